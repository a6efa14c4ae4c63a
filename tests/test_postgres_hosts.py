"""Many hosts on one PostgreSQL session store: one writer per session (leases with fencing),
takeover after a crash or a pause, cross-host interrupt, HITL resumed elsewhere, graceful drain.

Real processes throughout: a throwaway PostgreSQL cluster started for this module (as the
``postgres`` user when the tests run as root), 2-3 hosts on one database per test, and the
side-effect middleware of tests/durable_mw.py, whose tools append a line per run to a file, so a
test counts how often a tool really ran whatever happened to the hosts.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent_host.security import client_channel, token_digest
from agent_host.store.postgres import REACHABLE_TIMEOUT, SCHEMA_VERSION, PostgresStore
from agentmw.data import (
    ConfirmResult,
    Msg,
    ReplyEndEvent,
    ReplyFinishedReason,
    ReplyStartEvent,
    RequireUserConfirmEvent,
    Role,
    TextBlockDeltaEvent,
    ToolCallBlock,
    ToolResultBlock,
    ToolResultStartEvent,
    ToolResultState,
    UserConfirmResultEvent,
    UserMsg,
)
from agentmw.v1 import host_pb2
from clients.chat import HostClient
from clients.launch import ServerProcess, start_all
from clients.postgres import ABSENT, create_database, pg_bin, throwaway_cluster
from tests.certs import pki

from .durable_mw import lines
from .host_util import Procs, get_session, run_cli, stub
from .test_durable_sessions import calls_and_results, reply, user_texts, wait_until
from .test_durable_store import keeps_its_title
from .test_security import TOKENS
from .test_security import reply as secure_reply

pytestmark = pytest.mark.timeout(60)

LEASE = "2"  # seconds: short, so a paused or killed host loses its sessions quickly


# ---------------------------------------------------------------------------------------------
# A throwaway PostgreSQL cluster for the module, a fresh database per test.


@pytest.fixture(scope="module")
def pg_server() -> Iterator[str]:
    """The DSN of the cluster's maintenance database; the cluster is stopped and removed at the end."""
    bindir = pg_bin()
    if bindir is None:
        pytest.skip(ABSENT)
    try:
        with throwaway_cluster(bindir) as dsn:
            yield dsn
    except RuntimeError as exc:
        raise AssertionError(str(exc)) from None


_databases = itertools.count()


@pytest.fixture
async def dsn(pg_server: str) -> str:
    return await create_database(pg_server, f"agentmw_{os.getpid()}_{next(_databases)}")


SLOW = "models:\n  default: slow\n  models:\n    slow: {provider: offline, delay: %s}\n"


def cluster(
    procs: Procs,
    tmp_path: Path,
    dsn: str,
    n: int,
    *args: str,
    delay: float = 0.0,
    yaml: str = "",
    fx: str = "SideEffects",
    fx_args: dict[str, object] | None = None,
) -> tuple[Path, list[ServerProcess]]:
    """The side-effect middleware (``fx``: its class in tests/durable_mw.py, given ``fx_args`` too)
    and ``n`` hosts on ``dsn`` (``yaml``: more of host.yaml), started together; the effects file."""
    effects, config = tmp_path / "effects.txt", tmp_path / "host.yaml"
    config.write_text(SLOW % delay + yaml)
    argv = ["-m", "agentmw.sdk", f"tests.durable_mw:{fx}", "--address", "127.0.0.1:0"]
    for name, value in {"path": str(effects), **(fx_args or {})}.items():
        argv += ["--arg", f"{name}={json.dumps(value)}"]
    fx_server = procs.start("fx", argv)
    settings = ["--db", dsn, "--config", str(config), "--middleware", f"fx={fx_server.address}"]
    settings += ["--lease", LEASE, *args]
    hosts = [
        ServerProcess(
            ["-m", "agent_host", "--listen", "127.0.0.1:0", *settings],
            name=f"host{i}",
            log_dir=procs.log_dir,
            startup=30,
            new_session=True,
        )
        for i in range(n)
    ]
    procs.procs += hosts
    return effects, start_all(hosts)


async def ending(items: list[object]) -> ReplyFinishedReason:
    return next(i for i in items if isinstance(i, ReplyEndEvent)).finished_reason


async def taken_over(stream: AsyncIterator[object]) -> grpc.aio.AioRpcError:
    """The error ending a paused host's reply stream once it is resumed after another host took
    its session over (bounded)."""
    with pytest.raises(grpc.aio.AioRpcError) as lost:
        async with asyncio.timeout(20):
            async for _item in stream:
                pass
    return lost.value


def contiguous_turns(state: object) -> list[str]:
    """The user turns in order, checking that each turn's messages follow it with no other turn's
    tool calls among them (two replies writing at once would interleave or overwrite rows)."""
    turns: list[str] = []
    for msg in state.context:  # type: ignore[attr-defined]
        if msg.role == Role.USER:
            turns.append(msg.text)
            continue
        for block in msg.content:
            if getattr(block, "type", "") == "tool_call":
                assert json.loads(block.input)["text"] in turns[-1], (block.input, turns[-1])
    return turns


# ---------------------------------------------------------------------------------------------


async def test_two_replies_to_one_session_on_two_hosts_run_one_after_the_other(
    procs: Procs, tmp_path: Path, dsn: str
) -> None:
    effects, (a, b) = cluster(procs, tmp_path, dsn, 2, delay=0.02)
    session, _ = await reply(a.address, "", UserMsg("hello"))
    order: list[str] = []

    async def turn(host: ServerProcess, text: str) -> list[object]:
        async with HostClient(host.address) as client:
            items = []
            async with asyncio.timeout(30):
                async for item in client.reply(session, UserMsg(f"call fx__slow_note text={text} seconds=0.5")):
                    if isinstance(item, ReplyStartEvent):
                        order.append(f"start {text}")
                    items.append(item)
            order.append(f"end {text}")
            return items

    first, second = await asyncio.gather(turn(a, "one"), turn(b, "two"))
    assert await ending(first) == await ending(second) == ReplyFinishedReason.COMPLETED
    assert order in (
        ["start one", "end one", "start two", "end two"],
        ["start two", "end two", "start one", "end one"],
    ), order
    _, state, _ = await get_session(b.address, session)
    turns = contiguous_turns(state)
    assert turns[0] == "hello" and sorted(turns[1:]) == sorted(
        f"call fx__slow_note text={t} seconds=0.5" for t in ("one", "two")
    ), turns
    assert sorted(lines(effects)) == ["one", "two"], "each turn's tool ran once"
    calls, results = calls_and_results(state)
    assert len(calls) == 2 and set(results) == {c.id for c in calls}


