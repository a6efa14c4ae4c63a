"""``agent-host``: run the agent host (also ``python -m agent_host``).

    agent-host --config host.yaml --middleware budget=127.0.0.1:50062 --listen 127.0.0.1:50070

Settings come from the YAML file, then AGENTMW_* environment variables, then these flags (see
agent_host/config.py). A configuration that cannot work (malformed YAML, an unknown model
provider, a middleware address that does not answer Describe) prints one line saying what is
wrong and where, and exits with status 2 (configuration) or 1 (startup).
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys

from agentmw import loops

from . import metrics, tracing
from .config import _TLS_SETTINGS, ConfigError, load_config
from .service import StartupError, run_host


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="agent-host",
        description="Run the agentmw agent host: the AgentHost gRPC service, with middleware attached by address.",
    )
    parser.add_argument("--config", metavar="PATH", help="YAML configuration file (env AGENTMW_CONFIG)")
    parser.add_argument("--listen", metavar="HOST:PORT", help="where to serve AgentHost (default 127.0.0.1:50070)")
    parser.add_argument(
        "--db",
        metavar="PATH|DSN",
        help='SQLite session store (default agentmw.db; ":memory:"), or a postgresql:// DSN shared by many hosts',
    )
    parser.add_argument("--lease", metavar="SECONDS", help="shared store: how long a host holds a session unrenewed")
    parser.add_argument("--drain-grace", metavar="SECONDS", help="on SIGTERM: time the replies in flight get (30)")
    parser.add_argument(
        "--middleware",
        action="append",
        default=[],
        metavar="NAME=HOST:PORT",
        help="attach a middleware server (repeatable; the order is the onion order, first = outermost)",
    )
    parser.add_argument("--model", metavar="ID", help="default model id of the registry")
    parser.add_argument("--log-level", metavar="LEVEL", help="debug, info, warning, error (default info)")
    parser.add_argument("--loop", metavar="KIND", help="event loop: asyncio (default), uvloop, or auto")
    parser.add_argument(
        "--metrics-port", metavar="PORT", help="serve Prometheus metrics at http://<listen host>:PORT/metrics"
    )
    tls = parser.add_argument_group("TLS (PEM file paths; see docs/security.md)")
    tls.add_argument("--tls-cert", metavar="PATH", help="serve AgentHost over TLS with this certificate")
    tls.add_argument("--tls-key", metavar="PATH", help="the private key of --tls-cert")
    tls.add_argument("--tls-client-ca", metavar="PATH", help="require client certificates signed by this CA (mTLS)")
    tls.add_argument("--middleware-tls-ca", metavar="PATH", help="connect to middleware over TLS, trusting this CA")
    tls.add_argument("--middleware-tls-cert", metavar="PATH", help="the host's client certificate for middleware")
    tls.add_argument("--middleware-tls-key", metavar="PATH", help="the private key of --middleware-tls-cert")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    flags = {
        "listen": args.listen,
        "db": args.db,
        "middleware": args.middleware,
        "model": args.model,
        "log_level": args.log_level,
        "loop": args.loop,
        "metrics_port": args.metrics_port,
        "lease": args.lease,
        "drain_grace": args.drain_grace,
        **{key: getattr(args, key.replace(".", "_")) for key in _TLS_SETTINGS},
    }
    try:
        config = load_config(args.config, flags=flags)
        level = getattr(logging, config.log_level.upper())  # checked by load_config
        logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
        # The model SDKs' HTTP client logs every request at INFO: one line per model call, beyond
        # the host's one line per reply (its warnings and errors still show).
        for name in ("httpx", "httpx2"):  # httpx2: the openai SDK's
            logging.getLogger(name).setLevel(max(level, logging.WARNING))
        # asyncpg's pool logs a traceback at each reconnection try while PostgreSQL is down: an
        # outage, which the store's own warnings and UNAVAILABLE answers tell.
        logging.getLogger("asyncpg.pool").setLevel(max(level, logging.ERROR))
        try:  # spans only when configured (OTEL_* variables or ``tracing:``); else the API's no-op
            tracing.configure("agent-host", settings=config.tracing)
        except ValueError as exc:
            raise ConfigError(f"{config.source}: tracing: {exc}") from None
        if config.metrics_port is not None:
            host = config.listen.rsplit(":", 1)[0]
            try:
                port = metrics.serve(config.metrics_port, host)
            except OSError as exc:
                raise StartupError(
                    f"metrics_port: cannot serve metrics on {host}:{config.metrics_port}: {exc}"
                ) from None
            print(f"agentmw host metrics at http://{host}:{port}/metrics", flush=True)
        try:
            loops.run(run_host(config), config.loop)
        finally:
            # The host's middleware channels sit in reference cycles (a RemoteTool and its
            # middleware, ...): left for the interpreter's exit, a TLS one made gRPC's shutdown
            # wait some 2 s, so a host with middleware_tls took that long to exit on SIGTERM.
            gc.collect()
    except ConfigError as exc:
        print(f"agent-host: configuration error: {exc}", file=sys.stderr)
        return 2
    except StartupError as exc:
        print(f"agent-host: cannot start: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
