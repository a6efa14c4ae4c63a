"""``agentmw``: operate a running agent host (the AgentHost RPCs and grpc.health.v1).

    agentmw status                                   # host health; attached middleware and their health
    agentmw alive [--timeout 5]                      # the host answers at all (a liveness probe)
    agentmw middleware list
    agentmw middleware attach 127.0.0.1:50071 --name timing [--fail-open] [--timeout 5] [--position 0]
    agentmw middleware detach timing
    agentmw sessions list [--limit 20]
    agentmw sessions show ID
    agentmw sessions delete ID

``--host ADDRESS`` (default: $AGENTMW_HOST, else 127.0.0.1:50070, the host's default listen) and
``--json`` (machine-readable output) go before or after the command; so do agent-chat's TLS flags
and ``--token-file`` (or $AGENTMW_TOKEN) for a secured host (docs/security.md). Exit status: 0 done; 1 the
host is unreachable, NOT_SERVING (status), or refused the request (alive: does not answer within
--timeout, whatever its health); 2 usage.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent_host.config import MAX_SECONDS, ConfigError, check_middleware_address, check_seconds
from agentmw.codec import codec
from agentmw.commandline import non_negative
from agentmw.security import CLIENT_MAX_MESSAGE, SecurityError, TlsFiles, bearer_metadata
from agentmw.v1 import host_pb2, host_pb2_grpc
from clients.host_client import CommandLine, add_security_arguments, credentials, tls_note

DEFAULT_HOST = "127.0.0.1:50070"
TIMEOUT = 10.0


class Admin:
    """One host connection; each method is one command and returns what it prints (text or JSON data)."""

    def __init__(self, address: str, tls: TlsFiles | None = None, token: str = "", timeout: float = TIMEOUT) -> None:
        self.address = address
        self.timeout = timeout
        # GetSession carries a whole session: as large as the host's other clients accept
        options = [("grpc.max_receive_message_length", CLIENT_MAX_MESSAGE)]
        if tls is not None and tls.enabled:  # a blocking channel: agentmw.security.channel() is asyncio's
            credentials = tls.channel_credentials()
            self.channel = grpc.secure_channel(address, credentials, options=[*options, *tls.channel_options()])
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        metadata = bearer_metadata(token)  # on every call
        self.stub = _Calls(host_pb2_grpc.AgentHostStub(self.channel), metadata)
        self.health = _Calls(health_pb2_grpc.HealthStub(self.channel), metadata)

    def close(self) -> None:
        self.channel.close()

    def status(self) -> dict[str, Any]:
        reply = self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=self.timeout)
        serving = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return {"host": self.address, "health": serving, "middleware": self.middleware_list()}

    def alive(self) -> dict[str, Any]:
        """The health check answered, SERVING or not: NOT_SERVING (draining, a fail_closed
        middleware or the store down) is a reason not to send replies, not to restart the host;
        a frozen or dead host does not answer (its kernel still accepts the TCP connection)."""
        reply = self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=self.timeout)
        return {"host": self.address, "health": health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}

    def middleware_list(self) -> list[dict[str, Any]]:
        found = self.stub.ListMiddleware(host_pb2.ListMiddlewareRequest(), timeout=self.timeout)
        return [_dict(m) for m in found.middleware]

    def attach(self, address: str, name: str, fail_open: bool, timeout: float, position: int | None) -> dict[str, Any]:
        request = host_pb2.AttachMiddlewareRequest(address=address, name=name, fail_open=fail_open, timeout=timeout)
        if position is not None:
            request.position = position
        return _dict(self.stub.AttachMiddleware(request, timeout=self.timeout + 30))  # Describe may wait

    def detach(self, name: str) -> dict[str, Any]:
        return _dict(self.stub.DetachMiddleware(host_pb2.DetachMiddlewareRequest(name=name), timeout=self.timeout))

    def sessions(self, limit: int) -> list[dict[str, Any]]:
        found = self.stub.ListSessions(host_pb2.ListSessionsRequest(limit=limit), timeout=self.timeout)
        return [_dict(s) for s in found.sessions]

    def session(self, session_id: str) -> dict[str, Any]:
        found = self.stub.GetSession(host_pb2.GetSessionRequest(session_id=session_id), timeout=self.timeout)
        state = codec.decode(found.state)
        return {
            "summary": _dict(found.summary),
            "replying": found.replying,
            "messages": [
                {"role": m.role.value, "name": m.name, "text": m.text, "blocks": [b.type for b in m.content]}
                for m in state.context
            ],
            "pending_tool_calls": [
                {"id": c.id, "name": c.name, "input": c.input} for c in map(codec.decode, found.pending_tool_calls)
            ],
            "middle_context": json.loads(found.middle_context_json or "{}"),
        }

    def delete(self, session_id: str) -> dict[str, Any]:
        found = self.stub.DeleteSession(host_pb2.DeleteSessionRequest(session_id=session_id), timeout=self.timeout)
        return {"session_id": session_id, "deleted": found.deleted}


class _Calls:
    """A stub whose every call carries ``metadata`` (the token)."""

    def __init__(self, stub: Any, metadata: tuple[tuple[str, str], ...]) -> None:
        self._stub, self._metadata = stub, metadata

    def __getattr__(self, method: str) -> Callable[..., Any]:
        call = getattr(self._stub, method)
        return lambda request, **kw: call(request, metadata=self._metadata, **kw)


_INT64 = {getattr(FieldDescriptor, f"TYPE_{t}") for t in ("INT64", "UINT64", "SINT64", "FIXED64", "SFIXED64")}


def _dict(message: Any) -> dict[str, Any]:
    found = MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    _int64_as_numbers(message.DESCRIPTOR, found)
    return found


def _int64_as_numbers(descriptor: Any, found: dict[str, Any]) -> None:
    """MessageToDict writes 64-bit integers as JSON strings (proto3's JSON mapping, for parsers
    whose numbers are doubles); --json prints them as numbers, as every other number, so that
    scripts can compare them (jq's ``.failures > 0``). Nested and repeated messages too."""
    for field in descriptor.fields:
        if field.name not in found:
            continue
        repeated = field.is_repeated
        values = found[field.name] if repeated else [found[field.name]]
        if field.type in _INT64:
            numbers = [int(v) for v in values]
            found[field.name] = numbers if repeated else numbers[0]
        elif field.message_type is not None and not field.message_type.GetOptions().map_entry:
            for value in values:
                if isinstance(value, dict):  # not a well-known type written as a scalar
                    _int64_as_numbers(field.message_type, value)


# ---------------------------------------------------------------------------------------------
# Text output.


def _middleware_lines(found: list[dict[str, Any]]) -> list[str]:
    if not found:
        return ["  (no middleware attached)"]
    out = []
    for i, m in enumerate(found):
        policy = "fail_open" if m["fail_open"] else "fail_closed"
        if m.get("pending"):
            out.append(f"  -. {m['name']} at {m['address']}: not attached yet, {policy}, timeout {m['timeout']:g}s")
            out.append(f"     attached once its server answers; last error: {m['last_error']}")
            continue
        out.append(f"  {i}. {m['name']} at {m['address']}: {m['health'] or '?'}, {policy}, timeout {m['timeout']:g}s")
        out.append(f"     hooks: {', '.join(m['hooks']) or '-'}; tools: {', '.join(m['tools']) or '-'}")
        if m["last_error"]:
            # The last outcome known, not a fresh check: `health` tells whether it can be reached now.
            now = " (no call has succeeded since)" if m["failing"] else ""
            out.append(f"     last error{now} at {m['last_error_at']}: {m['last_error']}")
        if float(m.get("skipped_for", 0)) > 0:
            out.append(
                f"     skipped by every reply for {float(m['skipped_for']):.0f}s more (fail_open; it did not answer)"
            )
        if int(m["failures"]) or int(m["bypasses"]):
            out.append(f"     failed hook calls: {m['failures']}, bypassed: {m['bypasses']}")
    return out


def _text(command: str, result: Any) -> str:
    if command == "status":
        lines = [f"host {result['host']}: {result['health']}", "middleware (outermost first):"]
        return "\n".join(lines + _middleware_lines(result["middleware"]))
    if command == "middleware list":
        return "\n".join(_middleware_lines(result))
    if command == "alive":
        return f"host {result['host']}: answers ({result['health']})"
    if command == "middleware detach":  # it is gone (one waiting to be attached no longer waits)
        return f"detached {result['name']} at {result['address']}"
    if command == "middleware attach":
        return f"attached {result['name']} at {result['address']}\n" + "\n".join(_middleware_lines([result])[1:])
    if command == "sessions list":
        if not result:
            return "(no sessions)"
        rows = [
            f"{s['session_id']}  {s['updated_at']}  {s['message_count']:>4} msgs"
            f"{'  PARKED' if s['parked'] else ''}  {s['title']}"
            for s in result
        ]
        return "\n".join(rows)
    if command == "sessions show":
        s = result["summary"]
        flags = (", parked" if s["parked"] else "") + (", replying now" if result["replying"] else "")
        lines = [
            f"session {s['session_id']}: {s['message_count']} messages, created {s['created_at']}, "
            f"updated {s['updated_at']}{flags}"
        ]
        for m in result["messages"]:
            text = m["text"] or f"[{', '.join(m['blocks'])}]"
            lines.append(f"  {m['role']:>9}: {text}")
        for c in result["pending_tool_calls"]:
            lines.append(f"  waiting on {c['name']}({c['input']}) [{c['id']}]")
        if result["middle_context"]:
            lines.append(f"  middle_context: {json.dumps(result['middle_context'], sort_keys=True)}")
        return "\n".join(lines)
    if command == "sessions delete":
        return f"deleted {result['session_id']}" if result["deleted"] else f"no session {result['session_id']}"
    raise AssertionError(command)


# ---------------------------------------------------------------------------------------------
# The command line.


INT32_MAX = 2**31 - 1  # ListSessionsRequest.limit and AttachMiddlewareRequest.position are int32s


def _too_long(value: float, text: str) -> None:
    """check_seconds refused a finite ``value`` above 0: it is beyond MAX_SECONDS (30 days), which
    a gRPC deadline holds (one of ~1e10 s overflows and every call fails at once)."""
    if math.isfinite(value) and value > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"must be {MAX_SECONDS:.0f} seconds (30 days) or less, not {text}")