async def test_a_host_killed_during_a_tool_the_client_retries_on_another(
    procs: Procs, tmp_path: Path, dsn: str
) -> None:
    effects, (a, b) = cluster(procs, tmp_path, dsn, 2)
    ask = UserMsg("call fx__note text=first then call fx__slow_note text=second seconds=60")
    async with HostClient(a.address) as client:
        call = client.reply("", ask)
        with pytest.raises(grpc.aio.AioRpcError):  # the host dies under the stream
            async with asyncio.timeout(20):
                async for item in call:
                    if isinstance(item, ToolResultStartEvent) and item.tool_call_name == "fx__slow_note":
                        await wait_until(lambda: lines(effects) == ["first", "second"])
                        a.kill()
    session = call.session_id

    # The client sends the same message (same id) to another host: it waits out A's lease, closes
    # A's reply and continues the stored turn, never storing the message or running a tool again.
    _, items = await reply(b.address, session, ask)
    assert await ending(items) == ReplyFinishedReason.COMPLETED
    assert "may or may not have taken effect" in items[-1].text, items[-1].text
    assert lines(effects) == ["first", "second"], "each tool ran once"
    _, state, _ = await get_session(b.address, session)
    assert user_texts(state) == [ask.text], "the user message is stored once"
    calls, results = calls_and_results(state)
    assert [c.name for c in calls] == ["fx__note", "fx__slow_note"]
    assert set(results) == {c.id for c in calls}, "every tool call has a result"
    assert results[calls[0].id].state == ToolResultState.SUCCESS
    assert results[calls[1].id].state == ToolResultState.ERROR

    with pytest.raises(grpc.aio.AioRpcError) as again:  # a retry of a finished reply is refused
        await reply(b.address, session, ask)
    assert again.value.code() == grpc.StatusCode.ALREADY_EXISTS


async def test_a_paused_host_past_its_lease_can_neither_save_nor_start_a_tool(
    procs: Procs, tmp_path: Path, dsn: str
) -> None:
    effects, (a, b) = cluster(procs, tmp_path, dsn, 2)
    ask = UserMsg("call fx__slow_note text=a seconds=3 then call fx__note text=b")
    async with HostClient(a.address) as client:
        call = client.reply("", ask)
        stream = aiter(call)
        async with asyncio.timeout(20):
            async for item in stream:
                if isinstance(item, ToolResultStartEvent):
                    await wait_until(lambda: lines(effects) == ["a"])
                    os.kill(a.pid, signal.SIGSTOP)  # paused while fx__slow_note runs, past its lease
                    break
        session = call.session_id
        try:
            # Host B takes the session once A's lease expires, closes A's reply, and runs its own.
            _, items = await reply(b.address, session, UserMsg("call fx__note text=c"))
            assert await ending(items) == ReplyFinishedReason.COMPLETED
            _, taken, _ = await get_session(b.address, session)
        finally:
            os.kill(a.pid, signal.SIGCONT)
        lost = await taken_over(stream)  # A: its writes are refused
    assert lost.code() == grpc.StatusCode.ABORTED, lost.details()
    assert "taken over by another host" in lost.details()
    await asyncio.sleep(0.5)  # anything A might still do (it must not) has had time to land
    assert lines(effects) == ["a", "c"], "A started no tool after losing the lease"
    _, state, _ = await get_session(b.address, session)
    assert host_pb2_state(state) == host_pb2_state(taken), "the stored state is B's"
    assert user_texts(state) == [ask.text, "call fx__note text=c"]
    # In order (each host's offline model numbers its calls from 1: ids repeat across hosts).
    blocks = [b for m in state.context for b in m.content]
    calls = [b for b in blocks if isinstance(b, ToolCallBlock)]
    results = [b for b in blocks if isinstance(b, ToolResultBlock)]
    assert [c.name for c in calls] == [r.name for r in results] == ["fx__slow_note", "fx__note", "fx__note"]
    assert "may or may not have taken effect" in str(results[0].output), "A's call, closed by B"
    assert "it was not run" in str(results[1].output)
    assert "noted c" in str(results[2].output)


async def test_a_host_that_lost_its_lease_while_on_acting_held_a_call_does_not_run_the_tool(
    procs: Procs, tmp_path: Path, dsn: str
) -> None:
    """Host A records a tool's start, then a remote on_acting hook holds the call (3 s) while A is
    paused past its lease; B takes the session over and closes the call as "may or may not have
    taken effect". A, continued, must not run the tool. Before, the lease was checked only when
    the start was recorded, and A ran the tool after the takeover."""
    marks = tmp_path / "marks.txt"
    hold = 3.0
    effects, (a, b) = cluster(procs, tmp_path, dsn, 2, fx="HeldActing", fx_args={"marks": str(marks), "hold": hold})
    async with HostClient(a.address) as client:
        call = client.reply("", UserMsg("call fx__note text=held_a"))
        stream = aiter(call)
        async with asyncio.timeout(20):
            async for item in stream:
                if isinstance(item, ToolResultStartEvent):
                    break
            await wait_until(lambda: "acting held_a" in lines(marks))  # the start is recorded
        os.kill(a.pid, signal.SIGSTOP)
        held_since = time.monotonic()
        session = call.session_id
        try:
            _, items = await reply(b.address, session, UserMsg("call fx__note text=b"))
            assert await ending(items) == ReplyFinishedReason.COMPLETED
            # The hook's hold ends while A is paused: its call of the tool waits for A.
            await asyncio.sleep(hold + 0.5 - (time.monotonic() - held_since))
        finally:
            os.kill(a.pid, signal.SIGCONT)
        lost = await taken_over(stream)  # A: its writes are refused
    assert lost.code() == grpc.StatusCode.ABORTED, lost.details()
    assert "taken over by another host" in lost.details()
    await asyncio.sleep(0.5)  # a tool A might still run (it must not) has had time to
    assert lines(effects) == ["b"], "A ran no tool after losing the lease"
    _, state, _ = await get_session(b.address, session)
    calls, _ = calls_and_results(state)
    # In order (each host's offline model numbers its calls from 1: ids repeat across hosts).
    outputs = [str(r.output) for m in state.context for r in m.content if isinstance(r, ToolResultBlock)]
    assert len(calls) == len(outputs) == 2, outputs
    assert "may or may not have taken effect" in outputs[0] and "noted b" in outputs[1], outputs


