"""serve(): run a MiddlewareBase as a gRPC middleware server.

Registers one service per implemented hook (all sharing HookSession), Describe, ToolSource,
grpc.health.v1 and (when enabled) server reflection; stops gracefully on SIGTERM / SIGINT.

Security (``ServeSecurity``, docs/security.md), from the environment when serve() is not given it,
so every server built on serve() has it: AGENTMW_MW_TLS_CERT / AGENTMW_MW_TLS_KEY (a TLS port
only), AGENTMW_MW_TLS_CLIENT_CA (then the host must present a certificate signed by it),
AGENTMW_MW_TOKEN or AGENTMW_MW_TOKEN_FILE (then every call but health checks must carry it:
the server accepts only its host), AGENTMW_MW_REFLECTION=1 (server reflection).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from agentmw import loops, tracing
from agentmw.codec import codec, value_to_json
from agentmw.data import TextBlock, ToolCallBlock, ToolChunk, ToolResultState
from agentmw.errors import ConfigError
from agentmw.hooks import HOOKS, PROTOCOL_VERSION, check_middleware_key
from agentmw.middleware import MiddlewareBase
from agentmw.security import (
    SecurityError,
    TlsFiles,
    abort,
    presented_token,
    read_secret,
    refuse_stream,
    token_digest,
    token_matches,
)
from agentmw.subscriptions import to_proto
from agentmw.tools import Tool, Toolkit, error_response
from agentmw.transport import (
    MESSAGE_SIZE_OPTIONS,
    NOT_READY,
    SERVER_OPTIONS,
    CannotListen,
    check_listen_address,
    listen,
)
from agentmw.v1 import hooks_pb2, hooks_pb2_grpc, types_pb2

from .session import HookSession, HostProtocolError, HostReader

log = logging.getLogger("agentmw.sdk")


class _Describe(hooks_pb2_grpc.DescribeServicer):
    def __init__(self, description: hooks_pb2.MiddlewareDescription) -> None:
        self.description = description

    async def Describe(self, request: Any, context: Any) -> hooks_pb2.MiddlewareDescription:
        return self.description


@dataclasses.dataclass
class ToolState:
    """What a tool's ``call(tool_input, state)`` gets in a server: the calling session's ids, its
    owner (the authenticated user who created it, as ``agent.state.owner``; "" without
    authentication) and this middleware's slot (``middle_context[key]``, read-only here), as the
    host sent them."""

    session_id: str
    reply_id: str
    middle_context: dict[str, Any]
    owner: str = ""


class _ToolSource(hooks_pb2_grpc.ToolSourceServicer):
    def __init__(self, middleware: MiddlewareBase, key: str, streams: _Streams) -> None:
        self.middleware = middleware
        self.key = key
        self.streams = streams
        self.tools: dict[str, Tool] = {}

    async def _refresh(self, context: Any) -> None:
        try:
            self.tools = {t.name: t for t in await self.middleware.list_tools()}
        except Exception as exc:  # its backend down, say: not ready (at start the host waits, then asks again)
            log.exception("list_tools of %s raised", type(self.middleware).__name__)
            context.set_trailing_metadata(((NOT_READY, "list_tools"),))  # hooks.proto, ListTools
            await abort(context, grpc.StatusCode.UNAVAILABLE, f"list_tools raised {type(exc).__name__}: {exc}")

    async def ListTools(self, request: Any, context: Any) -> types_pb2.ToolDescriptorList:
        await self._refresh(context)
        out = types_pb2.ToolDescriptorList()
        for t in self.tools.values():
            codec.encode(t.descriptor, out.tools.add())
        return out

    async def CallTool(self, request: hooks_pb2.CallToolRequest, context: Any) -> Any:
        name = request.tool_call.name
        if name not in self.tools:
            await self._refresh(context)
        tool = self.tools.get(name)
        if tool is None:
            await abort(context, grpc.StatusCode.NOT_FOUND, f"no tool named {name!r}")
        tool_input = codec.decode_record(request)["tool_input"] if request.HasField("tool_input") else {}
        call = ToolCallBlock(id=request.tool_call.id or "call", name=name, input=json.dumps(tool_input))
        ctx = request.context
        slot = value_to_json(ctx.slot) if ctx.HasField("slot") else None
        state = ToolState(ctx.session_id, ctx.reply_id, {} if slot is None else {self.key: slot}, ctx.session_owner)
        try:
            async for item in Toolkit([tool]).call_tool(call, state):
                yield codec.encode_item(item)
        except (KeyboardInterrupt, SystemExit) as exc:
            # What the toolkit lets through stops this process, but the host gets its answer first
            # (the tool's failure, as the toolkit answers any other exception; its result holds
            # only the error), not a wait until its timeout.
            log.error("tool %s of %s raised", name, type(self.middleware).__name__, exc_info=exc)
            try:
                yield codec.encode_item(ToolChunk(content=[TextBlock(text=str(exc))], state=ToolResultState.ERROR))
                yield codec.encode_item(error_response(str(exc), call.id))
            finally:
                # Also when the generator is closed at its last yield: the host cancels the call
                # once it has the response, often before gRPC asks for more, and code after that
                # yield never ran (the process then served on, idle, instead of exiting).
                exiting = self.streams.exit(exc)
            if not exiting:
                raise


class _Streams:
    """A server's hook streams that wait for their next invocation. The host keeps idle streams
    open to reuse them; on stop they end at once, between invocations (the host then opens new
    ones, to the next server), instead of each holding the stop for its whole grace period and
    then being cancelled with an error logged. A stream inside an invocation finishes it first.

    Also how a handler asks serve_async to stop the server (``exit``).
    """

    def __init__(self) -> None:
        self.idle: set[asyncio.Task[Any]] = set()
        self.stopping = False
        self.exiting: asyncio.Future[BaseException | None] | None = None  # serve_async's; None: start() alone

    def stop(self) -> None:
        self.stopping = True
        for task in self.idle:
            task.cancel()

    def exit(self, exc: BaseException | None) -> bool:
        """The author's code raised ``exc`` (SystemExit, KeyboardInterrupt), already answered, or
        a signal came (None): under serve_async the server stops as it does on SIGTERM, then
        serve_async raises ``exc``. False without serve_async: the caller raises it. (Raised out of
        a handler, it would stop the event loop under a gRPC server still running.)"""
        if self.exiting is None:
            return False
        if not self.exiting.done():
            self.exiting.set_result(exc)
        return True


_streams: weakref.WeakKeyDictionary[grpc.aio.Server, _Streams] = weakref.WeakKeyDictionary()


def _hook_handler(middleware: MiddlewareBase, key: str, hook: str, streams: _Streams) -> grpc.RpcMethodHandler:
    spec = HOOKS[hook]

    async def run(request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        # One stream carries invocations one after another, each opened by a begin.
        reader = HostReader(context)
        task = asyncio.current_task()
        assert task is not None
        try:
            while not streams.stopping:
                streams.idle.add(task)
                try:
                    begin = await reader.next_begin()
                except asyncio.CancelledError:
                    if streams.stopping:  # the server stops: this idle stream ends, status OK
                        return
                    raise
                finally:
                    streams.idle.discard(task)
                if begin is None:
                    return
                # The host's trace goes on in the author's code.
                with tracing.continued(begin.begin.context.trace_context):
                    await HookSession(middleware, key, spec, context, reader).run(begin)
        except HostProtocolError as exc:  # the stream cannot go on; this server and its other streams do
            log.warning("%s: the host broke the protocol: %s", hook, exc)
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"{hook}: the host broke the protocol: {exc}")
        except (KeyboardInterrupt, SystemExit) as exc:  # the author's, answered (HookSession.run)
            if not streams.exit(exc):
                raise
        except Exception:
            log.exception("%s: the hook session failed", hook)
            raise
        finally:
            reader.close()

    return grpc.stream_stream_rpc_method_handler(
        run,
        request_deserializer=hooks_pb2.HostMessage.FromString,
        response_serializer=hooks_pb2.MiddlewareMessage.SerializeToString,
    )


async def describe(middleware: MiddlewareBase) -> hooks_pb2.MiddlewareDescription:
    """What Describe answers; a key no host would take is a ConfigError (refused at start)."""
    try:
        key = check_middleware_key(await middleware.get_middleware_key())
    except ValueError as exc:
        raise ConfigError(f"get_middleware_key(): {exc}") from None
    desc = hooks_pb2.MiddlewareDescription(key=key, protocol_version=PROTOCOL_VERSION)
    for hook in type(middleware).implemented_hooks():
        desc.hooks.append(to_proto(HOOKS[hook].number, middleware.subscription(hook)))
    desc.provides_tools = type(middleware).list_tools is not MiddlewareBase.list_tools
    return desc


@dataclass
class ServeSecurity:
    """TLS (``tls.cert``/``key``; ``tls.ca`` = the CA the host's client certificate must be
    signed by), the host's token (only its SHA-256 is kept) and whether reflection is on."""

    tls: TlsFiles = field(default_factory=TlsFiles)
    token_sha256: str = ""
    reflection: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ServeSecurity:
        env = os.environ if environ is None else environ
        tls = TlsFiles(
            cert=env.get("AGENTMW_MW_TLS_CERT", ""),
            key=env.get("AGENTMW_MW_TLS_KEY", ""),
            ca=env.get("AGENTMW_MW_TLS_CLIENT_CA", ""),
        )
        token = env.get("AGENTMW_MW_TOKEN", "") or read_secret(file=env.get("AGENTMW_MW_TOKEN_FILE", ""), where="serve")
        reflection = env.get("AGENTMW_MW_REFLECTION", "").lower() in ("1", "true", "yes", "on")
        return cls(tls, token_digest(token) if token else "", reflection)


