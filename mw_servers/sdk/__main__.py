"""Serve any MiddlewareBase subclass: ``python -m mw_servers.sdk package.module:Class --address HOST:PORT``.

``--arg key=value`` (repeatable, JSON values) are passed to the constructor.
"""

from __future__ import annotations

import argparse
import importlib
import json

from .server import serve


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mw_servers.sdk", description=__doc__)
    parser.add_argument("target", help="module:Class of a MiddlewareBase subclass")
    parser.add_argument("--address", default="127.0.0.1:50061", help="host:port to listen on (port 0 = any)")
    parser.add_argument("--arg", action="append", default=[], help="constructor argument key=value (JSON value)")
    args = parser.parse_args(argv)
    module_name, _, class_name = args.target.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    kwargs = {}
    for item in args.arg:
        key, _, raw = item.partition("=")
        try:
            kwargs[key] = json.loads(raw)
        except json.JSONDecodeError:
            kwargs[key] = raw
    serve(cls(**kwargs), args.address)


if __name__ == "__main__":
    main()
