"""The shared session store: PostgreSQL, for many hosts on one database (asyncpg).

Tables (created, or migrated, at start under an advisory lock, so hosts may start together):

* ``agentmw_sessions`` / ``agentmw_messages``: the SQLite layout (a session row with the listing
  columns, the reply status, the calls started without a result and ``meta``; one row per context
  message), written by the shared ``RowJournal`` (journal.py): each write only what changed. The
  session's ``owner`` (the authenticated user who created it) is written with its first row.
* ``agentmw_leases``: one row per session that was ever held: ``fence`` (incremented by every
  taker), ``owner`` (the holding host's ``host_id``, NULL once released), ``expires`` (by the
  database clock) and ``interrupt`` (the fence whose reply another host asked to interrupt). The
  row outlives a deleted session, so fences never repeat.
* ``agentmw_replies``: one row per reply running (or waiting for its session) of an
  authenticated user, on any host: ``replies_per_owner`` counts these, so the limit holds for the
  whole deployment, not per host. A reply that makes its session names it (``new_session``):
  ``sessions_per_owner`` counts those with the stored ones. Rows are renewed with the leases and
  expire like them, so a killed host's replies stop counting after one lease.

One writer per session: a reply takes the lease (only when released or expired: the fence goes
up by one), and every write of it is a transaction that first renews the lease *if its fence is
still the lease's*; else nothing is written and the write raises ``LeaseLostError``. Right before
a tool is called the same check runs again on its own (``_check_fence``: its start was recorded
before the on_acting middleware, which may hold the call past the lease), so a host that lost its
lease (paused, cut off past the expiry, and another host took over) neither saves nor starts a
tool. While held, one loop renews every lease of this host each third of the lease; it also finds
leases taken over and interrupt requests.

Notifications (LISTEN/NOTIFY) make the common cases fast: ``agentmw_lease`` (a lease released:
waiters try at once instead of at the expiry) and ``agentmw_interrupt`` (interrupt the reply of
that fence). A missed notification costs time only: waiters poll at least every second and the
renewal loop reads the ``interrupt`` column. The listening connection, once lost (a database
restart, a failover), is opened again as soon as the database answers. Readiness pings on a
connection of its own (``reachable``), so that a pool whose every connection is at work can neither
delay the ping nor pass for a database that answers.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import re
import secrets
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from agentmw.data.state import AgentState

from .base import (
    Hold,
    LeaseLostError,
    ReplyStatus,
    SessionBusyError,
    SessionRecord,
    TooManyRepliesError,
    TooManySessionsError,
    check_schema_version,
    failure_text,
)
from .journal import CachedJournals, RowJournal, Write, decode_state

log = logging.getLogger("agentmw.store")

# 2: the session's owner (security: the authenticated user who created it); 3: agentmw_replies;
# 4: agentmw_replies.new_session
SCHEMA_VERSION = 4
_MIGRATION_LOCK = 0x61676D77  # pg_advisory_xact_lock key: one host migrates at a time ("agmw")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS agentmw_schema (version integer NOT NULL);
CREATE TABLE IF NOT EXISTS agentmw_sessions (
    session_id    text PRIMARY KEY,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    title         text NOT NULL DEFAULT '',
    message_count integer NOT NULL DEFAULT 0,
    status        text NOT NULL DEFAULT 'idle',
    in_flight     text[] NOT NULL DEFAULT '{}',
    fence         bigint,
    meta          bytea NOT NULL,
    owner         text NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS agentmw_messages (
    session_id text NOT NULL,
    idx        integer NOT NULL,
    msg        bytea NOT NULL,
    PRIMARY KEY (session_id, idx)
);
CREATE TABLE IF NOT EXISTS agentmw_leases (
    session_id text PRIMARY KEY,
    fence      bigint NOT NULL,
    owner      text,
    expires    timestamptz NOT NULL,
    interrupt  bigint NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS agentmw_replies (
    id        text PRIMARY KEY,
    user_name text NOT NULL,
    host      text NOT NULL,
    expires   timestamptz NOT NULL,
    new_session text NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS agentmw_replies_user ON agentmw_replies (user_name);
"""
# Take the lease if it is free (released or expired); else say how long the holder has left.
_ACQUIRE = """
WITH taken AS (
    INSERT INTO agentmw_leases AS l (session_id, fence, owner, expires)
    VALUES ($1, 1, $2, now() + make_interval(secs => $3))
    ON CONFLICT (session_id) DO UPDATE SET fence = l.fence + 1, owner = excluded.owner, expires = excluded.expires
    WHERE l.owner IS NULL OR l.expires <= now()
    RETURNING l.fence
)
SELECT (SELECT fence FROM taken) AS fence, l.owner AS holder,
       extract(epoch FROM l.expires - now())::float8 AS remaining
FROM (SELECT 1) AS one LEFT JOIN agentmw_leases AS l ON l.session_id = $1
"""
_FENCE = """
UPDATE agentmw_leases SET expires = now() + make_interval(secs => $4)
WHERE session_id = $1 AND fence = $2 AND owner = $3 RETURNING fence
"""
_RELEASE = """
WITH r AS (UPDATE agentmw_leases SET owner = NULL, expires = now()
           WHERE session_id = $1 AND fence = $2 AND owner = $3 RETURNING session_id)
SELECT pg_notify('agentmw_lease', session_id) FROM r
"""
_RENEW = """
UPDATE agentmw_leases AS l SET expires = now() + make_interval(secs => $4)
FROM unnest($1::text[], $2::bigint[]) AS h(session_id, fence)
WHERE l.session_id = h.session_id AND l.fence = h.fence AND l.owner = $3
RETURNING l.session_id, l.fence, l.interrupt
"""
_INTERRUPT = """
WITH r AS (UPDATE agentmw_leases SET interrupt = fence
           WHERE session_id = $1 AND owner IS NOT NULL AND expires > now() RETURNING session_id, fence)
SELECT pg_notify('agentmw_interrupt', session_id || ' ' || fence) FROM r
"""
# One user's admissions run one at a time (a transaction-scoped advisory lock per user), so two
# hosts cannot both see room for the last reply.
_ADMIT_LOCK = "SELECT pg_advisory_xact_lock(hashtext('agentmw_replies'), hashtext($1))"
_ADMIT = """
WITH gone AS (DELETE FROM agentmw_replies WHERE user_name = $1 AND expires <= now()),
     live AS (SELECT count(*) AS n FROM agentmw_replies WHERE user_name = $1 AND expires > now())
INSERT INTO agentmw_replies (id, user_name, host, expires, new_session)
SELECT $2, $1, $3, now() + make_interval(secs => $4), $6 FROM live WHERE n < $5
RETURNING id
"""
# The user's sessions with the one to make ($2): those stored and those that live replies make
# (a session is stored at its first write), each once.
_OWNED = """
SELECT count(*) FROM (
    SELECT session_id FROM agentmw_sessions WHERE owner = $1
    UNION SELECT new_session FROM agentmw_replies WHERE user_name = $1 AND new_session <> '' AND expires > now()
    UNION SELECT $2
) AS owned
"""
# This host's running replies ($1 ids, $2 users, $3 the sessions they make): renewed, and written
# again when gone (the host was paused or cut off past a lease, and an admission dropped them as
# expired): a reply that runs on counts again.
_RENEW_REPLIES = """
INSERT INTO agentmw_replies (id, user_name, new_session, host, expires)
SELECT id, user_name, new_session, $4, now() + make_interval(secs => $5)
FROM unnest($1::text[], $2::text[], $3::text[]) AS r(id, user_name, new_session)
ON CONFLICT (id) DO UPDATE SET expires = excluded.expires
"""
# The title is set once (the first user message, host.proto): compression may drop that message
# from the context later, and a write must not retitle the session then.
_UPSERT_SESSION = """
INSERT INTO agentmw_sessions (session_id, title, message_count, status, in_flight, fence, meta, owner)
VALUES ($1, $2, $3, $4, $5, $6, coalesce($7, ''::bytea), $8)
ON CONFLICT (session_id) DO UPDATE SET updated_at = now(),
    title = CASE agentmw_sessions.title WHEN '' THEN excluded.title ELSE agentmw_sessions.title END,
    message_count = excluded.message_count, status = excluded.status, in_flight = excluded.in_flight,
    fence = excluded.fence, meta = coalesce($7, agentmw_sessions.meta)
"""
_UPSERT_MESSAGE = """
INSERT INTO agentmw_messages (session_id, idx, msg) VALUES ($1, $2, $3)
ON CONFLICT (session_id, idx) DO UPDATE SET msg = excluded.msg
"""
_RECORD = "SELECT session_id, created_at, updated_at, title, message_count, status, owner FROM agentmw_sessions"
POLL = 1.0  # a waiter tries again at least this often (a missed notification costs no more)
RELISTEN_MAX = 5.0  # seconds at most between tries to listen again after the connection was lost
REACHABLE_TIMEOUT = 1.0  # seconds a health check waits for the database (probes time out soon after)
MIN_COMMAND_TIMEOUT = 3.0  # seconds connecting may take at least (else the lease)
MIGRATION_WAIT = 300.0  # seconds a starting host waits for another's migration


