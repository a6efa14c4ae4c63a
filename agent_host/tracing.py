"""OpenTelemetry tracing of the host and of middleware servers (see docs/tracing.md).

* ``configure()`` installs an SDK TracerProvider that exports spans over OTLP/gRPC (or to the
  console), but only when tracing is configured: the standard OTEL_* variables (an OTLP endpoint
  or OTEL_TRACES_EXPORTER) or the host's ``tracing:`` settings. Otherwise the OpenTelemetry API
  stays a no-op and nothing here does span work.
* The host makes one span per reply (``reply_span``) and a child per remote hook invocation
  (``hook_span``), whose W3C context goes to the middleware in ``HookContext.trace_context``.
* A middleware server continues that context around the author's code (``continued``, in
  agentmw.tracing), so the spans it makes are children of the host's: one trace per reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from opentelemetry import propagate, trace
from opentelemetry.trace import Span, Status, StatusCode

from agentmw.tracing import continued  # re-exported: the middleware side lives in the core

if TYPE_CHECKING:  # imported when tracing is configured (configure)
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider

TRACER_NAME = "agentmw"
SETTINGS = ("endpoint", "exporter", "service_name")  # the keys of host.yaml's ``tracing:``
EXPORTERS = ("otlp", "console", "none")

_NULL = contextlib.nullcontext()


def exporters(settings: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> list[str]:
    """The span exporters configured, [] for none: ``settings`` (host.yaml) first, then OTEL_*.
    An OTLP endpoint alone means "otlp"; OTEL_TRACES_EXPORTER=none or OTEL_SDK_DISABLED=true, none."""
    env = os.environ if env is None else env
    settings = settings or {}
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = settings.get("exporter") or env.get("OTEL_TRACES_EXPORTER")
    if names is None:
        endpoint = (
            settings.get("endpoint")
            or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        )
        return ["otlp"] if endpoint else []
    out = [n.strip().lower() for n in str(names).split(",") if n.strip()]
    unknown = [n for n in out if n not in EXPORTERS]
    if unknown:
        raise ValueError(f"unknown span exporter {unknown[0]!r} (known: {', '.join(EXPORTERS)})")
    return [n for n in out if n != "none"]


def configure(
    service_name: str, *, endpoint: str | None = None, settings: Mapping[str, Any] | None = None
) -> SdkTracerProvider | None:
    """Install and return an SDK TracerProvider when tracing is configured, else None.
    ``endpoint`` (a flag) overrides the configured OTLP endpoint. Raises ValueError on a bad setting."""
    settings = dict(settings or {})
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} (known: {', '.join(SETTINGS)})")
    if endpoint:
        settings["endpoint"] = endpoint
    names = exporters(settings)
    if not names:
        return None
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    # OTEL_SERVICE_NAME (and OTEL_RESOURCE_ATTRIBUTES) win over the default name; settings over both.
    name = settings.get("service_name") or os.environ.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    for exporter_name in names:
        if exporter_name == "console":
            exporter: Any = ConsoleSpanExporter()
        else:
            protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
                "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"
            )
            if protocol != "grpc":
                raise ValueError(f"OTLP protocol {protocol!r} is not supported (only grpc)")
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            _check_endpoint(settings)
            for variable in ("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", "OTEL_EXPORTER_OTLP_CERTIFICATE"):
                path = os.environ.get(variable)
                if path and not os.path.isfile(path):  # the exporter logs a traceback and goes on without it
                    raise ValueError(f"{variable}: {path!r} is not a file")
            try:
                exporter = OTLPSpanExporter(endpoint=settings.get("endpoint"))  # None: from OTEL_* variables
            except Exception as exc:  # its own settings' errors are plain Exceptions (e.g. a bad compression)
                raise ValueError(f"OTLP exporter: {exc}") from None
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return provider


def _check_endpoint(settings: Mapping[str, Any]) -> None:
    """The OTLP endpoint must name a host (and a valid port, if any): the exporter takes anything
    and only fails, in the background, at each export."""
    where, endpoint = "endpoint", settings.get("endpoint")
    for variable in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        if not endpoint:
            where, endpoint = variable, os.environ.get(variable)
    if not endpoint:
        return  # the exporter's default, localhost:4317
    url = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    try:
        port_ok = url.port is None or url.port > 0
    except ValueError:
        port_ok = False
    if url.scheme not in ("http", "https") or not url.hostname or not port_ok:
        raise ValueError(f"{where}: {endpoint!r} is not an OTLP/gRPC endpoint (e.g. http://127.0.0.1:4317)")


def enabled() -> bool:
    """An SDK TracerProvider is installed (by ``configure`` or by the embedding application)."""
    from opentelemetry.sdk.trace import TracerProvider

    return isinstance(trace.get_tracer_provider(), TracerProvider)


_tracers: dict[tuple[int, str], trace.Tracer] = {}


def tracer(name: str = TRACER_NAME) -> trace.Tracer:
    """The tracer of the installed provider (kept: an SDK provider makes a new one per call)."""
    provider = trace.get_tracer_provider()
    key = (id(provider), name)
    found = _tracers.get(key)
    if found is None:
        found = _tracers[key] = provider.get_tracer(name)
    return found


# ---------------------------------------------------------------------------------------------
# The host's spans.


@contextlib.contextmanager
def _reply_span(agent: Any, inputs: Any) -> Iterator[Span]:
    attributes = {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.agent.name": agent.name,
        "gen_ai.conversation.id": agent.state.session_id,
        "agentmw.reply.input": type(inputs).__name__ if inputs is not None else "none",
    }
    with tracer().start_as_current_span(f"reply {agent.name}", attributes=attributes) as span:
        try:
            yield span
        finally:
            span.set_attribute("agentmw.reply.id", agent.state.reply_id)
            span.set_attribute("agentmw.reply.parked", bool(agent.awaiting_calls()))


def reply_span(agent: Any, inputs: Any) -> contextlib.AbstractContextManager[Any]:
    """The current span for the whole reply; every hook invocation's span is its child. A shared
    no-op when the host does not trace."""
    return _reply_span(agent, inputs) if enabled() else _NULL


def hook_span(middleware: str, hook: str, detached: bool, carrier: MutableMapping[str, str]) -> Span | None:
    """A child of the current span (the reply's) for one remote hook invocation, put into
    ``carrier`` (the Begin's trace_context) so the middleware continues from it; None (and
    nothing done) when no span is current."""
    parent = trace.get_current_span()
    if not parent.is_recording():
        return None
    attributes: dict[str, str | bool] = {
        "agentmw.middleware.name": middleware,
        "agentmw.hook.name": hook,
        "agentmw.hook.detached": detached,
    }
    span = tracer().start_span(f"{hook} {middleware}", attributes=attributes)
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return span


def hook_bypassed(span: Span | None, exc: BaseException) -> None:
    """The middleware failed and the host went on without it (fail_open or detached)."""
    if span is not None:
        span.set_attribute("agentmw.hook.outcome", "bypassed")
        span.record_exception(exc)


def end_hook_span(span: Span | None, exc: BaseException | None) -> None:
    """End the invocation's span with its outcome: finished, bypassed, interrupted or failed."""
    if span is None:
        return
    if exc is None or isinstance(exc, GeneratorExit):  # a consumer that stopped early ends it normally
        if span.attributes.get("agentmw.hook.outcome") is None:  # type: ignore[attr-defined]
            span.set_attribute("agentmw.hook.outcome", "finished")
    elif isinstance(exc, asyncio.CancelledError):
        span.set_attribute("agentmw.hook.outcome", "interrupted")
    else:
        span.set_attribute("agentmw.hook.outcome", "failed")
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
    span.end()


__all__ = [
    "configure",
    "continued",
    "enabled",
    "end_hook_span",
    "exporters",
    "hook_bypassed",
    "hook_span",
    "reply_span",
    "tracer",
]
