"""Where the host's time goes when the tracing server is attached: the reply of the tracing row
(3 tool rounds, then 1,000 text deltas) with the real server exporting to a real receiver, the
host's per-invocation steps timed one by one. ``python -m bench.tracer_parts [--replies 100]``.

The tracing server's hooks are detached, so its copies are written after the reply (detached.py):
what the reply waits for is the host's own work at each of its 8 invocations (open it, encode its
Begin, encode the copies of the items it observes, end it) and one generator layer per streamed
item on on_reply and on_model_call. The steps are timed by wrapping them, which adds about 0.3 µs
per call; the wrapped steps nest (a Begin's encoding is inside the open), so the rows do not add up.
A diagnostic, not a target: docs/performance.md reads it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

from agent_host.remote import RemoteMiddleware, detached, protocol

from .builtins import BUILTINS, fleet, reply
from .harness import Sample

# (owner, attribute, what it is), in the order they run in an invocation
STEPS: list[tuple[Any, str, str]] = [
    (detached.Watch, "_open", "open an invocation (the Begin included)"),
    (protocol, "encode_kwargs", "…encode the Begin's input kwargs"),
    (protocol.HookCall, "_context", "…fill a message's hook context"),
    (protocol.HookCall, "_item_message", "encode an observed item's copy (its context included)"),
    (protocol.HookCall, "_done_message", "encode the inner_done"),
    (detached.DetachedDelivery, "end", "hold the invocation's copies for after the reply"),
    (detached.Watch, "_ended", "end it (its latency metric)"),
]


def _timed(fn: Callable[..., Any], key: str, spent: dict[str, float], calls: collections.Counter[str]) -> Any:
    if asyncio.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - t
                calls[key] += 1

        return timed_async

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - t
            calls[key] += 1

    return timed


async def measure(replies: int) -> str:
    bench = BUILTINS["tracing"]
    f = fleet(["tracing"])
    server = f.servers["tracing"]["attached"]
    spent: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter[str] = collections.Counter()
    try:
        server.start()
        rm = await RemoteMiddleware(server.address).connect()
        try:
            for _ in range(20):  # warm: the codec's plans, the kept streams
                await reply([rm], bench)
                await reply([], bench)
            plain: dict[str, list[Sample]] = {"none": [], "tracer": []}
            for _ in range(replies):  # unwrapped, interleaved: the difference to explain
                plain["tracer"].append(await reply([rm], bench))
                plain["none"].append(await reply([], bench))
            originals = [(owner, name, getattr(owner, name)) for owner, name, _ in STEPS]
            for owner, name, fn in originals:
                setattr(owner, name, _timed(fn, name, spent, calls))
            try:
                for _ in range(replies):
                    await reply([rm], bench)
            finally:
                for owner, name, fn in originals:
                    setattr(owner, name, fn)
        finally:
            await rm.close()
    finally:
        f.stop()

    def ms(samples: list[Sample], attr: str) -> float:
        return statistics.median(getattr(s, attr) for s in samples) * 1e3

    lines = ["| | no middleware | tracing server | difference |", "| --- | --- | --- | --- |"]
    for attr, label in (("first", "time to first text"), ("wall", "time to reply end")):
        none, tracer = ms(plain["none"], attr), ms(plain["tracer"], attr)
        lines.append(f"| {label} | {none:.2f} ms | {tracer:.2f} ms | {tracer - none:+.2f} ms |")
    lines += ["", "| host step (per reply of the tracer) | calls | µs per call | µs per reply |"]
    lines.append("| --- | --- | --- | --- |")
    for _, name, what in STEPS:
        n = calls[name]
        if n:
            per_call, per_reply = spent[name] / n * 1e6, spent[name] / replies * 1e6
            lines.append(f"| {what} | {n / replies:.0f} | {per_call:.1f} | {per_reply:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.tracer_parts", description=__doc__)
    parser.add_argument("--replies", type=int, default=100)
    args = parser.parse_args()
    print(asyncio.run(asyncio.wait_for(measure(args.replies), 300)))


if __name__ == "__main__":
    main()
