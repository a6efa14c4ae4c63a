"""``agentmw-traces``: a small OTLP/gRPC trace receiver that shows what the host and the
middleware servers traced (also ``python -m clients.traces``).

    agentmw-traces --listen 127.0.0.1:4317          # each trace as an indented span tree
    agentmw-traces --listen 127.0.0.1:4317 --json   # one JSON object per span, as spans arrive

Point the processes at it with OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317. A trace is
printed once no span of it arrived for ``--settle`` seconds (default 6: each process exports in
batches, every 5 s by default, so one trace's batches from the host and the middleware servers
come up to that far apart). Spans that arrive for a trace already printed are printed the same
way, as late additions to it under their parents; at exit, whatever is still pending.
``Receiver`` is the same thing in-process (the demo and the tests use it).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterable
from concurrent import futures
from typing import Any, TextIO

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2

from agentmw import transport
from agentmw.commandline import description, non_negative

# Attributes worth a look in a tree line, with a short label (the rest: --json).
KEY_ATTRIBUTES = {
    "agentmw.hook.outcome": "outcome",
    "gen_ai.conversation.id": "conversation",
    "agentscope.agent.reply_id": "reply",
    "gen_ai.request.model": "model",
    "gen_ai.usage.input_tokens": "in",
    "gen_ai.usage.output_tokens": "out",
    "gen_ai.response.finish_reasons": "finish",
    "gen_ai.tool.call.arguments": "args",
    "gen_ai.tool.call.result": "result",
    "agentscope.agent.hitl_pending_tools": "hitl_pending",
    "agentscope.agent.external_execution_pending_tools": "external_pending",
    "agentscope.agent.is_external_execution": "external",
    "agentscope.agent.incoming_event_type": "incoming",
}
VALUE_WIDTH = 60
# The OTel SDK exports a process's spans every 5 s by default (OTEL_BSP_SCHEDULE_DELAY), so the
# batches of one trace from several processes can come that far apart: wait a little longer.
DEFAULT_SETTLE = 6.0


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    if kind == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, kind) if kind else None


def _attributes(kvs: Iterable[common_pb2.KeyValue]) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def span_dicts(request: trace_service_pb2.ExportTraceServiceRequest) -> list[dict[str, Any]]:
    """The spans of one export, as plain dicts (ids in hex, times in ns since the epoch)."""
    out = []
    for rs in request.resource_spans:
        service = _attributes(rs.resource.attributes).get("service.name", "")
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    {
                        "trace_id": s.trace_id.hex(),
                        "span_id": s.span_id.hex(),
                        "parent_span_id": s.parent_span_id.hex(),
                        "name": s.name,
                        "service": service,
                        "scope": ss.scope.name,
                        "start_ns": s.start_time_unix_nano,
                        "end_ns": s.end_time_unix_nano,
                        "status": {0: "unset", 1: "ok", 2: "error"}.get(s.status.code, str(s.status.code)),
                        "status_message": s.status.message,
                        "attributes": _attributes(s.attributes),
                    }
                )
    return out


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every span received; ``on_span`` (if given) sees each as it arrives."""

    def __init__(self, on_span: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.spans: list[dict[str, Any]] = []
        self.arrived: dict[str, float] = {}  # trace id -> monotonic time of its latest span
        self.on_span = on_span
        self.changed = threading.Condition()

    def Export(self, request: Any, context: Any) -> trace_service_pb2.ExportTraceServiceResponse:
        spans = span_dicts(request)
        with self.changed:
            self.spans.extend(spans)
            for span in spans:
                self.arrived[span["trace_id"]] = time.monotonic()
            self.changed.notify_all()
            if self.on_span is not None:  # under the lock: exports come on several threads, lines whole
                for span in spans:
                    self.on_span(span)
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, predicate: Callable[[list[dict[str, Any]]], bool], timeout: float) -> list[dict[str, Any]]:
        """The spans so far, once ``predicate(spans)`` holds or ``timeout`` seconds passed."""
        with self.changed:
            self.changed.wait_for(lambda: predicate(self.spans), timeout)
            return list(self.spans)

    def traces(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        with self.changed:
            for span in self.spans:
                out.setdefault(span["trace_id"], []).append(span)
        return out


class Receiver:
    """An OTLP/gRPC trace receiver in this process (a gRPC server on its own threads)."""

    def __init__(self, on_span: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.collector = Collector(on_span)
        # SERVER_OPTIONS: a taken port fails to bind (no SO_REUSEPORT) instead of sharing the spans
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=transport.SERVER_OPTIONS)
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self.collector, self.server)
        self.address = ""

    def start(self, listen: str = "127.0.0.1:0") -> Receiver:
        port = transport.listen(self.server, listen)  # CannotListen, an OSError
        self.server.start()
        self.address = f"{listen.rsplit(':', 1)[0]}:{port}"
        return self

    @property
    def endpoint(self) -> str:
        """What OTEL_EXPORTER_OTLP_ENDPOINT should say."""
        return f"http://{self.address}"

    def stop(self) -> None:
        self.server.stop(0)


