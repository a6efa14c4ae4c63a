"""Serve any MiddlewareBase subclass: ``python -m agentmw.sdk package.module:Class --address HOST:PORT``.

``--arg key=value`` (repeatable, JSON values) are passed to the constructor. ``--tls-cert``,
``--tls-key``, ``--tls-client-ca``, ``--token-file`` and ``--reflection`` override the AGENTMW_MW_*
environment (see agentmw/sdk/server.py); the token itself goes only in a file or AGENTMW_MW_TOKEN,
never on a command line, which other users can read.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json

from agentmw.commandline import description
from agentmw.loops import LOOPS
from agentmw.middleware import MiddlewareBase
from agentmw.security import SecurityError, TlsFiles, read_secret, token_digest

from .server import ServeSecurity, serve


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m agentmw.sdk", description=description(__doc__))
    parser.add_argument("target", help="module:Class of a MiddlewareBase subclass")
    parser.add_argument("--address", default="127.0.0.1:50061", help="host:port to listen on (port 0 = any)")
    parser.add_argument("--arg", action="append", default=[], help="constructor argument key=value (JSON value)")
    parser.add_argument("--tls-cert", help="serve over TLS with this certificate (PEM)")
    parser.add_argument("--tls-key", help="the private key of --tls-cert")
    parser.add_argument("--tls-client-ca", help="require the host's client certificate, signed by this CA")
    parser.add_argument("--token-file", help="accept only calls carrying the token in this file (the host's)")
    parser.add_argument("--reflection", action="store_true", help="enable gRPC server reflection")
    parser.add_argument("--loop", choices=LOOPS, help="event loop (default: AGENTMW_LOOP, else asyncio)")
    args = parser.parse_args(argv)
    try:
        security = ServeSecurity.from_env()
        files = {k: getattr(args, f"tls_{k}") for k in ("cert", "key")} | {"ca": args.tls_client_ca}
        security.tls = TlsFiles(**{k: v or getattr(security.tls, k) for k, v in files.items()})
        if args.token_file:
            security.token_sha256 = token_digest(read_secret(file=args.token_file, where="--token-file"))
    except SecurityError as exc:
        parser.error(str(exc))
    security.reflection = security.reflection or args.reflection
    cls = _middleware_class(parser, args.target)
    kwargs = {}
    for item in args.arg:
        key, _, raw = item.partition("=")
        try:
            kwargs[key] = json.loads(raw)
        except json.JSONDecodeError:
            kwargs[key] = raw
    try:  # the arguments alone: a TypeError raised in the constructor's own code keeps its traceback
        inspect.signature(cls).bind(**kwargs)
    except TypeError as exc:
        parser.error(f"cannot construct {args.target}: {exc} (constructor arguments: --arg key=value)")
    serve(cls(**kwargs), args.address, security=security, loop=args.loop)


def _middleware_class(parser: argparse.ArgumentParser, target: str) -> type[MiddlewareBase]:
    """The class ``target`` names, or one line saying why not (a module that fails to import
    keeps its traceback: that is the author's code, not the command line)."""
    module_name, colon, class_name = target.partition(":")
    if not colon or not module_name or not class_name:
        parser.error(f"target {target!r} is not module:Class (e.g. mypackage.redact:Redact)")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name and not module_name.startswith(f"{exc.name}."):
            raise  # a module it imports is missing: its traceback says where
        parser.error(f"no module named {module_name!r} (is its directory on PYTHONPATH?)")
    cls = getattr(module, class_name, None)
    if cls is None:
        parser.error(f"module {module_name!r} has no {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, MiddlewareBase)):
        parser.error(f"{target} is not a MiddlewareBase subclass")
    return cls


if __name__ == "__main__":
    main()
