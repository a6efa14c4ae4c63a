"""What the host tells its operators: Prometheus metrics, one log line per reply, middleware health.

* Metrics live in prometheus_client's default registry (so the process metrics come along) and are
  served over HTTP only when asked (``--metrics-port`` / ``metrics_port:``; ``serve``).
* ``reply(agent)`` wraps one reply: the open-replies gauge, the outcome counter, and at the end one
  info line: session, reply, outcome, duration, tokens, which middleware served it (a detached
  watcher's copies go out later: not listed) and which failed or were bypassed.
* ``hook_started`` / ``hook_failed`` / ``hook_ended`` are called once per remote hook invocation:
  its latency, failures and bypasses, and each middleware's health (its last error; one warning
  when it starts failing and one info line when it serves again, not a traceback per reply).

Cheap on the hot path: nothing here runs per streamed item; per reply and per hook invocation only.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics, start_http_server

from agentmw.data import Msg, now

log = logging.getLogger("agentmw.host")
disable_created_metrics()  # no *_created series: a timestamp per label set that nobody graphs

REPLIES = Counter(
    "agentmw_replies",
    "Replies that ended, by outcome: completed, interrupted, exceed_max_iters, error, parked, cancelled",
    ["outcome"],
)
REPLY_ERRORS = Counter("agentmw_reply_errors", "Replies that ended with an error, by error type", ["type"])
# Replies last from tens of milliseconds to minutes (tool rounds): the default buckets stop at 10 s.
LONG_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 45, 60, 90, 120, 180, 300, 600)
REPLY_SECONDS = Histogram(
    "agentmw_reply_duration_seconds", "Wall time of a reply (to its end or park)", buckets=LONG_BUCKETS
)
OPEN_REPLIES = Gauge(
    "agentmw_open_replies",
    "Replies running now: from having their session (lock, lease, loaded) to their end or park; "
    "Reply calls waiting for a busy session are not counted",
)
REFUSED = Counter(
    "agentmw_replies_refused",
    "Reply calls ended by a gRPC status instead of a reply's end (refused before the reply began: a "
    "required middleware missing, draining, limits, a busy session; or cut off), by status code",
    ["code"],
)
TOKENS = Counter("agentmw_tokens", "Model tokens of ended replies", ["kind"])
HOOK_SECONDS = Histogram(
    "agentmw_hook_duration_seconds",
    "Wall time of one remote hook invocation, the inner chain included (on_reply spans the reply)",
    ["middleware", "hook"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
MIDDLEWARE_FAILURES = Counter(
    "agentmw_middleware_failures",
    "Hook invocations whose middleware failed (unreachable, timeout, broken stream, protocol violation)",
    ["middleware", "hook"],
)
BYPASSES = Counter(
    "agentmw_middleware_bypasses",
    "Hook invocations the host went on without the middleware: failed ones (fail_open, or a detached "
    "hook), and a fail_open one's skipped for the rest of a reply after one failed",
    ["middleware", "hook"],
)
DESCRIBE_FAILURES = Counter(
    "agentmw_middleware_describe_failures",
    "Describes of an attached middleware that failed: asked again after a failure or a dropped "
    "connection, or while it hung (a hook call that waited for one fails with it, counted as its own)",
    ["middleware"],
)
MODEL_FAILURES = Counter(
    "agentmw_model_failed_attempts",
    "Model call attempts that failed (each followed by a retry, a fallback, or the reply's error), by model",
    ["model"],
)
MODEL_RETRIES = Counter("agentmw_model_retries", "Failed model call attempts retried with the same model", ["model"])


# ---------------------------------------------------------------------------------------------
# Serving.


def serve(port: int, host: str = "127.0.0.1") -> int:
    """Serve /metrics on ``host:port`` (port 0: any free one) from a thread; the port it got."""
    server, _thread = start_http_server(port, addr=host.strip("[]"))
    return int(server.server_port)


# ---------------------------------------------------------------------------------------------
# Replies.


@dataclass
class ReplyWatch:
    """One reply as the operator sees it; ``last`` is set by the host to each item it streams
    (an attribute store, the only per-item cost), so the final Msg is known at the end."""

    session_id: str
    started: float = field(default_factory=time.perf_counter)
    acted: dict[str, None] = field(default_factory=dict)  # middleware that served a hook, in order
    trouble: dict[str, str] = field(default_factory=dict)  # middleware -> "bypassed" / "failed"
    last: Any = None
    # Why it failed after its final Msg (the host could not store its end): the client got an ERROR end.
    error: Any = None


_current: contextvars.ContextVar[ReplyWatch | None] = contextvars.ContextVar("agentmw_reply", default=None)


@contextlib.contextmanager
def reply(agent: Any) -> Iterator[ReplyWatch]:
    """Around one reply of ``agent``: counts it, and logs one line when it ends (however it ends).
    Hook invocations of the reply (its task and the tasks it starts) are attributed to it."""
    watch = ReplyWatch(agent.state.session_id)
    token = _current.set(watch)
    OPEN_REPLIES.inc()
    outcome = "cancelled"
    try:
        yield watch
        outcome = _outcome(agent, watch.last)
    except Exception:  # its end could not be stored (a cancellation stays "cancelled")
        outcome = "error"
        raise
    finally:
        OPEN_REPLIES.dec()
        _current.reset(token)
        _ended(agent, watch, outcome)


def reply_refused(session_id: str, code: str, why: str) -> None:
    """A Reply call that ended with a status, not a reply's end: counted and said once."""
    REFUSED.labels(code).inc()
    log.info("reply session=%s refused %s: %s", session_id, code, why)


