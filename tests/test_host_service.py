"""The host as users run it: real `agent-host`, middleware and demo processes on loopback ports.

Every process a test starts is stopped in its teardown (``processes``); every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent_host.config import ConfigError, load_config
from agentmw.codec import codec
from agentmw.data import (
    ConfirmResult,
    ExternalExecutionResultEvent,
    Msg,
    ReplyEndEvent,
    ReplyFinishedReason,
    ReplyStartEvent,
    RequireExternalExecutionEvent,
    RequireUserConfirmEvent,
    TextBlockDeltaEvent,
    ToolCallBlock,
    ToolCallState,
    ToolResultBlock,
    ToolResultEndEvent,
    ToolResultStartEvent,
    ToolResultState,
    UserConfirmResultEvent,
    UserMsg,
)
from agentmw.v1 import host_pb2
from clients.chat import HostClient, converse
from clients.launch import ServerProcess, unused_port

from .host_util import KEY, SLOW_MODEL, Procs, get_session, kinds, run_cli, stub
from .host_util import reply_once as _reply

pytestmark = pytest.mark.timeout(60)


def _end(items: list[object]) -> ReplyEndEvent:
    ends = [i for i in items if isinstance(i, ReplyEndEvent)]
    assert len(ends) == 1, kinds(items)
    return ends[0]


async def test_session_survives_host_restart(procs: Procs, tmp_path: Path) -> None:
    db = tmp_path / "sessions.db"
    host = procs.host(db)
    session, items = await _reply(host.address, "", UserMsg("remember the word banana"))
    assert _end(items).finished_reason == ReplyFinishedReason.COMPLETED
    assert isinstance(items[-1], Msg) and "banana" in items[-1].text
    assert host.stop() == 0  # SIGTERM: a clean shutdown

    host = procs.host(db, name="host2")
    async with grpc.aio.insecure_channel(host.address) as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        listed = await stub(channel).ListSessions(host_pb2.ListSessionsRequest(), timeout=5)
    assert [s.session_id for s in listed.sessions] == [session]
    assert listed.sessions[0].title == "remember the word banana"
    _, state, _ = await get_session(host.address, session)
    assert [m.role.value for m in state.context] == ["user", "assistant"]

    same, items = await _reply(host.address, session, UserMsg("what was the word?"))
    assert same == session and _end(items).finished_reason == ReplyFinishedReason.COMPLETED
    _, state, _ = await get_session(host.address, session)
    assert [m.text for m in state.context if m.role.value == "user"] == [
        "remember the word banana",
        "what was the word?",
    ]


async def test_hitl_parked_across_restart_then_resumed_with_edited_input(procs: Procs, tmp_path: Path) -> None:
    db = tmp_path / "sessions.db"
    recorder = procs.recorder()
    host = procs.host(db, "--middleware", f"rec={recorder.address}")
    session, items = await _reply(host.address, "", UserMsg("email bob@example.com saying hi"))
    asks = [i for i in items if isinstance(i, RequireUserConfirmEvent)]
    assert asks and asks[0].tool_calls[0].name == "send_email"
    assert not any(isinstance(i, ReplyEndEvent) for i in items), "a parked reply has no ReplyEndEvent"
    reply_id = items[-1].id
    info, _, slots = await get_session(host.address, session)
    assert [c.name for c in info.pending_tool_calls] == ["send_email"] and info.summary.parked
    assert slots[KEY] == {"starts": 1, "ends": []}

    # A new message is refused while the session waits for the answer.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _reply(host.address, session, UserMsg("hello?"))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    host.stop()
    host = procs.host(db, "--middleware", f"rec={recorder.address}", name="host2")
    call = asks[0].tool_calls[0]
    edited = ToolCallBlock(
        id=call.id, name=call.name, state=call.state, input=json.dumps({"to": "carol@example.com", "body": "edited"})
    )
    answer = UserConfirmResultEvent(
        reply_id=reply_id, confirm_results=[ConfirmResult(confirmed=True, tool_call=edited)]
    )
    _, items = await _reply(host.address, session, answer)
    assert not any(isinstance(i, ReplyStartEvent) for i in items), "a resumed reply has no new ReplyStartEvent"
    result = next(i for i in items if isinstance(i, ToolResultEndEvent))
    assert result.state == ToolResultState.SUCCESS
    end = _end(items)
    assert end.finished_reason == ReplyFinishedReason.COMPLETED and end.reply_id == reply_id
    assert "carol@example.com" in items[-1].text

    info, state, slots = await get_session(host.address, session)
    assert not info.pending_tool_calls and not info.summary.parked
    sent = [b for m in state.context for b in m.content if getattr(b, "type", "") == "tool_call"]
    assert json.loads(sent[0].input)["to"] == "carol@example.com" and sent[0].state == ToolCallState.FINISHED
    # The middleware's slot survived the pause and the restart; the reply's end reached it.
    assert slots[KEY] == {"starts": 1, "ends": [{"reply_id": reply_id, "finished_reason": "completed"}]}


async def test_a_middleware_asking_again_for_a_confirmed_call_is_said_and_not_answered_for_ever(
    procs: Procs, tmp_path: Path
) -> None:
    """The permission chain runs again for a call the user confirmed (as in AgentScope). A
    middleware that asks for every call, confirmed or not, brings the question back each time:
    the host logs it, naming the middleware, and an answering client stops after MAX_CONFIRMS
    confirmations of the call (the reply stays parked). Before, agent-chat --yes confirmed for
    ever (4,123 parked replies in 30 s) and nothing said why."""
    from clients.host_client import MAX_CONFIRMS

    asker = procs.start(
        "asker", ["-m", "agentmw.sdk", "tests.conformance_mw:AsksEveryTime", "--address", "127.0.0.1:0"]
    )
    host = procs.host(tmp_path / "s.db", "--middleware", f"asker={asker.address}")
    confirms: list[str] = []

    async def yes(call: ToolCallBlock) -> ConfirmResult:
        confirms.append(call.id)
        return ConfirmResult(confirmed=True, tool_call=call)

    async with HostClient(host.address) as client, asyncio.timeout(30):
        turn = await converse(client, "", UserMsg("email bob@example.com saying hi"), on_confirm=yes)
    assert turn.parked and [c.name for c in turn.asked_again] == ["send_email"], turn
    assert len(confirms) == MAX_CONFIRMS and len(set(confirms)) == 1, confirms
    said = "was confirmed by the user and is asked for again (on_check_permission middleware 'asker')"
    await asyncio.to_thread(host.wait_for_line, said)


async def test_external_execution_round_trip(procs: Procs, tmp_path: Path) -> None:
    host = procs.host(tmp_path / "sessions.db")
    ran: list[str] = []

    async def external(call: ToolCallBlock) -> ToolResultBlock:
        ran.append(call.input)
        return ToolResultBlock(id=call.id, name=call.name, output="shipped on Monday", state=ToolResultState.SUCCESS)

    async with HostClient(host.address) as client:
        turn = await converse(client, "", UserMsg("where is my order A-17?"), on_external=external)
    assert json.loads(ran[0]) == {"order_id": "A-17"}
    requests = [i for i in turn.items if isinstance(i, RequireExternalExecutionEvent)]
    assert [c.state for c in requests[0].tool_calls] == [ToolCallState.SUBMITTED]
    assert kinds(turn.items).count("ReplyStartEvent") == 1
    assert turn.end is not None and turn.end.finished_reason == ReplyFinishedReason.COMPLETED
    assert "shipped on Monday" in turn.final.text

    # An answer for calls that are not waiting is refused and changes nothing.
    stray = ExternalExecutionResultEvent(reply_id="r", execution_results=[ToolResultBlock(id="nope", name="x")])
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _reply(host.address, turn.session_id, stray)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_an_empty_content_block_from_a_client_is_refused_and_the_session_goes_on(
    procs: Procs, tmp_path: Path
) -> None:
    """A ContentBlock with none of its kinds set, in an external tool's result or in a user message:
    INVALID_ARGUMENT, and nothing changes. Before, it decoded to None: the result was taken, the
    session could not be stored (INTERNAL, no reply end) and stayed broken in the host's memory
    (each later request failed) until the host restarted; the message got INTERNAL."""
    host = procs.host(tmp_path / "sessions.db")
    session, items = await _reply(host.address, "", UserMsg("where is my order A-17?"))
    (asked,) = [i for i in items if isinstance(i, RequireExternalExecutionEvent)]
    (call,) = asked.tool_calls
    result = host_pb2.StartReply(session_id=session)
    result.external_execution_result.execution_results.add(id=call.id, name=call.name).output_blocks.blocks.add()
    message = host_pb2.StartReply()
    codec.encode(UserMsg("hello"), message.message)
    message.message.content.add()
    async with grpc.aio.insecure_channel(host.address) as channel:
        for bad in (result, message):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in stub(channel).Reply(iter([host_pb2.ReplyRequest(start=bad)]), timeout=10):
                    pass
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
            assert "an empty ContentBlock in a list" in (refused.value.details() or ""), refused.value
    answer = ToolResultBlock(id=call.id, name=call.name, output="shipped", state=ToolResultState.SUCCESS)
    answered = ExternalExecutionResultEvent(reply_id="", execution_results=[answer])
    _, items = await _reply(host.address, session, answered)
    assert _end(items).finished_reason == ReplyFinishedReason.COMPLETED


async def _cancel_after(address: str, session_id: str, message: str, when: type) -> tuple[str, list[object]]:
    """Start a reply and send a cancel as soon as an item of type ``when`` arrives."""
    items: list[object] = []
    async with HostClient(address) as client:
        call = client.reply(session_id, UserMsg(message))
        async with asyncio.timeout(20):
            async for item in call:
                items.append(item)
                if isinstance(item, when) and sum(isinstance(i, when) for i in items) == 1:
                    call.cancel()
    return call.session_id, items


async def test_cancel_ends_interrupted_through_remote_on_reply(procs: Procs, tmp_path: Path) -> None:
    config = tmp_path / "host.yaml"
    config.write_text(SLOW_MODEL)
    recorder = procs.recorder()
    host = procs.host(tmp_path / "sessions.db", "--config", str(config), "--middleware", f"rec={recorder.address}")

    # 1. While the model streams (a long answer at 20 ms a word).
    session, items = await _cancel_after(host.address, "", "word " * 200, TextBlockDeltaEvent)
    end = _end(items)
    assert end.finished_reason == ReplyFinishedReason.INTERRUPTED
    assert isinstance(items[-1], Msg) and items[-1].finished_reason == ReplyFinishedReason.INTERRUPTED
    assert kinds(items).count("TextBlockDeltaEvent") < 100, "the stream went on after the cancel"
    _, state, slots = await get_session(host.address, session)
    assert slots[KEY]["ends"] == [{"reply_id": end.reply_id, "finished_reason": "interrupted"}]
    assert state.context[-1].text.startswith("You"), "the partial answer is kept"

    # 2. While a (remote) tool runs: its call is closed as INTERRUPTED, the end still reaches on_reply.
    _, items = await _cancel_after(host.address, session, "call rec__nap seconds=30", ToolResultStartEvent)
    results = [i for i in items if isinstance(i, ToolResultEndEvent)]
    assert [r.state for r in results] == [ToolResultState.INTERRUPTED]
    assert _end(items).finished_reason == ReplyFinishedReason.INTERRUPTED
    _, _, slots = await get_session(host.address, session)
    assert [e["finished_reason"] for e in slots[KEY]["ends"]] == ["interrupted", "interrupted"]

    # The session goes on normally afterwards.
    _, items = await _reply(host.address, session, UserMsg("call rec__shout text=hi"))
    assert _end(items).finished_reason == ReplyFinishedReason.COMPLETED and "HI!" in items[-1].text


async def test_a_reply_its_client_cancelled_is_continued_by_a_retry_of_its_message(
    procs: Procs, tmp_path: Path
) -> None:
    """A reply cancelled by its client is stored as cut short (its partial message INTERRUPTED), and
    the same message sent again (same id) continues the turn, as after a host crash; so does one
    cancelled before it stored any answer. Before, the partial message looked completed and the
    retry was refused ALREADY_EXISTS ("already answered")."""
    config = tmp_path / "host.yaml"
    config.write_text(SLOW_MODEL)
    host = procs.host(tmp_path / "sessions.db", "--config", str(config))
    for cut_at in (TextBlockDeltaEvent, ReplyStartEvent):
        message = UserMsg("word " * 100)
        items: list[object] = []
        async with HostClient(host.address) as client:
            call = client.reply("", message)
            async with asyncio.timeout(20):
                async for item in call:
                    items.append(item)
                    if isinstance(item, cut_at) and sum(isinstance(i, cut_at) for i in items) == 1:
                        call.cancel()
        assert _end(items).finished_reason == ReplyFinishedReason.INTERRUPTED
        session = call.session_id
        _, state, _ = await get_session(host.address, session)
        tail = state.context[-1]
        assert tail.id == message.id or tail.finished_reason == ReplyFinishedReason.INTERRUPTED, (cut_at, tail)
        _, items = await _reply(host.address, session, message)  # the same message again
        assert _end(items).finished_reason == ReplyFinishedReason.COMPLETED, cut_at
        _, state, _ = await get_session(host.address, session)
        assert [m.id for m in state.context if m.role.value == "user"] == [message.id], "stored once"
        assert state.context[-1].role.value == "assistant"
        assert state.context[-1].finished_reason != ReplyFinishedReason.INTERRUPTED
        with pytest.raises(grpc.aio.AioRpcError) as again:  # once more: it is answered now (it was
            await _reply(host.address, session, message)  # "interrupted, and other messages followed")
        assert again.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert again.value.details().endswith(
            f"message {message.id} in session {session!r} was already answered: see GetSession"
        )


async def test_a_retry_is_known_by_the_clients_message_id_when_a_middleware_passed_on_a_new_message(
    procs: Procs, tmp_path: Path
) -> None:
    """An on_reply middleware passes the user's message on as a new one (a redactor: new id). The
    same message sent again is refused as answered, and a retry of one whose reply was cancelled
    continues it: the session takes the client's id (ReplyContext.input_ids), not only what was
    stored. Before, both were taken for new messages: the turn was stored and answered twice (and a
    tool in it ran twice)."""
    config = tmp_path / "host.yaml"
    config.write_text(SLOW_MODEL)
    served = ["-m", "agentmw.sdk", "tests.conformance_mw:PassesANewMessage", "--address", "127.0.0.1:0"]
    redactor = procs.start("redactor", served)
    host = procs.host(tmp_path / "s.db", "--config", str(config), "--middleware", f"redactor={redactor.address}")
    told = UserMsg("my pin is 1234")
    session, items = await _reply(host.address, "", told)
    assert _end(items).finished_reason == ReplyFinishedReason.COMPLETED
    with pytest.raises(grpc.aio.AioRpcError) as again:
        await _reply(host.address, session, told)
    assert again.value.code() == grpc.StatusCode.ALREADY_EXISTS and "was already answered" in again.value.details()
    cut = UserMsg("word " * 100 + "42")
    async with HostClient(host.address) as client, asyncio.timeout(20):
        call = client.reply(session, cut)
        async for item in call:
            if isinstance(item, TextBlockDeltaEvent):
                call.cancel()
                break
    _, items = await _reply(host.address, session, cut)  # continued, not a new turn
    assert _end(items).finished_reason == ReplyFinishedReason.COMPLETED
    _, state, _ = await get_session(host.address, session)
    assert [m.text for m in state.context if m.role.value == "user"] == ["my pin is ####", "word " * 100 + "##"]


async def test_a_retry_continues_a_reply_whose_own_message_compression_dropped(procs: Procs, tmp_path: Path) -> None:
    """Compression drops the reply's own user message half-way (a long message, a small context),
    then the client cancels: the same message sent again continues the reply. Before, the retry
    was refused as answered ('since compressed'): it was taken for an earlier message."""
    config = tmp_path / "host.yaml"
    rule = {"pattern": "loop", "tool": "add", "input": {"a": 1, "b": 2}, "repeat": True}
    model = {"provider": "offline", "context_size": 300, "delay": 0.05, "rules": [rule]}
    config.write_text(json.dumps({"models": {"default": "m", "models": {"m": model}}, "agent": {"max_iters": 4}}))
    host = procs.host(tmp_path / "s.db", "--config", str(config))
    ask = UserMsg("loop " + "x" * 1400)
    async with HostClient(host.address) as client, asyncio.timeout(20):
        call = client.reply("", ask)
        starts = 0
        async for item in call:
            starts += isinstance(item, ToolResultStartEvent)
            if starts == 2:  # compression ran before this round
                call.cancel()
                break
    session = call.session_id
    _, state, _ = await get_session(host.address, session)
    assert ask.id in state.dropped_user_ids and ask.id not in [m.id for m in state.context]
    _, items = await _reply(host.address, session, ask)
    assert _end(items).finished_reason in (ReplyFinishedReason.COMPLETED, ReplyFinishedReason.EXCEED_MAX_ITERS)


async def test_a_reply_cancelled_while_it_waits_for_its_session_ends_at_once(procs: Procs, tmp_path: Path) -> None:
    """A second reply waits for its session (a first one is streaming); its client cancels it. It
    ends at once with CANCELLED and stores nothing. Before, it was still run once the session was
    free (its message stored, unanswered), or cut off 5 s later with ABORTED blaming a middleware."""
    config = tmp_path / "host.yaml"
    config.write_text(SLOW_MODEL)
    host = procs.host(tmp_path / "sessions.db", "--config", str(config))
    session, _ = await _reply(host.address, "", UserMsg("hello"))
    busy = asyncio.ensure_future(_reply(host.address, session, UserMsg("word " * 60)))  # ~1.2 s of text
    await asyncio.sleep(0.3)
    async with HostClient(host.address) as client:
        call = client.reply(session, UserMsg("sent while busy, then cancelled"))
        await asyncio.sleep(0.2)
        call.cancel()
        loop = asyncio.get_running_loop()
        cancelled_at = loop.time()
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            async with asyncio.timeout(10):
                _ = [item async for item in call]
        took = loop.time() - cancelled_at
    assert ended.value.code() == grpc.StatusCode.CANCELLED, ended.value.details()
    assert "before it began" in (ended.value.details() or "")
    assert not busy.done(), f"the cancelled reply waited {took:.1f}s, until the session was free"
    await busy
    _, state, _ = await get_session(host.address, session)
    assert [m.text for m in state.context if m.role.value == "user"] == ["hello", "word " * 60]


async def test_a_tool_call_cut_by_its_servers_crash_says_the_server_went_away(procs: Procs, tmp_path: Path) -> None:
    """A middleware's tool is running when its server is killed: the call's error result says the
    server went away, not "cannot connect ... TLS may be the cause" (the connection was there)."""
    recorder = procs.recorder()
    host = procs.host(tmp_path / "sessions.db", "--middleware", f"rec={recorder.address}")
    items: list[object] = []
    async with HostClient(host.address) as client:
        call = client.reply("", UserMsg("call rec__nap seconds=30"))
        async with asyncio.timeout(20):
            async for item in call:
                items.append(item)
                if isinstance(item, ToolResultStartEvent):
                    await asyncio.sleep(0.3)  # the tool runs
                    recorder.kill()
    results = [i.delta for i in items if type(i).__name__ == "ToolResultTextDeltaEvent"]
    assert len(results) == 1 and "the server went away or the connection was lost" in results[0], results
    assert "cannot connect" not in results[0] and "TLS" not in results[0]


async def test_attach_and_detach_between_replies(procs: Procs, tmp_path: Path) -> None:
    config = tmp_path / "host.yaml"
    config.write_text(SLOW_MODEL)
    recorder = procs.recorder()
    host = procs.host(tmp_path / "sessions.db", "--config", str(config))
    async with grpc.aio.insecure_channel(host.address) as channel:
        host_stub = stub(channel)
        assert not (await host_stub.ListMiddleware(host_pb2.ListMiddlewareRequest(), timeout=5)).middleware

        # Attached while a reply streams: that reply goes on without it; the next one has it.
        session, _ = await _reply(host.address, "", UserMsg("hi"))  # stored, so GetSession sees it
        async with HostClient(host.address) as client:
            call = client.reply(session, UserMsg("word " * 100))  # ~2 s of streaming
            items = []
            async for item in call:
                items.append(item)
                if len(items) == 5:
                    info = await host_stub.AttachMiddleware(
                        host_pb2.AttachMiddlewareRequest(address=recorder.address, name="rec", timeout=5), timeout=10
                    )
                    # Only an attach that landed while the reply ran tests anything: make sure it did.
                    during, _, _ = await get_session(host.address, session)
                    assert during.replying, "the attach came after the reply; nothing was tested"
        assert _end(items).finished_reason == ReplyFinishedReason.COMPLETED
        assert info.key == KEY and list(info.hooks) == ["on_reply"]
        assert sorted(info.tools) == ["rec__nap", "rec__shout"]
        _, _, slots = await get_session(host.address, session)
        assert KEY not in slots

        _, items = await _reply(host.address, session, UserMsg("call rec__shout text=hello"))
        assert "HELLO!" in items[-1].text
        _, _, slots = await get_session(host.address, session)
        assert slots[KEY]["starts"] == 1

        with pytest.raises(grpc.aio.AioRpcError) as twice:
            await host_stub.AttachMiddleware(host_pb2.AttachMiddlewareRequest(address=recorder.address, name="rec"))
        assert twice.value.code() == grpc.StatusCode.ALREADY_EXISTS

        await host_stub.DetachMiddleware(host_pb2.DetachMiddlewareRequest(name="rec"), timeout=5)
        assert not (await host_stub.ListMiddleware(host_pb2.ListMiddlewareRequest(), timeout=5)).middleware
        _, items = await _reply(host.address, session, UserMsg("call rec__shout text=hello"))
        assert not any(isinstance(i, ToolResultEndEvent) for i in items), "the tool left with its middleware"
        _, _, slots = await get_session(host.address, session)
        assert slots[KEY]["starts"] == 1, "a detached middleware takes no part"


def serve_at(procs: Procs, port: int, target: str = "tests.host_util:RecorderMiddleware") -> ServerProcess:
    """The middleware class ``target`` served by the SDK launcher at 127.0.0.1:``port``."""
    return procs.start(target.rsplit(":", 1)[-1], ["-m", "agentmw.sdk", target, "--address", f"127.0.0.1:{port}"])


def host_with(procs: Procs, tmp_path: Path, port: int, policy: str, name: str = "rec") -> ServerProcess:
    """A host configured with one middleware ``name`` at 127.0.0.1:``port`` (``policy``: more keys
    of its YAML entry, e.g. "timeout: 3")."""
    config = tmp_path / "host.yaml"
    config.write_text(f"middleware:\n  - {{name: {name}, address: 127.0.0.1:{port}, {policy}}}\n")
    return procs.host(tmp_path / "sessions.db", "--config", str(config))


async def _health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        answer = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return answer.status


async def recorder_comes_up(procs: Procs, host: ServerProcess, port: int) -> None:
    """Start the recorder at the port a host waits on, and wait until the host has attached it
    (bounded: its channel connects within ~1 s of the server's start)."""
    serve_at(procs, port)
    for _ in range(200):
        if "attached middleware rec" in host.tail(50):
            return
        await asyncio.sleep(0.1)
    pytest.fail("the host did not attach the middleware once it answered:\n" + host.tail(50))


async def test_a_fail_open_middleware_down_at_start_is_attached_once_it_answers(procs: Procs, tmp_path: Path) -> None:
    """Optional (fail_open), it does not stop the host from starting: replies go on without it,
    and once its server answers the host attaches it (a required one: the test below)."""
    port = unused_port()
    host = host_with(procs, tmp_path, port, "fail_open: true, timeout: 3")
    assert "is fail_open and cannot be attached yet" in host.tail(50) and "starting without it" in host.tail(50)
    session, items = await _reply(host.address, "", UserMsg("hello"))
    assert isinstance(items[-1], Msg) and items[-1].finished_reason == ReplyFinishedReason.COMPLETED
    assert KEY not in (await get_session(host.address, session))[2]  # it took no part
    listed = run_cli("clients.admin", "--host", host.address, "--json", "middleware", "list")
    (rec,) = json.loads(listed.stdout)
    assert rec["name"] == "rec" and rec["pending"] and "cannot connect to" in rec["last_error"], rec
    status = run_cli("clients.admin", "--host", host.address, "status")
    assert "rec at 127.0.0.1:" in status.stdout and "not attached yet" in status.stdout, status.stdout
    assert status.returncode == 0, "a fail_open middleware not attached yet leaves the host SERVING"

    await recorder_comes_up(procs, host, port)
    session, items = await _reply(host.address, session, UserMsg("hello again"))
    assert items[-1].finished_reason == ReplyFinishedReason.COMPLETED
    assert (await get_session(host.address, session))[2][KEY]["starts"] == 1  # it took part this time
    listed = run_cli("clients.admin", "--host", host.address, "--json", "middleware", "list")
    (rec,) = json.loads(listed.stdout)
    assert not rec["pending"] and rec["hooks"] == ["on_reply"], rec


async def test_a_required_middleware_down_at_start_holds_replies_until_it_answers(procs: Procs, tmp_path: Path) -> None:
    """Required (fail_closed), down at start: the host starts anyway (no crash loop while a cluster
    comes up in any order) but runs no reply without it: each is refused (UNAVAILABLE, saying which
    middleware and why, nothing stored) and the health check says NOT_SERVING, until its server
    answers and the host attaches it."""
    port = unused_port()
    host = host_with(procs, tmp_path, port, "timeout: 3")
    assert "is required (fail_closed) and cannot be attached yet" in host.tail(50)

    assert await _health(host.address) == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _reply(host.address, "held", UserMsg("hello"))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "required middleware rec (fail_closed) is not attached yet: cannot connect to" in refused.value.details()
    # Said and counted (agentmw_replies_refused_total), though no reply began: before, no trace of it.
    said = "refused UNAVAILABLE: required middleware rec (fail_closed) is not attached yet"
    await asyncio.to_thread(host.wait_for_line, said)
    with pytest.raises(grpc.aio.AioRpcError) as nothing:
        await get_session(host.address, "held")
    assert nothing.value.code() == grpc.StatusCode.NOT_FOUND, "a refused reply stores nothing"
    status = run_cli("clients.admin", "--host", host.address, "status")
    assert "rec at 127.0.0.1:" in status.stdout and "not attached yet" in status.stdout, status.stdout
    assert status.returncode == 1, "status exits 1 while the host is NOT_SERVING"

    await recorder_comes_up(procs, host, port)
    assert await _health(host.address) == health_pb2.HealthCheckResponse.SERVING
    session, items = await _reply(host.address, "held", UserMsg("hello again"))
    assert items[-1].finished_reason == ReplyFinishedReason.COMPLETED
    assert (await get_session(host.address, session))[2][KEY]["starts"] == 1  # it took part


async def _listed(address: str) -> dict[str, host_pb2.MiddlewareInfo]:
    async with grpc.aio.insecure_channel(address) as channel:
        found = await stub(channel).ListMiddleware(host_pb2.ListMiddlewareRequest(), timeout=10)
    return {m.name: m for m in found.middleware}


async def _until_listed(
    address: str, name: str, ok: Callable[[host_pb2.MiddlewareInfo], bool], what: str
) -> host_pb2.MiddlewareInfo:
    """ListMiddleware's entry for ``name`` once ``ok(entry)`` holds (bounded)."""
    for _ in range(150):
        info = (await _listed(address)).get(name)
        if info is not None and ok(info):
            return info
        await asyncio.sleep(0.1)
    pytest.fail(f"{what}: {info}")


async def test_a_middleware_whose_tools_do_not_answer_at_start_is_waited_for(procs: Procs, tmp_path: Path) -> None:
    """It answers Describe but not ListTools (a tool source still warming up). As one that is down
    or silent, it does not stop the host: the host starts without it, says why (naming ListTools),
    and attaches it once ListTools answers, however many tries that takes. Before, the host did
    not start ('Describe failed: DEADLINE_EXCEEDED', fail_open or not), and once started without
    it, gave up on it for good after one ListTools timeout."""
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"name": "t", "inputSchema": {"type": "object"}}]))
    tools.with_suffix(".hang").write_text("")
    tm = procs.start("tm", ["-m", "tests.evil_mw", "--tools", str(tools), "--address", "127.0.0.1:0"])
    host = host_with(procs, tmp_path, int(tm.address.rsplit(":", 1)[1]), "fail_open: true, timeout: 1", name="tm")
    pending = (await _listed(host.address))["tm"]
    assert pending.pending and pending.last_error.startswith("ListTools: no answer within 1s"), pending
    await asyncio.sleep(2.5)  # it is tried again meanwhile, and still does not answer
    assert (await _listed(host.address))["tm"].pending
    tools.with_suffix(".hang").unlink()
    attached = await _until_listed(host.address, "tm", lambda m: not m.pending, "not attached once it answered")
    assert list(attached.tools) == ["tm__t"], attached


