"""Host: sessions, the attached middleware and the replies in flight (the gRPC layer is server.py).

* A reply runs in its own task (``ReplyRun``), not in the RPC handler: a client that cancels or
  goes away only *interrupts* it (``Agent.interrupt``), so the cleanup still flows through every
  on_reply middleware and the session is saved in every case.
* One Agent per reply, built from shared parts: the model registry, the toolkit and the
  middleware list as they are when the reply starts (attach / detach apply to the next reply).
* Replies of one session are serialized by a per-session lock; different sessions run
  concurrently. A reply's progress is written to the store step by step through the session's
  ``Journal`` (the user turn, each tool start and result, the park or the end), so a restarted
  host continues any session; a reply its host stopped during is closed when the session is
  next loaded (``_open``), and a tool whose result is recorded, or that was started, never runs again.
* With a shared store (PostgreSQL, many hosts), a reply also holds the session's lease
  (``store.hold``) for its whole run: a reply to a session held by another host waits for it, an
  interrupt request from another host or a lease found taken over interrupts the reply, and a
  reply whose lease was taken over ends with ABORTED (its writes, tool starts included, fail).
  A reply sent with ``refuse_if_busy`` does not wait: a session held here or on another host
  refuses it with ABORTED naming the holder.
* ``replies_per_owner`` is counted by the store (``store.admit``): per host on SQLite (one host
  per file), in the database on PostgreSQL, so it limits a user's replies on all hosts together;
  ``sessions_per_owner`` is checked here, and again at admission on PostgreSQL, with the sessions
  other hosts are making.
* ``drain`` (SIGTERM): new replies are refused with UNAVAILABLE while those in flight finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from agentmw.data import (
    ErrorInfo,
    ErrorType,
    Msg,
    ReplyEndEvent,
    ReplyFinishedReason,
    Role,
    ToolCallBlock,
    UserInterruptEvent,
)
from agentmw.data.state import AgentState
from agentmw.hooks import HOOKS
from agentmw.security import channel
from agentmw.tools import MAX_MODEL_TOOLS, Tool, Toolkit, middleware_tools, registered_tools, schema_validator

from .. import metrics, tracing
from ..agent import CUT_OFF, Agent, InputRefused
from ..agent_base import ReplyError, ReplyJournal
from ..config import HostConfig, MiddlewareConfig
from ..models import ModelRegistry
from ..remote import Policy, RemoteMiddleware
from ..remote.client import CHANNEL_OPTIONS, Access
from ..remote.errors import MiddlewareFailure, NoAnswer, NotReady, Unreachable
from ..runtime_state import RuntimeState
from ..security import ANONYMOUS_ADMIN, Principal
from ..store import (
    STORE_ERRORS,
    Hold,
    Journal,
    LeaseLostError,
    ReplyStatus,
    SessionBusyError,
    SessionRecord,
    SessionStore,
    TooManyRepliesError,
    TooManySessionsError,
    store_failure,
)

log = logging.getLogger("agentmw.host")

QUEUE_SIZE = 256  # items a reply may run ahead of a slow client before it waits
BATCH = 64  # items at most in one ReplyEvent
# Bytes at most in one ReplyEvent of several items: far below the 4 MiB a gRPC client accepts by
# default, however large the items are that came at once (one item alone may take more: host.proto).
BATCH_BYTES = 1024 * 1024
# Seconds an interrupted reply may take to wind down (its end flows out through every on_reply
# middleware) before it is cut off: a middleware that keeps the reply going cannot keep the host busy.
INTERRUPT_GRACE = 5.0
MAX_ATTACH_PAUSE = 30.0  # seconds at most between tries to attach a middleware not reached at start
# What a middleware not reached at start may still cure by itself (a refusal will not: wrong token,
# protocol violation), so the host starts without it and waits (Host.attach_when_it_answers).
WAIT_FOR = (Unreachable, NoAnswer, NotReady)
MAX_SESSION_ID = 256  # characters of a session id a client chooses (the host mints 32)


class ReplyRejected(Exception):
    """A reply cannot start; the RPC fails with ``code`` (nothing was changed)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class TooManyTools(ValueError):
    """Attaching a middleware would offer the model more tools than a model request takes."""


@dataclass(eq=False)
class Pending:
    """A middleware the host could not reach at start: attached once it answers (while a required,
    fail_closed, one is pending, replies are refused)."""

    config: MiddlewareConfig
    why: str  # its last failure
    task: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return self.config.name or self.config.address


@dataclass(eq=False)
class Attached:
    """One attached middleware server and the tools it contributes (registered as name__tool)."""

    config: MiddlewareConfig
    remote: RemoteMiddleware
    tools: dict[str, Tool]
    users: int = 0  # replies using it now
    detached: bool = False
    tools_refused: bool = False  # its tools as last listed clashed (Host._tools_changed): none offered

    @property
    def name(self) -> str:
        return self.remote.name


@dataclass(eq=False)
class _Setup:
    """What a reply is built from; replaced as a whole on attach / detach."""

    middleware: tuple[Attached, ...] = ()
    toolkit: Toolkit = field(default_factory=Toolkit)


_END = object()
_ACCEPTED = object()  # the reply is accepted: the client's first ReplyEvent goes now, with no item if need be