def _outcome(agent: Any, final: Any) -> str:
    if agent.awaiting_calls():
        return "parked"
    if isinstance(final, Msg) and final.finished_reason is not None:
        return final.finished_reason.value
    return "error"


def _ended(agent: Any, watch: ReplyWatch, outcome: str) -> None:
    seconds = time.perf_counter() - watch.started
    final = watch.last if isinstance(watch.last, Msg) else None
    usage = final.usage if final is not None else None
    tokens_in, tokens_out = (usage.input_tokens, usage.output_tokens) if usage is not None else (0, 0)
    REPLIES.labels(outcome).inc()
    REPLY_SECONDS.observe(seconds)
    if tokens_in or tokens_out:
        TOKENS.labels("input").inc(tokens_in)
        TOKENS.labels("output").inc(tokens_out)
    error = ""
    if outcome == "error":
        info = watch.error or (final.error if final is not None else None)
        REPLY_ERRORS.labels(info.type.value if info is not None else "unknown").inc()
        error = f" error={(info.message if info is not None else '')!r}"
    trouble = " ".join(f"{how}={name}" for name, how in watch.trouble.items())
    log.info(
        "reply session=%s reply=%s outcome=%s duration=%.3fs tokens=%d/%d middleware=%s%s%s",
        watch.session_id,
        agent.state.reply_id or "-",
        outcome,
        seconds,
        tokens_in,
        tokens_out,
        ",".join(watch.acted) or "-",
        f" {trouble}" if trouble else "",
        error,
    )


def quiet_failure(exc: BaseException) -> bool:
    """A failure the reply log line and the middleware or store warnings already tell (a
    middleware, a model or the session store that failed): no traceback for it. Anything else is
    a host bug worth one."""
    from .models.base import ModelError
    from .remote.errors import MiddlewareFailure
    from .store import STORE_ERRORS, LeaseLostError

    return isinstance(exc, (MiddlewareFailure, ModelError, LeaseLostError, *STORE_ERRORS))


def model_attempt_failed(failure: Any) -> dict[str, Any]:
    """Count a failed model attempt (a models.retry.Failure); its dict, for the model-call events."""
    MODEL_FAILURES.labels(failure.model).inc()
    if failure.delay is not None:  # a retry of the same model follows
        MODEL_RETRIES.labels(failure.model).inc()
    return failure.as_dict()


# ---------------------------------------------------------------------------------------------
# Middleware: hook invocations and health.


@dataclass
class MiddlewareHealth:
    """What the host saw of one attached middleware (shown by ListMiddleware / ``agentmw status``)."""

    failing: bool = False
    last_error: str = ""
    last_error_at: str = ""  # ISO 8601, UTC
    failed_at: float = 0.0  # perf_counter of the last failure
    failures: int = 0
    bypasses: int = 0  # counted with agentmw_middleware_bypasses, by count_bypass() alone


_health: weakref.WeakKeyDictionary[Any, MiddlewareHealth] = weakref.WeakKeyDictionary()


def health(mw: Any) -> MiddlewareHealth:
    found = _health.get(mw)
    if found is None:
        found = _health[mw] = MiddlewareHealth()
    return found


def hook_started() -> float:
    return time.perf_counter()


def hook_failed(mw: Any, hook: str, exc: BaseException, *, bypassed: bool, in_reply: bool = True) -> None:
    """The middleware failed in one invocation; ``bypassed``: the host goes on without it.
    ``in_reply`` False: a detached watcher's delivery, after the invocation ended (its reply may
    be over, and the task that delivers belongs to whichever reply released it): no reply's."""
    _went_wrong(mw, exc, bypassed=bypassed).failures += 1
    MIDDLEWARE_FAILURES.labels(mw.name, hook).inc()
    if bypassed:
        count_bypass(mw, hook)
    watch = _current.get() if in_reply else None
    if watch is not None:
        watch.trouble[mw.name] = "bypassed" if bypassed else "failed"


