"""HookCall: the host's side of one hook invocation over a stream (spec: hooks.proto).

The same class serves all seven hooks. ``items()`` is the onion face of STREAM hooks,
``stream()`` of on_model_call, ``value()`` of CALL and TRANSFORM hooks; all drive ``_run``.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf import struct_pb2

from agentmw.chain import close, prepend
from agentmw.codec import CodecError, codec, json_to_value, value_to_json
from agentmw.data import ChatResponse, PermissionDecision, new_id, now
from agentmw.errors import clipped
from agentmw.hooks import HookSpec, Kind
from agentmw.subscriptions import Mode, SubscriptionTable
from agentmw.v1 import hooks_pb2
from agentmw.wire import (
    DEFAULT_CREDITS,
    EMITTABLE,
    decode_error_attributes,
    decode_kwargs,
    decode_result,
    encode_error,
    encode_kwargs,
    encode_result,
    model_override,
    tool_item_problem,
)

from .. import metrics, tracing
from ..reply_grammar import OpenedBlocks
from .detached import Watch
from .errors import (
    KeptGoing,
    MiddlewareFailure,
    NoAnswer,
    OutputLimitExceeded,
    ProtocolError,
    StreamBroken,
    Suspended,
    broken_stream,
    remote_error,
)

if TYPE_CHECKING:
    from .client import RemoteMiddleware

log = logging.getLogger("agentmw.remote")

MISSING_ID = "MiddlewareMessage.invocation is missing (echo the begin's invocation id)"
NOTHING = object()  # _apply: the action emitted nothing
# The changes that add to what the session stores: together, one call's stay within max_item_bytes,
# so that no call of a middleware grows a session past what a client reads in one message.
_STORED_OPS = frozenset(("append_message", "append_blocks", "append_blocks_to_tail", "set_slot", "set_summary"))
# What a kwarg's override permission guards (client.OVERRIDE_PERMISSION): an override that keeps it
# needs none. The same model with its parameters edited (as the ``parameters`` kwarg may), the same
# tool with the same input (the call's state or timestamps edited).
_GUARDED: dict[str, Callable[[Any], Any]] = {
    "current_model": lambda model: model_override(model).id,
    "tool_call": lambda call: (call.name, call.input),
}
# Seconds a middleware may go on sending items after its reply was interrupted (its end has to flow
# out through it) before the reply goes on without it: well within the host's INTERRUPT_GRACE.
STOP_AFTER_INTERRUPT = 2.0
# Messages in a row, within one wait, that answer nothing (_moved_nothing) before the wait is taken
# for a flood: a sound middleware sends a few (a credit grant crossing an item, state changes while
# its code awaits something else); a flood of them cost the host most of a core until the timeout.
MAX_IDLE_MESSAGES = 1000
# Messages kept to send again if a reused stream turns out broken before any answer (_start_over),
# and the statuses that say the stream went with its connection: it ended (OK, before a finish) or
# broke; not an answer of a live server (RESOURCE_EXHAUSTED, UNIMPLEMENTED, UNAUTHENTICATED, ...).
MAX_RESENT = 64
_GONE = frozenset(
    (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED)
)


class _Unconverted(Exception):
    """Carries out of HookCall's generators what a generator frame turns into a RuntimeError (PEP
    479): a StopAsyncIteration (or StopIteration) the middleware, or the inner pipeline, raised in a
    coroutine hook. value() and stream() raise it as it came, so the layer around gets it as it
    would from an in-process layer (whose coroutine passes it on) and can catch it by class."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(error)
        self.error = error


