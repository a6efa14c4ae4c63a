"""Issue 16 item 4: the four built-in servers (tracing, budget, TTS, mem0) against AgentScope.

One reply of 3 tool rounds and 1,000 streamed text deltas with all four attached, three ways:

* ``remote``: each server in its own process (``python -m mw_servers.<name>``; mem0 with the Python
  of .venv-mem0), attached to the host's Agent over gRPC;
* ``inproc``: the same four classes in-process in the host's Agent. mem0's class needs mem0ai,
  which only .venv-mem0 has, so the host of *both* agentmw variants runs with .venv-mem0's Python
  (the project is installed there too): the two differ only in where the middleware runs;
* ``agentscope``: AgentScope 2.0.11 with its own TracingMiddleware, ReplyBudgetControlMiddleware,
  Mem0Middleware and TTSMiddleware in-process (bench/agentscope_four.py, in .venv-agentscope-full).

The same backends everywhere: spans over OTLP/gRPC to a receiver process per variant, TTS from a
local DashScope stand-in (bench/dashscope_tts.py; our dashscope engine and AgentScope's
DashScopeTTSModel), mem0 with the offline default of mw_servers/mem0/backend.py (bundled
all-MiniLM-L6-v2, local Qdrant, raw writes) in a store per variant, seeded with the same facts.

Each variant's host is a worker process driven over a pipe, one JSON line each way (like the
AgentScope peer), so that the variants take turns in interleaved rounds and none pays for another's
tracer or threads. A batch is ``n`` concurrent replies from a common start; it answers the host CPU
per reply (``time.process_time`` of the worker, background work included) and the medians of the
time to first text and of the reply end. Batches run at concurrency 1, 8 and 32, with an instant
model and with a paced one (``PACES``). ``python -m bench.four_servers`` runs this section alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clients.launch import ROOT, LaunchError, ServerProcess, start_all

from .dashscope_tts import MS_PER_CHAR
from .harness import Sample, Series, interleave, pace_label, process_cpu
from .peer import WorkerFailed, ask_worker

MEM0_PYTHON = ROOT / ".venv-mem0" / "bin" / "python"
AGENTSCOPE_FULL = ROOT / ".venv-agentscope-full" / "bin" / "python"
AGENTSCOPE_SCRIPT = Path(__file__).resolve().parent / "agentscope_four.py"
VARIANTS = ("remote", "inproc", "agentscope")
SERVERS = ("tracing", "budget", "mem0", "tts")  # outermost first, the same order on every side
CONCURRENCY = (1, 8, 32)
# Model pacing, (time to first token, seconds per streamed chunk), on every model call of the reply.
# "realistic" uses a fast model's per-token latency so that the section stays within a minute or
# two (4 model calls and 1,000 chunks: about 2.8 s per reply); --ttft / --token-latency choose others.
PACES = {"instant": (0.0, 0.0), "realistic": (0.2, 0.002)}
# Interleaved rounds per pace and concurrency (each worker warms up before the first): two to four
# minutes in all on 2 cores. At c8 and c32 a round's figures are already medians over the batch; the
# paced ones get a second round all the same (one round of 32 paced replies varied 1.06-1.12x). A
# paced c1 time to first text is one reply's: the median of its per-round differences moved by 5 ms
# between runs over 3 rounds, and by 8 ms over 5 (+6.0 and -2.2 ms), against a 5 ms target: 9 rounds.
ROUNDS = {"instant": {1: 5, 8: 3, 32: 1}, "realistic": {1: 9, 8: 2, 32: 2}}
QUESTION = "What is my favourite colour?"
SEED = ["My favourite colour is teal.", "I live in Lisbon.", "I am allergic to peanuts.", "My cat is called Miso."]
BUDGET_TOKENS = 1e9  # counts, never cuts the reply short (as in the main bench)
STARTUP = 240.0  # seconds for a worker to load (torch and the embedding model, in three processes at once)
BATCH_TIMEOUT = 180.0
TTS_KEY = "bench-unused"  # the DashScope stand-in takes any key


# -- the driver (bench.run's process) ------------------------------------------------------------------


class Worker:
    """A variant's host process: JSON commands in on stdin, one JSON answer line each on stdout."""

    def __init__(self, name: str, argv: list[str], *, cwd: Path, env: dict[str, str], log: Path) -> None:
        self.name, self.argv, self.cwd, self.env, self.log = name, argv, cwd, env, log
        self.proc: asyncio.subprocess.Process | None = None
        self.failure: str | None = None
        self.hello: dict[str, Any] = {}

    async def start(self) -> Worker:
        with self.log.open("w") as log:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
                cwd=self.cwd,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
                limit=1 << 20,
            )
        try:
            self.hello = await self.ask({"op": "hello"}, timeout=STARTUP)
        except WorkerFailed as exc:
            self.failure = str(exc)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def ask(self, command: dict[str, Any], *, timeout: float = BATCH_TIMEOUT) -> dict[str, Any]:
        assert self.proc is not None
        return await ask_worker(self.proc, command, timeout, self._tail)

    def _tail(self) -> str:
        lines = self.log.read_text(errors="replace").strip().splitlines() if self.log.exists() else []
        return f" (stderr: {lines[-1][:300]})" if lines else ""

    async def sample(self, n: int, pace: tuple[float, float] | None, server_pids: Sequence[int] = ()) -> Sample:
        """One batch of ``n`` concurrent replies; NaN once the worker has failed. ``pace`` None: the
        offline model itself (a PacedModel of (0, 0) still adds a generator layer per chunk)."""
        if self.failure is not None:
            return Sample(math.nan, math.nan, math.nan)
        servers0 = sum(process_cpu(pid) for pid in server_pids)
        try:
            ttft, token = pace if pace is not None else (None, None)
            a = await self.ask({"op": "batch", "n": n, "ttft": ttft, "token": token})
        except WorkerFailed as exc:
            self.failure = str(exc)
            return Sample(math.nan, math.nan, math.nan)
        servers = (sum(process_cpu(pid) for pid in server_pids) - servers0) / n if server_pids else math.nan
        return Sample(a["wall"], a["cpu"], a["first"], server_cpu=servers, mark=a["audio"])

    async def close(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 10)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


