"""The built-in servers (mw_servers.tracing, tts, mem0) attached remotely vs no middleware.

One mechanism for all of them: a ``Builtin`` says how to start its server variants and what reply
to measure; ``start`` launches them (with ``bench.run``'s other servers, in parallel), ``measure``
runs each server's variants interleaved with its own no-middleware baseline, one reply per batch.
Every reply is timed the same way (``reply``): time to first text, to the reply's end, host CPU,
and for TTS the time to the first audio. ``python -m bench.tracing`` (tts, mem0) runs one alone,
``python -m bench.builtins`` all of them (only this section of ``make bench``).

The tracing server exports to an OTLP receiver in a process of its own (the agentmw-traces
viewer, quiet until it stops), as a real collector would be: never in the host process.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from agent_host.remote import RemoteMiddleware
from agentmw.data import DataBlockDeltaEvent, TextBlockDeltaEvent, TextBlockEndEvent, UserMsg
from clients.launch import ROOT, ServerProcess, start_all

from .four_servers import Worker
from .harness import Batch, Sample, Series, interleave, process_cpu
from .middlewares import WatcherFloor
from .scenarios import WORDS, make_agent, tool_round_script

MEM0_PYTHON = ROOT / ".venv-mem0" / "bin" / "python"
TTS_TEXT = (
    "Here is the answer you asked for. The weather in Paris is sunny today, with a light breeze "
    "from the west, and it stays dry until the evening, when a few clouds come in."
)
PACE = (0.2, 0.002)  # 200 ms to first token, 2 ms per chunk
TRACING = ["-m", "mw_servers.tracing", "--address", "127.0.0.1:{port}", "--otlp-endpoint", "{otlp}"]
MEM0_SEED = ["My favourite colour is teal.", "I live in Lisbon.", "I am allergic to peanuts.", "My cat is called Miso."]


@dataclass(frozen=True)
class Builtin:
    """A built-in server's bench: its variants (name -> server argv after ``python``; ``{port}``,
    ``{store}`` and ``{otlp}`` are filled in), the reply each round measures, and what to send
    once before measuring (e.g. facts for mem0 to remember)."""

    name: str
    variants: dict[str, list[str]]
    script: Callable[[], list[dict[str, Any]]]
    question: str = "hi"
    python: Path | None = None  # its own venv's interpreter (None: this one)
    startup: float = 30.0
    seed: Sequence[str] = ()
    exports: bool = False  # it sends spans to the OTLP receiver
    pace: tuple[float, float] | None = None  # (time to first token, s per chunk) of a paced model
    rounds: int | None = None  # at most this many rounds (a paced reply takes seconds)
    # The same class in-process, in a host process of its own (a bench.four_servers worker of this
    # kind): its tracer provider is global, so it cannot share this process with the other variants.
    inproc: str = ""
    # An in-process middleware that does the least any middleware on the same hooks must (variant
    # FLOOR): what is left of the target's budget for the server's own work.
    floor: Callable[[], Any] | None = None


FLOOR = "in-process floor"


BUILTINS = {
    b.name: b
    for b in (
        Builtin(
            "tracing",
            {"attached": TRACING},
            tool_round_script,  # 3 tool rounds, then 1,000 text deltas: 8 detached invocations per reply
            exports=True,
            inproc="tracing",
            floor=WatcherFloor,
        ),
        Builtin(  # the same on a network model's clock (as the four-servers section's realistic pace)
            "tracing-paced",
            {"attached": TRACING},
            tool_round_script,
            exports=True,
            pace=PACE,
            rounds=5,  # ~2.8 s per reply
        ),
        Builtin(
            "tts",
            {
                "standard": ["-m", "mw_servers.tts", "--address", "127.0.0.1:{port}"],
                "realtime": ["-m", "mw_servers.tts", "--address", "127.0.0.1:{port}", "--realtime"],
            },
            lambda: [{"text": TTS_TEXT}],
        ),
        Builtin(
            "mem0",
            {
                "attached": [
                    "-m",
                    "mw_servers.mem0",
                    "--address",
                    "127.0.0.1:{port}",
                    "--mode",
                    "static",
                    "--store",
                    "{store}",
                ]
            },
            lambda: [{"text": WORDS}],
            question="What is my favourite colour?",
            python=MEM0_PYTHON,
            startup=180.0,  # importing torch and sentence-transformers, loading the model
            seed=MEM0_SEED,
        ),
    )
}


async def reply(middlewares: list[Any], bench: Builtin) -> Sample:
    """One reply: wall to its end, host CPU (with the background work it left), time to first text;
    ``mark``: seconds from the text block's end to the first audio delta, or from the first text
    when audio comes before the end."""
    agent = make_agent(middlewares, bench.script(), pace=bench.pace)
    start, cpu0 = time.perf_counter(), time.process_time()
    first = end = audio = math.nan
    async for item in agent.reply_stream(UserMsg(bench.question)):
        if isinstance(item, TextBlockDeltaEvent):
            if first != first:
                first = time.perf_counter()
        elif isinstance(item, TextBlockEndEvent):
            end = time.perf_counter()
        elif isinstance(item, DataBlockDeltaEvent) and audio != audio:
            audio = time.perf_counter()
    wall = time.perf_counter() - start
    await settle(middlewares)  # copies to detached hooks still on their way: their host CPU counts
    cpu = time.process_time() - cpu0
    return Sample(wall, cpu, first - start, mark=audio - (end if audio > end else first))


async def settle(middlewares: list[Any]) -> None:
    """Wait for the middlewares' background deliveries (and so for the servers' work on them), so
    that none of it lands in the next variant's turn."""
    for rm in middlewares:
        while getattr(rm, "background", None):  # a remote one's (in-process ones have none)
            await asyncio.gather(*rm.background, return_exceptions=True)


