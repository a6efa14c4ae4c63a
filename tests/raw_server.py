"""Serving a middleware written against the raw gRPC API (tests/raw_mw.py, forger_mw.py, evil_mw.py):
what every such server does once its handlers exist, as a server in another language would."""

from __future__ import annotations

from typing import Any

import grpc

from agentmw.v1 import hooks_pb2


def wire(msg: Any) -> bytes:
    """An answer as it goes out: a message serialized, or bytes as they are (which need not parse)."""
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


async def serve_raw(
    what: str, address: str, describe: Any, handlers: dict[str, Any], server: grpc.aio.Server | None = None
) -> None:
    """Serve Describe and each ``{"agentmw.v1.OnReply": run_handler}``, print the line the launchers
    wait for, and run until terminated. Describe may answer bytes (``wire``)."""
    server = server or grpc.aio.server()
    answer = grpc.unary_unary_rpc_method_handler(
        describe.Describe, request_deserializer=hooks_pb2.DescribeRequest.FromString, response_serializer=wire
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("agentmw.v1.Describe", {"Describe": answer}),)
    )
    for service, run in handlers.items():
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {"Run": run}),))
    port = server.add_insecure_port(address)
    await server.start()
    print(f"{what} listening on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()