async def test_a_host_paused_inside_a_write_does_not_block_the_takeover(procs: Procs, tmp_path: Path, dsn: str) -> None:
    """Host A is paused inside one of its write transactions, which holds the session's lease row
    locked; B still takes the session over about a lease later, and A's write is refused when A is
    continued. Before, B's reply waited on that lock for as long as A stayed paused (the pool set
    no idle_in_transaction_session_timeout)."""
    effects, (a, b) = cluster(procs, tmp_path, dsn, 2)
    monitor, probe = await asyncpg.connect(dsn), await asyncpg.connect(dsn)  # probe: pg_stat_activity is fresh
    try:
        async with HostClient(a.address) as client:
            call = client.reply("", UserMsg("call fx__slow_note text=a seconds=0.5"))
            stream = await started_tool(call, effects, ["a"])
            session = call.session_id
            # The session's row locked: A's write of the result waits in its transaction, the lease row locked.
            held = monitor.transaction()
            await held.start()
            await monitor.execute("SELECT 1 FROM agentmw_sessions WHERE session_id = $1 FOR UPDATE", session)
            waiting = (
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND query LIKE '%INSERT INTO agentmw_sessions%'"
            )
            await wait_until_async(lambda: probe.fetchval(waiting), 1)
            os.kill(a.pid, signal.SIGSTOP)
            await held.rollback()  # A's statement ends; its transaction stays open while A is paused
            try:
                started = time.monotonic()
                async with asyncio.timeout(15):
                    _, items = await reply(b.address, session, UserMsg("call fx__note text=b"))
                took = time.monotonic() - started
            finally:
                os.kill(a.pid, signal.SIGCONT)
            lost = await taken_over(stream)  # A: its writes are refused
    finally:
        await monitor.close()
        await probe.close()
    assert await ending(items) == ReplyFinishedReason.COMPLETED
    assert took < 3 * float(LEASE), f"B took the session over after {took:.1f}s"
    assert lost.code() == grpc.StatusCode.ABORTED, lost.details()
    assert lines(effects) == ["a", "b"]
    _, state, _ = await get_session(b.address, session)
    outputs = [str(r.output) for m in state.context for r in m.content if isinstance(r, ToolResultBlock)]
    assert len(outputs) == 2 and "may or may not have taken effect" in outputs[0] and "noted b" in outputs[1]


def host_pb2_state(state: object) -> bytes:
    from agentmw.codec import codec

    return codec.encode(state).SerializeToString(deterministic=True)


async def test_a_reply_parked_on_a_host_that_died_is_confirmed_on_another(
    procs: Procs, tmp_path: Path, dsn: str
) -> None:
    effects, (a, b) = cluster(procs, tmp_path, dsn, 2)
    session, items = await reply(a.address, "", UserMsg("call fx__confirmed_note text=hello"))
    asking = next(i for i in items if isinstance(i, RequireUserConfirmEvent)).tool_calls[0]
    reply_id = next(i for i in items if isinstance(i, Msg)).id
    a.kill()

    confirm = UserConfirmResultEvent(
        reply_id=reply_id, confirm_results=[ConfirmResult(confirmed=True, tool_call=asking)]
    )
    _, items = await reply(b.address, session, confirm)
    end = next(i for i in items if isinstance(i, ReplyEndEvent))
    assert end.finished_reason == ReplyFinishedReason.COMPLETED and end.reply_id == reply_id, "the same reply"
    assert not any(isinstance(i, ReplyStartEvent) for i in items)
    assert lines(effects) == ["hello"]

    async with grpc.aio.insecure_channel(b.address) as channel:  # one host's middleware alone: refused
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub(channel).DetachMiddleware(host_pb2.DetachMiddlewareRequest(name="fx"), timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "shares its session store" in refused.value.details()


async def test_interrupt_sent_to_one_host_ends_a_reply_running_on_another(
    procs: Procs, tmp_path: Path, dsn: str
) -> None:
    effects, (a, b) = cluster(procs, tmp_path, dsn, 2, "--lease", "30")  # the notification, not the expiry
    async with HostClient(a.address) as client, grpc.aio.insecure_channel(b.address) as channel:
        call = client.reply("", UserMsg("call fx__slow_note text=long seconds=60"))
        items = []
        async with asyncio.timeout(20):
            async for item in call:
                items.append(item)
                if isinstance(item, ToolResultStartEvent):
                    await wait_until(lambda: lines(effects) == ["long"])
                    answer = await stub(channel).InterruptReply(
                        host_pb2.InterruptReplyRequest(session_id=call.session_id), timeout=10
                    )
                    assert answer.interrupted
        assert await ending(items) == ReplyFinishedReason.INTERRUPTED
        _, items = await reply(b.address, call.session_id, UserMsg("hi"))  # the lease was released
        assert await ending(items) == ReplyFinishedReason.COMPLETED
        idle = await stub(channel).InterruptReply(host_pb2.InterruptReplyRequest(session_id=call.session_id))
        assert not idle.interrupted, "nothing runs any more"


async def test_a_host_listens_again_after_its_notification_connection_is_lost(
    procs: Procs, tmp_path: Path, dsn: str
) -> None:
    """The database ends the hosts' LISTEN connections (as a restart or a failover does): they
    listen again, so an interrupt sent to B reaches A's reply at once, not with A's next lease
    renewal (every 20 s here). Before, the connection was never opened again."""
    effects, (a, b) = cluster(procs, tmp_path, dsn, 2, "--lease", "60")
    listeners = (
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'LISTEN%' "
        "AND pid != pg_backend_pid()"
    )
    admin = await asyncpg.connect(dsn)
    try:
        before = {r["pid"] for r in await admin.fetch(listeners)}
        assert len(before) == 2
        await admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid = ANY($1)", list(before))

        async def listening_again() -> bool:
            return len({r["pid"] for r in await admin.fetch(listeners)} - before) == 2

        await wait_until_async(listening_again, True, timeout=5)
    finally:
        await admin.close()
    async with HostClient(a.address) as client, grpc.aio.insecure_channel(b.address) as channel:
        call = client.reply("", UserMsg("call fx__slow_note text=long seconds=60"))
        stream = await started_tool(call, effects, ["long"])
        answer = await stub(channel).InterruptReply(host_pb2.InterruptReplyRequest(session_id=call.session_id))
        assert answer.interrupted
        async with asyncio.timeout(3):  # the notification, not the renewal
            rest = [item async for item in stream]
    assert await ending(rest) == ReplyFinishedReason.INTERRUPTED


async def test_the_reply_end_reaches_the_client_only_once_the_reply_is_stored(
    procs: Procs, tmp_path: Path, dsn: str
) -> None:
    """The store is slow to take the reply's end (its lease row locked by another transaction): the
    client gets the reply's events, but its ReplyEndEvent and final Msg only once the end is stored.
    Before, the whole reply went out first: a host killed before the write left the client holding a
    reply the store did not have (a completed answer lost, a parked call no longer waiting); then the
    ReplyEndEvent still did (a completed end, and then an error when the write failed)."""
    _, (host,) = cluster(procs, tmp_path, dsn, 1, delay=0.2)  # the lock is taken before the reply ends
    async with HostClient(host.address) as client:
        call = client.reply("", UserMsg("hello there"))
        items: asyncio.Queue[object] = asyncio.Queue()

        async def consume() -> None:
            async for item in call:
                await items.put(item)

        consumer = asyncio.create_task(consume())
        lock = await asyncpg.connect(dsn)
        try:
            async with asyncio.timeout(20):
                while not isinstance(await items.get(), ReplyStartEvent):
                    pass
            held = lock.transaction()
            await held.start()
            await lock.execute("SELECT 1 FROM agentmw_leases WHERE session_id=$1 FOR UPDATE", call.session_id)
            before: list[object] = []
            with contextlib.suppress(TimeoutError):  # the reply's events, until it waits for the store
                while True:
                    before.append(await asyncio.wait_for(items.get(), 1.5))
            assert before and not any(isinstance(i, ReplyEndEvent | Msg) for i in before), before
            await held.rollback()
            end, final = await asyncio.wait_for(items.get(), 20), await asyncio.wait_for(items.get(), 20)
            await consumer
        finally:
            consumer.cancel()
            await lock.close()
    assert isinstance(end, ReplyEndEvent) and end.finished_reason == ReplyFinishedReason.COMPLETED, end
    assert isinstance(final, Msg) and final.text == "You said: hello there"


async def test_an_id_no_session_can_have_is_refused_before_the_store_sees_it(
    procs: Procs, tmp_path: Path, dsn: str
) -> None:
    """A session id with a NUL (PostgreSQL's text cannot hold one): Reply is INVALID_ARGUMENT, and
    Get/Delete/InterruptReply answer as for a missing session. Before, they reached the database and
    failed with INTERNAL / UNKNOWN (CharacterNotInRepertoireError in the client's details)."""
    _, (host,) = cluster(procs, tmp_path, dsn, 1)
    bad = "bad\x00id"
    async with HostClient(host.address) as client:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in client.reply(bad, UserMsg("hi")):
                pass
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
    async with grpc.aio.insecure_channel(host.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await stub(channel).GetSession(host_pb2.GetSessionRequest(session_id=bad), timeout=10)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        deleted = await stub(channel).DeleteSession(host_pb2.DeleteSessionRequest(session_id=bad), timeout=10)
        interrupted = await stub(channel).InterruptReply(host_pb2.InterruptReplyRequest(session_id=bad), timeout=10)
    assert not deleted.deleted and not interrupted.interrupted


async def health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        answer = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return answer.status


async def test_sigterm_drains_a_host_and_another_takes_its_sessions_at_once(
    procs: Procs, tmp_path: Path, dsn: str
) -> None:
    # A long lease: another host gets the sessions because they are released, not because it expired.
    effects, (a, b) = cluster(procs, tmp_path, dsn, 2, "--lease", "30", "--drain-grace", "3")
    short, _ = await reply(a.address, "", UserMsg("hi"))
    long, _ = await reply(a.address, "", UserMsg("hi"))
    async with HostClient(a.address) as client:
        finishing = client.reply(short, UserMsg("call fx__slow_note text=short seconds=1.5"))
        cut = client.reply(long, UserMsg("call fx__slow_note text=long seconds=60"))
        streams = [asyncio.create_task(collect(finishing)), asyncio.create_task(collect(cut))]
        await wait_until(lambda: sorted(lines(effects)) == ["long", "short"])
        a.popen.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        await wait_until_async(lambda: health(a.address), health_pb2.HealthCheckResponse.NOT_SERVING)
        assert not streams[0].done() and not streams[1].done(), "NOT_SERVING at once, replies still running"
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await reply(a.address, "", UserMsg("hi"))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        async with asyncio.timeout(20):
            done, cut_short = await asyncio.gather(*streams)
    assert await ending(done) == ReplyFinishedReason.COMPLETED, "the in-flight reply finished"
    assert await ending(cut_short) == ReplyFinishedReason.INTERRUPTED, "past the grace: interrupted and saved"
    assert a.popen.wait(20) == 0  # type: ignore[union-attr]
    for session in (short, long):
        _, items = await reply(b.address, session, UserMsg("again"))  # no wait for a 30 s lease
        assert await ending(items) == ReplyFinishedReason.COMPLETED
    assert sorted(lines(effects)) == ["long", "short"]


async def collect(call: object) -> list[object]:
    return [item async for item in call]  # type: ignore[attr-defined]


async def wait_until_async(probe: object, wanted: object, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while await probe() != wanted:  # type: ignore[operator]
            await asyncio.sleep(0.02)


class Relay:
    """A TCP relay to PostgreSQL in the test's process, cut and restored at will (the store becomes
    unreachable for a host, then comes back)."""

    def __init__(self, target: int) -> None:
        self.target, self.port = target, 0
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []
        self.stalled = False  # a database that stops answering, its connections open (a black hole)
        self.answering = asyncio.Event()  # cleared: the server's answers wait (a slow network)
        self.answering.set()

    @classmethod
    async def in_front_of(cls, dsn: str) -> tuple[Relay, str]:
        """A started relay to the database of ``dsn``, and the DSN that goes through it."""
        port = urlsplit(dsn).port or 5432
        relay = cls(port)
        await relay.start()
        return relay, dsn.replace(f":{port}/", f":{relay.port}/")

    def stall(self) -> None:
        self.stalled = True

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)
        self.port = self.server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.transport.abort()
        self.writers.clear()
        await self.server.wait_closed()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        if self.stalled:  # accepted, never answered
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        self.writers.append(up_writer)

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, answers: bool) -> None:
            with contextlib.suppress(OSError):
                while data := await r.read(65536):
                    if answers:
                        await self.answering.wait()
                    if not self.stalled:  # else swallowed
                        w.write(data)
                        await w.drain()
            w.transport.abort()

        await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, True))


