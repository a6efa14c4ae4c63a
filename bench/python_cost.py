"""Per-item Python of the host and the SDK for a run_ahead intercepted item, without I/O.

Each side runs over a stream that answers at once (no gRPC, no event-loop waits): the host's
HookCall against a stub middleware that answers every item with emit{forward_seq} + pull, and the
SDK's HookSession against a scripted host; next to them, the minimal protobuf peer's host and
middleware loops (bench/echo_server.py's exchange) over the same stubs. The differences are the
CPU agentmw adds per item on each side, to read next to the spun floor (``/bench.Floor/RunAheadSpun``:
the peer with that much busy work per item on each side, over real gRPC): what such work costs end
to end on the machine. ``python -m bench.python_cost`` prints them.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from agent_host.remote import RemoteMiddleware
from agentmw.codec import codec
from agentmw.hooks import HOOKS
from agentmw.sdk.session import HookSession, HostReader
from agentmw.subscriptions import Mode, SubscriptionTable, subscribe, to_proto
from agentmw.v1 import hooks_pb2

from .echo_server import CREDITS
from .middlewares import InterceptAllRunAhead
from .scenarios import ITEMS, drain, make_agent, reply_chain, reply_events

ON_REPLY = HOOKS["on_reply"]
RUN_AHEAD = subscribe(default=Mode.INTERCEPT, run_ahead=True)


def _answer(msg: hooks_pb2.HostMessage) -> hooks_pb2.MiddlewareMessage:
    """The peer's middleware side: what it answers to one host message (run_ahead)."""
    out = hooks_pb2.MiddlewareMessage(invocation=msg.invocation)
    which = msg.WhichOneof("message")
    if which == "begin":
        out.call_next.credits = CREDITS
    elif which == "item":
        out.actions.add().emit.forward_seq = msg.item.seq
        out.pull.credits, out.pull.answers_seq = CREDITS, msg.item.seq
    else:
        out.finish.SetInParent()
    return out


class _StubMiddleware:
    """A grpc stream call as the host uses it, answered at once by the peer's middleware side (the
    answer parsed from bytes, as grpc hands it over)."""

    def __init__(self) -> None:
        self.answer = b""

    async def write(self, msg: hooks_pb2.HostMessage) -> None:
        self.answer = _answer(msg).SerializeToString()

    async def read(self) -> hooks_pb2.MiddlewareMessage:
        return hooks_pb2.MiddlewareMessage.FromString(self.answer)

    def done(self) -> bool:
        return False

    def cancel(self) -> None:
        pass


class _Described(RemoteMiddleware):
    """A RemoteMiddleware described by hand (on_reply, run_ahead) whose stream is the stub."""

    def __init__(self) -> None:
        super().__init__("127.0.0.1:1")  # never connected
        self.key, self.described = "bench", True
        self.tables = {"on_reply": SubscriptionTable(to_proto(ON_REPLY.number, RUN_AHEAD))}
        self.stub = _StubMiddleware()

    def needs_describe(self) -> bool:
        return False

    def take_stream(self, hook: str) -> tuple[Any, bool]:
        return self.stub, True

    def release_stream(self, hook: str, call: Any) -> None:
        pass


class _ScriptedHost:
    """A servicer context as the SDK uses it: reads one invocation's host messages in order."""

    def __init__(self, messages: list[hooks_pb2.HostMessage]) -> None:
        self.messages: Iterator[hooks_pb2.HostMessage] = iter(messages)
        self.written = 0

    async def read(self) -> hooks_pb2.HostMessage:
        return next(self.messages)

    async def write(self, msg: hooks_pb2.MiddlewareMessage) -> None:
        self.written += 1


@dataclass
class PythonCost:
    """Microseconds of CPU per item, one value per round."""

    host: list[float] = field(default_factory=list)  # agentmw's host
    peer_host: list[float] = field(default_factory=list)  # the peer's host loop
    sdk: list[float] = field(default_factory=list)  # agentmw's SDK
    peer_mw: list[float] = field(default_factory=list)  # the peer's middleware loop

    def above(self) -> tuple[float, float]:
        """(host, SDK): median per-round CPU per item above the peer's side."""
        return (
            statistics.median(a - b for a, b in zip(self.host, self.peer_host, strict=True)),
            statistics.median(a - b for a, b in zip(self.sdk, self.peer_mw, strict=True)),
        )


async def _cpu(op: Callable[[], Awaitable[Any]]) -> float:
    start = time.process_time()
    await op()
    return time.process_time() - start


async def measure(rounds: int) -> PythonCost:
    agent = make_agent()
    events = reply_events(agent, ITEMS)
    n = len(events)
    items = [codec.encode_item(e) for e in events]

    def invocation(number: int) -> list[hooks_pb2.HostMessage]:
        """The host's messages of one invocation: begin, an item each, inner_done."""
        messages = [hooks_pb2.HostMessage(invocation=number, begin=hooks_pb2.Begin())]
        for seq, item in enumerate(items, 1):
            msg = hooks_pb2.HostMessage(invocation=number)
            msg.item.seq, msg.item.inner = seq, 1
            msg.item.item.CopyFrom(item)
            messages.append(msg)
        messages.append(hooks_pb2.HostMessage(invocation=number, inner_done=hooks_pb2.InnerDone(inner=1)))
        return messages

    rm = _Described()
    host_chain, none_chain = reply_chain([rm], events), reply_chain([], events)
    stub = rm.stub
    middleware = InterceptAllRunAhead()

    async def peer_host() -> None:  # the floor's host side (bench/scenarios.py floor_invocation)
        for msg in invocation(1):
            await stub.write(msg)
            await stub.read()

    async def sdk(script: list[hooks_pb2.HostMessage]) -> None:
        context = _ScriptedHost(script)
        reader = HostReader(context)  # type: ignore[arg-type]
        begin = await reader.next_begin()
        assert begin is not None
        await HookSession(middleware, "bench", ON_REPLY, context, reader).run(begin)  # type: ignore[arg-type]

    async def peer_mw(script: list[hooks_pb2.HostMessage]) -> None:  # echo_server's exchange
        context = _ScriptedHost(script)
        for _ in script:
            await context.write(_answer(await context.read()))

    out = PythonCost()
    try:
        for r in range(rounds + 1):  # the first round warms up
            host = await _cpu(lambda: drain(host_chain, agent)) - await _cpu(lambda: drain(none_chain, agent))
            peer = await _cpu(peer_host)
            mine = await _cpu(partial(sdk, invocation(2 * r + 2)))  # the scripts are built before timing
            theirs = await _cpu(partial(peer_mw, invocation(2 * r + 3)))
            if r:
                out.host.append(host / n * 1e6)
                out.peer_host.append(peer / n * 1e6)
                out.sdk.append(mine / n * 1e6)
                out.peer_mw.append(theirs / n * 1e6)
    finally:
        await rm.close()
    return out


if __name__ == "__main__":
    cost = asyncio.run(measure(25))
    host, sdk = cost.above()
    print(f"per item, CPU above the protobuf peer, without I/O: host {host:.1f} µs, SDK {sdk:.1f} µs")
