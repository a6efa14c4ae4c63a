"""``python -m mw_servers.tracing --address HOST:PORT [--otlp-endpoint URL] [--service-name NAME]``: the tracing server.

Spans go over OTLP/gRPC to ``--otlp-endpoint`` or wherever the standard variables say
(OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_TRACES_EXPORTER=otlp|console,
OTEL_SERVICE_NAME, OTEL_BSP_SCHEDULE_DELAY, ...); the flags win over the variables. With no
exporter configured it makes no spans.
"""

from __future__ import annotations

import argparse
import sys

from agent_host import tracing
from agentmw.commandline import description
from agentmw.sdk import serve

from . import TracingMiddleware


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mw_servers.tracing", description=description(__doc__))
    parser.add_argument(
        "--address", default="127.0.0.1:50075", help="host:port to listen on (port 0 = any; default %(default)s)"
    )
    parser.add_argument("--otlp-endpoint", metavar="URL", help="OTLP/gRPC collector, e.g. http://127.0.0.1:4317")
    parser.add_argument(
        "--service-name", metavar="NAME", help="service.name (default: $OTEL_SERVICE_NAME, else agentmw-tracing)"
    )
    args = parser.parse_args(argv)
    try:  # a flag wins over the environment: given, the name is a setting, not the default
        settings = {"service_name": args.service_name} if args.service_name else {}
        provider = tracing.configure("agentmw-tracing", endpoint=args.otlp_endpoint, settings=settings)
    except ValueError as exc:
        print(f"mw_servers.tracing: {exc}", file=sys.stderr)
        return 2
    if provider is None:
        print("mw_servers.tracing: no span exporter configured (--otlp-endpoint / OTEL_*): no spans", flush=True)
    try:
        serve(TracingMiddleware(), args.address)
    finally:
        if provider is not None:
            provider.shutdown()  # send what is still batched
    return 0


if __name__ == "__main__":
    sys.exit(main())
