"""Delivery to a detached hook (a watcher): copies go out in batches from a background task, so a
reply never waits for a watcher, not even for a write. Envoy ext_proc calls this observability mode."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import grpc

from agentmw.v1 import hooks_pb2

if TYPE_CHECKING:
    from .client import RemoteMiddleware

log = logging.getLogger("agentmw.remote")

BATCH_SIZE = 64  # copies per write
MAX_QUEUED = 64  # batches waiting for a slow watcher before copies are dropped


class DetachedDelivery:
    def __init__(self, mw: RemoteMiddleware, hook: str, invocation: int) -> None:
        self.mw, self.hook, self.invocation = mw, hook, invocation
        self.pending: list[hooks_pb2.HostMessage] = []
        self.queue: asyncio.Queue[list[hooks_pb2.HostMessage] | None] = asyncio.Queue(MAX_QUEUED + 1)
        self.dropping = False
        self.task = asyncio.get_running_loop().create_task(self._run())
        mw.background.add(self.task)
        self.task.add_done_callback(mw.background.discard)

    def add(self, msg: hooks_pb2.HostMessage) -> None:
        if not self.dropping:
            self.pending.append(msg)
            if len(self.pending) >= BATCH_SIZE:
                self._flush()

    def end(self) -> None:
        """The invocation is over on the host's side: send the rest, then read its finish."""
        self._flush()
        if self.queue.full():  # a stalled watcher: give up on it rather than on the reply
            self.task.cancel()
        else:
            self.queue.put_nowait(None)

    def abandon(self) -> None:
        """The reply stopped half-way (cancelled): the watcher's stream cannot be reused."""
        self.task.cancel()

    def _flush(self) -> None:
        if not self.pending:
            return
        if self.queue.qsize() >= MAX_QUEUED:
            self.dropping = True
            log.warning("detached middleware %r falls behind in %s: dropping copies", self.mw.name, self.hook)
        else:
            self.queue.put_nowait(self.pending)
        self.pending = []

    async def _run(self) -> None:
        mw = self.mw
        call, _ = mw.take_stream(self.hook)
        try:
            while (batch := await self.queue.get()) is not None:
                msg = (
                    batch[0]
                    if len(batch) == 1
                    else hooks_pb2.HostMessage(batch=hooks_pb2.Batch(messages=batch), invocation=self.invocation)
                )
                async with asyncio.timeout(mw.policy.timeout):
                    await call.write(msg)
            async with asyncio.timeout(mw.policy.timeout):
                while True:
                    answer = await call.read()
                    if answer is grpc.aio.EOF or answer is None:
                        break
                    if answer.invocation != self.invocation:  # sent after an earlier invocation ended
                        mw.stale_messages += 1
                        continue
                    if answer.WhichOneof("command") in ("finish", "fail"):
                        mw.release_stream(self.hook, call)
                        return
            call.cancel()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, TimeoutError) as exc:
            call.cancel()
            mw.bypasses += 1
            mw.failed()
            log.warning("detached middleware %r stopped watching %s: %s", mw.name, self.hook, exc)
        except asyncio.CancelledError:
            call.cancel()
            raise
