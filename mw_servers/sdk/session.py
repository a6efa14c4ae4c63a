"""HookSession: the middleware's side of one hook invocation (spec: protos/agentmw/v1/hooks.proto).

It runs the author's hook method with an ``agent`` view and a ``next_handler`` that speak the
protocol: iterating the inner pipeline sends call_next / pull, yielding sends emit, state changes
send mutations. Actions are batched into the next command; if the author's code awaits something
else first, they are flushed at the end of the current event-loop turn (so nothing waits).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import grpc

from agent_host.chain import prepend
from agent_host.codec import codec, json_to_value
from agent_host.data import ChatResponse
from agent_host.hooks import HookSpec, Kind
from agent_host.wire import (
    DEFAULT_CREDITS,
    decode_kwargs,
    decode_result,
    encode_kwargs,
    encode_result,
    model_override,
)
from agentmw.v1 import hooks_pb2

from .view import AgentView

WINDOW = DEFAULT_CREDITS  # credits granted per pull for observed items


class InnerPipelineError(Exception):
    """The host's inner pipeline raised; ``type_name`` is its exception class name."""

    def __init__(self, type_name: str, message: str, retryable: bool) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name, self.retryable = type_name, retryable


class HostGone(Exception):
    """The host closed the stream (it was cancelled or went away)."""


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
        self.write_lock = asyncio.Lock()
        self.generation = 0  # inner pipelines started
        self.granted = 0  # credits the host still holds
        self.host_waiting = False  # after an intercepted item the host waits for a command
        self.current: tuple[Any, Any, int] | None = None  # (item, its proto, seq) held now
        self.observed: dict[int, Any] = {}
        self.last_inner_error: InnerPipelineError | None = None
        subscription = middleware.subscription(spec.name)
        self.detached = subscription.detached
        self.eager = subscription.eager_next or subscription.detached  # the host starts next itself

    # -- running the author's code ---------------------------------------------------------------

    async def run(self, message: hooks_pb2.HostMessage) -> None:
        self.invocation = message.invocation
        begin = message.begin
        self.view.refresh(begin.context)
        kwargs = decode_kwargs(self.spec, begin.input_kwargs, complete=True)
        method = getattr(self.mw, self.spec.name)
        kind = self.spec.kind
        try:
            result: Any = None
            if kind is Kind.STREAM:
                async for out in method(agent=self.view, input_kwargs=kwargs, next_handler=self.next_handler):
                    self.emit(out)
            elif kind is Kind.CALL:
                result = await method(agent=self.view, input_kwargs=kwargs, next_handler=self.next_handler)
            elif kind is Kind.MODEL:
                value = await method(agent=self.view, input_kwargs=kwargs, next_handler=self.next_handler)
                if isinstance(value, ChatResponse):
                    self.emit(value)
                else:
                    async for chunk in value:
                        self.emit(chunk)
            else:
                result = await method(self.view, kwargs["prompt"])
            finish = hooks_pb2.MiddlewareMessage()
            finish.finish.SetInParent()
            encode_result(result, finish.finish.result)
            await self.send(finish)
        except HostGone:
            return
        except Exception as exc:
            fail = hooks_pb2.MiddlewareMessage()
            fail.fail.type = type(exc).__name__
            fail.fail.message = str(exc)
            fail.fail.from_inner = exc is self.last_inner_error
            await self.send(fail)

    def next_handler(self, **overrides: Any) -> Any:
        unknown = overrides.keys() - self.spec.params
        if unknown:
            raise TypeError(f"{self.spec.name}: next_handler() got unexpected kwargs {sorted(unknown)}")
        if self.spec.kind is Kind.STREAM:
            return InnerStream(self, overrides)
        return self._call_next_value(overrides)

    async def _call_next_value(self, overrides: dict[str, Any]) -> Any:
        """next_handler of CALL hooks (the inner value) and of on_model_call (a chunk stream)."""
        inner = InnerStream(self, overrides)
        if self.spec.kind is Kind.CALL:
            async for item in inner:
                raise RuntimeError(f"unexpected item {type(item).__name__} in {self.spec.name}")
            return inner.result
        try:
            first = await inner.__anext__()  # call-time errors raise here, as in-process
        except StopAsyncIteration:
            first = None
        return prepend(first, inner)

    # -- outgoing --------------------------------------------------------------------------------

    def emit(self, out: Any) -> None:
        self.sync_slot()
        if self.observed.pop(id(out), None) is out:
            return  # the host already forwarded it
        self._refuse_if_detached(f"emit {type(out).__name__}")
        action = hooks_pb2.Action()
        codec.encode_item(out, action.emit.item)
        current = self.current
        if current is not None and current[0] is out:
            if action.emit.item == current[1]:  # unchanged: point at it instead of resending it
                action.emit.forward_seq = current[2]
            self.current = None
        self._queue(action)

    def mutate(self, mutation: hooks_pb2.Mutation) -> None:
        self._refuse_if_detached("change the agent's state")
        self.sync_slot()
        action = hooks_pb2.Action()
        action.mutate.CopyFrom(mutation)
        self._queue(action)

    def sync_slot(self) -> None:
        changed, value = self.view.state.middle_context.changed()
        if changed:
            self._refuse_if_detached("change its slot")
            action = hooks_pb2.Action()
            json_to_value(value, action.mutate.set_slot)
            self.actions.append(action)

    def _refuse_if_detached(self, what: str) -> None:
        if self.detached:
            raise RuntimeError(f"{self.spec.name} is detached: it can only watch, not {what}")

    def _queue(self, action: hooks_pb2.Action) -> None:
        self.actions.append(action)
        if not self.flush_scheduled:
            self.flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_soon)

    def _flush_soon(self) -> None:
        self.flush_scheduled = False
        if self.actions:
            self.flush_task = asyncio.ensure_future(self.send(hooks_pb2.MiddlewareMessage()))

    async def send(self, msg: hooks_pb2.MiddlewareMessage) -> None:
        """Send pending actions (in order) together with ``msg``'s command."""
        self.sync_slot()
        msg.invocation = self.invocation
        async with self.write_lock:
            if self.actions:
                msg.actions.extend(self.actions)
                self.actions.clear()
            elif msg.WhichOneof("command") is None:
                return
            try:
                await self.ctx.write(msg)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, RuntimeError) as exc:
                raise HostGone(str(exc)) from None

    # -- incoming --------------------------------------------------------------------------------

    async def read(self) -> hooks_pb2.HostMessage:
        """The host's next message of this invocation (copies sent for an earlier one are skipped)."""
        while (msg := await self.reader.read()) is not None:
            if msg.invocation == self.invocation:
                return msg
        raise HostGone("the host closed the stream")


