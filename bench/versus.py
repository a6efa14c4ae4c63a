"""This tree against an earlier commit, side by side in one run: did a change make things slower?

The isolation issue's clause "make bench ratios no worse than before (±5 %)" compares with the tree
before that work, but figures from an older BENCHMARKS.md were measured on another day's machine
(the bare grpc floors alone moved by 40 % between such runs). So this section builds the earlier
commit (``BASELINE``) in a git worktree with its own virtual environment (its own ``make install``,
under .bench-versus/), starts one worker process per tree, each with its own middleware servers,
and runs the same operations in both, alternating round by round:

* 1a (a bare new-stream exchange) and 1b (a ping-pong on an open stream): identical code in both
  trees, so their ratio shows how far the noise alone moves a ratio in this run;
* one on_check_permission pass-through (a whole hook invocation), with its host and middleware
  CPU (the middleware's from /proc, every thread, nanoseconds); and the same from a middleware
  that reads its kwargs first (``READS_KWARGS``: this tree decodes kwargs only when the code uses
  them, and then also checks them for in-place edits at next_handler(), which fidelity requires);
* one intercepted item (on_reply), against the earlier tree's one round trip per item: this tree's
  ``run_ahead`` (also one round trip) and its default lock-step (two, for fidelity: by design);
* a whole reply (3 tool rounds + 1,000 deltas) with no middleware, and with one remote middleware
  on four hooks (Realistic): wall time and host CPU.

Only APIs both trees have are used (bench.scenarios, bench.harness, bench.middlewares,
agent_host.remote, clients.launch). ``python -m bench.versus [--rev REV] [--rounds N]`` runs it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from clients.launch import ROOT

from .scenarios import ITEMS

BASELINE = "a4557fb"  # the tree before the isolation work (invocation ids, deadlines, lock-step)
WORKDIR = ROOT / ".bench-versus"
ROUNDS = 40  # at least, in make bench: a hook invocation's ratio moved 1.02x-1.15x between 25-round runs
TIMEOUT = 300.0  # seconds for the worker's start and for each round: the bench never runs unbounded

# One tree's worker, run with that tree's Python in that tree's directory: it starts its servers,
# says "ready", then measures one round per "round" line on stdin and prints it as JSON.
WORKER = r"""
import asyncio, json, os, sys
sys.path.insert(0, os.getcwd())
import grpc
from agent_host.remote import RemoteMiddleware
from clients.launch import ServerProcess, middleware_server, start_all
from bench import scenarios
from bench.harness import timed_batch

MW_MODULE = os.environ.get("BENCH_VERSUS_MW")

async def main(names):
    echo = ServerProcess(["-m", "bench.echo_server", "--address", "127.0.0.1:{port}"], name="echo")
    servers = {n: middleware_server(f"bench.middlewares:{n}") for n in names}
    servers["ReadsKwargs"] = ServerProcess(  # bench_versus_mw.py, beside the trees (both SDKs have mw_servers.sdk)
        ["-m", "mw_servers.sdk", "bench_versus_mw:ReadsKwargs", "--address", "127.0.0.1:{port}"],
        name="ReadsKwargs", env={"PYTHONPATH": MW_MODULE},
    )
    start_all([echo, *servers.values()])
    channel = grpc.aio.insecure_channel(echo.address)
    await asyncio.wait_for(channel.channel_ready(), 10)
    rms = {n: await RemoteMiddleware(s.address).connect() for n, s in servers.items()}
    exchange, ping = channel.stream_stream("/bench.Echo/Exchange"), channel.stream_stream("/bench.Echo/PingPong")
    agent = scenarios.make_agent()
    perm = scenarios.permission_chain(rms["PassThroughCall"])
    perm_reads = scenarios.permission_chain(rms["ReadsKwargs"])
    events = scenarios.reply_events(agent, scenarios.ITEMS)
    chains = {"stream_none": scenarios.reply_chain([], events)}
    chains.update({f"stream_{n}": scenarios.reply_chain([rms[n]], events) for n in names if n.startswith("Intercept")})
    mw_pid, echo_pid, reads_pid = servers["PassThroughCall"].pid, echo.pid, servers["ReadsKwargs"].pid
    pinger = ping()

    async def bare():
        call = exchange()
        await call.write(b"b" * 300)
        await call.read()
        await call.done_writing()
        await call.code()

    async def one_ping():
        await pinger.write(b"i" * 108)
        await pinger.read()

    async def timed(op, n, pid=mw_pid):  # [wall, host CPU, the server's CPU] per operation
        s = await timed_batch(op, n, server_pid=pid)
        return [s.wall, s.cpu, s.server_cpu]

    async def reply(middlewares):
        s = await scenarios.one_reply(scenarios.make_agent(middlewares, scenarios.tool_round_script()))
        return [s.wall, s.cpu, 0.0]

    ops = {
        "1a": lambda: timed(bare, scenarios.OPS, echo_pid),
        "1b": lambda: timed(one_ping, scenarios.ITEMS, echo_pid),
        "hook": lambda: timed(lambda: perm(agent), scenarios.OPS),
        "hook_reads": lambda: timed(lambda: perm_reads(agent), scenarios.OPS, reads_pid),
        **{k: (lambda c=c: timed(lambda: scenarios.drain(c, agent), 1)) for k, c in chains.items()},
        "reply_none": lambda: reply([]),
        "reply_remote": lambda: reply([rms["Realistic"]]),
    }
    for op in ops.values():  # warm up
        for _ in range(2):
            await op()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "round":
            break
        print(json.dumps({k: await op() for k, op in ops.items()}), flush=True)
    for rm in rms.values():
        await rm.close()
    await channel.close()
    for proc in [echo, *servers.values()]:
        proc.stop()

