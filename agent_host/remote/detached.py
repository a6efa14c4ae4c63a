"""Delivery to a detached hook (a watcher): copies go out in batches in the background, so a reply
never waits for a watcher, not even for a write. Envoy ext_proc calls this observability mode.

Copies also stay off the reply's busy stretch: a middleware's finished invocations are held while
another of its detached invocations is still open (its on_reply spans the whole reply) and go out
together when none is, or ``HOLD`` seconds after the first was held, from one task per group.
Sent during the reply, the tracing server's copies made a 1,000-delta reply with 3 tool rounds
end ~10% later (gRPC writes and reads between its steps); held, they cost the same host CPU after
it (``make bench``, docs/tracing.md). A batch that fills up goes out at once (a watcher of every
delta streams).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import grpc

from agentmw.v1 import hooks_pb2

if TYPE_CHECKING:
    from .client import RemoteMiddleware

log = logging.getLogger("agentmw.remote")

BATCH_SIZE = 64  # copies per write
MAX_QUEUED = 64  # batches waiting for a slow watcher before copies are dropped
HOLD = 0.5  # seconds at most that finished invocations wait for the middleware's open ones
_FAILURES = (grpc.aio.AioRpcError, asyncio.InvalidStateError, TimeoutError)
_CLOSED = grpc.aio.UsageError  # the middleware was closed while copies were held: they are dropped


class _Outbox:
    """One middleware's detached invocations on one event loop: how many are open, and the
    finished ones held until none is (or until ``HOLD`` runs out)."""

    __slots__ = ("held", "loop", "open", "timer")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.open = 0
        self.held: list[DetachedDelivery] = []
        self.timer: asyncio.TimerHandle | None = None

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
            _background(group[0].mw, _send_all(group))


def _outbox(mw: RemoteMiddleware) -> _Outbox:
    if mw.outbox is None:  # one per middleware: its channel, and so its deliveries, live on one loop
        mw.outbox = _Outbox(asyncio.get_running_loop())
    return mw.outbox


def _background(mw: RemoteMiddleware, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    task = asyncio.get_running_loop().create_task(coro)
    mw.background.add(task)  # cancelled by mw.close()
    task.add_done_callback(mw.background.discard)
    return task


class DetachedDelivery:
    """The copies of one detached invocation, from its begin to its inner_done."""

    __slots__ = ("batches", "box", "closed", "dropping", "hook", "invocation", "mw", "pending", "task", "wake")

    def __init__(self, mw: RemoteMiddleware, hook: str, invocation: int) -> None:
        self.mw, self.hook, self.invocation = mw, hook, invocation
        self.pending: list[hooks_pb2.HostMessage] = []
        self.batches: list[list[hooks_pb2.HostMessage]] = []  # flushed, not yet written
        self.dropping = False
        self.closed = False  # ended or abandoned on the host's side
        self.task: asyncio.Task[None] | None = None  # its own sender, once a batch filled up
        self.wake: asyncio.Future[None] | None = None  # that sender waiting for more batches
        self.box = _outbox(mw)
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
            self.task = _background(self.mw, self._run())
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
                return

    def _failed(self, call: grpc.aio.StreamStreamCall, exc: BaseException) -> None:
        call.cancel()
        self.mw.bypasses += 1
        self.mw.failed()
        log.warning(
            "detached middleware %r stopped watching %s: %s", self.mw.name, self.hook, str(exc) or type(exc).__name__
        )


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