async def test_a_tool_source_whose_list_tools_raises_at_start_is_waited_for(procs: Procs, tmp_path: Path) -> None:
    """A served middleware whose list_tools raises (its backend is down): the SDK answers ListTools
    with UNAVAILABLE, saying what it raised, and the host starts without it, as for a tool source
    still warming up, and attaches it once list_tools answers. Before, the raw exception reached
    the host as UNKNOWN and the host did not start, fail_open or not."""
    ready = tmp_path / "ready"
    served = ["-m", "agentmw.sdk", "tests.conformance_mw:ToolsAfterWarmup", "--address", "127.0.0.1:0"]
    tm = procs.start("tm", [*served, "--arg", f"ready={json.dumps(str(ready))}"])
    host = host_with(procs, tmp_path, int(tm.address.rsplit(":", 1)[1]), "fail_open: true, timeout: 2", name="tm")
    pending = (await _listed(host.address))["tm"]
    assert pending.pending, pending
    assert "ListTools: not ready: UNAVAILABLE: list_tools raised ConnectionError: the tool backend is down" in (
        pending.last_error
    ), pending
    ready.write_text("")
    attached = await _until_listed(host.address, "tm", lambda m: not m.pending, "not attached once it listed")
    assert list(attached.tools) == ["tm__lookup"], attached


