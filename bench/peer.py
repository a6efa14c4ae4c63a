"""The host side of the optional AgentScope 2.0.11 peer (bench/agentscope_peer.py in its own venv).

The peer is a long-lived subprocess driven over stdin/stdout, one JSON line each way, so its runs
take their turn inside the interleaved rounds like any other variant. If it cannot start or fails,
it is switched off and the report says why; the rest of the bench goes on.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .harness import Sample

SCRIPT = Path(__file__).resolve().parent / "agentscope_peer.py"
ANSWER_TIMEOUT = 30.0  # seconds for one command (32 concurrent replies take about half a second)


class WorkerFailed(RuntimeError):
    """A bench worker process (this peer, or a host of bench/four_servers.py) failed or answered an error."""


async def ask_worker(
    proc: asyncio.subprocess.Process, command: dict[str, Any], timeout: float, tail: Callable[[], str] = lambda: ""
) -> dict[str, Any]:
    """One JSON command line to a worker's stdin, its JSON answer line from stdout. Lines that are not
    JSON objects are a library's stray prints and skipped; ``tail()`` adds context to a failure."""
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write((json.dumps(command) + "\n").encode())
        await proc.stdin.drain()
        async with asyncio.timeout(timeout):
            while (line := await proc.stdout.readline()).strip()[:1] not in (b"{", b""):
                pass
    except (TimeoutError, ConnectionError) as exc:
        raise WorkerFailed(f"{command['op']}: {type(exc).__name__}{tail()}") from None
    if not line:
        raise WorkerFailed(f"{command['op']}: the worker exited{tail()}")
    answer = json.loads(line)
    if "error" in answer:
        raise WorkerFailed(f"{command['op']}: {answer['error']}")
    return answer


class AgentScopePeer:
    def __init__(self, proc: asyncio.subprocess.Process, python: str) -> None:
        self.proc = proc
        self.python = python
        self.version = "?"
        self.failure: str | None = None

    @classmethod
    async def start(cls, python: str) -> AgentScopePeer:
        proc = await asyncio.create_subprocess_exec(
            python,
            str(SCRIPT),
            "--serve",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            cwd="/tmp",  # so that the repo's packages can never shadow the peer's
        )
        peer = cls(proc, python)
        try:
            peer.version = (await peer.ask({"op": "hello"}, timeout=60.0))["version"]
        except BaseException:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            raise
        return peer

    @property
    def alive(self) -> bool:
        return self.failure is None

    async def ask(self, command: dict[str, Any], *, timeout: float = ANSWER_TIMEOUT) -> dict[str, Any]:
        return await ask_worker(self.proc, command, timeout)

    async def sample(self, command: dict[str, Any]) -> Sample:
        """A Sample from a reply-like command; NaN once the peer has failed."""
        if not self.alive:
            return Sample(math.nan, math.nan, math.nan)
        try:
            answer = await self.ask(command)
        except WorkerFailed as exc:
            self.failure = str(exc)
            return Sample(math.nan, math.nan, math.nan)
        if "value" in answer:
            return Sample(answer["value"], math.nan)
        return Sample(answer["wall"], answer["cpu"], answer["first"])

    async def close(self) -> None:
        if self.proc.returncode is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 5)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


async def start_peer(python: str | None) -> tuple[AgentScopePeer | None, str]:
    """(the peer or None, a note for the report)."""
    if python is None:
        return None, "not measured: no Python with agentscope 2.0.11 (see `python -m bench.run --help`)"
    try:
        peer = await AgentScopePeer.start(python)
    except (WorkerFailed, OSError, KeyError, json.JSONDecodeError) as exc:
        return None, f"not measured: the AgentScope peer did not start ({exc})"
    return peer, f"AgentScope {peer.version} in-process, by {python}, interleaved with the host's variants"
