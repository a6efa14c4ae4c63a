"""HTTP/2 keepalive as the host and the servers agree on it.

A gRPC server left at its defaults (C-core, grpc-go, grpc-java alike) takes a ping that comes less
than 5 minutes after the previous one, with no data sent in between, as abuse; after two of them it
sends GOAWAY ``too_many_pings`` and closes the connection, with every stream on it. The host keeps
streams open between calls (reused for the next invocation) and during long quiet stretches of one
(an on_reply open while a tool runs for minutes), so a host pinging every 30 s had its connections
to idle default servers torn down after about 90 s, and with them any invocation in flight.

So the host pings no more often than any default server allows, and our own servers (the SDK's
``serve()``, the host's service, the bench's floors) accept pings from every 10 s, also on a
connection without calls, for clients that want to notice a dead peer sooner.
"""

from __future__ import annotations

import socket
from typing import Any

# The host's ping interval on a quiet connection: over the 5-minute floor of default servers, with
# a margin for timer jitter (a ping a millisecond early is already a strike).
HOST_KEEPALIVE_MS = 330_000

# The largest message the host and a middleware send each other (hooks.proto, conventions): a
# Begin carries a session's whole context, which grows past gRPC's default of 4 MiB.
MAX_MESSAGE = 64 * 1024 * 1024
# Both ways, for a channel or a server.
MESSAGE_SIZE_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
]

# The trailing metadata key of an UNAVAILABLE a server sends itself ("not ready yet": hooks.proto,
# ListTools), which a connection that broke cannot carry: the host tells the two apart by it.
NOT_READY = "agentmw-not-ready"

# The options every server of ours starts with (gRPC channel arguments): one process per port (a
# second server on a taken port fails to bind instead of sharing it), and the pings it accepts.
SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.so_reuseport", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


def check_listen_address(address: str, *, unix: bool = True) -> str:
    """``address`` if a gRPC server can listen on it as given: ``HOST:PORT`` with a port of 0-65535
    (0: any free port), or (``unix``) a ``unix:`` / ``unix-abstract:`` socket; else a ValueError.
    Checked before binding: gRPC takes a larger port modulo 65536 (``:99999`` listens on 34463)
    instead of refusing it."""
    if unix and address.startswith(("unix:", "unix-abstract:")):
        return address
    host, sep, port = address.rpartition(":")
    if not (sep and host and port.isascii() and port.isdigit() and int(port) <= 65535):  # isdigit() takes '²'
        raise ValueError(f"{address!r} is not HOST:PORT (a port of 0-65535; 0: any free port)")
    return address


class CannotListen(OSError):
    """The address is malformed, or cannot be bound (in use, not an address of this machine)."""


def bind_refused(address: str) -> OSError | None:
    """Why the system refuses ``HOST:PORT`` (a port above 0) to every address the host resolves to,
    as gRPC would bind it, or None when one of them binds (or it cannot tell: gRPC decides). The
    probe sets SO_REUSEPORT, so it refuses nothing gRPC would take, with or without the option."""
    host, _, port = address.rpartition(":")
    if address.startswith(("unix:", "unix-abstract:")) or not (port.isascii() and port.isdigit()) or int(port) == 0:
        return None
    try:
        found = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return None  # a name that does not resolve: gRPC's resolver says so
    refused = None
    for family, kind, proto, _, sockaddr in found:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
            if hasattr(socket, "SO_REUSEPORT"):
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                refused = exc
                continue
        return None
    return refused


def listen(server: Any, address: str, credentials: Any = None) -> int:
    """Add ``address`` to a gRPC server (sync or aio; TLS with ``credentials``) and return the bound
    port, or raise CannotListen saying why: the one way every server of ours binds (the SDK's
    ``serve()``, the host, the trace viewer)."""
    try:
        check_listen_address(address)
    except ValueError as exc:
        raise CannotListen(str(exc)) from None
    # Asked first: gRPC's C core would log its own "Failed to add port" line to stderr before our
    # one line, and its exception does not say why (in use, not an address of this machine).
    refused = bind_refused(address)
    if refused is not None:
        raise CannotListen(f"cannot listen on {address} ({(refused.strerror or str(refused)).lower()})")
    try:
        if credentials is not None:
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:  # grpcio >= 1.5x raises where older ones returned 0
        port = 0
    if port == 0:
        raise CannotListen(f"cannot listen on {address} (address in use or not local)")
    return int(port)
