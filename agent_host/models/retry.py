"""Retries with backoff, then fallback models: the one policy around every model call.

A model id is tried up to ``max_retries + 1`` times while its errors are retryable, waiting
between attempts as the server asked (``Retry-After`` / ``retry-after-ms``, capped at the
policy's ``max_delay``) or else exponentially with jitter, and never past the policy's
``deadline``; then each fallback id the same way. The waiting and stopping are tenacity's.

The providers' SDKs do not retry on their own (the OpenAI SDK would retry quota exhaustion, the
DashScope SDK a request whose connection failed, and their retries are invisible to the host;
dashscope.py turns that resend off): every attempt goes through the on_model_call chain, is
logged, and is reported to ``on_failure`` so the client sees it on the model-call events.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, stop_before_delay
from tenacity.wait import wait_exponential_jitter

from agentmw.data import ErrorType
from agentmw.errors import error_text, raised_where

from .base import ModelError

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Waits between attempts of one model, in seconds (a model's ``retry:`` config)."""

    initial_delay: float = 0.5  # the first wait; doubled every retry, with up to the same again of jitter
    max_delay: float = 8.0  # no wait is longer (a longer Retry-After is cut to this)
    deadline: float = 60.0  # no retry whose wait would end later than this after the first attempt

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None) -> RetryPolicy:
        if config is not None and not isinstance(config, Mapping):
            raise ValueError(f"retry: expected a mapping of initial_delay, max_delay, deadline, got {config!r}")
        unknown = set(config or {}) - {"initial_delay", "max_delay", "deadline"}
        if unknown:
            raise ValueError(f"unknown retry setting(s) {sorted(unknown)} (known: initial_delay, max_delay, deadline)")
        for key, value in (config or {}).items():  # a negative deadline would silently mean no retries
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"retry: {key}: expected seconds >= 0, got {value!r}")
        return cls(**{k: float(v) for k, v in (config or {}).items()})


@dataclass(slots=True)
class Failure:
    """One failed attempt, as reported to the client."""

    model: str
    error: BaseException
    attempt: int  # 1-based, per model
    delay: float | None  # the wait before the next attempt of this model; None: no retry follows

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model,
            "attempt": self.attempt,
            "error_type": str(getattr(self.error, "error_type", ErrorType.UNKNOWN)),
            "error": error_text(self.error),
        }
        request_id = getattr(self.error, "request_id", "")  # a ModelError's
        if request_id:
            out["request_id"] = request_id
        if self.delay is not None:
            out["retry_in"] = round(self.delay, 3)
        return out


class AllModelsFailed(ModelError):
    """Every attempt of every candidate model failed; the message names each model's last failure."""

    def __init__(self, failures: list[Failure]) -> None:
        last: dict[str, Failure] = {}
        for failure in failures:
            last[failure.model] = failure
        final = failures[-1].error
        text = "; ".join(f"{m} (attempt {f.attempt}): {f.error}{raised_where(f.error)}" for m, f in last.items())
        super().__init__(
            f"all models failed: {text}" if len(last) > 1 else str(final),
            error_type=getattr(final, "error_type", ErrorType.UNKNOWN),
            retryable=False,
            status=getattr(final, "status", None),
            code=getattr(final, "code", ""),
        )
        self.failures = failures
        self.request_id = getattr(final, "request_id", "")


def _retryable(exc: BaseException) -> bool:
    # tenacity catches BaseException: an interrupt (CancelledError, landing in an on_model_call
    # middleware's code as well as in the model's) must end the call, not start another attempt.
    if not isinstance(exc, Exception):
        return False
    return bool(getattr(exc, "retryable", True))  # a non-ModelError (a middleware's): try again


class _Wait:
    """The server's Retry-After when it gave one, else exponential backoff with jitter."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.backoff = wait_exponential_jitter(
            multiplier=policy.initial_delay, max=policy.max_delay, jitter=policy.initial_delay
        )

    def __call__(self, state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        asked = getattr(exc, "retry_after", None)
        # A number of seconds; anything else (a remote middleware's exception carries what it
        # sent) is as if none had been asked for.
        if isinstance(asked, int | float) and not isinstance(asked, bool) and 0 <= asked < math.inf:
            return min(float(asked), self.policy.max_delay)
        return self.backoff(state)


async def call_with_fallback(
    candidates: list[tuple[str, int, RetryPolicy]],
    attempt: Callable[[str], Awaitable[T]],
    on_failure: Callable[[Failure], None] | None = None,
    where: str = "",
) -> tuple[T, str]:
    """Run ``attempt(model_id)`` for each ``(model_id, max_retries, policy)`` in turn until one
    succeeds; returns its result and id. Raises ``AllModelsFailed`` (or the only error).
    ``where``: whose call it is (``session=… reply=…``), for the warnings: on a busy host a
    failing model's lines are otherwise not told apart."""
    at = f" in {where}" if where else ""
    failures: list[Failure] = []
    for model_id, max_retries, policy in candidates:
        wait = _Wait(policy)

        def record(state: RetryCallState, model_id: str = model_id) -> None:  # before each wait
            exc = state.outcome.exception() if state.outcome else None
            assert exc is not None  # it waits only after an attempt that raised
            failure = Failure(model_id, exc, state.attempt_number, state.upcoming_sleep)
            failures.append(failure)
            log.warning(
                "model %s attempt %d failed%s, retrying in %.2fs: %s", model_id, failure.attempt, at, failure.delay, exc
            )
            if on_failure is not None:
                on_failure(failure)

        retrying = AsyncRetrying(
            stop=stop_after_attempt(max_retries + 1) | stop_before_delay(policy.deadline),
            wait=wait,
            retry=retry_if_exception(_retryable),
            before_sleep=record,
            reraise=True,
        )
        try:
            # Called, not iterated (``async for try_ in retrying``): re-raised from the iterator's
            # __anext__, an attempt's StopAsyncIteration (a middleware's on_model_call may raise
            # one) ended the loop as if it had succeeded, with no result (UnboundLocalError).
            result: T = await retrying(attempt, model_id)
        except Exception as exc:
            last = failures[-1] if failures else None
            if last is None or last.error is not exc:  # the final attempt (no sleep follows it)
                attempts = retrying.statistics.get("attempt_number", 1)
                failure = Failure(model_id, exc, attempts, None)
                failures.append(failure)
                if on_failure is not None:
                    on_failure(failure)
            then = "" if model_id == candidates[-1][0] else ", falling back"
            log.warning("model %s failed%s%s: %s", model_id, at, then, exc)
            continue
        return result, model_id
    if len(failures) == 1 or len({f.model for f in failures}) == 1:
        raise failures[-1].error
    raise AllModelsFailed(failures)
