"""A middleware that holds the reply between two streamed items: its on_reply, on the text delta
"world", first emits ``CustomEvent("paused")`` (the client's cue), then waits before passing the
delta on. Meanwhile the reasoning is suspended at that delta, not awaiting the model: an interrupt
arriving then finds no core work in flight (tests/test_models_wire.py). Served by the SDK launcher:
``python -m agentmw.sdk tests.pause_mw:PauseAtWorld``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from agentmw.data import CustomEvent, TextBlockDeltaEvent
from agentmw.middleware import MiddlewareBase, subscribe

PAUSE = 2.0  # seconds


class PauseAtWorld(MiddlewareBase):
    subscriptions = {"on_reply": subscribe(intercept=[TextBlockDeltaEvent])}

    async def on_reply(self, agent: Any, input_kwargs: dict[str, Any], next_handler: Any) -> AsyncIterator[Any]:
        async for event in next_handler():
            if isinstance(event, TextBlockDeltaEvent) and event.delta == "world":
                yield CustomEvent(name="paused", value={}, reply_id=event.reply_id)
                await asyncio.sleep(PAUSE)
            yield event