def _timeout(text: str) -> float:
    """--timeout: 0 (the host's default) or what the host's own rule takes; anything else is a usage
    error here (exit 2), not the host's INVALID_ARGUMENT (exit 1)."""
    value = float(text)  # a ValueError: argparse's "invalid float value"
    if value == 0:
        return value
    try:
        return check_seconds(value, "the timeout")
    except ValueError:
        _too_long(value, text)
        raise argparse.ArgumentTypeError(f"must be 0 (the host's default) or finite and above 0, not {text}") from None


_timeout.__name__ = "float"  # argparse names the type in its errors: "invalid float value"


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be finite and above 0, not {text}") from None
    try:
        return check_seconds(value, "the timeout")
    except ValueError:
        _too_long(value, text)
        raise argparse.ArgumentTypeError(f"must be finite and above 0, not {text}") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    common = CommandLine(add_help=False)
    common.add_argument(
        "--host",
        default=argparse.SUPPRESS,
        help=f"the host's address (default $AGENTMW_HOST, else {DEFAULT_HOST})",
    )
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")
    add_security_arguments(common)
    parser = CommandLine(prog="agentmw", description="Operate a running agentmw host.", parents=[common])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("status", parents=[common], help="host health and attached middleware")
    alive = commands.add_parser(
        "alive", parents=[common], help="exit 0 if the host answers its health check, SERVING or not (liveness)"
    )
    alive.add_argument("--timeout", type=_seconds, default=5.0, help="seconds to wait for the answer (default 5)")

    mw = commands.add_parser("middleware", parents=[common], help="list, attach or detach middleware")
    mw_commands = mw.add_subparsers(dest="action", required=True, metavar="ACTION")
    mw_commands.add_parser("list", parents=[common], help="the attached middleware, outermost first")
    attach = mw_commands.add_parser("attach", parents=[common], help="attach a middleware server by address")
    attach.add_argument("address", help="HOST:PORT or a gRPC target name (dns:, unix:, ...)")
    attach.add_argument("--name", default="", help="default: the middleware's key")
    attach.add_argument("--fail-open", action="store_true", help="skip it when it fails instead of failing replies")
    attach.add_argument("--timeout", type=_timeout, default=0.0, help="seconds per message (default: the host's)")
    attach.add_argument(
        "--position",
        type=non_negative(int, INT32_MAX),
        help="onion position, 0 = outermost (default: innermost)",
    )
    detach = mw_commands.add_parser("detach", parents=[common], help="detach a middleware by name")
    detach.add_argument("name")

    sessions = commands.add_parser("sessions", parents=[common], help="list, show or delete sessions")
    s_commands = sessions.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = s_commands.add_parser("list", parents=[common], help="sessions, most recently updated first")
    listing.add_argument(
        "--limit", type=non_negative(int, INT32_MAX), default=0, help="at most this many (default 0: all)"
    )
    show = s_commands.add_parser("show", parents=[common], help="one session: messages, pending calls, slots")
    show.add_argument("session_id")
    delete = s_commands.add_parser("delete", parents=[common], help="delete a session")
    delete.add_argument("session_id")

    args = parser.parse_args(argv)
    if args.command == "middleware" and args.action == "attach":
        try:  # the host would only say the address is not allowed: say what is wrong with it
            check_middleware_address(args.address, "address")
        except ConfigError as exc:
            attach.error(str(exc))
    args.host = getattr(args, "host", None) or os.environ.get("AGENTMW_HOST") or DEFAULT_HOST
    args.json = getattr(args, "json", False)
    return args