async def store_lost_during_a_tool(
    procs: Procs, tmp_path: Path, dsn: str, lose: Callable[[Relay], Awaitable[None]]
) -> tuple[Relay, ServerProcess, str, grpc.aio.AioRpcError, float]:
    """A host behind a relay to the database; its store is lost (``lose``) while a reply's tool
    runs, so the result cannot be stored. The relay, the host, the session, how the reply's call
    ended, and the seconds it took to."""
    relay, relayed = await Relay.in_front_of(dsn)
    effects, (host,) = await asyncio.to_thread(cluster, procs, tmp_path, relayed, 1)
    session, _ = await reply(host.address, "", UserMsg("hi"))
    async with HostClient(host.address) as client:
        call = client.reply(session, UserMsg("call fx__slow_note text=slow seconds=1"))
        stream = await started_tool(call, effects, ["slow"])
        await lose(relay)
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as in_flight:
            async with asyncio.timeout(40):  # each store call within its bound: ~10 s for three when stalled
                async for _item in stream:
                    pass
    return relay, host, session, in_flight.value, time.monotonic() - started


async def test_a_database_that_stops_answering_fails_calls_in_bounded_time(
    procs: Procs, tmp_path: Path, dsn: str
) -> None:
    """PostgreSQL stops answering, its connections open (hung, or a network that drops packets): a
    reply in flight and the session calls end with UNAVAILABLE, each store call within its bound
    (connecting: the lease, at least 3 s; a statement: past the lock timeout), health says
    NOT_SERVING, and the host's stop does not wait on it. Before, each waited until the database
    answered again, saying nothing (asyncpg bounds only connecting, by 10 s)."""

    async def stall(relay: Relay) -> None:
        relay.stall()  # no answer, no error either

    relay, host, _, in_flight, took = await store_lost_during_a_tool(procs, tmp_path, dsn, stall)
    try:
        assert took < 30
        assert in_flight.code() == grpc.StatusCode.UNAVAILABLE, in_flight
        assert in_flight.details().startswith("the session store is unreachable: "), in_flight.details()
        assert not in_flight.details().endswith(": "), "it says why"
        async with grpc.aio.insecure_channel(host.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as listed:
                await stub(channel).ListSessions(host_pb2.ListSessionsRequest(), timeout=20)
            assert listed.value.code() == grpc.StatusCode.UNAVAILABLE, listed.value
        assert await health(host.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await asyncio.to_thread(host.stop, 20) != -signal.SIGKILL  # it exits by itself, not killed
    finally:
        await relay.cut()


async def test_a_reply_whose_end_cannot_be_stored_never_ends_completed(procs: Procs, tmp_path: Path, dsn: str) -> None:
    """The store goes away while the model streams a plain answer, so the first write that fails is
    the reply's end: the client gets ReplyEndEvent(ERROR) saying so, then UNAVAILABLE, and no final
    Msg (docs/host.md). Before, it got ReplyEndEvent(COMPLETED) for a turn the session does not have."""
    relay, relayed = await Relay.in_front_of(dsn)
    _, (host,) = await asyncio.to_thread(cluster, procs, tmp_path, relayed, 1, delay=0.05)
    items: list[object] = []
    try:
        async with HostClient(host.address) as client:
            call = client.reply("", UserMsg(" ".join(f"w{i}" for i in range(30))))
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                async with asyncio.timeout(30):
                    async for item in call:
                        items.append(item)
                        if isinstance(item, TextBlockDeltaEvent) and len(items) < 10:
                            await relay.cut()  # once: the end cannot be stored
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
        (end,) = [i for i in items if isinstance(i, ReplyEndEvent)]
        assert end.finished_reason == ReplyFinishedReason.ERROR, end
        assert end.error is not None
        assert "the reply was not stored: the session store is unreachable" in end.error.message
        assert not isinstance(items[-1], Msg), "the final Msg goes out only once the reply is stored"
        # Logged and counted as what the client got (before: outcome=completed, no reply error),
        # then the status that followed.
        said = f"reply session={call.session_id}"
        await asyncio.to_thread(host.wait_for_line, f"{said} refused UNAVAILABLE: ")
        (line,) = [x for x in host.tail(100).splitlines() if said in x and " outcome=" in x]
        assert "outcome=error" in line and "the reply was not stored" in line, line
    finally:
        await relay.cut()


async def test_health_is_not_serving_while_the_store_is_unreachable(procs: Procs, tmp_path: Path, dsn: str) -> None:
    """Readiness follows the store: a host whose PostgreSQL is cut off gets no replies (each would
    fail), and serves again once the database is back."""
    relay, relayed = await Relay.in_front_of(dsn)
    _, (host,) = await asyncio.to_thread(cluster, procs, tmp_path, relayed, 1)  # it connects through the relay
    try:
        assert await health(host.address) == health_pb2.HealthCheckResponse.SERVING
        await relay.cut()
        await wait_until_async(lambda: health(host.address), health_pb2.HealthCheckResponse.NOT_SERVING)
        await relay.start()  # the same port: the host reconnects
        await wait_until_async(lambda: health(host.address), health_pb2.HealthCheckResponse.SERVING)
        _, items = await reply(host.address, "", UserMsg("hi"))
        assert await ending(items) == ReplyFinishedReason.COMPLETED
    finally:
        await relay.cut()


async def test_readiness_asks_the_database_while_every_pool_connection_is_busy(dsn: str) -> None:
    """Every connection of the store's pool at work (held here, as by long statements): readiness
    still asks the database, within its bound: ready while it answers, not once it stops answering
    (stalled: its connections open, nothing comes back), ready again once it answers again. Before,
    a full pool was taken for a database that answers, without asking: ready while it hung."""
    relay, relayed = await Relay.in_front_of(dsn)
    store = await PostgresStore.connect(relayed, lease=5)
    try:
        busy = [await store.pool.acquire() for _ in range(store.pool.get_max_size())]
        assert store.pool.get_idle_size() == 0 and len(busy) == store.pool.get_size()
        assert await store.reachable()
        relay.stall()
        started = time.monotonic()
        assert not await store.reachable(), "a database that stopped answering is not ready"
        assert time.monotonic() - started < REACHABLE_TIMEOUT + 1, "the check is bounded"
        relay.stalled = False  # new connections go through again
        assert await store.reachable()
    finally:
        store.close()
        await relay.cut()


async def test_a_store_outage_is_unavailable_with_the_stores_message(procs: Procs, tmp_path: Path, dsn: str) -> None:
    """PostgreSQL cut off: a reply in flight, a new reply and every session RPC end with UNAVAILABLE
    saying the store is unreachable (a client or balancer may retry). Before: INTERNAL ("the host
    failed"), with a host-bug traceback in the log, and UNKNOWN for the session RPCs."""
    relay, host, session, in_flight, _ = await store_lost_during_a_tool(procs, tmp_path, dsn, Relay.cut)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as new:
            await reply(host.address, session, UserMsg("again"))
        failures = [in_flight, new.value]
        async with grpc.aio.insecure_channel(host.address) as channel:
            for rpc, request in (
                (stub(channel).GetSession, host_pb2.GetSessionRequest(session_id=session)),
                (stub(channel).ListSessions, host_pb2.ListSessionsRequest()),
                (stub(channel).DeleteSession, host_pb2.DeleteSessionRequest(session_id=session)),
                (stub(channel).InterruptReply, host_pb2.InterruptReplyRequest(session_id=session)),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await rpc(request, timeout=10)
                failures.append(failed.value)
        for failure in failures:
            assert failure.code() == grpc.StatusCode.UNAVAILABLE, failure
            assert failure.details().startswith("the session store is unreachable: "), failure.details()
    finally:
        await relay.cut()
    log = host.log_path
    assert log is not None
    await wait_until(lambda: "InterruptReply: the session store is unreachable" in log.read_text())
    assert " ERROR " not in log.read_text() and "a reply of session" not in log.read_text(), "an outage, not a bug"


async def test_a_bounded_load_across_three_hosts_runs_every_turn_once(procs: Procs, tmp_path: Path, dsn: str) -> None:
    effects, hosts = cluster(procs, tmp_path, dsn, 3)
    sessions, turns = 10, 6  # 60 replies; a session's turns go to different hosts at once
    ids = [f"load-{s}" for s in range(sessions)]
    gate = asyncio.Semaphore(15)
    clients = [HostClient(h.address) for h in hosts]

    async def one(n: int) -> ReplyFinishedReason:
        session, k = ids[n % sessions], n // sessions
        async with gate:
            call = clients[n % 3].reply(session, UserMsg(f"call fx__note text={session}/{k}"))
            async with asyncio.timeout(40):
                return await ending([item async for item in call])

    try:
        ends = await asyncio.gather(*(one(n) for n in range(sessions * turns)))
    finally:
        for c in clients:
            await c.close()
    assert ends == [ReplyFinishedReason.COMPLETED] * (sessions * turns)
    effect_lines = lines(effects)
    assert sorted(effect_lines) == sorted(f"{s}/{k}" for s in ids for k in range(turns)), "each tool ran once"
    for session in ids:
        _, state, _ = await get_session(hosts[0].address, session)
        assert sorted(contiguous_turns(state)) == sorted(f"call fx__note text={session}/{k}" for k in range(turns))
        blocks = [b for m in state.context for b in m.content]
        calls = [b for b in blocks if isinstance(b, ToolCallBlock)]
        results = [b for b in blocks if isinstance(b, ToolResultBlock)]
        assert len(calls) == len(results) == turns, "every tool call has a result"
        assert all(r.state == ToolResultState.SUCCESS for r in results)


async def busy_reply(address: str, session_id: str, text: str, token: str = "") -> list[object]:
    """One reply sent with refuse_if_busy (the items, or the AioRpcError)."""
    async with HostClient(address, token=token) as client:
        call = client.reply(session_id, UserMsg(text), refuse_if_busy=True)
        task = asyncio.ensure_future(collect(call))
        if not (await asyncio.wait([task], timeout=5))[0]:  # the busy reply runs longer (its tool: 10 s)
            task.cancel()
            raise AssertionError("the reply waited for the busy session instead of being refused")
        return task.result()


async def started_tool(call: object, effects: Path, wanted: list[str]) -> object:
    """Read ``call`` until its tool runs (the effects file says ``wanted``); the rest of its stream."""
    stream = aiter(call)  # type: ignore[call-overload]
    async with asyncio.timeout(20):
        async for item in stream:
            if isinstance(item, ToolResultStartEvent):
                break
        await wait_until(lambda: lines(effects) == wanted)
    return stream


async def test_refuse_if_busy_refuses_at_once_naming_the_host_that_holds_the_session(
    procs: Procs, tmp_path: Path, dsn: str
) -> None:
    effects, (a, b) = cluster(procs, tmp_path, dsn, 2, "--lease", "30")
    async with HostClient(a.address) as client:
        call = client.reply("", UserMsg("call fx__slow_note text=long seconds=60"))
        stream = await started_tool(call, effects, ["long"])
        session = call.session_id
        # From the other host (the lease's holder is named), and from the same host (its local lock).
        for host, holder in ((b, f"host {socket.gethostname()}/{a.pid}/"), (a, "this host (")):
            with pytest.raises(grpc.aio.AioRpcError) as busy:
                await busy_reply(host.address, session, "call fx__note text=refused")
            assert busy.value.code() == grpc.StatusCode.ABORTED, busy.value.details()
            assert f"session {session!r} is busy" in busy.value.details() and holder in busy.value.details()
        assert (await get_session(b.address, session))[0].replying, "B sees A's reply running"
        call.cancel()
        async with asyncio.timeout(20):
            rest = [item async for item in stream]
        assert await ending(rest) == ReplyFinishedReason.INTERRUPTED
    items = await busy_reply(b.address, session, "call fx__note text=after")  # free now: it runs
    assert await ending(items) == ReplyFinishedReason.COMPLETED
    shown, state, _ = await get_session(b.address, session)
    assert not shown.replying
    assert user_texts(state) == ["call fx__slow_note text=long seconds=60", "call fx__note text=after"]
    assert lines(effects) == ["long", "after"], "the refused replies stored and ran nothing"


async def test_refuse_if_busy_on_one_sqlite_host_and_agent_chat_no_wait(procs: Procs, tmp_path: Path) -> None:
    effects = tmp_path / "effects.txt"
    argv = ["-m", "agentmw.sdk", "tests.durable_mw:SideEffects", "--address", "127.0.0.1:0"]
    fx = procs.start("fx", [*argv, "--arg", f"path={json.dumps(str(effects))}"])
    host = procs.host(tmp_path / "sessions.db", "--middleware", f"fx={fx.address}")
    async with HostClient(host.address) as client:
        call = client.reply("", UserMsg("call fx__slow_note text=long seconds=60"))
        stream = await started_tool(call, effects, ["long"])
        session = call.session_id
        with pytest.raises(grpc.aio.AioRpcError) as busy:
            await busy_reply(host.address, session, "call fx__note text=refused")
        assert busy.value.code() == grpc.StatusCode.ABORTED
        assert f"session {session!r} is busy: a reply of it runs on this host" in busy.value.details()
        chat = ["clients.chat", "--host", host.address, "--session", session, "-m", "hi", "--no-wait"]
        done = await asyncio.to_thread(run_cli, *chat)
        assert done.returncode == 1, (done.stdout, done.stderr)
        assert "ABORTED" in done.stderr and f"session {session!r} is busy" in done.stderr, done.stderr
        call.cancel()
        async with asyncio.timeout(20):
            assert await ending([item async for item in stream]) == ReplyFinishedReason.INTERRUPTED
    _, state, _ = await get_session(host.address, session)
    assert user_texts(state) == ["call fx__slow_note text=long seconds=60"], "the refused replies stored nothing"
    assert lines(effects) == ["long"]


def users_yaml(limits: str) -> str:
    """More of host.yaml: the users of TOKENS, each by the digest of their token, and ``limits``."""
    users = "".join(f"    - {{name: {n}, role: user, token_sha256: '{token_digest(t)}'}}\n" for n, t in TOKENS.items())
    return f"security:\n  users:\n{users}limits: {limits}\n"


async def test_replies_per_owner_counts_the_replies_on_every_host(procs: Procs, tmp_path: Path, dsn: str) -> None:
    effects, (a, b) = cluster(procs, tmp_path, dsn, 2, yaml=users_yaml("{replies_per_owner: 1}"))
    async with HostClient(a.address, token=TOKENS["alice"]) as client:
        call = client.reply("", UserMsg("call fx__slow_note text=long seconds=60"))
        stream = await started_tool(call, effects, ["long"])  # kept: a dropped stream cancels the call
        await asyncio.sleep(float(LEASE) * 1.5)  # past a lease: alice's running reply is renewed, still counted
        with pytest.raises(grpc.aio.AioRpcError) as limited:  # her second reply, on the other host
            await busy_reply(b.address, "", "hi", token=TOKENS["alice"])
        assert limited.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "at most 1 replies at once per user on all hosts together" in limited.value.details()
        assert await ending(await busy_reply(b.address, "", "hi", token=TOKENS["bob"])) == (
            ReplyFinishedReason.COMPLETED
        ), "another user's replies count apart"
        a.kill()  # its reply no longer runs: it stops counting once its row's lease expires
        del stream
    async with asyncio.timeout(15):
        while True:
            try:
                items = await busy_reply(b.address, "", "hi", token=TOKENS["alice"])
                break
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                await asyncio.sleep(0.2)
    assert await ending(items) == ReplyFinishedReason.COMPLETED


async def test_a_reply_of_a_host_paused_past_its_lease_counts_again_when_it_goes_on(
    procs: Procs, tmp_path: Path, dsn: str
) -> None:
    """replies_per_owner: 1. Host A is paused (SIGSTOP) past a lease while alice's reply runs there,
    and an admission on B drops A's row as expired; A goes on (nobody took the session), and so does
    the reply: it counts again, and alice's next reply on B is refused while it runs. Before, the
    row was gone for good (renewing only updated rows): two replies of hers ran at once."""
    effects, (a, b) = cluster(procs, tmp_path, dsn, 2, yaml=users_yaml("{replies_per_owner: 1}"))
    async with HostClient(a.address, token=TOKENS["alice"]) as client:
        call = client.reply("", UserMsg("call fx__slow_note text=long seconds=60"))
        stream = await started_tool(call, effects, ["long"])  # kept: a dropped stream cancels the call
        assert a.popen is not None
        a.popen.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(float(LEASE) * 1.5)  # A's row expires
            items = await busy_reply(b.address, "", "hi", token=TOKENS["alice"])  # admitted: A's row dropped
            assert await ending(items) == ReplyFinishedReason.COMPLETED
        finally:
            a.popen.send_signal(signal.SIGCONT)
        await asyncio.sleep(float(LEASE))  # A renews what it runs
        with pytest.raises(grpc.aio.AioRpcError) as limited:
            await busy_reply(b.address, "", "hi again", token=TOKENS["alice"])
        assert limited.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, limited.value
        del stream


async def test_sessions_per_owner_holds_for_first_replies_sent_at_once_to_every_host(
    procs: Procs, tmp_path: Path, dsn: str
) -> None:
    """limits.sessions_per_owner: 2, and alice sends 10 new-session replies at once, 5 to each of two
    hosts: 2 run, 8 are refused (RESOURCE_EXHAUSTED). Before, each host counted the stored sessions
    and those it was making itself (a session is stored at its first write): 4 ran."""
    users = f"    - {{name: alice, role: user, token_sha256: '{token_digest(TOKENS['alice'])}'}}\n"
    limits = "limits: {sessions_per_owner: 2, replies_per_owner: 100}\n"
    _, hosts = cluster(procs, tmp_path, dsn, 2, delay=0.05, yaml=f"security:\n  users:\n{users}{limits}")
    channels = [client_channel(h.address, token=TOKENS["alice"]) for h in hosts]
    try:

        async def one(i: int) -> str:
            try:
                await secure_reply(channels[i % 2], f"hello {i}")
                return "ok"
            except grpc.aio.AioRpcError as exc:
                assert "sessions per user" in (exc.details() or ""), exc.details()
                return exc.code().name

        outcomes = await asyncio.gather(*(one(i) for i in range(10)))
        assert sorted(outcomes) == ["RESOURCE_EXHAUSTED"] * 8 + ["ok"] * 2, outcomes
        owned = await stub(channels[1]).ListSessions(host_pb2.ListSessionsRequest(), timeout=8)
        assert len(owned.sessions) == 2
    finally:
        for channel in channels:
            await channel.close()


async def test_owners_are_stored_and_checked_on_every_host(procs: Procs, tmp_path: Path, dsn: str) -> None:
    """Two users on two hosts of one store: the owner goes into PostgreSQL with the session, each
    user lists and reads only their own sessions whichever host they ask, and the per-owner
    session limit counts the sessions made on any host."""
    users = "".join(
        f"    - {{name: {n}, role: {'admin' if n == 'ops' else 'user'}, token_sha256: '{token_digest(t)}'}}\n"
        for n, t in TOKENS.items()
    )
    _, hosts = cluster(procs, tmp_path, dsn, 2, yaml=f"security:\n  users:\n{users}limits: {{sessions_per_owner: 1}}\n")
    channels = {(n, i): client_channel(h.address, token=t) for n, t in TOKENS.items() for i, h in enumerate(hosts)}
    try:
        alices, _ = await secure_reply(channels["alice", 0], "alice's plans")
        bobs, _ = await secure_reply(channels["bob", 1], "bob's plans")
        for i in range(2):
            for user, own in (("alice", alices), ("bob", bobs)):
                listed = await stub(channels[user, i]).ListSessions(host_pb2.ListSessionsRequest(), timeout=8)
                assert [s.session_id for s in listed.sessions] == [own], (user, i)
            listed = await stub(channels["ops", i]).ListSessions(host_pb2.ListSessionsRequest(), timeout=8)
            assert sorted(s.session_id for s in listed.sessions) == sorted([alices, bobs])
            with pytest.raises(grpc.aio.AioRpcError) as theirs:
                await stub(channels["bob", i]).GetSession(host_pb2.GetSessionRequest(session_id=alices), timeout=8)
            assert theirs.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.aio.AioRpcError) as theirs:
                await secure_reply(channels["bob", i], "let me in", alices)
            assert theirs.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as second:  # alice's one session is on the other host
            await secure_reply(channels["alice", 1], "another conversation")
        assert second.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        for channel in channels.values():
            await channel.close()
    conn = await asyncpg.connect(dsn)
    try:
        owners = dict(await conn.fetch("SELECT session_id, owner FROM agentmw_sessions"))
    finally:
        await conn.close()
    assert owners == {alices: "alice", bobs: "bob"}


@pytest.mark.parametrize("version_row", [True, False])
async def test_a_database_of_schema_1_gets_the_owner_column(dsn: str, version_row: bool) -> None:
    """A database made before owners (schema 1) is migrated at start: its sessions keep their rows
    and belong to no one; new sessions get their owner. Tables with no version row are taken for
    the oldest layout (before, they were stamped current as they were, and every write failed)."""
    conn = await asyncpg.connect(dsn)
    try:
        if version_row:
            await conn.execute(
                "CREATE TABLE agentmw_schema (version integer NOT NULL); INSERT INTO agentmw_schema VALUES (1)"
            )
        await conn.execute(
            "CREATE TABLE agentmw_sessions (session_id text PRIMARY KEY, created_at timestamptz NOT NULL "
            "DEFAULT now(), updated_at timestamptz NOT NULL DEFAULT now(), title text NOT NULL DEFAULT '', "
            "message_count integer NOT NULL DEFAULT 0, status text NOT NULL DEFAULT 'idle', in_flight text[] "
            "NOT NULL DEFAULT '{}', fence bigint, meta bytea NOT NULL);"
            "INSERT INTO agentmw_sessions (session_id, title, meta) VALUES ('old', 'before owners', '')"
        )
    finally:
        await conn.close()
    store = await PostgresStore.connect(dsn, lease=5)
    try:
        async with store.hold("new") as hold:
            await store.create("new", fence=hold.fence, owner="alice").begin_reply()
        assert [(r.session_id, r.owner) for r in await store.list(owner="")] == [("old", "")]
        assert [(r.session_id, r.owner) for r in await store.list(owner="alice")] == [("new", "alice")]
        assert {r.session_id for r in await store.list()} == {"old", "new"}
    finally:
        await store.aclose()
    conn = await asyncpg.connect(dsn)
    try:
        assert await conn.fetchval("SELECT version FROM agentmw_schema") == SCHEMA_VERSION
    finally:
        await conn.close()


async def test_the_title_stays_the_first_user_message_after_compression(dsn: str) -> None:
    """As on SQLite (tests/test_durable_store.py): compression does not change the listed title."""
    store = await PostgresStore.connect(dsn, lease=5)
    try:
        async with store.hold("s") as hold:
            await keeps_its_title(store, store.create("s", fence=hold.fence))
    finally:
        await store.aclose()


async def test_a_version_3_database_gets_the_column_of_the_sessions_replies_make(dsn: str) -> None:
    """Schema 4 adds agentmw_replies.new_session (sessions_per_owner across hosts): a database of
    schema 3 is migrated at start, its replies' rows kept."""
    await (await PostgresStore.connect(dsn, lease=5)).aclose()
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "ALTER TABLE agentmw_replies DROP COLUMN new_session; UPDATE agentmw_schema SET version = 3;"
            "INSERT INTO agentmw_replies (id, user_name, host, expires) VALUES ('r', 'alice', 'h', now())"
        )
        await (await PostgresStore.connect(dsn, lease=5)).aclose()
        assert await conn.fetchval("SELECT version FROM agentmw_schema") == SCHEMA_VERSION == 4
        assert await conn.fetchval("SELECT new_session FROM agentmw_replies WHERE id = 'r'") == ""
    finally:
        await conn.close()


def refused_start(dsn: str) -> str:
    """Start a host on ``dsn``, which must refuse to start: the one line it printed last."""
    done = run_cli("agent_host", "--db", dsn, "--listen", "127.0.0.1:0", timeout=20)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stdout + done.stderr
    return done.stderr.strip().splitlines()[-1]


async def test_session_tables_that_do_not_match_the_schema_are_refused_at_start(dsn: str) -> None:
    """A column missing, or another program's table of the same name: the host refuses to start,
    saying what differs. Before, it started, and every reply failed (INTERNAL)."""
    await (await PostgresStore.connect(dsn, lease=5)).aclose()
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("ALTER TABLE agentmw_sessions DROP COLUMN in_flight")
        message = await asyncio.to_thread(refused_start, dsn)
        assert (
            f"the session tables do not match schema version {SCHEMA_VERSION}: agentmw_sessions has no column in_flight"
            in message
        )
        await conn.execute(
            "ALTER TABLE agentmw_sessions ADD COLUMN in_flight text[] NOT NULL DEFAULT '{}'; DROP TABLE agentmw_leases;"
            "CREATE TABLE agentmw_leases (session_id text PRIMARY KEY, holder text, fence text)"
        )
        message = await asyncio.to_thread(refused_start, dsn)
        assert "agentmw_leases.fence is text, not bigint; agentmw_leases has no column owner (text)" in message
    finally:
        await conn.close()


_roles = itertools.count()


async def test_a_user_who_may_only_read_and_write_the_tables_runs_a_host(
    procs: Procs, tmp_path: Path, dsn: str
) -> None:
    """The usual least-privilege role: the schema made by its owner, the host's user with SELECT,
    INSERT, UPDATE and DELETE on the tables and no CREATE on the schema. Before, every start ran
    the DDL and was refused (permission denied for schema public)."""
    await (await PostgresStore.connect(dsn, lease=5)).aclose()
    role = f"app_{os.getpid()}_{next(_roles)}"
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            f"CREATE ROLE {role} LOGIN; REVOKE CREATE ON SCHEMA public FROM PUBLIC;"
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON agentmw_schema, agentmw_sessions, agentmw_messages, "
            f"agentmw_leases, agentmw_replies TO {role}"
        )
    finally:
        await conn.close()
    effects, (host,) = cluster(procs, tmp_path, dsn.replace("//postgres@", f"//{role}@"), 1)
    _, items = await reply(host.address, "", UserMsg("call fx__note text=hi"))
    assert await ending(items) == ReplyFinishedReason.COMPLETED
    assert lines(effects) == ["hi"]


