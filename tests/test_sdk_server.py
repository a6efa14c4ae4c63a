"""serve(): Describe, health, reflection, and a graceful stop on SIGTERM, on a real process; what a
served invocation leaves behind, in this one."""

from __future__ import annotations

import asyncio
import gc
import logging
import re
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from agent_host.agent import Agent
from agent_host.models import OfflineRuleModel
from agent_host.remote import RemoteMiddleware
from agent_host.remote.client import CHANNEL_OPTIONS
from agentmw.chain import Chain
from agentmw.codec import codec
from agentmw.data import (
    CustomEvent,
    PermissionBehavior,
    PermissionDecision,
    TextBlock,
    TextBlockDeltaEvent,
    ToolCallBlock,
    ToolResultTextDeltaEvent,
    UserMsg,
)
from agentmw.hooks import HOOKS
from agentmw.middleware import MiddlewareBase
from agentmw.sdk.server import _Streams, _ToolSource, start
from agentmw.sdk.session import HookSession
from agentmw.sdk.view import AgentView, ContextEditError
from agentmw.subscriptions import Mode, subscribe
from agentmw.tools import Toolkit, add_middleware_tools
from agentmw.transport import SERVER_OPTIONS
from agentmw.v1 import events_pb2, hooks_pb2, hooks_pb2_grpc
from agentmw.wire import encode_kwargs
from clients.launch import ServerProcess, middleware_server
from tests.conformance_mw import RaisesNonException

from .host_util import run_cli


async def test_describe_health_reflection_and_sigterm() -> None:
    server = middleware_server("tests.conformance_mw:Budget", token_budget=3)
    proc = ServerProcess([*server.argv, "--reflection"], name="Budget").start()  # reflection is opt-in
    try:
        async with grpc.aio.insecure_channel(proc.address) as channel:
            desc = await hooks_pb2_grpc.DescribeStub(channel).Describe(hooks_pb2.DescribeRequest())
            assert desc.key == "Budget" and desc.protocol_version == "v1"
            hooks = {h.hook: h for h in desc.hooks}
            assert set(hooks) == {hooks_pb2.HOOK_ON_REPLY, hooks_pb2.HOOK_ON_REASONING}
            reply = hooks[hooks_pb2.HOOK_ON_REPLY]
            assert reply.default_mode == hooks_pb2.SUBSCRIPTION_MODE_BYPASS
            assert {s.item_type for s in reply.subscriptions} == {
                events_pb2.ITEM_TYPE_REPLY_START,
                events_pb2.ITEM_TYPE_MODEL_CALL_END,
            }
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "agentmw.v1.OnReply", "agentmw.v1.Describe"):
                answer = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
            stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo()
            await stream.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            listed = await stream.read()
            await stream.done_writing()
            names = {s.name for s in listed.list_services_response.service}
            assert {"agentmw.v1.OnReply", "agentmw.v1.OnReasoning", "agentmw.v1.Describe"} <= names
            assert "agentmw.v1.OnActing" not in names  # unimplemented hooks are not even served
        assert proc.stop() == 0  # SIGTERM: a graceful stop (a SIGKILL after 10 s would give -9)
    finally:
        proc.stop()


def test_the_host_pings_no_more_often_than_default_grpc_servers_allow() -> None:
    """A default gRPC server (C-core, Go, Java) counts a ping less than 5 minutes after the previous
    one, with no data between, as a strike and sends GOAWAY too_many_pings after two. Pinging every
    30 s, the host lost its quiet connections to such servers after ~90 s, and with them any
    invocation in flight (an on_reply waiting out a long tool call): agentmw/transport.py. Waiting
    that long has no place here, so this guards the numbers; our own servers accept what it sends."""
    host = dict(CHANNEL_OPTIONS)["grpc.keepalive_time_ms"]
    assert host > 5 * 60 * 1000
    ours = dict(SERVER_OPTIONS)
    assert ours["grpc.http2.min_ping_interval_without_data_ms"] <= host and ours["grpc.keepalive_permit_without_calls"]