def is_dsn(db: str) -> bool:
    return db.startswith(("postgresql://", "postgres://"))


_SECRET_PARAMS = {"password", "sslpassword", "passfile"}  # libpq parameters whose value is a secret


def redact(dsn: str) -> str:
    """The DSN without its password (in the authority or a query parameter), for messages."""
    parts = urlsplit(dsn)
    netloc = parts.netloc
    if parts.password is not None:
        netloc = netloc.replace(f":{parts.password}@", ":***@")
    query = "&".join(
        f"{name}=***" if name.lower() in _SECRET_PARAMS else f"{name}={value}" if sep else name
        for name, sep, value in (item.partition("=") for item in parts.query.split("&") if item)
    )
    return urlunsplit(parts._replace(netloc=netloc, query=query))


class PostgresStore(CachedJournals):
    """The PostgreSQL ``SessionStore`` (see the module docstring); ``await PostgresStore.connect(dsn)``."""

    shared = True

    def __init__(self, pool: asyncpg.Pool, listener: asyncpg.Connection, lease: float, dsn: str) -> None:
        self.pool = pool
        self.listener = listener
        self.lease = lease
        self._dsn = dsn  # for listening again (it may hold a password: never logged)
        self._relisten: asyncio.Task[None] | None = None
        self._pinger: asyncpg.Connection | None = None  # readiness's own connection, opened by the first check
        self._ping_lock = asyncio.Lock()
        self._closing = False
        self.host_id = f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}"
        self._held: dict[str, Hold] = {}
        self._releasing: set[asyncio.Task[None]] = set()  # leases a cancelled acquire took (_try_acquire)
        self._waiters: dict[str, set[asyncio.Event]] = collections.defaultdict(set)
        CachedJournals.__init__(self)
        self._renewer: asyncio.Task[None] | None = None
        # This host's rows in agentmw_replies: id -> (user, the session it makes); renewed while any.
        self._admitted: dict[str, tuple[str, str]] = {}

    @classmethod
    async def connect(cls, dsn: str, *, lease: float = 10.0) -> PostgresStore:
        """Connect, create or migrate the schema, and listen. Raises OSError saying what failed."""
        try:
            pool = await asyncpg.create_pool(
                dsn,
                min_size=1,
                max_size=10,
                # Connecting, and every statement: a database that stops answering (hung, or cut
                # off with no reset) fails the call, UNAVAILABLE, instead of holding replies, session
                # calls and shutdown until it answers again. A write slower than the lease is lost anyway.
                timeout=max(lease, MIN_COMMAND_TIMEOUT),
                command_timeout=2 * lease + 1,  # past lock_timeout (_settings): a lock wait ends as busy
                server_settings=_settings(lease),
            )
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
            raise OSError(f"cannot connect to {redact(dsn)}: {exc}") from None
        except ValueError as exc:  # asyncpg's DSN parsing: a port that is not a number, ...
            raise OSError(f"malformed DSN {redact(dsn)}: {exc}") from None
        try:
            await _migrate(pool)
            listener = await asyncpg.connect(dsn, timeout=10)
        except BaseException as exc:
            await pool.close()
            if isinstance(exc, asyncpg.PostgresError | asyncpg.InterfaceError):
                raise OSError(f"{redact(dsn)}: {exc}") from None
            raise
        store = cls(pool, listener, lease, dsn)
        await store._listen(listener)
        store._renewer = asyncio.create_task(store._renew_loop(), name="lease renewal")
        return store

    # -- leases ------------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def hold(
        self, session_id: str, *, wait: bool = True, on_stop: Callable[[], None] | None = None
    ) -> AsyncIterator[Hold]:
        fence = await self._acquire(session_id, wait)
        hold = Hold(session_id, fence, on_stop)
        self._held[session_id] = hold
        try:
            yield hold
        finally:
            if self._held.get(session_id) is hold:
                del self._held[session_id]
            # Shielded: a cancelled reply still hands the session on at once, not at the expiry.
            await asyncio.shield(self._release(session_id, fence))

    async def _release(self, session_id: str, fence: int | None) -> None:
        with contextlib.suppress(Exception):  # else the lease runs out: the session is free then
            await self.pool.fetch(_RELEASE, session_id, fence, self.host_id)

    async def _try_acquire(self, session_id: str) -> Any:
        """One acquire statement. Shielded: a reply cancelled while it runs (its client gave up, the
        host stops) may find the statement already committed on the server, a lease with no hold
        behind it, which held the session on every host for a whole lease; so it runs to its end,
        and the lease it took is released."""
        attempt = asyncio.ensure_future(self.pool.fetchrow(_ACQUIRE, session_id, self.host_id, self.lease))
        try:
            return await asyncio.shield(attempt)
        except asyncio.CancelledError:
            attempt.add_done_callback(lambda done: self._release_untaken(session_id, done))
            raise

    def _release_untaken(self, session_id: str, attempt: asyncio.Future[Any]) -> None:
        if attempt.cancelled() or attempt.exception() is not None:
            return
        fence = attempt.result()["fence"]
        if fence is None:  # it found the session busy: took nothing
            return
        task = asyncio.get_running_loop().create_task(self._release(session_id, int(fence)))
        self._releasing.add(task)  # a reference until it is done (the loop keeps only weak ones)
        task.add_done_callback(self._releasing.discard)

    async def _acquire(self, session_id: str, wait: bool) -> int:
        released = asyncio.Event()
        self._waiters[session_id].add(released)  # before trying: a release meanwhile is not missed
        try:
            while True:
                try:
                    row = await self._try_acquire(session_id)
                except asyncpg.LockNotAvailableError:  # the lease row stayed locked (lock_timeout): busy
                    row = {"fence": None, "holder": None, "remaining": POLL}
                if row["fence"] is not None:
                    return int(row["fence"])
                if not wait:
                    raise SessionBusyError(session_id, f"host {row['holder'] or '(another host)'}")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(released.wait(), min(max(row["remaining"] or 0.0, 0.02), POLL))
                released.clear()
        finally:
            self._waiters[session_id].discard(released)
            if not self._waiters[session_id]:
                del self._waiters[session_id]

    async def _listen(self, conn: asyncpg.Connection) -> None:
        await conn.add_listener("agentmw_lease", self._on_notify)
        await conn.add_listener("agentmw_interrupt", self._on_notify)
        conn.add_termination_listener(self._on_listener_lost)

    def _on_listener_lost(self, conn: asyncpg.Connection) -> None:
        if self._closing or conn is not self.listener or self._relisten is not None:
            return
        log.warning(
            "the database's notification connection was lost: reconnecting; meanwhile waiters poll "
            "every %gs and other hosts' interrupts arrive with the lease renewal",
            POLL,
        )
        self._relisten = asyncio.get_running_loop().create_task(self._reconnect_listener(), name="relisten")

    async def _reconnect_listener(self) -> None:
        """Listen again once the database answers (after a restart, a failover, a cut connection),
        trying at most every RELISTEN_MAX seconds for as long as the store is open."""
        pause = 0.1
        try:
            while True:
                conn = None
                try:
                    conn = await asyncpg.connect(self._dsn, timeout=10)
                    await self._listen(conn)
                except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
                    if conn is not None:
                        conn.terminate()
                    log.debug("cannot listen to the database's notifications yet: %s", exc)
                    await asyncio.sleep(pause)
                    pause = min(2 * pause, RELISTEN_MAX)
                    continue
                self.listener = conn
                log.info("listening to the database's notifications again")
                for events in self._waiters.values():  # a release meanwhile went unheard: try now
                    for event in events:
                        event.set()
                return
        finally:
            self._relisten = None

    def _on_notify(self, _conn: Any, _pid: int, channel: str, payload: str) -> None:
        if channel == "agentmw_lease":
            for event in self._waiters.get(payload, ()):
                event.set()
            return
        session_id, _, fence = payload.rpartition(" ")
        hold = self._held.get(session_id)
        if hold is not None and str(hold.fence) == fence:
            log.info("session %s: another host asked to interrupt the reply", session_id)
            hold.signal()

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.lease / 3)
            holds = list(self._held.values())
            try:
                if self._admitted:
                    ids, rows = list(self._admitted), list(self._admitted.values())
                    users, made = [user for user, _ in rows], [session for _, session in rows]
                    await self.pool.execute(_RENEW_REPLIES, ids, users, made, self.host_id, self.lease)
                    ended = [i for i in ids if i not in self._admitted]  # meanwhile: not to count again
                    if ended:
                        await self.pool.execute("DELETE FROM agentmw_replies WHERE id = ANY($1::text[])", ended)
                if not holds:
                    continue
                rows = await self.pool.fetch(
                    _RENEW, [h.session_id for h in holds], [h.fence for h in holds], self.host_id, self.lease
                )
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
                log.warning("cannot renew %d leases: %s", len(holds), failure_text(exc))
                continue
            alive = {(r["session_id"], r["fence"]): r["interrupt"] for r in rows}
            for hold in holds:
                if self._held.get(hold.session_id) is not hold:
                    continue  # released meanwhile
                if (hold.session_id, hold.fence) not in alive:
                    log.warning("session %s: the lease was taken over by another host", hold.session_id)
                    hold.signal(lost=True)
                elif alive[hold.session_id, hold.fence] == hold.fence:
                    hold.signal()

    async def interrupt(self, session_id: str) -> bool:
        return bool(await self.pool.fetch(_INTERRUPT, session_id))

    async def holder(self, session_id: str) -> str | None:
        return await self.pool.fetchval(
            "SELECT owner FROM agentmw_leases WHERE session_id = $1 AND owner IS NOT NULL AND expires > now()",
            session_id,
        )

    # -- replies per user, across hosts ----------------------------------------------------------

    @contextlib.asynccontextmanager
    async def admit(self, user: str, limit: int, *, new_session: str = "", sessions: int = 0) -> AsyncIterator[None]:
        reply_id = f"{self.host_id}/{secrets.token_hex(8)}"
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(_ADMIT_LOCK, user)  # so no other host counts this user's at the same time
            if new_session and await conn.fetchval(_OWNED, user, new_session) > sessions:
                raise TooManySessionsError(user)
            if await conn.fetchval(_ADMIT, user, reply_id, self.host_id, self.lease, limit, new_session) is None:
                raise TooManyRepliesError(user)
        self._admitted[reply_id] = (user, new_session)
        try:
            yield
        finally:
            del self._admitted[reply_id]
            with contextlib.suppress(Exception):  # else it stops counting when it expires
                await asyncio.shield(self.pool.execute("DELETE FROM agentmw_replies WHERE id = $1", reply_id))

    async def reachable(self) -> bool:
        # On a connection of its own: in the pool, a ping would queue behind a full pool's work (and
        # time out under load), and skipping it took connections that hang for a database that answers.
        if self._closing:  # a check during the host's stop must not open a connection again
            return False
        try:
            async with asyncio.timeout(REACHABLE_TIMEOUT), self._ping_lock:  # one ping at a time on it
                return await self._ping()
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError):
            return False

    async def _ping(self) -> bool:
        """SELECT 1 on readiness's connection, opened (again) when there is none; under _ping_lock."""
        try:
            if self._pinger is None or self._pinger.is_closed():
                self._pinger = await asyncpg.connect(self._dsn)
            return await self._pinger.fetchval("SELECT 1") == 1
        except BaseException:  # the timeout's cancellation too: maybe hung mid-statement, so start afresh
            if self._pinger is not None:
                self._pinger.terminate()
                self._pinger = None
            raise

    # -- writes --------------------------------------------------------------------------------------

    async def _apply(self, w: Write) -> None:
        if w.fence is None:
            raise LeaseLostError(f"session {w.session_id!r}: a shared store is written only under a lease")
        async with self.pool.acquire() as conn, conn.transaction():
            # First, and locking the lease row: a taker's fence commits before this or waits for it.
            if await conn.fetchval(_FENCE, w.session_id, w.fence, self.host_id, self.lease) is None:
                raise _lost(w.session_id, w.fence)
            await conn.execute(
                _UPSERT_SESSION,
                w.session_id,
                w.title,
                w.count,
                w.status.value,
                w.in_flight,
                w.fence,
                w.meta,
                w.owner,
            )
            if w.upserts:
                await conn.executemany(_UPSERT_MESSAGE, [(w.session_id, i, data) for i, data in w.upserts])
            if w.truncate is not None:
                await conn.execute(
                    "DELETE FROM agentmw_messages WHERE session_id = $1 AND idx >= $2", w.session_id, w.truncate
                )

    async def _check_fence(self, session_id: str, fence: int | None) -> None:
        # The fenced renewal on its own: the lease is this host's now (and for another lease from now).
        if fence is None or await self.pool.fetchval(_FENCE, session_id, fence, self.host_id, self.lease) is None:
            raise _lost(session_id, fence)

    # -- SessionStore --------------------------------------------------------------------------------

    async def _read(self, session_id: str) -> tuple[asyncpg.Record, list[bytes]] | None:
        async with self.pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
            row = await conn.fetchrow(
                "SELECT status, in_flight, meta FROM agentmw_sessions WHERE session_id = $1", session_id
            )
            if row is None:
                return None
            msgs = await conn.fetch("SELECT msg FROM agentmw_messages WHERE session_id = $1 ORDER BY idx", session_id)
        return row, [m["msg"] for m in msgs]

    async def open(self, session_id: str, *, fence: int | None = None) -> RowJournal | None:
        cached = self._cache.pop(session_id, None)
        # Fences go up by one per taker: the next fence after ours means no other host held it since.
        if cached is not None and fence is not None and cached.fence is not None and fence == cached.fence + 1:
            cached.fence = fence
            self._remember(cached)
            return cached
        found = await self._read(session_id)
        if found is None:
            return None
        row, blobs = found
        journal = RowJournal.loaded(self, row["meta"], blobs, row["status"], list(row["in_flight"]), fence)
        self._remember(journal)
        return journal

    async def load(self, session_id: str) -> tuple[AgentState, ReplyStatus] | None:
        found = await self._read(session_id)
        if found is None:
            return None
        row, blobs = found
        return decode_state(row["meta"], blobs), ReplyStatus(row["status"])

    async def list(self, limit: int = 0, owner: str | None = None) -> list[SessionRecord]:
        where, args = (" WHERE owner = $1", [owner]) if owner is not None else ("", [])
        sql = _RECORD + where + " ORDER BY updated_at DESC, session_id" + (f" LIMIT {int(limit)}" if limit > 0 else "")
        return [_record(r) for r in await self.pool.fetch(sql, *args)]

    async def record(self, session_id: str) -> SessionRecord | None:
        r = await self.pool.fetchrow(_RECORD + " WHERE session_id = $1", session_id)
        return _record(r) if r else None

    async def delete(self, session_id: str) -> bool:
        self._cache.pop(session_id, None)
        async with self.pool.acquire() as conn, conn.transaction():
            deleted = await conn.execute("DELETE FROM agentmw_sessions WHERE session_id = $1", session_id)
            await conn.execute("DELETE FROM agentmw_messages WHERE session_id = $1", session_id)
        return deleted != "DELETE 0"

    def close(self) -> None:
        """Synchronous callers only: drops the connections without releasing leases (use aclose)."""
        self._closing = True
        for task in (self._renewer, self._relisten):
            if task is not None:
                task.cancel()
        self.pool.terminate()
        self.listener.terminate()
        if self._pinger is not None:
            self._pinger.terminate()

    async def aclose(self) -> None:
        self._closing = True
        for task in (self._renewer, self._relisten):
            if task is not None:
                task.cancel()
        for hold in list(self._held.values()):  # normally none: each reply releases its own
            await self._release(hold.session_id, hold.fence)
        self._held.clear()
        if self._releasing:  # what cancelled acquires took, before the pool goes
            await asyncio.wait(self._releasing, timeout=5)
        with contextlib.suppress(Exception):
            await self.pool.execute("DELETE FROM agentmw_replies WHERE host = $1", self.host_id)
        with contextlib.suppress(Exception):
            await self.listener.close(timeout=5)
        if self._pinger is not None:
            self._pinger.terminate()  # it holds nothing
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.pool.close(), 5)