def test_the_store_settings_come_from_yaml_environment_and_flags(tmp_path: Path) -> None:
    from agent_host.config import ConfigError, load_config

    config = tmp_path / "host.yaml"
    config.write_text("store: {dsn: 'postgresql://u@h/db', lease: 4}\ndrain_grace: 7\n")
    cfg = load_config(config, env={})
    assert (cfg.db, cfg.lease, cfg.drain_grace) == ("postgresql://u@h/db", 4.0, 7.0)
    cfg = load_config(config, env={"AGENTMW_LEASE": "3"}, flags={"drain_grace": "1.5"})
    assert (cfg.lease, cfg.drain_grace) == (3.0, 1.5)
    config.write_text("store: {lease: -1}\n")
    with pytest.raises(ConfigError, match=r"store\.lease: expected a number of seconds above 0"):
        load_config(config, env={})
    with pytest.raises(ConfigError, match="--drain-grace"):
        load_config(None, env={}, flags={"drain_grace": "soon"})
    # With the security branch's sections and flags in the same file and command line.
    config.write_text(
        "store: {dsn: 'postgresql://u@h/db', lease: 4}\ndrain_grace: 7\nlimits: {sessions_per_owner: 3}\n"
        "security:\n  users: [{name: alice, role: user, token_sha256: '" + "0" * 64 + "'}]\n"
    )
    server = pki(tmp_path / "pki").server  # the TLS files must load (TlsFiles.check)
    cfg = load_config(config, env={}, flags={"lease": "2", "tls.cert": server.cert, "tls.key": server.key})
    assert (cfg.db, cfg.lease, cfg.drain_grace) == ("postgresql://u@h/db", 2.0, 7.0)
    assert ([u.name for u in cfg.security.users], cfg.security.sessions_per_owner) == (["alice"], 3)
    assert cfg.security.tls.cert == server.cert


