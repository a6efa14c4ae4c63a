"""The middleware server's side of tracing (docs/tracing.md): continue the host's trace around the
author's code, so the spans a middleware makes are children of the host's hook span. Needs only the
OpenTelemetry API (a no-op until the process installs a TracerProvider); the host's side, which
configures exporters and makes the reply and hook spans, is agent_host.tracing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate

_NULL = contextlib.nullcontext()


@contextlib.contextmanager
def _continued(carrier: Mapping[str, str]) -> Iterator[None]:
    token = otel_context.attach(propagate.extract(carrier))
    try:
        yield
    finally:
        otel_context.detach(token)


def continued(carrier: Mapping[str, str]) -> contextlib.AbstractContextManager[Any]:
    """Make the host's span (``carrier``: a HookContext.trace_context) current while the
    author's hook runs; a shared no-op when the host sent none."""
    return _continued(carrier) if carrier else _NULL


__all__ = ["continued"]
