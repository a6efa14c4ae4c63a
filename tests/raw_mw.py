"""A middleware server that breaks the protocol on purpose, written against the raw gRPC API (as
a server in another language would be). ``python -m tests.raw_mw MODE --address 127.0.0.1:0``.

Modes: garbage (bytes that are no MiddlewareMessage), pull_first (pull before call_next),
bad_forward (forwards an item it never received), foreign_block (removes the user's text block, which it did not add),
unknown_model (asks for a model id the host does not have), negative_iter (sets the ReAct iteration
to -1), summary (sets the compression summary), drop_all (drops the only message of the context,
the user's), early_eof (ends the stream at once),
steal_id (appends a block under the id of the user's own text block), unserved (declares
on_reasoning in Describe without serving it), forward_twice (forwards the item it holds twice),
reply_result (finishes on_reply with a result), seqs (observes every item but the final Msg, and
finishes only if the items were numbered 1, 2, ...; else fails saying what it got), burst (seqs,
and fails unless some message carried several items: a burst of observed copies comes batched),
finish_early (observes every item with one credit, and finishes after the first copy: the host then
holds the next item, taken from the inner pipeline while it waited for credits), describe_hangs
(never answers Describe), preclaim (appends a block under the id of the user's text block before
that enters the context, with its call_next; removes "its" block at the first item, then passes
everything on), hold_first (takes the first item, for a new message the ReplyStartEvent, the message stored by
then; prints "holding the first item, KIND" and for a ReplyStartEvent " of session ID"; answers
nothing more), grants_forever (takes the first item and never answers it, but sends a credit grant
every 0.2 s: busy, not hung), suspends_forever (the same with an empty suspend), empties_forever
(the same with a message of no command and no action), mutates_forever (the same with a message that only sets
its slot), grants_flood (credit grants as fast as it can write them), grants_after_done (passes every
item on, then sends credit grants instead of its finish), break_reused (a pass-through
that breaks a stream the host sends a second begin on, as a dropped connection does; declared
eager_next: break_reused_eager; refuse_reused ends it with RESOURCE_EXHAUSTED instead, the answer of
a live server).
"""

from __future__ import annotations

import argparse
import asyncio

import grpc

from agentmw.v1 import events_pb2, hooks_pb2, hooks_pb2_grpc
from tests.raw_server import serve_raw


class Describe(hooks_pb2_grpc.DescribeServicer):
    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.hooks = [hooks_pb2.HookDescription(hook=hooks_pb2.HOOK_ON_REPLY)]
        if mode == "unserved":
            self.hooks.append(hooks_pb2.HookDescription(hook=hooks_pb2.HOOK_ON_REASONING))
        if mode == "break_reused_eager":
            self.hooks[0].eager_next = True  # the host starts the inner pipeline at begin
        if mode == "finish_early":
            self.hooks[0].default_mode = hooks_pb2.SUBSCRIPTION_MODE_OBSERVE
        if mode in ("seqs", "burst"):
            self.hooks[0].default_mode = hooks_pb2.SUBSCRIPTION_MODE_OBSERVE
            msg = self.hooks[0].subscriptions.add(item_type=events_pb2.ITEM_TYPE_MSG)
            msg.mode = hooks_pb2.SUBSCRIPTION_MODE_INTERCEPT

    async def Describe(self, request, context):
        if self.mode == "describe_hangs":
            await asyncio.Event().wait()
        return hooks_pb2.MiddlewareDescription(key="Raw", protocol_version="v1", hooks=self.hooks)


