"""The embedded session store: SQLite (WAL), one row per message, written incrementally.

Tables: ``sessions`` (one row per session: the listing columns, the reply status, the tool calls
started without a result, and ``meta``: the AgentState proto without its context, so summary,
reply_context, middle_context, permission rules and block owners) and ``messages`` (one row per
context message, keyed by its index). A write upserts the messages that changed, deletes the rows
past the context's end (compression shortens it) and updates the session's row, in one
transaction; every value is proto bytes from the one codec.

Which messages changed is found by the shared ``RowJournal`` (journal.py).

One host per database file: an exclusive ``flock`` on ``<db>.lock`` is held while the store is
open. ``synchronous=NORMAL``: a commit survives the host process being killed (the tested case),
not necessarily a power loss.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import json
import logging
import os
import socket
import sqlite3
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from agentmw.codec import codec
from agentmw.data.state import AgentState
from agentmw.v1 import types_pb2

from .base import Hold, ReplyStatus, SessionRecord, StoreLockedError, TooManyRepliesError, check_schema_version
from .journal import CachedJournals, RowJournal, Write, decode_state

log = logging.getLogger("agentmw.store")

SCHEMA_VERSION = 3  # PRAGMA user_version: 1 one blob per session, 2 the row layout, 3 the session's owner
_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session_id    TEXT PRIMARY KEY,
    created_at    TEXT NOT NULL,
    updated_at    TEXT NOT NULL,
    title         TEXT NOT NULL DEFAULT '',
    message_count INTEGER NOT NULL DEFAULT 0,
    status        TEXT NOT NULL DEFAULT 'idle',
    in_flight     TEXT NOT NULL DEFAULT '[]',
    fence         INTEGER,
    meta          BLOB NOT NULL,
    owner         TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS messages (
    session_id TEXT NOT NULL,
    idx        INTEGER NOT NULL,
    msg        BLOB NOT NULL,
    PRIMARY KEY (session_id, idx)
);
"""
_RECORD = "SELECT session_id, created_at, updated_at, title, message_count, status, owner FROM sessions"


def _now() -> str:
    # Microseconds: ListSessions orders by it, and replies in one second are ordered too.
    return datetime.now(UTC).isoformat(timespec="microseconds")


def _seconds(stamp: str) -> str:
    """A stored time as the API gives it (to the second, as PostgreSQL's store does)."""
    return datetime.fromisoformat(stamp).isoformat(timespec="seconds")


SqliteJournal = RowJournal  # the shared row journal (journal.py); the name is kept for callers