def _connected(channel: grpc.Channel) -> bool:
    """Whether the host is reachable: then an UNAVAILABLE came from the host itself (say, a
    middleware it could not attach) and its own words are printed, not "cannot reach the host"."""
    try:
        grpc.channel_ready_future(channel).result(timeout=0.5)
    except grpc.FutureTimeoutError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = f"{args.command} {args.action}" if getattr(args, "action", None) else args.command
    try:
        admin = Admin(args.host, *credentials(args), timeout=args.timeout if command == "alive" else TIMEOUT)
    except SecurityError as exc:
        print(f"agentmw: {exc}", file=sys.stderr)
        return 2
    run: dict[str, Callable[[], Any]] = {
        "status": admin.status,
        "alive": admin.alive,
        "middleware list": admin.middleware_list,
        "middleware attach": lambda: admin.attach(args.address, args.name, args.fail_open, args.timeout, args.position),
        "middleware detach": lambda: admin.detach(args.name),
        "sessions list": lambda: admin.sessions(args.limit),
        "sessions show": lambda: admin.session(args.session_id),
        "sessions delete": lambda: admin.delete(args.session_id),
    }
    try:
        result = run[command]()
    except grpc.RpcError as exc:
        code = exc.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and not _connected(admin.channel):
            what = f"cannot reach the host at {args.host} ({code.name}{tls_note(exc, args, '; {}')})"
        else:
            what = f"{args.host}: {code.name}: {exc.details()}"
        if args.json:
            print(json.dumps({"error": what, "code": code.name}))
        print(f"agentmw: {what}", file=sys.stderr)
        return 1
    finally:
        admin.close()
    try:
        print(json.dumps(result, indent=2, ensure_ascii=False) if args.json else _text(command, result))
        sys.stdout.flush()
    except BrokenPipeError:  # `agentmw ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    if command == "sessions delete" and not result["deleted"]:
        return 1
    return 0 if command != "status" or result["health"] == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