asyncio.run(main(sys.argv[1].split(",")))
"""

# A pass-through that reads its kwargs before calling next (served by both trees' SDKs).
READS_KWARGS = """
try:
    from agentmw.middleware import MiddlewareBase
except ImportError:  # the earlier tree
    from agent_host.middleware import MiddlewareBase


class ReadsKwargs(MiddlewareBase):
    async def on_check_permission(self, agent, input_kwargs, next_handler):
        if input_kwargs["tool_call"].name == "refused":
            raise PermissionError("refused")
        return await next_handler()
"""

# Middleware classes each tree's worker serves (the earlier tree has no run_ahead).
NAMES = {
    "before": "PassThroughCall,InterceptAll,Realistic",
    "now": "PassThroughCall,InterceptAll,InterceptAllRunAhead,Realistic",
}


@dataclass
class VersusResult:
    rev: str = BASELINE
    rounds: list[dict[str, dict[str, list[float]]]] = field(default_factory=list)  # side -> op -> [wall, cpu, mw cpu]
    note: str = ""  # why it was not measured

    def ratio(self, now_op: str, before_op: str | None = None, i: int = 0) -> float:
        """Median over rounds of now / before for one figure (0 wall, 1 host CPU, 2 the server's CPU)."""
        return statistics.median(
            _value(r["now"], now_op, i) / _value(r["before"], before_op or now_op, i) for r in self.rounds
        )


def _value(side: dict[str, list[float]], op: str, i: int) -> float:
    if op.startswith("stream_Intercept"):  # per intercepted item: (with - without) / ITEMS
        return (side[op][i] - side["stream_none"][i]) / ITEMS
    return side[op][i]


def _baseline_tree(rev: str) -> Path:
    """The earlier commit checked out under .bench-versus/, with its own venv (built once)."""
    tree = WORKDIR / rev
    if not (tree / ".git").exists():
        WORKDIR.mkdir(exist_ok=True)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(tree), rev], check=True)
    if not (tree / ".venv" / ".installed").exists():
        log = WORKDIR / f"{rev}-install.log"
        print(f"==> building {rev}'s virtual environment in {tree} (once; log: {log})", file=sys.stderr, flush=True)
        with log.open("w") as out:
            subprocess.run(["make", "-C", str(tree), "install"], check=True, stdout=out, stderr=out, timeout=600)
    return tree


