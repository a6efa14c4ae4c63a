"""The AgentHost gRPC service (spec: protos/agentmw/v1/host.proto), health and reflection."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import logging
import signal
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from agentmw import loops, transport
from agentmw.codec import CodecError, codec
from agentmw.data import Msg, new_id
from agentmw.hooks import HOOKS
from agentmw.transport import SERVER_OPTIONS
from agentmw.v1 import host_pb2, host_pb2_grpc

from .. import metrics
from ..config import (
    ConfigError,
    HostConfig,
    MiddlewareConfig,
    check_middleware_address,
    check_middleware_name,
    check_seconds,
)
from ..remote import MiddlewareFailure, Policy
from ..security import (
    ADMIN,
    ANONYMOUS_ADMIN,
    USER,
    Authenticator,
    Principal,
    SecurityError,
    abort,
    address_allowed,
    refuse_stream,
)
from ..store import STORE_ERRORS, SessionBusyError, SessionRecord, open_store, store_failure
from ..store.postgres import redact
from .builtin_tools import BUILTIN_TOOLS
from .host import BATCH_BYTES, INTERRUPT_GRACE, WAIT_FOR, Attached, Host, Pending, ReplyRejected, ReplyRun, TooManyTools

log = logging.getLogger("agentmw.host")

SERVICE = "agentmw.v1.AgentHost"

# The role each AgentHost method needs; a method not listed needs ADMIN (a new RPC is closed by default).
METHOD_ROLES = {
    "Reply": USER,
    "ListSessions": USER,
    "GetSession": USER,
    "DeleteSession": USER,
    "InterruptReply": USER,
}
CALLER: contextvars.ContextVar[Principal] = contextvars.ContextVar("caller", default=ANONYMOUS_ADMIN)
CONNECT_TIMEOUT = Policy.connect_timeout  # an attach failure is answered no sooner than this
ATTACH_FAILED = "no usable middleware server answered there (the host's log says why)"

START_WAIT = 5.0  # seconds a Reply call may take to send its StartReply (a client sends it at once)
# Seconds the server waits for its calls when the host stops, past the interrupt grace: a reply
# cut off at INTERRUPT_GRACE still sends its client the documented ABORTED end, not "Cancelling all calls".
STOP_GRACE = INTERRUPT_GRACE + 5.0
WATCH_EVERY = 1.0  # seconds between health checks while a health Watch is open


_Answer = TypeVar("_Answer")


def _store_unavailable(
    method: Callable[[Any, Any, Any], Awaitable[_Answer]],
) -> Callable[[Any, Any, Any], Awaitable[_Answer]]:
    """A session RPC whose store fails (unreachable, full) answers UNAVAILABLE with the store's
    message, as Reply does (Host._run), not UNKNOWN with a traceback in the log."""

    @functools.wraps(method)
    async def answer(self: Any, request: Any, context: Any) -> _Answer:
        try:
            return await method(self, request, context)
        except STORE_ERRORS as exc:
            log.warning("%s: %s", method.__name__, store_failure(exc))
            await abort(context, grpc.StatusCode.UNAVAILABLE, store_failure(exc))

    return answer


class AgentHostServicer(host_pb2_grpc.AgentHostServicer):
    def __init__(self, host: Host) -> None:
        self.host = host

    async def Reply(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:  # a call that never starts would hold its stream (and memory) for good
            async with asyncio.timeout(START_WAIT):
                first = await anext(aiter(request_iterator), None)
        except TimeoutError:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"no `start` within {START_WAIT:g}s of the call")
        if first is None or first.WhichOneof("request") != "start":
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "the first ReplyRequest must be `start`")
        try:
            start = codec.decode_record(first.start)
        except (CodecError, KeyError, TypeError, ValueError) as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"malformed StartReply: {exc}")
        inputs = start.get("input")
        if inputs is None:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "StartReply needs a message or a resumption event")
        if not start.get("session_id") and not isinstance(inputs, Msg):  # nothing to resume in a new session
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "a resumption event needs its session's session_id")
        if isinstance(inputs, Msg) and not inputs.id:  # proto3's default: one of its own (a retry needs the client's)
            inputs.id = new_id()
        session_id = start.get("session_id") or new_id()
        # A JSON object (the codec's struct_to_dict) when set; the host checks it before anything is stored.
        structured_schema = start.get("structured_schema")
        # With authentication, new sessions get ids the host mints: an unknown id is NOT_FOUND, as
        # another user's is (so ids tell nothing about who has which).
        may_create = not start.get("session_id") or not self.host.config.security.users
        run = self.host.start_reply(
            session_id,
            inputs,
            structured_schema,
            caller=CALLER.get(),
            may_create=may_create,
            refuse_if_busy=first.start.refuse_if_busy,
        )
        watcher = asyncio.create_task(_watch_cancel(request_iterator, run))
        try:
            async for batch in run.batches():
                event = host_pb2.ReplyEvent(session_id=session_id)
                for item in batch:
                    codec.encode_item(item, event.items.add())
                if len(batch) == 1 or event.ByteSize() <= BATCH_BYTES:  # the usual case: one size check
                    yield event
                else:
                    for part in _split(event):
                        yield part
        except ReplyRejected as exc:
            await abort(context, exc.code, str(exc))
        finally:
            watcher.cancel()
            run.abandon()  # a no-op when the reply has ended; else the client went away

    @_store_unavailable
    async def ListSessions(self, request: Any, context: Any) -> host_pb2.SessionList:
        sessions = await self.host.sessions(request.limit, CALLER.get())
        return host_pb2.SessionList(sessions=[_summary(r) for r in sessions])

    @_store_unavailable
    async def GetSession(self, request: Any, context: grpc.aio.ServicerContext) -> host_pb2.Session:
        found = await self.host.session(request.session_id, CALLER.get())
        if found is None:
            await abort(context, grpc.StatusCode.NOT_FOUND, f"no session {request.session_id!r}")
        record, state, pending = found
        out = host_pb2.Session(summary=_summary(record), replying=await self.host.replying_anywhere(request.session_id))
        codec.encode(state, out.state)
        out.middle_context_json = self.host.middle_context_json(state)
        for call in pending:
            codec.encode(call, out.pending_tool_calls.add())
        return out

    @_store_unavailable
    async def DeleteSession(self, request: Any, context: Any) -> host_pb2.DeleteSessionResponse:
        try:
            deleted = await self.host.delete_session(request.session_id, CALLER.get())
        except SessionBusyError as exc:
            await abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{exc}: a reply of it runs (interrupt it with InterruptReply, or delete it once it ended)",
            )
        return host_pb2.DeleteSessionResponse(deleted=deleted)

    @_store_unavailable
    async def InterruptReply(self, request: Any, context: Any) -> host_pb2.InterruptReplyResponse:
        return host_pb2.InterruptReplyResponse(interrupted=await self.host.interrupt(request.session_id, CALLER.get()))

    async def AttachMiddleware(self, request: Any, context: grpc.aio.ServicerContext) -> host_pb2.MiddlewareInfo:
        await _per_host_middleware(self.host, context)
        if not request.address:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "an address is required")
        try:
            check_middleware_name(request.name)
        except ValueError as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.timeout != 0:  # 0 = the default
            try:
                check_seconds(request.timeout)
            except ValueError as exc:
                await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            check_middleware_address(request.address, "address")
        except ConfigError as exc:  # a malformed address is not a forbidden one
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        security = self.host.config.security
        configured = {m.address: m for m in self.host.config.middleware}
        if not address_allowed(request.address, security.attach_allow, configured):
            await abort(context, grpc.StatusCode.PERMISSION_DENIED, f"{request.address} is not an allowed address")
        known = configured.get(request.address)  # a configured address keeps its key, permissions and limits
        base = known or MiddlewareConfig(address=request.address, permissions=security.attach_permissions)
        mc = dataclasses.replace(
            base,
            name=request.name,
            fail_open=request.fail_open,
            timeout=request.timeout or base.timeout,
            source="AttachMiddleware",
        )
        position = request.position if request.HasField("position") else None
        if position is not None and not 0 <= position <= len(self.host.middleware):
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"position {position} is out of range")
        started = time.monotonic()
        try:
            attached = await self.host.attach(mc, position)
        except MiddlewareFailure as exc:
            # One answer, at one time, for refused / unreachable / timed out / not a middleware:
            # AttachMiddleware must not be a port scanner. The details go to the log only.
            log.warning("AttachMiddleware %s failed: %s", request.address, exc)
            await asyncio.sleep(max(0.0, started + CONNECT_TIMEOUT - time.monotonic()))
            await abort(context, grpc.StatusCode.UNAVAILABLE, f"cannot attach {request.address}: {ATTACH_FAILED}")
        except TooManyTools as exc:
            await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ValueError as exc:
            await abort(context, grpc.StatusCode.ALREADY_EXISTS, str(exc))
        return _info(attached)

    async def DetachMiddleware(self, request: Any, context: grpc.aio.ServicerContext) -> host_pb2.MiddlewareInfo:
        await _per_host_middleware(self.host, context)
        try:
            return _info(await self.host.detach(request.name))
        except KeyError:
            pending = self.host.forget_pending(request.name)
            if pending is not None:
                return _info(pending)
            await abort(context, grpc.StatusCode.NOT_FOUND, f"no middleware named {request.name!r} is attached")

    async def ListMiddleware(self, request: Any, context: Any) -> host_pb2.MiddlewareList:
        every: list[Attached | Pending] = [*self.host.middleware, *self.host.pending.values()]
        return host_pb2.MiddlewareList(middleware=[_info(a) for a in every])


async def _per_host_middleware(host: Host, context: grpc.aio.ServicerContext) -> None:
    """Hosts sharing a store must run the same middleware: a change to one host alone is refused."""
    if host.store.shared:
        await abort(
            context,
            grpc.StatusCode.FAILED_PRECONDITION,
            "this host shares its session store with other hosts: attach and detach would change one host only; "
            "change the middleware in every host's configuration and restart them one by one (they drain)",
        )


def _split(event: host_pb2.ReplyEvent) -> list[host_pb2.ReplyEvent]:
    """A ReplyEvent of several items over BATCH_BYTES as several, in order, each within it (an item
    larger than that alone goes alone): what came at once never adds up to a message a client refuses."""
    parts = [host_pb2.ReplyEvent(session_id=event.session_id)]
    size = 0
    for item in event.items:
        n = item.ByteSize()
        if parts[-1].items and size + n > BATCH_BYTES:
            parts.append(host_pb2.ReplyEvent(session_id=event.session_id))
            size = 0
        parts[-1].items.add().CopyFrom(item)
        size += n
    return parts


async def _watch_cancel(request_iterator: Any, run: ReplyRun) -> None:
    """After `start`, the only thing a client may send is `cancel` (a half-close is not one)."""
    # AbortError: an undecodable request ended the call (see _DecodeErrors)
    with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.AbortError, asyncio.InvalidStateError):
        async for request in request_iterator:
            if request.WhichOneof("request") == "cancel":
                log.info("session %s: the client cancelled the reply", run.session_id)
                run.interrupt()


class _Undecodable:
    """A request that is not the method's proto; the call ends with INVALID_ARGUMENT."""

    def __init__(self, message: str) -> None:
        self.message = message