async def test_a_reply_cancelled_while_its_lease_is_being_taken_leaves_the_session_free(dsn: str) -> None:
    """A reply cancelled (its client gave up, the host stopping) while it waits for the session,
    just as the server commits its acquire: the lease was taken with no hold behind it, and every
    host waited a whole lease (here 30 s) for a session no reply used. Now the acquire runs to its
    end and what it took is released."""
    relay, relayed = await Relay.in_front_of(dsn)
    store = await PostgresStore.connect(relayed, lease=30)
    conn = await asyncpg.connect(dsn)
    owners: list[str | None] = []

    async def owner() -> str | None:
        owners.append(await conn.fetchval("SELECT owner FROM agentmw_leases WHERE session_id = 's'"))
        return owners[-1]

    async def reply() -> None:
        async with store.hold("s"):
            await asyncio.sleep(3600)  # never: cancelled before it holds

    try:
        async with store.hold("warm"):  # the statements prepared: one acquire is one round trip
            pass
        relay.answering.clear()  # the server's answers wait from here
        waiting = asyncio.create_task(reply())
        async with asyncio.timeout(10):
            while await owner() != store.host_id:  # the server took the lease; the host has no answer yet
                await asyncio.sleep(0.02)
        waiting.cancel()
        await asyncio.sleep(0.2)  # the cancellation is seen before the answer comes
        relay.answering.set()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        async with asyncio.timeout(5):  # not the lease's 30 s
            while await owner() is not None:
                await asyncio.sleep(0.05)
        async with asyncio.timeout(5), store.hold("s", wait=False):  # free for the next reply at once
            pass
    finally:
        await conn.close()
        await store.aclose()
        await relay.cut()
