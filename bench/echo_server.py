"""The floors: ``python -m bench.echo_server --address 127.0.0.1:0 [--loop asyncio|uvloop]``.

A trivial grpc.aio echo server, the bare baseline: messages are raw bytes (no protobuf work on
either side). Two bidirectional-streaming methods:

* ``/bench.Echo/Exchange``: read one message, write it back, end the call (one exchange per stream);
* ``/bench.Echo/PingPong``: echo every message until the client half-closes.

And the minimal protobuf peer: the protocol's real HostMessage / MiddlewareMessage, decoded and
encoded by grpc, and nothing else (no SDK, no item decoding): it answers exactly as the SDK does
for a pass-through middleware (begin -> call_next; item -> emit{forward_seq} + suspend; resume ->
pull; inner_done -> finish, with the inner result):

* ``/bench.Floor/Lockstep``: the default (suspend after each emit: two round trips per item);
* ``/bench.Floor/RunAhead``: declared run_ahead (emit + pull: one round trip per item);
* ``/bench.Floor/RunAheadSpun``: the same, busy for ``SPIN`` seconds more per item (the bench's host
  side spins as long): how much a few microseconds of per-item work on each side cost on this
  machine, the calibration for agentmw's own per-item work above the peer (bench/python_cost.py).

The peer also serves as a middleware a real host can attach (``agentmw.v1.OnReply`` and
``Describe``: on_reply, every item intercepted; lock-step, or run_ahead with ``--on-reply
run_ahead``), so that the bench can pair the real host with the peer's middleware side, and the
peer's host side with the real SDK: where the time above the floor goes.

Prints ``bench echo server listening on HOST:PORT`` once it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time

import grpc

from agentmw import loops
from agentmw.hooks import HOOKS, PROTOCOL_VERSION
from agentmw.subscriptions import Mode, subscribe, to_proto
from agentmw.transport import SERVER_OPTIONS
from agentmw.v1 import hooks_pb2, hooks_pb2_grpc

SERVICE = "bench.Echo"
FLOOR = "bench.Floor"
CREDITS = 32
SPIN = 5e-6  # seconds of busy work per item on each side of /bench.Floor/RunAheadSpun


def spin(seconds: float) -> None:
    """Busy for ``seconds`` (bounded): CPU work as the per-item Python of a framework would be."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def _exchange(request_iterator: object, context: grpc.aio.ServicerContext) -> None:
    msg = await context.read()
    if msg is not grpc.aio.EOF:
        await context.write(msg)


async def _ping_pong(request_iterator: object, context: grpc.aio.ServicerContext) -> None:
    while True:
        msg = await context.read()
        if msg is grpc.aio.EOF:
            return
        await context.write(msg)


def _floor(suspend: bool, busy: float = 0.0) -> grpc.RpcMethodHandler:
    async def run(request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        Msg = hooks_pb2.MiddlewareMessage
        while True:
            host = await context.read()
            if host is grpc.aio.EOF:
                return
            which, invocation = host.WhichOneof("message"), host.invocation
            if which == "begin":
                out = Msg(invocation=invocation, call_next=hooks_pb2.CallNext(credits=CREDITS))
            elif which == "item":
                if busy:
                    spin(busy)
                seq = host.item.seq
                out = Msg(invocation=invocation, actions=[hooks_pb2.Action(emit=hooks_pb2.Emit(forward_seq=seq))])
                if suspend:
                    out.suspend.SetInParent()
                else:
                    out.pull.credits, out.pull.answers_seq = CREDITS, seq
            elif which == "resume":
                out = Msg(invocation=invocation, pull=hooks_pb2.Pull(credits=CREDITS, answers_seq=seq))
            else:  # inner_done
                out = Msg(invocation=invocation)
                out.finish.result.CopyFrom(host.inner_done.result)
            await context.write(out)

    return grpc.stream_stream_rpc_method_handler(
        run,
        request_deserializer=hooks_pb2.HostMessage.FromString,
        response_serializer=hooks_pb2.MiddlewareMessage.SerializeToString,
    )


class _Describe(hooks_pb2_grpc.DescribeServicer):
    """The peer as a middleware: on_reply, every item intercepted (lock-step, or run_ahead)."""

    def __init__(self, run_ahead: bool) -> None:
        self.run_ahead = run_ahead

    async def Describe(self, request: object, context: object) -> hooks_pb2.MiddlewareDescription:
        hook = to_proto(HOOKS["on_reply"].number, subscribe(default=Mode.INTERCEPT, run_ahead=self.run_ahead))
        return hooks_pb2.MiddlewareDescription(key="bench-floor", protocol_version=PROTOCOL_VERSION, hooks=[hook])


async def serve(address: str, on_reply: str = "lockstep") -> None:
    server = grpc.aio.server(options=SERVER_OPTIONS)
    handlers = {
        "Exchange": grpc.stream_stream_rpc_method_handler(_exchange),
        "PingPong": grpc.stream_stream_rpc_method_handler(_ping_pong),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    floor = {
        "Lockstep": _floor(suspend=True),
        "RunAhead": _floor(suspend=False),
        "RunAheadSpun": _floor(suspend=False, busy=SPIN),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(FLOOR, floor),))
    run_ahead = on_reply == "run_ahead"
    served = floor["RunAhead" if run_ahead else "Lockstep"]
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("agentmw.v1.OnReply", {"Run": served}),))
    hooks_pb2_grpc.add_DescribeServicer_to_server(_Describe(run_ahead), server)
    port = server.add_insecure_port(address)
    await server.start()
    print(f"bench echo server listening on {address.rsplit(':', 1)[0]}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.echo_server")
    parser.add_argument("--address", default="127.0.0.1:0")
    parser.add_argument("--loop", choices=loops.LOOPS, default=None)
    parser.add_argument("--on-reply", choices=("lockstep", "run_ahead"), default="lockstep", help="as a middleware")
    args = parser.parse_args()
    loops.run(serve(args.address, args.on_reply), args.loop)


if __name__ == "__main__":
    main()
