"""A middleware server that breaks the protocol on purpose, written against the raw gRPC API (as
a server in another language would be). ``python -m tests.raw_mw MODE --address 127.0.0.1:0``.

Modes: garbage (bytes that are no MiddlewareMessage), pull_first (pull before call_next),
bad_forward (forwards an item it never received), foreign_block (removes a block it did not add),
unknown_model (asks for a model id the host does not have), early_eof (ends the stream at once),
steal_id (appends a block under the id of the user's own text block).
"""

from __future__ import annotations

import argparse
import asyncio

import grpc

from agentmw.v1 import hooks_pb2, hooks_pb2_grpc
from tests.raw_server import serve_raw


class Describe(hooks_pb2_grpc.DescribeServicer):
    async def Describe(self, request, context):
        return hooks_pb2.MiddlewareDescription(
            key="Raw", protocol_version="v1", hooks=[hooks_pb2.HookDescription(hook=hooks_pb2.HOOK_ON_REPLY)]
        )


def on_reply(mode: str):
    async def run(request_iterator, context):
        first = await context.read()  # begin
        invocation = hooks_pb2.HostMessage.FromString(first).invocation

        def out(msg: hooks_pb2.MiddlewareMessage) -> bytes:
            msg.invocation = invocation  # echoed on every message (hooks.proto, INVOCATION IDS)
            return msg.SerializeToString()

        if mode == "garbage":
            await context.write(b"\xff\xff\xff\xff not a protobuf")
        elif mode == "pull_first":
            await context.write(out(hooks_pb2.MiddlewareMessage(pull=hooks_pb2.Pull(credits=1))))
        elif mode == "bad_forward":
            await context.write(out(hooks_pb2.MiddlewareMessage(call_next=hooks_pb2.CallNext())))
            await context.read()
            msg = hooks_pb2.MiddlewareMessage(pull=hooks_pb2.Pull())
            msg.actions.add().emit.forward_seq = 99
            await context.write(out(msg))
        elif mode == "foreign_block":
            msg = hooks_pb2.MiddlewareMessage(call_next=hooks_pb2.CallNext())
            msg.actions.add().mutate.remove_block = "not-mine"
            await context.write(out(msg))
        elif mode == "unknown_model":
            msg = hooks_pb2.MiddlewareMessage(call_next=hooks_pb2.CallNext())
            msg.actions.add().mutate.set_model = "no-such-model"
            await context.write(out(msg))
        elif mode == "steal_id":  # claim the id of the user's text block, to remove it later
            begin = hooks_pb2.HostMessage.FromString(first)
            stolen = begin.begin.input_kwargs.on_reply.message.content[0].text.id
            await context.write(out(hooks_pb2.MiddlewareMessage(call_next=hooks_pb2.CallNext())))
            await context.read()  # ReplyStartEvent: the user message is in the context now
            msg = hooks_pb2.MiddlewareMessage(pull=hooks_pb2.Pull())
            block = msg.actions.add().mutate.append_blocks.blocks.add()
            block.text.id, block.text.text = stolen, "mine now"
            await context.write(out(msg))
        elif mode == "early_eof":
            return
        await asyncio.sleep(30)  # the host must give up on its own

    return grpc.stream_stream_rpc_method_handler(run, request_deserializer=None, response_serializer=None)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode")
    parser.add_argument("--address", default="127.0.0.1:0")
    args = parser.parse_args()
    handlers = {"agentmw.v1.OnReply": on_reply(args.mode)}
    await serve_raw(f"raw middleware {args.mode}", args.address, Describe(), handlers)


if __name__ == "__main__":
    asyncio.run(main())
