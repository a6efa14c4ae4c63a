"""Serving a middleware written against the raw gRPC API (tests/raw_mw.py, forger_mw.py, evil_mw.py):
what every such server does once its handlers exist, as a server in another language would."""

from __future__ import annotations

from typing import Any

import grpc

from agentmw.v1 import hooks_pb2_grpc


async def serve_raw(
    what: str, address: str, describe: Any, handlers: dict[str, Any], server: grpc.aio.Server | None = None
) -> None:
    """Serve Describe and each ``{"agentmw.v1.OnReply": run_handler}``, print the line the launchers
    wait for, and run until terminated."""
    server = server or grpc.aio.server()
    hooks_pb2_grpc.add_DescribeServicer_to_server(describe, server)
    for service, run in handlers.items():
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {"Run": run}),))
    port = server.add_insecure_port(address)
    await server.start()
    print(f"{what} listening on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()