# ---------------------------------------------------------------------------------------------
# Showing traces.


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= VALUE_WIDTH else text[: VALUE_WIDTH - 1] + "…"


def format_trace(spans: list[dict[str, Any]], shown: Collection[str] = ()) -> str:
    """One trace as an indented tree: name, duration, service and key attributes per span. With
    ``shown`` (ids of its spans printed before), only the others, as late additions: each under its
    parent, the earlier spans on the way to them by name alone."""
    by_id = {s["span_id"]: s for s in spans}
    children: dict[str, list[dict[str, Any]]] = {}
    for span in by_id.values():
        parent = span["parent_span_id"] if span["parent_span_id"] in by_id else ""
        children.setdefault(parent, []).append(span)
    new = [s for s in by_id.values() if s["span_id"] not in shown]
    on_the_way: set[str] = set()  # the new spans and their ancestors: what the tree shows
    for span in new:
        span_id = span["span_id"]
        while span_id in by_id and span_id not in on_the_way:
            on_the_way.add(span_id)
            span_id = by_id[span_id]["parent_span_id"]
    start = min(s["start_ns"] for s in new)
    end = max(s["end_ns"] for s in new)
    services = ", ".join(sorted({s["service"] for s in new}))
    trace_id = spans[0]["trace_id"]
    if len(new) == len(by_id):
        lines = [f"trace {trace_id}  {len(new)} spans, {(end - start) / 1e6:.1f} ms, {services}"]
    else:
        lines = [f"late additions to trace {trace_id}  {len(new)} spans (of {len(by_id)}), {services}"]

    def walk(parent: str, depth: int) -> None:
        for span in sorted(children.get(parent, []), key=lambda s: (s["start_ns"], s["end_ns"])):
            if span["span_id"] not in on_the_way:
                continue
            indent = "  " * depth
            if span["span_id"] in shown:  # printed before: only where the new spans hang
                lines.append(f"{indent}{span['name']}  [{span['service']}]  (printed before)")
            else:
                attrs = span["attributes"]
                attrs_text = " ".join(
                    f"{label}={_short(attrs[key])}" for key, label in KEY_ATTRIBUTES.items() if key in attrs
                )
                error = f" ERROR {span['status_message']}" if span["status"] == "error" else ""
                duration = (span["end_ns"] - span["start_ns"]) / 1e6
                head = f"{indent}{span['name']}  {duration:.1f} ms  [{span['service']}]{error}"
                lines.append(f"{head}  {attrs_text}".rstrip())
            walk(span["span_id"], depth + 1)

    walk("", 1)
    return "\n".join(lines)


def print_settled(collector: Collector, out: TextIO, settle: float, shown: dict[str, set[str]]) -> None:
    """Print the spans not printed yet of each trace no span of which arrived for ``settle``
    seconds: a whole trace, or late additions to one printed before. ``shown``: trace id -> the
    ids of its spans printed (kept per span, not per trace, so that a late batch is not dropped)."""
    now = time.monotonic()
    for trace_id, spans in collector.traces().items():
        printed = shown.setdefault(trace_id, set())
        fresh = {s["span_id"] for s in spans} - printed
        if fresh and now - collector.arrived.get(trace_id, now) >= settle:
            print(format_trace(spans, printed), file=out, flush=True)
            printed |= fresh


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentmw-traces", description=description(__doc__.split("\n\n")[0]))
    parser.add_argument("--listen", default="127.0.0.1:4317", metavar="HOST:PORT", help="default 127.0.0.1:4317")
    parser.add_argument("--json", action="store_true", help="one JSON object per span instead of trees")
    parser.add_argument(
        "--settle",
        type=non_negative(float),
        default=DEFAULT_SETTLE,
        metavar="S",
        help=f"print a trace S s after its last span (default {DEFAULT_SETTLE:g}; later spans: as late additions)",
    )
    args = parser.parse_args(argv)
    try:  # a usage error (2), as every command says one; a port that is taken stays a failure to start (1)
        transport.check_listen_address(args.listen)
    except ValueError as exc:
        parser.error(f"--listen: {exc}")

    def as_json(span: dict[str, Any]) -> None:
        print(json.dumps(span), flush=True)

    try:
        receiver = Receiver(as_json if args.json else None).start(args.listen)
    except OSError as exc:
        print(f"agentmw-traces: {exc}", file=sys.stderr)
        return 1
    print(f"agentmw traces listening on {receiver.address}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    shown: dict[str, set[str]] = {}
    while not stop.wait(0.2):
        if not args.json:
            print_settled(receiver.collector, sys.stdout, args.settle, shown)
    if not args.json:  # at exit, whatever is pending
        print_settled(receiver.collector, sys.stdout, 0.0, shown)
    receiver.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
