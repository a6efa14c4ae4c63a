"""``python -m mw_servers.tts --address HOST:PORT [--engine E] [--voice V] [--language L] [--realtime] [--timeout S]``

Serves TTSMiddleware (docs/tts.md). Engines: espeak (default; embedded, offline), piper (the
``piper`` extra), dashscope (qwen3-tts-flash over HTTP), dashscope-realtime (WebSocket; implies
--realtime). DashScope reads DASHSCOPE_API_KEY and DASHSCOPE_HTTP_BASE_URL; ``--url`` sets its
endpoint (the realtime engine's WebSocket URL, which the SDK does not take from the environment).
"""

from __future__ import annotations

import argparse
from typing import Any

from agentmw.commandline import description
from agentmw.sdk import serve
from agentmw.transport import check_listen_address

from . import ENGINES, TTSMiddleware, make_engine
from .engines import EngineError, api_key


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mw_servers.tts", description=description(__doc__))
    parser.add_argument(
        "--address", default="127.0.0.1:50081", help="host:port to listen on (port 0 = any; default %(default)s)"
    )
    parser.add_argument("--engine", choices=list(ENGINES), default="espeak")
    parser.add_argument(
        "--voice", default="", help='espeak: a voice ("en", "en-us", "de"); piper: an .onnx model; DashScope: "Cherry"'
    )
    parser.add_argument("--language", default="", help='DashScope: language_type ("Chinese", "English", ...)')
    parser.add_argument("--model", default="", help="DashScope: the model name")
    parser.add_argument("--url", default="", help="DashScope: HTTP base URL, or the realtime WebSocket URL")
    parser.add_argument("--realtime", action="store_true", help="speak text as it streams, not after each block")
    parser.add_argument(
        "--timeout",
        type=float,
        default=8.0,
        help="seconds to wait for each piece of audio before a block's speech is given up (tts_error; "
        "default 8); keep it below the host's timeout for this server (the host's default: 10)",
    )
    args = parser.parse_args(argv)
    if not 0 < args.timeout < float("inf"):
        parser.error(f"--timeout {args.timeout:g}: give a number of seconds above 0")
    options: dict[str, Any] = {}
    if args.engine.startswith("dashscope"):
        options = {"language": args.language, **({"model": args.model} if args.model else {})}
        if args.url:
            options["url" if args.engine == "dashscope-realtime" else "base_url"] = args.url
    try:  # before an engine loads
        check_listen_address(args.address)
    except ValueError as exc:
        parser.error(f"--address {exc}")
    try:
        if args.engine.startswith("dashscope"):
            api_key()  # read once, at start: else every reply would fail on it
        engine = make_engine(args.engine, args.voice, **options)
        engine.ready()  # a voice that does not load refuses the start, not every reply later
    except EngineError as exc:
        parser.error(str(exc))
    engine.timeout = args.timeout
    serve(TTSMiddleware(engine, realtime=True if args.realtime else None), args.address)


if __name__ == "__main__":
    main()