class HostReader:
    """The host's messages on one stream, with batches (hooks.proto, Batch) unpacked in order."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self.context = context
        self.buffer: deque[hooks_pb2.HostMessage] = deque()

    async def read(self) -> hooks_pb2.HostMessage | None:
        """The next message, or None once the host closed the stream."""
        while not self.buffer:
            try:
                msg = await self.context.read()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                return None
            if msg is grpc.aio.EOF:
                return None
            if msg.WhichOneof("message") != "batch":
                return msg
            self.buffer.extend(msg.batch.messages)
        return self.buffer.popleft()

    async def next_begin(self) -> hooks_pb2.HostMessage | None:
        """The next invocation's begin message (None when the host closed the stream). Messages
        still in flight from the previous invocation (observed items it did not read) are skipped."""
        while (msg := await self.read()) is not None:
            if msg.WhichOneof("message") == "begin":
                return msg
        return None


class InnerStream:
    """One call of next_handler: the inner pipeline's items, pulled on demand."""

    def __init__(self, session: HookSession, overrides: dict[str, Any]) -> None:
        self.session = session
        self.overrides = overrides
        self.started = False
        self.done = False
        self.generation = 0
        self.result: Any = None

    def __aiter__(self) -> InnerStream:
        return self

    async def __anext__(self) -> Any:
        s = self.session
        if self.done:
            raise StopAsyncIteration
        if not self.started:
            self.started = True
            s.generation += 1
            self.generation = s.generation
            if s.eager and s.generation == 1:  # the host started this pipeline at begin
                if self.overrides:
                    raise TypeError(f"{s.spec.name} is declared eager_next: its first next_handler() takes no kwargs")
                s.granted, s.host_waiting, s.current = WINDOW, False, None
                return await self._receive()
            msg = hooks_pb2.MiddlewareMessage()
            call_next = msg.call_next
            call_next.credits = WINDOW
            overrides = dict(self.overrides)
            if overrides.get("current_model") is not None:
                overrides["current_model"] = model_override(overrides["current_model"])
            cleared = [k for k, v in overrides.items() if v is None]
            encode_kwargs(s.spec, {k: v for k, v in overrides.items() if v is not None}, call_next.overrides)
            call_next.cleared.extend(cleared)
            s.granted, s.host_waiting, s.current = WINDOW, False, None
            await s.send(msg)
        elif self.generation != s.generation:
            raise RuntimeError("this inner pipeline was replaced by a later next_handler() call")
        elif (s.host_waiting or s.granted <= 0) and not s.detached:  # a detached hook is never waited for
            msg = hooks_pb2.MiddlewareMessage()
            msg.pull.credits = WINDOW
            s.granted, s.host_waiting, s.current = WINDOW, False, None
            await s.send(msg)
        return await self._receive()

    async def _receive(self) -> Any:
        s = self.session
        while True:
            msg = await s.read()
            which = msg.WhichOneof("message")
            body = getattr(msg, which)
            if getattr(body, "inner", self.generation) != self.generation:
                continue  # still in flight from an inner pipeline this middleware abandoned
            if body.HasField("context"):
                s.view.refresh(body.context)
            if which == "item":
                item = codec.decode_item(body.item)
                if body.observed:
                    s.granted -= 1
                    if len(s.observed) > 1024:
                        s.observed.clear()
                    s.observed[id(item)] = item
                else:
                    s.granted, s.host_waiting = 0, True
                    s.current = (item, body.item, body.seq)
                return item
            self.done = True
            s.host_waiting = True  # after inner_done / inner_error the host waits for a command
            if which == "inner_done":
                self.result = decode_result(body.result)
                raise StopAsyncIteration
            if which == "inner_error":
                s.last_inner_error = InnerPipelineError(body.type, body.message, body.retryable)
                raise s.last_inner_error
            raise RuntimeError(f"unexpected {which} from the host")