@pytest.mark.parametrize(
    ("garbage", "says"),
    [
        (False, "tool 'has space'"),
        # before: a traceback ending in AttributeError: 'NoneType' object has no attribute 'tools'
        (True, "an answer that does not parse as a ToolDescriptorList"),
    ],
    ids=["bad-name", "unparsed"],
)
def test_a_middleware_whose_tools_are_refused_at_start_says_listtools(
    procs: Procs, tmp_path: Path, garbage: bool, says: str
) -> None:
    """A ListTools answer that cannot be attached (a tool name no model takes, bytes that do not
    parse) stops the start, as a wrong Describe does, and the error names the call that failed."""
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"name": "has space"}]))
    if garbage:
        tools.with_suffix(".garbage").write_text("")
    bad = procs.start("bad", ["-m", "tests.evil_mw", "--tools", str(tools), "--address", "127.0.0.1:0"])
    refused = run_cli(
        "agent_host", "--db", str(tmp_path / "x.db"), "--listen", "127.0.0.1:0", "--middleware", f"tm={bad.address}"
    )
    assert refused.returncode == 1
    line = refused.stderr.strip().splitlines()[-1]
    assert f"tm at {bad.address}: ListTools failed: protocol violation: {says}" in line, line


async def test_a_required_middleware_whose_listing_does_not_parse_keeps_replies_refused(
    procs: Procs, tmp_path: Path
) -> None:
    """Required (fail_closed), its tool source still warming up at start (the host starts without
    it and refuses replies); then ListTools answers bytes that do not parse. The host says why it
    cannot attach it and goes on refusing replies. Before, the task attaching it died of an
    AttributeError: the middleware was forgotten, health said SERVING and replies ran without it."""
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"name": "t"}]))
    tools.with_suffix(".hang").write_text("")
    tm = procs.start("tm", ["-m", "tests.evil_mw", "--tools", str(tools), "--address", "127.0.0.1:0"])
    host = host_with(procs, tmp_path, int(tm.address.rsplit(":", 1)[1]), "timeout: 1", name="tm")
    assert (await _listed(host.address))["tm"].pending
    tools.with_suffix(".garbage").write_text("")
    tools.with_suffix(".hang").unlink()
    info = await _until_listed(host.address, "tm", lambda m: "does not parse" in m.last_error, "not said")
    assert info.pending, info
    assert "cannot be attached: middleware 'tm' failed in ListTools: protocol violation: an answer that" in (
        info.last_error
    ), info
    assert await _health(host.address) == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _reply(host.address, "held", UserMsg("hello"))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "required middleware tm (fail_closed) is not attached yet: cannot be attached" in (
        refused.value.details() or ""
    ), refused.value


