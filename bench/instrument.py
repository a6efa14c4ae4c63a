"""Counting, for the passes that check round trips and RPCs (never used in a timed pass).

Host side: ``counting(rm)`` wraps a RemoteMiddleware's per-hook stream stubs and counts streams
opened, messages written (host -> middleware) and read (middleware -> host, each one a wait for the
middleware), with their sizes. Server side: ``server_stats(rm)`` asks the bench middleware's
``bench_stats`` tool how often each hook ran in its own process.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc

from agent_host.remote import RemoteMiddleware
from agentmw.v1 import hooks_pb2, hooks_pb2_grpc

from .middlewares import STATS_TOOL


@dataclass
class Tally:
    streams: int = 0
    writes: int = 0
    reads: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    first: dict[str, Any] = field(default_factory=dict)  # host -> middleware: a copy of the first of each kind

    def __iadd__(self, other: Tally) -> Tally:
        self.streams += other.streams
        self.writes += other.writes
        self.reads += other.reads
        self.bytes_out += other.bytes_out
        self.bytes_in += other.bytes_in
        return self


class _CountingCall:
    """Proxy of a grpc.aio StreamStreamCall that counts what passes through it."""

    def __init__(self, call: Any, tally: Tally) -> None:
        self._call = call
        self._tally = tally

    async def write(self, msg: hooks_pb2.HostMessage) -> None:
        self._tally.writes += 1
        self._tally.bytes_out += msg.ByteSize()
        kind = msg.WhichOneof("message")
        if kind == "item":  # by item kind: "item.text_block_delta", ...
            kind = f"item.{msg.item.item.WhichOneof('item')}"
        if kind not in self._tally.first:
            self._tally.first[kind] = hooks_pb2.HostMessage()
            self._tally.first[kind].CopyFrom(msg)
        await self._call.write(msg)

    async def read(self) -> Any:
        msg = await self._call.read()
        if msg is not grpc.aio.EOF:
            self._tally.reads += 1
            self._tally.bytes_in += msg.ByteSize()
        return msg

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


def _counted_stub(stub: Callable[[], Any], tally: Tally) -> Callable[[], Any]:
    def open_stream() -> _CountingCall:
        tally.streams += 1
        return _CountingCall(stub(), tally)

    return open_stream


@contextmanager
def counting(*middlewares: RemoteMiddleware) -> Iterator[dict[str, Tally]]:
    """Per hook name, the traffic of all given middleware while the block runs. Idle streams are
    dropped before and after: none opened outside is counted, and no counting proxy outlives it."""
    tallies: dict[str, Tally] = {}
    for rm in middlewares:
        rm._drop_idle()
    saved = [(rm, dict(rm.stubs)) for rm in middlewares]
    for rm, stubs in saved:
        for hook, stub in stubs.items():
            rm.stubs[hook] = _counted_stub(stub, tallies.setdefault(hook, Tally()))
    try:
        yield tallies
    finally:
        for rm, stubs in saved:
            rm._drop_idle()
            rm.stubs.clear()
            rm.stubs.update(stubs)


async def server_stats(rm: RemoteMiddleware, *, reset: bool = True) -> dict[str, dict[str, int]]:
    """``{"calls": {hook: n}, "items": {hook: n}}`` as counted inside the middleware process."""
    stub = hooks_pb2_grpc.ToolSourceStub(rm.channel)
    request = hooks_pb2.CallToolRequest()
    request.tool_call.name = STATS_TOOL
    request.tool_input.update({"reset": reset})
    text = ""
    async for item in stub.CallTool(request, timeout=10):
        if item.WhichOneof("item") == "tool_response":
            text = "".join(block.text.text for block in item.tool_response.content)
    return json.loads(text)
