"""A middleware for tests/test_security.py: its on_reply asks for the context (wants_context) and
writes into its slot how many context messages it was sent, so a test sees whether it got them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from agentmw.data import ReplyStartEvent
from agentmw.middleware import MiddlewareBase, subscribe


class ContextReader(MiddlewareBase):
    subscriptions = {"on_reply": subscribe(intercept=[ReplyStartEvent], wants_context=True)}

    async def get_middleware_key(self) -> str:
        return "context_reader"

    async def on_reply(self, agent: Any, input_kwargs: dict[str, Any], next_handler: Any) -> AsyncIterator[Any]:
        async for event in next_handler():
            if isinstance(event, ReplyStartEvent):
                agent.state.middle_context["context_reader"] = {"messages_seen": len(agent.state.context)}
            yield event


class ToolCallStamper(MiddlewareBase):
    """on_acting edits the tool call it is given without changing its tool or input (a timestamp),
    and calls next with it: no permission needed for that (the call runs as the model asked)."""

    async def on_acting(self, agent: Any, input_kwargs: dict[str, Any], next_handler: Any) -> AsyncIterator[Any]:
        input_kwargs["tool_call"].finished_at = "stamped by a middleware"
        async for item in next_handler():
            yield item
