"""``make bench``: measure the remote-middleware costs side by side in one run; write BENCHMARKS.md.

Middleware and the bare echo server run as separate processes on 127.0.0.1; this process is the
host. Compared variants are interleaved round by round and summarised by medians (see harness.py).
Every load loop is bounded; the whole run takes about five minutes on 2 cores, half of it the
four servers vs AgentScope (section 8; starting the mem0 server alone takes 5-10 s).

Options: ``--rounds N`` (default 25), ``--quick`` (few rounds, for a smoke test), ``--out PATH``,
``--agentscope-python PATH`` (a Python with agentscope==2.0.11 installed, for the optional peer;
default ``$BENCH_AGENTSCOPE_PYTHON`` or /tmp/agentscope-venv/bin/python when it exists). The peer
is installed by ``make bench`` into its own venv, .venv-agentscope (never into .venv); AgentScope
with its own four middleware (section 8, bench/four_servers.py) into .venv-agentscope-full
(``$BENCH_AGENTSCOPE_FULL_PYTHON``). ``--only four`` runs section 9 alone. Section 10 builds the tree
before the isolation work once (.bench-versus/, bench/versus.py) and runs it side by side with this one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc

from agent_host.remote import RemoteMiddleware
from agentmw import loops
from clients.launch import ROOT, ServerProcess, middleware_server, start_all

from . import builtins, four_servers, hosts, python_cost, scenarios, versus
from .harness import Sample, Series
from .peer import start_peer
from .report import Results, environment, render

DEFAULT_AGENTSCOPE_PYTHON = "/tmp/agentscope-venv/bin/python"
MEASURE_TIMEOUT = 900.0  # seconds: the bench never runs unbounded


def _agentscope_python(explicit: str | None) -> str | None:
    candidate = explicit or os.environ.get("BENCH_AGENTSCOPE_PYTHON") or DEFAULT_AGENTSCOPE_PYTHON
    return candidate if Path(candidate).exists() else None


MIDDLEWARE = [
    "PassThroughCall",
    "PassThroughCallEager",
    "PassThroughCallDone",
    "InterceptAll",
    "InterceptAllRunAhead",
    "ReplyEndOnly",
    "Realistic",
]


ECHO_AHEAD = "echo-ahead"  # bench.echo_server --on-reply run_ahead, among the servers


CALLS_MIDDLEWARE = [
    "PassThroughCall",
    "PassThroughCallEager",
    "PassThroughCallDone",
    "InterceptAll",
    "InterceptAllRunAhead",
]


def start_servers(
    loop: str = "asyncio", *, calls_only: bool = False
) -> tuple[ServerProcess, dict[str, ServerProcess], builtins.Fleet]:
    """The echo server, one process per bench middleware class, the budget server and the other
    built-in servers, in parallel; ``calls_only``: the echo server and the middleware of 1-3. Every
    server of 1-3 runs on the event loop ``loop``, as this process does."""
    echo = ServerProcess(["-m", "bench.echo_server", "--address", "127.0.0.1:{port}", "--loop", loop], name="echo")
    names = CALLS_MIDDLEWARE if calls_only else MIDDLEWARE
    servers = {name: middleware_server(f"bench.middlewares:{name}") for name in names}
    for proc in servers.values():
        proc.env["AGENTMW_LOOP"] = loop
    # The protobuf peer as a run_ahead middleware (a real host attaches it: the run_ahead split of 3)
    argv = ["-m", "bench.echo_server", "--address", "127.0.0.1:{port}", "--loop", loop, "--on-reply", "run_ahead"]
    servers[ECHO_AHEAD] = ServerProcess(argv, name=ECHO_AHEAD)
    if calls_only:
        start_all([echo, *servers.values()])
        return echo, servers, builtins.Fleet()
    servers["ReplyBudget"] = ServerProcess(
        ["-m", "mw_servers.budget", "--address", "127.0.0.1:{port}", "--token-budget", str(scenarios.BUDGET_TOKENS)],
        name="budget",
    )
    fleet = builtins.fleet(list(builtins.BUILTINS))
    try:
        start_all([echo, *servers.values(), *fleet.processes])  # all or none: on an error none is left running
    except BaseException:
        fleet.stop()
        raise
    return echo, servers, fleet


async def measure_calls_only(rounds: int, out: str) -> None:
    """1-3 alone, on this process's loop, with servers on the same kind of loop; the series go to
    ``out`` as JSON (the main run starts this in a child process for the uvloop figures)."""
    echo, servers, _ = start_servers(loops.loop_name(), calls_only=True)
    try:
        async with connect_env(echo, servers, calls_only=True) as env:
            protocol = await scenarios.count_protocol(env)
            calls = await scenarios.measure_calls(env, protocol, rounds)
        Path(out).write_text(
            json.dumps({name: [dataclasses.asdict(s) for s in series.samples] for name, series in calls.items()})
        )
    finally:
        for proc in [echo, *servers.values()]:
            proc.stop()


@contextlib.asynccontextmanager
async def connect_env(
    echo: ServerProcess, servers: dict[str, ServerProcess], *, calls_only: bool = False
) -> AsyncIterator[scenarios.Env]:
    """Clients of the started servers, closed on the way out; ``calls_only``: those of 1-3 alone."""
    clients: list[RemoteMiddleware] = []
    channels = [grpc.aio.insecure_channel(echo.address)]
    channels += [grpc.aio.insecure_channel(servers[name].address) for name in ("InterceptAll", "InterceptAllRunAhead")]

    async def attach(name: str) -> RemoteMiddleware:
        rm = await RemoteMiddleware(echo.address if name == "echo" else servers[name].address).connect()
        clients.append(rm)
        return rm

    try:
        await asyncio.wait_for(channels[0].channel_ready(), 10)
        env = scenarios.Env(
            echo=channels[0],
            rm_call=await attach("PassThroughCall"),
            rm_eager=await attach("PassThroughCallEager"),
            rm_done=await attach("PassThroughCallDone"),
            rm_icpt=await attach("InterceptAll"),
            rm_icpt_ahead=await attach("InterceptAllRunAhead"),
            rm_end=[] if calls_only else [await attach("ReplyEndOnly") for _ in range(4)],
            rm_real=[] if calls_only else [await attach("Realistic") for _ in range(4)],
            rm_budget=await attach("PassThroughCall" if calls_only else "ReplyBudget"),  # unused in 1-3
            rm_floor=await attach("echo"),
            rm_floor_ahead=await attach(ECHO_AHEAD),
            icpt=channels[1],
            icpt_ahead=channels[2],
            pids={"echo": echo.pid, **{name: proc.pid for name, proc in servers.items()}},
        )
        yield env
    finally:
        for rm in clients:
            await rm.close()
        for channel in channels:
            await channel.close()


async def calls_on_uvloop(rounds: int) -> dict[str, Series] | None:
    """1-3 again with everything on uvloop (host, echo, middleware), in a child process."""
    try:
        loops.check_loop("uvloop")
    except ValueError:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "calls.json")
        argv = [sys.executable, "-m", "bench.run", "--loop", "uvloop", "--calls-only", out, "--rounds", str(rounds)]
        proc = await asyncio.create_subprocess_exec(*argv, cwd=ROOT)
        if await proc.wait() != 0:
            return None
        data = json.loads(Path(out).read_text())
    return {name: Series([Sample(**s) for s in samples]) for name, samples in data.items()}


async def measure(rounds: int, quick: bool, peer_python: str | None) -> Results:
    started = await asyncio.gather(start_peer(peer_python), asyncio.to_thread(start_servers), return_exceptions=True)
    peer_started, servers_started = started
    if isinstance(peer_started, BaseException) or isinstance(servers_started, BaseException):
        if not isinstance(peer_started, BaseException) and peer_started[0] is not None:
            await peer_started[0].close()
        if not isinstance(servers_started, BaseException):
            for proc in [servers_started[0], *servers_started[1].values()]:
                proc.stop()
            servers_started[2].stop()
        raise servers_started if isinstance(servers_started, BaseException) else peer_started  # type: ignore[misc]
    (peer, peer_note), (echo, servers, fleet) = peer_started, servers_started
    try:
        async with connect_env(echo, servers) as env:
            res = Results(rounds=rounds, peer_note=peer_note)
            res.env_start = environment()
            step = _progress(time.perf_counter())
            res.protocol = await scenarios.count_protocol(env)
            step("protocol counts")
            res.calls = await scenarios.measure_calls(env, res.protocol, rounds)
            step("1-3 baselines, hook invocation, intercepted item")
            res.idle = await scenarios.measure_idle_round_trip(env, 9 if quick else 25)
            step("1b after a paced model's wait")
            res.python_cost = await python_cost.measure(rounds)
            step("3 per-item work of host and SDK without I/O")
            res.calls_uvloop = await calls_on_uvloop(rounds)
            step("1-3 again on uvloop (a child process)")
            res.bypass = await scenarios.measure_bypass(env, rounds, peer)
            step("4 bypassed items")
            res.unimplemented = await scenarios.measure_unimplemented(env, max(rounds // 3, 3))
            step("4 unimplemented hooks")
            res.traffic = await scenarios.count_reply(env)
            res.replies = await scenarios.measure_replies(env, rounds, peer)
            step("5 whole replies")
            res.fairness = await scenarios.measure_fairness(env, 2 if quick else 4, peer)
            step("6 fairness")
            res.builtins = await builtins.measure(fleet, rounds)
            step("7 built-in servers")
            res.hosts = await hosts.measure(1 if quick else 3)
            step("8 hosts on one PostgreSQL vs SQLite")
            res.four = await four_servers.measure(quick=quick)
            step("9 the four servers vs AgentScope")
            res.versus = await asyncio.to_thread(versus.measure, 3 if quick else max(rounds, versus.ROUNDS))
            step(f"10 this tree against {versus.BASELINE}")
            if peer is not None:
                res.peer_ok = peer.alive
                if not peer.alive:
                    res.peer_note = f"failed during the run: {peer.failure}"
    finally:
        if peer is not None:
            await peer.close()
        for proc in [echo, *servers.values()]:
            proc.stop()
        fleet.stop()
    res.builtin_notes, res.spans_exported = fleet.notes, fleet.spans
    return res


def _progress(t0: float) -> Callable[[str], None]:
    def step(what: str) -> None:
        print(f"[bench {time.perf_counter() - t0:6.1f}s] {what}", file=sys.stderr, flush=True)

    return step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--quick", action="store_true", help="few rounds: a smoke test, not figures")
    parser.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
    parser.add_argument("--agentscope-python", default=None)
    parser.add_argument("--only", choices=["four"], help="four: only the four servers vs AgentScope (section 9)")
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio", help="this process's event loop")
    parser.add_argument("--calls-only", metavar="JSON", help=argparse.SUPPRESS)  # internal: see calls_on_uvloop
    args = parser.parse_args(argv)
    rounds = 3 if args.quick else args.rounds
    if args.calls_only:
        loops.run(asyncio.wait_for(measure_calls_only(rounds, args.calls_only), MEASURE_TIMEOUT), args.loop)
        return
    started = time.perf_counter()
    if args.only == "four":
        four = asyncio.run(asyncio.wait_for(four_servers.measure(quick=args.quick), MEASURE_TIMEOUT))
        Path(args.out).write_text(four_servers.section(four) + "\n")
        print(f"wrote {args.out} in {time.perf_counter() - started:.0f}s", file=sys.stderr)
        return
    peer_python = _agentscope_python(args.agentscope_python)
    results = asyncio.run(asyncio.wait_for(measure(rounds, args.quick, peer_python), MEASURE_TIMEOUT))
    results.env_end = environment()
    results.duration = time.perf_counter() - started
    text = render(results)
    Path(args.out).write_text(text)
    print(text)
    print(f"wrote {args.out} in {results.duration:.0f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
