"""Copies to a detached hook (a watcher) stay off the reply's busy stretch: the invocations that end
while the middleware's on_reply is still open are held and go out when the reply is over."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from agent_host.agent import Agent
from agent_host.models import OfflineRuleModel
from agent_host.models.registry import ModelRegistry
from agent_host.models.retry import RetryPolicy
from agent_host.remote import RemoteMiddleware
from agent_host.remote.detached import HOLD
from agentmw.data import ChatResponse, Msg, ReplyEndEvent, ReplyFinishedReason, ToolCallBlock, ToolResponse, UserMsg
from agentmw.errors import ErrorType, ModelError
from agentmw.middleware import MiddlewareBase, subscribe
from agentmw.tools import Toolkit, add_middleware_tools, tool
from clients.launch import middleware_server
from tests.conformance_mw import ReturnsPlainIterators


@tool(description="Waits on I/O for a moment (the host's loop runs other tasks meanwhile).")
async def fetch() -> str:
    await asyncio.sleep(0.02)
    return "fetched"


class StampingWatcher(MiddlewareBase):
    """A tracer's shape (detached on_reply, on_model_call, on_acting); notes the wall-clock time at
    which each invocation reached it, read back with its ``stamps`` tool."""

    subscriptions = {
        "on_reply": subscribe(observe=[ReplyEndEvent], detached=True),
        "on_model_call": subscribe(observe=["chat_response_final"], detached=True),
        "on_acting": subscribe(observe=[ToolResponse], detached=True),
    }

    def __init__(self) -> None:
        self.stamps: list[tuple[str, float]] = []

    async def on_reply(self, agent, input_kwargs, next_handler):
        self.stamps.append(("on_reply", time.time()))
        async for item in next_handler():
            yield item

    async def on_model_call(self, agent, input_kwargs, next_handler):
        self.stamps.append(("on_model_call", time.time()))
        return await next_handler()

    async def on_acting(self, agent, input_kwargs, next_handler):
        self.stamps.append(("on_acting", time.time()))
        async for item in next_handler():
            yield item

    async def list_tools(self):
        @tool(description="When each invocation arrived.", is_read_only=True)
        def stamps() -> str:
            return json.dumps(self.stamps)

        return [stamps]


async def test_copies_go_out_after_the_reply() -> None:
    proc = middleware_server("tests.test_detached:StampingWatcher").start()
    try:
        remote = await RemoteMiddleware(proc.address).connect()
        toolkit = Toolkit([fetch])
        await add_middleware_tools(toolkit, remote)
        script = [{"tool_calls": [{"name": "fetch", "input": {}}]} for _ in range(3)]
        script.append({"text": " ".join(f"w{i}" for i in range(500))})
        agent = Agent(model=OfflineRuleModel(script=script), toolkit=toolkit, middlewares=[remote])
        final_at = 0.0
        async with asyncio.timeout(30):
            async for item in agent.reply_stream(UserMsg("hi")):
                if isinstance(item, Msg):
                    final_at = time.time()  # the reply's last item: its on_reply is still open
            stamps: list = []
            while len(stamps) < 8:  # on_reply, 4 model calls, 3 tool calls
                await asyncio.sleep(0.05)
                call = ToolCallBlock(id="s", name="StampingWatcher__stamps", input="{}")
                response = [r async for r in toolkit.call_tool(call)][-1]
                stamps = json.loads(response.content[0].text)
        early = [hook for hook, at in stamps if at < final_at]
        assert not early, f"copies of {early} reached the watcher while the reply was still going"
        await remote.close()
    finally:
        proc.stop()


class DepthModel(OfflineRuleModel):
    """The offline model, noting how many frames deep its stream runs at each chunk."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.depths: list[int] = []

    async def _stream(self, turn: dict[str, Any], input_tokens: int) -> AsyncIterator[ChatResponse]:
        async for chunk in super()._stream(turn, input_tokens):
            depth, frame = 0, sys._getframe()
            while frame is not None:
                depth, frame = depth + 1, frame.f_back
            self.depths.append(depth)
            yield chunk


async def test_a_watcher_costs_each_streamed_item_one_frame_per_hook() -> None:
    """A detached hook runs flat: between the agent and the inner pipeline it is one generator,
    whatever the hook (the generic machinery was four or five, and a 1,000-delta reply with a
    tracer attached ended ~10% later for it). Here on_reply and on_model_call wrap each chunk."""
    proc = middleware_server("tests.test_detached:StampingWatcher").start()
    try:
        remote = await RemoteMiddleware(proc.address).connect()
        depths = []
        for middlewares in ([], [remote]):
            model = DepthModel(script=[{"text": "a b c d e f"}])
            agent = Agent(model=model, toolkit=Toolkit([fetch]), middlewares=middlewares)
            async with asyncio.timeout(30):
                async for _ in agent.reply_stream(UserMsg("hi")):
                    pass
            depths.append(model.depths[-1])  # a chunk read while the reply streams
        assert depths[1] - depths[0] <= 2, f"frames per chunk: {depths[0]} without the watcher, {depths[1]} with it"
        await remote.close()
    finally:
        proc.stop()


