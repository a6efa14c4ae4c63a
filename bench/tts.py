"""Bench row: the TTS server (espeak-ng) attached remotely vs no middleware. Run alone:

    python -m bench.tts [--rounds 15]

Each reply is one text block of ``WORDS`` streamed by the offline model. Measured per reply:
time to the first text delta (what attaching the server costs the user's first words), time to
the reply's end, and with the server attached, the time from the text block's end to its first
audio delta (standard mode) and from the reply's start to the first audio (realtime mode).
Prints the row (medians over interleaved rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import time

from agent_host.agent import Agent
from agent_host.data import DataBlockDeltaEvent, TextBlockDeltaEvent, TextBlockEndEvent, UserMsg
from agent_host.models.offline import OfflineRuleModel
from agent_host.remote import RemoteMiddleware
from clients.launch import ServerProcess

from .harness import Sample, interleave

TEXT = (
    "Here is the answer you asked for. The weather in Paris is sunny today, with a light breeze "
    "from the west, and it stays dry until the evening, when a few clouds come in."
)


async def one_reply(middlewares: list) -> tuple[Sample, float]:
    """(wall to the reply's end, host CPU, first text delta), and seconds from the block end (or,
    when audio comes before it, from the first text) to the first audio delta."""
    agent = Agent(model=OfflineRuleModel(script=[{"text": TEXT}]), middlewares=middlewares)
    start, cpu0 = time.perf_counter(), time.process_time()
    first = end = audio = math.nan
    async for item in agent.reply_stream(UserMsg("hi")):
        now = time.perf_counter()
        if isinstance(item, TextBlockDeltaEvent) and math.isnan(first):
            first = now
        elif isinstance(item, TextBlockEndEvent):
            end = now
        elif isinstance(item, DataBlockDeltaEvent) and math.isnan(audio):
            audio = now
    wall = time.perf_counter() - start
    sample = Sample(wall, time.process_time() - cpu0, first - start)
    return sample, audio - (end if audio > end else first)


async def measure(rounds: int) -> str:
    standard = ServerProcess(["-m", "mw_servers.tts", "--address", "127.0.0.1:0"], name="tts").start()
    realtime = ServerProcess(["-m", "mw_servers.tts", "--address", "127.0.0.1:0", "--realtime"], name="tts-rt").start()
    rm_std = await RemoteMiddleware(standard.address).connect()
    rm_rt = await RemoteMiddleware(realtime.address).connect()
    to_audio: dict[str, list[float]] = {"standard": [], "realtime": []}
    try:

        def run(name: str, middlewares: list):
            async def batch() -> Sample:
                sample, audio = await one_reply(middlewares)
                if name in to_audio:
                    to_audio[name].append(audio)
                return sample

            return batch

        series = await interleave(
            {"none": run("none", []), "standard": run("standard", [rm_std]), "realtime": run("realtime", [rm_rt])},
            rounds,
        )
    finally:
        await rm_std.close()
        await rm_rt.close()
        standard.stop()
        realtime.stop()
    none, std, rt = series["none"], series["standard"], series["realtime"]
    to_std = statistics.median(to_audio["standard"][-rounds:])
    to_rt = statistics.median(to_audio["realtime"][-rounds:])
    words = len(TEXT.split())
    return (
        "| scenario | first text, ms (none → standard / realtime) | reply end, ms (none → standard / realtime) "
        "| first audio after the text block ends, ms (standard) | first audio after the first text, ms (realtime) |\n"
        "|---|---|---|---|---|\n"
        f"| one text block of {words} words; TTS server (espeak-ng) attached remotely ({rounds} rounds) "
        f"| {none.first * 1e3:.2f} → {std.first * 1e3:.2f} / {rt.first * 1e3:.2f} "
        f"| {none.wall * 1e3:.2f} → {std.wall * 1e3:.2f} / {rt.wall * 1e3:.2f} "
        f"| {to_std * 1e3:.2f} | {to_rt * 1e3:.2f} |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.tts", description=__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    print(asyncio.run(asyncio.wait_for(measure(args.rounds), 170)))


if __name__ == "__main__":
    main()
