"""HookSession: the middleware's side of one hook invocation (spec: protos/agentmw/v1/hooks.proto).

It runs the author's hook method with an ``agent`` view and a ``next_handler`` that speak the
protocol: iterating the inner pipeline sends call_next / pull, yielding sends emit, state changes
send mutations. Actions are batched into the next command; if the author's code awaits something
else first, they are flushed at the end of the current event-loop turn (so nothing waits).

Fidelity with an in-process run: a ``yield`` suspends the author's generator until the host's
consumer asks for the next item (suspend / resume; after an observed copy, until the host's next
message); ``input_kwargs`` edited in place count as overrides (``changed_kwargs``); the inner
pipeline's exceptions are raised as the host's classes (``inner_error``). Credits are refilled
as the grant runs out, with ``answers_seq`` so a refill never answers an intercepted item.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import traceback
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from agentmw.chain import prepend
from agentmw.codec import CodecError, codec, json_to_value
from agentmw.data import ChatResponse, ErrorType
from agentmw.errors import MAX_TEXT, own_cancellation
from agentmw.hooks import HookSpec, Kind, check_next_kwargs, check_result
from agentmw.v1 import hooks_pb2
from agentmw.wire import (
    DEFAULT_CREDITS,
    EMITTABLE,
    decode_error_attributes,
    decode_kwarg,
    decode_result,
    encode_error,
    encode_kwargs,
    encode_result,
    model_override,
    rebuilt_error,
)

from .snapshot import same_fields, scalar_fields
from .view import EDITABLE, AgentView, KwargsDict

log = logging.getLogger("agentmw.sdk")

WINDOW = DEFAULT_CREDITS  # credits granted per pull for observed items
TRACEBACK_LIMIT = MAX_TEXT  # bytes of a traceback sent in Fail (its tail: where it was raised)


class InnerPipelineError(Exception):
    """The host's inner pipeline raised. ``type_name`` is its exception class name; ``str()`` its
    message, as in-process. The SDK raises a subclass named after the type that is also the host's
    own class when it knows the name (``agentmw.wire.rebuilt_error``), so ``except RuntimeError``
    or ``except ModelError`` match as they would in-process."""

    def __init__(
        self, type_name: str, message: str, retryable: bool | None, error_type: ErrorType | None = None
    ) -> None:
        super().__init__(message)
        self.type_name = type_name
        if retryable is not None:  # else none, as the host's exception had none (a RuntimeError)
            self.retryable = retryable
        if error_type is not None:  # else the class's own, if it has one (ModelError's default)
            self.error_type = error_type


def inner_error(
    type_name: str,
    message: str,
    retryable: bool | None = None,
    error_type: ErrorType | None = None,
    *,
    bases: Sequence[str] = (),
    attributes: Mapping[str, Any] | None = None,
) -> InnerPipelineError:
    """The inner pipeline's exception as the author's code would see it in-process (as near as
    the SDK can tell from its class, its bases and attributes: ``rebuilt_error``)."""

    def init(exc: InnerPipelineError) -> None:
        InnerPipelineError.__init__(exc, type_name, message, retryable, error_type)

    return rebuilt_error(InnerPipelineError, type_name, message, init, bases=bases, attributes=attributes)


class HostGone(Exception):
    """The host closed the stream (it was cancelled or went away)."""


class HostProtocolError(Exception):
    """The host broke the protocol (hooks.proto): a message that cannot be one, or cannot come now.
    The server ends the stream INVALID_ARGUMENT saying what came; the author's code, which may see
    this raised where it reads the inner pipeline, is not blamed for it (no Fail is sent)."""


class HookSession:
    def __init__(
        self, middleware: Any, key: str, spec: HookSpec, context: grpc.aio.ServicerContext, reader: HostReader
    ) -> None:
        self.mw, self.spec, self.ctx, self.reader = middleware, spec, context, reader
        self.invocation = 0  # the begin's id, echoed on every message (hooks.proto, INVOCATION IDS)
        self.view = AgentView(self, key)
        self.actions: list[hooks_pb2.Action] = []
        self.flush_scheduled = False
        self.flush_task: asyncio.Future[None] | None = None
        self.loop: asyncio.AbstractEventLoop  # set by run()
        self.write_lock = asyncio.Lock()
        self.sent = 0  # messages written in this invocation (compared with HookContext.applied)
        self.inbox: deque[hooks_pb2.HostMessage] = deque()  # host messages read ahead, in order
        self.generation = 0  # inner pipelines started
        self.inner_open = False  # the current inner pipeline may still deliver items
        self.granted = 0  # credits the host still holds (a lower bound)
        self.host_holding = False  # the host delivered an intercepted item and waits for its answer
        self.unanswered = 0  # seq of the intercepted item handed to the author, not answered yet
        self.answered = 0  # seq of the last intercepted item answered (Pull.answers_seq of a refill)
        self.suspended = False  # sent suspend, waiting for resume
        self.unsent_slot: Exception | None = None  # why the slot could not be sent (_sync_slot_unchecked)
        self.emittable = EMITTABLE.get(spec.name, frozenset())  # what emit() sends (read per item)
        self.read_lock = asyncio.Lock()
        # The intercepted item held now: (item, its proto, seq, its fields when all are scalars).
        self.current: tuple[Any, Any, int, tuple[Any, ...] | None] | None = None
        self.observed: dict[int, Any] = {}
        self.last_inner_error: InnerPipelineError | None = None
        subscription = middleware.subscription(spec.name)
        self.detached = subscription.detached
        self.run_ahead = subscription.run_ahead  # no suspend at yields (Subscription.run_ahead)
        self.eager = subscription.eager_next or subscription.detached  # the host starts next itself
        self.done_with_inner = subscription.done_with_inner  # the host ends the call at inner_done
        self.ended = False  # an inner pipeline ended normally (inner_done)
        self.inner_result: Any = None  # its result (a value hook's)
        self.begin_kwargs: hooks_pb2.Kwargs | None = None
        self.kwargs = KwargsDict()  # the author's input_kwargs (edited in place, as in-process)
        self.inner_streams: list[Any] = []  # on_model_call: the streams next_handler() returned
        self.violation: HostProtocolError | None = None  # how the host broke the protocol, if it did

    # -- running the author's code ---------------------------------------------------------------

    async def run(self, message: hooks_pb2.HostMessage) -> None:
        self.loop = asyncio.get_running_loop()  # once: on Python 3.11 each lookup costs a getpid()
        self.invocation = message.invocation
        begin = message.begin
        self.begin_kwargs = begin.input_kwargs
        self.view.refresh(begin.context)
        spec, encoded = self.spec, begin.input_kwargs
        self.kwargs = kwargs = KwargsDict.lazy(spec.params, lambda key: decode_kwarg(spec, encoded, key))
        method = getattr(self.mw, self.spec.name)
        kind = self.spec.kind
        try:
            sent_for = encoded.WhichOneof("hook")  # unset: every parameter None
            if sent_for is not None and sent_for != spec.name:
                raise self.host_violation(f"a begin with the input kwargs of {sent_for}")
            result: Any = None
            if kind is Kind.STREAM:
                items = method(agent=self.view, input_kwargs=kwargs, next_handler=self.next_handler)
                await self._drive(items, lockstep=not self.run_ahead)
            elif kind is Kind.CALL:
                result = await method(agent=self.view, input_kwargs=kwargs, next_handler=self.next_handler)
                result = check_result(self.spec, result)  # as the chain checks an in-process layer
            elif kind is Kind.MODEL:
                value = await method(agent=self.view, input_kwargs=kwargs, next_handler=self.next_handler)
                if isinstance(value, ChatResponse):
                    # The hook's value, not a stream (hooks.proto, finish); an observed copy the host
                    # forwarded already is not sent again.
                    if self.observed.get(id(value)) is not value:
                        result = value
                else:  # next_handler()'s own stream, returned as is, runs no author code between chunks
                    await self._drive(value, lockstep=value not in self.inner_streams and not self.run_ahead)
            else:
                result = check_result(self.spec, await method(self.view, kwargs["prompt"]))
            if self.violation is not None:  # the author's code caught it and went on: the stream ends all the same
                raise self.violation
            if self.done_with_inner and self.ended and result != self.inner_result:
                self._refuse(f"return {result!r} instead of the inner result {self.inner_result!r}")
            finish = hooks_pb2.MiddlewareMessage()
            finish.finish.SetInParent()
            encode_result(result, finish.finish.result)
            await self.send(finish)
        except HostGone:
            return
        except BaseException as exc:
            # Whatever the author's code raised is answered, a CancelledError or another
            # BaseException too: unanswered, the host would wait out its timeout and then take the
            # middleware for hung. Only a cancellation of this task (the host went away, the
            # server stops) has no one to answer.
            if own_cancellation(exc):
                raise
            if self.violation is not None:  # whatever the author's code made of it: the host's fault
                raise self.violation from None
            fail = hooks_pb2.MiddlewareMessage()
            encode_error(exc, fail.fail)
            fail.fail.from_inner = exc is self.last_inner_error
            if not fail.fail.from_inner:
                log.exception("%s raised in %s", type(self.mw).__name__, self.spec.name)
                text = "".join(traceback.format_exception(exc))
                fail.fail.traceback = text.encode()[-TRACEBACK_LIMIT:].decode(errors="ignore")
            await self.send(fail, check=False)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):  # answered; the process still stops
                raise
        finally:
            # Break the session's reference cycles (its view, and on_model_call's streams, point back
            # at it) so that it is freed now, not by the garbage collector: a cyclic session cost
            # a value hook ~15% more SDK time, in collections.
            self.view.close()
            self.inner_streams.clear()

    async def _drive(self, items: Any, *, lockstep: bool = True) -> None:
        """Emit what the author's generator yields. As in-process, its code after a ``yield`` runs
        only once the consumer asks for the next item: after an emit the SDK suspends and waits for
        the host's resume; after an observed copy (which the host did not wait for) it waits for the
        host's next message. ``lockstep=False``: no author code runs between items (the stream of
        next_handler() itself), or the hook declared ``run_ahead``, so nothing waits."""
        async for out in items:
            emitted = self.emit(out, flush=not lockstep)  # lock-step: the suspend below carries it
            if not lockstep:
                continue
            if emitted:
                msg = hooks_pb2.MiddlewareMessage()
                msg.suspend.SetInParent()
                self.suspended = True
                await self.send(msg, synced=True)  # emit() synced the view just now
                await self.fetch(_resumed)
            else:
                await self.fetch(_inbox_or_end)

    def next_handler(self, **overrides: Any) -> Any:
        check_next_kwargs(self.spec, overrides, dict.keys(self.kwargs))  # keys only: nothing decoded
        if self.spec.kind is Kind.STREAM:
            return InnerStream(self, overrides)
        return self._call_next_value(overrides)

    async def _call_next_value(self, overrides: dict[str, Any]) -> Any:
        """next_handler of CALL hooks (the inner value) and of on_model_call (a chunk stream)."""
        inner = InnerStream(self, overrides)
        if self.spec.kind is Kind.CALL:
            async for item in inner:
                raise RuntimeError(f"unexpected item {type(item).__name__} in {self.spec.name}")
            if inner.error is not None:  # a StopAsyncIteration of the inner pipeline ended the loop
                raise inner.error
            return inner.result
        try:
            first = await inner.__anext__()  # call-time errors raise here, as in-process
        except StopAsyncIteration:
            if inner.error is not None:  # the inner pipeline raised one: as in-process, the caller gets it
                raise
            if isinstance(inner.result, ChatResponse):
                return inner.result  # the inner pipeline returned one response, not a stream
            first = None
        stream = prepend(first, inner)
        self.inner_streams.append(stream)
        return stream

    def changed_kwargs(self, overrides: dict[str, Any]) -> dict[str, Any]:
        """What the inner pipeline gets that differs from the begin's kwargs: the explicit overrides
        merged over ``input_kwargs`` as it is now (in-place edits count, as in-process; a deleted
        key is None). Only values the code was handed can have been edited (KwargsDict.used): none,
        nothing to compare; some, those alone, less those a snapshot clears (KwargsDict.edited: an
        immutable value, or a flat dataclass whose fields are as decoded). Encoding is cheaper than
        decoding, and the same values encode to the same bytes: when they encode to the begin's
        bytes, nothing changed. Else, or when they cannot be encoded, each is compared with a fresh
        decode of the begin's, as a value (so the error, if any, comes when sent)."""
        assert self.begin_kwargs is not None
        kwargs = self.kwargs
        if not overrides and not kwargs.touched:
            return {}
        if overrides or kwargs.used is None:
            kwargs.use()
            keys = self.spec.params
        else:  # only the values handed out can have been edited in place
            keys = frozenset(k for k in kwargs.used if kwargs.edited(k))
            if not keys:
                return {}
        merged = {k: dict.get(kwargs, k) for k in keys}
        merged.update(overrides)
        keys = keys | overrides.keys()
        present = {k: v for k in keys if (v := merged.get(k)) is not None}
        with contextlib.suppress(Exception):  # an unencodable value fails when sent, as before
            now = encode_kwargs(self.spec, present, hooks_pb2.Kwargs())
            begin = (
                self.begin_kwargs.SerializeToString(deterministic=True)
                if keys >= self.spec.params
                else _only(self.begin_kwargs, self.spec.name, keys)
            )
            if now.SerializeToString(deterministic=True) == begin:
                return {}
        begin_kwargs = self.begin_kwargs
        return {k: v for k in keys if (v := merged.get(k)) != decode_kwarg(self.spec, begin_kwargs, k)}

    # -- outgoing --------------------------------------------------------------------------------

    def emit(self, out: Any, *, flush: bool = True) -> bool:
        """Queue ``out`` as an emit; False when it is an observed copy (the host already forwarded it).
        ``flush``: send it at the end of this loop turn unless a command takes it first (False: the
        caller sends a command right away)."""
        self.sync_state()
        if out is not None and self.observed.pop(id(out), None) is out:  # None: the pop's default
            return False
        if type(out) not in self.emittable:  # as the host checks an in-process layer's
            raise TypeError(f"{self.spec.name} cannot yield {type(out).__name__}")
        self._refuse(f"emit {type(out).__name__}")
        action = hooks_pb2.Action()
        current = self.current
        if current is not None and current[0] is out:  # the held item yielded again
            self.current = None
            _, proto, seq, fields = current
            if fields is not None and same_fields(out, fields):  # unchanged: point at it, no encoding
                action.emit.forward_seq = seq
            else:
                codec.encode_item(out, action.emit.item)
                if action.emit.item == proto:  # edited and back, or nested fields: compared encoded
                    action.emit.forward_seq = seq
        else:
            codec.encode_item(out, action.emit.item)
        self._queue(action, flush=flush)
        return True

    def mutate(self, mutation: hooks_pb2.Mutation) -> None:
        self._refuse("change the agent's state")
        self.sync_state()
        action = hooks_pb2.Action()
        action.mutate.CopyFrom(mutation)
        self._queue(action)

    def sync_state(self) -> None:
        """Turn in-place changes of the view (context edits, the slot) into mutations, in order.
        It runs twice per intercepted item: the checks that find nothing to do are made here, not
        by a call each (a context not sent, a slot neither used nor a dict or list)."""
        if self.unsent_slot is not None:
            exc, self.unsent_slot = self.unsent_slot, None
            raise exc
        state = self.view.state
        if state.context.visible:
            state.context.sync()
        slot = state.middle_context
        if slot.touched or isinstance(dict.get(slot, slot.key), EDITABLE):
            self.sync_slot()

    def sync_slot(self) -> None:
        slot = self.view.state.middle_context
        try:
            changed, value = slot.changed()
            if changed:
                self._refuse("change its slot")
                action = hooks_pb2.Action()
                json_to_value(value, action.mutate.set_slot)
                self.actions.append(action)
                slot.pending_message = self.sent + 1  # the next message written carries it
        except (TypeError, ValueError, RecursionError) as exc:  # a set, a non-str key, a cycle...
            raise TypeError(
                f"middle_context[{slot.key!r}] must hold JSON (objects with str keys, lists, str, numbers, "
                f"bools, None): {exc}"
            ) from None

    def _sync_slot_unchecked(self) -> None:
        """``sync_slot`` where no author code is on the stack (a flush, the fail): what cannot be
        carried is raised in the author's code at its next step (sync_state), not here, where it
        ended the stream with UNKNOWN and the host took the middleware for broken."""
        try:
            self.sync_slot()
        except (TypeError, RuntimeError) as exc:
            self.unsent_slot = exc

    def host_violation(self, what: str) -> HostProtocolError:
        """``what`` came from the host: kept, so that the invocation ends saying so (run)."""
        self.violation = HostProtocolError(what)
        return self.violation

    def _refuse(self, what: str) -> None:
        """What a detached hook, or a done_with_inner one once its inner pipeline ended, must not do
        (the host would never read it: hooks.proto, HookDescription)."""
        if self.detached:
            raise RuntimeError(f"{self.spec.name} is detached: it can only watch, not {what}")
        if self.done_with_inner and self.ended:
            raise RuntimeError(
                f"{self.spec.name} is declared done_with_inner: after its inner pipeline ended it cannot {what}"
            )

    def _queue(self, action: hooks_pb2.Action, *, flush: bool = True) -> None:
        self.actions.append(action)
        if flush and not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self._flush_soon)

    def _flush_soon(self) -> None:
        self.flush_scheduled = False
        if self.actions:
            self.flush_task = self.loop.create_task(self.send(hooks_pb2.MiddlewareMessage(), check=False))
            # The author's code runs ahead (emits without asking for more): unless it waits for the
            # inner pipeline meanwhile (fetch reads), an Interrupted would wait unseen. Read on now.
            if not self.read_lock.locked():
                self.reader.read_ahead(self._peek)

    def _peek(self, msg: hooks_pb2.HostMessage) -> None:
        """A message read ahead: an interrupt of this invocation shows in the view at once (the
        message itself is handed over in order by the next read)."""
        messages = msg.batch.messages if msg.WhichOneof("message") == "batch" else (msg,)
        if any(m.invocation == self.invocation and m.WhichOneof("message") == "interrupted" for m in messages):
            self.view.interrupted = True

    async def send(self, msg: hooks_pb2.MiddlewareMessage, *, check: bool = True, synced: bool = False) -> None:
        """Send pending actions (in order) together with ``msg``'s command. ``check``: first turn
        in-place view changes into mutations (raises in the author's code if one cannot be carried);
        ``synced``: the caller just did, and no author code ran since."""
        if not synced:
            if check:
                self.sync_state()
            else:
                self._sync_slot_unchecked()
        msg.invocation = self.invocation
        # acquire/release, not ``async with``: two Python calls fewer, twice per item.
        lock = self.write_lock
        await lock.acquire()
        try:
            if self.actions:
                msg.actions.extend(self.actions)
                self.actions.clear()
            elif msg.WhichOneof("command") is None:
                return
            self.sent += 1
            try:
                await self.ctx.write(msg)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, RuntimeError) as exc:
                raise HostGone(str(exc)) from None
        finally:
            lock.release()

    async def pull(self, answers: int) -> None:
        """Ask for more: answers the intercepted item ``answers`` (0: a credit grant only)."""
        msg = hooks_pb2.MiddlewareMessage()
        msg.pull.credits = WINDOW
        msg.pull.answers_seq = answers or self.answered
        if answers:
            self.answered, self.unanswered, self.host_holding, self.current = answers, 0, False, None
        self.granted += WINDOW
        await self.send(msg)

    # -- incoming --------------------------------------------------------------------------------

    async def fetch(self, ready: Callable[[HookSession], bool]) -> None:
        """Read the host's messages of this invocation into the inbox (a resume ends a suspend
        instead) until ``ready(self)``. One reader at a time (the author's code may wait on the inner
        pipeline in another task while suspended). Grants credits when the host may wait for them."""
        lock = self.read_lock
        await lock.acquire()  # not ``async with``: see send()
        try:
            while not ready(self):
                if self.inner_open and not (self.detached or self.suspended or self.host_holding) and self.granted <= 0:
                    await self.pull(0)
                try:
                    msg = await self.reader.read()
                except HostProtocolError as exc:
                    self.violation = exc
                    raise
                if msg is None:
                    raise HostGone("the host closed the stream")
                if msg.invocation != self.invocation:
                    if msg.invocation > self.invocation and msg.WhichOneof("message") == "begin":
                        self.reader.buffer.appendleft(msg)  # the host ended this one (done_with_inner)
                        raise HostGone("the host moved on to the next invocation")
                    continue  # sent for an earlier invocation
                which = msg.WhichOneof("message")
                if which == "resume":
                    self.suspended = False
                    if msg.resume.HasField("context"):
                        self.view.refresh(msg.resume.context)
                    continue
                if which == "interrupted":  # the reply was interrupted: agent.interrupted (hooks.proto)
                    self.view.interrupted = True
                    continue
                body = getattr(msg, which)
                if getattr(body, "inner", self.generation) == self.generation:  # else stale: ignored later
                    if which == "item":
                        if body.observed:
                            self.granted -= 1
                        else:
                            self.granted, self.host_holding = 0, True
                    else:
                        self.inner_open = False
                self.inbox.append(msg)
        finally:
            lock.release()