async def test_a_model_call_that_fails_at_the_call_is_retried_under_a_watcher() -> None:
    """On the flat path too, a model error raises at the call (where retries happen), and the
    watcher gets the failed invocation as well as the retried one."""
    proc = middleware_server("tests.test_detached:StampingWatcher").start()
    try:
        remote = await RemoteMiddleware(proc.address).connect()
        toolkit = Toolkit([fetch])
        await add_middleware_tools(toolkit, remote)
        script = [{"error": {"type": "upstream", "message": "try again"}}, {"text": "second time lucky"}]
        models = ModelRegistry()
        models.add(OfflineRuleModel(script=script), max_retries=1, retry=RetryPolicy(initial_delay=0.01))
        agent = Agent(models=models, toolkit=toolkit, middlewares=[remote])
        async with asyncio.timeout(30):
            items = [item async for item in agent.reply_stream(UserMsg("hi"))]
            assert isinstance(items[-1], Msg) and items[-1].text == "second time lucky"
            stamps: list = []
            while len(stamps) < 3:  # on_reply and both model calls
                await asyncio.sleep(0.05)
                call = ToolCallBlock(id="s", name="StampingWatcher__stamps", input="{}")
                stamps = json.loads([r async for r in toolkit.call_tool(call)][-1].content[0].text)
        assert sorted(hook for hook, _ in stamps) == ["on_model_call", "on_model_call", "on_reply"]
        await remote.close()
    finally:
        proc.stop()


class FailsBeforeItsFirstChunk(OfflineRuleModel):
    """Its first call answers with a stream that fails before its first chunk (as a layer's own
    generator may): a failure while the stream is read, which is not retried."""

    async def _open(self, messages, tools, tool_choice, parameters=None):
        stream = await super()._open(messages, tools, tool_choice, parameters)
        if self.calls > 1:
            return stream

        async def failing():
            raise ModelError("lost before the first chunk", error_type=ErrorType.UPSTREAM, retryable=True)
            yield

        return failing()


async def test_a_watcher_does_not_change_which_model_errors_are_retried() -> None:
    """A detached on_model_call is transparent: the call returns when the inner call does, so an
    error of the stream's first read stays an error of the stream, as with no watcher (not
    retried: the reply ends in error after one call). Before, the flat path read the first chunk at
    the call, so the same error was retried, and the reply succeeded, only with a watcher attached."""
    proc = middleware_server("tests.test_detached:StampingWatcher").start()
    try:
        remote = await RemoteMiddleware(proc.address).connect()
        outcomes = []
        for middlewares in ([], [remote]):
            model = FailsBeforeItsFirstChunk(script=[{"text": "second time lucky"}, {"text": "unused"}])
            models = ModelRegistry()
            models.add(model, max_retries=1, retry=RetryPolicy(initial_delay=0.01))
            agent = Agent(models=models, middlewares=middlewares)
            async with asyncio.timeout(30):
                items = [item async for item in agent.reply_stream(UserMsg("hi"))]
            (end,) = [i for i in items if isinstance(i, ReplyEndEvent)]
            outcomes.append((end.finished_reason, model.calls))
        assert outcomes[0] == (ReplyFinishedReason.ERROR, 1), outcomes
        assert outcomes[1] == outcomes[0], f"without a watcher {outcomes[0]}, with it {outcomes[1]}"
        await remote.close()
    finally:
        proc.stop()


async def test_a_watcher_over_a_layer_that_returns_a_plain_iterator() -> None:
    """A layer's hook may return any async iterator. A watcher above one closes it as it can: the
    reply completes (before, every such reply failed with AttributeError: no aclose)."""
    proc = middleware_server("tests.conformance_mw:DetachedWatcher").start()
    try:
        remote = await RemoteMiddleware(proc.address).connect()
        agent = Agent(model=OfflineRuleModel(), middlewares=[remote, ReturnsPlainIterators()])
        async with asyncio.timeout(30):
            items = [item async for item in agent.reply_stream(UserMsg("hi"))]
        (end,) = [i for i in items if isinstance(i, ReplyEndEvent)]
        assert end.finished_reason == ReplyFinishedReason.COMPLETED, end.error
        await remote.close()
    finally:
        proc.stop()