async def test_listing_tools_again_never_holds_up_or_fails_a_hook_call(procs: Procs, tmp_path: Path) -> None:
    """A middleware with hooks and tools whose ListTools stops answering. One session's own hook
    call hangs (so the middleware is described again at the next call), and then its server is
    restarted (ListTools is asked again, aside): every other reply still completes, and the tools
    as last listed stay on offer until the new listing answers. Before (2e289cd), the hook call that
    re-described also waited for ListTools, and every reply of every session failed after a timeout."""
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"name": "t1", "description": "a tool"}]))
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "slow.json").write_text(json.dumps({"stop_reading": True}))
    port = unused_port()
    argv = ["-m", "tests.evil_mw", "--hooks", "on_reply", "--tools", str(tools), "--scripts", str(scripts)]
    argv += ["--address", f"127.0.0.1:{port}"]
    ev = procs.start("ev", argv)
    host = host_with(procs, tmp_path, port, "timeout: 1", name="ev")
    tools.with_suffix(".hang").write_text("")  # the tool source does not answer from now on
    _, items = await _reply(host.address, "slow", UserMsg("hello"))
    assert _end(items).finished_reason == ReplyFinishedReason.ERROR  # its own hang (fail_closed)
    await asyncio.sleep(1.2)  # the Describe that checks for a hang of the whole middleware answered
    for restart in (False, True):
        if restart:
            ev.stop()
            ev = procs.start("ev2", argv)
        for i in range(2):
            _, items = await _reply(host.address, f"s{restart}{i}", UserMsg("hello"))
            assert _end(items).finished_reason == ReplyFinishedReason.COMPLETED, (restart, i, items[-1])
    assert list((await _listed(host.address))["ev"].tools) == ["ev__t1"]  # as last listed
    tools.write_text(json.dumps([{"name": "t2", "description": "a tool"}]))
    tools.with_suffix(".hang").unlink()  # ListTools answers again, with another tool
    await _until_listed(host.address, "ev", lambda m: list(m.tools) == ["ev__t2"], "not listed again")