@dataclass
class FourResults:
    """Per pace and concurrency, a Series per variant (``mark``: audio deltas per reply)."""

    series: dict[str, dict[int, dict[str, Series]]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # variant -> why it is missing or what failed
    spans: dict[str, int] = field(default_factory=dict)  # variant -> spans its receiver got
    server_cpu: dict[str, float] = field(default_factory=dict)  # server -> CPU per remote reply, whole run
    versions: dict[str, str] = field(default_factory=dict)
    paces: dict[str, tuple[float, float]] = field(default_factory=dict)
    rounds: dict[str, dict[int, int]] = field(default_factory=dict)  # pace -> concurrency -> rounds


def _server_argv(name: str, otlp: str, tts_url: str, store: Path) -> tuple[list[str], str | None, dict[str, str]]:
    """(argv, executable, env) of one of the four servers."""
    address = ["--address", "127.0.0.1:{port}"]
    if name == "tracing":
        return ["-m", "mw_servers.tracing", *address, "--otlp-endpoint", otlp], None, {}
    if name == "budget":
        return ["-m", "mw_servers.budget", *address, "--token-budget", str(BUDGET_TOKENS)], None, {}
    if name == "tts":
        argv = ["-m", "mw_servers.tts", *address, "--engine", "dashscope", "--url", tts_url]
        return argv, None, {"DASHSCOPE_API_KEY": TTS_KEY}
    return ["-m", "mw_servers.mem0", *address, "--mode", "static", "--store", str(store)], str(MEM0_PYTHON), {}


async def measure(
    *,
    quick: bool = False,
    agentscope_python: str | None = None,
    paces: dict[str, tuple[float, float]] | None = None,
    concurrency: Sequence[int] | None = None,
    rounds: dict[str, dict[int, int]] | None = None,
) -> FourResults:
    paces = paces or PACES
    concurrency = concurrency or ((1, 8) if quick else CONCURRENCY)
    rounds = rounds or {p: {n: 1 if quick else ROUNDS.get(p, {}).get(n, 2) for n in concurrency} for p in paces}
    res = FourResults(paces=paces, rounds=rounds)
    if not MEM0_PYTHON.exists():
        res.notes["all"] = "not measured: .venv-mem0 is missing (make mem0)"
        return res
    as_python = Path(agentscope_python or os.environ.get("BENCH_AGENTSCOPE_FULL_PYTHON") or AGENTSCOPE_FULL)
    variants = [v for v in VARIANTS if v != "agentscope" or as_python.exists()]
    if "agentscope" not in variants:
        res.notes["agentscope"] = f"not measured: {as_python} is missing (make bench builds .venv-agentscope-full)"
    tmp = tempfile.TemporaryDirectory(prefix="bench-four-")
    root = Path(tmp.name)
    receivers = {
        v: ServerProcess(
            ["-m", "clients.traces", "--listen", "127.0.0.1:{port}", "--settle", "3600"], name=f"otlp-{v}", log_dir=root
        )
        for v in variants
    }
    tts = ServerProcess(["-m", "bench.dashscope_tts", "--address", "127.0.0.1:{port}"], name="dashscope-tts")
    processes: list[ServerProcess] = []
    workers: dict[str, Worker] = {}
    try:
        processes = start_all([*receivers.values(), tts])
        otlp = {v: f"http://{p.address}" for v, p in receivers.items()}
        tts_url = f"http://{tts.address}/api/v1"
        servers = {}
        for name in SERVERS:
            argv, exe, env = _server_argv(name, otlp["remote"], tts_url, root / "store-remote")
            servers[name] = ServerProcess(argv, name=name, executable=exe, env=env, startup=STARTUP)
        heads = {
            "inproc": [str(MEM0_PYTHON), "-m", "bench.four_servers", "--worker", "inproc"],
            "agentscope": [str(as_python), str(AGENTSCOPE_SCRIPT)],
        }
        env = {"DASHSCOPE_API_KEY": TTS_KEY, "DASHSCOPE_HTTP_BASE_URL": tts_url}

        def make_worker(v: str) -> Worker:
            argv = [*heads[v], "--otlp", otlp[v], "--tts-url", tts_url, "--store", str(root / f"store-{v}")]
            cwd = Path("/tmp") if v == "agentscope" else ROOT  # the repo must never shadow AgentScope's packages
            return Worker(v, argv, cwd=cwd, env=env, log=root / f"worker-{v}.log")

        # The remote worker needs the servers' addresses; the others load meanwhile.
        others = [make_worker(v) for v in variants if v != "remote"]
        started = asyncio.gather(*(w.start() for w in others))
        try:
            processes += await asyncio.to_thread(start_all, servers.values())
        finally:
            for w in await started:
                workers[w.name] = w
        addresses = json.dumps({name: p.address for name, p in servers.items()})
        remote = Worker(
            "remote",
            [str(MEM0_PYTHON), "-m", "bench.four_servers", "--worker", "remote", "--addresses", addresses],
            cwd=ROOT,
            env=env,
            log=root / "worker-remote.log",
        )
        workers = {"remote": await remote.start(), **workers}
        res.versions = {v: w.hello.get("version", "?") for v, w in workers.items()}
        server_pids = [p.pid for p in servers.values()]
        cpu0 = {name: process_cpu(p.pid) for name, p in servers.items()}
        for pace_name, pace in paces.items():
            res.series[pace_name] = {}
            for n in concurrency:
                batches = {
                    v: (lambda w=w, n=n, pace=pace: w.sample(n, pace, server_pids if w.name == "remote" else ()))
                    for v, w in workers.items()
                }
                res.series[pace_name][n] = await interleave(batches, rounds[pace_name][n], warmup=0)
                _progress(f"four servers: {pace_name}, concurrency {n}")
        replies = sum(n * rounds[p][n] for p in paces for n in concurrency)
        res.server_cpu = {name: (process_cpu(p.pid) - cpu0[name]) / replies for name, p in servers.items()}
    except LaunchError as exc:  # a server that does not start costs this section, not the whole bench
        res.series, res.notes["all"] = {}, f"not measured: {exc}"
    finally:
        for w in workers.values():
            if w.failure is not None:
                res.notes[w.name] = f"failed: {w.failure}"
            await w.close()
        for proc in reversed(processes):  # the tracing server before the receivers: it flushes on the way out
            proc.stop()
        for v, receiver in receivers.items():
            log = receiver.log_path
            if log is not None and log.exists():
                found = re.findall(r"^trace \S+\s+(\d+) spans", log.read_text(), re.M)
                res.spans[v] = sum(int(k) for k in found)
        tmp.cleanup()
    return res


def _progress(what: str) -> None:
    print(f"[bench] {what}", file=sys.stderr, flush=True)


# -- a variant's host (the worker process) ------------------------------------------------------------


async def _stack(kind: str, args: argparse.Namespace) -> list[Any]:
    """The four middlewares of a variant, outermost first; ``tracing``: the tracing class alone
    (bench/builtins.py's in-process tracing variant)."""
    if kind == "tracing":
        from agent_host import tracing
        from mw_servers.tracing import TracingMiddleware

        tracing.configure("agentmw-inproc", endpoint=args.otlp)
        return [TracingMiddleware()]
    if kind == "remote":
        from agent_host.remote import RemoteMiddleware

        addresses = json.loads(args.addresses)
        return [await RemoteMiddleware(addresses[name]).connect() for name in SERVERS]
    from agent_host import tracing
    from mw_servers.budget import ReplyBudget
    from mw_servers.mem0 import Mem0Middleware
    from mw_servers.mem0.backend import build_memory, load_config, prepare_environment
    from mw_servers.tracing import TracingMiddleware
    from mw_servers.tts import TTSMiddleware, make_engine

    store = Path(args.store)
    store.mkdir(parents=True, exist_ok=True)
    prepare_environment(store)
    config, _ = load_config(None, store)
    tracing.configure("agentmw-inproc", endpoint=args.otlp)
    return [
        TracingMiddleware(),
        ReplyBudget(token_budget=BUDGET_TOKENS),
        Mem0Middleware(build_memory(config), mode="static"),
        TTSMiddleware(make_engine("dashscope", base_url=args.tts_url)),
    ]


async def _reply(middlewares: list[Any], t0: float, pace: tuple[float, float] | None, question: str = QUESTION) -> Any:
    """(time to first text, reply end, audio deltas) from ``t0``."""
    from agentmw.data import DataBlockDeltaEvent, TextBlockDeltaEvent, UserMsg

    from .scenarios import make_agent, tool_round_script

    script = tool_round_script() if question == QUESTION else [{"text": "Noted."}]
    agent = make_agent(middlewares, script, pace=pace)
    first, audio = math.nan, 0
    async for item in agent.reply_stream(UserMsg(question)):
        if isinstance(item, TextBlockDeltaEvent) and first != first:
            first = time.perf_counter() - t0
        elif isinstance(item, DataBlockDeltaEvent):
            audio += 1
    return first, time.perf_counter() - t0, audio


async def _batch(middlewares: list[Any], n: int, pace: tuple[float, float] | None) -> dict[str, float]:
    from .builtins import settle

    cpu0, t0 = time.process_time(), time.perf_counter()
    results = await asyncio.gather(*(_reply(middlewares, t0, pace) for _ in range(n)))
    await settle([m for m in middlewares if hasattr(m, "background")])  # remote deliveries, mem0 writes
    return {
        "cpu": (time.process_time() - cpu0) / n,
        "first": statistics.median(r[0] for r in results),
        "wall": statistics.median(r[1] for r in results),
        "audio": statistics.median(r[2] for r in results),
    }


async def worker(kind: str, args: argparse.Namespace) -> None:
    middlewares = await _stack(kind, args)
    for fact in SEED:  # the same memories in every variant's store
        await _reply(middlewares, time.perf_counter(), (0.0, 0.0), question=fact)
    await _batch(middlewares, 1, (0.0, 0.0))  # warm up imports and caches
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        command = json.loads(line)
        try:
            if command["op"] == "hello":
                from importlib.metadata import version

                answer: dict[str, Any] = {"version": f"agentmw {version('agentmw')}"}
            else:
                pace = None if command["ttft"] is None else (command["ttft"], command["token"])
                answer = await _batch(middlewares, command["n"], pace)
        except Exception as exc:  # reported to the driver, which drops this variant
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


# -- the report (BENCHMARKS.md's rows; formatting helpers from bench.report) ---------------------------

LABELS = {
    "remote": "agentmw, the four servers remote (one process each)",
    "inproc": "agentmw, the same four classes in-process",
    "agentscope": "AgentScope 2.0.11, its own four in-process",
}
HEADER = [
    "model",
    "concurrency",
    "variant",
    "time to first text",
    "reply end",
    "host CPU per reply",
    "servers' CPU per reply",
    "audio deltas",
]


def _pace(res: FourResults, name: str) -> str:
    return pace_label(res.paces[name])


def target_rows(res: FourResults) -> list[list[str]]:
    """The issue's three targets per model pace, each measured at every concurrency (c1, c8, c32)."""
    from .harness import ratio
    from .report import ms, times, verdict

    if not res.series:
        return [["The four servers vs AgentScope", res.notes.get("all", "not measured"), "—", "n/a"]]
    rows = [[f"The four servers vs AgentScope: {v}", note, "—", "n/a"] for v, note in res.notes.items()]

    def row(label: str, pace: str, fn: Any, fmt: Any, target: str = "—", limit: float | None = None) -> list[str]:
        """``fn(series by variant)`` at each concurrency; met when every value is ≤ ``limit``."""
        values = {n: fn(by) for n, by in res.series[pace].items()}
        cell = ", ".join(f"c{n}: {fmt(v)}" for n, v in values.items())
        if limit is None:
            return [f"{label} ({_pace(res, pace)}; no target)", cell, "—", "—"]
        met = None if any(v != v for v in values.values()) else all(v <= limit for v in values.values())
        return [f"{label} ({_pace(res, pace)})", cell, target, verdict(met)]

    def first_diff(by: dict[str, Series]) -> float:
        return statistics.median(a - b for a, b in zip(by["remote"].firsts, by["agentscope"].firsts, strict=True))

    def cpu(a: str, b: str) -> Any:
        return lambda by: ratio(by[a].cpus, by[b].cpus) if a in by and b in by else math.nan

    remote, inproc = res.spans.get("remote"), res.spans.get("inproc")
    if remote is not None and inproc is not None:  # the same class on the same replies: the same spans
        rows.append(
            [
                "Spans the tracing server sent for the same replies: remote, the same class in-process",
                f"{remote:,}, {inproc:,}",
                "equal",
                verdict(remote == inproc),
            ]
        )
    work = "3 tool rounds + 1,000 deltas, tracing + budget + mem0 + TTS"
    for pace in res.series:
        rows += [
            row(
                f"Four servers remote / AgentScope's four in-process: host CPU per reply, {work}",
                pace,
                cpu("remote", "agentscope"),
                times,
                "≤ 1.5x",
                1.5,
            ),
            row(
                "…time to first text, remote - AgentScope",
                pace,
                lambda by: first_diff(by) if "agentscope" in by else math.nan,
                ms,
                "≤ +5 ms",
                0.005,
            ),
        ]
        if pace != "instant":
            rows.append(
                row(
                    "…time to reply end, remote / the same four in-process",
                    pace,
                    lambda by: ratio(by["remote"].walls, by["inproc"].walls),
                    times,
                    "≤ 1.05x",
                    1.05,
                )
            )
        rows.append(
            row(
                "…context: host CPU per reply, the same four in-process / AgentScope's",
                pace,
                cpu("inproc", "agentscope"),
                times,
            )
        )
    return rows


def absolute_rows(res: FourResults) -> list[list[str]]:
    from .report import ms

    return [
        [_pace(res, pace), str(n), LABELS[v], ms(s.first), ms(s.wall), ms(s.cpu), ms(s.server_cpu), f"{s.mark:g}"]
        for pace, by_n in res.series.items()
        for n, by in by_n.items()
        for v, s in by.items()
    ]


def notes(res: FourResults) -> str:
    rounds = "; ".join(
        f"{pace}: " + ", ".join(f"{r} at c{n}" for n, r in by_n.items()) for pace, by_n in res.rounds.items()
    )
    spans = ", ".join(f"{v} {k:,}" for v, k in res.spans.items())
    split = ", ".join(f"{name} {cpu * 1e3:.1f} ms" for name, cpu in res.server_cpu.items())
    versions = ", ".join(f"{v}: {k}" for v, k in res.versions.items())
    extra = "".join(f" {v}: {note}." for v, note in res.notes.items())
    return (
        f"Interleaved rounds: {rounds}; each a batch of n concurrent replies per variant (medians over rounds). "
        f"Servers' CPU per remote reply over the whole run: {split or 'n/a'}. "
        f"Spans received per variant: {spans or 'none'}. Workers: {versions or 'none'}.{extra} "
        "Alone: `python -m bench.run --only four` (or `python -m bench.four_servers`, `--quick` for a smoke run)."
    )


def section(res: FourResults) -> str:
    from .report import table

    return "\n\n".join(
        [
            table(["what", "measured", "target", "verdict"], target_rows(res)),
            table(HEADER, absolute_rows(res)),
            notes(res),
        ]
    )


METHOD = [
    "- Four servers vs AgentScope (bench/four_servers.py, bench/agentscope_four.py): a reply of 3 tool rounds and "
    "1,000 streamed deltas with tracing, budget (1e9 tokens: counts, never acts), mem0 (static mode, awaited "
    "write-back, 4 seeded facts, a question that recalls them) and TTS (standard mode: the text block is spoken "
    "at its end) attached, outermost first in that order. Three variants, each host its own worker process "
    "driven over a pipe and interleaved round by round: the four mw_servers remote, each its own process "
    "(mem0 with .venv-mem0's Python); the same four classes in-process; AgentScope 2.0.11's own "
    "TracingMiddleware, ReplyBudgetControlMiddleware, Mem0Middleware and TTSMiddleware in-process "
    "(.venv-agentscope-full: agentscope 2.0.11 with mem0ai 2.2.1 and the embedder stack pinned as in .venv-mem0). "
    "Both agentmw hosts run with .venv-mem0's Python, since the in-process mem0 class needs mem0ai. "
    "Host CPU is the worker's `process_time` over the batch (background deliveries and exporter threads "
    "included) divided by its replies; servers' CPU is the four server processes' over the same batch.",
    "- Equivalent backends: spans over OTLP/gRPC with a batch processor to a receiver process per variant; "
    "TTS from bench/dashscope_tts.py, a local stand-in for DashScope's qwen3-tts-flash SSE endpoint "
    f"({MS_PER_CHAR:g} ms of silent 24 kHz PCM per character, in 0.1 s pieces), spoken to by our `dashscope` engine "
    "and by AgentScope's DashScopeTTSModel; mem0 with mw_servers/mem0/backend.py's offline configuration "
    "(bundled all-MiniLM-L6-v2, local Qdrant) in a store per variant. What differs: AgentScope's "
    "Mem0Middleware uses `AsyncMemory` and writes with mem0's LLM extraction (infer=True), which needs an "
    "LLM: its client is an AsyncMemory subclass that writes raw (infer=False), as our server does; "
    "AgentScope's DashScopeTTSModel calls the SDK's blocking HTTP client on the event loop (ours uses the "
    "SDK's asyncio client); AgentScope's tracing spans are its own (agent, LLM and tool spans; the host "
    "adds none), ours are the tracing server's plus, in-process only, the host's reply and hook spans; "
    "AgentScope's model stand-in is the AgentScope peer's ScriptedModel, ours OfflineRuleModel, both paced "
    "the same way: on a network model's clock, each call's first chunk due the time to first token after the "
    "call and each next one the per-chunk latency later, so that host work per chunk overlaps the wait as it "
    "does for chunks arriving on a socket.",
]


# -- alone ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.four_servers", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="one round, concurrency 1 and 8: a smoke test")
    parser.add_argument(
        "--agentscope-python", help="a Python with agentscope 2.0.11 and mem0ai (.venv-agentscope-full)"
    )
    parser.add_argument("--ttft", type=float, default=PACES["realistic"][0], help="realistic pace: seconds")
    parser.add_argument("--token-latency", type=float, default=PACES["realistic"][1], help="realistic pace: s/chunk")
    parser.add_argument("--worker", choices=("remote", "inproc", "tracing"), help=argparse.SUPPRESS)
    parser.add_argument("--addresses", help=argparse.SUPPRESS)
    parser.add_argument("--otlp", help=argparse.SUPPRESS)
    parser.add_argument("--tts-url", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        asyncio.run(worker(args.worker, args))
        return
    paces = {"instant": PACES["instant"], "realistic": (args.ttft, args.token_latency)}
    coro = measure(quick=args.quick, agentscope_python=args.agentscope_python, paces=paces)
    print(section(asyncio.run(asyncio.wait_for(coro, 900))))


if __name__ == "__main__":
    main()