@dataclass
class Fleet:
    """The started servers of the built-ins to measure, and why any others are left out."""

    servers: dict[str, dict[str, ServerProcess]] = field(default_factory=dict)  # builtin -> variant -> process
    receiver: ServerProcess | None = None
    otlp: str = ""  # the receiver's endpoint
    notes: dict[str, str] = field(default_factory=dict)  # builtin -> why it is not measured
    tmp: tempfile.TemporaryDirectory[str] | None = None
    spans: int = 0  # spans the receiver got, counted when it stops

    @property
    def processes(self) -> list[ServerProcess]:
        return [p for variants in self.servers.values() for p in variants.values()]

    def stop(self) -> None:
        for proc in self.processes:  # the tracing server first: it sends its last spans on the way out
            proc.stop()
        if self.receiver is not None:
            self.receiver.stop()  # it prints every trace with its size now
            log = self.receiver.log_path
            if log is not None and log.exists():
                self.spans = sum(int(n) for n in re.findall(r"^trace \S+\s+(\d+) spans", log.read_text(), re.M))
            self.receiver = None
        if self.tmp is not None:
            self.tmp.cleanup()
            self.tmp = None


def fleet(names: Sequence[str]) -> Fleet:
    """Unstarted server processes of these built-ins (the receiver, if one exports, is started)."""
    f = Fleet(tmp=tempfile.TemporaryDirectory(prefix="bench-builtins-"))
    tmp = Path(f.tmp.name)
    otlp = ""
    for name in names:
        bench = BUILTINS[name]
        if bench.python is not None and not bench.python.exists():
            f.notes[name] = f"not measured: {bench.python.relative_to(ROOT)} is missing (make mem0)"
            continue
        if bench.exports and not otlp:
            # --settle: it prints nothing while the bench runs, every trace when it stops
            argv = ["-m", "clients.traces", "--listen", "127.0.0.1:{port}", "--settle", "3600"]
            f.receiver = ServerProcess(argv, name="otlp-receiver", log_dir=tmp).start()
            otlp = f.otlp = f"http://{f.receiver.address}"
        f.servers[name] = {}
        for variant, argv in bench.variants.items():
            store = tmp / f"{name}-{variant}"
            store.mkdir()
            argv = [a.replace("{store}", str(store)).replace("{otlp}", otlp) for a in argv]
            exe = str(bench.python) if bench.python else None
            f.servers[name][variant] = ServerProcess(
                argv, name=f"{name}-{variant}", executable=exe, startup=bench.startup
            )
    return f


