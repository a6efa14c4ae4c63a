"""Bench row: the tracing server attached remotely vs no middleware, on the whole-reply scenario
(3 tool rounds, then 1,000 text deltas; see scenario 5 in scenarios.py). Run alone:

    python -m bench.tracing [--rounds 15]

The tracing server runs in its own process with an OTLP exporter to a receiver in this process,
so it does its real span work; the host (this process) does not trace, which isolates what the
attached tracer costs the agent. Prints the row (medians over interleaved rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import math
from dataclasses import replace

from agent_host.remote import RemoteMiddleware
from clients.launch import ServerProcess
from clients.traces import Receiver

from .harness import Sample, interleave, process_cpu, ratio
from .scenarios import make_agent, one_reply, tool_round_script


async def measure(rounds: int) -> str:
    receiver = Receiver().start()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    server = ServerProcess(["-m", "mw_servers.tracing", "--address", "127.0.0.1:0"], name="tracing", env=env).start()
    rm = await RemoteMiddleware(server.address).connect()
    try:

        async def run(middlewares: list) -> Sample:
            server0 = process_cpu(server.pid)
            sample = await one_reply(make_agent(middlewares, tool_round_script()))
            return replace(sample, server_cpu=process_cpu(server.pid) - server0 if middlewares else math.nan)

        series = await interleave({"none": lambda: run([]), "tracing": lambda: run([rm])}, rounds)
        await asyncio.sleep(0.5)  # the last batch of spans
        spans = len(receiver.collector.spans)
    finally:
        await rm.close()
        server.stop()
        receiver.stop()
    none, traced = series["none"], series["tracing"]
    return (
        "| scenario | reply end, ms (none → tracing) | ratio | host CPU per reply, ms (none → tracing) | ratio "
        "| tracing server CPU per reply, ms |\n|---|---|---|---|---|---|\n"
        f"| 1,000 deltas, 3 tool rounds; tracing server attached remotely ({rounds} rounds, {spans} spans exported) "
        f"| {none.wall * 1e3:.2f} → {traced.wall * 1e3:.2f} | {ratio(traced.walls, none.walls):.2f}x "
        f"| {none.cpu * 1e3:.2f} → {traced.cpu * 1e3:.2f} | {ratio(traced.cpus, none.cpus):.2f}x "
        f"| {traced.server_cpu * 1e3:.2f} |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.tracing", description=__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    print(asyncio.run(asyncio.wait_for(measure(args.rounds), 170)))


if __name__ == "__main__":
    main()