def count_bypass(mw: Any, hook: str) -> None:
    """The host went on without ``mw`` in one ``hook`` call: one count, which status (``bypasses``)
    and /metrics both show."""
    health(mw).bypasses += 1
    _bypasses(mw.name, hook).inc()


@functools.lru_cache(maxsize=1024)
def _bypasses(name: str, hook: str) -> Any:
    """BYPASSES' child (as _hook_seconds): a fail_open middleware skipped for the rest of a reply
    is counted at each of its hook calls."""
    return BYPASSES.labels(name, hook)


def describe_failed(mw: Any, exc: BaseException) -> None:
    """Describing an attached middleware again failed (RemoteMiddleware.connect): a Describe's
    failure, counted as one; no hook call's (one that waited for it says so itself)."""
    DESCRIBE_FAILURES.labels(mw.name).inc()
    _went_wrong(mw, exc, bypassed=mw.policy.fail_open or not mw.holds_replies())


def _went_wrong(mw: Any, exc: BaseException, *, bypassed: bool) -> MiddlewareHealth:
    """Its last error; and one warning when it starts failing (once per outage, not per reply)."""
    h = health(mw)
    h.last_error, h.last_error_at, h.failed_at = str(exc), now(), time.perf_counter()
    if not h.failing:
        h.failing = True
        then = "replies go on without it" if bypassed else "replies that reach it fail"
        log.warning("middleware %s at %s is failing, %s until it is back: %s", mw.name, mw.address, then, exc)
    return h


def middleware_error(mw: Any, call: str, what: str) -> None:
    """A failure of the middleware outside a hook call (its tools refused when listed again):
    its last error, shown by ListMiddleware, without counting a failed hook call."""
    h = health(mw)
    h.last_error, h.last_error_at = f"middleware {mw.name!r} failed in {call}: {what}", now()


@functools.lru_cache(maxsize=1024)
def _hook_seconds(name: str, hook: str) -> Any:
    """HOOK_SECONDS' child of a middleware and hook: labels() takes a lock and builds a key on
    every call, which showed in the per-invocation profile."""
    return HOOK_SECONDS.labels(name, hook)


def hook_ended(mw: Any, hook: str, started: float, exc: BaseException | None, *, served: bool = True) -> None:
    """One invocation ended (``exc``: how, if it raised): its latency; and, when the middleware
    served it, that it acted in the reply and, if it had been failing, the news that it is back.
    ``served`` False: it did not, though nothing raised: a detached watcher's invocation ends
    before its copies are even delivered (detached.py tells how that went: ``answers_again`` or
    ``hook_failed``), and a hook the server no longer implements ran without it."""
    _hook_seconds(mw.name, hook).observe(time.perf_counter() - started)
    if exc is not None or not served:
        return
    h = _health.get(mw)
    if h is not None and h.failed_at >= started:  # it failed in this invocation, which went on without it
        return
    watch = _current.get()
    if watch is not None:
        watch.acted[mw.name] = None
    answers_again(mw)


def answers_again(mw: Any, after: str = "") -> None:
    """A call of it worked (a hook call served, a watcher's copies delivered, a Describe once its
    connection is back or once it hung): if it had been failing, it is not any more. One info
    line, also when ``after`` (what it had stopped doing) is given and no call failed meanwhile."""
    h = _health.get(mw)
    was = h is not None and h.failing
    if h is not None:
        h.failing = False
    if was or after:
        log.info("middleware %s at %s answers again%s", mw.name, mw.address, f" after {after}" if after else "")


def middleware_status(mw: Any) -> dict[str, Any]:
    """MiddlewareInfo's status fields (host.proto, 20+) of an attached RemoteMiddleware."""
    h = _health.get(mw) or MiddlewareHealth()
    reachable = mw.reachable()
    health = "connecting" if reachable is None else "reachable" if reachable else "unreachable"
    return {
        # A fail_closed one that hung, connected but not answering (RemoteMiddleware.stopped_answering).
        "health": "unresponsive" if mw.unresponsive and reachable else health,
        "last_error": h.last_error,
        "last_error_at": h.last_error_at,
        "failures": h.failures,
        "bypasses": h.bypasses,
        "failing": h.failing,
        "skipped_for": max(getattr(mw, "suspended_until", 0.0) - time.monotonic(), 0.0),
    }


__all__ = [
    "MiddlewareHealth",
    "ReplyWatch",
    "answers_again",
    "count_bypass",
    "describe_failed",
    "health",
    "hook_ended",
    "hook_failed",
    "hook_started",
    "middleware_error",
    "middleware_status",
    "model_attempt_failed",
    "quiet_failure",
    "reply",
    "reply_refused",
    "serve",
]