class _KeepsItsView(MiddlewareBase):
    """A value hook and a stream hook that pass through; the value hook keeps the ``agent`` view it
    was given, as code that starts a task of its own might."""

    subscriptions = {"on_reply": subscribe(default=Mode.INTERCEPT)}

    def __init__(self) -> None:
        self.kept: Any = None

    async def on_check_permission(self, agent: Any, input_kwargs: Any, next_handler: Any) -> Any:
        self.kept = agent
        return await next_handler()

    async def on_reply(self, agent: Any, input_kwargs: Any, next_handler: Any) -> Any:
        async for item in next_handler():
            yield item


async def test_a_served_invocation_leaves_nothing_for_the_garbage_collector_and_its_view_ends_with_it() -> None:
    """Served in this process, so that its heap can be looked at: after a value hook's and a stream
    hook's invocations, no session is left in a reference cycle (the view pointed back at its
    session: each invocation's objects waited for the collector, which cost a value hook ~15% of its
    SDK time). A view kept past its invocation then says so on a change, instead of queueing it for
    a host that will never read it."""
    mw = _KeepsItsView()
    server, port = await start(mw, "127.0.0.1:0")
    remote = await RemoteMiddleware(f"127.0.0.1:{port}").connect()
    agent = Agent(model=OfflineRuleModel(), middlewares=[])

    async def decide(tool_call: Any, tool: Any, tool_input: Any) -> PermissionDecision:
        return PermissionDecision(behavior=PermissionBehavior.ALLOW)

    async def deltas(inputs: Any = None, structured_schema: Any = None) -> Any:
        for word in ("a", "b", "c"):
            yield TextBlockDeltaEvent(reply_id="r", block_id="b", delta=word)

    call = ToolCallBlock(id="call_1", name="add", input="{}")
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            decision = await Chain("on_check_permission", [remote], decide)(
                agent, tool_call=call, tool=None, tool_input={}
            )
            assert decision.behavior == PermissionBehavior.ALLOW
            out = [
                item.delta
                async for item in Chain("on_reply", [remote], deltas)(agent, inputs=None, structured_schema=None)
            ]
            assert out == ["a", "b", "c"]
        await asyncio.sleep(0.1)  # the server's handlers are done with their sessions
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        left = [type(obj).__name__ for obj in gc.garbage if isinstance(obj, (HookSession, AgentView))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        await remote.close()
        await server.stop(None)
    assert left == []
    with pytest.raises(RuntimeError, match="hook invocation has ended"):
        mw.kept.state.append_context("late", [TextBlock(text="too late")])


class _WaitsAfterYield(MiddlewareBase):
    """Declared run_ahead, it waits after its first yield for something that happens only once the
    consumer has that item: its emit must go out while it waits, not with its next pull."""

    subscriptions = {"on_reply": subscribe(default=Mode.INTERCEPT, run_ahead=True)}

    def __init__(self) -> None:
        self.consumer_has_it = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def on_reply(self, agent: Any, input_kwargs: Any, next_handler: Any) -> Any:
        first = True
        async for item in next_handler():
            yield item
            if first:
                first = False
                try:
                    await asyncio.wait_for(self.consumer_has_it.wait(), 10)
                except asyncio.CancelledError:
                    self.cancelled.set()
                    raise


async def test_a_run_ahead_emit_goes_out_while_the_code_after_its_yield_waits_and_the_wait_ends_with_stream() -> None:
    """Served in this process, so that the middleware can wait on the consumer itself. The SDK
    sends a run_ahead emit with the pull for the next item when the code asks for it straight away,
    and at once when the code waits for anything else first; holding it for the pull, this reply
    would wait for itself (and fail after 10 s)."""
    mw = _WaitsAfterYield()
    server, port = await start(mw, "127.0.0.1:0")
    remote = await RemoteMiddleware(f"127.0.0.1:{port}").connect()
    agent = Agent(model=OfflineRuleModel(), middlewares=[])

    async def deltas(inputs: Any = None, structured_schema: Any = None) -> Any:
        for word in ("a", "b", "c"):
            yield TextBlockDeltaEvent(reply_id="r", block_id="b", delta=word)

    out = []
    chain = Chain("on_reply", [remote], deltas)
    try:
        async with asyncio.timeout(30):
            async for item in chain(agent, inputs=None, structured_schema=None):
                out.append(item.delta)
                mw.consumer_has_it.set()
            assert out == ["a", "b", "c"]
            # The consumer stops while the code waits: the host cancels the stream, and the wait
            # in the author's code is cancelled with it (as it would be in-process).
            mw.consumer_has_it.clear()
            async for _ in chain(agent, inputs=None, structured_schema=None):
                break
            await asyncio.wait_for(mw.cancelled.wait(), 10)
    finally:
        await remote.close()
        await server.stop(None)


class _DetachedEmitter(MiddlewareBase):
    """A watcher (detached) that tries to add an item: the host would never read it."""

    subscriptions = {"on_reply": subscribe(default=Mode.OBSERVE, detached=True)}

    async def on_reply(self, agent: Any, input_kwargs: Any, next_handler: Any) -> Any:
        async for item in next_handler():
            yield item
        yield TextBlockDeltaEvent(reply_id="r", block_id="b", delta="extra")


async def test_a_detached_hook_that_emits_is_told_it_can_only_watch(caplog: Any) -> None:
    """Served in this process, so that its log can be read. A watcher's emits and changes would be
    dropped by the host without a word (hooks.proto, HookDescription.detached): the SDK raises in
    the author's code instead, saying why, and the reply is as if the watcher were not there."""
    server, port = await start(_DetachedEmitter(), "127.0.0.1:0")
    remote = await RemoteMiddleware(f"127.0.0.1:{port}").connect()
    agent = Agent(model=OfflineRuleModel(), middlewares=[])

    async def deltas(inputs: Any = None, structured_schema: Any = None) -> Any:
        for word in ("a", "b", "c"):
            yield TextBlockDeltaEvent(reply_id="r", block_id="b", delta=word)

    try:
        with caplog.at_level(logging.ERROR, logger="agentmw.sdk"):
            chain = Chain("on_reply", [remote], deltas)
            out = [item.delta async for item in chain(agent, inputs=None, structured_schema=None)]
            assert out == ["a", "b", "c"]
            async with asyncio.timeout(10):  # its copies and the refusal come after the reply
                while not any("can only watch" in r.getMessage() + (r.exc_text or "") for r in caplog.records):
                    await asyncio.sleep(0.05)
        text = "\n".join(r.getMessage() + "\n" + (r.exc_text or "") for r in caplog.records)
        assert "on_reply is detached: it can only watch, not emit TextBlockDeltaEvent" in text
    finally:
        await remote.close()
        await server.stop(None)


class _CountsModelCalls(MiddlewareBase):
    """A pass-through on_model_call that counts its calls."""

    calls = 0

    async def on_model_call(self, agent: Any, input_kwargs: Any, next_handler: Any) -> Any:
        type(self).calls += 1
        return await next_handler()


async def test_a_served_middleware_takes_a_begin_as_large_as_the_host_sends() -> None:
    """A session's context past 4 MiB (two user messages of 2.5 MB: the host takes up to 4 MiB a
    message from a client) goes in every on_model_call Begin. The SDK's server takes messages up
    to 64 MiB, as the host sends them (hooks.proto). Before, it kept gRPC's 4 MiB and refused
    every later Begin of the session (RESOURCE_EXHAUSTED), blaming the middleware."""
    server, port = await start(_CountsModelCalls(), "127.0.0.1:0")
    remote = await RemoteMiddleware(f"127.0.0.1:{port}").connect()
    agent = Agent(model=OfflineRuleModel(), middlewares=[remote])
    try:
        for text in ("a" * 2_500_000, "b" * 2_500_000):
            final = await agent.reply(UserMsg(text))
            assert final.error is None, final.error
        assert _CountsModelCalls.calls == 2
    finally:
        await remote.close()
        await server.stop(None)


class NeedsLimit(MiddlewareBase):
    """A constructor argument to pass with --arg."""

    def __init__(self, limit: int) -> None:
        self.limit = limit


@pytest.mark.parametrize(
    ("target", "says"),
    [
        ("tests.test_sdk_server", "target 'tests.test_sdk_server' is not module:Class"),
        ("tests.no_such_module:X", "no module named 'tests.no_such_module' (is its directory on PYTHONPATH?)"),
        ("tests.test_sdk_server:Missing", "module 'tests.test_sdk_server' has no 'Missing'"),
        ("tests.test_sdk_server:Chain", "tests.test_sdk_server:Chain is not a MiddlewareBase subclass"),
        ("tests.test_sdk_server:NeedsLimit", "cannot construct tests.test_sdk_server:NeedsLimit: missing a required"),
    ],
)
def test_serving_a_wrong_target_is_one_line(target: str, says: str) -> None:
    """`python -m agentmw.sdk` with a target it cannot serve: exit 2 and one line saying why (it was
    a traceback ending in AttributeError or TypeError)."""
    done = run_cli("agentmw.sdk", target, "--address", "127.0.0.1:0", timeout=30)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"python -m agentmw.sdk: error: {says}"), done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_an_address_it_cannot_listen_on_is_one_line() -> None:
    """A port gRPC would wrap (99999 listened on 34463): a configuration error, exit 2, before
    anything starts, in every SDK server (the tracing server and the launcher only said it once
    gRPC refused, exit 1; budget and mem0 checked it themselves), and a usage error (exit 2) of the
    trace viewer. A port in use: exit 1. One line each."""
    target = "tests.host_util:RecorderMiddleware"
    wrapped = run_cli("agentmw.sdk", target, "--address", "127.0.0.1:99999", timeout=30)
    assert wrapped.returncode == 2, wrapped.stdout + wrapped.stderr
    assert wrapped.stderr.strip().splitlines()[-1] == (
        "agentmw middleware RecorderMiddleware: configuration error: address '127.0.0.1:99999' is not HOST:PORT "
        "(a port of 0-65535; 0: any free port)"
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        busy = run_cli("agentmw.sdk", target, "--address", address, timeout=30)
        host = run_cli("agent_host", "--listen", address, "--db", ":memory:", timeout=30)
        budget = run_cli("mw_servers.budget", "--address", address, "--token-budget", "5", timeout=30)
    # One line each, saying why: gRPC's C core logged its own "add_port.cc:83] Failed to add port
    # to server ..." line before it, and ours guessed "(address in use or not local)".
    assert (busy.returncode, busy.stderr.splitlines()) == (
        1,
        [f"agentmw middleware RecorderMiddleware: cannot listen on {address} (address already in use)"],
    ), busy.stderr
    assert (host.returncode, host.stderr.splitlines()) == (
        1,
        [f"agent-host: cannot start: listen: cannot listen on {address} (address already in use)"],
    ), host.stderr
    assert (budget.returncode, budget.stderr.splitlines()) == (
        1,
        [f"agentmw middleware ReplyBudget: cannot listen on {address} (address already in use)"],
    ), budget.stderr
    elsewhere = run_cli("agentmw.sdk", target, "--address", "192.0.2.1:50000", timeout=30)  # TEST-NET-1: not ours
    assert elsewhere.stderr.splitlines() == [
        "agentmw middleware RecorderMiddleware: cannot listen on 192.0.2.1:50000 (cannot assign requested address)"
    ], elsewhere.stderr
    assert "Traceback" not in wrapped.stderr + busy.stderr
    viewer = run_cli("clients.traces", "--listen", "127.0.0.1:99999", timeout=30)  # the trace viewer: the same check
    assert viewer.returncode == 2, viewer.stdout + viewer.stderr  # a usage error, as its other flags'
    said = viewer.stderr.splitlines()[-1]
    assert said.startswith("agentmw-traces: error: --listen: '127.0.0.1:99999' is not HOST:PORT"), said


class Keyed(MiddlewareBase):
    """Describes the key it is given (with --arg key=...)."""

    def __init__(self, key: Any) -> None:
        self.key = key

    async def get_middleware_key(self) -> Any:
        return self.key


@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [
        (["mw_servers.budget", "--token-budget", "1"], {"AGENTMW_LOOP": "fast"}, "ReplyBudget"),
        (["mw_servers.tracing"], {"AGENTMW_LOOP": "fast"}, "TracingMiddleware"),
        (["agentmw.sdk", "tests.host_util:RecorderMiddleware"], {"AGENTMW_LOOP": "fast"}, "RecorderMiddleware"),
        (["agentmw.sdk", "tests.test_sdk_server:Keyed", "--arg", "key=" + "k" * 257], {}, "Keyed"),
        (["agentmw.sdk", "tests.test_sdk_server:Keyed", "--arg", "key=5"], {}, "Keyed"),
    ],
    ids=["budget_loop", "tracing_loop", "launcher_loop", "key_too_long", "key_not_a_string"],
)
def test_a_bad_loop_or_key_is_one_line_and_exit_2(argv: list[str], env: dict[str, str], says: str) -> None:
    """Refused by serve() before serving, as agent-host refuses its configuration. A bad AGENTMW_LOOP
    was a ValueError traceback not naming the variable and a never-awaited-coroutine warning; a key
    no host takes was served, and every attach then failed (or a TypeError traceback)."""
    done = run_cli(*argv, "--address", "127.0.0.1:0", env=env, timeout=30)
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.splitlines()
    if "AGENTMW_LOOP" in env:
        what = "AGENTMW_LOOP: 'fast' is not one of asyncio, uvloop, auto"
    elif argv[-1] == "key=5":
        what = "get_middleware_key(): a middleware key must be a string, got int 5"
    else:
        what = "get_middleware_key(): a middleware key of 257 characters (at most 256)"
    assert line == f"agentmw middleware {says}: configuration error: {what}"