def _settings(lease: float) -> dict[str, str]:
    """The pool's session settings. A host paused or cut off inside one of its write transactions
    holds the session's lease row locked, and a taker's _ACQUIRE would wait on it for as long:
    the server ends a transaction idle for a lease (the lease has expired by then, unrenewed), and
    no statement waits for a lock beyond two (a taker polls again)."""
    ms = max(1, round(lease * 1000))
    return {"idle_in_transaction_session_timeout": str(ms), "lock_timeout": str(2 * ms)}


async def _migrate(pool: asyncpg.Pool) -> None:
    """Create or migrate the schema, then check it is this host's. A schema already current gets
    no DDL: a database user who may only read and write the tables runs a host."""
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("SET LOCAL lock_timeout = 0")  # another host's migration may take its time
        await conn.execute(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK})", timeout=MIGRATION_WAIT)
        version = None
        if await conn.fetchval("SELECT to_regclass('agentmw_schema')") is not None:
            version = await conn.fetchval("SELECT max(version) FROM agentmw_schema")
        if version is not None:
            check_schema_version(version, SCHEMA_VERSION)
        if version != SCHEMA_VERSION:
            if version is None and await conn.fetchval("SELECT to_regclass('agentmw_sessions')") is not None:
                version = 1  # tables without a version row: the oldest layout, migrated like one
            await conn.execute(_SCHEMA)  # a new database gets the latest layout
            # One step per version, in this transaction (older hosts are to be stopped first).
            if version is not None and version < 2:  # sessions made before owners: owned by no one ("")
                await conn.execute(
                    "ALTER TABLE agentmw_sessions ADD COLUMN IF NOT EXISTS owner text NOT NULL DEFAULT ''"
                )
            # 3: agentmw_replies is new, made by _SCHEMA above (it starts empty: no reply runs during a migration).
            if version is not None and version < 4:
                await conn.execute(
                    "ALTER TABLE agentmw_replies ADD COLUMN IF NOT EXISTS new_session text NOT NULL DEFAULT ''"
                )
            await conn.execute("DELETE FROM agentmw_schema")
            await conn.execute("INSERT INTO agentmw_schema (version) VALUES ($1)", SCHEMA_VERSION)
        await _check_layout(conn)