async def _inproc_worker(f: Fleet, bench: Builtin) -> Worker:
    """The host process that runs ``bench``'s class in-process (bench.four_servers' worker)."""
    assert f.tmp is not None
    tmp = Path(f.tmp.name)
    argv = [sys.executable, "-m", "bench.four_servers", "--worker", bench.inproc, "--otlp", f.otlp]
    argv += ["--tts-url", "", "--store", str(tmp / f"{bench.name}-inproc")]
    worker = Worker(f"{bench.name}-inproc", argv, cwd=ROOT, env={}, log=tmp / f"{bench.name}-inproc.log")
    return await worker.start()


async def measure(f: Fleet, rounds: int) -> dict[str, dict[str, Series]]:
    """Per built-in, its variants and "none", interleaved round by round."""
    out: dict[str, dict[str, Series]] = {}
    clients: list[RemoteMiddleware] = []
    workers: list[Worker] = []
    try:
        for name, procs in f.servers.items():
            bench = BUILTINS[name]
            attached = {}
            for variant, proc in procs.items():
                rm = await RemoteMiddleware(proc.address).connect()
                clients.append(rm)
                attached[variant] = (rm, proc.pid)
                for fact in bench.seed:
                    await reply([rm], replace(bench, question=fact))

            def batch(variant: str, bench: Builtin = bench, attached: dict = attached) -> Batch:
                if variant == "none":
                    return lambda: reply([], bench)
                rm, pid = attached[variant]

                async def run() -> Sample:
                    server0 = process_cpu(pid)
                    sample = await reply([rm], bench)
                    return replace(sample, server_cpu=process_cpu(pid) - server0)

                return run

            variants = {v: batch(v) for v in ["none", *attached]}
            if bench.floor is not None:
                floor = bench.floor()
                variants[FLOOR] = partial(reply, [floor], bench)
            if bench.inproc:
                worker = await _inproc_worker(f, bench)
                workers.append(worker)
                if worker.failure is None:
                    variants["in-process"] = partial(worker.sample, 1, bench.pace)
                else:
                    f.notes[f"{name} in-process"] = f"not measured: {worker.failure}"
            out[name] = await interleave(variants, min(rounds, bench.rounds or rounds))
    finally:
        for worker in workers:
            await worker.close()
        for rm in clients:
            await rm.close()
    return out


# -- alone: python -m bench.tracing / bench.tts / bench.mem0, or all: python -m bench.builtins --------


def main(name: str | None = None, doc: str | None = None, argv: list[str] | None = None) -> None:
    """One built-in's rows (``name``), or all of them: the "Built-in servers" section of
    BENCHMARKS.md without the rest of ``make bench``, printed (e.g. while iterating on one)."""
    from .report import builtin_section

    names = [n for n in BUILTINS if name in (None, n, n.split("-")[0])]  # tracing: with tracing-paced
    prog = f"python -m bench.{name or 'builtins'}"
    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)

    async def run() -> str:
        f = fleet(names)
        try:
            start_all(f.processes)
            series = await measure(f, args.rounds)
        finally:
            f.stop()
        return builtin_section(series, f.notes, f.spans, args.rounds)

    print(asyncio.run(asyncio.wait_for(run(), 400)))


if __name__ == "__main__":
    main(doc=__doc__)