class Flusher(MiddlewareBase):
    """Leaves work running after each reply (as a write-back does), finished by close()."""

    def __init__(self, mark: str) -> None:
        self.mark = Path(mark)
        self.pending: set[asyncio.Task[None]] = set()

    async def on_reply(self, agent: Any, input_kwargs: dict[str, Any], next_handler: Any) -> Any:
        async for item in next_handler():
            yield item

        async def flush() -> None:
            await asyncio.sleep(0.5)
            self.mark.write_text("flushed")

        task = asyncio.get_running_loop().create_task(flush())
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def close(self) -> None:
        await asyncio.gather(*self.pending)


async def test_a_stopping_server_lets_the_middleware_finish_its_background_work(tmp_path: Path) -> None:
    """SIGTERM right after a reply whose middleware left work running: serve() awaits the class's
    close() before it exits (a rolling update must not drop a write-back). Before, the event loop
    ended with the work cancelled."""
    mark = tmp_path / "mark"
    argv = ["-m", "agentmw.sdk", "tests.test_sdk_server:Flusher", "--arg", f'mark="{mark}"', "--address", "127.0.0.1:0"]
    proc = ServerProcess(argv, log_dir=tmp_path).start()
    try:
        remote = await RemoteMiddleware(proc.address).connect()
        agent = Agent(model=OfflineRuleModel(), middlewares=[remote])
        async for _ in agent.reply_stream(UserMsg("hi")):
            pass
        await remote.close()
        assert not mark.exists()
        assert proc.stop() == 0  # SIGTERM, with the flush still sleeping
        assert mark.read_text() == "flushed", proc.tail()
    finally:
        proc.stop()


