"""The host's gRPC API as a client written from host.proto uses it: what each call answers when
sessions are busy, deleted or interrupted, and what a client may leave unset. One host for the
module (a slow offline model, so that replies overlap)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent_host.service.server import STOP_GRACE
from agentmw.codec import codec
from agentmw.data import (
    ConfirmResult,
    Msg,
    ReplyEndEvent,
    ReplyFinishedReason,
    RequireUserConfirmEvent,
    UserConfirmResultEvent,
    UserMsg,
)
from agentmw.v1 import host_pb2
from clients.launch import ServerProcess, middleware_server

from .host_util import SLOW_MODEL, Procs, get_session, processes, stub
from .host_util import reply_once as reply

pytestmark = pytest.mark.timeout(60)

LONG = " ".join(f"w{i}" for i in range(60))  # about 1.2 s of the slow model's words


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("api")
    (tmp / "host.yaml").write_text(SLOW_MODEL)
    with processes(tmp) as procs:
        yield procs.host(tmp / "s.db", "--config", str(tmp / "host.yaml"))


def ended(items: list[object]) -> ReplyFinishedReason:
    return next(i for i in items if isinstance(i, ReplyEndEvent)).finished_reason


async def test_messages_without_an_id_get_one_each(host: ServerProcess) -> None:
    """proto3 leaves Msg.id empty unless the client sets it: the host gives such a message an id
    of its own, so a second one in the session is a new message. Before, the first was stored
    with id "" and every later one was refused as already answered (ALREADY_EXISTS)."""
    first, second = UserMsg("one"), UserMsg("two")
    first.id = second.id = ""
    session, items = await reply(host.address, "", first)
    assert ended(items) == ReplyFinishedReason.COMPLETED
    _, items = await reply(host.address, session, second)
    assert ended(items) == ReplyFinishedReason.COMPLETED


async def test_a_resumption_event_needs_its_session(host: ServerProcess) -> None:
    """A resumption event with no session_id is INVALID_ARGUMENT (there is nothing to resume in a
    new session). Before: NOT_FOUND naming an id the host had just made up."""
    event = host_pb2.StartReply()
    event.user_interrupt.SetInParent()
    async with grpc.aio.insecure_channel(host.address) as channel:
        call = stub(channel).Reply(iter([host_pb2.ReplyRequest(start=event)]), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in call:
                pass
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "a resumption event needs its session's session_id"


async def test_interrupt_ends_the_running_reply_not_those_waiting_for_the_session(host: ServerProcess) -> None:
    """InterruptReply interrupts the reply that runs; a message of another client waiting for the
    session behind it then runs as usual. Before, the waiting one was cancelled too ('interrupted
    before it began'), its message dropped."""
    session, _ = await reply(host.address, "", UserMsg("hello"))
    running = asyncio.create_task(reply(host.address, session, UserMsg(LONG)))
    await asyncio.sleep(0.4)
    waiting = asyncio.create_task(reply(host.address, session, UserMsg("and then this")))
    await asyncio.sleep(0.3)
    async with grpc.aio.insecure_channel(host.address) as channel:
        done = await stub(channel).InterruptReply(host_pb2.InterruptReplyRequest(session_id=session), timeout=10)
    assert done.interrupted
    assert ended((await running)[1]) == ReplyFinishedReason.INTERRUPTED
    assert ended((await waiting)[1]) == ReplyFinishedReason.COMPLETED


async def test_a_session_a_reply_runs_in_is_not_deleted_and_the_delete_does_not_wait(host: ServerProcess) -> None:
    """DeleteSession while a reply runs is FAILED_PRECONDITION at once, naming what to do; once
    the reply ended the session is deleted. Before, the delete waited for the reply without bound
    (DEADLINE_EXCEEDED for a reply whose client stopped reading)."""
    session, _ = await reply(host.address, "", UserMsg("hello"))
    running = asyncio.create_task(reply(host.address, session, UserMsg(LONG)))
    await asyncio.sleep(0.4)
    request = host_pb2.DeleteSessionRequest(session_id=session)
    async with grpc.aio.insecure_channel(host.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub(channel).DeleteSession(request, timeout=0.8)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.value
        assert "interrupt it with InterruptReply, or delete it once it ended" in (refused.value.details() or "")
        assert ended((await running)[1]) == ReplyFinishedReason.COMPLETED
        assert (await stub(channel).DeleteSession(request, timeout=10)).deleted


async def test_sessions_are_listed_most_recently_updated_first_within_a_second(host: ServerProcess) -> None:
    """Replies in A, then B, then A again, all within a second or so: A is listed first. Before
    (SQLite), times were kept to the second and ties went by creation, so B came first."""
    fast = UserMsg("hi")
    a, _ = await reply(host.address, "", fast)
    b, _ = await reply(host.address, "", UserMsg("hi"))
    await reply(host.address, a, UserMsg("again"))
    async with grpc.aio.insecure_channel(host.address) as channel:
        listed = await stub(channel).ListSessions(host_pb2.ListSessionsRequest(limit=2), timeout=10)
    assert [s.session_id for s in listed.sessions] == [a, b]
    assert all(len(s.updated_at) == len("2026-12-02T05:40:01+00:00") for s in listed.sessions), listed


async def test_the_first_reply_event_names_the_session_once_its_message_is_stored(procs: Procs, tmp_path: Path) -> None:
    """The host sends the first ReplyEvent, with no item, as soon as it has stored the user's
    message, though an on_reply middleware holds the ReplyStartEvent: the client knows the session
    the host minted, and when the host dies mid-reply the restarted one shows the message in it.
    Before, the client heard nothing until the first item passed the middleware: a host that died
    meanwhile left a session stored that the client could not name. A refused reply still gets
    no ReplyEvent, only its status."""
    held = procs.start("held", ["-m", "tests.raw_mw", "hold_first", "--address", "127.0.0.1:0"])
    db = tmp_path / "s.db"
    host = procs.host(db, "--middleware", f"held={held.address}")
    start = host_pb2.StartReply()
    codec.encode(UserMsg("hello"), start.message)
    async with grpc.aio.insecure_channel(host.address) as channel:
        call = stub(channel).Reply(iter([host_pb2.ReplyRequest(start=start)]), timeout=30)
        first = await asyncio.wait_for(call.read(), 15)
        assert first.session_id and not first.items, first
        sid = first.session_id
        assert held.wait_for_line("holding the first item") == f"holding the first item, reply_start of session {sid}"
        listed = await stub(channel).ListSessions(host_pb2.ListSessionsRequest(), timeout=10)
        assert [s.session_id for s in listed.sessions] == [sid]

        busy = host_pb2.StartReply(session_id=sid, refuse_if_busy=True)
        codec.encode(UserMsg("me too"), busy.message)
        refused = stub(channel).Reply(iter([host_pb2.ReplyRequest(start=busy)]), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as busy_status:
            got = await refused.read()  # the status, not a ReplyEvent
            pytest.fail(f"a refused reply got a ReplyEvent: {got}")
        assert busy_status.value.code() == grpc.StatusCode.ABORTED

        host.kill()
        with pytest.raises(grpc.aio.AioRpcError) as broke:
            async with asyncio.timeout(15):
                while (more := await call.read()) is not grpc.aio.EOF:
                    assert not more.items, f"the held reply went on: {more}"
        assert broke.value.code() == grpc.StatusCode.UNAVAILABLE
    again = procs.host(db, name="host2")
    _, state, _ = await get_session(again.address, sid)
    assert [m.text for m in state.context if m.role.value == "user"] == ["hello"]


async def test_a_resumption_is_accepted_at_once_too(procs: Procs, tmp_path: Path) -> None:
    """A resumption event gets its first ReplyEvent, with no item, once the host has checked it
    against the parked reply, while an on_reply middleware holds the resumed reply's first item:
    the client knows it was taken, not refused. Before, it heard nothing until the item passed."""
    host = procs.host(tmp_path / "s.db")
    sid, items = await reply(host.address, "", UserMsg("email bob@example.com saying hi"))
    ask = next(i for i in items if isinstance(i, RequireUserConfirmEvent))
    final = items[-1]
    assert isinstance(final, Msg) and ask.tool_calls, items
    held = procs.start("held", ["-m", "tests.raw_mw", "hold_first", "--address", "127.0.0.1:0"])
    answer = UserConfirmResultEvent(
        reply_id=final.id, confirm_results=[ConfirmResult(confirmed=True, tool_call=c) for c in ask.tool_calls]
    )
    start = host_pb2.StartReply(session_id=sid)
    codec.encode(answer, start.user_confirm_result)
    async with grpc.aio.insecure_channel(host.address) as channel:
        await stub(channel).AttachMiddleware(host_pb2.AttachMiddlewareRequest(name="held", address=held.address))
        call = stub(channel).Reply(iter([host_pb2.ReplyRequest(start=start)]), timeout=30)
        try:
            first = await asyncio.wait_for(call.read(), 15)
            assert first.session_id == sid and not first.items, first
            assert held.wait_for_line("holding the first item").startswith("holding the first item, tool_")
        finally:
            call.cancel()


def test_codec_round_trips_the_empty_id() -> None:
    """(What the first test relies on: an unset Msg.id decodes as "", not as a fresh id.)"""
    msg = UserMsg("x")
    msg.id = ""
    assert codec.decode(codec.encode(msg)).id == ""


async def test_a_health_watch_hears_of_an_outage_and_the_drain_and_ends_with_the_host(procs: Procs) -> None:
    """gRPC's client-side health checking Watches: a fail_closed middleware going away, then a
    SIGHUP (a drain, as SIGTERM), reach the watcher by themselves; the stream ends when the host
    stops, and the host exits at once and cleanly. Before, Watch heard of nothing that no Check
    asked about, an open Watch held the stop for its whole grace, and SIGHUP killed the host
    outright (nothing drained)."""
    recorder = middleware_server("tests.host_util:RecorderMiddleware")  # restarts on its port
    procs.procs.append(recorder.start())
    host = procs.host(procs.log_dir / "s.db", "--middleware", f"rec={recorder.address}")
    statuses: list[int] = []
    async with grpc.aio.insecure_channel(host.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
        reading = asyncio.create_task(_collect(watch, statuses))
        await _until(lambda: statuses[-1:] == [health_pb2.HealthCheckResponse.SERVING])
        recorder.kill()
        await _until(lambda: statuses[-1:] == [health_pb2.HealthCheckResponse.NOT_SERVING])
        await asyncio.to_thread(recorder.restart)
        await _until(lambda: statuses[-1:] == [health_pb2.HealthCheckResponse.SERVING])
        stopped = time.monotonic()
        host.popen.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
        assert await asyncio.to_thread(host.popen.wait, 10) == 0  # type: ignore[union-attr]
        assert time.monotonic() - stopped < STOP_GRACE / 2
        async with asyncio.timeout(5):
            await reading
    assert statuses[-1] == health_pb2.HealthCheckResponse.NOT_SERVING, statuses


async def _collect(watch: Any, statuses: list[int]) -> None:
    with contextlib.suppress(grpc.aio.AioRpcError):
        async for answer in watch:
            statuses.append(answer.status)


async def _until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.05)
