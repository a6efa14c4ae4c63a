"""Durable sessions: a host killed with -9 mid-reply loses no recorded step and runs no tool twice;
a reply's writes do not grow with the session; one host per SQLite file.

Real processes: the host, and a middleware (tests/durable_mw.py) whose tools append a line to a
file per run, so a test counts how often a tool really ran, whatever happened to the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sqlite3
import statistics
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from agent_host.store import SqliteStore
from agent_host.store.sqlite import SCHEMA_VERSION as SQLITE_SCHEMA
from agentmw.codec import codec
from agentmw.data import (
    AssistantMsg,
    ConfirmResult,
    Msg,
    ReplyEndEvent,
    ReplyFinishedReason,
    RequireUserConfirmEvent,
    Role,
    ToolCallBlock,
    ToolResultBlock,
    ToolResultEndEvent,
    ToolResultStartEvent,
    ToolResultState,
    ToolResultTextDeltaEvent,
    UserConfirmResultEvent,
    UserMsg,
    block_text,
)
from agentmw.data.state import AgentState
from agentmw.tools import INTERRUPTED_TOOL_TEXT
from agentmw.v1 import host_pb2
from clients.chat import HostClient
from clients.launch import ServerProcess

from .durable_mw import lines
from .host_util import Procs, get_session, run_cli, stub

pytestmark = pytest.mark.timeout(90)


def side_effects(procs: Procs, path: Path) -> ServerProcess:
    argv = ["-m", "agentmw.sdk", "tests.durable_mw:SideEffects", "--address", "127.0.0.1:0"]
    return procs.start("fx", [*argv, "--arg", f"path={json.dumps(str(path))}"])


async def reply(address: str, session_id: str, inputs: object) -> tuple[str, list[object]]:
    async with HostClient(address) as client:
        call = client.reply(session_id, inputs)
        async with asyncio.timeout(30):
            items = [item async for item in call]
    return call.session_id, items


async def wait_until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.02)


def calls_and_results(state: object) -> tuple[list[ToolCallBlock], dict[str, ToolResultBlock]]:
    blocks = [b for m in state.context for b in m.content]  # type: ignore[attr-defined]
    calls = [b for b in blocks if isinstance(b, ToolCallBlock)]
    return calls, {b.id: b for b in blocks if isinstance(b, ToolResultBlock)}


def user_texts(state: object) -> list[str]:
    return [m.text for m in state.context if m.role == Role.USER]  # type: ignore[attr-defined]


async def test_a_reply_cut_off_while_its_tool_result_is_being_stored_ends_well_formed(
    procs: Procs, tmp_path: Path
) -> None:
    """The client cancels while a tool runs, and the store is slow to take the interrupted result
    (another writer holds the database) past the 5 s grace: the reply is cut off. What the client
    gets stays well formed, the result's end before the reply's. Before, the result's end was lost
    when the cut-off came during its write, and the reply's end found it open: a ReplyGrammarError
    blaming "the agent itself", stored in the session."""
    effects, db = tmp_path / "effects.txt", tmp_path / "sessions.db"
    fx = side_effects(procs, effects)
    host = procs.host(db, "--middleware", f"fx={fx.address}")
    items: list[object] = []
    blocker = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    try:
        async with HostClient(host.address) as client:
            call = client.reply("", UserMsg("call fx__slow_note text=slow seconds=60"))
            with contextlib.suppress(grpc.aio.AioRpcError):  # ABORTED once cut off
                async with asyncio.timeout(30):
                    async for item in call:
                        items.append(item)
                        if isinstance(item, ToolResultStartEvent):
                            await wait_until(lambda: lines(effects) == ["slow"])
                            blocker.execute("BEGIN IMMEDIATE")  # the store's next write waits for it
                            call.cancel()
                            asyncio.get_running_loop().call_later(8, blocker.rollback)  # past the grace
    finally:
        blocker.close()
    opened = {i.tool_call_id for i in items if isinstance(i, ToolResultStartEvent)}
    ended = {i.tool_call_id for i in items if isinstance(i, ToolResultEndEvent)}
    assert opened == ended, items
    assert not any("ReplyGrammarError" in str(getattr(i, "error", "")) for i in items), items
    _, state, _ = await get_session(host.address, call.session_id)
    assert "ReplyGrammarError" not in str(state.context)


async def test_a_cancelled_tool_streams_its_interrupted_text_once(procs: Procs, tmp_path: Path) -> None:
    """The client cancels while a tool runs: the interrupted result's text reaches it once, as it
    is stored. Before, the toolkit's own interrupted chunk streamed and then the host's, so the
    client showed the text twice."""
    effects = tmp_path / "effects.txt"
    fx = side_effects(procs, effects)
    host = procs.host(tmp_path / "sessions.db", "--middleware", f"fx={fx.address}")
    items: list[object] = []
    async with HostClient(host.address) as client:
        call = client.reply("", UserMsg("call fx__slow_note text=slow seconds=60"))
        async with asyncio.timeout(20):
            async for item in call:
                items.append(item)
                if isinstance(item, ToolResultStartEvent):
                    await wait_until(lambda: lines(effects) == ["slow"])  # the tool runs: cancel lands in it
                    call.cancel()
    assert [i.delta for i in items if isinstance(i, ToolResultTextDeltaEvent)] == [INTERRUPTED_TOOL_TEXT]
    _, state, _ = await get_session(host.address, call.session_id)
    _, results = calls_and_results(state)
    assert [(r.state, block_text(r.output)) for r in results.values()] == [
        (ToolResultState.INTERRUPTED, INTERRUPTED_TOOL_TEXT)
    ]


async def test_a_tool_cut_short_by_a_host_stop_may_have_taken_effect(procs: Procs, tmp_path: Path) -> None:
    """SIGTERM while a tool runs (past the drain grace): the tool's result says that the host
    stopped and that it may or may not have taken effect (it had), as after a kill, in what the
    client sees and in what is stored; the call after it, which never started, that the host
    stopped before it ran. Before, both said "interrupted by the user", who did nothing."""
    effects, db = tmp_path / "effects.txt", tmp_path / "sessions.db"
    fx = side_effects(procs, effects)
    args = ("--middleware", f"fx={fx.address}", "--drain-grace", "0.5")
    host = procs.host(db, *args)
    items: list[object] = []
    async with HostClient(host.address) as client:
        asked = "call fx__slow_note text=slow seconds=60 and then call fx__note text=never"
        call = client.reply("", UserMsg(asked))
        async with asyncio.timeout(20):
            async for item in call:
                items.append(item)
                if isinstance(item, ToolResultStartEvent):
                    await wait_until(lambda: lines(effects) == ["slow"])  # its effect happened
                    host.popen.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    assert host.popen.wait(20) == 0  # type: ignore[union-attr]
    deltas = [i.delta for i in items if isinstance(i, ToolResultTextDeltaEvent)]
    assert len(deltas) == 2 and "The host stopped" in deltas[0] and "may or may not have taken effect" in deltas[0]
    assert deltas[1] == "<system-reminder>The host stopped before this tool call ran; it was not run.</system-reminder>"
    assert next(i for i in items if isinstance(i, ReplyEndEvent)).finished_reason == ReplyFinishedReason.INTERRUPTED

    host = procs.host(db, *args, name="host2")
    _, state, _ = await get_session(host.address, call.session_id)
    _, results = calls_and_results(state)
    stored = [(r.state, block_text(r.output)) for r in results.values()]
    assert stored == [(ToolResultState.INTERRUPTED, deltas[0]), (ToolResultState.INTERRUPTED, deltas[1])]
    assert lines(effects) == ["slow"]


async def test_kill_while_a_tool_runs_keeps_results_and_runs_nothing_again(procs: Procs, tmp_path: Path) -> None:
    effects, db = tmp_path / "effects.txt", tmp_path / "sessions.db"
    fx = side_effects(procs, effects)
    host = procs.host(db, "--middleware", f"fx={fx.address}")
    ask = "call fx__note text=first then call fx__slow_note text=second seconds=60"
    async with HostClient(host.address) as client:
        call = client.reply("", UserMsg(ask))
        async with asyncio.timeout(20):
            async for item in call:  # still reading: leaving the call would cancel the reply
                if isinstance(item, ToolResultStartEvent) and item.tool_call_name == "fx__slow_note":
                    await wait_until(lambda: lines(effects) == ["first", "second"])
                    host.kill()  # -9 while fx__slow_note runs: its result is never recorded
                    break
    session = call.session_id

    host = procs.host(db, "--middleware", f"fx={fx.address}", name="host2")
    info, state, _ = await get_session(host.address, session)
    assert user_texts(state) == [ask], "the accepted user turn is stored, once"
    assert not info.summary.parked and not info.pending_tool_calls
    calls, results = calls_and_results(state)
    assert [c.name for c in calls] == ["fx__note", "fx__slow_note"]
    assert results[calls[0].id].state == ToolResultState.SUCCESS, "the recorded result is kept"
    doubt = results[calls[1].id]
    assert doubt.state == ToolResultState.ERROR and "may or may not have taken effect" in doubt.output
    assert state.context[-1].finished_reason == ReplyFinishedReason.INTERRUPTED, "the reply was closed"

    # The session goes on; neither tool ran again.
    _, items = await reply(host.address, session, UserMsg("call fx__note text=third"))
    assert next(i for i in items if isinstance(i, ReplyEndEvent)).finished_reason == ReplyFinishedReason.COMPLETED
    assert lines(effects) == ["first", "second", "third"]
    _, state, _ = await get_session(host.address, session)
    calls, results = calls_and_results(state)
    assert len(calls) == 3 and set(results) == {c.id for c in calls}, "every tool call has a result"


async def test_kill_after_a_confirmed_tool_ran_never_runs_it_again(procs: Procs, tmp_path: Path) -> None:
    effects, db, config = tmp_path / "effects.txt", tmp_path / "sessions.db", tmp_path / "host.yaml"
    # A slow model: after the tool's result the final answer takes seconds, time to kill the host.
    config.write_text("models:\n  default: slow\n  models:\n    slow: {provider: offline, delay: 0.3}\n")
    fx = side_effects(procs, effects)
    args = ("--config", str(config), "--middleware", f"fx={fx.address}")
    host = procs.host(db, *args)
    ask = "call fx__confirmed_note text=hello"
    session, items = await reply(host.address, "", UserMsg(ask))
    asking = next(i for i in items if isinstance(i, RequireUserConfirmEvent)).tool_calls[0]
    reply_id = next(i for i in items if isinstance(i, Msg)).id
    confirm = UserConfirmResultEvent(
        reply_id=reply_id, confirm_results=[ConfirmResult(confirmed=True, tool_call=asking)]
    )

    async with HostClient(host.address) as client:
        call = client.reply(session, confirm)
        async with asyncio.timeout(20):
            async for item in call:
                if isinstance(item, ToolResultEndEvent):
                    assert item.state == ToolResultState.SUCCESS
                    host.kill()  # -9 after the tool's result, before the reply ends
                    break
    assert lines(effects) == ["hello"]

    host = procs.host(db, *args, name="host2")
    info, state, _ = await get_session(host.address, session)
    assert not info.summary.parked and not info.pending_tool_calls, "no longer parked on the call that ran"
    assert user_texts(state) == [ask]
    calls, results = calls_and_results(state)
    assert [c.id for c in calls] == [asking.id] and results[asking.id].state == ToolResultState.SUCCESS
    assert state.context[-1].finished_reason == ReplyFinishedReason.INTERRUPTED, "the reply was closed"

    with pytest.raises(grpc.aio.AioRpcError) as again:  # confirming again is refused, clearly
        await reply(host.address, session, confirm)
    assert again.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no tool call is waiting" in again.value.details()
    assert lines(effects) == ["hello"], "the confirmed tool ran once"


def written_bytes(proc: ServerProcess) -> int:
    """Bytes the process has passed to write(2) and friends so far: the store's writes, mostly."""
    for line in Path(f"/proc/{proc.pid}/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError("no wchar in /proc/<pid>/io")


async def test_a_reply_writes_as_much_late_in_a_session_as_early(procs: Procs, tmp_path: Path) -> None:
    host = procs.host(tmp_path / "sessions.db")
    try:
        written_bytes(host)
    except OSError:
        pytest.skip("no /proc/<pid>/io here")
    text = "word " * 400  # 2 kB a message, echoed back: the session grows by ~4 kB a reply
    session, per_reply = "", []
    async with HostClient(host.address) as client:
        before = written_bytes(host)
        for _ in range(50):
            call = client.reply(session, UserMsg(text))
            async with asyncio.timeout(10):
                items = [item async for item in call]
            assert isinstance(items[-1], Msg) and items[-1].finished_reason == ReplyFinishedReason.COMPLETED
            session = call.session_id
            after = written_bytes(host)
            per_reply.append(after - before)
            before = after
    _, state, _ = await get_session(host.address, session)
    assert len(state.context) == 100
    early, late = statistics.median(per_reply[1:8]), statistics.median(per_reply[-7:])
    assert late < 2 * early, f"a reply wrote {early:.0f} bytes early in the session, {late:.0f} late"


def test_a_db_path_that_cannot_be_a_sqlite_file_is_one_line(tmp_path: Path) -> None:
    """--db through a file, a directory as --db, a directory that does not exist: the host refuses
    to start with one line saying what is wrong with the path, and leaves nothing behind. Before:
    "[Errno 17] File exists", "unable to open database file" with a stray <dir>.lock, and a
    mistyped directory created in silence (a new, empty session store)."""
    (tmp_path / "afile").write_text("x\n")
    (tmp_path / "adir").mkdir()
    cases = {
        "afile/x.db": "afile is not a directory",
        "afile/sub/x.db": "afile is not a directory",
        "adir": "adir is a directory, not a SQLite file",
        "no/such/dir/x.db": "no directory no/such/dir (the host creates the file, not its directory)",
    }
    for db, says in cases.items():
        done = run_cli("agent_host", "--db", str(tmp_path / db), "--listen", "127.0.0.1:0", timeout=15)
        assert done.returncode == 1, done.stdout + done.stderr
        cause = says.replace("afile", str(tmp_path / "afile")).replace("adir", str(tmp_path / "adir"))
        cause = cause.replace("no/such/dir", str(tmp_path / "no/such/dir"))
        assert done.stderr.strip() == (
            f"agent-host: cannot start: db: cannot open the session store {str(tmp_path / db)!r}: {cause}"
        ), done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile"]  # no lock, no directory
    assert not any((tmp_path / "adir").iterdir())


def test_a_second_host_on_the_same_sqlite_file_refuses_to_start(procs: Procs, tmp_path: Path) -> None:
    db = tmp_path / "sessions.db"
    first = procs.host(db)
    second = run_cli("agent_host", "--db", str(db), "--listen", "127.0.0.1:0", timeout=20)
    assert second.returncode == 1
    message = second.stderr.strip().splitlines()[-1]
    assert "in use by another agent-host process" in message and f"pid {first.pid}" in message, message
    first.stop()
    procs.host(db, name="host2")  # free again once the first host is gone


def test_a_second_host_on_a_symlink_to_the_sqlite_file_refuses_to_start(procs: Procs, tmp_path: Path) -> None:
    """The lock is the real file's: through a symlink (it was <link>.lock) both hosts served the
    same sessions."""
    db = tmp_path / "s.db"
    first = procs.host(db)
    (tmp_path / "link.db").symlink_to(db)
    second = run_cli("agent_host", "--db", str(tmp_path / "link.db"), "--listen", "127.0.0.1:0", timeout=20)
    assert second.returncode == 1, second.stdout + second.stderr
    message = second.stderr.strip().splitlines()[-1]
    assert "in use by another agent-host process" in message and f"pid {first.pid}" in message, message


# ---------------------------------------------------------------------------------------------
# The SQLite schema at start: migration from the one-blob layout, a newer schema.

V1_SESSIONS = (
    "CREATE TABLE {name} (session_id TEXT PRIMARY KEY, state BLOB NOT NULL, created_at TEXT NOT NULL, "
    "updated_at TEXT NOT NULL, title TEXT NOT NULL DEFAULT '', message_count INTEGER NOT NULL DEFAULT 0, "
    "parked INTEGER NOT NULL DEFAULT 0)"
)
OLD = "2025-01-01T00:00:00+00:00"


def one_blob_sessions(db: sqlite3.Connection, n: int, table: str = "sessions") -> None:
    """``n`` sessions old0.. of the one-blob layout (schema 1) in ``table``."""
    db.execute(V1_SESSIONS.format(name=table))
    for i in range(n):
        state = AgentState(session_id=f"old{i}", context=[UserMsg(f"hello {i}"), AssistantMsg(f"hi {i}")])
        blob = codec.encode(state).SerializeToString()
        db.execute(f"INSERT INTO {table} VALUES (?, ?, ?, ?, ?, 2, 0)", (f"old{i}", blob, OLD, OLD, f"hello {i}"))


def tables(path: Path) -> dict[str, int]:
    db = sqlite3.connect(path)
    try:
        names = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {t: db.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in names}
    finally:
        db.close()


async def listed(address: str) -> list[str]:
    async with grpc.aio.insecure_channel(address) as channel:
        answer = await stub(channel).ListSessions(host_pb2.ListSessionsRequest(), timeout=10)
    return sorted(s.session_id for s in answer.sessions)


def refused_start(db: Path) -> str:
    """Start a host on ``db``, which must refuse to start: the last line it printed."""
    done = run_cli("agent_host", "--db", str(db), "--listen", "127.0.0.1:0", timeout=20)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    return done.stderr.strip().splitlines()[-1]


async def test_a_one_blob_migration_that_fails_leaves_the_database_as_it_was(procs: Procs, tmp_path: Path) -> None:
    """A session of the one-blob layout that does not decode stops the start with one line naming
    the file and the row, and the old layout is intact: fixed, the next start migrates every
    session. Before, the table rename had committed alone (Python's sqlite3 opens no transaction
    for DDL): a DecodeError traceback, then every later start found an empty store."""
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    one_blob_sessions(db, 2)
    db.execute("INSERT INTO sessions VALUES ('broken', x'ffffff00', ?, ?, 'x', 1, 0)", (OLD, OLD))
    db.commit()
    db.close()
    message = refused_start(path)
    assert f"cannot open the session store '{path}'" in message, message
    assert "cannot migrate session 'broken' (row 3 of table sessions, the one-blob layout)" in message, message
    assert tables(path) == {"sessions": 3}, "the database was left as it was"

    db = sqlite3.connect(path)
    db.execute("DELETE FROM sessions WHERE session_id = 'broken'")
    db.commit()
    db.close()
    host = procs.host(path)
    assert await listed(host.address) == ["old0", "old1"]
    _, state, _ = await get_session(host.address, "old1")
    assert [m.text for m in state.context] == ["hello 1", "hi 1"]


async def test_a_one_blob_migration_an_older_host_left_half_done_is_finished(procs: Procs, tmp_path: Path) -> None:
    """What an older host's interrupted migration left (the old table renamed to sessions_v1, the
    new tables empty, sessions made since) is migrated at the next start. Before, those old
    sessions stayed hidden in sessions_v1 for good."""
    path = tmp_path / "half.db"
    store = SqliteStore(path)  # the row layout, as the older host made it after the rename
    await store.create("new").begin_reply()
    store.close()
    db = sqlite3.connect(path)
    one_blob_sessions(db, 2, table="sessions_v1")
    db.commit()
    db.close()
    host = procs.host(path)
    assert await listed(host.address) == ["new", "old0", "old1"]
    _, state, _ = await get_session(host.address, "old0")
    assert [m.text for m in state.context] == ["hello 0", "hi 0"]
    host.stop()
    assert "sessions_v1" not in tables(path)


def test_a_sqlite_database_of_a_newer_schema_is_refused(procs: Procs, tmp_path: Path) -> None:
    """As on PostgreSQL: a database a newer host migrated is refused, and its version is kept.
    Before, it was served and stamped back to this host's version (a newer host would then
    migrate it again)."""
    path = tmp_path / "newer.db"
    SqliteStore(path).close()
    db = sqlite3.connect(path)
    db.execute("ALTER TABLE sessions ADD COLUMN later TEXT")
    db.execute(f"PRAGMA user_version = {SQLITE_SCHEMA + 1}")
    db.commit()
    db.close()
    message = refused_start(path)
    assert f"the database has session schema version {SQLITE_SCHEMA + 1}; this host knows {SQLITE_SCHEMA}" in message
    db = sqlite3.connect(path)
    try:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SQLITE_SCHEMA + 1
    finally:
        db.close()