def forwarded(seq: int) -> hooks_pb2.MiddlewareMessage:
    """The answer of a pass-through to the intercepted item ``seq``: re-emit it, ask for the next."""
    answer = hooks_pb2.MiddlewareMessage(pull=hooks_pb2.Pull(answers_seq=seq))
    answer.actions.add().emit.forward_seq = seq
    return answer


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
        elif mode == "foreign_block":  # remove the user's own text block (in the context once the reply starts)
            begin = hooks_pb2.HostMessage.FromString(first)
            users = begin.begin.input_kwargs.on_reply.message.content[0].text.id
            await context.write(out(hooks_pb2.MiddlewareMessage(call_next=hooks_pb2.CallNext())))
            await context.read()  # ReplyStartEvent
            msg = hooks_pb2.MiddlewareMessage(pull=hooks_pb2.Pull())
            msg.actions.add().mutate.remove_block = users
            await context.write(out(msg))
        elif mode == "unknown_model":
            msg = hooks_pb2.MiddlewareMessage(call_next=hooks_pb2.CallNext())
            msg.actions.add().mutate.set_model = "no-such-model"
            await context.write(out(msg))
        elif mode == "negative_iter":
            msg = hooks_pb2.MiddlewareMessage(call_next=hooks_pb2.CallNext())
            msg.actions.add().mutate.set_cur_iter = -1
            await context.write(out(msg))
        elif mode == "summary":
            msg = hooks_pb2.MiddlewareMessage(call_next=hooks_pb2.CallNext())
            msg.actions.add().mutate.set_summary = "all of it"
            await context.write(out(msg))
        elif mode == "drop_all":
            await context.write(out(hooks_pb2.MiddlewareMessage(call_next=hooks_pb2.CallNext())))
            await context.read()  # ReplyStartEvent: the user message is in the context now
            msg = hooks_pb2.MiddlewareMessage(pull=hooks_pb2.Pull())
            msg.actions.add().mutate.drop_messages = 1
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
        elif mode == "forward_twice":
            await context.write(out(hooks_pb2.MiddlewareMessage(call_next=hooks_pb2.CallNext())))
            seq = hooks_pb2.HostMessage.FromString(await context.read()).item.seq
            msg = hooks_pb2.MiddlewareMessage(pull=hooks_pb2.Pull(answers_seq=seq))
            msg.actions.add().emit.forward_seq = seq
            msg.actions.add().emit.forward_seq = seq
            await context.write(out(msg))
        elif mode == "reply_result":
            await context.write(out(hooks_pb2.MiddlewareMessage(finish=hooks_pb2.Finish(result={"prompt": "x"}))))
        elif mode in ("seqs", "burst"):
            await context.write(out(hooks_pb2.MiddlewareMessage(call_next=hooks_pb2.CallNext(credits=1000))))
            seqs: list[int] = []
            pending: list[hooks_pb2.HostMessage] = []  # a Batch's messages, handled one by one
            largest = 1  # the most items one message carried
            while True:
                if not pending:
                    got = hooks_pb2.HostMessage.FromString(await context.read())
                    pending = list(got.batch.messages) if got.WhichOneof("message") == "batch" else [got]
                    largest = max(largest, len(pending))
                msg = pending.pop(0)
                if msg.WhichOneof("message") != "item":
                    break
                seqs.append(msg.item.seq)
                if not msg.item.observed:  # the final Msg: forward it
                    await context.write(out(forwarded(msg.item.seq)))
            if seqs != list(range(1, len(seqs) + 1)):
                await context.write(out(hooks_pb2.MiddlewareMessage(fail=hooks_pb2.Fail(message=f"seqs {seqs}"))))
            elif mode == "burst" and largest < 2:
                fail = hooks_pb2.Fail(message=f"{len(seqs)} items, each in a message of its own")
                await context.write(out(hooks_pb2.MiddlewareMessage(fail=fail)))
            else:
                await context.write(out(hooks_pb2.MiddlewareMessage(finish=hooks_pb2.Finish())))
        elif mode == "preclaim":
            begin = hooks_pb2.HostMessage.FromString(first)
            claimed = begin.begin.input_kwargs.on_reply.message.content[0].text.id
            msg = hooks_pb2.MiddlewareMessage(call_next=hooks_pb2.CallNext())
            block = msg.actions.add().mutate.append_blocks.blocks.add()
            block.text.id, block.text.text = claimed, "preclaimed"
            await context.write(out(msg))
            while (got := hooks_pb2.HostMessage.FromString(await context.read())).WhichOneof("message") == "item":
                answer = forwarded(got.item.seq)
                if claimed:  # the user's message is in the context now, under the same id
                    answer.actions.add().mutate.remove_block, claimed = claimed, ""
                await context.write(out(answer))
            await context.write(out(hooks_pb2.MiddlewareMessage(finish=hooks_pb2.Finish())))
        elif mode == "finish_early":
            await context.write(out(hooks_pb2.MiddlewareMessage(call_next=hooks_pb2.CallNext(credits=1))))
            await context.read()  # the first item's copy; the host now waits for credits
            await context.write(out(hooks_pb2.MiddlewareMessage(finish=hooks_pb2.Finish())))
        elif mode == "early_eof":
            return
        elif mode in ("grants_forever", "grants_flood", "suspends_forever", "empties_forever", "mutates_forever"):
            # Busy, not hung: after the first item, messages that move nothing, every 0.2 s (a flood:
            # as fast as it can write them).
            await context.write(out(hooks_pb2.MiddlewareMessage(call_next=hooks_pb2.CallNext())))
            await context.read()
            print(f"{mode}: holding the first item", flush=True)
            while True:
                if mode.startswith("grants"):  # a grant, not the answer: answers_seq is another item's
                    await context.write(out(hooks_pb2.MiddlewareMessage(pull=hooks_pb2.Pull(credits=1, answers_seq=0))))
                elif mode == "suspends_forever":  # paused at a yield that emitted nothing; read the resume
                    await context.write(out(hooks_pb2.MiddlewareMessage(suspend=hooks_pb2.Suspend())))
                    await context.read()
                elif mode == "mutates_forever":  # a state change alone: its slot, again and again
                    msg = hooks_pb2.MiddlewareMessage()
                    msg.actions.add().mutate.set_slot.number_value = 1
                    await context.write(out(msg))
                else:  # no command and no action
                    await context.write(out(hooks_pb2.MiddlewareMessage()))
                await asyncio.sleep(0 if mode == "grants_flood" else 0.2)
        elif mode == "grants_after_done":
            # Passes every item on, then, instead of its finish, a credit grant every 0.2 s (a pull
            # after inner_done the host ignores).
            await context.write(out(hooks_pb2.MiddlewareMessage(call_next=hooks_pb2.CallNext())))
            while (got := hooks_pb2.HostMessage.FromString(await context.read())).WhichOneof("message") == "item":
                await context.write(out(forwarded(got.item.seq)))
            print("grants_after_done: the inner pipeline ended", flush=True)
            while True:
                await context.write(out(hooks_pb2.MiddlewareMessage(pull=hooks_pb2.Pull(credits=1))))
                await asyncio.sleep(0.2)
        elif mode in ("break_reused", "break_reused_eager", "refuse_reused"):
            # A pass-through, one invocation per stream: a second begin on the same stream breaks it,
            # as a connection that dropped does (a restarted server whose idle streams the host kept).
            if mode != "break_reused_eager":  # (declared eager_next, the host starts the inner pipeline)
                await context.write(out(hooks_pb2.MiddlewareMessage(call_next=hooks_pb2.CallNext())))
            while (got := hooks_pb2.HostMessage.FromString(await context.read())).WhichOneof("message") == "item":
                await context.write(out(forwarded(got.item.seq)))
            await context.write(out(hooks_pb2.MiddlewareMessage(finish=hooks_pb2.Finish())))
            if await context.read() is grpc.aio.EOF:
                return
            print("breaking a reused stream", flush=True)
            if mode == "refuse_reused":  # an answer of a live server, not a dropped connection
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no more streams for you")
            await context.abort(grpc.StatusCode.UNAVAILABLE, "Connection reset by peer")
        elif mode == "hold_first":
            await context.write(out(hooks_pb2.MiddlewareMessage(call_next=hooks_pb2.CallNext())))
            item = hooks_pb2.HostMessage.FromString(await context.read()).item.item
            kind = item.WhichOneof("item")
            session = f" of session {item.reply_start.session_id}" if kind == "reply_start" else ""
            print(f"holding the first item, {kind}{session}", flush=True)
        await asyncio.sleep(30)  # the host must give up on its own

    return grpc.stream_stream_rpc_method_handler(run, request_deserializer=None, response_serializer=None)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode")
    parser.add_argument("--address", default="127.0.0.1:0")
    args = parser.parse_args()
    handlers = {"agentmw.v1.OnReply": on_reply(args.mode)}
    await serve_raw(f"raw middleware {args.mode}", args.address, Describe(args.mode), handlers)


if __name__ == "__main__":
    asyncio.run(main())
