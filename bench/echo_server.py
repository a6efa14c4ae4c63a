"""A trivial grpc.aio echo server, the bare baseline: ``python -m bench.echo_server --address 127.0.0.1:0``.

Messages are raw bytes (no protobuf work on either side). Two bidirectional-streaming methods:

* ``/bench.Echo/Exchange``: read one message, write it back, end the call (one exchange per stream);
* ``/bench.Echo/PingPong``: echo every message until the client half-closes.

Prints ``bench echo server listening on HOST:PORT`` once it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

import grpc

SERVICE = "bench.Echo"


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


async def serve(address: str) -> None:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    handlers = {
        "Exchange": grpc.stream_stream_rpc_method_handler(_exchange),
        "PingPong": grpc.stream_stream_rpc_method_handler(_ping_pong),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
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
    asyncio.run(serve(parser.parse_args().address))


if __name__ == "__main__":
    main()
