"""The journal every row store shares (SQLite, PostgreSQL): one row per context message, one row per
session for the rest, and each write only what changed since the previous one.

Which messages changed is found without re-encoding the whole context: a message is re-encoded
when it is new, when it is not the object stored at its index (compression replaces the list),
when it lost blocks (``remove_block``), or when it was the stored tail (the reply's message grows
in place). Older messages change in no other way.

A backend gives the journal ``_apply(write)`` (make one ``Write`` durable, atomically),
``_check_fence(session_id, fence)`` (raise LeaseLostError unless the lease of ``fence`` is still
this host's) and ``_forget(journal)`` (drop a cached journal whose stored state is no longer known).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
from dataclasses import dataclass, replace
from typing import Protocol

from agentmw.codec import codec
from agentmw.data import Msg, Role
from agentmw.data.state import AgentState
from agentmw.v1 import types_pb2

from .base import ReplyStatus


def digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def encode_meta(state: AgentState) -> bytes:
    """The state without its context: summary, reply_context, middle_context, rules, block owners."""
    return codec.encode(replace(state, context=[])).SerializeToString()


def decode_state(meta: bytes, blobs: list[bytes]) -> AgentState:
    state = codec.decode(types_pb2.AgentState.FromString(meta))
    state.context = [codec.decode(types_pb2.Msg.FromString(b)) for b in blobs]
    return state


@dataclass(slots=True)
class Row:
    """What is stored at one context index: the message object, its block count, its bytes' digest."""

    msg: Msg
    blocks: int
    digest: bytes


@dataclass(slots=True)
class Write:
    session_id: str
    owner: str  # stored when the session's row is created, never changed by a later write
    status: ReplyStatus
    in_flight: list[str]
    fence: int | None
    title: str
    count: int
    meta: bytes | None  # None: unchanged
    upserts: list[tuple[int, bytes]]
    truncate: int | None  # delete rows from this index on


class RowBackend(Protocol):
    async def _apply(self, write: Write) -> None: ...

    async def _check_fence(self, session_id: str, fence: int | None) -> None: ...

    def _remember(self, journal: RowJournal) -> None: ...

    def _forget(self, journal: RowJournal) -> None: ...