# Where a server's TLS files are set, for its errors (a certificate without its key: which to add).
TLS_SETTINGS = (
    "TLS (AGENTMW_MW_TLS_CERT, AGENTMW_MW_TLS_KEY, AGENTMW_MW_TLS_CLIENT_CA; "
    "the SDK command's --tls-cert, --tls-key, --tls-client-ca)"
)


class _HostToken(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call without the host's token, except health checks."""

    def __init__(self, digest: str) -> None:
        self.digest = digest

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith("/grpc.health.v1."):
            return handler
        if token_matches(presented_token(details.invocation_metadata), [self.digest]):
            return handler

        code, why = grpc.StatusCode.UNAUTHENTICATED, "this middleware server accepts only its host"

        async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
            await abort(context, code, why)

        async def refuse_streaming(requests: Any, context: grpc.aio.ServicerContext) -> None:
            await refuse_stream(requests, context, code, why)

        kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream") if getattr(handler, k))
        return handler._replace(**{kind: refuse_streaming if kind.startswith("stream_") else refuse})


async def start(
    middleware: MiddlewareBase, address: str = "127.0.0.1:0", security: ServeSecurity | None = None
) -> tuple[grpc.aio.Server, int]:
    """Start serving in the running event loop; returns the server and the bound port."""
    security = security or ServeSecurity()
    interceptors = [_HostToken(security.token_sha256)] if security.token_sha256 else []
    # Messages as large as the host sends (a Begin with a long session's context): not gRPC's 4 MiB.
    server = grpc.aio.server(options=[*SERVER_OPTIONS, *MESSAGE_SIZE_OPTIONS], interceptors=interceptors)
    streams = _streams[server] = _Streams()
    description = await describe(middleware)
    services = []
    for hook in description.hooks:
        name = next(s.name for s in HOOKS.values() if s.number == hook.hook)
        service = f"agentmw.v1.{HOOKS[name].service}"
        services.append(service)
        handler = grpc.method_handlers_generic_handler(
            service, {"Run": _hook_handler(middleware, description.key, name, streams)}
        )
        server.add_generic_rpc_handlers((handler,))
    hooks_pb2_grpc.add_DescribeServicer_to_server(_Describe(description), server)
    services.append("agentmw.v1.Describe")
    if description.provides_tools:
        hooks_pb2_grpc.add_ToolSourceServicer_to_server(_ToolSource(middleware, description.key, streams), server)
        services.append("agentmw.v1.ToolSource")
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for service in ["", *services]:
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    if security.reflection:
        reflection.enable_server_reflection([*services, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    # A TLS port only: plaintext callers fail the handshake.
    credentials = security.tls.server_credentials(where=TLS_SETTINGS) if security.tls.enabled else None
    port = listen(server, address, credentials)  # CannotListen: serve() makes it one line, exit 1
    await server.start()
    return server, port


async def serve_async(
    middleware: MiddlewareBase, address: str, *, grace: float = 5.0, security: ServeSecurity | None = None
) -> None:
    server, port = await start(middleware, address, security or ServeSecurity.from_env())
    host = address.rsplit(":", 1)[0]
    # Tests and launchers read this line to learn the port when the address asked for port 0.
    print(
        f"agentmw middleware {type(middleware).__name__} listening on {host}:{port} (event loop: {loops.loop_name()})",
        flush=True,
    )
    loop = asyncio.get_running_loop()
    # A signal (None), or what the author's code raised to end the process (_Streams.exit).
    streams = _streams[server]
    exiting = streams.exiting = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, streams.exit, None)
    raised = await exiting
    await stop_server(server, grace)
    try:  # then its background work gets as long (else it would be dropped with the event loop)
        async with asyncio.timeout(grace):
            await middleware.close()
    except TimeoutError:
        log.warning("%s did not finish its background work within %gs", type(middleware).__name__, grace)
    if raised is not None:
        raise raised


async def stop_server(server: grpc.aio.Server, grace: float | None) -> None:
    """Stop a server ``start`` made: idle hook streams end at once, invocations in flight get
    ``grace`` seconds to finish (then they are cancelled)."""
    streams = _streams.get(server)
    if streams is not None:
        streams.stop()
    await server.stop(grace)


def serve(
    middleware: MiddlewareBase,
    address: str = "127.0.0.1:50061",
    *,
    grace: float = 5.0,
    security: ServeSecurity | None = None,
    loop: str | None = None,
) -> None:
    """Run ``middleware`` as a gRPC server at ``address`` until SIGTERM/SIGINT; ``security``
    defaults to ``ServeSecurity.from_env()`` (plaintext, no token, no reflection when unset);
    ``loop``: "asyncio", "uvloop" or "auto" (default: AGENTMW_LOOP, else asyncio; agentmw/loops.py)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    prefix = f"agentmw middleware {type(middleware).__name__}"
    try:
        loop = loops.choose_loop(loop)
    except ValueError as exc:
        _configuration_error(prefix, exc)
    try:  # before anything starts: gRPC would take a port above 65535 modulo 65536
        check_listen_address(address)
    except ValueError as exc:
        _configuration_error(prefix, f"address {exc}")
    try:
        loops.run(serve_async(middleware, address, grace=grace, security=security), loop)
    except (ConfigError, SecurityError) as exc:  # what the middleware describes (its key), TLS files
        _configuration_error(prefix, exc)
    except CannotListen as exc:  # a port in use or not local: a failure to start (1), as agent-host's
        raise SystemExit(f"{prefix}: {exc}") from None


def _configuration_error(prefix: str, what: object) -> NoReturn:
    """One line and exit status 2, as agent-host says a configuration error."""
    print(f"{prefix}: configuration error: {what}", file=sys.stderr)
    raise SystemExit(2)


__all__ = ["CannotListen", "ServeSecurity", "describe", "serve", "serve_async", "start", "stop_server"]