async def test_a_restarted_middleware_is_offered_with_its_tools_as_listed_again(procs: Procs, tmp_path: Path) -> None:
    """A middleware with tools only, restarted at its address as a new version with other tools:
    the host describes it again once its channel reconnects (no hook call would) and lists its
    tools again, so the next replies are offered the new tool and not the removed one, and
    ListMiddleware shows them. A version whose tools clash with another middleware's is refused as
    at attach: it contributes none (its old ones are not kept), its last error says why, and the
    next version that lists acceptable tools is offered again. Before, its tools were listed once,
    at attach: the model was offered the removed tool (NOT_FOUND when called), never the new one."""

    def toolset(name: str, key: str, tools: str) -> ServerProcess:
        argv = ["-m", "agentmw.sdk", "tests.host_util:ToolSetMiddleware", "--address", "127.0.0.1:{port}"]
        return procs.start(name, argv, env={"TOOLSET": tools, "TOOLSET_KEY": key})

    tm, other = toolset("tm", "tm", "alpha"), toolset("tm__x", "tmx", "y")
    config = tmp_path / "host.yaml"
    config.write_text(
        f"middleware:\n  - {{name: tm, address: {tm.address}, timeout: 2}}\n"
        f"  - {{name: tm__x, address: {other.address}, timeout: 2}}\n"
    )
    host = procs.host(tmp_path / "sessions.db", "--config", str(config))

    async def call(tool: str) -> str:
        _, items = await _reply(host.address, "", UserMsg(f"call {tool} text=hi"))
        assert isinstance(items[-1], Msg) and items[-1].finished_reason == ReplyFinishedReason.COMPLETED
        return items[-1].text

    async def new_version(
        tools: str, ok: Callable[[host_pb2.MiddlewareInfo], bool], what: str
    ) -> host_pb2.MiddlewareInfo:
        tm.kill()
        tm.env["TOOLSET"] = tools
        await asyncio.to_thread(tm.start)  # the same port
        return await _until_listed(host.address, "tm", ok, what)

    assert "alpha:hi" in await call("tm__alpha")
    await new_version("beta", lambda m: list(m.tools) == ["tm__beta"], "its new tools were not listed")
    assert "beta:hi" in await call("tm__beta")
    assert "You said: call tm__alpha" in await call("tm__alpha")  # no longer offered

    refused = await new_version("x__y,gamma", lambda m: not m.tools, "clashing tools were kept")
    assert "failed in ListTools: its tools as listed again are refused" in refused.last_error, refused
    assert "'tm__x__y' is already registered" in refused.last_error, refused
    assert list((await _listed(host.address))["tm__x"].tools) == ["tm__x__y"]  # the other keeps its own
    assert "You said: call tm__gamma" in await call("tm__gamma")
    # The middleware it clashed with leaves: the refused tools fit now, and are offered (before,
    # they stayed refused until the server listed them again, which nothing asked it to).
    async with grpc.aio.insecure_channel(host.address) as channel:
        await stub(channel).DetachMiddleware(host_pb2.DetachMiddlewareRequest(name="tm__x"), timeout=5)
    offered = lambda m: sorted(m.tools) == ["tm__gamma", "tm__x__y"]  # noqa: E731
    await _until_listed(host.address, "tm", offered, "refused tools not offered after the clash left")
    assert "gamma:hi" in await call("tm__gamma")

    await new_version("gamma", lambda m: list(m.tools) == ["tm__gamma"], "acceptable tools were not offered again")
    assert "gamma:hi" in await call("tm__gamma")


