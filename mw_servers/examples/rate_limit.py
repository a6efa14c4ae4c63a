"""RateLimitMiddleware: at most ``rate`` model calls per second, with bursts of up to ``burst``.

A token bucket in the middleware process: a call takes a token, or waits until one has refilled.
The bucket is deliberately process state, not session state: it protects a shared upstream, so
it counts the calls of every session this server handles (N replicas allow N times the rate).

What it did to a session is kept in that session's slot (``agent.state.middle_context[key]``):
``{"calls": n, "delayed": n, "waited_seconds": s}``, the model calls it let through, how many of
them had to wait for a token, and the total time they waited.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

from agentmw.sdk import MiddlewareBase, ModelCallKwargs, serve, subscribe


class RateLimitMiddleware(MiddlewareBase):
    subscriptions = {"on_model_call": subscribe()}  # chunks bypass it: only the call's start matters

    def __init__(self, rate: float = 1.0, burst: int = 1, key: str = "RateLimitMiddleware") -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self.rate, self.burst = float(rate), int(burst)
        self.key = key
        self.tokens = float(burst)
        self.updated = time.monotonic()
        self.lock = asyncio.Lock()  # waiters queue in order instead of racing for the next token

    async def acquire(self) -> float:
        """Take one token; returns the seconds waited for it (0.0 when one was there at once)."""
        start = time.monotonic()
        waited = self.lock.locked()  # queued behind a caller that waits for a token
        async with self.lock:
            while True:
                now = time.monotonic()
                self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
                self.updated = now
                if self.tokens >= 1:
                    self.tokens -= 1
                    return now - start if waited else 0.0
                await asyncio.sleep((1 - self.tokens) / self.rate)
                waited = True

    async def get_middleware_key(self) -> str:
        return self.key

    async def on_model_call(self, agent: Any, input_kwargs: ModelCallKwargs, next_handler: Any) -> Any:
        waited = await self.acquire()
        stats = agent.state.middle_context.get(self.key) or {}
        agent.state.middle_context[self.key] = {
            "calls": stats.get("calls", 0) + 1,
            "delayed": stats.get("delayed", 0) + (waited > 0),
            "waited_seconds": round(stats.get("waited_seconds", 0.0) + waited, 3),
        }
        return await next_handler()


if __name__ == "__main__":
    serve(RateLimitMiddleware(), sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50072")