class _DecodeErrors(grpc.aio.ServerInterceptor):
    """Undecodable AgentHost requests end with INVALID_ARGUMENT, not UNKNOWN.

    grpc answers UNKNOWN to any exception of a request deserializer, so the deserializer returns
    an ``_Undecodable`` instead, and the method (or its request stream) aborts on it."""

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(f"/{SERVICE}/") or handler.request_deserializer is None:
            return handler
        decode = handler.request_deserializer

        def lenient(data: bytes) -> Any:
            try:
                return decode(data)
            except Exception as exc:  # DecodeError, or anything the parser raises on garbage
                return _Undecodable(f"{details.method}: the request is not a valid message: {exc}")

        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def checked_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Undecodable):
                    await abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)
                return await unary(request, context)

            return handler._replace(request_deserializer=lenient, unary_unary=checked_unary)
        if handler.stream_stream is not None:
            stream = handler.stream_stream

            async def checked_requests(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                async for request in requests:
                    if isinstance(request, _Undecodable):
                        await abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)
                    yield request

            async def checked_stream(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                async for response in stream(checked_requests(requests, context), context):  # grpc wants an async gen
                    yield response

            return handler._replace(request_deserializer=lenient, stream_stream=checked_stream)
        return handler  # AgentHost has no other kind of method


class _Authorize(grpc.aio.ServerInterceptor):
    """Every AgentHost call is authenticated (token or client certificate) and checked against
    METHOD_ROLES before its method runs; the caller is then ``CALLER`` for the method. Without
    configured users every caller is an anonymous admin (today's loopback behaviour)."""

    def __init__(self, auth: Authenticator) -> None:
        self.auth = auth

    def _caller(self, method: str, context: grpc.aio.ServicerContext) -> Principal | tuple[grpc.StatusCode, str]:
        """Who the call is from, or why it is refused (a status and its details)."""
        caller = self.auth.authenticate(context.invocation_metadata(), context.auth_context())
        if caller is None:  # said for the operator (who tries, from where), never the credential itself
            log.warning("refused %s from %s: no valid token or certificate", method, context.peer())
            return grpc.StatusCode.UNAUTHENTICATED, "a valid token or certificate is required"
        needed = METHOD_ROLES.get(method.rsplit("/", 1)[-1], ADMIN)
        if needed == ADMIN and not caller.admin:
            log.warning("refused %s from user %r at %s: it needs the admin role", method, caller.name, context.peer())
            return grpc.StatusCode.PERMISSION_DENIED, f"{method} needs the admin role"
        return caller

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        method = details.method
        if handler is None or not method.startswith(f"/{SERVICE}/") or not self.auth.enabled:
            return handler  # health (and reflection, when enabled) stay open, as probes expect
        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def authorized_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                caller = self._caller(method, context)
                if isinstance(caller, tuple):
                    await abort(context, *caller)
                CALLER.set(caller)
                return await unary(request, context)

            return handler._replace(unary_unary=authorized_unary)
        stream = handler.stream_stream

        async def authorized_stream(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            caller = self._caller(method, context)
            if isinstance(caller, tuple):
                await refuse_stream(requests, context, *caller)
            CALLER.set(caller)
            async for response in stream(requests, context):
                yield response

        return handler._replace(stream_stream=authorized_stream)


def _summary(r: SessionRecord) -> host_pb2.SessionSummary:
    return host_pb2.SessionSummary(
        session_id=r.session_id,
        created_at=r.created_at,
        updated_at=r.updated_at,
        message_count=r.message_count,
        title=r.title,
        parked=r.parked,
    )


def _info(a: Attached | Pending) -> host_pb2.MiddlewareInfo:
    """An attached middleware as described and as its status stands, or one still pending (only
    its configuration and why it is not attached yet are known)."""
    mc = a.config
    if isinstance(a, Pending):
        found: dict[str, Any] = {
            "key": mc.key,
            "health": "unreachable",
            "last_error": a.why,
            "failing": True,
            "pending": True,
        }
    else:
        found = {"key": a.remote.key, "hooks": [h for h in HOOKS if a.remote.implements(h)], "tools": list(a.tools)}
        found.update(metrics.middleware_status(a.remote))
    return host_pb2.MiddlewareInfo(name=a.name, address=mc.address, fail_open=mc.fail_open, timeout=mc.timeout, **found)


# ---------------------------------------------------------------------------------------------
# Running a host.


class HostHealth(health.aio.HealthServicer):
    """grpc.health.v1: NOT_SERVING while a fail_closed middleware that replies wait for (not a
    detached watcher) or the session store cannot be reached, or such a middleware is not attached
    yet or hung (every reply is refused), or while draining; SERVING again once they are back.
    Checked on each Check, and every WATCH_EVERY seconds while a Watch is open (gRPC's client-side
    health checking watches: it would never hear of a change otherwise); nothing runs otherwise."""

    def __init__(self, host: Host) -> None:
        super().__init__()
        self.host = host
        self.serving = True
        self.watches = 0
        self.refresher: asyncio.Task[None] | None = None
        self.stopped = asyncio.Event()

    async def Watch(self, request: Any, context: Any) -> None:
        self.watches += 1
        if self.refresher is None or self.refresher.done():
            self.refresher = asyncio.create_task(self._refresh_while_watched())
        watching = asyncio.ensure_future(super().Watch(request, context))
        stopped = asyncio.ensure_future(self.stopped.wait())
        try:  # until the host stops: the stream then ends (OK), not held for the server's grace
            await asyncio.wait([watching, stopped], return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.watches -= 1
            for waiting in (watching, stopped):
                waiting.cancel()

    async def _refresh_while_watched(self) -> None:
        while self.watches:
            await asyncio.sleep(WATCH_EVERY)
            try:
                await self.refresh()
            except Exception:  # a store that fails its check says so in refresh; keep watching
                log.exception("refreshing the health status")

    async def stop(self) -> None:
        """The host stops: NOT_SERVING to every watcher, then their streams end (else each held
        the server's stop for its whole grace)."""
        await self.enter_graceful_shutdown()
        await asyncio.sleep(0.1)  # the watchers write it
        self.stopped.set()
        if self.refresher is not None:
            self.refresher.cancel()

    async def refresh(self) -> None:
        required = [a for a in self.host.middleware if not a.config.fail_open and a.remote.holds_replies()]
        reachable = [a.remote.reachable() for a in required]
        if self.host.required_unavailable() is not None:  # not attached yet, or hung: replies are refused
            reachable.append(False)
        reachable.append(await self.host.store.reachable())  # no store (PostgreSQL down): no reply can be stored
        if self.host.draining or False in reachable:  # draining: load balancers stop sending replies
            self.serving = False
        elif None not in reachable:  # None: still connecting, keep the last answer
            self.serving = True
        status = health_pb2.HealthCheckResponse.SERVING if self.serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            await self.set(name, status)

    async def Check(self, request: Any, context: Any) -> Any:
        await self.refresh()
        return await super().Check(request, context)


class StartupError(RuntimeError):
    """The host cannot start as configured (e.g. a middleware refuses the host's token)."""


async def build_host(config: HostConfig) -> Host:
    """The host of a configuration, with its middleware attached (in order). Raises ConfigError /
    StartupError naming what failed and where it was configured."""
    models = config.build_models()
    try:
        store = await open_store(config.db, lease=config.lease)
    except (OSError, sqlite3.Error) as exc:
        raise StartupError(f"db: cannot open the session store {redact(config.db)!r}: {exc}") from None
    host = Host(config, store, models, [BUILTIN_TOOLS[name] for name in config.tools])
    try:
        for mc in config.middleware:
            label = f"middleware {mc.name + ' ' if mc.name else ''}at {mc.address}"
            try:
                await host.attach(mc)
            except MiddlewareFailure as exc:  # its text says why: cannot connect, no answer, ...
                if isinstance(exc, WAIT_FOR):  # down or silent, not wrong: the host starts without it
                    host.attach_when_it_answers(mc, exc)
                    continue
                raise StartupError(f"{mc.source}: {label}: {exc.hook} failed: {exc.what}") from None
            except ValueError as exc:
                raise ConfigError(f"{mc.source}: {label}: {exc}") from None
    except BaseException:
        await host.close()
        raise
    return host


async def start_server(host: Host, listen: str) -> tuple[grpc.aio.Server, int, HostHealth]:
    sec = host.config.security
    options = [*SERVER_OPTIONS, ("grpc.max_receive_message_length", sec.max_message_bytes)]
    interceptors = [_Authorize(Authenticator(sec.users)), _DecodeErrors()]  # the first is the outermost
    server = grpc.aio.server(options=options, interceptors=interceptors)
    host_pb2_grpc.add_AgentHostServicer_to_server(AgentHostServicer(host), server)
    health_servicer = HostHealth(host)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await health_servicer.refresh()
    if sec.reflection:
        reflection.enable_server_reflection([SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    try:
        credentials = None  # a TLS port only, when TLS is on: plaintext clients fail the handshake
        if sec.tls.enabled:
            credentials = sec.tls.server_credentials(require_client_cert=sec.require_client_cert, where="security.tls")
        port = transport.listen(server, listen, credentials)
    except SecurityError as exc:
        raise StartupError(str(exc)) from None
    except transport.CannotListen as exc:
        raise StartupError(f"listen: {exc}") from None
    await server.start()
    return server, port, health_servicer  # run_host tells the health service of the drain and the stop


async def run_host(config: HostConfig, *, ready: Any = None) -> None:
    """Run until SIGTERM / SIGINT. SIGTERM drains: NOT_SERVING and new replies refused at once, the
    replies in flight get ``config.drain_grace`` seconds to finish; then (at once on SIGINT, Ctrl-C)
    the rest are interrupted and saved."""
    host = await build_host(config)
    try:
        server, port, health = await start_server(host, config.listen)
    except BaseException:
        await host.close()
        raise
    address = f"{config.listen.rsplit(':', 1)[0]}:{port}"
    # Launchers and tests read this line to learn the port when --listen asked for port 0.
    print(f"agentmw host listening on {address} (event loop: {loops.loop_name()})", flush=True)
    if ready is not None:
        ready(address)
    stop, now = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    # SIGHUP as SIGTERM: a drain, not the default death with nothing saved (there is no reload).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)

    def interrupted() -> None:  # Ctrl-C: no grace
        stop.set()
        now.set()

    loop.add_signal_handler(signal.SIGINT, interrupted)
    await stop.wait()
    loop.add_signal_handler(signal.SIGTERM, now.set)  # a second SIGTERM cuts the grace short
    drain, cut = (
        asyncio.create_task(host.drain(0 if now.is_set() else config.drain_grace)),
        asyncio.create_task(now.wait()),
    )
    await asyncio.sleep(0)  # the drain has begun (host.draining): watchers hear NOT_SERVING at once
    await health.refresh()
    await asyncio.wait([drain, cut], return_when=asyncio.FIRST_COMPLETED)
    drain.cancel()
    cut.cancel()
    log.info("stopping: interrupting %d replies in flight", len(host._runs))
    closing = asyncio.create_task(host.close())
    await health.stop()
    await server.stop(STOP_GRACE)
    await closing


__all__ = ["AgentHostServicer", "HostHealth", "StartupError", "build_host", "run_host", "start_server"]