async def test_a_required_middleware_that_hangs_holds_replies_until_it_answers_again(
    procs: Procs, tmp_path: Path
) -> None:
    """Required (fail_closed) and hung (SIGSTOP: connected, silent): the reply that finds it so fails
    after its timeout; once a Describe gets no answer either (within the timeout), the replies
    after it are refused at once (UNAVAILABLE, saying which middleware and why, nothing stored)
    and the health check says NOT_SERVING, instead of each waiting the timeout in it. Once it
    answers again (SIGCONT), replies run with it."""
    port = unused_port()
    recorder = serve_at(procs, port)
    host = host_with(procs, tmp_path, port, "timeout: 1")
    _, items = await _reply(host.address, "before", UserMsg("hello"))
    assert _end(items).finished_reason == ReplyFinishedReason.COMPLETED

    os.kill(recorder.pid, signal.SIGSTOP)
    try:
        _, items = await _reply(host.address, "before", UserMsg("are you there?"))
        end = _end(items)
        assert end.finished_reason == ReplyFinishedReason.ERROR and "no answer within 1s" in end.error.message
        for _ in range(50):  # the Describe that confirms the hang: bounded wait
            if await _health(host.address) == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            await asyncio.sleep(0.1)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _reply(host.address, "held", UserMsg("hello"))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "required middleware rec (fail_closed) does not answer (no answer within 1s at" in (
            refused.value.details() or ""
        )
        with pytest.raises(grpc.aio.AioRpcError) as nothing:
            await get_session(host.address, "held")
        assert nothing.value.code() == grpc.StatusCode.NOT_FOUND, "a refused reply stores nothing"
        assert await _health(host.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        status = run_cli("clients.admin", "--host", host.address, "status")
        assert "rec at 127.0.0.1:" in status.stdout and "unresponsive" in status.stdout, status.stdout
    finally:
        os.kill(recorder.pid, signal.SIGCONT)

    for _ in range(150):  # it answers the host's next Describe (asked every second): bounded wait
        if await _health(host.address) == health_pb2.HealthCheckResponse.SERVING:
            break
        await asyncio.sleep(0.1)
    else:
        pytest.fail("the host did not take the middleware back once it answered:\n" + host.tail(30))
    session, items = await _reply(host.address, "held", UserMsg("hello again"))
    assert _end(items).finished_reason == ReplyFinishedReason.COMPLETED
    assert (await get_session(host.address, session))[2][KEY]["starts"] == 1  # it took part


async def test_a_watcher_that_is_down_leaves_the_host_serving(procs: Procs, tmp_path: Path) -> None:
    """A middleware whose hooks are all detached (a tracer), fail_closed by default: replies never
    wait for it, so its outage must not take the host out of a load balancer's rotation (it said
    NOT_SERVING while such a watcher could not be reached, while every reply completed)."""
    port = unused_port()
    watcher = serve_at(procs, port, "tests.conformance_mw:DetachedWatcher")
    host = host_with(procs, tmp_path, port, "timeout: 2", name="watch")
    _, items = await _reply(host.address, "s", UserMsg("hello"))
    assert _end(items).finished_reason == ReplyFinishedReason.COMPLETED
    watcher.kill()
    for _ in range(100):  # until the host has seen it go (bounded)
        status = run_cli("clients.admin", "--host", host.address, "status")
        if "watch at 127.0.0.1:" in status.stdout and "unreachable" in status.stdout:
            break
        await asyncio.sleep(0.1)
    else:
        pytest.fail("the host did not notice the watcher was gone:\n" + status.stdout)
    assert await _health(host.address) == health_pb2.HealthCheckResponse.SERVING
    _, items = await _reply(host.address, "s", UserMsg("still there?"))
    assert _end(items).finished_reason == ReplyFinishedReason.COMPLETED


async def test_a_middleware_attached_by_hand_ends_the_wait_for_one_of_its_name(procs: Procs, tmp_path: Path) -> None:
    """A required middleware that is down at start, attached by hand under its name from another
    address: replies run with that one (the host stops waiting for the configured address; before,
    the waiting went on and every reply stayed refused)."""
    host = host_with(procs, tmp_path, unused_port(), "timeout: 3")
    with pytest.raises(grpc.aio.AioRpcError, match="required middleware rec"):
        await _reply(host.address, "", UserMsg("hello"))
    recorder = procs.recorder()
    attached = run_cli(
        "clients.admin", "--host", host.address, "middleware", "attach", recorder.address, "--name", "rec"
    )
    assert attached.returncode == 0, attached.stderr
    session, items = await _reply(host.address, "", UserMsg("hello"))
    assert items[-1].finished_reason == ReplyFinishedReason.COMPLETED
    assert (await get_session(host.address, session))[2][KEY]["starts"] == 1  # it took part
    listed = json.loads(run_cli("clients.admin", "--host", host.address, "--json", "middleware", "list").stdout)
    assert [(m["name"], m["address"], m["pending"]) for m in listed] == [("rec", recorder.address, False)], listed


def test_bad_configuration_gives_one_clear_error(procs: Procs, tmp_path: Path) -> None:
    db = str(tmp_path / "x.db")
    # A server that answers, but not as a middleware may (it declares a hook it does not serve): the
    # host does not start (one that is down is waited for: the tests above).
    wrong = procs.start("wrong", ["-m", "tests.raw_mw", "unserved", "--address", "127.0.0.1:0"])
    argv = ["--db", db, "--listen", "127.0.0.1:0", "--middleware", f"budget={wrong.address}"]
    refused = run_cli("agent_host", *argv)
    assert refused.returncode == 1
    line = refused.stderr.strip().splitlines()[-1]
    assert "--middleware" in line and f"budget at {wrong.address}" in line and "Describe failed" in line, line
    assert "declares on_reasoning but does not serve it" in line, line

    malformed = tmp_path / "bad.yaml"
    malformed.write_text("listen: 127.0.0.1:0\nmiddleware: [budget\n  timeout: 3\n")
    bad = run_cli("agent_host", "--config", str(malformed), "--db", db)
    assert bad.returncode == 2
    assert f"{malformed}:3:" in bad.stderr and "malformed YAML" in bad.stderr and len(bad.stderr.splitlines()) == 1

    provider = tmp_path / "provider.yaml"
    provider.write_text("models:\n  models:\n    m1: {provider: nosuch}\n")
    bad = run_cli("agent_host", "--config", str(provider), "--db", db)
    assert bad.returncode == 2 and "unknown provider 'nosuch'" in bad.stderr and str(provider) in bad.stderr

    spaced = run_cli("agent_host", "--db", db, "--listen", "127.0.0.1:0", "--middleware", "my mw=127.0.0.1:9")
    assert spaced.returncode == 2 and "middleware name 'my mw' is not 1-64 of [a-zA-Z0-9_-]" in spaced.stderr

    # A misspelt setting: the key by name (it was "ChatModel.__init__() got an unexpected keyword").
    provider.write_text("models:\n  models:\n    m1: {provider: openai, model: gpt-4o}\n")
    bad = run_cli("agent_host", "--config", str(provider), "--db", db)
    assert bad.returncode == 2 and "model 'm1': unknown key 'model' for provider 'openai'" in bad.stderr, bad.stderr
    assert "model_name" in bad.stderr and "__init__" not in bad.stderr, bad.stderr


@pytest.mark.parametrize(
    ("yaml", "error"),
    [
        # One middleware's settings with the list's "- " forgotten: it became a middleware named
        # "address", or an error about a middleware[1] the file does not have.
        ("middleware:\n  address: 127.0.0.1:50181\n", "middleware: expected a list, got one mapping"),
        ("middleware:\n  name: timing\n  address: 127.0.0.1:50181\n", "middleware: expected a list, got one mapping"),
        # A network model's settings without its provider: the offline rule model answered for it.
        (
            "models:\n  default: gpt\n  models:\n    gpt: {model_name: gpt-4o-mini, base_url: 'http://127.0.0.1:1/v1'}\n",
            "models: model 'gpt': no provider (one of: dashscope, offline, openai)",
        ),
    ],
)
def test_a_setting_that_would_be_misread_is_a_configuration_error(tmp_path: Path, yaml: str, error: str) -> None:
    path = tmp_path / "host.yaml"
    path.write_text(yaml)
    with pytest.raises(ConfigError) as raised:
        load_config(path, env={}).build_models()
    assert str(raised.value) == f"{path}: {error}" or error in str(raised.value), raised.value


@pytest.mark.parametrize(
    ("yaml", "env", "flags", "error"),
    [
        ("listen: foo\n", {}, {}, "{path}: listen: 'foo' is not HOST:PORT"),
        ("", {"AGENTMW_LISTEN": "foo"}, {}, "environment AGENTMW_LISTEN: 'foo' is not HOST:PORT"),
        ("listen: 127.0.0.1:1\n", {}, {"listen": "foo"}, "flag --listen: 'foo' is not HOST:PORT"),
        ("log_level: verbose\n", {}, {}, "{path}: log_level: unknown level 'verbose'"),
        ("", {"AGENTMW_LOG_LEVEL": "verbose"}, {}, "environment AGENTMW_LOG_LEVEL: unknown level 'verbose'"),
        ("", {}, {"model": "gpt4"}, "models (the default model: flag --model): unknown model id 'gpt4'"),
        # TLS files: where they were given (it said "security.tls" for a flag too)
        ("security:\n  tls: {cert: c.pem}\n", {}, {}, "{path}: security.tls.cert: a TLS certificate needs its key"),
        ("", {"AGENTMW_TLS_KEY": "k.pem"}, {}, "environment AGENTMW_TLS_KEY: a TLS certificate needs its key"),
        # Digits that str.isdigit() takes: '²' ended in int()'s traceback, '٣٠٠٠' was port 3000.
        ("", {"AGENTMW_METRICS_PORT": "²"}, {}, "environment AGENTMW_METRICS_PORT: '²' is not a port number"),
        ("", {}, {"metrics_port": "٣٠٠٠"}, "flag --metrics-port: '٣٠٠٠' is not a port number"),
        ("", {}, {"listen": "127.0.0.1:²"}, "flag --listen: '127.0.0.1:²' is not HOST:PORT"),
    ],
)
def test_a_bad_setting_says_where_it_came_from(
    tmp_path: Path, yaml: str, env: dict[str, str], flags: dict[str, str], error: str
) -> None:
    """Each error names the file and key, the variable or the flag of the value (config.py's
    promise); these said only "listen:", "log_level:" or "models:" whatever the source."""
    path = tmp_path / "host.yaml"
    path.write_text(yaml or "{}\n")
    with pytest.raises(ConfigError) as raised:
        load_config(path, env=env, flags=flags).build_models()
    assert error.format(path=path) in str(raised.value), raised.value


def test_config_precedence_yaml_env_flags(tmp_path: Path) -> None:
    path = tmp_path / "host.yaml"
    path.write_text(
        "listen: 127.0.0.1:1000\ndb: yaml.db\n"
        "middleware:\n  - {name: budget, address: 127.0.0.1:1, fail_open: true, timeout: 3}\n"
        "  - {name: tts, address: 127.0.0.1:2}\n"
    )
    env = {"AGENTMW_LISTEN": "127.0.0.1:2000", "AGENTMW_DB": "env.db", "AGENTMW_MIDDLEWARE": "tts=127.0.0.1:22"}
    cfg = load_config(path, env=env, flags={"listen": "127.0.0.1:3000", "middleware": ["budget=127.0.0.1:11", "x=h:5"]})
    assert (cfg.listen, cfg.db) == ("127.0.0.1:3000", "env.db")
    assert [(m.name, m.address, m.fail_open, m.timeout) for m in cfg.middleware] == [
        ("budget", "127.0.0.1:11", True, 3.0),  # the flag's address, the YAML's policy
        ("tts", "127.0.0.1:22", False, 10.0),
        ("x", "h:5", False, 10.0),
    ]
    with pytest.raises(ConfigError, match=r"middleware\[0\]\.timeout: expected float"):
        path.write_text("middleware:\n  - {name: a, address: h:1, timeout: soon}\n")
        load_config(path, env={})


def test_a_negative_max_iters_is_a_configuration_error(tmp_path: Path) -> None:
    """agent.max_iters as ``agent.max_iters = ...`` takes it: 0 or more (-5 was accepted)."""
    path = tmp_path / "host.yaml"
    path.write_text("agent: {max_iters: 0}\n")
    assert load_config(path, env={}).max_iters == 0  # the final answer at once, as AgentScope
    path.write_text("agent: {max_iters: -5}\n")
    bad = run_cli("agent_host", "--config", str(path), "--db", ":memory:", "--listen", "127.0.0.1:0")
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert bad.stderr.strip() == (
        f"agent-host: configuration error: {path}: agent.max_iters: max_iters must be 0 or more, not -5"
    )


def test_middleware_from_the_environment_takes_what_the_flag_takes() -> None:
    """AGENTMW_MIDDLEWARE holds --middleware values separated by commas; a replica list
    (``ipv4:a,b``, README) keeps its own (its second address became a middleware of its own)."""
    values = ["127.0.0.1:50185", "clock=ipv4:127.0.0.1:50183,127.0.0.1:50184", "tts=ipv6:[::1]:50186,[::1]:50187"]
    from_flags = load_config(env={}, flags={"middleware": values}).middleware
    from_env = load_config(env={"AGENTMW_MIDDLEWARE": ",".join(values)}).middleware
    assert (
        [(m.name, m.address) for m in from_env]
        == [(m.name, m.address) for m in from_flags]
        == [
            ("", "127.0.0.1:50185"),
            ("clock", "ipv4:127.0.0.1:50183,127.0.0.1:50184"),
            ("tts", "ipv6:[::1]:50186,[::1]:50187"),
        ]
    )


@pytest.mark.parametrize(
    ("module", "says"),
    [
        ("clients.demo", "usage: python -m clients.demo"),  # it ran the whole demo
        ("mw_servers.tracing", "default 127.0.0.1:50075"),  # the servers' addresses had no default shown
        ("mw_servers.tts", "default 127.0.0.1:50081"),
        ("mw_servers.mem0", "default 127.0.0.1:50077"),
    ],
)
def test_help_says_what_it_does_and_its_defaults(module: str, says: str) -> None:
    done = run_cli(module, "--help", timeout=30)
    assert done.returncode == 0 and says in " ".join(done.stdout.split()), done.stdout + done.stderr


@pytest.mark.timeout(120)
def test_demo_completes(tmp_path: Path) -> None:
    # What another user's demo left in the shared temporary directory: the demo wrote its audio to
    # the fixed TMPDIR/agentmw-demo-audio, so it could save none (and two demos overwrote each other's).
    (tmp_path / "agentmw-demo-audio").write_text("another user's\n")
    # ~16 s alone; the mem0 server loads its model first, which takes much longer on a loaded machine.
    done = run_cli("clients.demo", timeout=100, env={"TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    out = done.stdout
    assert "agentmw demo: OK" in out
    speech = re.search(r"^── speech \(the tts server\): (\d+) WAV files in (\S+);", out, re.M)
    assert speech, out  # a directory of this run's own, named where the files are
    audio = Path(speech[2])
    assert audio.parent == tmp_path and audio.name.startswith("agentmw-demo-audio-"), audio
    assert len(list(audio.glob("*.wav"))) == int(speech[1]) > 0
    # What each example middleware did, as the demo prints it (see clients/demo.py).
    sections = re.split(r"^── ", out, flags=re.M)[1:]
    steps = [s for s in sections if re.match(r"\d+\. ", s)]

    def step(title: str) -> str:
        return next(s for s in steps if title in s.splitlines()[0])

    assert len(steps) >= 7, out
    timings = [json.loads(t) for t in re.findall(r"^  · timing: (\{.*\})$", out, re.M)]
    assert len(timings) == len(steps) and all(t["reply_seconds"] > 0 for t in timings), timings  # each reply
    assert len({t["reply_id"] for t in timings}) == len(steps)
    prompt = step("dynamic system prompt")
    assert "## Current Context" in prompt and 'Session: {"session_started": ' in prompt  # dynamic_prompt
    outage = step("model outage")
    assert "This is the backup model" in outage and "· model call: backup" in outage  # fallback
    budget = step("token budget")  # the budget server withholds the tools once the budget is used
    exhausted = re.search(r"^  · budget_exhausted: (\{.*\})$", budget, re.M)
    assert exhausted and json.loads(exhausted[1])["used"] >= json.loads(exhausted[1])["budget"], budget
    after = budget[exhausted.end() :]
    assert "→ get_weather" not in after and "Done:" in after
    assert re.search(r"^── the traces of the conversation", out, re.M)  # the tracing server's spans
    recalled = step("recalled in another new session")  # mem0: a fact of one session in another
    answer = recalled.split("[you] What is my favourite colour?", 1)[1]
    assert "My favourite colour is teal." in answer, recalled
    slots = {m[0]: m[1] for m in re.findall(r"^    (\w+) +\[\w+\]: (.*)$", out, re.M)}
    assert set(slots) >= {"budget", "tracing", "tts", "dynamic_prompt", "fallback", "rate_limit", "timing"}, out
    assert set(json.loads(slots["dynamic_prompt"])) == {"session_started"}
    fallback = json.loads(slots["fallback"])
    assert (fallback["switches"], fallback["to"]) == (1, "backup") and "simulated outage" in fallback["last_error"]
    # The rate limiter is inside the fallback: it counts every model call of the session, the failed
    # one too (the steps in new sessions count in their own slots).
    same_session = [s for s in steps if "new session" not in s.splitlines()[0]]
    model_calls = sum(len(re.findall(r"^  · model call: ", s, re.M)) for s in same_session)
    assert json.loads(slots["rate_limit"])["calls"] == model_calls + fallback["switches"]


def test_a_slot_holding_nan_reads_as_json_any_parser_takes() -> None:
    """GetSession's middle_context_json is JSON (host.proto): a slot holding NaN or an infinity (a
    middleware may set one: a Value's number takes them) is written as proto3's JSON mapping writes
    them, as strings. Before, the text held the tokens NaN and Infinity, which JSON parsers outside
    Python refuse."""
    from agent_host.service.host import Host
    from agentmw.data.state import AgentState

    state = AgentState(middle_context={"m": {"x": float("nan"), "y": [1.5, float("inf"), -float("inf")], "z": 2}})

    def strict(token: str) -> None:
        raise ValueError(f"not JSON: {token}")

    assert json.loads(Host.middle_context_json(state), parse_constant=strict) == {
        "m": {"x": "NaN", "y": [1.5, "Infinity", "-Infinity"], "z": 2}
    }
