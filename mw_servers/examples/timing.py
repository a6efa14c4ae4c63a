"""TimingMiddleware: how long model calls and replies take.

Model calls are logged (time to first chunk, total); each reply gets a ``CustomEvent`` named
"timing" with its duration, emitted just before its ``ReplyEndEvent``. The subscriptions keep it
cheap when served remotely: ``on_reply`` intercepts only ``ReplyEndEvent`` and ``on_model_call``
sees no chunks at all (only the call's start and end matter).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

# The event classes are exported by name from EVENT_CLASSES (agentmw/data/__init__.py), which mypy cannot follow.
from agentmw.sdk import (  # type: ignore[attr-defined]
    CustomEvent,
    MiddlewareBase,
    ModelCallKwargs,
    ReplyEndEvent,
    ReplyKwargs,
    serve,
    subscribe,
)

log = logging.getLogger("agentmw.examples.timing")


class TimingMiddleware(MiddlewareBase):
    subscriptions = {
        "on_reply": subscribe(intercept=[ReplyEndEvent]),
        "on_model_call": subscribe(),
    }

    async def on_reply(self, agent: Any, input_kwargs: ReplyKwargs, next_handler: Any) -> AsyncIterator[Any]:
        start = time.perf_counter()
        async for event in next_handler(**input_kwargs):
            if isinstance(event, ReplyEndEvent):
                seconds = round(time.perf_counter() - start, 6)
                yield CustomEvent(name="timing", value={"reply_id": event.reply_id, "reply_seconds": seconds})
            yield event

    async def on_model_call(self, agent: Any, input_kwargs: ModelCallKwargs, next_handler: Any) -> Any:
        model = input_kwargs["current_model"]
        model_id = getattr(model, "id", model)
        start = time.perf_counter()
        stream = await next_handler()  # returns at the first chunk
        first = time.perf_counter() - start
        return self._timed(stream, agent.name, model_id, start, first)

    async def _timed(self, stream: Any, agent_name: str, model_id: str, start: float, first: float) -> AsyncIterator:
        try:
            async for chunk in stream:
                yield chunk
        finally:
            total = time.perf_counter() - start
            log.info("[timing] %s -> %s: first chunk %.3fs, total %.3fs", agent_name, model_id, first, total)


if __name__ == "__main__":
    serve(TimingMiddleware(), sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50071")