class _Announcing:
    """A reply's journal that tells the client once the user turn is stored (ReplyRun.accept).
    A wrapper, not a field of the journal: the store caches that beyond the reply."""

    def __init__(self, journal: Journal, accepted: Callable[[], None]) -> None:
        self._journal, self._accepted = journal, accepted
        self.record_step = journal.record_step
        self.record_tool_started = journal.record_tool_started
        self.record_tool_result = journal.record_tool_result
        self.check_lease = journal.check_lease

    async def begin_reply(self) -> None:
        await self._journal.begin_reply()
        self._accepted()


class ReplyRun:
    """One reply in flight: its task, and the queue its items flow through to the client."""

    def __init__(self, session_id: str, owner: str = "") -> None:
        self.session_id = session_id
        self.owner = owner  # who asks for the reply
        self.session_owner = owner  # whom the session belongs to (_check_access): agent.state.owner
        self.new_session = False  # the reply makes its session (_check_access): counts per owner
        self.queue: asyncio.Queue[Any] = asyncio.Queue(QUEUE_SIZE)
        self.agent: Agent | None = None
        self.interrupted = False
        self.consumer_gone = False
        self.task: asyncio.Task[None] | None = None
        self.cut_off = False  # the reply did not wind down within INTERRUPT_GRACE and was cancelled
        self.ended = False  # its stream's end is decided (end_now)
        self.final: ReplyRejected | None = None  # an end decided while the queue was full
        self.waiting = False  # for its session (this host's lock, the store's lease): not started
        self.existed = False  # its session was stored when the reply was asked for (_check_access)
        self.withdrawn = False  # interrupted while waiting: it ends at once, nothing stored
        self.last_read = time.monotonic()  # when the client last took items
        self.told = False  # a ReplyEvent is on its way to the client (accept, or an item): it knows the session
        self._grace: asyncio.TimerHandle | None = None

    def interrupt(self, grace: float = INTERRUPT_GRACE) -> None:
        """The client cancelled: interrupt the reply (it still ends cleanly and is saved), and cut it
        off if it has not ended ``grace`` seconds later."""
        self.interrupted = True
        if self.agent is not None:
            self.agent.interrupt()
        elif self.waiting and self.task is not None and not self.task.done():
            self.withdrawn = True  # nothing began, nothing to save: stop waiting now
            self.task.cancel()
            return
        if self._grace is None and self.task is not None and not self.task.done():
            self._grace = asyncio.get_running_loop().call_later(grace, self._cut_off)
            self.task.add_done_callback(lambda _t: self._grace.cancel() if self._grace else None)

    def _cut_off(self) -> None:
        if self.task is not None and not self.task.done():
            log.warning(
                "session %s: the interrupted reply did not end within %ss: cancelling it",
                self.session_id,
                INTERRUPT_GRACE,
            )
            self.cut_off = True
            self.task.cancel()

    def abandon(self) -> None:
        """The client went away: interrupt, and drop whatever is still queued."""
        if self.task is not None and not self.task.done():
            self.interrupt()
        self.consumer_gone = True
        while not self.queue.empty():
            self.queue.get_nowait()

    def accept(self) -> None:
        """The reply is accepted (its message stored, or its resumption event checked): the client
        is told at once, with the session id, though middleware may hold its first item for long
        (host.proto, ReplyEvent): a call that breaks from now on can name the session."""
        if not self.told and not self.consumer_gone:
            self.told = True
            self.queue.put_nowait(_ACCEPTED)  # nothing queued yet (told): never full

    async def put(self, item: Any) -> None:
        if not self.consumer_gone:
            self.told = True
            await self.queue.put(item)

    def end_now(self, final: ReplyRejected) -> None:
        """End the stream with ``final`` without waiting for the client: the reply's task ends at
        once; a client still reading gets every queued item, then ``final`` (batches)."""
        self.ended = True
        metrics.reply_refused(self.session_id, final.code.name, str(final))
        if self.queue.qsize() <= QUEUE_SIZE - 2:
            self.queue.put_nowait(final)
            self.queue.put_nowait(_END)
        else:  # full: batches() raises it once the client has taken what is queued
            self.final = final

    def stalled(self) -> bool:
        """The client has not taken items for a while though some wait for it."""
        return self.queue.full() and time.monotonic() - self.last_read > 1.0

    async def batches(self) -> AsyncIterator[list[Any]]:
        """Items as they come, each batch all that is ready at once; raises ReplyRejected."""
        while True:
            batch = [await self.queue.get()]
            while len(batch) < BATCH and not self.queue.empty():
                batch.append(self.queue.get_nowait())
            self.last_read = time.monotonic()
            if self.final is not None and self.queue.empty():  # end_now found the queue full
                batch += [self.final]
            if batch[0] is _ACCEPTED:  # first if at all: with the items ready, else alone
                del batch[0]
                if not batch or batch[0] is _END or isinstance(batch[0], ReplyRejected):
                    yield []
                if not batch:
                    continue
            end = next((i for i, x in enumerate(batch) if x is _END or isinstance(x, ReplyRejected)), None)
            if end is None:
                yield batch
                continue
            if end:
                yield batch[:end]
            if isinstance(batch[end], ReplyRejected):
                raise batch[end]
            return