async def test_a_stopping_server_ends_the_hosts_idle_streams_at_once() -> None:
    """After a reply the host keeps the server's hook stream open, idle, to reuse it. SIGTERM ends
    such a stream at once (the server exits well within its 5 s grace, nothing logged as an error),
    and the host's next reply, to the restarted server, opens a new one. Before, the stop waited the
    whole grace period for the idle stream, then cancelled it with a traceback logged."""
    proc = middleware_server("tests.conformance_mw:Marker").start()
    remote = await RemoteMiddleware(proc.address).connect()
    try:
        agent = Agent(model=OfflineRuleModel(), middlewares=[remote])

        async def reply() -> list[Any]:
            async with asyncio.timeout(30):
                return [item async for item in agent.reply_stream(UserMsg("hi"))]

        await reply()
        assert any(remote.idle.values()), "the host keeps the stream to reuse it"
        started = time.monotonic()
        assert proc.stop() == 0
        assert time.monotonic() - started < 4.0, "the stop waited for an idle stream (grace: 5 s)"
        log = proc.tail(200)
        assert "Traceback" not in log and "ERROR" not in log, log
        proc.start()
        items = await reply()
        assert [i.name for i in items if isinstance(i, CustomEvent)] == ["marker"]
    finally:
        await remote.close()
        proc.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["on_reasoning", "tool"])
