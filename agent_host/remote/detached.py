"""Delivery to a detached hook (a watcher): copies go out in batches in the background, so a reply
never waits for a watcher, not even for a write. Envoy ext_proc calls this observability mode.

Copies also stay off the reply's busy stretch: a middleware's finished invocations are held while
another of its detached invocations is still open (its on_reply spans the whole reply) and go out
together when none is, or ``HOLD`` seconds after the first was held, from one task per group.
Sent during the reply, the tracing server's copies made a 1,000-delta reply with 3 tool rounds
end ~10% later (gRPC writes and reads between its steps); held, they cost the same host CPU after
it (``make bench``, docs/tracing.md). A batch that fills up goes out at once (a watcher of every
delta streams).

A detached invocation runs flat (``Watch``): one generator between the agent and the inner
pipeline, with the per-item work a subscription lookup, instead of the generic HookCall's four or
five; a tracer's 1,000-delta reply ended 1.27x → ~1.14x of no middleware for it. Copies are encoded
when their item passes: encoding them later, in the sender, would need a snapshot of what the
agent mutates in place afterwards (the reply's assistant message grows, tool calls change state),
and a safe one (deepcopy) costs more than the encoding it moves (measured: ~3x for a model call's
messages).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

import grpc

from agentmw.chain import closing
from agentmw.data import ChatResponse
from agentmw.subscriptions import Mode
from agentmw.v1 import hooks_pb2

from .. import metrics, tracing
from .errors import MiddlewareFailure

if TYPE_CHECKING:
    from .client import RemoteMiddleware
    from .protocol import HookCall

log = logging.getLogger("agentmw.remote")

BATCH_SIZE = 64  # copies per write
MAX_QUEUED = 64  # batches waiting for a slow watcher before copies are dropped
HOLD = 0.5  # seconds at most that finished invocations wait for the middleware's open ones
_FAILURES = (grpc.aio.AioRpcError, asyncio.InvalidStateError, TimeoutError)
_CLOSED = grpc.aio.UsageError  # the middleware was closed while copies were held: they are dropped


class _Outbox:
    """One middleware's detached invocations on one event loop: how many are open, and the
    finished ones held until none is (or until ``HOLD`` runs out); its Describe in the background."""

    __slots__ = ("describing", "held", "loop", "open", "timer")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.open = 0
        self.held: list[DetachedDelivery] = []
        self.timer: asyncio.TimerHandle | None = None
        self.describing: asyncio.Task[None] | None = None

    def describe(self, mw: RemoteMiddleware) -> None:
        """Describe ``mw`` again, in the background and one Describe at a time: a watcher is never
        waited for, not even for that (a server that hangs would hold every reply up)."""
        if self.describing is None or self.describing.done():
            self.describing = mw.in_background(_describe(mw))

    def hold(self, delivery: DetachedDelivery) -> None:
        self.held.append(delivery)
        if self.timer is None:
            self.timer = self.loop.call_later(HOLD, self.release)

    def release(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        group, self.held = self.held, []
        if group:
            group[0].mw.in_background(_send_all(group))


def _outbox(mw: RemoteMiddleware) -> _Outbox:
    if mw.outbox is None:  # one per middleware: its channel, and so its deliveries, live on one loop
        mw.outbox = _Outbox(asyncio.get_running_loop())
    return mw.outbox


async def _describe(mw: RemoteMiddleware) -> None:
    try:
        await mw.connect(timeout=mw.policy.timeout)  # a failure is counted there, as a Describe's
    except MiddlewareFailure:
        mw.failed()


class DetachedDelivery:
    """The copies of one detached invocation, from its begin to its inner_done."""

    __slots__ = (
        "batches",
        "box",
        "closed",
        "dropping",
        "hook",
        "invocation",
        "mw",
        "pending",
        "reply",
        "task",
        "wake",
    )

    def __init__(self, call: HookCall) -> None:
        self.mw, self.hook, self.invocation = call.mw, call.spec.name, call.invocation
        state = call.agent.state  # which reply, said should its delivery fail (after the reply, mostly)
        self.reply = (state.session_id, state.reply_id)
        self.pending: list[hooks_pb2.HostMessage] = []
        self.batches: list[list[hooks_pb2.HostMessage]] = []  # flushed, not yet written
        self.dropping = False
        self.closed = False  # ended or abandoned on the host's side
        self.task: asyncio.Task[None] | None = None  # its own sender, once a batch filled up
        self.wake: asyncio.Future[None] | None = None  # that sender waiting for more batches
        self.box = _outbox(call.mw)
        self.box.open += 1

    def add(self, msg: hooks_pb2.HostMessage) -> None:
        if not self.dropping:
            self.pending.append(msg)
            if len(self.pending) >= BATCH_SIZE:
                self._flush()
                self._stream()

    def end(self) -> None:
        """The invocation is over on the host's side: send the rest, then read its finish."""
        self._flush()
        self._close()
        if self.task is not None:
            self._wake()
        else:
            self.box.hold(self)
        if self.box.open == 0:
            self.box.release()

    def abandon(self) -> None:
        """The reply stopped half-way (cancelled): the watcher's stream cannot be reused."""
        self._close()
        if self.task is not None:
            self.task.cancel()
        if self.box.open == 0:
            self.box.release()

    def _close(self) -> None:
        if not self.closed:
            self.closed = True
            self.box.open -= 1

    def _flush(self) -> None:
        if not self.pending:
            return
        if len(self.batches) >= MAX_QUEUED:
            self.dropping = True
            log.warning("detached middleware %r falls behind in %s: dropping copies", self.mw.name, self.hook)
        else:
            self.batches.append(self.pending)
        self.pending = []

    # -- sending ---------------------------------------------------------------------------------

    def _stream(self) -> None:
        """A full batch: this invocation sends from now on by itself, as its batches come."""
        if self.task is None:
            self.task = self.mw.in_background(self._run())
        else:
            self._wake()

    def _wake(self) -> None:
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)

    async def _run(self) -> None:
        try:
            call, _ = self.mw.take_stream(self.hook)
        except _CLOSED:
            return
        timeout = self.mw.policy.timeout
        try:
            while True:
                async with asyncio.timeout(timeout):
                    await self._write(call)
                if self.closed:
                    break
                self.wake = asyncio.get_running_loop().create_future()
                await self.wake
            async with asyncio.timeout(timeout):
                await self._finish(call)
        except _FAILURES as exc:
            self._failed(call, exc)
        except asyncio.CancelledError:
            call.cancel()
            raise

    async def _write(self, call: grpc.aio.StreamStreamCall) -> None:
        while self.batches:
            batch = self.batches.pop(0)
            msg = (
                batch[0]
                if len(batch) == 1
                else hooks_pb2.HostMessage(batch=hooks_pb2.Batch(messages=batch), invocation=self.invocation)
            )
            await call.write(msg)

    async def _finish(self, call: grpc.aio.StreamStreamCall) -> None:
        """Read up to its finish (or fail), then hand the stream to the next invocation."""
        mw = self.mw
        while True:
            answer = await call.read()
            if answer is grpc.aio.EOF or answer is None:
                call.cancel()
                return
            if answer.invocation != self.invocation:  # sent after an earlier invocation ended
                mw.stale_messages += 1
                continue
            if answer.WhichOneof("command") in ("finish", "fail"):
                mw.release_stream(self.hook, call)
                metrics.answers_again(mw)  # a watcher's invocation is served only now
                return

    def _failed(self, call: grpc.aio.StreamStreamCall, exc: BaseException) -> None:
        call.cancel()
        mw = self.mw
        mw.failed()
        if isinstance(exc, grpc.aio.AioRpcError):
            why = f"{exc.code().name}: {exc.details()}"
        elif isinstance(exc, TimeoutError):
            why = f"no answer within {mw.policy.timeout:g}s"
        else:
            why = str(exc) or type(exc).__name__
        reply = f"session={self.reply[0]} reply={self.reply[1] or '-'}"
        log.warning("detached middleware %r stopped watching %s of %s: %s", mw.name, self.hook, reply, why)
        failure = MiddlewareFailure(mw.name, self.hook, f"its copies of {reply} were not delivered: {why}")
        metrics.hook_failed(mw, self.hook, failure, bypassed=True, in_reply=False)


