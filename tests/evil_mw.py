"""A scriptable misbehaving middleware, written against the raw gRPC API from the protos (as a
server in another language would be): ``python -m tests.evil_mw --scripts DIR --address 127.0.0.1:0``.

Per invocation it looks up ``DIR/<session id>.json`` (the begin's context.session_id); without
one it behaves: a pass-through that intercepts every item (on_system_prompt returns the prompt,
on_check_permission the inner decision). A script is a JSON object:

* ``hooks``: the hooks it applies to (default: all it implements); in the others it behaves.

* ``messages``: MiddlewareMessages (protobuf JSON) sent right after the begin, in order, without
  waiting for answers; then a finish, so the invocation always ends. Each may carry ``"_id"``:
  ``"current"`` (default), ``"previous"``, ``"next"`` or ``"zero"`` for its invocation field.
* ``after``: behave, and once finished send these messages (for the next invocation to receive).
* ``at_done``: behave, and at inner_done send these messages before the finish (what a hook
  declared done_with_inner must not do); ``no_finish``: then never send the finish at all.
* ``flood``: behave until the first intercepted item, then emit CustomEvents without end (``size``
  bytes of value each, default small), until the host cancels the stream; then write
  ``DIR/<session id>.cancelled``.
* ``stop_reading``: read nothing after the begin and never answer.
* ``stop_after_next``: call next with credits for 100,000 observed copies, then read nothing more
  (with ``--default-mode observe``: a watcher whose copies pile up in the stream).
* ``exit_after_next``: call next, then the whole server process exits at once (killed mid-reply).

Flags: ``--hooks on_reply,on_acting`` (the hooks it implements, intercepting everything),
``--max-concurrent-rpcs N`` (a server that serves only N streams at a time), ``--max-streams N``
(HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS: further streams queue in the client), ``--tools FILE`` (a
JSON list of ToolDescriptor objects served by ListTools, read at each call; while ``FILE.hang``
exists, ListTools never answers, while ``FILE.garbage`` exists it answers bytes that do not parse;
each tool streams chunks without end, but those named ``huge`` (one chunk of 3 MB), ``garbage``
(a chunk that does not parse), ``running`` (a response in state RUNNING) and ``progress_text`` (a
chunk whose metadata.mcp_progress is a string) do not), ``--done-with-inner`` and ``--cacheable``
(declare every hook so), ``--default-mode observe`` (every item observed), ``--describe-delay S``
(Describe answers after S seconds: a server that answers, slowly), ``--detached-while FILE``
(while FILE exists, Describe declares every hook detached: a new version rolled out),
``--garbage-describe`` (Describe answers bytes that do not parse).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format

from agentmw.hooks import HOOKS
from agentmw.v1 import events_pb2, hooks_pb2, hooks_pb2_grpc, types_pb2
from tests.raw_server import serve_raw, wire

GARBAGE = b"\xff\xff\xff\xff"  # no message of any kind parses from it


def _msg(**fields: Any) -> hooks_pb2.MiddlewareMessage:
    return json_format.ParseDict(fields, hooks_pb2.MiddlewareMessage())


class Invocation:
    def __init__(self, context: grpc.aio.ServicerContext, scripts: Path | None, hook: str) -> None:
        self.context, self.scripts, self.hook = context, scripts, hook
        self.id = 0

    async def send(self, msg: hooks_pb2.MiddlewareMessage, which: str = "current") -> None:
        msg.invocation = {"current": self.id, "previous": max(self.id - 1, 0), "next": self.id + 1, "zero": 0}[which]
        await self.context.write(msg)

    def script(self, begin: hooks_pb2.Begin) -> dict[str, Any]:
        if self.scripts is None or not begin.context.session_id:
            return {}
        path = self.scripts / f"{begin.context.session_id}.json"
        script = json.loads(path.read_text()) if path.exists() else {}
        return script if self.hook in script.get("hooks", [self.hook]) else {}

    async def run(self, begin: hooks_pb2.HostMessage) -> bool:
        """One invocation; False when the stream is no longer usable."""
        self.id = begin.invocation
        script = self.script(begin.begin)
        if script.get("stop_reading"):
            await asyncio.sleep(3600)
        if script.get("exit_after_next"):
            await self.send(_msg(callNext={"credits": 32}))
            await asyncio.sleep(0.1)  # the call_next goes out first
            os._exit(1)
        if script.get("stop_after_next"):
            await self.send(_msg(callNext={"credits": 100_000}))
            await asyncio.sleep(3600)
        if "messages" in script:
            for raw in script["messages"]:
                raw = dict(raw)
                which = raw.pop("_id", "current")
                await self.send(_msg(**raw), which)
            await self.send(_msg(finish={}))
            return True
        if self.hook == "on_system_prompt":  # a transformer (no inner pipeline): the prompt unchanged
            await self.send(_msg(finish={"result": {"prompt": begin.begin.input_kwargs.on_system_prompt.prompt}}))
            return True
        await self.send(_msg(callNext={"credits": 32}))
        while True:
            msg = await self.context.read()
            if msg is grpc.aio.EOF:
                return False
            if msg.WhichOneof("message") == "batch":
                msg = msg.batch.messages[-1]
            if msg.invocation != self.id:
                continue
            which = msg.WhichOneof("message")
            if which == "item" and not msg.item.observed:
                if "flood" in script:
                    await self.flood(script["flood"], begin.begin.context.session_id)
                    return False
                reply = _msg(pull={})
                reply.actions.add().emit.forward_seq = msg.item.seq
                await self.send(reply)
            elif which == "inner_done":
                for raw in script.get("at_done", []):
                    await self.send(_msg(**raw))
                if script.get("no_finish"):
                    await asyncio.sleep(3600)
                finish = _msg(finish={})
                if self.hook == "on_check_permission":  # its finish carries the decision: the inner one
                    finish.finish.result.CopyFrom(msg.inner_done.result)
                await self.send(finish)
                for raw in script.get("after", []):
                    raw = dict(raw)
                    which = raw.pop("_id", "current")
                    await self.send(_msg(**raw), which)
                return True
            elif which == "inner_error":
                await self.send(_msg(fail={"fromInner": True}))
                return True

    async def flood(self, spec: dict[str, Any], session_id: str) -> None:
        value = "x" * int(spec.get("size", 8))
        n = 0
        try:
            while True:
                msg = _msg()
                event = msg.actions.add().emit.item.custom
                event.name, event.id, event.created_at = "flood", f"f{n}", "2026-01-01T00:00:00Z"
                event.value.update({"n": n, "pad": value})
                await self.send(msg)
                n += 1
        finally:
            if self.scripts is not None:
                (self.scripts / f"{session_id}.cancelled").write_text(str(n))


def hook_handler(scripts: Path | None, hook: str) -> grpc.RpcMethodHandler:
    async def run(request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        inv = Invocation(context, scripts, hook)
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError, asyncio.CancelledError):
            while (msg := await context.read()) is not grpc.aio.EOF:
                if msg.WhichOneof("message") == "batch":
                    msg = msg.batch.messages[0]
                if msg.WhichOneof("message") == "begin" and not await inv.run(msg):
                    return

    return grpc.stream_stream_rpc_method_handler(
        run,
        request_deserializer=hooks_pb2.HostMessage.FromString,
        response_serializer=hooks_pb2.MiddlewareMessage.SerializeToString,
    )


class Describe(hooks_pb2_grpc.DescribeServicer):
    def __init__(
        self,
        hooks: list[str],
        tools: bool,
        *,
        done_with_inner: bool = False,
        cacheable: bool = False,
        default_mode: int = 0,
        key: str = "Evil",
        delay: float = 0.0,
        detached_while: Path | None = None,
        garbage: bool = False,
    ) -> None:
        self.delay, self.detached_while, self.garbage = delay, detached_while, garbage
        self.description = hooks_pb2.MiddlewareDescription(key=key, protocol_version="v1", provides_tools=tools)
        for hook in hooks:
            self.description.hooks.add(
                hook=HOOKS[hook].number,  # type: ignore[arg-type]
                done_with_inner=done_with_inner,
                cacheable=cacheable,
                default_mode=default_mode,  # type: ignore[arg-type]
            )

    async def Describe(self, request: Any, context: Any) -> hooks_pb2.MiddlewareDescription | bytes:
        await asyncio.sleep(self.delay)
        if self.garbage:
            return GARBAGE
        if self.detached_while is None or not self.detached_while.exists():
            return self.description
        detached = hooks_pb2.MiddlewareDescription()
        detached.CopyFrom(self.description)
        for hook in detached.hooks:
            hook.detached = True
        return detached


class ToolSource(hooks_pb2_grpc.ToolSourceServicer):
    def __init__(self, path: Path) -> None:
        self.path = path

    async def ListTools(self, request: Any, context: Any) -> types_pb2.ToolDescriptorList | bytes:
        while self.path.with_suffix(".hang").exists():  # a tool source still warming up
            await asyncio.sleep(0.05)
        if self.path.with_suffix(".garbage").exists():
            return GARBAGE
        out = types_pb2.ToolDescriptorList()
        for raw in json.loads(self.path.read_text()):
            json_format.ParseDict(raw, out.tools.add())
        return out

    async def CallTool(self, request: Any, context: Any) -> Any:
        """Every tool streams text chunks without end (a runaway), until the host cancels the call;
        then ``<tools file>.cancelled`` is written. One named ``huge`` sends one chunk of 3 MB."""
        name = request.tool_call.name
        if name in ("huge", "garbage", "running", "progress_text"):
            chunk = events_pb2.Item()
            chunk.tool_chunk.content.add().text.text = "x" * 3_000_000 if name == "huge" else "some"
            if name == "progress_text":
                chunk.tool_chunk.metadata.update({"mcp_progress": "half way"})
            yield GARBAGE if name == "garbage" else chunk
            if name == "running":
                response = events_pb2.Item()
                response.tool_response.state = types_pb2.TOOL_RESULT_STATE_RUNNING
                yield response
            return
        try:
            while True:
                chunk = events_pb2.Item()
                chunk.tool_chunk.content.add().text.text = "more "
                yield chunk
                await asyncio.sleep(0)
        finally:
            self.path.with_suffix(".cancelled").write_text("")


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", default="127.0.0.1:0")
    parser.add_argument("--scripts", type=Path)
    parser.add_argument("--hooks", default="on_reply")
    parser.add_argument("--max-concurrent-rpcs", type=int)
    parser.add_argument("--max-streams", type=int)
    parser.add_argument("--tools", type=Path)
    parser.add_argument("--done-with-inner", action="store_true")
    parser.add_argument("--cacheable", action="store_true")
    parser.add_argument("--default-mode", choices=("intercept", "observe"), default="intercept")
    parser.add_argument("--key", default="Evil")
    parser.add_argument("--describe-delay", type=float, default=0.0)
    parser.add_argument("--detached-while", type=Path)
    parser.add_argument("--garbage-describe", action="store_true")
    args = parser.parse_args()
    options = [] if args.max_streams is None else [("grpc.max_concurrent_streams", args.max_streams)]
    server = grpc.aio.server(maximum_concurrent_rpcs=args.max_concurrent_rpcs, options=options)
    hooks = args.hooks.split(",")
    if args.tools is not None:  # its answers may be bytes (wire)
        source = ToolSource(args.tools)
        methods = {
            "ListTools": grpc.unary_unary_rpc_method_handler(
                source.ListTools, request_deserializer=hooks_pb2.ListToolsRequest.FromString, response_serializer=wire
            ),
            "CallTool": grpc.unary_stream_rpc_method_handler(
                source.CallTool, request_deserializer=hooks_pb2.CallToolRequest.FromString, response_serializer=wire
            ),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("agentmw.v1.ToolSource", methods),))
    handlers = {f"agentmw.v1.{HOOKS[hook].service}": hook_handler(args.scripts, hook) for hook in hooks}
    mode = hooks_pb2.SUBSCRIPTION_MODE_OBSERVE if args.default_mode == "observe" else 0
    describe = Describe(
        hooks,
        args.tools is not None,
        done_with_inner=args.done_with_inner,
        cacheable=args.cacheable,
        default_mode=mode,
        key=args.key,
        delay=args.describe_delay,
        detached_while=args.detached_while,
        garbage=args.garbage_describe,
    )
    await serve_raw("evil middleware", args.address, describe, handlers, server)


if __name__ == "__main__":
    asyncio.run(main())
