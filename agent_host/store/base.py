"""The session store interface: what the host needs from any backend (SQLite now, PostgreSQL later).

A reply's progress is written step by step through a ``Journal`` (the session as one reply holds
it), so a host killed at any point leaves a session that the next load can continue:

* ``begin_reply``: the accepted user turn is stored before anything else of the reply happens;
* ``record_tool_started`` before a tool runs, ``record_tool_result`` once its result is in the
  state, so a call that was started but has no result is known after a crash ("in doubt");
* ``park`` / ``end_reply`` when the reply waits for the client or is over.

Every write stores only what changed since the previous one (never the whole session), so the
cost of a reply does not grow with the session's length. A backend with many hosts (``shared``:
PostgreSQL) gives each reply a lease on its session (``hold``): the lease's ``fence`` goes with
each write of the journal opened with it, and a write with a stale fence fails (LeaseLostError),
so a host that lost the lease can save nothing; ``check_lease`` asks the same right before a tool
is called, so it starts no tool either. (SQLite has one host per file: the host's per-session lock
is the lease, and the fence is kept only.)
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from agentmw.data.state import AgentState


class ReplyStatus(StrEnum):
    IDLE = "idle"  # no reply in progress
    OPEN = "open"  # a reply is in progress; found at load only if its host stopped during it
    PARKED = "parked"  # the reply waits for a confirmation or an external execution result


@dataclass(slots=True)
class SessionRecord:
    session_id: str
    created_at: str
    updated_at: str
    title: str
    message_count: int
    parked: bool
    status: ReplyStatus = ReplyStatus.IDLE
    owner: str = ""  # the authenticated user who created it ("" without authentication)


class StoreLockedError(OSError):
    """Another process holds the store (SQLite: one host per database file)."""


def check_schema_version(found: int, known: int) -> None:
    """Raise OSError when the database was migrated by a newer host (``found`` above ``known``):
    its layout is unknown here, so it is neither served nor written to."""
    if found > known:
        raise OSError(
            f"the database has session schema version {found}; this host knows {known}: run a newer agent-host"
        )


class SessionBusyError(Exception):
    """Another reply holds the session (``hold(wait=False)``); ``holder`` names its host."""

    def __init__(self, session_id: str, holder: str) -> None:
        super().__init__(f"session {session_id!r} is busy: a reply of it runs on {holder}")
        self.session_id = session_id
        self.holder = holder


class TooManyRepliesError(Exception):
    """The user has as many replies running as their limit allows (``admit``)."""


def failure_text(exc: BaseException) -> str:
    """What a store failure says: its text, or what it is when it has none (a timeout's is "")."""
    return str(exc) or ("it did not answer in time" if isinstance(exc, TimeoutError) else type(exc).__name__)


class TooManySessionsError(Exception):
    """The reply would make a session past the user's limit of sessions (``admit``)."""


class LeaseLostError(Exception):
    """This host's lease on the session was taken over (it was paused or cut off past its expiry):
    nothing more of the reply is stored, and no tool of it starts."""


@dataclass(eq=False)
class Hold:
    """This host's right to reply in a session: ``fence`` (None: no lease, one host) goes to
    ``open`` / ``create``. ``on_stop`` is called (once) when another host asks for the reply to be
    interrupted, or when the lease is found taken over."""

    session_id: str
    fence: int | None
    on_stop: Callable[[], None] | None = None
    lost: bool = False
    interrupted: bool = field(default=False)

    def signal(self, *, lost: bool = False) -> None:
        self.lost = self.lost or lost
        if not self.interrupted:
            self.interrupted = True
            if self.on_stop is not None:
                self.on_stop()


class Journal(Protocol):
    """A session held by one reply: its state, and the durable record of the reply's progress.

    ``state`` is the live state the reply changes; each write stores what changed in it since the
    previous write. ``in_doubt``: calls recorded as started without a recorded result (only when
    the session was opened after a host stopped mid-reply)."""

    state: AgentState
    status: ReplyStatus
    in_doubt: frozenset[str]
    fence: int | None

    async def begin_reply(self) -> None:
        """The accepted user turn is in ``state``: store it; the reply is now OPEN."""

    async def record_step(self) -> None:
        """Store what changed (e.g. tool decisions, results answered by the client); still OPEN."""

    async def record_tool_started(self, call_id: str) -> None:
        """Before the tool runs: after a crash, the call is in doubt rather than never run."""

    async def record_tool_result(self, call_id: str) -> None:
        """The call's result is in ``state``: store it; the call is no longer in doubt."""

    async def check_lease(self) -> None:
        """Right before a tool is called: raise LeaseLostError unless this host still holds the
        session (its start was recorded earlier, and an on_acting middleware, or a pause, may have
        held the call past the lease since)."""

    async def park(self) -> None:
        """The reply waits for the client (confirmation, external execution)."""

    async def end_reply(self) -> None:
        """The reply is over (completed, failed, interrupted, or closed after a crash)."""


class SessionStore(Protocol):
    shared: bool  # many hosts on one store (attach / detach are then refused: see docs/host.md)
    host_id: str  # this host as other hosts see it ("hostname/pid/..."): names a lease's holder

    def admit(
        self, user: str, limit: int, *, new_session: str = "", sessions: int = 0
    ) -> AbstractAsyncContextManager[None]:
        """Count one running reply of ``user`` while held; raises TooManyRepliesError when ``limit``
        of theirs run already, on any host of the store (a shared store counts in the database).
        ``new_session``: the reply makes that session, which counts against ``sessions`` (the
        user's sessions) from now on, TooManySessionsError when it would pass it. One host per
        store checks that itself (it knows the sessions it is making); a shared store, here."""

    async def reachable(self) -> bool:
        """The store answers now (readiness: a host that cannot store a reply should get none)."""

    def hold(
        self, session_id: str, *, wait: bool = True, on_stop: Callable[[], None] | None = None
    ) -> AbstractAsyncContextManager[Hold]:
        """Hold the session for one reply (or a recovery, a delete): waits while another host holds
        it (``wait=False``: raises SessionBusyError), renews the lease while held, releases it at the end."""

    async def interrupt(self, session_id: str) -> bool:
        """Ask whichever other host replies in the session to interrupt the reply; False if none does."""

    async def holder(self, session_id: str) -> str | None:
        """The host holding the session now (a live lease), if the store knows (None: no one, or
        one host per store: its own per-session lock says)."""

    async def open(self, session_id: str, *, fence: int | None = None) -> Journal | None:
        """The stored session, for a reply (None if there is none). The caller holds the session
        (one reply at a time: the host's per-session lock; with many hosts, the lease of ``fence``)."""

    def create(self, session_id: str, *, fence: int | None = None, owner: str = "") -> Journal:
        """A new, empty session of ``owner``; nothing is stored until its first write."""

    async def load(self, session_id: str) -> tuple[AgentState, ReplyStatus] | None:
        """A read-only snapshot of what is stored (for GetSession), never shared with a reply."""

    async def list(self, limit: int = 0, owner: str | None = None) -> list[SessionRecord]:
        """Most recently updated first; only ``owner``'s when given."""

    async def record(self, session_id: str) -> SessionRecord | None: ...

    async def delete(self, session_id: str) -> bool: ...

    def close(self) -> None: ...

    async def aclose(self) -> None:
        """Close, releasing whatever leases are still held."""


__all__ = [
    "Hold",
    "Journal",
    "LeaseLostError",
    "ReplyStatus",
    "SessionBusyError",
    "SessionRecord",
    "SessionStore",
    "StoreLockedError",
    "TooManyRepliesError",
    "check_schema_version",
]