async def test_a_hook_or_tool_that_exits_the_process_answers_first(where: str) -> None:
    """SystemExit in a hook or a list_tools tool: the SDK answers (a Fail naming it; the tool's
    error result), then the server exits. Before, it went out of the stream unanswered, and the
    host saw the stream break (a hook) or the tool's call fail, without the author's exception."""
    proc = middleware_server("tests.conformance_mw:RaisesNonException", hook=where, kind="exit").start()
    remote = await RemoteMiddleware(proc.address).connect()
    try:
        toolkit = Toolkit()
        await add_middleware_tools(toolkit, remote)
        # The tool case attaches only its tools: as middleware too, the reply's next step would race
        # the server's exit and, under load, wait out the host's 10 s for the gone server.
        middlewares = [] if where == "tool" else [remote]
        agent = Agent(model=OfflineRuleModel(), middlewares=middlewares, toolkit=toolkit)
        text = "call RaisesNonException__unexceptional text=x" if where == "tool" else "hi"
        async with asyncio.timeout(30):
            items = [item async for item in agent.reply_stream(UserMsg(text))]
        if where == "tool":
            deltas = [i.delta for i in items if isinstance(i, ToolResultTextDeltaEvent)]
            assert deltas[0] == "the tool cannot take 'x'", deltas
        else:
            error = items[-1].error
            assert error is not None and error.message.startswith("SystemExit: exit raised in on_reasoning (raised by")
        # It exits, stopping its server as on SIGTERM (~0.1 s alone). A tool's exit once never came
        # when the host cancelled the call at the response (the test below drives that case every
        # time; here it happened under load only). A bound for a hang, not a measure.
        async with asyncio.timeout(75):
            while proc.running:
                await asyncio.sleep(0.05)
    finally:
        await remote.close()
        proc.stop()