class SqliteStore(CachedJournals):
    """The SQLite ``SessionStore``; ``path`` may be ``":memory:"``. SQLite calls run in worker
    threads (one connection, one lock) so a write never stalls other sessions' streams."""

    shared = False  # one host per file: attach / detach stay per host

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self.host_id = f"{socket.gethostname()}/{os.getpid()}"
        self._replies: collections.Counter[str] = collections.Counter()  # running replies per user
        self._lockfile: IO[str] | None = None
        db = self.path
        if self.path != ":memory:":
            db = str(_check_path(Path(self.path).expanduser()))
            self._lockfile = _lock(Path(db))
        self._lock = threading.Lock()
        CachedJournals.__init__(self)
        self.bytes_written = 0  # message and meta bytes written so far (a measure of write cost)
        try:
            # Autocommit, and every transaction explicit (_transaction): Python's implicit ones leave
            # DDL out (before 3.12), so a migration's table rename committed on its own.
            self._db = sqlite3.connect(db, check_same_thread=False, timeout=10.0, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._migrate()
        except BaseException:
            self._unlock()
            raise

    # -- schema --------------------------------------------------------------------------------

    def _migrate(self) -> None:
        """Create, or migrate, the layout in one transaction: an interrupted migration (a row that
        does not decode, a host killed meanwhile) leaves the database as it was."""
        db = self._db
        with self._transaction():
            version = db.execute("PRAGMA user_version").fetchone()[0]
            check_schema_version(version, SCHEMA_VERSION)  # a newer host's layout: never touched
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            columns = {r[1] for r in db.execute("PRAGMA table_info(sessions)")}
            # Where the one-blob rows are, as a user finds them: in sessions_v1 when an older host's
            # migration did not finish (its rename committed alone), else in sessions (renamed here).
            v1_rows = "sessions_v1"
            if "state" in columns:  # version 1: the whole state in one blob per session
                db.execute("ALTER TABLE sessions RENAME TO sessions_v1")
                v1_rows, columns = "sessions", set()
                tables.add("sessions_v1")
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)
            if columns and "owner" not in columns:  # version 2: no owner yet
                db.execute("ALTER TABLE sessions ADD COLUMN owner TEXT NOT NULL DEFAULT ''")
            if "sessions_v1" in tables:
                self._convert_v1(db, v1_rows)
            if version < SCHEMA_VERSION:
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _convert_v1(self, db: sqlite3.Connection, table: str) -> None:
        """The sessions of the one-blob layout (now ``sessions_v1``; ``table`` is where the user
        finds them) in the row layout. A session id the row layout has already (made after an older
        host's interrupted migration) is left in ``sessions_v1``, with a warning."""
        present = {r[0] for r in db.execute("SELECT session_id FROM sessions")}
        taken: list[str] = []
        migrated: list[tuple[str]] = []
        rows = db.execute("SELECT rowid, session_id, state, created_at, parked FROM sessions_v1")
        for rowid, sid, blob, created, parked in rows:
            if sid in present:
                taken.append(sid)
                continue
            try:
                state = codec.decode(types_pb2.AgentState.FromString(blob))
            except Exception as exc:  # whatever the parser raises on a damaged blob
                raise OSError(
                    f"cannot migrate session {sid!r} (row {rowid} of table {table}, the one-blob layout): its "
                    f"state does not decode ({type(exc).__name__}: {exc}); the database was left as it was: "
                    "repair or delete that row, or restore a backup"
                ) from None
            status = ReplyStatus.PARKED if parked else ReplyStatus.IDLE
            write, _, _ = RowJournal(self, state).diff(status, [])
            self._write_in(db, write, created_at=created)
            migrated.append((sid,))
        if taken:
            log.warning(
                "%s: sessions %s of the one-blob layout were not migrated (a newer session has the same id): "
                "they stay in table sessions_v1",
                self.path,
                ", ".join(map(repr, taken)),
            )
            db.executemany("DELETE FROM sessions_v1 WHERE session_id = ?", migrated)
        else:
            db.execute("DROP TABLE sessions_v1")

    # -- writes (worker thread) ------------------------------------------------------------------

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """All of the block or none of it, DDL included (the connection is in autocommit mode)."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
            self._db.execute("COMMIT")
        finally:
            if self._db.in_transaction:  # the block, or the commit, failed
                self._db.rollback()

    async def _apply(self, w: Write) -> None:
        await asyncio.to_thread(self._write, w)

    async def _check_fence(self, session_id: str, fence: int | None) -> None:
        pass  # one host per file: the lease is the host's own per-session lock, never taken over

    def _write(self, w: Write) -> None:
        with self._lock, self._transaction():
            self._write_in(self._db, w)

    def _write_in(self, db: sqlite3.Connection, w: Write, created_at: str | None = None) -> None:
        now = _now()
        sid = w.session_id
        meta = w.meta if w.meta is not None else b""
        # The title is set once (the first user message, host.proto): compression may drop that
        # message from the context later, and a write must not retitle the session then.
        db.execute(
            "INSERT INTO sessions (session_id, created_at, updated_at, title, message_count, status, in_flight, "
            "fence, meta, owner) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(session_id) DO UPDATE SET "
            "updated_at = excluded.updated_at, "
            "title = CASE sessions.title WHEN '' THEN excluded.title ELSE sessions.title END, "
            "message_count = excluded.message_count, "
            "status = excluded.status, in_flight = excluded.in_flight, fence = excluded.fence"
            + (", meta = excluded.meta" if w.meta is not None else ""),
            (
                sid,
                created_at or now,
                now,
                w.title,
                w.count,
                w.status.value,
                json.dumps(w.in_flight),
                w.fence,
                meta,
                w.owner,
            ),
        )
        if w.upserts:
            db.executemany(
                "INSERT INTO messages (session_id, idx, msg) VALUES (?, ?, ?) "
                "ON CONFLICT(session_id, idx) DO UPDATE SET msg = excluded.msg",
                [(sid, i, data) for i, data in w.upserts],
            )
        if w.truncate is not None:
            db.execute("DELETE FROM messages WHERE session_id = ? AND idx >= ?", (sid, w.truncate))
        self.bytes_written += len(meta) + sum(len(d) for _, d in w.upserts)

    # -- reads (worker thread) -------------------------------------------------------------------

    def _read(self, session_id: str) -> tuple[list[Any], list[bytes]] | None:
        with self._lock:
            row = self._db.execute(
                "SELECT status, in_flight, fence, meta FROM sessions WHERE session_id = ?", (session_id,)
            ).fetchone()
            if row is None:
                return None
            msgs = self._db.execute(
                "SELECT msg FROM messages WHERE session_id = ? ORDER BY idx", (session_id,)
            ).fetchall()
        return list(row), [m[0] for m in msgs]

    def _list(self, limit: int, owner: str | None) -> list[SessionRecord]:
        where, args = (" WHERE owner = ?", (owner,)) if owner is not None else ("", ())
        sql = _RECORD + where + " ORDER BY updated_at DESC, rowid DESC" + (f" LIMIT {int(limit)}" if limit > 0 else "")
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
        return [_record(r) for r in rows]

    def _record(self, session_id: str) -> SessionRecord | None:
        with self._lock:
            r = self._db.execute(_RECORD + " WHERE session_id = ?", (session_id,)).fetchone()
        return _record(r) if r else None

    def _delete(self, session_id: str) -> bool:
        with self._lock, self._transaction():
            cur = self._db.execute("DELETE FROM sessions WHERE session_id = ?", (session_id,))
            self._db.execute("DELETE FROM messages WHERE session_id = ?", (session_id,))
        return cur.rowcount > 0

    # -- async API (SessionStore) ----------------------------------------------------------------

    async def open(self, session_id: str, *, fence: int | None = None) -> RowJournal | None:
        journal = self._cache.get(session_id)
        if journal is not None:
            self._cache.move_to_end(session_id)
            journal.fence = fence
            return journal
        found = await asyncio.to_thread(self._read, session_id)
        if found is None:
            return None
        (status, in_flight, _fence, meta), blobs = found
        journal = RowJournal.loaded(self, meta, blobs, status, json.loads(in_flight), fence)
        self._remember(journal)
        return journal

    async def load(self, session_id: str) -> tuple[AgentState, ReplyStatus] | None:
        found = await asyncio.to_thread(self._read, session_id)
        if found is None:
            return None
        (status, _in_flight, _fence, meta), blobs = found
        return decode_state(meta, blobs), ReplyStatus(status)

    async def list(self, limit: int = 0, owner: str | None = None) -> list[SessionRecord]:
        return await asyncio.to_thread(self._list, limit, owner)

    async def record(self, session_id: str) -> SessionRecord | None:
        return await asyncio.to_thread(self._record, session_id)

    async def delete(self, session_id: str) -> bool:
        self._cache.pop(session_id, None)
        return await asyncio.to_thread(self._delete, session_id)

    @contextlib.asynccontextmanager
    async def hold(
        self, session_id: str, *, wait: bool = True, on_stop: Callable[[], None] | None = None
    ) -> AsyncIterator[Hold]:
        """One host per file: the host's per-session lock is all the holding there is."""
        yield Hold(session_id, None)

    async def interrupt(self, session_id: str) -> bool:
        return False  # no other host to tell

    async def holder(self, session_id: str) -> str | None:
        return None  # one host per file: the host's own lock is the only holding

    @contextlib.asynccontextmanager
    async def admit(self, user: str, limit: int, *, new_session: str = "", sessions: int = 0) -> AsyncIterator[None]:
        """One host per file: this host's replies are all the replies there are, and the sessions
        it is making all there are (the host counts those: ``new_session`` needs nothing here)."""
        if self._replies[user] >= limit:
            raise TooManyRepliesError(user)
        self._replies[user] += 1
        try:
            yield
        finally:
            self._replies[user] -= 1
            if not self._replies[user]:
                del self._replies[user]

    async def reachable(self) -> bool:
        return True  # a local file: a failing disk fails the writes themselves

    def close(self) -> None:
        with self._lock:
            self._db.close()
        self._unlock()

    async def aclose(self) -> None:
        self.close()

    # -- lock --------------------------------------------------------------------------------------

    def _unlock(self) -> None:
        if self._lockfile is not None:
            self._lockfile.close()  # releases the flock
            self._lockfile = None