class Host:
    def __init__(self, config: HostConfig, store: SessionStore, models: ModelRegistry, tools: Sequence[Tool]) -> None:
        self.config = config
        self.store = store
        self.models = models
        self.tools = list(tools)
        self._setup = _Setup(toolkit=Toolkit(self.tools))
        self._setup_lock = asyncio.Lock()
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._runs: set[ReplyRun] = set()
        # Per owner, the new sessions whose first reply runs and which the store may not hold yet:
        # counted with the stored ones, so that concurrent first replies cannot pass the limit.
        self._creating: dict[str, set[str]] = {}
        self.draining = False  # shutting down: new replies are refused (UNAVAILABLE)
        self.pending: dict[str, Pending] = {}  # middleware not reached yet (attach_when_it_answers)

    # -- replies ---------------------------------------------------------------------------------

    def start_reply(
        self,
        session_id: str,
        inputs: Any,
        structured_schema: dict[str, Any] | None = None,
        *,
        caller: Principal = ANONYMOUS_ADMIN,
        may_create: bool = True,
        refuse_if_busy: bool = False,
    ) -> ReplyRun:
        """Run a reply to ``inputs`` (a message, or an event resuming a parked reply); with
        ``structured_schema`` (a message only) its final Msg carries a ``structured_output``.
        ``caller`` must own the session (or be an admin); ``may_create``: an unknown id starts a
        new session (else it is NOT_FOUND, like another user's); ``refuse_if_busy``: a session held
        by another reply (here or on another host) refuses this one (ABORTED) instead of waiting."""
        run = ReplyRun(session_id, caller.name)
        work = self._run(run, inputs, structured_schema, caller, may_create, refuse_if_busy)
        run.task = asyncio.create_task(work, name=f"reply {session_id}")
        self._runs.add(run)
        run.task.add_done_callback(lambda _t: self._runs.discard(run))
        return run

    async def _run(
        self,
        run: ReplyRun,
        inputs: Any,
        structured_schema: dict[str, Any] | None,
        caller: Principal,
        may_create: bool,
        refuse_if_busy: bool,
    ) -> None:
        limit = self.config.security.replies_per_owner
        try:
            sid = run.session_id
            if not _valid_session_id(sid):  # before any store sees it (PostgreSQL refuses a NUL)
                what = "control characters" if len(sid) <= MAX_SESSION_ID else f"{len(sid)} characters"
                raise ReplyRejected(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"a session id is at most {MAX_SESSION_ID} printable characters (this one has {what})",
                )
            await self._check_access(run, inputs, caller, may_create)
            # Counted from here to the end, waiting for the session included (no authentication: no limit).
            admitted = (
                self.store.admit(
                    caller.name,
                    limit,
                    new_session=sid if run.new_session else "",
                    sessions=self.config.security.sessions_per_owner,
                )
                if caller.name
                else contextlib.nullcontext()
            )
            async with admitted:
                await self._reply(run, inputs, structured_schema, wait=not refuse_if_busy)
        # A failure ends the stream at once (end_now), never waiting for a client that stopped reading.
        except ReplyRejected as exc:
            run.end_now(exc)
        except TooManyRepliesError:
            where = " on all hosts together" if self.store.shared else ""
            run.end_now(
                ReplyRejected(grpc.StatusCode.RESOURCE_EXHAUSTED, f"at most {limit} replies at once per user{where}")
            )
        except TooManySessionsError:  # another host made the user's last one meanwhile (a shared store)
            run.end_now(self._too_many_sessions())
        except SessionBusyError as exc:  # refuse_if_busy
            run.end_now(ReplyRejected(grpc.StatusCode.ABORTED, f"{exc} (refused, as refuse_if_busy asks)"))
        except LeaseLostError as exc:  # paused or cut off past the lease: another host has the session
            log.warning("%s: the reply stops here, nothing more of it is stored", exc)
            run.end_now(ReplyRejected(grpc.StatusCode.ABORTED, f"{exc}: retry the reply (on any host)"))
        except asyncio.CancelledError:
            if not (run.cut_off or run.withdrawn):  # the host is shutting down
                raise
            task = asyncio.current_task()
            assert task is not None
            task.uncancel()
            if run.withdrawn:
                run.end_now(self._withdrawn())
                return
            why = "the client did not read its events" if run.stalled() else "a middleware kept it going"
            run.end_now(
                ReplyRejected(
                    grpc.StatusCode.ABORTED,
                    f"the reply was interrupted but did not end within {INTERRUPT_GRACE}s ({why}), so it was "
                    "cut off; the session keeps what was done, open tool calls closed",
                )
            )
        except STORE_ERRORS as exc:  # an outage, not a host bug: worth a retry (here once it is back, or elsewhere)
            log.warning("reply of session %s: %s", run.session_id, store_failure(exc))
            run.end_now(ReplyRejected(grpc.StatusCode.UNAVAILABLE, store_failure(exc)))
        except Exception:  # a host bug: say so on the stream rather than hang the client
            log.exception("reply of session %s failed", run.session_id)
            run.end_now(ReplyRejected(grpc.StatusCode.INTERNAL, "the host failed; see its log"))
        finally:
            if not run.ended:  # a reply that ran to its end: every item reaches a slow client
                await run.put(_END)

    def _withdrawn(self) -> ReplyRejected:
        """The end of a reply interrupted before it began (it waited for its session)."""
        if self.draining:
            return ReplyRejected(
                grpc.StatusCode.UNAVAILABLE,
                "this host is shutting down and the reply had not begun (it waited for its session): nothing "
                "of it was stored; send it to another host",
            )
        return ReplyRejected(
            grpc.StatusCode.CANCELLED,
            "the reply was interrupted before it began (it waited for its session): nothing of it was stored",
        )

    async def _reply(
        self, run: ReplyRun, inputs: Any, structured_schema: dict[str, Any] | None, *, wait: bool = True
    ) -> None:
        sid = run.session_id
        check_structured_schema(inputs, structured_schema)  # before waiting for the session or storing
        if self.draining:
            raise ReplyRejected(grpc.StatusCode.UNAVAILABLE, "this host is shutting down: send the reply to another")
        missing = self.required_unavailable()
        if missing is not None:
            raise ReplyRejected(grpc.StatusCode.UNAVAILABLE, missing)
        run.waiting = True
        async with self._holding(sid, wait=wait, on_stop=run.interrupt) as hold:
            run.waiting = False
            if run.interrupted:  # while it waited (a reply with no session yet is withdrawn at once)
                raise self._withdrawn()
            journal = await self._open(sid, hold.fence)
            if journal is None:
                if not isinstance(inputs, Msg):
                    raise ReplyRejected(grpc.StatusCode.NOT_FOUND, f"no session {sid!r} to resume")
                if run.existed:  # deleted while this reply waited for it: not made anew, empty
                    raise ReplyRejected(
                        grpc.StatusCode.NOT_FOUND,
                        f"session {sid!r} was deleted while this reply waited for it: nothing of it was stored",
                    )
                journal = self.store.create(sid, fence=hold.fence, owner=run.owner)
            setup = self._setup  # this reply's middleware and tools, whatever attach/detach do meanwhile
            for a in setup.middleware:
                a.users += 1
            try:
                agent = self._agent(journal.state, setup, _Announcing(journal, run.accept))
                agent.state.owner = run.session_owner
                self._check_inputs(agent, inputs)
                if not isinstance(inputs, Msg):  # a resumption: the session holds the reply already
                    run.accept()
                if _is_retry(journal.state, inputs):  # the client retries a reply its host stopped during
                    inputs = None  # continue the stored turn: its message is not stored twice
                run.agent = agent
                if run.interrupted:  # cancelled while the session loaded: nothing began
                    raise self._withdrawn()
                final: Msg | None = None  # the reply's last item: sent once the reply is stored
                end: list[Any] = []  # its ReplyEndEvent (and what follows): the same
                # The store write inside the reply's metrics and span: a reply whose end is not
                # stored is counted and logged as failed, not as it would have ended.
                with tracing.reply_span(agent, inputs), metrics.reply(agent) as watch:
                    try:
                        async for item in agent.reply_stream(inputs, structured_schema):
                            watch.last = item
                            if final is not None:
                                await run.put(final)
                                final = None
                            if isinstance(item, Msg):
                                final = item
                            elif end or isinstance(item, ReplyEndEvent):
                                end.append(item)
                            else:
                                await run.put(item)
                    finally:
                        if run.cut_off:  # cancelled half-way: close the reply as after a host crash
                            agent.close_interrupted_reply(None, CUT_OFF)
                        try:  # Shielded: a host shutdown that cancels this task must not lose the session.
                            await asyncio.shield(journal.park() if agent.awaiting_calls() else journal.end_reply())
                        except STORE_ERRORS as exc:  # the client gets an ERROR end, then UNAVAILABLE
                            why = f"the reply was not stored: {store_failure(exc)}"
                            watch.error = ErrorInfo(type=ErrorType.UPSTREAM, message=why)
                            if end and isinstance(end[0], ReplyEndEvent):
                                ended = replace(end[0], finished_reason=ReplyFinishedReason.ERROR, error=watch.error)
                                await run.put(ended)
                            raise
                # Only now: a client that saw the reply's end can count on the session holding the
                # reply (parked or ended), whichever host it asks next.
                for item in end:
                    await run.put(item)
                if final is not None:
                    await run.put(final)
            finally:
                for a in setup.middleware:
                    a.users -= 1
                    if a.detached and a.users == 0:
                        await a.remote.close()

    async def _check_access(self, run: ReplyRun, inputs: Any, caller: Principal, may_create: bool) -> None:
        """Another user's session answers exactly as a missing one; per-owner limits (with
        authentication). Before the session lock: waiting on it would tell a session is busy."""
        sid = run.session_id
        record = await self.store.record(sid)
        if (record is None and not may_create) or not self._visible(record, caller):
            what = f"no session {sid!r}" + ("" if isinstance(inputs, Msg) else " to resume")
            raise ReplyRejected(grpc.StatusCode.NOT_FOUND, what)
        run.session_owner = record.owner if record is not None else run.owner  # an admin may reply in it
        run.existed = record is not None
        if not caller.name:  # no authentication: one anonymous owner, no per-owner limits
            return
        limits = self.config.security
        if record is None:
            stored = {r.session_id for r in await self.store.list(0, caller.name)}
            creating = self._creating.setdefault(caller.name, set())
            if len(stored | creating | {run.session_id}) > limits.sessions_per_owner:  # no await since list
                raise self._too_many_sessions()
            # On a shared store, admission counts it again with those other hosts are making (store.admit).
            run.new_session = True
            creating.add(run.session_id)
            assert run.task is not None  # this is its task (start_reply)
            run.task.add_done_callback(lambda _t: creating.discard(run.session_id))

    def _too_many_sessions(self) -> ReplyRejected:
        where = " on all hosts together" if self.store.shared else ""
        limit = self.config.security.sessions_per_owner
        return ReplyRejected(
            grpc.StatusCode.RESOURCE_EXHAUSTED, f"at most {limit} sessions per user{where}: delete some first"
        )

    async def _may_see(self, session_id: str, caller: Principal) -> bool:
        """Whether ``caller`` may see a session of this id (another user's answers as a missing one,
        and so does an id no session can have, before the store sees it)."""
        return _valid_session_id(session_id) and self._visible(await self.store.record(session_id), caller)

    @staticmethod
    def _visible(record: SessionRecord | None, caller: Principal) -> bool:
        return record is None or caller.admin or record.owner == caller.name

    async def _open(self, session_id: str, fence: int | None) -> Journal | None:
        """The session for a reply (the caller holds its lock and lease). A reply found OPEN was running
        when its host stopped (or lost the lease): it is closed now, its recorded results kept, before
        anything else happens."""
        journal = await self.store.open(session_id, fence=fence)
        if journal is not None and journal.status == ReplyStatus.OPEN:
            log.warning("session %s: closing the reply its host stopped during", session_id)
            self._agent(journal.state).close_interrupted_reply(journal.in_doubt)
            await journal.end_reply()
        return journal

    @contextlib.asynccontextmanager
    async def _holding(
        self, session_id: str, *, wait: bool = True, on_stop: Callable[[], None] | None = None
    ) -> AsyncIterator[Hold]:
        """The session for one reply (or a recovery, a delete): this host's lock, then the store's
        lease (so one waiter per session and host polls it). ``wait=False``: SessionBusyError at
        once, naming the holder, when either is taken."""
        lock = self._session_lock(session_id)
        if not wait and lock.locked():  # no await between this and taking it: no one slips in
            raise SessionBusyError(session_id, f"this host ({self.store.host_id})")
        async with lock, self.store.hold(session_id, wait=wait, on_stop=on_stop) as hold:
            yield hold

    def _session_lock(self, session_id: str) -> asyncio.Lock:
        lock = self._locks.get(session_id)
        if lock is None:
            lock = self._locks[session_id] = asyncio.Lock()
        return lock

    def _agent(self, state: AgentState, setup: _Setup | None = None, journal: ReplyJournal | None = None) -> Agent:
        setup = setup or self._setup
        cfg = self.config
        return Agent(
            name=cfg.agent_name,
            system_prompt=cfg.system_prompt,
            models=self.models,
            toolkit=setup.toolkit,
            middlewares=[a.remote for a in setup.middleware],
            state=state,
            max_iters=cfg.max_iters,
            journal=journal,
            runtime_state=RuntimeState(timezone=cfg.timezone) if cfg.inject_runtime_state else None,
        )

    @staticmethod
    def _check_inputs(agent: Agent, inputs: Any) -> None:
        """Refuse, before anything changes, what the agent could only answer by failing the reply."""
        sid = agent.state.session_id
        if isinstance(inputs, UserInterruptEvent):
            if not agent.awaiting_calls():  # in-process it yields nothing; a client is told
                raise ReplyRejected(grpc.StatusCode.FAILED_PRECONDITION, f"session {sid!r} has no parked reply")
            try:
                agent.check_reply_id(inputs)  # as for the other resumption events
            except ReplyError as exc:
                raise ReplyRejected(grpc.StatusCode.FAILED_PRECONDITION, f"session {sid!r}: {exc}") from None
            return
        try:
            agent.check_inputs(inputs)
        except InputRefused as exc:
            if exc.malformed:
                raise ReplyRejected(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            raise ReplyRejected(grpc.StatusCode.FAILED_PRECONDITION, f"session {sid!r}: {exc}") from None

    def replying(self, session_id: str) -> bool:
        """A reply of the session runs (or waits to) on this host."""
        return any(r.session_id == session_id for r in self._runs)

    async def replying_anywhere(self, session_id: str) -> bool:
        """A reply of the session runs on this host or holds it on another host of a shared store."""
        return self.replying(session_id) or await self.store.holder(session_id) is not None

    async def interrupt(self, session_id: str, caller: Principal = ANONYMOUS_ADMIN) -> bool:
        """Interrupt the session's running reply, here or on another host of a shared store (another
        user's session answers as one with no reply)."""
        if not await self._may_see(session_id, caller):
            return False
        # The reply that runs: not those that wait for the session behind it (other clients' messages).
        local = [r for r in self._runs if r.session_id == session_id and not r.waiting]
        for run in local:
            run.interrupt()
        return await self.store.interrupt(session_id) or bool(local)

    # -- sessions --------------------------------------------------------------------------------

    async def sessions(self, limit: int = 0, caller: Principal = ANONYMOUS_ADMIN) -> list[SessionRecord]:
        return await self.store.list(limit, None if caller.admin else caller.name)

    async def session(
        self, session_id: str, caller: Principal = ANONYMOUS_ADMIN
    ) -> tuple[SessionRecord, AgentState, list[ToolCallBlock]] | None:
        if not await self._may_see(session_id, caller):
            return None
        loaded = await self.store.load(session_id)
        if loaded is not None and loaded[1] == ReplyStatus.OPEN and not self.replying(session_id):
            # Left open by a host that stopped: close it; unless another host replies in it now.
            with contextlib.suppress(SessionBusyError):
                async with self._holding(session_id, wait=False) as hold:
                    await self._open(session_id, hold.fence)
            loaded = await self.store.load(session_id)
        record = await self.store.record(session_id)
        if loaded is None or record is None:
            return None
        state = loaded[0]
        return record, state, self._agent(state).awaiting_calls()

    async def delete_session(self, session_id: str, caller: Principal = ANONYMOUS_ADMIN) -> bool:
        """Delete a session no reply holds (SessionBusyError naming who does: a delete never waits
        for a reply, which may wait on its client for good)."""
        if not await self._may_see(session_id, caller):
            return False
        async with self._holding(session_id, wait=False):
            return await self.store.delete(session_id)

    @staticmethod
    def middle_context_json(state: AgentState) -> str:
        """JSON any parser reads: a slot may hold NaN or an infinity (set in-process, or over the
        wire, where a Value's number takes them), which JSON has no token for; they are written as
        proto3's JSON mapping writes them, the strings "NaN", "Infinity" and "-Infinity"."""
        try:
            return json.dumps(state.middle_context, sort_keys=True, default=str, allow_nan=False)
        except ValueError:
            return json.dumps(_finite(state.middle_context), sort_keys=True, default=str)

    # -- middleware --------------------------------------------------------------------------------

    @property
    def middleware(self) -> tuple[Attached, ...]:
        return self._setup.middleware

    async def attach(self, mc: MiddlewareConfig, position: int | None = None) -> Attached:
        """Describe the server, list its tools, and add it for the next replies. Raises
        MiddlewareFailure when it cannot be reached, ValueError on a name clash."""
        async with self._setup_lock:
            if mc.name and any(a.name == mc.name for a in self.middleware):
                raise ValueError(f"a middleware named {mc.name!r} is already attached")
            remote = RemoteMiddleware(
                mc.address,
                name=mc.name or None,
                policy=Policy(
                    fail_open=mc.fail_open,
                    timeout=mc.timeout,
                    max_items=mc.max_items,
                    max_bytes=mc.max_bytes,
                    max_item_bytes=mc.max_item_bytes,
                ),
                access=self._access(mc),
            )
            remote.tools_changed = self._tools_changed  # once it is attached, a new tool list is news
            try:
                await remote.connect()
                if any(a.name == remote.name for a in self.middleware):
                    raise ValueError(f"a middleware named {remote.name!r} is already attached")
                owner = next((m for m in self.config.middleware if m.key == remote.key and m is not mc), None)
                if not mc.key and owner is not None:  # a configured key's slot is that middleware's alone
                    raise ValueError(f"{mc.address} reports key {remote.key!r}, reserved for {owner.source}")
                clash = next((a for a in self.middleware if a.remote.key == remote.key), None)
                if clash is not None:  # one key = one middle_context slot: two would share it
                    raise ValueError(
                        f"{mc.address} reports key {remote.key!r}, already used by middleware {clash.name!r}; "
                        "give one of them another get_middleware_key()"
                    )
                tools = await middleware_tools(remote, remote.name)
                attached = Attached(mc, remote, tools)
                middleware = list(self.middleware)
                middleware.insert(len(middleware) if position is None else position, attached)
                self._set_middleware(middleware)
            except BaseException:
                await remote.close()
                raise
            for waiting in [p for p in self.pending.values() if p.config is not mc]:
                if waiting.name == attached.name or waiting.config.address == mc.address:
                    # Attached by hand in its stead: waiting on would hold a fail_closed one's
                    # replies refused for good (its name is taken now), or attach it twice.
                    log.info(
                        "middleware %s was attached at %s: no longer waiting for %s",
                        attached.name,
                        mc.address,
                        waiting.config.address,
                    )
                    self.forget_pending(waiting.name)
            hooks = [h for h in HOOKS if remote.implements(h)]
            log.info(
                "attached middleware %s at %s (key %s; hooks: %s; tools: %s)",
                remote.name,
                mc.address,
                remote.key,
                ", ".join(hooks) or "none",
                ", ".join(tools) or "none",
            )
            return attached

    def _access(self, mc: MiddlewareConfig) -> Access:
        sec = self.config.security
        return Access(tls=sec.middleware_tls, token=sec.middleware_token, key=mc.key, permissions=mc.permissions)

    def attach_when_it_answers(self, mc: MiddlewareConfig, why: MiddlewareFailure) -> None:
        """A middleware the host could not reach at start: the host starts without it and attaches
        it in its configured place once it answers (about a second after its server accepts
        connections: _attach_later). Meanwhile replies go on without a fail_open one (as when it
        fails) and are refused while a required (fail_closed) one is missing: UNAVAILABLE, and the
        health check says NOT_SERVING. A cluster restarted in any order comes up with no crash loop."""
        pending = Pending(mc, _not_attached(why))
        if mc.fail_open:
            level, meanwhile = logging.WARNING, "is fail_open and cannot be attached yet (%s): starting without it"
        else:
            level, meanwhile = (
                logging.ERROR,
                "is required (fail_closed) and cannot be attached yet (%s): replies are refused",
            )
        log.log(level, f"middleware %s at %s {meanwhile} until it answers", pending.name, mc.address, pending.why)
        self.pending[pending.name] = pending
        pending.task = asyncio.get_running_loop().create_task(self._attach_later(pending))

    def required_unavailable(self) -> str | None:
        """Why no reply can run now, if a required (fail_closed) middleware is missing: not attached
        yet, or it hung and has not answered since (RemoteMiddleware.stopped_answering). Replies
        are refused then, before anything is stored, instead of each failing in that middleware."""
        for p in self.pending.values():
            if not p.config.fail_open:
                return f"required middleware {p.name} (fail_closed) is not attached yet: {p.why}"
        for a in self._setup.middleware:
            if a.remote.unresponsive:  # set for fail_closed middleware only
                return (
                    f"required middleware {a.name} (fail_closed) does not answer "
                    f"({a.remote.unresponsive}); replies are refused until it answers again"
                )
        return None

    def forget_pending(self, name: str) -> Pending | None:
        """Stop waiting to attach the pending middleware ``name`` (None: there is none)."""
        pending = self.pending.pop(name, None)
        if pending is not None and pending.task is not None:
            pending.task.cancel()
        return pending

    async def _attach_later(self, pending: Pending) -> None:
        """Attach it as soon as its server accepts a connection: a channel of its own waits for
        that (reconnecting within a second, as the middleware's channels do), so a server that comes
        up is attached about a second later, with no polling of Describe meanwhile."""
        mc = pending.config
        probe = channel(mc.address, self._access(mc).tls, options=CHANNEL_OPTIONS)
        try:
            while True:
                with contextlib.suppress(TimeoutError):  # connected, or time to try anyway
                    async with asyncio.timeout(MAX_ATTACH_PAUSE):
                        await probe.channel_ready()
                before = self.config.middleware[: self.config.middleware.index(mc)]  # mc is one of them
                position = sum(1 for a in self.middleware if any(a.config is m for m in before))
                try:
                    await self.attach(mc, position)
                    return
                except WAIT_FOR as exc:  # still not answering
                    pending.why = _not_attached(exc)
                    await asyncio.sleep(1.0)  # connected and silent: no busy loop
                except (MiddlewareFailure, ValueError) as exc:  # it answered, and cannot be attached as configured
                    log.error("middleware %s at %s cannot be attached: %s", pending.name, mc.address, exc)
                    if mc.fail_open:  # the host goes on without it
                        return
                    # Required: replies stay refused, and it is tried again (its server may be fixed).
                    pending.why = f"cannot be attached: {exc}"
                    await asyncio.sleep(MAX_ATTACH_PAUSE)
        finally:
            await probe.close()
            if self.pending.get(pending.name) is pending:
                del self.pending[pending.name]

    async def detach(self, name: str) -> Attached:
        """Remove it for the next replies; replies using it now finish with it (then it is closed)."""
        async with self._setup_lock:
            found = next((a for a in self.middleware if a.name == name), None)
            if found is None:
                raise KeyError(name)
            self._set_middleware([a for a in self.middleware if a is not found])
            found.detached = True
            if found.users == 0:
                await found.remote.close()
            log.info("detached middleware %s", name)
            self._offer_refused_tools()  # what clashed with its tools may fit now
            return found

    def _tools_changed(self, remote: RemoteMiddleware) -> None:
        """A Describe after attach (a restarted or upgraded server) found another tool list: the
        next replies are offered it, checked as at attach. Refused (a name clash, too many tools
        together): the middleware contributes no tools until it lists acceptable ones; its old ones
        are not kept (its server may no longer serve them), and its last error says why."""
        found = next((a for a in self.middleware if a.remote is remote), None)
        if found is None:  # detached meanwhile
            return
        before, found.tools = found.tools, registered_tools(remote.tools, remote.name)
        try:
            self._set_middleware(list(self.middleware))
        except ValueError as exc:  # a clash with another's tools (or the host's), or TooManyTools
            found.tools = {}
            found.tools_refused = True
            self._set_middleware(list(self.middleware))  # fewer tools than before: cannot fail
            why = f"its tools as listed again are refused ({exc}); it contributes no tools until they fit"
            metrics.middleware_error(remote, "ListTools", why)
            log.error("middleware %s: %s", remote.name, why)
            return
        found.tools_refused = False
        log.info(
            "middleware %s lists other tools now: %s (before: %s)",
            remote.name,
            ", ".join(found.tools) or "none",
            ", ".join(before) or "none",
        )
        if found.tools.keys() != before.keys():
            self._offer_refused_tools()  # it gave up names (or room) another's refused tools need

    def _offer_refused_tools(self) -> None:
        """Offer again the tools refused from a middleware (a clash, too many together) once the
        middleware they clashed with left or gave them up; each as at attach, all or none."""
        for a in self.middleware:
            if not a.tools_refused:
                continue
            a.tools = registered_tools(a.remote.tools, a.remote.name)
            try:
                self._set_middleware(list(self.middleware))
            except ValueError:
                a.tools = {}  # still refused: its last error says why
                continue
            a.tools_refused = False
            log.info("middleware %s: its tools are offered now: %s", a.name, ", ".join(a.tools) or "none")

    def _set_middleware(self, middleware: list[Attached]) -> None:
        toolkit = Toolkit(self.tools)
        for a in middleware:
            for name, t in a.tools.items():
                toolkit.register(t, name)  # a clash raises before anything changes
        if len(toolkit.tools) > MAX_MODEL_TOOLS:  # each within its limit, too many together
            counts = ", ".join(f"{a.name}: {len(a.tools)}" for a in middleware if a.tools)
            raise TooManyTools(
                f"the model would be offered {len(toolkit.tools)} tools (the host's own: {len(self.tools)}; "
                f"{counts}), and a model request takes at most {MAX_MODEL_TOOLS}"
            )
        self._setup = _Setup(tuple(middleware), toolkit)

    # -- lifecycle ---------------------------------------------------------------------------------

    async def drain(self, grace: float) -> None:
        """Refuse new replies (UNAVAILABLE) and give the replies in flight ``grace`` seconds to end."""
        self.draining = True
        tasks = [r.task for r in self._runs if r.task is not None]
        log.info("draining: %d replies in flight, %.3gs to finish", len(tasks), grace)
        if tasks:
            await asyncio.wait(tasks, timeout=grace)

    async def close(self, timeout: float = 10.0) -> None:
        """Interrupt the replies in flight (their clients still get the INTERRUPTED end), wait for them
        to end and be saved, then let go (of the store, and of its leases)."""
        for name in list(self.pending):
            self.forget_pending(name)
        tasks = [r.task for r in self._runs if r.task is not None]
        for run in self._runs:
            if run.agent is not None:  # not the user's doing: its results say the host stopped
                run.agent.host_stopping = True
            run.interrupt()
        if tasks:
            _done, pending = await asyncio.wait(tasks, timeout=timeout)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=2.0)
        for a in self.middleware:
            await a.remote.close()
        await self.models.aclose()  # the model clients' connection pools (else "Unclosed client session")
        await self.store.aclose()