async def _send_all(group: list[DetachedDelivery]) -> None:
    """Held invocations of one middleware: write each one's copies (each on a stream of its own),
    then read their finishes, so that their round trips overlap; within the policy's timeout."""
    mw = group[0].mw
    timeout = mw.policy.timeout
    sent: list[tuple[DetachedDelivery, grpc.aio.StreamStreamCall]] = []
    try:
        for delivery in group:
            try:
                call, _ = mw.take_stream(delivery.hook)
            except _CLOSED:
                break
            sent.append((delivery, call))
            try:
                async with asyncio.timeout(timeout):
                    await delivery._write(call)
            except _FAILURES as exc:
                sent.pop()
                delivery._failed(call, exc)
        async with asyncio.timeout(timeout):
            while sent:
                delivery, call = sent[0]
                try:
                    await delivery._finish(call)
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
                    delivery._failed(call, exc)
                sent.pop(0)
    except TimeoutError as exc:  # a stalled watcher: give up on what it has not finished
        for delivery, call in sent:
            delivery._failed(call, exc)
    except asyncio.CancelledError:
        for _, call in sent:
            call.cancel()
        raise


# -- the flat path: a detached invocation in one generator layer ----------------------------------


_UNOPENED: Any = object()


class Watch:
    """One detached invocation, run flat: one generator layer between the agent and the inner
    pipeline, whose per-item work is a subscription lookup (and, for a subscribed item, building
    its copy). The generic HookCall machinery (its guard, protocol loop and inner-item adapter:
    four generator layers per item) cost a 1,000-delta reply ~3 µs per delta per detached hook.
    The HookCall still builds the messages, so copies are the same on both paths."""

    __slots__ = ("call", "started")

    def __init__(self, call: HookCall) -> None:
        self.call = call
        self.started = 0.0

    def items(self) -> AsyncIterator[Any]:
        """on_reply, on_reasoning, on_acting."""
        return self.flow()

    async def stream(self) -> Any:
        """on_model_call: returns when the inner call does, with the inner stream (or a whole
        ChatResponse) as it is: a watcher changes nothing, not even which errors raise at the call
        (where retries happen) and which while the stream is read. (The generic path reads the
        first chunk at the call: the middleware's own call returns only with its first emit.)"""
        call = self.call
        try:
            begin = await self._open()
        except BaseException as exc:
            self._ended(exc)
            raise
        if begin is False:  # described anew, and no longer detached: the generic path
            return await call.stream()
        try:
            result = await call.next_handler()
            if isinstance(result, ChatResponse):  # a value, not an item: its copy goes in InnerDone
                call.inner_result = result
                async for _ in self.flow(begin, _nothing()):
                    pass
                return result
        except Exception as exc:
            if begin:  # its copies end with the error
                delivery = DetachedDelivery(call)
                delivery.add(begin)
                delivery.add(call._error_message(exc))
                delivery.end()
            self._ended(exc)
            raise
        except BaseException as exc:
            self._ended(exc)
            raise
        return self.flow(begin, result)

    async def _open(self) -> hooks_pb2.HostMessage | Literal[False] | None:
        """The Begin; None when the middleware is bypassed (it is being described again, in the
        background: copies go nowhere meanwhile), False when the hook is not detached any more."""
        call, mw, name = self.call, self.call.mw, self.call.spec.name
        self.started = metrics.hook_started()
        if mw.needs_describe():
            _outbox(mw).describe(mw)
            if not mw.described or mw.outage:  # until it is described again: bypassed, counted
                why = mw.outage or "being described again after a failure"
                metrics.hook_failed(mw, name, MiddlewareFailure(mw.name, name, why), bypassed=True)
                return None
        call.table = mw.tables.get(name)
        if call.table is None:  # the server no longer implements this hook (it was restarted)
            return None
        if not call.table.detached:
            return False
        call.generation = 1  # the inner pipeline is called once
        return call._begin()

    async def flow(self, begin: Any = _UNOPENED, inner: Any = None, *, own: bool = True) -> AsyncIterator[Any]:
        """The inner pipeline's items, with copies of the subscribed ones sent in the background;
        ``begin`` None: no copies at all. Unopened: it opens the invocation and calls the inner
        pipeline itself. ``own``: it ends the invocation's metrics and span (the generic path,
        which calls it too, does that itself)."""
        call = self.call
        error: BaseException | None = None
        delivery: DetachedDelivery | None = None
        try:
            if begin is _UNOPENED:
                begin = await self._open()
                if begin is False:
                    own = False  # the generic path's guard does
                    async for item in call._guarded():
                        yield item
                    return
                inner = call.next_handler()
            async with closing(inner):
                if not begin:  # bypassed: nothing to copy
                    async for item in inner:
                        yield item
                    return
                call.generation = 1
                delivery = DetachedDelivery(call)
                delivery.add(begin)
                table = call.table
                assert table is not None
                copy, bypass = call._item_message, Mode.BYPASS
                # table.mode_of, inlined: a call per streamed item is a measurable part of the cost
                by_class, default, chat = table.by_class.get, table.default, (table.chat_delta, table.chat_final)
                async for item in inner:
                    cls = type(item)
                    if (chat[item.is_last] if cls is ChatResponse else by_class(cls, default)) is not bypass:
                        delivery.add(copy(item, observed=True))
                    yield item
        except Exception as exc:
            error = exc
            if delivery is not None:
                delivery.add(call._error_message(exc))
                delivery.end()
            raise
        except GeneratorExit:  # the consumer had what it needed (e.g. the ToolResponse): a normal end
            if delivery is not None:
                delivery.add(call._done_message())
                delivery.end()
            raise
        except BaseException as exc:  # cancelled half-way
            error = exc
            if delivery is not None:
                delivery.abandon()
            raise
        else:
            if delivery is not None:
                delivery.add(call._done_message())
                delivery.end()
        finally:
            if own:
                self._ended(error)

    def _ended(self, exc: BaseException | None) -> None:
        call = self.call
        tracing.end_hook_span(call.span, exc)
        metrics.hook_ended(call.mw, call.spec.name, self.started, exc, served=False)


async def _nothing() -> AsyncIterator[Any]:
    return
    yield