def _check_path(db: Path) -> Path:
    """``db`` if a SQLite file can be there, else an OSError saying what is wrong with the path
    (SQLite says "unable to open database file", and a directory given as the file left a stray
    lock beside it). No directory is created: a mistyped one would become a new, empty store."""
    if db.is_dir():
        raise IsADirectoryError(f"{db} is a directory, not a SQLite file")
    parent = db.parent
    found = next(p for p in (parent, *parent.parents) if p.exists())  # "." or "/" at worst
    if not found.is_dir():
        raise NotADirectoryError(f"{found} is not a directory")
    if found != parent:
        raise FileNotFoundError(f"no directory {parent} (the host creates the file, not its directory)")
    return db


def _lock(db: Path) -> IO[str]:
    """Hold ``<db>.lock`` exclusively, or raise StoreLockedError naming the process that holds it.
    The lock is beside the real file (symlinks resolved): any path to one file finds its lock."""
    real = db.resolve()
    path = real.with_name(real.name + ".lock")
    f = path.open("a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise StoreLockedError(
            f"{db} is in use by another agent-host process (pid {holder}); one host per SQLite file: "
            "stop that host or give this one another --db"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f


def _record(r: Any) -> SessionRecord:
    status = ReplyStatus(r[5])
    return SessionRecord(r[0], _seconds(r[1]), _seconds(r[2]), r[3], r[4], status == ReplyStatus.PARKED, status, r[6])


__all__ = ["SqliteJournal", "SqliteStore"]
