"""An on_reply middleware that forwards a reply but forges one thing in it, written against the raw
gRPC API like tests/raw_mw.py. ``python -m tests.forger_mw MODE --address 127.0.0.1:0``.

Every mode follows the protocol to the letter (call_next, emit + pull per intercepted item,
finish at inner_done); what it emits breaks the reply's event grammar:

confirm_unknown  a RequireUserConfirmEvent for a tool call that does not exist, before the end
second_end       the ReplyEndEvent, then a copy of it
foreign_start    the ReplyStartEvent replaced by one with another reply's id
stray_delta      a TextBlockDeltaEvent for a block never started, after the start
foreign_delta    every TextBlockDeltaEvent replaced by one naming another reply (its block is open)
start_twice      every TextBlockStartEvent twice
left_open        a TextBlockStartEvent never ended, before the ReplyEndEvent
no_next          finish at once, without calling next (nothing at all reaches the client)
"""

from __future__ import annotations

import argparse
import asyncio

import grpc

from agentmw.v1 import events_pb2, hooks_pb2, hooks_pb2_grpc, types_pb2
from tests.raw_server import serve_raw

MODES = (
    "confirm_unknown",
    "second_end",
    "foreign_start",
    "stray_delta",
    "foreign_delta",
    "start_twice",
    "left_open",
    "no_next",
)


class Describe(hooks_pb2_grpc.DescribeServicer):
    async def Describe(self, request, context):
        return hooks_pb2.MiddlewareDescription(
            key="Forger", protocol_version="v1", hooks=[hooks_pb2.HookDescription(hook=hooks_pb2.HOOK_ON_REPLY)]
        )


def forge(mode: str, seq: int, item: events_pb2.Item, reply_id: str) -> list[hooks_pb2.Action]:
    """The actions answering intercepted item ``seq``: forward it, plus or instead of the forgery."""
    kind = item.WhichOneof("item")
    forward = hooks_pb2.Action(emit=hooks_pb2.Emit(forward_seq=seq))

    def emit(**fields) -> hooks_pb2.Action:
        return hooks_pb2.Action(emit=hooks_pb2.Emit(item=events_pb2.Item(**fields)))

    if mode == "confirm_unknown" and kind == "reply_end":
        call = types_pb2.ToolCallBlock(id="no-such-call", name="add", input="{}")
        return [
            emit(require_user_confirm=events_pb2.RequireUserConfirmEvent(reply_id=reply_id, tool_calls=[call])),
            forward,
        ]
    if mode == "second_end" and kind == "reply_end":
        return [forward, emit(reply_end=item.reply_end)]
    if mode == "foreign_start" and kind == "reply_start":
        start = events_pb2.ReplyStartEvent()
        start.CopyFrom(item.reply_start)
        start.reply_id = "another-reply"
        return [emit(reply_start=start)]
    if mode == "stray_delta" and kind == "reply_start":
        delta = events_pb2.TextBlockDeltaEvent(reply_id=reply_id, block_id="nowhere", delta="boo")
        return [forward, emit(text_block_delta=delta)]
    if mode == "foreign_delta" and kind == "text_block_delta":
        delta = events_pb2.TextBlockDeltaEvent()
        delta.CopyFrom(item.text_block_delta)
        delta.reply_id = "another-reply"
        return [emit(text_block_delta=delta)]
    if mode == "start_twice" and kind == "text_block_start":
        return [forward, emit(text_block_start=item.text_block_start)]
    if mode == "left_open" and kind == "reply_end":
        return [emit(text_block_start=events_pb2.TextBlockStartEvent(reply_id=reply_id, block_id="dangling")), forward]
    return [forward]


def on_reply(mode: str):
    async def run(request_iterator, context):
        while (raw := await context.read()) != grpc.aio.EOF:  # one invocation per begin
            begin = hooks_pb2.HostMessage.FromString(raw)
            if begin.WhichOneof("message") != "begin":
                continue  # in flight from an earlier invocation
            invocation = begin.invocation  # echoed on every message (hooks.proto, INVOCATION IDS)
            if mode == "no_next":
                await context.write(
                    hooks_pb2.MiddlewareMessage(invocation=invocation, finish=hooks_pb2.Finish()).SerializeToString()
                )
                continue
            await context.write(
                hooks_pb2.MiddlewareMessage(invocation=invocation, call_next=hooks_pb2.CallNext()).SerializeToString()
            )
            reply_id = begin.begin.context.reply_id
            while (raw := await context.read()) != grpc.aio.EOF:
                msg = hooks_pb2.HostMessage.FromString(raw)
                if msg.WhichOneof("message") != "item":  # inner_done (or inner_error: give up)
                    await context.write(
                        hooks_pb2.MiddlewareMessage(
                            invocation=invocation, finish=hooks_pb2.Finish()
                        ).SerializeToString()
                    )
                    break
                item = msg.item.item
                if item.WhichOneof("item") == "reply_start":
                    reply_id = item.reply_start.reply_id
                answer = hooks_pb2.MiddlewareMessage(
                    invocation=invocation, actions=forge(mode, msg.item.seq, item, reply_id), pull=hooks_pb2.Pull()
                )
                await context.write(answer.SerializeToString())

    return grpc.stream_stream_rpc_method_handler(run, request_deserializer=None, response_serializer=None)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("--address", default="127.0.0.1:0")
    args = parser.parse_args()
    handlers = {"agentmw.v1.OnReply": on_reply(args.mode)}
    await serve_raw(f"forger middleware {args.mode}", args.address, Describe(), handlers)


if __name__ == "__main__":
    asyncio.run(main())