# How format_type() writes the types _SCHEMA names otherwise.
_TYPE_NAMES = {"timestamptz": "timestamp with time zone"}


def _layout(schema: str) -> dict[str, dict[str, str]]:
    """Each table ``schema`` makes: its columns' names and types, as the database reports them."""
    tables: dict[str, dict[str, str]] = {}
    for table, body in re.findall(r"CREATE TABLE IF NOT EXISTS (\w+) \((.*?)\);", schema, re.S):
        columns = tables[table] = {}
        for line in body.strip().splitlines():
            name, kind = line.split()[:2]
            if name != "PRIMARY":
                columns[name] = _TYPE_NAMES.get(kind.rstrip(","), kind.rstrip(","))
    return tables


_LAYOUT = _layout(_SCHEMA)


async def _check_layout(conn: asyncpg.Connection) -> None:
    """Raise OSError naming what differs when the tables lack a column of this host's schema, or
    have it of another type (changed by hand, another program's tables of the same names): every
    reply would fail later, with a database error."""
    wrong: list[str] = []
    for table, columns in _LAYOUT.items():
        found = dict(
            await conn.fetch(
                "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
                "WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped",
                table,
            )
        )
        if not found:
            wrong.append(f"there is no table {table}")
            continue
        for name, kind in columns.items():
            if name not in found:
                wrong.append(f"{table} has no column {name} ({kind})")
            elif found[name] != kind:
                wrong.append(f"{table}.{name} is {found[name]}, not {kind}")
    if wrong:
        raise OSError(
            f"the session tables do not match schema version {SCHEMA_VERSION}: {'; '.join(wrong)} "
            "(changed by hand, or another program's tables of these names?)"
        )


def _lost(session_id: str, fence: int | None) -> LeaseLostError:
    return LeaseLostError(f"session {session_id!r}: this host's lease (fence {fence}) was taken over by another host")


def _record(r: Any) -> SessionRecord:
    status = ReplyStatus(r["status"])
    stamp = [t.isoformat(timespec="seconds") for t in (r["created_at"], r["updated_at"])]
    return SessionRecord(
        r["session_id"],
        stamp[0],
        stamp[1],
        r["title"],
        r["message_count"],
        status == ReplyStatus.PARKED,
        status,
        r["owner"],
    )


__all__ = ["PostgresStore", "is_dsn", "redact"]