async def test_a_tool_that_exits_stops_the_server_even_when_the_host_cancels_at_the_response() -> None:
    """The host cancels a CallTool once it has the ToolResponse, often before gRPC asks the handler
    for more. The handler is then closed at its last yield: the exit must not wait behind it. (It
    did: the process served on, idle, after the tool's SystemExit; under load the test above then
    timed out waiting for the exit.) Driven here as gRPC drives the handler, to that point."""
    streams = _Streams()
    streams.exiting = asyncio.get_running_loop().create_future()
    source = _ToolSource(RaisesNonException(hook="tool", kind="exit"), "RaisesNonException", streams)
    source.tools = {t.name: t for t in await source.middleware.list_tools()}
    request = hooks_pb2.CallToolRequest()
    request.tool_call.id, request.tool_call.name = "call-1", "unexceptional"
    request.tool_input.update({"text": "x"})
    answers = source.CallTool(request, context=None)
    async for answer in answers:
        if answer.WhichOneof("item") == "tool_response":
            break  # the host has its answer and cancels
    await answers.aclose()
    assert streams.exiting.done(), "the server was never asked to stop"
    raised = streams.exiting.result()
    assert isinstance(raised, SystemExit) and str(raised) == "the tool cannot take 'x'"


class _StubSession:
    """What an AgentView asks of its HookSession: the messages sent, a queue of mutations."""

    def __init__(self) -> None:
        self.sent = 0
        self.mutations: list[hooks_pb2.Mutation] = []

    def mutate(self, mutation: hooks_pb2.Mutation) -> None:
        self.mutations.append(mutation)

    def sync_state(self) -> None:
        pass