def _not_attached(exc: MiddlewareFailure) -> str:
    """Why a middleware is not attached yet: what failed, naming the call after Describe that did
    (a Describe's failure says what it is: cannot connect to ..., no answer within ...)."""
    return exc.what if exc.hook == "Describe" else f"{exc.hook}: {exc.what}"


def _valid_session_id(sid: str) -> bool:
    """What a session may be called (it is stored, logged and listed): no id else names one, so a
    Get/Delete/Interrupt of another answers as for a missing session."""
    return len(sid) <= MAX_SESSION_ID and sid.isprintable()


def _is_retry(state: AgentState, inputs: Any) -> bool:
    """``inputs`` is a user message the session took before (same id). The latest one, whose reply
    was interrupted (its host stopped, its client cancelled or went away): the retry continues it.
    Any other end, or an earlier message (answered before the latest was sent), is final: refused.
    The latest reply's message is known by the id the client gave (ReplyContext.input_ids), also
    when an on_reply middleware passed it on as a new message or compression dropped it since."""
    if not isinstance(inputs, Msg):
        return False
    # (The last user message's id for a session stored before input_ids were kept.)
    latest = state.reply_context.input_ids or [m.id for m in state.context if m.role == Role.USER][-1:]
    tail = state.context[-1] if state.context else None
    if (
        inputs.id in latest
        and tail is not None
        and (tail.role == Role.USER or tail.finished_reason == ReplyFinishedReason.INTERRUPTED)
    ):  # unanswered: its reply stored nothing after the message before it was interrupted, or was cut short
        return True
    index = next((i for i, m in enumerate(state.context) if m.role == Role.USER and m.id == inputs.id), None)
    if index is None and inputs.id not in state.dropped_user_ids and inputs.id not in latest:
        return False
    answer = None if index is None else next((m for m in state.context[index + 1 :] if m.role == Role.ASSISTANT), None)
    where = f"message {inputs.id} in session {state.session_id!r}"
    # (The latest message's reply, cut short and then continued by a retry, is answered.)
    if answer is not None and answer.finished_reason == ReplyFinishedReason.INTERRUPTED and inputs.id not in latest:
        why = f"{where} was interrupted, and other messages followed it: only the latest can be retried"
    else:
        why = f"{where} was already answered" + (": see GetSession" if index is not None else "")
    raise ReplyRejected(grpc.StatusCode.ALREADY_EXISTS, why)


def check_structured_schema(inputs: Any, schema: dict[str, Any] | None) -> None:
    """Refuse (INVALID_ARGUMENT) a structured-output schema sent with a resumption event (a resumed
    reply keeps the schema it started with), or one that is not a JSON schema of type object."""
    if schema is None:
        return
    if not isinstance(inputs, Msg):
        raise ReplyRejected(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"structured_schema goes only with a new message, not with a {type(inputs).__name__} "
            "(a resumed reply keeps the schema it started with)",
        )
    try:
        schema_validator(schema)  # as a tool's: its $refs resolve within it, or it is refused here
    except ValueError as exc:
        raise ReplyRejected(grpc.StatusCode.INVALID_ARGUMENT, f"structured_schema: {exc}") from None
    if schema.get("type") != "object":
        raise ReplyRejected(
            grpc.StatusCode.INVALID_ARGUMENT,
            f'structured_schema must be of "type": "object" (the structured output is an object), '
            f"got {schema.get('type')!r}",
        )


def _finite(value: Any) -> Any:
    """``value`` with its non-finite floats as proto3's JSON mapping writes them."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


__all__ = ["Attached", "Host", "ReplyRejected", "ReplyRun", "check_structured_schema"]