class HookCall:
    # An invocation's state, each field's start value given here: an invocation sets only what it
    # uses (one assignment each in __init__ was a measurable part of every hook call's cost).
    table: SubscriptionTable | None = None
    call: Any = None
    inner: AsyncGenerator[Any, None] | None = None  # the open inner pipeline, as items
    inner_done: bool = False
    inner_result: Any = None  # a CALL hook's inner value; on_model_call's inner ChatResponse, if one was returned
    inner_exc: BaseException | None = None
    pending: Any = None  # the intercepted item the middleware holds now (until emitted)
    seq: int = 0  # items delivered (intercepted and observed) in this invocation
    held_seq: int = 0  # the intercepted item the host waits on the middleware's answer for
    generation: int = 0  # which inner pipeline (call_next count)
    credits: int = 0
    result: Any = None
    handed_stream: bool = False  # stream() returned a stream to the caller (not a ChatResponse)
    sent_fingerprint: tuple[int, int, str] | None = None
    sent_slot: Any = None  # the slot as last sent (in-process layers may edit it in place)
    applied: int = 0  # this invocation's middleware messages read (HookContext.applied)
    clean: bool = False  # the invocation ended with finish / fail on a sound stream
    held_begin: hooks_pb2.HostMessage | None = None  # an eager value hook's begin, sent with its outcome
    in_hand: Any = None  # an observed item taken from the inner pipeline, not yet forwarded
    deferred: hooks_pb2.MiddlewareMessage | None = None  # a command read while items flowed
    loop: asyncio.AbstractEventLoop  # set by _watch, before the first wait
    watchdog: asyncio.TimerHandle | None = None
    waiting_since: float | None = None  # time.monotonic() since when the host waits on the stream
    read_since: float = 0.0  # when the wait of the last read began
    stalled_since: float | None = None  # set by _moved_nothing: the next read continues that wait
    moved_nothing: int = 0  # messages of the current wait that answered nothing (named at a timeout)
    waiter: asyncio.Task[Any] | None = None  # the task waiting on the stream now
    timed_out: bool = False
    span: Any = None  # this invocation's span, when the host traces
    invocation: int = 0  # this invocation's id on the wire (hooks.proto, INVOCATION IDS)
    reused: bool = False  # the stream carried earlier invocations (their late messages may follow)
    resend: list[hooks_pb2.HostMessage] | None = None  # sent on a reused stream, none answered yet
    unlabelled: int = 0  # messages without an invocation id dropped on a reused stream
    emitted: int = 0  # new items the middleware emitted, against policy.max_items
    opened: OpenedBlocks | None = None  # fail_open: blocks its emits started and did not end (closed on bypass)
    stored_bytes: int = 0  # what its changes of this call add to the session (_STORED_OPS)
    received_bytes: int = 0  # bytes of its messages, against policy.max_bytes
    read_bytes: int = sys.maxsize  # bytes of the last message read (no part of it is larger)
    flusher: asyncio.Task[None] | None = None  # the task writing the observed copies queued (copies)
    sending: bool = False  # a write of this invocation is in flight (_send): another must wait for it
    copy_error: Exception | None = None  # how that task failed (raised at the next write or read)

    def __init__(self, mw: RemoteMiddleware, spec: HookSpec, agent: Any, input_kwargs: dict, next_handler: Any) -> None:
        self.mw, self.spec, self.agent = mw, spec, agent
        self.input_kwargs = input_kwargs
        self.next_handler = next_handler
        self.copies: list[hooks_pb2.HostMessage] = []  # observed copies not written yet (_queue_copy)

    # -- faces ------------------------------------------------------------------------------------

    # Each face reads the hook's description as last received once: a hook idle by its only_when
    # flag is not called; a detached one takes the flat path (detached.py); the rest, the protocol.

    def items(self) -> AsyncIterator[Any]:
        table = self.mw.tables.get(self.spec.name)
        if self._skipped(table):
            return self.next_handler()
        if table is not None and table.detached:
            return Watch(self).items()
        return self._guarded()

    async def stream(self) -> AsyncIterator[Any] | ChatResponse:
        """on_model_call: run until the first chunk (so call-time errors raise here), then stream;
        or, when the hook (or, finishing with none, its inner pipeline) returned one ChatResponse
        before any chunk went out, that response."""
        table = self.mw.tables.get(self.spec.name)
        if self._skipped(table):
            return await self.next_handler()
        if table is not None and table.detached:
            return await Watch(self).stream()
        gen = self._guarded()
        try:
            first = await anext(gen)
        except _Unconverted as exc:
            raise exc.error from None
        except StopAsyncIteration:
            # It returned one response (its finish's result); or it finished with none over an inner
            # pipeline that returned one: that one passes through, as finish{} after forwarding items
            # means "the inner pipeline's output" (a pass-through written before chat_response).
            returned = self.result if isinstance(self.result, ChatResponse) else self.inner_result
            if isinstance(returned, ChatResponse):
                return returned
            first = None
        except BaseException:
            await gen.aclose()
            raise
        self.handed_stream = True
        return prepend(first, gen)

    async def value(self) -> Any:
        table = self.mw.tables.get(self.spec.name)
        if self._skipped(table):
            return self.input_kwargs["prompt"] if self.spec.kind is Kind.TRANSFORM else await self.next_handler()
        try:
            async for _ in self._guarded():  # hooks without items cannot emit (_emitted rejects it)
                pass
        except _Unconverted as exc:
            raise exc.error from None
        return self.result

    def _raised(self, exc: BaseException) -> BaseException:
        """``exc`` as this invocation's generators raise it: carried (_Unconverted) where the hook is
        a coroutine whose caller would get it as it is (not a stream hook, nor a stream handed out)."""
        if isinstance(exc, StopIteration | StopAsyncIteration) and not (
            self.spec.kind is Kind.STREAM or self.handed_stream
        ):
            return _Unconverted(exc)
        return exc

    def _skipped(self, table: SubscriptionTable | None) -> bool:
        """The inner pipeline runs without the middleware, no begin and no round trip: the hook
        declared ``only_when`` and that flag of its slot is off (and the description is current):
        it would only pass through (hooks.proto, HookDescription.only_when); or it is fail_open
        and failed earlier in this reply (README: the host goes on without it from that point)."""
        mw = self.mw
        if mw.policy.fail_open and mw.bypassing and mw.bypassed_in_reply(self.agent):
            metrics.count_bypass(mw, self.spec.name)
            return True
        if table is None or not table.only_when:  # the usual case: no slot lookup
            return False
        return table.skips(self.agent.state.middle_context.get(mw.key)) and not mw.needs_describe()

    # -- failure policy ------------------------------------------------------------------------

    async def _guarded(self) -> AsyncGenerator[Any, None]:
        started = metrics.hook_started()
        try:
            try:
                async with aclosing(self._run()) as run:
                    async for item in run:
                        yield item
                self.mw.answered()
            except MiddlewareFailure as exc:
                if exc.middleware != self.mw.name:  # an inner middleware's, raised through this one (from_inner)
                    raise
                if isinstance(exc, NoAnswer):  # this call's alone, unless the middleware hangs as a whole
                    self.mw.no_answer(exc.hook, self.agent.state.session_id)
                if not isinstance(exc, KeptGoing):  # (that one is sound, only slow to stop)
                    self.mw.failed()
                # As the call began (a new description meanwhile, of a new version rolled out,
                # does not make a call that intercepted a watcher); else as last described.
                table = self.table if self.table is not None else self.mw.tables.get(self.spec.name)
                watcher = table is not None and table.detached
                metrics.hook_failed(self.mw, self.spec.name, exc, bypassed=self.mw.policy.fail_open or watcher)
                if not (self.mw.policy.fail_open or watcher):
                    raise
                if not watcher:
                    self.mw.bypass_rest_of_reply(self.agent)
                tracing.hook_bypassed(self.span, exc)
                async for item in self._bypass(exc, record=not watcher):
                    yield item
            if self.handed_stream and isinstance(self.result, ChatResponse):
                yield self.result  # returned after chunks went out: the caller reads a stream (hooks.proto, finish)
        finally:
            raised = sys.exc_info()[1]
            if isinstance(raised, _Unconverted):
                raised = raised.error
            tracing.end_hook_span(self.span, raised)
            # Served by the middleware: not by a watcher, whose copies are still to be delivered.
            served = self.table is not None and not self.table.detached
            metrics.hook_ended(self.mw, self.spec.name, started, raised, served=served)
            await self._close()

    async def _bypass(self, exc: MiddlewareFailure, *, record: bool = True) -> AsyncIterator[Any]:
        """fail_open (and any detached hook): go on as if the middleware were not there
        (transparent until it changed items). ``record``: say so in the reply's events."""
        log.debug("bypassing %s", exc)  # metrics.hook_failed counted it, and warns once per outage
        # Every hook records through the agent, which places the event in the reply's stream as the
        # client gets it (Agent.reply_stream): a hook without events (on_acting, on_system_prompt,
        # ...) has nowhere to put it, and an on_reply one may fail before the reply's start or
        # after its final Msg.
        record_bypass = getattr(self.agent, "record_bypass", None)  # an agent of the host's (Agent)
        if record and record_bypass is not None:
            record_bypass(self.mw.name, self.spec.name, str(exc))
        async for item in self._without_middleware():
            yield item

    async def _without_middleware(self) -> AsyncIterator[Any]:
        """The rest of the hook as if the middleware were not there: whatever the host already
        took from the inner pipeline, then the inner pipeline itself (started if it was not)."""
        if self.spec.kind is Kind.TRANSFORM:
            self.result = self.input_kwargs["prompt"]
            return
        if self.opened is not None:  # blocks it started and never ended (a TTS audio block cut off)
            for end in self.opened.closing_events():
                yield end
        for held in (self.in_hand, self.pending):  # nothing the host took from the inner pipeline is lost
            if held is not None:
                yield held
        self.in_hand = self.pending = None
        if self.inner is None and not self.inner_done:
            self.inner = self._inner_items({})
        if self.inner is not None:
            async for item in self.inner:
                yield item
        if self.inner_exc is not None:  # the inner pipeline had failed: that error stands
            raise self._raised(self.inner_exc)
        self.result = self.inner_result

    async def _write_copies(self) -> None:
        await self._settle_copies()
        if self.copies:
            await self._send(self._with_pending())

    async def _close(self) -> None:
        open_calls = getattr(self.agent, "open_calls", None)
        if open_calls is not None:
            open_calls.discard(self)
        flusher, self.flusher = self.flusher, None
        try:
            if flusher is not None and self.clean:
                # An interrupt's notice went out while the finish came in: the stream is reusable
                # once it is written (the watchdog bounds the write). Its failure is in copy_error.
                await flusher
            elif flusher is not None:  # the invocation ended half-way: its copies are moot
                flusher.cancel()
        finally:
            if flusher is not None and not (flusher.done() and not flusher.cancelled() and self.copy_error is None):
                self.clean = False
            if self.watchdog is not None:
                self.watchdog.cancel()
            if self.call is not None:
                call, self.call = self.call, None
                if self.clean:  # ended with finish / fail: the stream can carry the next invocation
                    self.mw.release_stream(self.spec.name, call)
                else:
                    call.cancel()
            if self.inner is not None:
                inner, self.inner = self.inner, None
                await close(inner)

    # -- the protocol -----------------------------------------------------------------------------

    async def _run(self) -> AsyncGenerator[Any, None]:
        """One invocation: the begin, then until finish or fail: while the middleware has granted
        credits, run the inner pipeline to its next intercepted item (``advance``); read the
        middleware's next message, apply its actions in order, obey its command."""
        mw, spec = self.mw, self.spec
        skipped = mw.skipped()  # it hung lately (RemoteMiddleware.no_answer)
        if skipped:
            raise Suspended(mw.name, spec.name, skipped)
        await mw.ensure_described()
        self.table = mw.tables.get(spec.name)
        if self.table is None:  # the server no longer implements this hook (it was restarted)
            async for item in self._without_middleware():
                yield item
            return
        begin = self._begin()
        if mw.policy.fail_open:  # only then does the reply go on without it, ending what it opened
            self.opened = OpenedBlocks()
        if self.table.detached:  # described as detached only now (else the faces take detached.Watch)
            async for item in Watch(self).flow(begin, self._inner_items({}), own=False):
                yield item
            self.result = self.inner_result
            return
        self.call, self.reused = self.mw.take_stream(self.spec.name)
        if self.reused:
            self.resend = []  # until the middleware answers: see _start_over
        self._watch()
        open_calls = getattr(self.agent, "open_calls", None)  # an Agent of the host's (interrupt() tells them)
        if open_calls is not None:
            open_calls.add(self)
        table = self.table
        advance = 0  # credits granted: run the inner pipeline to its next intercepted item first
        if table.eager_next:  # the middleware calls next first thing: do not wait for it
            if self.spec.kind is Kind.CALL:
                # A value hook's inner pipeline is short: send begin together with its outcome
                # (one Batch, one message fewer); see _write.
                self.held_begin = begin
            else:
                await self._write(begin)
            await self._start_inner(hooks_pb2.CallNext())
            advance = DEFAULT_CREDITS
        else:
            await self._write(begin)
        while True:
            if advance:
                # Run the inner pipeline to its next intercepted item (or its end), forwarding the
                # rest. Inline, not a generator per call_next / pull: this is the per-item path.
                self.credits += advance
                advance = 0
                self.pending = None
                inner = self.inner
                assert inner is not None
                while True:
                    try:
                        item = await anext(inner)
                    except StopAsyncIteration:
                        self.inner, self.inner_done = None, True
                        await self._write(self._done_message())
                        break
                    except Exception as exc:  # the inner pipeline raised: the middleware decides
                        error = exc.error if isinstance(exc, _Unconverted) else exc
                        self.inner, self.inner_done, self.inner_exc = None, True, error
                        await self._write(self._error_message(error))
                        break
                    mode = table.mode_of(item)
                    if mode is Mode.BYPASS:
                        yield item
                        continue
                    if mode is Mode.OBSERVE:
                        self.in_hand = item  # taken from the inner pipeline, not yet forwarded
                        if self.credits <= 0:
                            async for emitted in self._await_credits():
                                yield emitted
                        self.in_hand = None
                        if self.deferred is not None:  # a command came first: the loop below takes it
                            yield item  # observed items are the host's to forward
                            break
                        self.credits -= 1
                        self.seq += 1
                        self._queue_copy(self._item_message(item, observed=True))
                        yield item
                        continue
                    self.seq += 1
                    self.pending, self.held_seq = item, self.seq
                    if self.opened is not None:  # a block it starts is the inner pipeline's, not the middleware's
                        self.opened.handed(item)
                    self.credits = 0
                    await self._write(self._item_message(item, observed=False))
                    break
            if self.inner_done and self._done_with_inner():  # no finish to wait for (hooks.proto)
                return
            deferred, self.deferred = self.deferred, None  # a command _await_credits read and judged
            msg = deferred or await self._read()
            # Whether it emitted: an item is an answer in itself (the client sees it), where state
            # changes alone are not.
            emitted = False
            for action in msg.actions:  # inline, not a generator per message (the per-item path)
                item = self._apply(action)
                if item is not NOTHING:
                    emitted = True
                    yield item
            command = msg.WhichOneof("command")
            if command == "call_next":
                if spec.kind is Kind.TRANSFORM:
                    raise self._violation("call_next in on_system_prompt (a transformer has no inner pipeline)")
                await self._start_inner(msg.call_next)
                advance = max(msg.call_next.credits, 1)
            elif command == "pull":
                pull = msg.pull
                if self.inner is None and not self.inner_done:
                    raise self._violation("pull before call_next")
                if self.inner is None:
                    pass  # a credit refill that crossed inner_done: harmless, and no answer
                elif self.held_seq and pull.HasField("answers_seq") and pull.answers_seq != self.held_seq:
                    self.credits += max(pull.credits, 1)  # a credit grant, not the answer to the held item
                else:
                    self.held_seq = 0
                    advance = max(pull.credits, 1)
            elif command == "suspend":
                if not spec.has_items:
                    raise self._violation(f"suspend in {spec.name}, which has no items")
                resume = hooks_pb2.HostMessage(invocation=self.invocation)
                resume.resume.SetInParent()
                self._context(resume.resume.context)
                await self._write(resume)
            elif command == "finish":
                self.result = self._finish(msg.finish)
                self.clean = True
                return
            elif command == "fail":
                self.clean = True
                fail = msg.fail
                if fail.traceback:
                    log.error("middleware %r raised in %s:\n%s", mw.name, spec.name, clipped(fail.traceback, tail=True))
                if fail.from_inner and self.inner_exc is not None:
                    raise self._raised(self.inner_exc)
                if fail.type == "CancelledError":
                    # As an in-process layer's CancelledError propagates (the agent takes it as an
                    # interruption; out of on_reply it fails the reply): raised, not delivered by
                    # Task.cancel(), so no task of the host is cancelled and no cancel count moves.
                    raise asyncio.CancelledError(
                        f"middleware {mw.name!r} raised CancelledError in {spec.name}: {clipped(fail.message)}"
                    )
                raise self._raised(
                    remote_error(
                        mw.name, spec.name, fail.type or "Exception", fail.message, **decode_error_attributes(fail)
                    )
                )
            if not (emitted or advance) and deferred is None:  # it moved nothing on: the wait goes on
                self._moved_nothing()

    def _begin(self) -> hooks_pb2.HostMessage:
        """A new invocation's Begin (and its span, when the host traces); ``self.table`` is set."""
        mw, spec = self.mw, self.spec
        assert self.table is not None
        self.invocation = mw.new_invocation()
        begin = hooks_pb2.HostMessage(invocation=self.invocation)
        self._context(begin.begin.context, force=True)
        self.span = tracing.hook_span(mw.name, spec.name, self.table.detached, begin.begin.context.trace_context)
        try:
            encode_kwargs(spec, self.input_kwargs, begin.begin.input_kwargs)
        except CodecError as exc:  # our own kwargs do not fit the contract: a host bug, not the middleware's
            raise RuntimeError(f"{spec.name}: cannot send kwargs to {mw.name}: {exc}") from exc
        return begin

    def _apply(self, action: hooks_pb2.Action) -> Any:
        """Apply one action of a message (in order): an emitted item is returned, to go outward
        before the next action is applied; a mutation goes into state (NOTHING is returned)."""
        which = action.WhichOneof("action")
        if which == "emit":
            return self._emitted(action.emit)
        if which == "mutate":
            self._mutate(action.mutate)
            return NOTHING
        raise self._violation("an empty action")

    def _done_with_inner(self) -> bool:
        """The inner pipeline ended normally and the hook is declared done_with_inner (hooks.proto):
        the invocation ends here with the inner result; its finish is dropped later, by whichever
        invocation takes the stream next."""
        if self.inner_exc is None and self.table is not None and self.table.done_with_inner:
            self.result, self.clean = self.inner_result, True
            return True
        return False

    def _finish(self, finish: hooks_pb2.Finish) -> Any:
        spec = self.spec
        self._within_item_limit(finish.result, "finished with a result")
        try:
            value = decode_result(finish.result)
        except CodecError as exc:
            raise self._violation(f"malformed result: {exc}") from None
        if spec.kind is Kind.TRANSFORM:
            if not isinstance(value, str):
                raise self._violation("on_system_prompt must finish with a prompt")
        elif spec.name == "on_check_permission":
            if not isinstance(value, PermissionDecision):
                raise self._violation("on_check_permission must finish with a permission_decision")
        elif value is not None and not (spec.kind is Kind.MODEL and isinstance(value, ChatResponse)):
            raise self._violation(f"{spec.name} must finish without a result (it sent {type(value).__name__})")
        return value

    async def _start_inner(self, call_next: hooks_pb2.CallNext) -> None:
        if self.inner is not None:  # a second call_next closes the first inner pipeline
            inner, self.inner = self.inner, None
            await close(inner)
        if self.spec.kind is not Kind.MODEL:  # a model call's input is only sent on; other kwargs may be stored
            self._within_item_limit(call_next.overrides, "sent call_next overrides")
        try:
            overrides = decode_kwargs(self.spec, call_next.overrides, complete=False)
        except CodecError as exc:
            raise self._violation(f"malformed call_next overrides: {exc}") from None
        for name in call_next.cleared:
            if name not in self.spec.params:
                raise self._violation(f"call_next clears unknown kwarg {name!r}")
            overrides[name] = None
        if overrides.get("current_model") is not None:
            overrides["current_model"] = model_override(overrides["current_model"])
        checked = [name for name, value in overrides.items() if self._changes_guarded(name, value)]
        self.mw.check_overrides(checked, self.spec.name)  # its permissions (security: client.py)
        self.pending = None
        self.held_seq = 0
        self.inner_done = False
        self.inner_result = self.inner_exc = None
        self.generation += 1
        self.inner = self._inner_items(overrides)

    def _changes_guarded(self, name: str, value: Any) -> bool:
        """Overriding kwarg ``name`` with ``value`` changes what its permission guards (_GUARDED)."""
        guarded, given = _GUARDED.get(name), self.input_kwargs.get(name)
        return guarded is None or value is None or given is None or guarded(value) != guarded(given)

    def _inner_items(self, overrides: dict[str, Any]) -> AsyncGenerator[Any, None]:
        """The inner pipeline as items, whatever the hook's shape; a CALL hook's value is kept. A
        stream hook's is its own generator, with no layer around it: this is the per-item path."""
        if self.spec.kind is Kind.STREAM:
            return self.next_handler(**overrides)
        return self._value_items(overrides)

    async def _value_items(self, overrides: dict[str, Any]) -> AsyncGenerator[Any, None]:
        try:
            value = await self.next_handler(**overrides)
        except (StopIteration, StopAsyncIteration) as exc:  # as the inner layer raised it (_Unconverted)
            raise _Unconverted(exc) from None
        if self.spec.kind is Kind.CALL or isinstance(value, ChatResponse):  # a value, sent in InnerDone
            self.inner_result = value
        else:
            async for item in value:
                yield item

    async def _await_credits(self) -> AsyncIterator[Any]:
        """Out of credits with an observed item in hand: read until the middleware grants more,
        yielding what its actions emit meanwhile. A command other than pull (finish, fail,
        call_next) is left in ``self.deferred`` for the main loop."""
        while self.credits <= 0:
            msg = await self._read()
            emitted = False
            for action in msg.actions:
                item = self._apply(action)
                if item is not NOTHING:
                    emitted = True
                    yield item
            command = msg.WhichOneof("command")
            if command == "pull":
                self.credits += max(msg.pull.credits, 1)
            elif command is None:
                if not emitted:
                    self._moved_nothing()
            else:
                self.deferred = hooks_pb2.MiddlewareMessage()
                self.deferred.CopyFrom(msg)
                del self.deferred.actions[:]
                return

    # -- host messages (the same for interactive and detached hooks) ------------------------------

    def _item_message(self, item: Any, *, observed: bool) -> hooks_pb2.HostMessage:
        msg = hooks_pb2.HostMessage(invocation=self.invocation)
        delivery = msg.item
        delivery.seq, delivery.observed, delivery.inner = self.seq, observed, self.generation
        codec.encode_item(item, delivery.item)
        self._context(delivery.context)
        return msg

    def _done_message(self) -> hooks_pb2.HostMessage:
        msg = hooks_pb2.HostMessage(invocation=self.invocation)
        done = msg.inner_done
        done.inner = self.generation
        if self.inner_result is not None:
            encode_result(self.inner_result, done.result)
        self._context(done.context)
        return msg

    def _error_message(self, exc: BaseException) -> hooks_pb2.HostMessage:
        msg = hooks_pb2.HostMessage(invocation=self.invocation)
        err = encode_error(exc, msg.inner_error)  # an inner middleware's own exception, as it raised it
        err.inner = self.generation
        # A detached watcher gets this late: it times (and reports) the failure by these.
        err.created_at = now()
        partial = getattr(exc, "partial", None)  # a failed model call's response so far
        if isinstance(partial, ChatResponse):
            codec.encode(partial, err.partial)
        self._context(err.context)
        return msg

    def _emitted(self, emit: hooks_pb2.Emit) -> Any:
        if not self.spec.has_items:
            raise self._violation(f"emit in {self.spec.name}, which has no items")
        which = emit.WhichOneof("what")
        if which == "forward_seq":
            if self.pending is None:
                held = f"seq {self.held_seq} was emitted already" if self.held_seq else "none is held"
                raise self._violation(f"forward_seq {emit.forward_seq} names no held intercepted item ({held})")
            if emit.forward_seq != self.held_seq:
                raise self._violation(f"forward_seq {emit.forward_seq} is not the held item's seq ({self.held_seq})")
            item, self.pending = self.pending, None
            return item
        if which == "item":
            self.emitted += 1
            policy = self.mw.policy
            if self.emitted > policy.max_items:
                raise OutputLimitExceeded(
                    self.mw.name, self.spec.name, f"emitted more than {policy.max_items} items in one call"
                )
            self._within_item_limit(emit.item, "emitted an item")
            try:
                item = codec.decode_item(emit.item)
            except (CodecError, KeyError, ValueError) as exc:
                raise self._violation(f"malformed item: {exc}") from None
            if type(item) not in EMITTABLE[self.spec.name]:  # e.g. a model chunk in on_reply
                raise self._violation(f"{self.spec.name} cannot yield {type(item).__name__}")
            if (problem := tool_item_problem(item)) is not None:  # only on_acting yields tool items
                raise self._violation(problem)  # as a tool's own CallTool stream would be refused
            if getattr(item, "id", None) == "":  # the spec lets a middleware leave these to the host
                item.id = new_id()
            if getattr(item, "created_at", None) == "":
                item.created_at = now()
            if self.opened is not None:
                self.opened.see(item)
            return item
        raise self._violation("an empty emit")

    # -- state --------------------------------------------------------------------------------------

    def _context(self, ctx: hooks_pb2.HookContext, *, force: bool = False) -> None:
        """Fill the hook context when host state moved since the last one sent on this stream."""
        agent, state = self.agent, self.agent.state
        # The summary too: an in-process layer may set it in place (no version bump); a string
        # compares by identity first, so an unchanged one costs nothing.
        fingerprint = (state.version, len(state.context), state.summary)
        slot = state.middle_context.get(self.mw.key)
        # In-process layers sharing this key may edit the slot in place (no version bump).
        if not force and fingerprint == self.sent_fingerprint and slot == self.sent_slot:
            return
        self.sent_fingerprint, self.sent_slot = fingerprint, copy.deepcopy(slot)
        ctx.applied = self.applied
        ctx.agent_name = agent.name
        ctx.agent_description = agent.description
        ctx.session_id = state.session_id
        ctx.session_owner = state.owner
        ctx.reply_id = state.reply_id
        ctx.cur_iter = state.cur_iter
        ctx.max_iters = agent.max_iters
        ctx.middleware_key = self.mw.key
        ctx.state_version = state.version
        if slot is not None:
            json_to_value(slot, ctx.slot)
        else:
            ctx.slot.null_value = struct_pb2.NULL_VALUE
        codec.encode(agent.model.peek_ref(), ctx.model)  # encoded at once: no snapshot needed
        if force:  # a begin's context: they change only with the host's configuration, not per item
            ctx.model_ids.extend(agent.models.ids)
        ctx.structured_output_pending = (
            state.reply_context.structured_schema is not None and state.reply_context.structured_output is None
        )
        ctx.interrupted = getattr(agent, "interrupted_at", None) is not None
        if self.table is not None and self.table.wants_context:
            ctx.context.SetInParent()
            for msg in state.context:
                codec.encode(msg, ctx.context.messages.add())
            ctx.summary = state.summary

    def _mutate(self, mutation: hooks_pb2.Mutation) -> None:
        """Validate and apply one state change; anything not the middleware's own is a violation."""
        agent, state, key = self.agent, self.agent.state, self.mw.key
        op = mutation.WhichOneof("op")
        self.mw.check_mutation(op, self.spec.name)  # its permissions (security: client.py)
        what = "set a slot" if op == "set_slot" else f"sent a change ({op})"
        if op in _STORED_OPS:  # what it adds to the session, all its changes of one call together
            size, limit = mutation.ByteSize(), self.mw.policy.max_item_bytes  # sized once, for both limits
            if size > limit:
                raise OutputLimitExceeded(self.mw.name, self.spec.name, f"{what} of {size} bytes (limit {limit})")
            self.stored_bytes += size
            if self.stored_bytes > limit:
                raise OutputLimitExceeded(
                    self.mw.name,
                    self.spec.name,
                    f"its changes of the session in one call add up to {self.stored_bytes} bytes (limit {limit})",
                )
        else:
            self._within_item_limit(mutation, what)
        try:
            if op == "set_slot":
                value = value_to_json(mutation.set_slot)
                if value is None:
                    state.middle_context.pop(key, None)
                else:
                    state.middle_context[key] = value
                state.version += 1
            elif op == "append_message":
                msg = codec.decode(mutation.append_message)
                state.check_message(msg)  # before _own records anything (the same rules as in-process)
                self._own(msg.content)
                state.append_message(msg)
            elif op in ("append_blocks", "append_blocks_to_tail"):
                blocks = [codec.decode(getattr(b, b.WhichOneof("block"))) for b in getattr(mutation, op).blocks]
                self._own(blocks)
                if op == "append_blocks":
                    state.append_context(agent.name, blocks)
                else:
                    state.append_to_last_assistant(agent.name, blocks)
            elif op == "remove_block":
                block_id = mutation.remove_block
                if state.block_owners.get(block_id) == key:
                    state.remove_block(block_id)
                    del state.block_owners[block_id]
                elif any(b.id == block_id for m in state.context for b in m.content):
                    raise self._violation(f"remove_block {block_id!r}: not a block this middleware added")
                # else gone (compression dropped it, with its owner): nothing to remove, as in-process
            elif op == "set_model":
                agent.set_model(mutation.set_model)
            elif op == "set_cur_iter":
                if mutation.set_cur_iter < 0:
                    raise self._violation("set_cur_iter below 0")
                state.cur_iter = mutation.set_cur_iter
            elif op == "set_max_iters":
                agent.max_iters = mutation.set_max_iters  # checked as in-process (ValueError below)
            elif op == "set_summary":
                state.summary = mutation.set_summary
                state.version += 1
            elif op == "drop_messages":
                state.drop_messages(mutation.drop_messages)  # as compression does (ValueError below)
            else:
                raise self._violation("an empty mutation")
        except (CodecError, KeyError, TypeError, ValueError) as exc:
            raise self._violation(f"invalid {op}: {exc}") from None

    def _own(self, blocks: list[Any]) -> None:
        """Record the adder of each new block; an id already in the context is refused (a middleware
        must not come to own, and then remove, a block someone else added)."""
        state = self.agent.state
        taken = state.block_owners.keys() | {b.id for m in state.context for b in m.content}
        for block in blocks:
            if block.id in taken:
                raise self._violation(f"block id {block.id!r} is already in the context")
        for block in blocks:
            state.block_owners[block.id] = self.mw.key

    # -- transport -------------------------------------------------------------------------------

    # The per-message timeout: one timer per invocation (an asyncio.timeout() around every read
    # and write cost ~25 µs per intercepted item). While the host waits on the stream,
    # ``waiting_since`` is set; the watchdog ends a wait that outlasts the policy by cancelling the
    # waiting task (like asyncio.timeout: a pending grpc write does not return on call.cancel()
    # alone, e.g. while the stream waits for the server to admit it) and the call.

    def _watch(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.watchdog = self.loop.call_later(self.mw.policy.timeout, self._check_wait)

    def _check_wait(self) -> None:
        timeout, since, now = self.mw.policy.timeout, self.waiting_since, time.monotonic()
        if since is not None and now - since >= timeout:
            self.timed_out = True
            if self.waiter is not None:
                self.waiter.cancel()  # see _fail_if_timed_out
            if self.call is not None:
                self.call.cancel()
            return
        self.watchdog = self.loop.call_later(
            timeout - (now - since) if since is not None else timeout, self._check_wait
        )

    def _moved_nothing(self) -> None:
        """The message just read answers nothing: no command that moves the call on (a credit grant
        while the host holds an item or after inner_done, a suspend, or none) and no item emitted
        (state changes alone, or nothing). The wait it came in goes on with its deadline, so a middleware that keeps
        sending such messages times out as a silent one does, instead of holding the reply for ever,
        and a flood of them is a violation at once (hooks.proto, FAILURE)."""
        self.stalled_since = self.read_since
        self.moved_nothing += 1
        if self.moved_nothing > MAX_IDLE_MESSAGES:
            what = f"more than {MAX_IDLE_MESSAGES} messages in a row that answered nothing (no item, no answer)"
            raise self._violation(what)

    def _fail_if_timed_out(self, what: str) -> None:
        """On a CancelledError while waiting: raise the failure when our watchdog cancelled the
        wait; return when the reply itself was cancelled (that wins: the caller re-raises)."""
        if not self.timed_out:
            return
        task = self.waiter
        if task is not None and task.uncancel() > 0:
            return  # the reply was cancelled as well
        what = f"{what} within {self.mw.policy.timeout:g}s (timeout"
        if self.unlabelled:  # the likely reason it never answered, as far as the host can tell
            what += f"; {self.unlabelled} ignored: {MISSING_ID}"
        if self.moved_nothing:
            what += f"; {self.moved_nothing} messages meanwhile answered nothing (no item, no answer)"
        what += ")"
        raise NoAnswer(self.mw.name, self.spec.name, what) from None

    def notify_interrupted(self) -> None:
        """The reply was interrupted (Agent.interrupt, from another task): the next context sent says
        so, and a hook that declared interrupt_notice is told at once (hooks.proto, Interrupted), in
        order with whatever else goes out: as a queued copy, written now unless a write of this
        invocation is in flight (then right after it: _send)."""
        self.sent_fingerprint = None
        if self.call is None or self.table is None or not self.table.interrupt_notice or self.copy_error is not None:
            return
        notice = hooks_pb2.HostMessage(invocation=self.invocation)
        notice.interrupted.SetInParent()
        self.copies.append(notice)
        if self.flusher is None and not self.sending:
            self.flusher = self.loop.create_task(self._flush_copies())

    def _queue_copy(self, copy: hooks_pb2.HostMessage) -> None:
        """An observed copy goes out when the host next yields to its event loop, together with
        any others taken from the inner pipeline until then (one Batch: a burst of deltas costs one
        write, not one each), and always before the host's next message on the stream."""
        if self.copy_error is not None:  # an earlier write of copies failed: so does the invocation
            raise self.copy_error
        self.copies.append(copy)
        if self.flusher is None:
            self.flusher = asyncio.get_running_loop().create_task(self._flush_copies())

    async def _flush_copies(self) -> None:
        try:
            while self.copies:
                await self._send(self._with_pending())
        except Exception as exc:  # StreamBroken, a timeout: the invocation's, raised where it waits next
            self.copy_error = exc
        finally:
            self.flusher = None

    async def _settle_copies(self) -> None:
        """Before the host writes or reads on the stream: copies in flight are written first (one
        writer at a time, in order); a failed write fails the invocation here."""
        if self.flusher is not None:
            await asyncio.shield(self.flusher)  # our cancellation is not the flusher's
        if self.copy_error is not None:
            raise self.copy_error

    def _with_pending(self, msg: hooks_pb2.HostMessage | None = None) -> hooks_pb2.HostMessage:
        """``msg`` after what must go before it (a held begin, queued copies): one message, a
        Batch when there are several; what it took is no longer pending."""
        messages = [self.held_begin] if self.held_begin is not None else []
        messages += self.copies
        if msg is not None:
            messages.append(msg)
        self.held_begin, self.copies = None, []
        if len(messages) == 1:
            return messages[0]
        return hooks_pb2.HostMessage(batch=hooks_pb2.Batch(messages=messages), invocation=self.invocation)

    def _write(self, msg: hooks_pb2.HostMessage) -> Awaitable[None]:
        """Send ``msg`` after whatever must go before it (copies in flight, a held begin). The usual
        case returns ``_send`` itself: one frame fewer between the host's task and grpc."""
        if self.flusher is not None or self.copy_error is not None or self.held_begin is not None or self.copies:
            return self._write_after_pending(msg)
        return self._send(msg)

    async def _write_after_pending(self, msg: hooks_pb2.HostMessage) -> None:
        await self._settle_copies()
        await self._send(self._with_pending(msg) if self.held_begin is not None or self.copies else msg)

    # _send and _read mark the wait on the stream for the watchdog (waiting_since, waiter) in line,
    # not through a call or a coroutine wrapping them: this is the per-item path, and every frame
    # between the host's task and grpc is resumed at each wakeup. current_task is given the loop:
    # no running-loop lookup.

    async def _send(self, msg: hooks_pb2.HostMessage) -> None:
        if self.resend is not None:
            if len(self.resend) < MAX_RESENT:
                self.resend.append(msg)
            else:
                self.resend = None  # too much to send again: this call will not start over
        self.waiting_since, self.waiter = time.monotonic(), asyncio.current_task(self.loop)
        self.sending = True
        try:
            await self.call.write(msg)  # a middleware that stops reading blocks it
        except asyncio.CancelledError:
            self._fail_if_timed_out("could not send")
            raise
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _GONE and await self._start_over():
                return
            raise self._broken(exc.code(), exc.details()) from None
        except asyncio.InvalidStateError:  # it had ended already: how, its status says (the write does not)
            code = await self.call.code() if self.call.done() else None
            if (code is None or code in _GONE) and await self._start_over():
                return
            if code is None:
                raise StreamBroken(self.mw.name, self.spec.name, "the stream ended") from None
            if code is grpc.StatusCode.OK:
                raise StreamBroken(self.mw.name, self.spec.name, "the stream ended before finish") from None
            raise self._broken(code, await self.call.details()) from None
        finally:
            self.waiting_since = self.waiter = None
            self.sending = False
            if self.copies and self.flusher is None:  # an interrupt's notice queued while this was written
                self.flusher = self.loop.create_task(self._flush_copies())

    async def _start_over(self) -> bool:
        """A reused stream broke before the middleware answered anything of this invocation: it went
        with a connection that dropped (a restarted server) before the host noticed, so the
        middleware never got the invocation. Once, what was sent goes again, in order, on a new
        stream (hooks.proto, STREAMS ARE REUSED). Not while another task writes (copies in flight):
        then the call fails as before. True when it started over."""
        sent = self.resend
        if sent is None or self.flusher is not None:
            return False
        self.resend = None
        self.call.cancel()
        self.call, self.reused = self.mw.stream_went_stale(self.spec.name), False
        log.debug("%s %s: a kept stream had broken; the call starts over on a new one", self.mw.name, self.spec.name)
        for msg in sent:
            await self._send(msg)
        return True

    def _broken(self, code: grpc.StatusCode, details: str | None) -> StreamBroken:
        """The stream failed underneath, with this status. UNAVAILABLE is a connection gone (the
        server killed or restarted, the network cut), which its details do not say plainly."""
        return StreamBroken(self.mw.name, self.spec.name, broken_stream(code, details))

    async def _read(self) -> hooks_pb2.MiddlewareMessage:
        """The middleware's next message of this invocation. Messages of finished invocations on this
        stream (sent after their finish) are dropped; they count against the same deadline."""
        if self.copies or self.flusher is not None or self.copy_error is not None:
            await self._write_copies()  # what it may be waiting for goes out first (or their failure)
        if self.stalled_since is None:  # a new wait
            since, self.moved_nothing = time.monotonic(), 0
        else:  # the last message answered nothing: the same wait goes on
            since, self.stalled_since = self.stalled_since, None
        self.read_since = since
        while True:
            self.waiting_since, self.waiter = since, asyncio.current_task(self.loop)
            try:
                msg = await self.call.read()
            except asyncio.CancelledError:
                self._fail_if_timed_out("no answer")
                raise
            except grpc.aio.AioRpcError as exc:
                what = f"{exc.code().name}: {exc.details()}"
                if exc.code() == grpc.StatusCode.INTERNAL and "parse" in (exc.details() or "").lower():
                    raise ProtocolError(self.mw.name, self.spec.name, f"malformed message ({what})") from None
                if exc.code() in _GONE and await self._start_over():
                    continue
                raise self._broken(exc.code(), exc.details()) from None
            finally:
                self.waiting_since = self.waiter = None
            if msg is grpc.aio.EOF:
                if await self._start_over():
                    continue
                raise StreamBroken(self.mw.name, self.spec.name, "the stream ended before finish")
            if msg is None:  # grpc.aio hands over None when the bytes do not parse
                raise ProtocolError(self.mw.name, self.spec.name, "malformed message (not a MiddlewareMessage)")
            self.read_bytes = msg.ByteSize()
            self.received_bytes += self.read_bytes
            if self.received_bytes > self.mw.policy.max_bytes:
                raise OutputLimitExceeded(
                    self.mw.name, self.spec.name, f"sent more than {self.mw.policy.max_bytes} bytes in one call"
                )
            invocation = msg.invocation
            if invocation == self.invocation:
                self.applied += 1  # its actions are applied before the host sends anything else
                if self.resend is not None:  # it answered: the stream was sound
                    self.resend = None
                interrupted = getattr(self.agent, "interrupted_at", None)
                if interrupted is not None and time.monotonic() - interrupted > STOP_AFTER_INTERRUPT:
                    self._stop_after_interrupt(msg)
                return msg
            # On a reused stream, an unlabelled or older message may be a late one of an earlier
            # invocation: dropped, so it never fails this one. On a new stream it can only be ours.
            if invocation == 0 and not self.reused:
                raise self._violation(MISSING_ID)
            if invocation > self.invocation:
                raise self._violation(f"invocation {invocation} has not begun (this one is {self.invocation})")
            self.unlabelled += invocation == 0
            command = msg.WhichOneof("command")
            if command == "finish" and not msg.actions:
                continue  # a done_with_inner invocation's finish: expected, and nothing in it
            self.mw.stale_messages += 1
            if command == "fail":
                log.warning(
                    "%s %s: invocation %d failed after it ended: %s",
                    self.mw.name,
                    self.spec.name,
                    invocation,
                    clipped(msg.fail.message or msg.fail.type),
                )
            log.debug("%s %s: dropped a message of invocation %d", self.mw.name, self.spec.name, invocation)

    def _stop_after_interrupt(self, msg: hooks_pb2.MiddlewareMessage) -> None:
        """The reply was interrupted a while ago and the middleware still sends items of its own
        (it speaks a long text, say): the reply ends without it (fail_open: its open blocks ended
        for it; else the reply fails naming it), instead of the whole reply being cut off with no end
        at all. Passing on what it holds (forward_seq) is letting the interrupted end flow: fine."""
        if msg.WhichOneof("command") not in ("finish", "fail") and any(
            action.emit.WhichOneof("what") == "item" for action in msg.actions
        ):
            raise KeptGoing(
                self.mw.name,
                self.spec.name,
                f"it still sent items of its own {STOP_AFTER_INTERRUPT:g}s after the reply was interrupted",
            )

    def _within_item_limit(self, msg: Any, what: str) -> None:
        """One thing the middleware sent that the host stores or shows a client in one piece (an
        item, a result, a slot, a change of the context, stored kwargs) is at most max_item_bytes:
        a client takes 4 MiB per message by default (host.proto ReplyEvent)."""
        limit = self.mw.policy.max_item_bytes
        # Each part sized only when the message it came in (sized as read) may hold one too large:
        # an emitting middleware's items would otherwise be serialized twice.
        if self.read_bytes > limit and (size := msg.ByteSize()) > limit:
            raise OutputLimitExceeded(self.mw.name, self.spec.name, f"{what} of {size} bytes (limit {limit})")

    def _violation(self, what: str) -> ProtocolError:
        return ProtocolError(self.mw.name, self.spec.name, what)


__all__ = ["HookCall"]
