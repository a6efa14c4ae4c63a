"""Measurement helpers: interleaved rounds, medians, and per-round ratios.

A noisy shared machine drifts over seconds, so compared variants run in the same round, one batch
each, in an order that rotates from round to round; a ratio is the median of the per-round ratios,
an absolute value the median of the per-round values.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Sample:
    """One batch of one variant, per operation: wall seconds, host-process CPU seconds, CPU seconds
    of the server process it talks to (when measured), for replies the time to first text, and a
    scenario's own time (``mark``: e.g. to the first audio)."""

    wall: float
    cpu: float
    first: float = math.nan
    server_cpu: float = math.nan
    mark: float = math.nan


Batch = Callable[[], Awaitable[Sample]]


@dataclass
class Series:
    """The samples of one variant over all rounds."""

    samples: list[Sample] = field(default_factory=list)

    @property
    def walls(self) -> list[float]:
        return [s.wall for s in self.samples]

    @property
    def cpus(self) -> list[float]:
        return [s.cpu for s in self.samples]

    @property
    def wall(self) -> float:
        return statistics.median(self.walls)

    @property
    def firsts(self) -> list[float]:
        return [s.first for s in self.samples]

    @property
    def cpu(self) -> float:
        return statistics.median(self.cpus)

    @property
    def first(self) -> float:
        return statistics.median(self.firsts)

    @property
    def server_cpu(self) -> float:
        return statistics.median(s.server_cpu for s in self.samples)

    @property
    def mark(self) -> float:
        return statistics.median(s.mark for s in self.samples)


def process_cpu(pid: int) -> float:
    """CPU seconds used so far by all threads of another process (Linux schedstat, ns resolution)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    return total / 1e9


async def timed_batch(op: Callable[[], Awaitable[object]], n: int, *, server_pid: int | None = None) -> Sample:
    """Run ``op`` ``n`` times back to back; the mean wall and CPU time per operation (and the mean
    CPU of process ``server_pid`` per operation)."""
    server0 = process_cpu(server_pid) if server_pid else math.nan
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        await op()
    wall, cpu = (time.perf_counter() - wall0) / n, (time.process_time() - cpu0) / n
    server = (process_cpu(server_pid) - server0) / n if server_pid else math.nan
    return Sample(wall, cpu, server_cpu=server)


async def interleave(variants: dict[str, Batch], rounds: int, *, warmup: int = 1) -> dict[str, Series]:
    """Run every variant once per round, rotating the order; ``warmup`` rounds are discarded."""
    names = list(variants)
    series = {name: Series() for name in names}
    for r in range(warmup + rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            sample = await variants[name]()
            if r >= warmup:
                series[name].samples.append(sample)
    return series


def ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """Median of the per-round ratios num[i] / den[i]."""
    return statistics.median(a / b for a, b in zip(num, den, strict=True))


def spread(values: Sequence[float]) -> tuple[float, float]:
    """The interquartile range (25th, 75th percentile) of a list of values."""
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def per_round(a: Sequence[float], b: Sequence[float], fn: Callable[[float, float], float]) -> list[float]:
    return [fn(x, y) for x, y in zip(a, b, strict=True)]


def pace_label(pace: tuple[float, float]) -> str:
    """A model pace, (time to first token, seconds per chunk), as the reports write it."""
    ttft, token = pace
    return "instant" if not (ttft or token) else f"{ttft * 1e3:.0f} ms to first token, {token * 1e3:g} ms/chunk"
