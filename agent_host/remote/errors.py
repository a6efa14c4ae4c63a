"""What a remote middleware's failure raises in the host: shared by the client (RemoteMiddleware)
and the protocol (HookCall) without either importing the other's module for them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from agentmw.data import ErrorType
from agentmw.errors import clipped
from agentmw.wire import MAX_TYPE_NAME, rebuilt_error

__all__ = [
    "KeptGoing",
    "MiddlewareFailure",
    "NoAnswer",
    "NotReady",
    "OutputLimitExceeded",
    "ProtocolError",
    "RemoteMiddlewareError",
    "StreamBroken",
    "Suspended",
    "Unreachable",
    "broken_stream",
    "remote_error",
]


class MiddlewareFailure(RuntimeError):
    """The middleware could not be used: unreachable, broken stream, timeout, protocol violation."""

    error_type = ErrorType.UPSTREAM

    def __init__(self, middleware: str, hook: str, what: str) -> None:
        what = clipped(what)  # it may quote what the middleware sent, and it reaches the client
        super().__init__(f"middleware {middleware!r} failed in {hook}: {what}")
        self.middleware, self.hook, self.what = middleware, hook, what


class StreamBroken(MiddlewareFailure):
    """The stream failed underneath: connection lost, server gone, stream ended early."""


def broken_stream(code: grpc.StatusCode, details: str | None) -> str:
    """Why a call that had its stream (a hook call, a tool call) failed, with this status.
    UNAVAILABLE is a connection gone (the server killed or restarted, the network cut), which its
    details do not say plainly ("Socket closed" is no TLS mismatch once the call was connected)."""
    what = f"{code.name}: {details}"
    return f"the server went away or the connection was lost ({what})" if code is grpc.StatusCode.UNAVAILABLE else what


class Unreachable(MiddlewareFailure):
    """The middleware's server cannot be connected to (down, restarting, a name not resolving):
    unlike a refusal (UNAUTHENTICATED, a protocol violation), waiting may cure it."""


class NotReady(MiddlewareFailure):
    """The server answered that it cannot serve yet (UNAVAILABLE on a connection that is up: a tool
    source whose backend is down): like an unreachable one, waiting may cure it."""


class NoAnswer(MiddlewareFailure):
    """The middleware did not answer (or take a message) within its timeout: it may hang."""


class Suspended(MiddlewareFailure):
    """A middleware that hung is not called for a while: a fail_open one is skipped, a
    fail_closed one's calls fail at once (RemoteMiddleware.no_answer)."""


class OutputLimitExceeded(MiddlewareFailure):
    """The middleware emitted more than its policy allows in one hook call (a runaway)."""


class KeptGoing(MiddlewareFailure):
    """The reply was interrupted and the middleware still sent items well after (protocol.py
    STOP_AFTER_INTERRUPT): speech of a long text, say. The reply ends without it."""


class ProtocolError(MiddlewareFailure):
    """The middleware sent a malformed, out-of-order or forbidden message."""

    def __init__(self, middleware: str, hook: str, what: str) -> None:
        super().__init__(middleware, hook, f"protocol violation: {what}")


class RemoteMiddlewareError(Exception):
    """The middleware's own code raised; propagated as an in-process middleware's exception would:
    of the class it raised, by name (``remote_error``: a subclass of this one and, when the host
    knows the name, of that class, so that an in-process layer around it catches it by class), with
    its message. ``retryable`` and ``error_type`` are set only when that exception had them
    (hooks.proto, Fail), so that whoever reads them with a default (retries, a failed reply's
    ErrorInfo) gets what it would get from the exception in-process. ``raised_in`` says where, for
    the texts the host makes of it (a failed reply's error)."""

    def __init__(self, middleware: str, hook: str, type_name: str, message: str, **attributes: Any) -> None:
        super().__init__(message)
        self.middleware, self.hook, self.type_name = middleware, hook, type_name
        self.raised_in = f"raised by middleware {middleware!r} in {hook}"
        self.__dict__.update(attributes)


def remote_error(
    middleware: str,
    hook: str,
    type_name: str,
    message: str,
    *,
    bases: Sequence[str] = (),
    attributes: Mapping[str, Any] | None = None,
    **fields: Any,
) -> RemoteMiddlewareError:
    """What the host raises for a middleware's Fail: ``RemoteMiddlewareError`` of its class (and
    of the nearest of its ``bases`` the host knows), with its ``attributes`` and ``fields``
    (``retryable``, ``error_type``): ``wire.decode_error_attributes``."""
    # Clipped, as a failure's text is: the middleware chose them, and they reach the client.
    type_name, message = clipped(type_name, MAX_TYPE_NAME), clipped(message)

    def init(exc: RemoteMiddlewareError) -> None:
        RemoteMiddlewareError.__init__(exc, middleware, hook, type_name, message, **fields)

    return rebuilt_error(RemoteMiddlewareError, type_name, message, init, bases=bases, attributes=attributes)