class RowJournal:
    """One session as a reply holds it (see ``Journal``); cached by its store between replies."""

    def __init__(self, store: RowBackend, state: AgentState, *, fence: int | None = None, owner: str = "") -> None:
        self.store = store
        self.state = state
        self.owner = owner  # written with the first write only
        self.status = ReplyStatus.IDLE
        self.fence = fence
        self.in_flight: set[str] = set()
        self.in_doubt: frozenset[str] = frozenset()
        self.rows: list[Row] = []
        self.meta_digest = b""
        self.lock = asyncio.Lock()  # concurrent tool calls of one reply write in order

    @classmethod
    def loaded(
        cls,
        store: RowBackend,
        meta: bytes,
        blobs: list[bytes],
        status: str,
        in_flight: list[str],
        fence: int | None,
    ) -> RowJournal:
        """The journal of a stored session (its rows known, so the next write is a diff)."""
        state = decode_state(meta, blobs)
        journal = cls(store, state, fence=fence)
        journal.status = ReplyStatus(status)
        journal.in_flight = set(in_flight)
        journal.in_doubt = frozenset(in_flight)
        journal.rows = [Row(m, len(m.content), digest(b)) for m, b in zip(state.context, blobs, strict=True)]
        journal.meta_digest = digest(meta)
        return journal

    async def begin_reply(self) -> None:
        await self._commit(ReplyStatus.OPEN)

    async def record_step(self) -> None:
        await self._commit(ReplyStatus.OPEN)

    async def record_tool_started(self, call_id: str) -> None:
        await self._commit(ReplyStatus.OPEN, started=call_id)

    async def record_tool_result(self, call_id: str) -> None:
        await self._commit(ReplyStatus.OPEN, finished=call_id)

    async def check_lease(self) -> None:
        await self.store._check_fence(self.state.session_id, self.fence)

    async def park(self) -> None:
        await self._commit(ReplyStatus.PARKED, clear=True)

    async def end_reply(self) -> None:
        await self._commit(ReplyStatus.IDLE, clear=True)

    async def _commit(self, status: ReplyStatus, started: str = "", finished: str = "", clear: bool = False) -> None:
        # Shielded: a cancelled caller must not leave a write half-known (the DB has it, we don't).
        write = asyncio.ensure_future(self._commit_in_order(status, started, finished, clear))
        try:
            await asyncio.shield(write)
        except asyncio.CancelledError:  # the write goes on; its caller is gone, so a failure of it is no bug
            write.add_done_callback(_retrieved)
            raise

    async def _commit_in_order(self, status: ReplyStatus, started: str, finished: str, clear: bool) -> None:
        async with self.lock:
            in_flight = set() if clear else (self.in_flight | {started}) - {finished, ""}
            try:
                write, rows, meta_digest = self.diff(status, sorted(in_flight))
                await self.store._apply(write)
            except BaseException:
                # What is stored is unknown now, or (state that does not encode) older than what is
                # held: the next reply reloads.
                self.store._forget(self)
                raise
            self.rows, self.meta_digest = rows, meta_digest or self.meta_digest
            self.status, self.in_flight = status, in_flight
            self.store._remember(self)  # a new session's journal is kept once it is stored

    def diff(self, status: ReplyStatus, in_flight: list[str]) -> tuple[Write, list[Row], bytes | None]:
        """What to write (encoded here, on the event loop, so it is one consistent snapshot)."""
        context, old = self.state.context, self.rows
        hot = len(old) - 1  # the stored tail: the reply's message grows in place
        rows: list[Row] = []
        upserts: list[tuple[int, bytes]] = []
        for i, msg in enumerate(context):
            row = old[i] if i < len(old) else None
            if row is not None and i < hot and row.msg is msg and row.blocks == len(msg.content):
                rows.append(row)
                continue
            data = codec.encode(msg).SerializeToString()
            d = digest(data)
            if row is None or row.digest != d:
                upserts.append((i, data))
            rows.append(Row(msg, len(msg.content), d))
        meta = encode_meta(self.state)
        meta_digest = digest(meta)
        first_user = next((m for m in context if m.role == Role.USER and m.text), None)
        write = Write(
            session_id=self.state.session_id,
            owner=self.owner,
            status=status,
            in_flight=in_flight,
            fence=self.fence,
            title=first_user.text[:80] if first_user else "",
            count=len(context),
            meta=meta if meta_digest != self.meta_digest else None,
            upserts=upserts,
            truncate=len(context) if len(context) < len(old) else None,
        )
        return write, rows, meta_digest


__all__ = ["Row", "RowBackend", "RowJournal", "Write", "decode_state", "digest", "encode_meta"]


CACHE_SESSIONS = 64  # sessions kept decoded between replies (a reply then loads nothing)


class CachedJournals:
    """What both stores do with the journals they hand out: keep the last few sessions decoded
    (a reply of a cached session reads nothing), and forget one whose stored state is unknown."""

    def __init__(self) -> None:
        self._cache: collections.OrderedDict[str, RowJournal] = collections.OrderedDict()

    async def _apply(self, write: Write) -> None:  # each store's own: with it, a store is a RowBackend
        raise NotImplementedError

    async def _check_fence(self, session_id: str, fence: int | None) -> None:  # each store's own
        raise NotImplementedError

    def create(self, session_id: str, *, fence: int | None = None, owner: str = "") -> RowJournal:
        # Cached at its first write: a new session whose first message is refused leaves nothing
        # behind (else it answered as an existing session until evicted).
        return RowJournal(self, AgentState(session_id=session_id), fence=fence, owner=owner)

    def _remember(self, journal: RowJournal) -> None:
        self._cache[journal.state.session_id] = journal
        self._cache.move_to_end(journal.state.session_id)
        while len(self._cache) > CACHE_SESSIONS:
            self._cache.popitem(last=False)

    def _forget(self, journal: RowJournal) -> None:
        if self._cache.get(journal.state.session_id) is journal:
            del self._cache[journal.state.session_id]


def _retrieved(task: asyncio.Future[None]) -> None:
    """A write no one awaits any more: its failure (a store outage) is not a bug to print at exit."""
    if not task.cancelled():
        task.exception()
