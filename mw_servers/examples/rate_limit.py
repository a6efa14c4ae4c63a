"""RateLimitMiddleware: at most ``rate`` model calls per second, with bursts of up to ``burst``.

A token bucket in the middleware process: a call takes a token, or waits until one has refilled.
The bucket is deliberately process state, not session state: it protects a shared upstream, so
it counts the calls of every session this server handles (N replicas allow N times the rate).
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

from mw_servers.sdk import MiddlewareBase, serve, subscribe


class RateLimitMiddleware(MiddlewareBase):
    subscriptions = {"on_model_call": subscribe()}  # chunks bypass it: only the call's start matters

    def __init__(self, rate: float = 1.0, burst: int = 1) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self.rate, self.burst = float(rate), int(burst)
        self.tokens = float(burst)
        self.updated = time.monotonic()
        self.lock = asyncio.Lock()  # waiters queue in order instead of racing for the next token

    async def acquire(self) -> float:
        """Take one token; returns the seconds waited."""
        waited = 0.0
        async with self.lock:
            while True:
                now = time.monotonic()
                self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
                self.updated = now
                if self.tokens >= 1:
                    self.tokens -= 1
                    return waited
                pause = (1 - self.tokens) / self.rate
                await asyncio.sleep(pause)
                waited += pause

    async def on_model_call(self, agent: Any, input_kwargs: dict[str, Any], next_handler: Any) -> Any:
        await self.acquire()
        return await next_handler()


if __name__ == "__main__":
    serve(RateLimitMiddleware(), sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50072")