# What fetch() waits for. Module functions, not lambdas made per call (one per item) or stored on
# the session (each a reference cycle, left to the garbage collector).
def _has_inbox(s: HookSession) -> bool:
    return bool(s.inbox)


def _resumed(s: HookSession) -> bool:
    return not s.suspended


def _inbox_or_end(s: HookSession) -> bool:
    return bool(s.inbox) or not s.inner_open


def _only(kwargs: hooks_pb2.Kwargs, hook: str, keys: frozenset[str]) -> bytes:
    """The Begin's kwargs with only ``keys`` set (and their ``_json`` texts), serialized as
    ``encode_kwargs`` of those keys would be."""
    copy = hooks_pb2.Kwargs()
    copy.CopyFrom(kwargs)
    record = getattr(copy, hook)
    for field, _ in record.ListFields():
        oneof = field.containing_oneof
        name = oneof.name if oneof is not None and not oneof.name.startswith("_") else field.name
        if name not in keys and name.removesuffix("_json") not in keys:
            record.ClearField(field.name)
    return copy.SerializeToString(deterministic=True)


_UNPARSED = "a message that cannot be parsed as a HostMessage"


class HostReader:
    """The host's messages on one stream, with batches (hooks.proto, Batch) unpacked in order."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self.context = context
        self.buffer: deque[hooks_pb2.HostMessage] = deque()
        self.ahead: asyncio.Task[hooks_pb2.HostMessage | None] | None = None  # a read started early

    async def read(self) -> hooks_pb2.HostMessage | None:
        """The next message, or None once the host closed the stream."""
        while not self.buffer:
            if self.ahead is None:  # the usual case, inline: this is the per-item path
                try:
                    msg = await self.context.read()
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    return None
                except DecodeError:  # grpc's deserializer: the bytes are no HostMessage
                    raise HostProtocolError(_UNPARSED) from None
                if msg is grpc.aio.EOF:
                    return None
            else:
                ahead, self.ahead = self.ahead, None
                msg = await ahead
                if msg is None:
                    return None
            which = msg.WhichOneof("message")
            if which != "batch":
                if which is None:
                    raise HostProtocolError("a message with none of begin, item, inner_done, ... set")
                return msg
            for inside in msg.batch.messages:
                if inside.WhichOneof("message") in ("batch", None):
                    raise HostProtocolError("a batch inside a batch, or an empty message in one")
            self.buffer.extend(msg.batch.messages)
        return self.buffer.popleft()

    async def _read_one(self) -> hooks_pb2.HostMessage | None:
        try:
            msg = await self.context.read()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            return None
        except DecodeError:
            raise HostProtocolError(_UNPARSED) from None
        return None if msg is grpc.aio.EOF else msg

    def read_ahead(self, peek: Callable[[hooks_pb2.HostMessage], None]) -> None:
        """Start reading the next message now, unless one is at hand or being read; ``peek`` sees
        it as soon as it arrives, and ``read`` hands it over in order."""
        if self.ahead is not None or self.buffer:
            return

        def arrived(task: asyncio.Task[hooks_pb2.HostMessage | None]) -> None:
            if not task.cancelled() and task.exception() is None and (msg := task.result()) is not None:
                peek(msg)

        self.ahead = asyncio.get_running_loop().create_task(self._read_one())
        self.ahead.add_done_callback(arrived)

    def close(self) -> None:
        """The stream is over: a read started early is given up."""
        if self.ahead is not None:
            self.ahead.cancel()
            self.ahead = None

    async def next_begin(self) -> hooks_pb2.HostMessage | None:
        """The next invocation's begin message (None when the host closed the stream). Messages
        still in flight from the previous invocation (observed items it did not read) are skipped."""
        while (msg := await self.read()) is not None:
            if msg.WhichOneof("message") == "begin":
                if msg.invocation == 0:
                    raise HostProtocolError("a begin with invocation id 0")
                return msg
        return None


class InnerStream:
    """One call of next_handler: the inner pipeline's items, pulled on demand."""

    def __init__(self, session: HookSession, overrides: dict[str, Any]) -> None:
        self.session = session
        self.changed = session.changed_kwargs(overrides)  # at call time, as in-process
        self.started = False
        self.done = False
        self.generation = 0
        self.result: Any = None
        # The inner pipeline's exception: a StopAsyncIteration raised from __anext__ reads as the end.
        self.error: InnerPipelineError | None = None

    def __aiter__(self) -> InnerStream:
        return self

    async def __anext__(self) -> Any:
        s = self.session
        if self.done:
            raise StopAsyncIteration
        if not self.started:
            if s.done_with_inner and s.ended:
                s._refuse("call next_handler() again")
            self.started = True
            changed = self.changed
            s.generation += 1
            self.generation = s.generation
            s.granted, s.host_holding, s.unanswered, s.current, s.inner_open = WINDOW, False, 0, None, True
            if s.eager and s.generation == 1:  # the host started this pipeline at begin
                if changed:
                    raise TypeError(
                        f"{s.spec.name} is declared eager_next: its first next_handler() runs with the "
                        f"kwargs unchanged (it changes {sorted(changed)})"
                    )
                return await self._receive()
            msg = hooks_pb2.MiddlewareMessage()
            call_next = msg.call_next
            call_next.credits = WINDOW
            if changed.get("current_model") is not None:
                changed["current_model"] = model_override(changed["current_model"])
            if changed:  # else no overrides at all (an unset Kwargs: hooks.proto CallNext)
                call_next.cleared.extend(k for k, v in changed.items() if v is None)
                encode_kwargs(s.spec, {k: v for k, v in changed.items() if v is not None}, call_next.overrides)
            await s.send(msg)
        elif self.generation != s.generation:
            raise RuntimeError("this inner pipeline was replaced by a later next_handler() call")
        elif s.unanswered and not s.detached:  # done with the held item: answer it
            await s.pull(s.unanswered)
        return await self._receive()

    async def _receive(self) -> Any:
        s = self.session
        inbox = s.inbox
        while True:
            if not inbox:  # the host's next message of this invocation: read ahead, or read it now
                await s.fetch(_has_inbox)
            msg = inbox.popleft()
            which = msg.WhichOneof("message")
            body = getattr(msg, which)
            if getattr(body, "inner", self.generation) != self.generation:
                continue  # still in flight from an inner pipeline this middleware abandoned
            if body.HasField("context"):
                s.view.refresh(body.context)
            if which == "item":
                try:
                    item = codec.decode_item(body.item)
                except (CodecError, KeyError, ValueError) as exc:
                    raise s.host_violation(f"a malformed item (seq {body.seq}): {exc}") from None
                if body.observed:
                    if len(s.observed) > 1024:
                        s.observed.clear()
                    s.observed[id(item)] = item
                else:
                    s.current = (item, body.item, body.seq, scalar_fields(item))
                    s.unanswered = body.seq
                return item
            self.done = True
            if which == "inner_done":
                self.result = s.inner_result = decode_result(body.result)
                s.ended = True
                raise StopAsyncIteration
            if which == "inner_error":
                s.last_inner_error = self.error = inner_error(body.type, body.message, **decode_error_attributes(body))
                raise s.last_inner_error
            raise s.host_violation(f"a {which} inside the invocation it belongs to")
