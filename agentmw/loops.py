"""Which event loop runs the host (``loop:`` in host.yaml, ``--loop``, AGENTMW_LOOP) and a
middleware server's ``serve()`` (``loop=``, AGENTMW_LOOP): asyncio's own, or uvloop (libuv; less
per-message overhead on the event loop, see BENCHMARKS.md). "auto" takes uvloop when it can be
imported (it is a dependency on Linux and macOS) and asyncio's loop otherwise.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
LOOPS = ("asyncio", "uvloop", "auto")
DEFAULT_LOOP = "asyncio"  # the loop every test runs on; uvloop is opt-in (docs/host.md)


def check_loop(name: str, where: str = "loop") -> str:
    """``name`` if it is a known choice, else ValueError saying where."""
    if name not in LOOPS:
        raise ValueError(f"{where}: {name!r} is not one of {', '.join(LOOPS)}")
    if name == "uvloop" and _uvloop() is None:
        raise ValueError(f"{where}: uvloop is not installed (pip install uvloop, or loop: asyncio)")
    return name


def choose_loop(name: str | None = None) -> str:
    """The loop to run: ``name`` when given, else AGENTMW_LOOP, else DEFAULT_LOOP; a ValueError
    names where a bad choice came from ("loop" or "AGENTMW_LOOP")."""
    if name:
        return check_loop(name)
    env = os.environ.get("AGENTMW_LOOP")
    return check_loop(env, "AGENTMW_LOOP") if env else DEFAULT_LOOP


def loop_factory(name: str | None = None) -> Callable[[], asyncio.AbstractEventLoop]:
    """A factory of new event loops of the chosen kind (``choose_loop``)."""
    uvloop = _uvloop() if choose_loop(name) != "asyncio" else None
    return uvloop.new_event_loop if uvloop is not None else asyncio.new_event_loop


def run(main: Coroutine[Any, Any, T], loop: str | None = None) -> T:
    """``asyncio.run(main)`` on the chosen loop. The new loop is also made the thread's current
    loop, as asyncio.run does (a Runner given a loop_factory does not; grpc.aio then ran measurably
    slower per message)."""
    try:
        factory = loop_factory(loop)
    except ValueError:
        main.close()  # never to run: no "coroutine was never awaited" warning after the error
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        asyncio.set_event_loop(runner.get_loop())
        try:
            return runner.run(main)
        finally:
            asyncio.set_event_loop(None)


def loop_name() -> str:
    """The kind of the running loop: "uvloop" or "asyncio"."""
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"


def _uvloop() -> Any:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop


__all__ = ["DEFAULT_LOOP", "LOOPS", "check_loop", "choose_loop", "loop_factory", "loop_name", "run"]