def _host_state(model_id: str, max_iters: int, applied: int) -> hooks_pb2.HookContext:
    ctx = hooks_pb2.HookContext(max_iters=max_iters, applied=applied)
    ctx.model.id, ctx.model.provider = model_id, "offline"
    return ctx


def test_the_view_keeps_its_own_change_over_host_state_taken_before_the_host_read_it() -> None:
    session: Any = _StubSession()
    view = AgentView(session, "Key")
    session.view = view
    view.refresh(_host_state("main", 10, applied=0))
    view.set_model("backup")
    view.max_iters = 3
    assert (view.model.id, view.model.provider, view.max_iters) == ("backup", "", 3)  # the id alone, at once
    assert [m.WhichOneof("op") for m in session.mutations] == ["set_model", "set_max_iters"]
    view.refresh(_host_state("main", 10, applied=0))  # sent before the host read our message: stale
    assert (view.model.id, view.max_iters) == ("backup", 3)
    session.sent = 1
    view.refresh(_host_state("backup", 3, applied=1))  # the host's state once it applied them
    assert (view.model.id, view.model.provider, view.max_iters) == ("backup", "offline", 3)


def test_the_view_drops_the_oldest_messages_and_refuses_other_removals() -> None:
    """``summary = text``, ``del context[:n]`` and ``context = context[n:]`` are sent and shown at
    once; a removal that is not of the oldest messages, or of every message, raises in the
    middleware's code and sends nothing."""
    session: Any = _StubSession()
    view = AgentView(session, "Key")
    session.view = view
    view.refresh(_host_state("main", 10, applied=0))
    with pytest.raises(RuntimeError, match=r"^agent.state.summary is not sent .* wants_context"):  # as the context
        _ = view.state.summary
    ctx = _host_state("main", 10, applied=0)
    for text in ("one", "two", "three", "four"):
        codec.encode(UserMsg(text), ctx.context.messages.add())
    ctx.summary = "earlier"
    view.refresh(ctx)
    state = view.state
    assert state.summary == "earlier"
    state.summary = "one, two"
    del state.context[:1]
    state.context = state.context[1:]
    assert state.summary == "one, two" and [m.text for m in state.context] == ["three", "four"]
    sent = [(m.WhichOneof("op"), getattr(m, m.WhichOneof("op"))) for m in session.mutations]
    assert sent == [("set_summary", "one, two"), ("drop_messages", 1), ("drop_messages", 1)]
    for edit, says in [
        (lambda: state.context.__delitem__(1), "is not a drop of the oldest messages"),
        (lambda: setattr(state, "context", state.context[:1]), "not its newest ones"),
        (lambda: setattr(state, "context", [UserMsg("new"), state.context[1]]), "not its newest ones"),
        (lambda: setattr(state, "context", []), "the newest message stays"),
        (lambda: state.context.__delitem__(slice(None)), "the newest message stays"),
    ]:
        with pytest.raises(ContextEditError, match=says):
            edit()
    assert len(session.mutations) == 3 and [m.text for m in state.context] == ["three", "four"]


# -- a host that breaks the protocol --------------------------------------------------------------


class _Watches(MiddlewareBase):
    """A pass-through that counts its invocations running; ``swallow``: it catches what reading the
    inner pipeline raises and finishes normally."""

    running = 0

    def __init__(self, swallow: bool = False) -> None:
        self.swallow = swallow

    async def on_reply(self, agent: Any, input_kwargs: dict, next_handler: Any) -> AsyncIterator[Any]:
        type(self).running += 1
        try:
            async for item in next_handler():
                yield item
        except Exception:
            if not self.swallow:
                raise
        finally:
            type(self).running -= 1