def _start(tree: Path, names: str) -> subprocess.Popen[str]:
    (WORKDIR / "bench_versus_mw.py").write_text(READS_KWARGS)
    proc = subprocess.Popen(
        [str(tree / ".venv" / "bin" / "python"), "-c", WORKER, names],
        cwd=tree,
        env={**os.environ, "BENCH_VERSUS_MW": str(WORKDIR)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + TIMEOUT
    while (line := proc.stdout.readline()) and not line.startswith("ready"):
        if time.monotonic() > deadline:
            break
    if not line.startswith("ready"):
        proc.kill()
        raise RuntimeError(f"the worker in {tree} did not start")
    return proc


def measure(rounds: int, rev: str = BASELINE) -> VersusResult:
    result = VersusResult(rev=rev)
    try:
        before_tree = _baseline_tree(rev)
    except (subprocess.SubprocessError, OSError) as exc:
        result.note = f"not measured: could not build {rev} ({exc})"
        return result
    workers: dict[str, subprocess.Popen[str]] = {}
    try:
        workers["before"] = _start(before_tree, NAMES["before"])
        workers["now"] = _start(ROOT, NAMES["now"])
        for r in range(rounds):
            sides = list(workers) if r % 2 == 0 else list(workers)[::-1]
            row = {}
            for side in sides:
                proc = workers[side]
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write("round\n")
                proc.stdin.flush()
                row[side] = json.loads(proc.stdout.readline())
            result.rounds.append(row)
    finally:
        for proc in workers.values():
            if proc.stdin is not None:
                proc.stdin.close()  # the worker stops its servers and exits
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return result


# (what, now's op, before's op (None: the same), figures (0 wall, 1 host CPU, 2 the server's CPU),
# whether it is a target: the isolation issue's "no worse than before (±5 %)")
ROWS: list[tuple[str, str, str | None, tuple[int, ...], bool]] = [
    ("1a bare new-stream exchange, identical code in both (the noise): wall; host CPU; server CPU",
     "1a", None, (0, 1, 2), False),
    ("1b bare ping-pong, identical code in both (the noise): wall", "1b", None, (0,), False),
    ("one hook invocation (on_check_permission pass-through): wall", "hook", None, (0,), True),
    ("…its host CPU; its middleware CPU", "hook", None, (1, 2), True),
    ("one hook invocation that reads a kwarg first (it pays fidelity's in-place edit check, by a snapshot of the "
     "value's fields; the earlier tree had none): wall; middleware CPU", "hook_reads", None, (0, 2), True),
    ("one intercepted item at one round trip (run_ahead; before: its default, also one)",
     "stream_InterceptAllRunAhead", "stream_InterceptAll", (0,), True),
    ("one intercepted item, default lock-step (two round trips, by design) / before's (one)",
     "stream_InterceptAll", None, (0,), False),
    ("whole reply, no middleware: wall; host CPU", "reply_none", None, (0, 1), False),
    ("whole reply with 1 remote middleware on 4 hooks: wall; host CPU", "reply_remote", None, (0, 1), True),
]  # fmt: skip


def _ratios(result: VersusResult, now_op: str, before_op: str | None, figures: tuple[int, ...]) -> list[float]:
    return [result.ratio(now_op, before_op, i) for i in figures]


def rows(result: VersusResult) -> list[list[str]]:
    from .report import times  # report imports this module

    return [
        [what, "; ".join(times(x) for x in _ratios(result, now_op, before_op, figures))]
        for what, now_op, before_op, figures, _ in ROWS
    ]


def target_rows(result: VersusResult | None) -> list[list[str]]:
    """For BENCHMARKS.md's targets table: the noise (1a) as context, then each target row."""
    from .report import times, verdict  # report imports this module

    if result is None or not result.rounds:
        return []
    out = []
    for what, now_op, before_op, figures, target in ROWS:
        if not target and now_op != "1a":
            continue
        values = _ratios(result, now_op, before_op, figures)
        out.append(
            [
                f"This tree / {result.rev} (before the isolation work), same run: {what}",
                "; ".join(times(x) for x in values),
                "≤ 1.05x" if target else "—",
                verdict(max(values) <= 1.05) if target else "—",
            ]
        )
    return out


def section(result: VersusResult | None) -> str:
    from .report import table  # report imports this module

    if result is None or not result.rounds:
        note = result.note if result is not None else "not measured"
        return f"### This tree against {BASELINE} (before the isolation work)\n\n{note}"
    return "\n".join(
        [
            f"### This tree against {result.rev} (before the isolation work), side by side",
            "",
            f"{len(result.rounds)} alternating rounds, each tree in its own worker process with its own servers "
            "(bench/versus.py); medians of the per-round ratios now / before. 1a and 1b run identical code in "
            "both trees: how far they stray from 1.00x is the noise of this run.",
            "",
            table(["what", "now / before"], rows(result)),
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.versus", description=__doc__)
    parser.add_argument("--rev", default=BASELINE)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args(argv)
    print(section(measure(args.rounds, args.rev)))


if __name__ == "__main__":
    main()
