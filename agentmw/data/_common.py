"""Id and timestamp factories shared by every data class (pluggable, as in AgentScope).

Every streamed chunk and event gets an id and a timestamp, several per delta, so both are on the
hottest path of a reply: the defaults below cost about a third of ``os.urandom(16).hex()`` and of
``datetime.now().isoformat()``, with the same output (``make bench``: bench/optimizations.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from datetime import datetime

_ID_BATCH = 256  # ids per read of the OS's random source


def _ids() -> Iterator[str]:
    hexed = os.urandom(16 * _ID_BATCH).hex()
    return iter([hexed[i : i + 32] for i in range(0, 32 * _ID_BATCH, 32)])


_id_source = _ids()


def _random_id() -> str:
    """32 random hex digits, like uuid4().hex, from the OS's random source 256 at a time. Thread
    safe: ``next`` on a list iterator is atomic, so two threads never get the same id (a refill
    race only discards the rest of one batch)."""
    global _id_source
    try:
        return next(_id_source)
    except StopIteration:
        _id_source = source = _ids()
        return next(source)


# (end of the current second, its start, its isoformat + ".", its UTC offset), replaced as one
# object so that a thread never pairs one second's prefix with another second's fraction.
_second: tuple[float, int, str, str] = (0.0, 0, "", "")


def _local_isoformat() -> str:
    """``datetime.now().astimezone().isoformat()``: local time with microseconds and its UTC offset
    (a reader in another time zone, e.g. a tracing server, reads the same instant), formatting the
    date, time of day and offset once per second instead of once per call."""
    global _second
    t = time.time()
    end, start, prefix, offset = _second
    if t >= end or t < start:  # a new second (or the clock went back)
        start = int(t)
        moment = datetime.fromtimestamp(start).astimezone()
        prefix, offset = moment.replace(tzinfo=None).isoformat() + ".", moment.isoformat()[19:]
        _second = (start + 1.0, start, prefix, offset)
    micros = round((t - start) * 1e6)  # half to even, as datetime rounds
    if micros >= 1_000_000:  # rounds up into the next second: rare, done the slow way
        return datetime.fromtimestamp(t).astimezone().isoformat()
    return (prefix + str(micros + 1_000_000)[1:] if micros else prefix[:-1]) + offset


_id_factory: Callable[[], str] = _random_id
_time_factory: Callable[[], str] = _local_isoformat


def new_id() -> str:
    return _id_factory()


def now() -> str:
    return _time_factory()


def set_id_factory(factory: Callable[[], str]) -> None:
    global _id_factory
    _id_factory = factory


def set_time_factory(factory: Callable[[], str]) -> None:
    global _time_factory
    _time_factory = factory
