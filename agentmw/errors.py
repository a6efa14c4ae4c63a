"""The host's error types that cross the wire by name: a middleware raises them (or sees them raised
by the host's pipeline) and the host and the SDK rebuild them by name (agentmw.wire.KNOWN_ERRORS). They live in the
core so that a middleware server needs no host; the host's modules import them from here."""

from __future__ import annotations

import asyncio

from .data import ChatResponse, ErrorType

MAX_TEXT = 8192  # characters kept of a text another process sent (an error message, a traceback)


def clipped(text: str, limit: int = MAX_TEXT, *, tail: bool = False) -> str:
    """``text`` at most ``limit`` characters (its end with ``tail``: a traceback's last frames),
    saying how much more there was: what another process says reaches logs and clients bounded."""
    if len(text) <= limit:
        return text
    more = f"({len(text) - limit} more characters)"
    return f"... {more} {text[-limit:]}" if tail else f"{text[:limit]}... {more}"


def exception_error_type(exc: BaseException) -> ErrorType | None:
    """An exception's ``error_type`` as an ErrorType; None when it has none, or one that is not an
    ErrorType value (as if it had none: a failed reply's error is then ``internal``)."""
    value = getattr(exc, "error_type", None)
    try:
        return None if value is None else ErrorType(value)
    except ValueError:
        return None


class ConfigError(ValueError):
    """A configuration problem; the message names what and where."""


class ModelError(Exception):
    """A model call failed. ``retryable`` errors (throttling, 5xx, connection, a bad response) may
    be retried; ``retry_after`` is the delay the server asked for; ``request_id`` is the
    provider's id of the request (the message ends with it, so support can find the call).
    ``partial`` is set when a model client's call failed: what had arrived until then (nothing,
    when it failed before the first chunk), with the usage so far, ``created_at`` when it failed and
    ``usage.time`` how long the attempt took."""

    def __init__(
        self,
        message: str,
        *,
        error_type: ErrorType = ErrorType.UNKNOWN,
        retryable: bool = False,
        status: int | None = None,
        code: str = "",
        request_id: str = "",
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message + (f" (request id {request_id})" if request_id else ""))
        self.error_type = error_type
        self.retryable = retryable
        self.status = status
        self.code = code
        self.request_id = request_id
        self.retry_after = retry_after
        self.partial: ChatResponse | None = None


class UnknownModelError(KeyError):
    def __str__(self) -> str:
        return f"unknown model id {self.args[0]!r} (registered: {', '.join(self.args[1]) or 'none'})"


class ReplyGrammarError(RuntimeError):
    """The reply's items break the grammar; the reply ends with ReplyEndEvent(ERROR) saying how."""

    error_type = ErrorType.INTERNAL


__all__ = [
    "MAX_TEXT",
    "ConfigError",
    "ModelError",
    "ReplyGrammarError",
    "UnknownModelError",
    "clipped",
    "error_text",
    "own_cancellation",
    "raised_where",
]


def raised_where(exc: BaseException) -> str:
    """ " (raised by middleware 'x' in hook)" for an exception a remote middleware raised (its
    ``raised_in``, set by the host), else "": an error text the client sees ends with it, so that
    it says where, as the in-process traceback would."""
    raised_in = getattr(exc, "raised_in", None)
    return f" ({raised_in})" if isinstance(raised_in, str) else ""


def error_text(exc: BaseException) -> str:
    """An exception as a client reads it: "Type: message", clipped (the message may quote what a
    middleware or a model sent), and where a remote middleware raised it, kept when clipped."""
    where = raised_where(exc)
    return clipped(f"{type(exc).__name__}: {exc}", MAX_TEXT - len(where)) + where


def own_cancellation(exc: BaseException) -> bool:
    """``exc`` cancels the running task (Task.cancel(), not withdrawn since by uncancel), rather
    than being a CancelledError some code raised itself (say, awaiting a task that was cancelled),
    which is an exception like any other: the host's reply loop and the SDK tell them apart so."""
    if not isinstance(exc, asyncio.CancelledError):
        return False
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
