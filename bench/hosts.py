"""Replies per second of 1, 2 and 3 real host processes on one PostgreSQL vs one host on SQLite.

Every variant serves the same bounded load: ``CLIENTS`` concurrent clients, each with a session of
its own on one host (client ``i`` on host ``i mod n``), send ``REPLIES`` replies in all, each a
tool round with the offline model ("What's the weather in Paris?": the user turn, the tool's
start and result, the answer and the end are each a write of the store). Sessions are fresh each
round, so every round's work is the same. Variants run interleaved, rounds rotating the order,
and the figure is the median rate over rounds. A throwaway PostgreSQL cluster (clients/postgres.py)
serves every PostgreSQL host; without PostgreSQL's server binaries the row is skipped, saying why.

The hosts, the database and this process (the clients) share the machine's cores: on a small
machine the hosts compete for the same CPUs, so the rate shows what the store's locking and round
trips cost, not how far more machines would scale. ``python -m bench.hosts`` runs this row alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from agentmw.data import ReplyEndEvent, ReplyFinishedReason, UserMsg
from clients.chat import HostClient
from clients.launch import ServerProcess, start_all
from clients.postgres import ABSENT, create_database, pg_bin, throwaway_cluster

REPLIES = 240  # per variant and round
CLIENTS = 12
QUESTION = "What's the weather in Paris?"
VARIANTS = {"SQLite, 1 host": 1, "PostgreSQL, 1 host": 1, "PostgreSQL, 2 hosts": 2, "PostgreSQL, 3 hosts": 3}
BASELINE = "SQLite, 1 host"
TIMEOUT = 120.0  # seconds for one variant's load: the bench never runs unbounded


@dataclass
class HostsResult:
    rates: dict[str, list[float]] = field(default_factory=dict)  # variant -> replies/s per round
    replies: int = REPLIES
    clients: int = CLIENTS
    note: str = ""  # why the row is missing, or what went wrong
    failed: int = 0  # replies that did not complete (none expected)


def _host(name: str, db: str, log_dir: Path) -> ServerProcess:
    argv = ["-m", "agent_host", "--listen", "127.0.0.1:0", "--db", db, "--log-level", "warning"]
    return ServerProcess(argv, name=name, log_dir=log_dir, startup=30, new_session=True)


async def _load(addresses: list[str], replies: int, clients: int, tag: str) -> tuple[float, int]:
    """``replies`` replies from ``clients`` concurrent clients spread over the hosts: the rate, and
    how many did not complete."""
    connections = [HostClient(a) for a in addresses]
    per_client = [replies // clients + (i < replies % clients) for i in range(clients)]
    failed = 0

    async def client(i: int) -> None:
        nonlocal failed
        host = connections[i % len(connections)]
        for _ in range(per_client[i]):
            items = [item async for item in host.reply(f"{tag}-{i}", UserMsg(QUESTION))]
            end = next((x for x in items if isinstance(x, ReplyEndEvent)), None)
            failed += end is None or end.finished_reason != ReplyFinishedReason.COMPLETED

    try:
        started = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(clients))), TIMEOUT)
        return replies / (time.perf_counter() - started), failed
    finally:
        for c in connections:
            await c.close()


async def measure(rounds: int, replies: int = REPLIES, clients: int = CLIENTS) -> HostsResult:
    result = HostsResult(replies=replies, clients=clients)
    bindir = pg_bin()
    if bindir is None:
        result.note = f"skipped: {ABSENT}"
        return result
    with contextlib.ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="agentmw-bench-hosts-")))
        try:
            server = stack.enter_context(throwaway_cluster(bindir))
        except RuntimeError as exc:
            result.note = f"skipped: {exc}"
            return result
        dsn = await create_database(server, "agentmw_bench")
        sqlite = _host("sqlite-host", str(logs / "sessions.db"), logs)
        pg = [_host(f"pg-host{i}", dsn, logs) for i in range(max(VARIANTS.values()))]
        await asyncio.to_thread(start_all, [sqlite, *pg])
        stack.callback(lambda: [p.stop() for p in (sqlite, *pg)])
        hosts = {v: [sqlite.address] if v == BASELINE else [p.address for p in pg[:n]] for v, n in VARIANTS.items()}
        await _load(list({a for h in hosts.values() for a in h}), clients, clients, "warm-up")  # connections, caches
        names = list(VARIANTS)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                rate, failed = await _load(hosts[name], replies, clients, f"r{r}-{names.index(name)}")
                result.rates.setdefault(name, []).append(rate)
                result.failed += failed
    if result.failed:
        result.note = f"{result.failed} replies did not complete: the figures are not to be trusted"
    return result


def section(result: HostsResult | None) -> str:
    """The BENCHMARKS.md section of this row."""
    title = "### Hosts: replies/s of 1-3 host processes on one PostgreSQL vs one host on SQLite"
    if result is None:
        return f"{title}\n\nnot run."
    if not result.rates:
        return f"{title}\n\n{result.note}"
    base = statistics.median(result.rates[BASELINE])
    rows = [
        "| variant | replies/s (median) | range over rounds | vs SQLite, 1 host |",
        "| --- | --- | --- | --- |",
    ]
    for name, rates in result.rates.items():
        rate = statistics.median(rates)
        rows.append(f"| {name} | {rate:,.0f} | {min(rates):,.0f}-{max(rates):,.0f} | {rate / base:.2f}x |")
    what = (
        f"{result.replies} replies per variant and round from {result.clients} concurrent clients, one session "
        f"each, spread over the hosts; each reply is one tool round of the offline model ({QUESTION!r}); "
        f"{len(next(iter(result.rates.values())))} rounds interleaved. The hosts, PostgreSQL and the clients "
        "share this machine's cores (see Environment), so more hosts add contention, not CPUs: the rows "
        "show the shared store's cost per reply, not how far hosts on more machines scale."
    )
    return "\n".join([title, "", what, "", *rows] + ([f"\n{result.note}"] if result.note else []))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.hosts", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--replies", type=int, default=REPLIES)
    args = parser.parse_args(argv)
    print(section(asyncio.run(measure(args.rounds, args.replies))))


if __name__ == "__main__":
    main()
