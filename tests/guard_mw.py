"""Middleware for tests/test_guards.py and the observe test: each makes one host guard visible
from outside (served by ``python -m agentmw.sdk tests.guard_mw:Class``)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from agentmw.data import ReplyStartEvent, TextBlockDeltaEvent
from agentmw.middleware import MiddlewareBase, subscribe


class Keyed(MiddlewareBase):
    """Reports the key it is given and counts the replies it saw in that slot."""

    subscriptions = {"on_reply": subscribe(intercept=[ReplyStartEvent])}

    def __init__(self, key: str = "keyed") -> None:
        self.key = key

    async def get_middleware_key(self) -> str:
        return self.key

    async def on_reply(self, agent: Any, input_kwargs: dict[str, Any], next_handler: Any) -> Any:
        async for item in next_handler():
            if isinstance(item, ReplyStartEvent):
                slot = agent.state.middle_context.get(self.key) or {"replies": 0}
                agent.state.middle_context[self.key] = {"replies": slot["replies"] + 1}
            yield item


class SlotPrompt(MiddlewareBase):
    """Writes its slot in on_reasoning (after the compression check built the prompt once) and
    puts the slot into the system prompt: the second prompt of the iteration must show the new slot."""

    async def on_reasoning(self, agent: Any, input_kwargs: dict[str, Any], next_handler: Any) -> Any:
        agent.state.middle_context["SlotPrompt"] = f"reasoning {agent.state.cur_iter}"
        async for item in next_handler():
            yield item

    async def on_system_prompt(self, agent: Any, prompt: str) -> str:
        return f"{prompt} [slot: {agent.state.middle_context.get('SlotPrompt')}]"


class ContextReader(MiddlewareBase):
    """Subscribed with wants_context: copies the texts of the context it is sent into its slot."""

    subscriptions = {"on_reply": subscribe(intercept=[ReplyStartEvent], wants_context=True)}

    async def on_reply(self, agent: Any, input_kwargs: dict[str, Any], next_handler: Any) -> Any:
        async for item in next_handler():
            if isinstance(item, ReplyStartEvent):
                agent.state.middle_context["ContextReader"] = [m.text for m in agent.state.context]
            yield item


class GatedObserver(MiddlewareBase):
    """Observes text deltas and, at the first one, does not go on until the file ``gate`` exists
    (the test creates it once its client has every delta; bounded by ``wait`` seconds). Its slot
    says whether the gate opened: it can only open if the host forwards observed items without
    waiting for the middleware."""

    subscriptions = {"on_reply": subscribe(observe=[TextBlockDeltaEvent])}

    def __init__(self, gate: str, wait: float = 5.0) -> None:
        self.gate, self.wait = gate, wait

    async def on_reply(self, agent: Any, input_kwargs: dict[str, Any], next_handler: Any) -> Any:
        opened, seen = None, 0
        async for item in next_handler():
            seen += 1
            if opened is None:
                opened = await self._gate_opens()
            yield item
        agent.state.middle_context["GatedObserver"] = {"gate_opened": opened, "seen": seen}

    async def _gate_opens(self) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait
        while loop.time() < deadline:
            if os.path.exists(self.gate):
                return True
            await asyncio.sleep(0.02)
        return False