def _raw_begin(invocation: int, hook: str = "on_reply") -> hooks_pb2.HostMessage:
    msg = hooks_pb2.HostMessage(invocation=invocation)
    msg.begin.context.session_id, msg.begin.context.reply_id = "s1", "r1"
    kwargs = {"msg": UserMsg("hi")} if hook == "on_reply" else {"tool_call": None}
    encode_kwargs(HOOKS[hook], kwargs, msg.begin.input_kwargs)
    return msg


def _then(*rest: hooks_pb2.HostMessage) -> list[hooks_pb2.HostMessage]:
    return [_raw_begin(7), *rest]


_EMPTY_ITEM = hooks_pb2.HostMessage(invocation=7, item=hooks_pb2.ItemDelivery(seq=1, inner=1))
_NESTED = hooks_pb2.HostMessage(invocation=7, batch=hooks_pb2.Batch(messages=[hooks_pb2.HostMessage(invocation=7)]))
_NESTED.batch.messages[0].batch.messages.add().CopyFrom(_raw_begin(7))


@pytest.mark.parametrize("swallow", [False, True], ids=["raises", "swallows"])
@pytest.mark.parametrize(
    ("sent", "says"),
    [
        ([b"\xff\xff\xff"], "a message that cannot be parsed as a HostMessage"),
        ([hooks_pb2.HostMessage(invocation=7)], "a message with none of begin, item, inner_done, ... set"),
        ([_NESTED], "a batch inside a batch"),
        ([_raw_begin(0)], "a begin with invocation id 0"),
        ([_raw_begin(7, "on_acting")], "a begin with the input kwargs of on_acting"),
        (_then(_EMPTY_ITEM), r"a malformed item \(seq 1\): empty Item"),
        (_then(hooks_pb2.HostMessage(invocation=7, begin=hooks_pb2.Begin())), "a begin inside the invocation"),
        (_then(hooks_pb2.HostMessage(invocation=7)), "a message with none of begin"),
    ],
    ids=["bytes", "empty", "nested-batch", "invocation-0", "other-kwargs", "empty-item", "begin-again", "empty-later"],
)
async def test_a_host_that_breaks_the_protocol_gets_invalid_argument_and_the_server_serves_on(
    sent: list[Any], says: str, swallow: bool
) -> None:
    """What a host sends that cannot be, on a stream of a served middleware: that stream ends
    INVALID_ARGUMENT saying what came, no Fail blames the author's code (even when it caught the
    error and finished), the code has ended, and the same server serves a real host's reply after.
    Before, a malformed message raised inside the author's code (TypeError, CodecError) and was sent
    as its own failure; nested batches went unnoticed; unparseable bytes ended the stream UNKNOWN."""
    server, port = await start(_Watches(swallow), "127.0.0.1:0")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        call = channel.stream_stream("/agentmw.v1.OnReply/Run", _as_bytes, _as_bytes)()
        for msg in sent:
            await call.write(msg if isinstance(msg, bytes) else msg.SerializeToString())
        answers = []
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            async with asyncio.timeout(10):
                async for answer in call:
                    answers.append(hooks_pb2.MiddlewareMessage.FromString(answer).WhichOneof("command"))
        assert failed.value.code() is grpc.StatusCode.INVALID_ARGUMENT, failed.value
        assert re.match(f"on_reply: the host broke the protocol: {says}", failed.value.details() or "")
        assert "fail" not in answers and "finish" not in answers, answers
        assert _Watches.running == 0
        remote = await RemoteMiddleware(f"127.0.0.1:{port}").connect()
        try:
            final = await Agent(model=OfflineRuleModel(), middlewares=[remote]).reply(UserMsg("hi"))
            assert final.error is None, final.error
        finally:
            await remote.close()
    finally:
        await channel.close()
        await server.stop(None)


def _as_bytes(data: bytes) -> bytes:
    return data
