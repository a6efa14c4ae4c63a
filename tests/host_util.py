"""Helpers for tests/test_host_service.py: real host and middleware processes, and a recorder.

``RecorderMiddleware`` is served in its own process by the SDK launcher
(``python -m agentmw.sdk tests.host_util:RecorderMiddleware``). Its on_reply writes what it saw
into its own session slot, so a test can check through GetSession which replies reached it and
how they ended (an interrupted one included), and that the slot survives pauses and restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from agentmw.codec import codec
from agentmw.data import ReplyEndEvent, ReplyStartEvent
from agentmw.middleware import MiddlewareBase, subscribe
from agentmw.tools import tool
from agentmw.v1 import host_pb2, host_pb2_grpc
from clients.launch import ROOT, ServerProcess

KEY = "recorder"


@tool(description="Shout the text back.")
def shout(text: str) -> str:
    return text.upper() + "!"


@tool(description="Rest for a while, then say so.")
async def nap(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return f"rested {seconds}s"


class RecorderMiddleware(MiddlewareBase):
    """Records each reply start and end (with its finished reason) in ``middle_context["recorder"]``."""

    subscriptions = {"on_reply": subscribe(intercept=[ReplyStartEvent, ReplyEndEvent])}

    async def get_middleware_key(self) -> str:
        return KEY

    async def list_tools(self) -> list[Any]:
        return [shout, nap]

    async def on_reply(self, agent: Any, input_kwargs: dict[str, Any], next_handler: Any) -> AsyncIterator[Any]:
        async for event in next_handler():
            slot = agent.state.middle_context.get(KEY) or {"starts": 0, "ends": []}
            if isinstance(event, ReplyStartEvent):
                slot["starts"] += 1
            elif isinstance(event, ReplyEndEvent):
                slot["ends"].append({"reply_id": event.reply_id, "finished_reason": event.finished_reason.value})
            agent.state.middle_context[KEY] = slot
            yield event


def _echo(name: str) -> Any:
    @tool(name=name, description=f"Say the text back, as {name}.")
    def echo(text: str) -> str:
        return f"{name}:{text}"

    return echo


class ToolSetMiddleware(MiddlewareBase):
    """Tools only: one per name in the environment variable TOOLSET (comma-separated), each saying
    its name and the text. Served again with another TOOLSET, it is a new version of the server."""

    async def get_middleware_key(self) -> str:
        return os.environ.get("TOOLSET_KEY", "toolset")

    async def list_tools(self) -> list[Any]:
        return [_echo(name) for name in os.environ.get("TOOLSET", "").split(",") if name]


# ---------------------------------------------------------------------------------------------
# Processes.


class Procs:
    """Starts processes for one test and kills every one of them at the end."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[ServerProcess] = []

    def start(
        self, name: str, argv: list[str], timeout: float = 20.0, env: dict[str, str] | None = None
    ) -> ServerProcess:
        proc = ServerProcess(argv, name=name, env=env, log_dir=self.log_dir, startup=timeout, new_session=True)
        self.procs.append(proc)
        return proc.start()

    def recorder(self) -> ServerProcess:
        target = "tests.host_util:RecorderMiddleware"
        return self.start("recorder", ["-m", "agentmw.sdk", target, "--address", "127.0.0.1:0"])

    def host(self, db: Path, *args: str, name: str = "host") -> ServerProcess:
        return self.start(name, ["-m", "agent_host", "--listen", "127.0.0.1:0", "--db", str(db), *args])

    def close(self) -> None:
        kill_all(self.procs)


def kill_all(procs: list[ServerProcess]) -> None:
    """Kill each (SIGKILL) at a test's end. No test looks at how they stop, and graceful
    stops took long (a host that used TLS ~2 s to exit, a mem0 server ~2 s, most ~0.1-0.2 s each)."""
    for proc in procs:
        proc.kill()  # a SIGKILLed process is gone at once: the wait for each is short


@contextlib.contextmanager
def processes(log_dir: Path) -> Iterator[Procs]:
    procs = Procs(log_dir)
    try:
        yield procs
    finally:
        procs.close()


@contextlib.contextmanager
def configured_host(log_dir: Path, config: str) -> Iterator[ServerProcess]:
    """A host process on the host.yaml text ``config`` (logs and sessions in ``log_dir``), stopped at the end."""
    path = log_dir / "host.yaml"
    path.write_text(config)
    with processes(log_dir) as procs:
        yield procs.host(log_dir / "sessions.db", "--config", str(path))


def run_cli(*args: str, timeout: float = 30.0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m <args>`` to completion in the repository root (``env``: variables set over
    this process's). On a timeout it gets SIGTERM first (the demo then stops the processes it
    started), SIGKILL only if that does not work."""
    proc = subprocess.Popen(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        raise AssertionError(f"python -m {' '.join(args)} timed out:\n{out[-2000:]}\n{err[-2000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_cli_aside(
    *args: str, timeout: float = 30.0, env: dict[str, str] | None = None
) -> Future[subprocess.CompletedProcess[str]]:
    """``run_cli`` in a thread of its own, for a command that mostly waits (e.g. a failed attach,
    answered only after the host's anti-scan delay): the test goes on and takes ``.result()`` later."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="run_cli")
    try:
        return pool.submit(run_cli, *args, timeout=timeout, env=env)
    finally:
        pool.shutdown(wait=False)


# ---------------------------------------------------------------------------------------------
# Talking to a host.


def stub(channel: grpc.aio.Channel) -> host_pb2_grpc.AgentHostStub:
    return host_pb2_grpc.AgentHostStub(channel)


async def get_session(address: str, session_id: str) -> tuple[host_pb2.Session, Any, dict[str, Any]]:
    """The Session message, its decoded AgentState, and middle_context."""
    async with grpc.aio.insecure_channel(address) as channel:
        session = await stub(channel).GetSession(host_pb2.GetSessionRequest(session_id=session_id), timeout=10)
    return session, codec.decode(session.state), json.loads(session.middle_context_json)


async def reply_once(address: str, session_id: str, inputs: object) -> tuple[str, list[object]]:
    """One Reply call that answers nothing (a parked reply stays parked): (session id, items)."""
    from clients.chat import HostClient

    async with HostClient(address) as client:
        call = client.reply(session_id, inputs)
        items = [item async for item in call]
    return call.session_id, items


def kinds(items: list[Any]) -> list[str]:
    return [type(i).__name__ for i in items]


__all__ = [
    "KEY",
    "Procs",
    "RecorderMiddleware",
    "configured_host",
    "get_session",
    "kill_all",
    "kinds",
    "processes",
    "run_cli",
    "run_cli_aside",
    "stub",
]


# An offline model that pauses 20 ms per streamed piece: replies last long enough to overlap,
# to be cancelled, or to be restarted under.
SLOW_MODEL = """
models:
  default: slow
  models:
    slow: {provider: offline, delay: 0.02}
"""


def chat(address: str, *args: str) -> subprocess.CompletedProcess[str]:
    """agent-chat as a user runs it, against the host at ``address``."""
    return run_cli("clients.chat", "--host", address, *args, timeout=20)
