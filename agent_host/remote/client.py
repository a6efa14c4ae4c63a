"""RemoteMiddleware: a middleware server at an address, used as one layer of the host's chains.

One long-lived channel per address. ``connect()`` runs Describe (the handshake); afterwards the
object has every hook method of ``MiddlewareBase`` and takes part in exactly the hooks the server
implements. Each invocation is one ``HookCall`` (protocol.py) over a fresh bidirectional stream.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
import time
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

import grpc

from agentmw.codec import CodecError, codec, json_to_value
from agentmw.data import ChatResponse, ToolCallBlock, ToolChunk, ToolDescriptor, ToolResponse
from agentmw.hooks import HOOKS, HOOKS_BY_NUMBER, PROTOCOL_VERSION, HookSpec, check_middleware_key
from agentmw.subscriptions import SubscriptionTable
from agentmw.tools import MAX_MODEL_TOOLS, TOOL_NAME, Tool, schema_validator
from agentmw.transport import HOST_KEEPALIVE_MS, MESSAGE_SIZE_OPTIONS, NOT_READY
from agentmw.v1 import hooks_pb2, hooks_pb2_grpc
from agentmw.wire import EMITTABLE, tool_item_problem

from .. import metrics
from ..config import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_ITEM_BYTES,
    DEFAULT_MAX_ITEMS,
    DEFAULT_TIMEOUT,
    Permissions,
    check_seconds,
)
from ..security import TlsFiles, bearer_metadata, channel, tls_hint
from .errors import (
    MiddlewareFailure,
    NoAnswer,
    NotReady,
    OutputLimitExceeded,
    ProtocolError,
    StreamBroken,
    Unreachable,
    broken_stream,
)
from .protocol import HookCall

log = logging.getLogger("agentmw.remote")

MAX_IDLE_STREAMS = 16  # per hook and middleware: enough for the concurrent calls of a busy host
CHANNEL_OPTIONS = [
    # Reconnect quickly after a middleware restart; the default backoff grows to minutes.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", HOST_KEEPALIVE_MS),  # what default servers accept (agentmw/transport.py)
    *MESSAGE_SIZE_OPTIONS,  # what a middleware's server takes too (the SDK's serve())
    ("grpc.lb_policy_name", "round_robin"),
]


_steps = random.Random()  # its own generator: invocation ids touch no global random state

MAX_TOOL_DESCRIPTOR_BYTES = 256 * 1024


MAX_SUSPENSION = 300.0  # seconds at most that a fail_open middleware that hangs is skipped
PROBE_EVERY = 1.0  # seconds between the Describes that ask a fail_closed one that hung whether it is back
# Hook calls of this many sessions in a row got no answer (none answered in between): the middleware
# hangs for everyone even though its Describe answers (see no_answer). One session's hang never is.
HANG_SESSIONS = 3
# grpc.aio hands over None for an answer whose bytes do not parse (and logs only its own line)
_UNPARSED = "an answer that does not parse as {} (malformed, or nested past protobuf's 100 levels)"
RELIST_PAUSE_MAX = 30.0  # seconds at most between ListTools asked again of a server that does not answer it


@dataclass
class Policy:
    """Per-middleware failure policy. ``timeout``: seconds the host waits for one message from the
    middleware (never counted while the host runs the inner pipeline for it), and for each
    handshake (Describe, ListTools) or tool call message. ``max_items`` / ``max_bytes``: what one
    hook call of the middleware may emit (items) and send (bytes) before it is failed as a runaway.
    ``max_item_bytes``: the largest one item it emits, tool chunk it sends or slot value it sets."""

    fail_open: bool = False
    timeout: float = DEFAULT_TIMEOUT
    connect_timeout: float = 5.0
    max_items: int = DEFAULT_MAX_ITEMS
    max_bytes: int = DEFAULT_MAX_BYTES
    max_item_bytes: int = DEFAULT_MAX_ITEM_BYTES

    def __post_init__(self) -> None:
        self.timeout = check_seconds(self.timeout)
        self.connect_timeout = check_seconds(self.connect_timeout, "connect_timeout")
        for name in ("max_items", "max_bytes", "max_item_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number above 0, got {value!r}")


@dataclass
class Access:
    """How the host reaches a middleware and what it lets it do (docs/security.md): TLS, the
    token it presents on every call, the key Describe must report ("" = any), its permissions."""

    tls: TlsFiles | None = None
    token: str = dataclass_field(default="", repr=False)  # a secret: never in a repr, a log or an error
    key: str = ""
    permissions: Permissions = dataclass_field(default_factory=Permissions)


# Which permission each Mutation op needs (set_slot, the middleware's own slot, needs none).
MUTATION_PERMISSION = {
    "append_message": "mutate_context",
    "append_blocks": "mutate_context",
    "append_blocks_to_tail": "mutate_context",
    "remove_block": "mutate_context",
    "set_cur_iter": "mutate_context",
    "set_max_iters": "mutate_context",
    "set_summary": "mutate_context",
    "drop_messages": "mutate_context",
    "set_model": "set_model",
}
# Kwargs whose override in call_next changes what the mutations above change: the model a reply
# uses, the messages a reply stores, how the context is compressed, which tool a call the model
# made runs with what input (on_acting, past the permission check and the user's confirmation:
# its result is stored as that call's) (security.md).
OVERRIDE_PERMISSION = {
    "current_model": "set_model",
    "inputs": "mutate_context",
    "context_config": "mutate_context",
    "instructions": "mutate_context",
    "tool_call": "mutate_context",
}


def _no_answer(exc: grpc.aio.AioRpcError, waited: float) -> str:
    return f"no answer within {waited:g}s ({exc.code().name}: {exc.details()})"


class RemoteMiddleware:
    def __init__(
        self, address: str, *, name: str | None = None, policy: Policy | None = None, access: Access | None = None
    ) -> None:
        self.address = address
        self.policy = policy or Policy()
        self.access = access or Access()
        self.configured_name = name
        self.channel = channel(address, self.access.tls, options=CHANNEL_OPTIONS)
        self.metadata = bearer_metadata(self.access.token)  # on every call: the server checks it
        # Streams open with wait_for_ready: on a reconnecting channel (a restarting middleware) the
        # begin waits for the server instead of failing at once; the hook call's watchdog bounds it.
        self.stubs = {
            spec.name: functools.partial(
                self.channel.stream_stream(
                    f"/agentmw.v1.{spec.service}/Run",
                    request_serializer=hooks_pb2.HostMessage.SerializeToString,
                    response_deserializer=hooks_pb2.MiddlewareMessage.FromString,
                ),
                wait_for_ready=True,
                metadata=self.metadata,
            )
            for spec in HOOKS.values()
        }
        self._describe_stub = hooks_pb2_grpc.DescribeStub(self.channel)
        self._tools_stub = hooks_pb2_grpc.ToolSourceStub(self.channel)
        self.key = ""
        self.tables: dict[str, SubscriptionTable] = {}
        self.provides_tools = False
        self.tools: list[Tool] = []  # as listed when it was last described
        self.listing = b""  # that ListTools answer, serialized: a new one that differs is news
        # Called when a Describe after attach finds another tool list (the host offers it from then on).
        self.tools_changed: Callable[[RemoteMiddleware], None] | None = None
        self.described = False
        # Times the connection dropped (see _follow_connection), and that count as of the last
        # Describe: a server may have restarted in between, with other hooks or tools.
        self.drops = 0
        self.described_drops = 0
        self.follower: asyncio.Task[None] | None = None
        self.stale_messages = 0  # messages of ended invocations, dropped (hooks.proto, INVOCATION IDS)
        self._invocation = 0  # the last invocation id handed out (see new_invocation)
        self.prompt_cache: dict[tuple, str] = {}
        # Idle streams per hook: a stream carries one invocation at a time, then the next one, so
        # a hook call does not pay for opening a stream (see hooks.proto, STREAMS).
        self.idle: dict[str, list[Any]] = {hook: [] for hook in HOOKS}
        self.background: set[asyncio.Task[None]] = set()  # detached hooks' deliveries and Describe
        self.outbox: Any = None  # detached.py: its finished detached invocations held for one send
        self.outage: str | None = None  # why the server could not be reached, until it can again
        self.hangs = 0  # suspensions (no_answer) since it last answered (see _suspend)
        self.hung_sessions: set[str] = set()  # sessions whose hook calls got no answer since one did
        self.suspended_until = 0.0  # time.monotonic() until which it is skipped
        self.last_hang = ""
        self.unresponsive = ""  # fail_closed: why its calls fail at once until a Describe answers
        self.confirming: asyncio.Task[None] | None = None  # the Describe after a call got no answer
        self.relisting: asyncio.Task[None] | None = None  # ListTools after a re-Describe (_relist)
        # fail_open: the agents whose current reply goes on without it (see bypass_rest_of_reply)
        self.bypassing: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()

    @property
    def bypasses(self) -> int:
        """Hook calls the host went on without it, as status and /metrics count them (metrics.count_bypass)."""
        return metrics.health(self).bypasses

    @property
    def name(self) -> str:
        return self.configured_name or self.key or self.address

    def __repr__(self) -> str:
        return f"RemoteMiddleware({self.name!r} at {self.address})"

    # -- handshake ------------------------------------------------------------------------------

    async def connect(self, *, timeout: float | None = None) -> RemoteMiddleware:
        """Describe the server (on attach, and again after any failure or a dropped connection):
        Describe, then ListTools when it provides tools (a restarted server may list others: the
        host is told, tools_changed). Raises MiddlewareFailure.

        Waits for the server to come up (a restarted one is still reconnecting), for up to
        ``timeout``: ``connect_timeout`` on attach, the hook timeout when a hook call re-describes.
        Not once it is known to be down (a Describe found it unreachable: until one reaches it
        again, each fails at once, so an outage costs one call the wait, not every reply). A
        Describe that does not wait still connects when the channel is connecting, or idle after
        a restart. (Detached hooks never wait for a Describe: detached.py runs theirs aside.)

        A failure after attach is counted as what it is, a Describe's (metrics.describe_failed),
        wherever it was asked for: a hook call, a reconnection, a probe, a watcher's aside.
        """
        try:
            return await self._describe(timeout)
        except MiddlewareFailure as exc:
            if self.key:  # attached (an attach that fails is the attach's to report)
                metrics.describe_failed(self, exc)
            raise

    async def _describe(self, timeout: float | None) -> RemoteMiddleware:
        attach = not self.key
        drops = self.drops  # a drop from here on is after this Describe: it describes again
        request = hooks_pb2.DescribeRequest(protocol_version=PROTOCOL_VERSION)
        limit = self.policy.connect_timeout if timeout is None else timeout
        try:
            desc = None
            if attach or self.outage:  # once without waiting: a dead server is reported at once
                try:
                    desc = await self._describe_stub.Describe(
                        request, timeout=limit, wait_for_ready=False, metadata=self.metadata
                    )
                except grpc.aio.AioRpcError as exc:
                    if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:  # it is there, and does not answer
                        raise NoAnswer(self.name, "Describe", _no_answer(exc, limit)) from None
                    if not attach:
                        raise
                    if "connection refused" in (exc.details() or "").lower():
                        what = f"cannot connect to {self.address}: connection refused"
                        raise Unreachable(self.name, "Describe", what) from None
                    # else a name still resolving, a first connection: the Describe below waits
            if desc is None:
                desc = await self._describe_stub.Describe(
                    request, timeout=limit, wait_for_ready=True, metadata=self.metadata
                )
        except grpc.aio.AioRpcError as exc:
            raise await self._describe_failed(exc, request, limit) from None
        if desc is None:  # grpc.aio hands over None when the bytes do not parse
            raise ProtocolError(self.name, "Describe", _UNPARSED.format("a MiddlewareDescription"))
        if desc.protocol_version and desc.protocol_version != PROTOCOL_VERSION:
            raise ProtocolError(self.name, "Describe", f"protocol {desc.protocol_version!r} is not {PROTOCOL_VERSION}")
        try:
            check_middleware_key(desc.key)
        except ValueError as exc:
            raise ProtocolError(self.name, "Describe", str(exc)) from None
        tables = {}
        for hook in desc.hooks:
            spec = HOOKS_BY_NUMBER.get(hook.hook)
            if spec is None:
                raise ProtocolError(self.name, "Describe", f"unknown hook number {hook.hook}")
            if spec.name in tables:
                raise ProtocolError(self.name, "Describe", f"describes {spec.name} twice")
            try:
                tables[spec.name] = SubscriptionTable(hook)
            except ValueError as exc:
                raise ProtocolError(self.name, "Describe", str(exc)) from None
        if self.key and desc.key != self.key:  # the slot it owns is fixed at attach
            raise ProtocolError(self.name, "Describe", f"key changed from {self.key!r} to {desc.key!r}")
        self._check_permitted(desc, tables)
        if attach:
            missing = [hook for hook in tables if not await self._serves(hook, limit)]
            if missing:
                raise ProtocolError(self.name, "Describe", f"declares {', '.join(missing)} but does not serve it")
        self.key = desc.key  # its tools are registered under the name it gives
        # At attach the tools are listed here (a listing refused refuses the attach). Afterwards
        # they are listed aside (_relist), when the server may have restarted (the connection
        # dropped since it was last described) or newly provides tools: the hook call that
        # re-described (after any failure, in any session) never waits for, or fails with, them.
        relist = desc.provides_tools and not attach and (drops != self.described_drops or not self.provides_tools)
        if attach and desc.provides_tools:
            self.tools, self.listing = await self._list_tools()
        self.tables, self.provides_tools = tables, desc.provides_tools
        self.described, self.described_drops = True, drops
        self.outage = None
        self.prompt_cache.clear()  # answers of the server as it was described before
        self._drop_idle()  # streams of an earlier connection are of no use
        if not desc.provides_tools and self.listing:  # it no longer provides any
            self._tools_are([], b"")
        if relist and (self.relisting is None or self.relisting.done()):
            self.relisting = self.in_background(self._relist())
        if self.follower is None:  # from its first Describe on
            self.follower = asyncio.get_running_loop().create_task(self._follow_connection())
        return self

    async def _relist(self) -> None:
        """ListTools after attach, aside from any hook call. Not answered (a restarting server):
        the tools as last listed stay on offer, and it asks again, waiting longer each time. A
        listing refused (malformed, an invalid tool): it contributes no tools until it lists
        acceptable ones (the next time it is described after a drop), and its last error says why."""
        pause = self.policy.timeout
        while True:
            try:
                tools, listing = await self._list_tools()
            except (NoAnswer, Unreachable) as exc:
                log.warning(
                    "middleware %s: its tools could not be listed again (asking again in %gs): %s",
                    self.name,
                    pause,
                    exc,
                )
                await asyncio.sleep(pause)
                pause = min(pause * 2, RELIST_PAUSE_MAX)
                continue
            except MiddlewareFailure as exc:
                why = f"its tools as listed again are refused ({exc.what}); it contributes none until it lists others"
                metrics.middleware_error(self, "ListTools", why)
                log.error("middleware %s: %s", self.name, why)
                tools, listing = [], b""
            if listing != self.listing:
                self._tools_are(tools, listing)
            return

    def _tools_are(self, tools: list[Tool], listing: bytes) -> None:
        """A new tool list (after attach): the host offers it from the next reply on."""
        self.tools, self.listing = tools, listing
        if self.tools_changed is not None:
            self.tools_changed(self)

    async def _describe_failed(
        self, exc: grpc.aio.AioRpcError, request: hooks_pb2.DescribeRequest, waited: float
    ) -> MiddlewareFailure:
        """What a failed Describe raises. One that waited for the server and ran out of time says
        only DEADLINE_EXCEEDED, for a server that is down as for one that hangs: a second ask that
        does not wait fails at once with the channel's own reason when it cannot connect (connection
        refused, a name that does not resolve, a TLS handshake refused)."""
        if exc.code() is not grpc.StatusCode.DEADLINE_EXCEEDED:
            return self._rpc_failed("Describe", exc, waited)
        if self.channel.get_state() is not grpc.ChannelConnectivity.READY:  # else connected: it hangs
            try:
                await self._describe_stub.Describe(
                    request, timeout=min(waited, 2.0), wait_for_ready=False, metadata=self.metadata
                )
            except grpc.aio.AioRpcError as probe:
                if probe.code() is grpc.StatusCode.UNAVAILABLE:
                    why = self._down(self._cannot_connect(probe.details(), f" (waited {waited:g}s)"))
                    return Unreachable(self.name, "Describe", why)
        return NoAnswer(self.name, "Describe", _no_answer(exc, waited))

    def _rpc_failed(self, call: str, exc: grpc.aio.AioRpcError, waited: float) -> MiddlewareFailure:
        """A unary call's failure, of the kind the host acts on: no answer in time (it may hang),
        unreachable (it may come back: at start the host waits for it), or anything else."""
        if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
            return NoAnswer(self.name, call, _no_answer(exc, waited))
        if exc.code() is grpc.StatusCode.UNAVAILABLE and any(k == NOT_READY for k, _ in exc.trailing_metadata() or ()):
            # The server itself said it cannot serve yet (hooks.proto, ListTools): no connection outage.
            return NotReady(self.name, call, f"not ready: UNAVAILABLE: {exc.details()}")
        cls = Unreachable if exc.code() is grpc.StatusCode.UNAVAILABLE else MiddlewareFailure
        return cls(self.name, call, self._failure(exc))

    def _failure(self, exc: grpc.aio.AioRpcError) -> str:
        """A call's failure in words; one that could not connect marks an outage (see connect)."""
        if exc.code() is grpc.StatusCode.UNAVAILABLE:
            return self._down(self._cannot_connect(exc.details()))
        return f"{exc.code().name}: {exc.details()}"

    def _cannot_connect(self, details: str | None, waited: str = "") -> str:
        """Why the channel could not connect, with what it may owe to TLS (a mismatch says only
        "Socket closed": an operator would look for a server that is down)."""
        tls = self.access.tls is not None and self.access.tls.enabled
        hint = tls_hint(
            details, tls, use_tls="security.middleware_tls", client_cert="security.middleware_tls cert, key"
        )
        return f"cannot connect to {self.address}{waited}: {details}" + (f" ({hint})" if hint else "")

    def _down(self, why: str) -> str:
        self.outage = why
        return why

    def _check_permitted(self, desc: hooks_pb2.MiddlewareDescription, tables: dict[str, SubscriptionTable]) -> None:
        """Least privilege, where Describe is read: the host decides the key, the hooks, the context
        and the tools a middleware gets; a Describe asking for more is refused (a re-Describe too)."""
        access, perms = self.access, self.access.permissions

        def refuse(what: str) -> ProtocolError:
            return ProtocolError(self.name, "Describe", f"{what}, which its configuration does not allow")

        if access.key and desc.key != access.key:
            raise refuse(f"reports key {desc.key!r} (configured: {access.key!r})")
        for hook, table in tables.items():
            if perms.hooks is not None and hook not in perms.hooks:
                raise refuse(f"serves {hook}")
            if table.wants_context and not perms.context:
                raise refuse(f"asks for the context (wants_context) in {hook}")
        if desc.provides_tools and not perms.tools:
            raise refuse("provides tools")

    def check_mutation(self, op: str, hook: str) -> None:
        """Raise ProtocolError when the permissions do not allow this Mutation op (protocol.py)."""
        self._check_permission(MUTATION_PERMISSION.get(op), op, hook)

    def check_overrides(self, names: Iterable[str], hook: str) -> None:
        """The same for the kwargs a call_next overrides (or clears)."""
        for name in names:
            self._check_permission(OVERRIDE_PERMISSION.get(name), f"overriding {name}", hook)

    def _check_permission(self, needed: str | None, what: str, hook: str) -> None:
        if needed is not None and not getattr(self.access.permissions, needed):
            raise ProtocolError(self.name, hook, f"{what} is not allowed by its configuration ({needed}: false)")

    async def _serves(self, hook: str, limit: float) -> bool:
        """Probe a declared hook at attach: open its stream and half-close it at once. A server
        without the service answers UNIMPLEMENTED; one that has it ends the stream (or anything
        else: only UNIMPLEMENTED counts against it)."""
        call = self.stubs[hook]()
        try:
            async with asyncio.timeout(limit):
                await call.done_writing()
                while await call.read() is not grpc.aio.EOF:
                    pass
        except grpc.aio.AioRpcError as exc:
            return exc.code() != grpc.StatusCode.UNIMPLEMENTED
        except (TimeoutError, asyncio.InvalidStateError):
            pass
        finally:
            call.cancel()
        return True

    def implements(self, hook: str) -> bool:
        return hook in self.tables

    def holds_replies(self) -> bool:
        """Replies wait for some hook of it (one not detached), as last described. A watcher's do
        not, nor do tools: one that fails is an error result for the model, not a failed reply."""
        return any(not table.detached for table in self.tables.values())

    async def get_middleware_key(self) -> str:
        return self.key

    def needs_describe(self) -> bool:
        """The last Describe may be out of date: the last call failed, or the connection dropped
        since (a server restarted between replies may implement other hooks or list other tools
        now, even when the channel is READY again by the time the next call comes)."""
        if not self.described or self.drops != self.described_drops:
            return True
        if self.channel.get_state() != grpc.ChannelConnectivity.READY:
            return True
        for idle in self.idle.values():  # loops, not any() over a generator: once per hook call
            for call in idle:
                if call.done():
                    return True
        return False

    async def _follow_connection(self) -> None:
        """Count the connection's drops (needs_describe), and describe it again as soon as it is
        connected again (the channel reconnects by itself): the next call would, but a middleware
        with tools only has no hook call to do it, and its tools are offered before any of them is
        called. Runs from attach to close."""
        ready = grpc.ChannelConnectivity.READY
        state = self.channel.get_state()
        while True:
            await self.channel.wait_for_state_change(state)
            was, state = state, self.channel.get_state()
            if was is ready:
                self.drops += 1
                # Its idle streams went with the connection; one not marked done yet (its status
                # still on the way) would be taken and fail the next call (a server restarted).
                self._drop_idle()
            if state is ready and self.needs_describe():
                try:
                    await self.connect(timeout=self.policy.timeout)
                except MiddlewareFailure as exc:  # the calls that follow find out themselves
                    log.debug("describing %s again after a reconnection: %s", self.name, exc)
                except Exception:  # a bug of ours: say so, and keep following the connection
                    log.exception("describing %s again after a reconnection", self.name)
                else:
                    # A server that is back (restarted, reachable again) is not failing, even
                    # if no reply calls it: an idle host's status would say so until one did.
                    metrics.answers_again(self)

    async def ensure_described(self) -> None:
        if self.needs_describe():
            await self.connect(timeout=self.policy.timeout)

    def new_invocation(self) -> int:
        """Ids increase (so a stream tells old from future ones) by a random step: a message a
        broken middleware sends after its finish, with the id it had plus one, is still an old one
        to the invocation that reuses the stream next."""
        self._invocation += 1 + _steps.getrandbits(32)
        return self._invocation

    def reachable(self) -> bool | None:
        """False while the channel cannot connect, True when connected or idle, None while it is
        connecting (unknown yet). Asks the channel to connect, so a dead server is noticed."""
        state = self.channel.get_state(try_to_connect=True)
        if state in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN):
            return False
        return None if state == grpc.ChannelConnectivity.CONNECTING else True

    async def wait_ready(self, timeout: float) -> bool:
        """Wait (bounded) until the channel is connected again, e.g. after a server restart."""
        try:
            async with asyncio.timeout(timeout):
                await self.channel.channel_ready()
            return True
        except TimeoutError:
            return False

    def stopped_answering(self) -> None:
        """It hangs as a whole (see no_answer): a middleware that hangs must not cost every reply its
        timeout. fail_open: every reply skips it for a while (_suspend). fail_closed: no reply can
        run without it, so its calls fail at once and the host refuses new replies
        (Host.required_unavailable) until it answers a Describe again, asked in the background
        every PROBE_EVERY seconds: it is back for the first reply after that."""
        hang = f"no answer within {self.policy.timeout:g}s at {time.strftime('%H:%M:%SZ', time.gmtime())}"
        if not self.policy.fail_open:
            if not self.unresponsive:  # calls that were waiting together: one hang, one probe
                self.unresponsive = hang
                self.in_background(self._probe())
            return
        self._suspend(hang)

    def _suspend(self, hang: str) -> None:
        """Skip it (fail_open: bypassed; fail_closed: its calls fail at once) for its timeout,
        doubled at each further suspension up to MAX_SUSPENSION, then try it again; one that
        answers a hook call is no longer counted."""
        now = time.monotonic()
        if now < self.suspended_until:  # calls that were waiting together: one hang, counted once
            return
        self.hangs += 1
        pause = min(self.policy.timeout * 2 ** (self.hangs - 1), MAX_SUSPENSION)
        self.suspended_until = now + pause
        self.last_hang = hang

    def answered(self) -> None:
        """A hook call got its answer: whatever hung before is over."""
        self.hangs = 0
        self.hung_sessions.clear()

    async def _probe(self) -> None:
        """Describe it until it answers (each within its timeout), then let calls through again."""
        while True:
            try:
                await self.connect(timeout=self.policy.timeout)
            except MiddlewareFailure:
                await asyncio.sleep(PROBE_EVERY)
                continue
            metrics.answers_again(self, after=self.unresponsive)
            self.unresponsive = ""
            return

    def no_answer(self, call: str, session: str | None = None) -> None:
        """``call`` (a hook, CallTool, Describe, ListTools) got no answer within the timeout, the
        connection up. The call itself fails (or is bypassed) per its policy; whether the middleware
        hangs as a whole is another question: a hook or tool call may be slow for one session only
        (one tenant's slow backend, one long tool) while the server answers every other. A Describe
        in the background tells (within the timeout): one that gets no answer either is a hang
        (stopped_answering: every reply skips it, or is refused); one that answers leaves it in
        service for everyone else. A Describe that got no answer is that check already. Calls
        that time out together share one check. A server whose hooks hang while its Describe
        answers (a stuck backend behind every hook) is told by ``session``, the hook call's: when
        hook calls of HANG_SESSIONS different sessions got no answer in a row, it is suspended
        (_suspend), whatever its policy, instead of costing every reply its timeout."""
        if call == "Describe":
            self.stopped_answering()
            return
        if session is not None:
            self.hung_sessions.add(session)
            # A hang after a suspension, with no answer since: the trial call after the pause
            # failed, so the pause resumes (doubled) at once, as a circuit breaker's half-open does.
            if self.hangs or len(self.hung_sessions) >= HANG_SESSIONS:
                # Whether its Describe answers is not known yet (a stopped process answers nothing):
                # the check below tells, and one that gets no answer makes it unresponsive.
                when = time.strftime("%H:%M:%SZ", time.gmtime())
                self._suspend(
                    f"no answer within {self.policy.timeout:g}s to hook calls of {len(self.hung_sessions)}"
                    f" session(s) in a row, at {when}"
                )
                self.hung_sessions.clear()
        if self.confirming is None or self.confirming.done():
            self.confirming = self.in_background(self._confirm_hang())

    async def _confirm_hang(self) -> None:
        """A bare Describe: whether the server answers at all (describing it again is the next
        call's business), without waiting for a connection (one that is down is no hang)."""
        request = hooks_pb2.DescribeRequest(protocol_version=PROTOCOL_VERSION)
        try:
            await self._describe_stub.Describe(
                request, timeout=self.policy.timeout, wait_for_ready=False, metadata=self.metadata
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                self.stopped_answering()
            # else down, or broken: the calls that follow find out themselves

    def skipped(self) -> str:
        """Why its hook calls fail (fail_closed) or are bypassed (fail_open) at once, without
        waiting for it; "" when it is called. Only a middleware that hung is skipped."""
        if self.unresponsive:
            return f"not called until it answers again after: {self.unresponsive}"
        if self.suspended_until:
            left = self.suspended_until - time.monotonic()
            if left > 0:
                return f"skipped for {left:.1f}s more after: {self.last_hang}"
        return ""

    def in_background(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``coro`` as a task of this middleware's: close() cancels the ones still running."""
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    def bypass_rest_of_reply(self, agent: Any) -> None:
        """fail_open, after a failure: the rest of ``agent``'s current reply goes on without this
        middleware, so one that hangs costs the reply one timeout, not one per hook call."""
        replies = getattr(agent, "replies_started", None)  # an agent of the host's (Agent)
        if replies is not None:
            self.bypassing[agent] = replies

    def bypassed_in_reply(self, agent: Any) -> bool:
        replies = getattr(agent, "replies_started", None)
        return replies is not None and self.bypassing.get(agent) == replies

    def failed(self) -> None:
        """After a failure, the next call re-runs Describe (the server may have restarted)."""
        self.described = False
        self._drop_idle()

    def take_stream(self, hook: str) -> tuple[Any, bool]:
        """An idle stream of this hook if a live one is left, else a new one; and whether it is
        reused (it may still hold messages of an earlier invocation)."""
        idle = self.idle[hook]
        while idle:
            call = idle.pop()
            if not call.done():  # a stream whose server went away has ended by now
                return call, True
        return self.stubs[hook](), False

    def stream_went_stale(self, hook: str) -> Any:
        """A reused idle stream of ``hook`` broke at its first use: its connection dropped (a
        restarted server) before the host noticed. The other idle streams went with it, and the
        server may be another version now: a new stream, and the next call describes it again. The
        stream does not wait for a connection: a server that is down fails the call at once, as the
        broken stream did (waiting for it to come back is the next Describe's business)."""
        self.described = False
        self._drop_idle()
        return self.stubs[hook](wait_for_ready=False)

    def release_stream(self, hook: str, call: Any) -> None:
        idle = self.idle[hook]
        if len(idle) < MAX_IDLE_STREAMS and not call.done():
            idle.append(call)
        else:
            call.cancel()

    def _drop_idle(self) -> None:
        for idle in self.idle.values():
            while idle:
                idle.pop().cancel()

    async def close(self) -> None:
        for task in [*self.background, self.follower]:
            if task is not None:
                task.cancel()
        self._drop_idle()
        await self.channel.close()

    # -- hook positions: every one goes through the same HookCall --------------------------------

    def on_reply(self, agent: Any, input_kwargs: dict, next_handler: Any) -> AsyncIterator[Any]:
        return self._call(HOOKS["on_reply"], agent, input_kwargs, next_handler).items()

    def on_reasoning(self, agent: Any, input_kwargs: dict, next_handler: Any) -> AsyncIterator[Any]:
        return self._call(HOOKS["on_reasoning"], agent, input_kwargs, next_handler).items()

    def on_acting(self, agent: Any, input_kwargs: dict, next_handler: Any) -> AsyncIterator[Any]:
        return self._call(HOOKS["on_acting"], agent, input_kwargs, next_handler).items()

    async def on_check_permission(self, agent: Any, input_kwargs: dict, next_handler: Any) -> Any:
        return await self._call(HOOKS["on_check_permission"], agent, input_kwargs, next_handler).value()

    async def on_compress_context(self, agent: Any, input_kwargs: dict, next_handler: Any) -> None:
        await self._call(HOOKS["on_compress_context"], agent, input_kwargs, next_handler).value()

    async def on_model_call(
        self, agent: Any, input_kwargs: dict, next_handler: Any
    ) -> AsyncIterator[Any] | ChatResponse:
        return await self._call(HOOKS["on_model_call"], agent, input_kwargs, next_handler).stream()

    async def on_system_prompt(self, agent: Any, prompt: str) -> str:
        state = agent.state
        slot = repr(state.middle_context.get(self.key))
        cached = self.prompt_cache.get(self._prompt_key(prompt, slot, state))
        if cached is None:
            cached = await self._call(HOOKS["on_system_prompt"], agent, {"prompt": prompt}, None).value()
            if len(self.prompt_cache) > 256:
                self.prompt_cache.clear()
            self.prompt_cache[self._prompt_key(prompt, slot, state)] = cached  # as described now
        return cached

    def _prompt_key(self, prompt: str, slot: str, state: Any) -> tuple[Any, ...]:
        """At most one call per ReAct iteration: an answer is kept by (prompt, reply, iteration, own
        slot); one declared cacheable by (prompt, own slot) alone, while its description is current."""
        table = self.tables.get("on_system_prompt")
        if table is not None and table.cacheable and not self.needs_describe():
            return (prompt, slot)
        return (prompt, state.session_id, state.reply_id, state.cur_iter, slot)

    def _call(self, spec: HookSpec, agent: Any, input_kwargs: dict, next_handler: Any) -> Any:
        return HookCall(self, spec, agent, input_kwargs, next_handler)

    # -- tools -------------------------------------------------------------------------------------

    async def list_tools(self) -> list[Tool]:
        """Its tools as listed when it was last described (connect)."""
        return list(self.tools)

    async def _list_tools(self) -> tuple[list[Tool], bytes]:
        """ListTools (part of describing it): the tools, and the answer as bytes to compare."""
        try:
            reply = await self._tools_stub.ListTools(
                hooks_pb2.ListToolsRequest(), timeout=self.policy.timeout, metadata=self.metadata
            )
        except grpc.aio.AioRpcError as exc:
            raise self._rpc_failed("ListTools", exc, self.policy.timeout) from None
        if reply is None:
            raise ProtocolError(self.name, "ListTools", _UNPARSED.format("a ToolDescriptorList"))
        return self._checked_tools(reply.tools), reply.SerializeToString(deterministic=True)

    def _checked_tools(self, descriptors: Any) -> list[Tool]:
        """Refuse at attach what a model provider would refuse later, or what would clash."""
        tools: list[Tool] = []
        seen: set[str] = set()
        for proto in descriptors:

            def bad(what: str, name: str = proto.name) -> ProtocolError:
                return ProtocolError(self.name, "ListTools", f"tool {name!r}: {what}")

            if len(tools) == MAX_MODEL_TOOLS:  # else every model call of every reply would be refused
                raise bad(
                    f"one too many: a middleware lists at most {MAX_MODEL_TOOLS} tools "
                    f"(a model request takes {MAX_MODEL_TOOLS})"
                )
            if proto.ByteSize() > MAX_TOOL_DESCRIPTOR_BYTES:
                raise bad(f"descriptor of {proto.ByteSize()} bytes (limit {MAX_TOOL_DESCRIPTOR_BYTES})")
            try:
                descriptor = codec.decode(proto)
            except (CodecError, KeyError, TypeError, ValueError) as exc:
                raise bad(f"malformed descriptor: {exc}") from None
            full = f"{self.name}__{descriptor.name}"
            if not descriptor.name:
                raise bad("an empty name")
            if not TOOL_NAME.fullmatch(full):
                raise bad(f"registered as {full!r}, which is not 1-64 of [a-zA-Z0-9_-]")
            if descriptor.name in seen:
                raise bad("listed twice")
            seen.add(descriptor.name)
            validators = {}
            for field in ("input_schema", "metadata_schema"):
                schema = getattr(descriptor, field)
                if schema is None:
                    continue
                try:
                    validators[field] = schema_validator(schema)
                except ValueError as exc:
                    raise bad(f"{field}: {exc}") from None
            kind = descriptor.input_schema.get("type", "object")
            if kind != "object":  # a model's function parameters are an object: providers refuse the request
                raise bad(f'input_schema is of type {kind!r}: a tool\'s input is an object ("type": "object")')
            tool = RemoteTool(descriptor, self)
            tool._validator = validators.get("input_schema")
            tools.append(tool)
        return tools


class RemoteTool(Tool):
    """A tool that executes in the middleware server that contributed it (ToolSource.CallTool)."""

    def __init__(self, descriptor: ToolDescriptor, middleware: RemoteMiddleware) -> None:
        super().__init__(descriptor)
        self.middleware = middleware

    async def call(self, tool_input: dict[str, Any], state: Any = None) -> AsyncIterator[ToolChunk | ToolResponse]:
        return self._stream(tool_input, state)

    async def _stream(self, tool_input: dict[str, Any], state: Any) -> AsyncIterator[ToolChunk | ToolResponse]:
        mw = self.middleware
        skipped = mw.skipped()  # it hung lately: fail now, not after another timeout
        if skipped:
            raise MiddlewareFailure(mw.name, "CallTool", skipped)
        request = hooks_pb2.CallToolRequest()
        codec.encode(ToolCallBlock(id="", name=self.descriptor.name, input=json.dumps(tool_input)), request.tool_call)
        request.tool_input.update(tool_input)
        if state is not None:
            request.context.session_id = state.session_id
            request.context.reply_id = state.reply_id
            slot = state.middle_context.get(mw.key)
            if slot is not None:
                json_to_value(slot, request.context.slot)
        # Reads are timed below. As for Describe, no wait for a server known to be down.
        connected = mw.channel.get_state() is grpc.ChannelConnectivity.READY  # so a drop is no "cannot connect"
        call = mw._tools_stub.CallTool(request, timeout=None, wait_for_ready=mw.outage is None, metadata=mw.metadata)
        items = size = 0  # bounded as a hook call's output is (Policy): a tool that streams without end fails
        try:
            while True:
                try:
                    async with asyncio.timeout(mw.policy.timeout):
                        msg = await call.read()
                except TimeoutError:
                    mw.failed()
                    what = f"no answer within {mw.policy.timeout:g}s"
                    if mw.channel.get_state() is not grpc.ChannelConnectivity.READY:  # it waited for a connection
                        what = mw._down(f"cannot connect to {mw.address} (waited {mw.policy.timeout:g}s)")
                    else:
                        mw.no_answer("CallTool")
                    raise MiddlewareFailure(mw.name, "CallTool", what) from None
                mw.outage, mw.hangs = None, 0  # it answers (fail_open: a later hang pauses it afresh)
                if msg is grpc.aio.EOF:
                    raise ProtocolError(mw.name, "CallTool", "stream ended without a tool_response")
                if msg is None:
                    raise ProtocolError(mw.name, "CallTool", _UNPARSED.format("an Item"))
                items, policy = items + 1, mw.policy
                size += (piece := msg.ByteSize())
                if piece > policy.max_item_bytes:
                    what = f"a tool sent a chunk of {piece} bytes (limit {policy.max_item_bytes})"
                    raise OutputLimitExceeded(mw.name, "CallTool", what)
                if items > policy.max_items:
                    raise OutputLimitExceeded(mw.name, "CallTool", f"a tool sent more than {policy.max_items} chunks")
                if size > policy.max_bytes:
                    raise OutputLimitExceeded(mw.name, "CallTool", f"a tool sent more than {policy.max_bytes} bytes")
                try:
                    item = codec.decode_item(msg)
                except (CodecError, KeyError, ValueError) as exc:
                    raise ProtocolError(mw.name, "CallTool", f"malformed item: {exc}") from None
                if type(item) not in EMITTABLE["on_acting"]:  # what a tool yields is what on_acting may
                    what = type(item).__name__
                    raise ProtocolError(mw.name, "CallTool", f"a tool streams chunks, then a response; not {what}")
                if (problem := tool_item_problem(item)) is not None:
                    raise ProtocolError(mw.name, "CallTool", problem)
                yield item
                if isinstance(item, ToolResponse):
                    return
        except grpc.aio.AioRpcError as exc:
            mw.failed()
            if connected or items:  # the connection was there, and went
                raise StreamBroken(mw.name, "CallTool", broken_stream(exc.code(), exc.details())) from None
            raise MiddlewareFailure(mw.name, "CallTool", mw._failure(exc)) from None
        finally:
            call.cancel()
