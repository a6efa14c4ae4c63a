"""Bench row: the mem0 server attached remotely vs no middleware: time to first text (and reply
end) of a reply of 1,000 text deltas. Run alone (it needs the mem0 venv, ``make mem0``):

    python -m bench.mem0 [--rounds 15]

The server is the offline default (bundled all-MiniLM-L6-v2, Qdrant local store in a temporary
directory), mode ``static``: before the reply it searches the user's memories (one embedding and
one vector search) and inserts a hint; after it, it writes the exchange back (awaited, so the
reply end includes two more embeddings). The store is seeded with a few memories first.
Prints the row (medians over interleaved rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

from agent_host.data import TextBlockDeltaEvent, UserMsg
from agent_host.remote import RemoteMiddleware
from clients.launch import ROOT, ServerProcess

from .harness import Sample, interleave, ratio
from .scenarios import WORDS, make_agent

MEM0_PY = ROOT / ".venv-mem0" / "bin" / "python"
SEED = ["My favourite colour is teal.", "I live in Lisbon.", "I am allergic to peanuts.", "My cat is called Miso."]


async def one_reply(middlewares: list, text: str) -> Sample:
    agent = make_agent(middlewares, [{"text": WORDS}])
    start = time.perf_counter()
    cpu0 = time.process_time()
    first = float("nan")
    async for item in agent.reply_stream(UserMsg(text)):
        if first != first and isinstance(item, TextBlockDeltaEvent):
            first = time.perf_counter() - start
    return Sample(time.perf_counter() - start, time.process_time() - cpu0, first)


async def measure(rounds: int) -> str:
    with tempfile.TemporaryDirectory(prefix="bench-mem0-") as store:
        argv = ["-m", "mw_servers.mem0", "--address", "127.0.0.1:0", "--mode", "static", "--store", store]
        server = ServerProcess(argv, name="mem0", executable=str(MEM0_PY), startup=180).start()
        rm = await RemoteMiddleware(server.address).connect()
        try:
            for fact in SEED:
                await one_reply([rm], fact)
            series = await interleave(
                {
                    "none": lambda: one_reply([], "What is my favourite colour?"),
                    "mem0": lambda: one_reply([rm], "What is my favourite colour?"),
                },
                rounds,
            )
        finally:
            await rm.close()
            server.stop()
    none, mem0 = series["none"], series["mem0"]
    return (
        "| scenario | time to first text, ms (none → mem0) | added | reply end, ms (none → mem0) | ratio |\n"
        "|---|---|---|---|---|\n"
        f"| 1,000 deltas; mem0 server attached remotely, static mode, offline default ({rounds} rounds) "
        f"| {none.first * 1e3:.2f} → {mem0.first * 1e3:.2f} | +{(mem0.first - none.first) * 1e3:.2f} "
        f"| {none.wall * 1e3:.2f} → {mem0.wall * 1e3:.2f} | {ratio(mem0.walls, none.walls):.2f}x |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.mem0", description=__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    print(asyncio.run(asyncio.wait_for(measure(args.rounds), 400)))


if __name__ == "__main__":
    main()
