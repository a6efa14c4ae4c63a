"""Middleware classes the benchmark serves in separate processes.

Run one with ``python -m agentmw.sdk bench.middlewares:ClassName --address 127.0.0.1:0``.
Every class is a pure pass-through (it changes nothing) and counts, in its own process, how many
times each hook was invoked (one invocation = one RPC stream) and how many items it saw. The
counters are read through the ToolSource service (tool ``bench_stats``), so the benchmark can
confirm from the server side that a hook was never called.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from agentmw.sdk import (
    ChatResponse,
    MiddlewareBase,
    Mode,
    ModelCallEndEvent,
    ModelCallStartEvent,
    ReplyEndEvent,
    ReplyStartEvent,
    Subscription,
    Tool,
    ToolResponse,
    subscribe,
    tool,
)
from agentmw.subscriptions import CHAT_FINAL

STATS_TOOL = "bench_stats"

NextHandler = Any


class Counted(MiddlewareBase):
    """Counts hook invocations and items per hook; serves them as the ``bench_stats`` tool."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.items: Counter[str] = Counter()

        @tool(name=STATS_TOOL, description="Hook invocation and item counters of this process.")
        def bench_stats(reset: bool = False) -> str:
            text = json.dumps({"calls": dict(self.calls), "items": dict(self.items)})
            if reset:
                self.calls.clear()
                self.items.clear()
            return text

        self._stats_tool: Tool = bench_stats

    async def list_tools(self) -> list[Any]:
        return [self._stats_tool]

    async def _pass_stream(self, hook: str, next_handler: NextHandler) -> AsyncIterator[Any]:
        self.calls[hook] += 1
        async for item in next_handler():
            self.items[hook] += 1
            yield item

    async def _pass_value(self, hook: str, next_handler: NextHandler) -> Any:
        self.calls[hook] += 1
        return await next_handler()


class PassThroughCall(Counted):
    """The two value hooks, each Begin -> call_next -> inner_done -> finish."""

    async def on_check_permission(self, agent: Any, input_kwargs: dict[str, Any], next_handler: NextHandler) -> Any:
        return await self._pass_value("on_check_permission", next_handler)

    async def on_compress_context(self, agent: Any, input_kwargs: dict[str, Any], next_handler: NextHandler) -> None:
        await self._pass_value("on_compress_context", next_handler)


class PassThroughCallEager(PassThroughCall):
    """The same, declared eager_next: Begin -> inner_done -> finish, one round trip."""

    subscriptions: dict[str, Subscription] = {
        "on_check_permission": subscribe(eager_next=True),
        "on_compress_context": subscribe(eager_next=True),
    }


class PassThroughCallDone(PassThroughCall):
    """The same, declared done_with_inner: Begin -> call_next -> inner_done, one round trip (the
    host does not wait for the finish)."""

    subscriptions: dict[str, Subscription] = {
        "on_check_permission": subscribe(done_with_inner=True),
        "on_compress_context": subscribe(done_with_inner=True),
    }


class InterceptAll(Counted):
    """on_reply and on_reasoning, intercepting every item (lock-step, one round trip per item)."""

    subscriptions = {
        "on_reply": subscribe(default=Mode.INTERCEPT),
        "on_reasoning": subscribe(default=Mode.INTERCEPT),
    }

    async def on_reply(self, agent: Any, input_kwargs: dict[str, Any], next_handler: NextHandler) -> AsyncIterator[Any]:
        async for item in self._pass_stream("on_reply", next_handler):
            yield item

    async def on_reasoning(
        self, agent: Any, input_kwargs: dict[str, Any], next_handler: NextHandler
    ) -> AsyncIterator[Any]:
        async for item in self._pass_stream("on_reasoning", next_handler):
            yield item


class InterceptAllRunAhead(InterceptAll):
    """InterceptAll declaring ``run_ahead``: the SDK does not suspend at each yield (one round trip
    per item instead of two; its code after a yield may run before the consumer asks for more)."""

    subscriptions = {
        "on_reply": subscribe(default=Mode.INTERCEPT, run_ahead=True),
        "on_reasoning": subscribe(default=Mode.INTERCEPT, run_ahead=True),
    }


class ReplyEndOnly(Counted):
    """on_reply subscribed to nothing but ReplyEndEvent: every other item bypasses it."""

    subscriptions = {"on_reply": subscribe(intercept=[ReplyEndEvent])}

    async def on_reply(self, agent: Any, input_kwargs: dict[str, Any], next_handler: NextHandler) -> AsyncIterator[Any]:
        async for item in self._pass_stream("on_reply", next_handler):
            yield item


class Realistic(Counted):
    """Four hooks with the subscriptions a Budget / Tracing style middleware would declare:
    hold ReplyEndEvent, watch the reply and model-call boundaries, the final model response and
    the tool results (as a detached watcher); every delta bypasses."""

    subscriptions: dict[str, Subscription] = {
        # A pass-through calls next first thing (eager_next); pure watchers are detached.
        "on_reply": subscribe(intercept=[ReplyEndEvent], observe=[ReplyStartEvent], eager_next=True),
        "on_reasoning": subscribe(observe=[ModelCallStartEvent, ModelCallEndEvent], detached=True),
        "on_model_call": subscribe(observe=[CHAT_FINAL], detached=True),
        "on_acting": subscribe(observe=[ToolResponse], detached=True),
    }

    async def on_reply(self, agent: Any, input_kwargs: dict[str, Any], next_handler: NextHandler) -> AsyncIterator[Any]:
        async for item in self._pass_stream("on_reply", next_handler):
            yield item

    async def on_reasoning(
        self, agent: Any, input_kwargs: dict[str, Any], next_handler: NextHandler
    ) -> AsyncIterator[Any]:
        async for item in self._pass_stream("on_reasoning", next_handler):
            yield item

    async def on_model_call(self, agent: Any, input_kwargs: dict[str, Any], next_handler: NextHandler) -> Any:
        return await self._pass_value("on_model_call", next_handler)

    async def on_acting(
        self, agent: Any, input_kwargs: dict[str, Any], next_handler: NextHandler
    ) -> AsyncIterator[Any]:
        async for item in self._pass_stream("on_acting", next_handler):
            yield item


class WatcherFloor(MiddlewareBase):
    """In-process, the least a watcher of the tracing server's three hooks can cost: one generator
    per streamed item on on_reply, on_model_call's stream and on_acting, and no other work (the
    in-process TracingMiddleware wraps the same three, so does the host's flat detached path)."""

    async def on_reply(self, agent: Any, input_kwargs: dict[str, Any], next_handler: NextHandler) -> AsyncIterator[Any]:
        async for item in next_handler():
            yield item

    async def on_model_call(self, agent: Any, input_kwargs: dict[str, Any], next_handler: NextHandler) -> Any:
        result = await next_handler()
        return result if isinstance(result, ChatResponse) else _passed(result)

    async def on_acting(
        self, agent: Any, input_kwargs: dict[str, Any], next_handler: NextHandler
    ) -> AsyncIterator[Any]:
        async for item in next_handler():
            yield item


async def _passed(stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for item in stream:
        yield item


__all__ = [
    "STATS_TOOL",
    "Counted",
    "InterceptAll",
    "InterceptAllRunAhead",
    "PassThroughCall",
    "PassThroughCallDone",
    "PassThroughCallEager",
    "Realistic",
    "ReplyEndOnly",
    "WatcherFloor",
]