async def test_a_watcher_over_a_layer_that_returns_a_response_sees_it_returned() -> None:
    """The layer inside the watcher returns one ChatResponse, not a stream: the watcher's
    next_handler() returns it, as in-process (not a stream of one chunk), and the reply is that
    of the layer alone."""
    from tests.conformance_mw import DetachedWatcher, ReturnsResponse

    proc = middleware_server("tests.conformance_mw:DetachedWatcher").start()
    try:
        remote = await RemoteMiddleware(proc.address).connect()
        replies = []
        for watcher in (DetachedWatcher(), remote):
            toolkit = Toolkit([])
            await add_middleware_tools(toolkit, watcher)
            agent = Agent(model=OfflineRuleModel(), toolkit=toolkit, middlewares=[watcher, ReturnsResponse()])
            async with asyncio.timeout(30):
                items = [item async for item in agent.reply_stream(UserMsg("hi"))]
                call = ToolCallBlock(
                    id="s",
                    name="DetachedWatcher__watch_stats",
                    input=json.dumps({"session_id": agent.state.session_id}),
                )
                stats: dict[str, int] = {}
                while not any(k.startswith("on_model_call") for k in stats):  # copies arrive after the reply
                    stats = json.loads([r async for r in toolkit.call_tool(call)][-1].content[0].text)
                    await asyncio.sleep(0.02)
            replies.append(([type(i).__name__ for i in items], items[-1].text))
            assert {k: v for k, v in stats.items() if k.startswith("on_model_call")} == {
                "on_model_call:returned:ChatResponse": 1
            }, watcher
        assert replies[0][1] == "canned reply" and "TextBlockDeltaEvent" in replies[0][0]
        assert replies[1] == replies[0]
        await remote.close()
    finally:
        proc.stop()


async def test_a_watcher_of_every_item_gets_a_long_reply_in_full() -> None:
    """Past a batch's worth of copies an invocation sends by itself as they come (not held)."""
    proc = middleware_server("tests.conformance_mw:DetachedWatcher").start()
    try:
        remote = await RemoteMiddleware(proc.address).connect()
        toolkit = Toolkit([fetch])
        await add_middleware_tools(toolkit, remote)
        words = " ".join(f"w{i}" for i in range(1000))  # ~1,000 copies: batches of 64 go out while it streams
        agent = Agent(model=OfflineRuleModel(script=[{"text": words}]), toolkit=toolkit, middlewares=[remote])
        async with asyncio.timeout(30):
            events = [item async for item in agent.reply_stream(UserMsg("hi"))]
            seen = 0
            while seen < len(events):
                await asyncio.sleep(0.05)
                args = json.dumps({"session_id": agent.state.session_id})
                call = ToolCallBlock(id="s", name="DetachedWatcher__watch_stats", input=args)
                stats = json.loads([r async for r in toolkit.call_tool(call)][-1].content[0].text)
                seen = sum(n for key, n in stats.items() if key.startswith("on_reply:"))
        assert seen == len(events) > 1000
        await remote.close()
    finally:
        proc.stop()


async def test_a_watcher_that_stops_reading_costs_bounded_memory(caplog: Any) -> None:
    """A watcher of every item that stops reading (SIGSTOP) while a long reply streams: once its
    stream takes no more, at most MAX_QUEUED batches of copies wait for it and the rest are dropped,
    saying so; the reply is not held up. (Without the bound every copy of the reply is kept.)"""
    proc = middleware_server("tests.conformance_mw:DetachedWatcher").start()
    try:
        remote = await RemoteMiddleware(proc.address).connect()
        words = " ".join(f"w{i}" for i in range(40_000))  # far more than the stream's window takes
        agent = Agent(model=OfflineRuleModel(script=[{"text": words}]), toolkit=Toolkit([fetch]), middlewares=[remote])
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            with caplog.at_level(logging.WARNING, logger="agentmw.remote"):
                async with asyncio.timeout(30):
                    events = [item async for item in agent.reply_stream(UserMsg("hi"))]
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert isinstance(events[-1], Msg) and len(events) > 40_000
        assert any("falls behind in on_reply: dropping copies" in r.getMessage() for r in caplog.records)
        await remote.close()
    finally:
        proc.stop()


async def test_copies_held_when_the_middleware_is_closed_are_dropped_quietly() -> None:
    """Closing the client while copies wait (another invocation still open) drops them: no error
    surfaces from the background task that would have sent them."""
    proc = middleware_server("tests.test_detached:StampingWatcher").start()
    try:
        remote = await RemoteMiddleware(proc.address).connect()
        agent = Agent(model=OfflineRuleModel(script=[{"text": "hi"}]), toolkit=Toolkit([fetch]), middlewares=[remote])
        errors: list = []  # what the loop reports, e.g. "Task exception was never retrieved"
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
        outer = remote.on_reply(agent, {"inputs": None, "structured_schema": None}, _never_ending)
        first = asyncio.ensure_future(anext(outer))  # an on_reply that stays open
        await asyncio.sleep(0.05)
        inner = remote.on_acting(agent, {"tool_call": ToolCallBlock(id="c", name="fetch", input="{}")}, _one_response)
        assert [type(i).__name__ async for i in inner] == ["ToolResponse"]  # ended: its copies are held
        await remote.close()
        await asyncio.sleep(HOLD + 0.2)  # the hold ran out after the close
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await outer.aclose()
        gc.collect()  # a task's unretrieved exception is reported when the task is collected
        await asyncio.sleep(0.05)
        assert not [c for c in errors if "exception" in c], errors
    finally:
        asyncio.get_running_loop().set_exception_handler(None)
        proc.stop()


async def _never_ending(**_: object):
    await asyncio.sleep(3600)
    yield None


async def _one_response(**_: object):
    yield ToolResponse(id="c", content=[])
