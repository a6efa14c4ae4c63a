"""``make demo`` (``python -m clients.demo``): the whole system, offline, no keys.

It starts every middleware server the repository has, each as its own process on a free
loopback port (built-in servers ``mw_servers/<name>/`` through their ``__main__``, and every
middleware class in ``mw_servers/examples/`` through the SDK launcher), then the agent host with
all of them attached and the offline model, then runs a scripted conversation on one session:
a tool call, an email that needs confirmation (answered automatically, with an edited input), a
tool the client executes, each middleware-contributed tool, and a follow-up turn. It prints what
happened and what each middleware kept in the session, and stops every process it started, also
on an error or Ctrl-C. Exit status 0 means every reply completed.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import os
import pkgutil
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LISTENING = re.compile(r"listening on (\S+:\d+)")

# Constructor arguments some example servers need to be useful in the demo.
SERVER_ARGS: dict[str, dict[str, Any]] = {
    "ModelFallbackMiddleware": {"fallback": "offline"},
    "RateLimitMiddleware": {"rate": 50, "burst": 10},
}


# ---------------------------------------------------------------------------------------------
# Processes.


class Proc:
    """A child process that announces its address with a "... listening on HOST:PORT" line."""

    def __init__(self, name: str, argv: Sequence[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = [sys.executable, *argv]
        self.log_path = log_dir / (re.sub(r"[^\w.-]", "_", name) + ".log")
        self.address = ""
        self._ready = threading.Event()
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            self.argv,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,  # a Ctrl-C in the terminal reaches only us; we stop it
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:  # keep draining, so the child never blocks on a full pipe
            match = LISTENING.search(line)
            if match and not self._ready.is_set():
                self.address = match.group(1)
                self._ready.set()
            self._log.write(line)
        self._ready.set()

    def wait_ready(self, timeout: float = 30.0) -> str:
        """The address it listens on; raises RuntimeError (with its log) if it does not start."""
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.05):
            if time.monotonic() > deadline:
                break
        if not self.address:
            self.stop()
            raise RuntimeError(f"{self.name} did not start (exit {self.popen.poll()}):\n{self.log_tail()}")
        return self.address

    def log_tail(self, lines: int = 15) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join("    " + line for line in text[-lines:])

    def stop(self, timeout: float = 5.0) -> int | None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout)
        self._log.flush()
        return self.popen.returncode

    def close(self) -> None:
        self.stop()
        if not self._log.closed:
            self._log.close()


@dataclass
class ServerSpec:
    name: str
    argv: list[str]
    what: str


def discover_servers() -> list[ServerSpec]:
    """Every middleware server in mw_servers/: built-in packages, then example classes."""
    import mw_servers
    from agent_host.middleware import MiddlewareBase

    specs: list[ServerSpec] = []
    address = ["--address", "127.0.0.1:0"]
    for info in pkgutil.iter_modules(mw_servers.__path__):
        path = Path(mw_servers.__path__[0]) / info.name
        if info.ispkg and info.name not in ("sdk", "examples") and (path / "__main__.py").exists():
            specs.append(ServerSpec(info.name, ["-m", f"mw_servers.{info.name}", *address], f"mw_servers.{info.name}"))
    try:
        examples = importlib.import_module("mw_servers.examples")
    except ImportError:
        return specs
    for info in pkgutil.iter_modules(examples.__path__):
        module = importlib.import_module(f"mw_servers.examples.{info.name}")
        classes = [
            c
            for _, c in inspect.getmembers(module, inspect.isclass)
            if issubclass(c, MiddlewareBase) and c is not MiddlewareBase and c.__module__ == module.__name__
        ]
        for cls in classes:
            name = info.name if len(classes) == 1 else f"{info.name}_{cls.__name__.lower()}"
            args = [f"--arg={k}={json.dumps(v)}" for k, v in SERVER_ARGS.get(cls.__name__, {}).items()]
            target = f"{module.__name__}:{cls.__name__}"
            specs.append(ServerSpec(name, ["-m", "mw_servers.sdk", target, *address, *args], target))
    return specs


# ---------------------------------------------------------------------------------------------
# The conversation.


@dataclass
class Step:
    title: str
    message: str
    edit: dict[str, Any] | None = None  # confirmed calls get this input merged in
    external: str = "shipped on Monday, arrives Thursday"


@dataclass
class Outcome:
    failures: list[str] = field(default_factory=list)


def _steps(tools: list[str]) -> list[Step]:
    steps = [
        Step("a tool call", "What's the weather in Paris?"),
        Step(
            "human in the loop: the email needs a confirmation; the demo allows it and edits the body",
            "Please email bob@example.com saying hello from Paris",
            edit={"body": "Hello from Paris! (edited by the demo before sending)"},
        ),
        Step("external execution: the client runs lookup_order and sends back its result", "Where is my order A-1001?"),
    ]
    for name in tools:
        steps.append(Step(f"a tool contributed by a middleware: {name}", f"call {name} text=hello"))
    steps.append(Step("a second turn on the same session", "Thanks! Now use add a=2 b=40"))
    return steps


async def converse_demo(address: str, out: Any = sys.stdout) -> Outcome:
    from agent_host.codec import codec
    from agent_host.data import ReplyFinishedReason, ToolCallBlock, ToolResultBlock, ToolResultState, UserMsg
    from agent_host.data.events import ConfirmResult
    from agentmw.v1 import host_pb2

    from .chat import HostClient, View, converse

    outcome = Outcome()
    view = View(out=out, audio_dir=Path(tempfile.gettempdir()) / "agentmw-demo-audio", color=False)
    async with HostClient(address) as client:
        attached = (await client.stub.ListMiddleware(host_pb2.ListMiddlewareRequest(), timeout=10)).middleware
        print("\nattached middleware (outermost first):", file=out)
        for mw in attached:
            tools = f"; tools: {', '.join(mw.tools)}" if mw.tools else ""
            print(f"  {mw.name:<16} {mw.address:<22} hooks: {', '.join(mw.hooks) or '-'}{tools}", file=out)
        session = ""
        for i, step in enumerate(_steps([t for mw in attached for t in mw.tools]), 1):
            print(f"\n── {i}. {step.title}\n[you] {step.message}", file=out)

            async def confirm(call: ToolCallBlock, step: Step = step) -> ConfirmResult:
                edited = json.dumps({**json.loads(call.input or "{}"), **(step.edit or {})})
                call = ToolCallBlock(id=call.id, name=call.name, state=call.state, input=edited)
                print(f"  ! the demo allows {call.name}" + (f" with input {edited}" if step.edit else ""), file=out)
                return ConfirmResult(confirmed=True, tool_call=call)

            async def external(call: ToolCallBlock, step: Step = step) -> ToolResultBlock:
                print(f"  ! the demo runs {call.name}({call.input}) itself: {step.external!r}", file=out)
                return ToolResultBlock(id=call.id, name=call.name, output=step.external, state=ToolResultState.SUCCESS)

            turn = await converse(
                client, session, UserMsg(step.message), on_item=view.show, on_confirm=confirm, on_external=external
            )
            session = turn.session_id
            reason = turn.end.finished_reason if turn.end is not None else None
            if reason != ReplyFinishedReason.COMPLETED:
                outcome.failures.append(f"step {i} ({step.title}) ended {reason or 'parked'}")
        info = await client.stub.GetSession(host_pb2.GetSessionRequest(session_id=session), timeout=10)
        state = codec.decode(info.state)
        print(f"\n── the session {session}, as the host persisted it", file=out)
        print(
            f"  {len(state.context)} messages; {len(state.permission_rules)} permission rules; "
            f"pending tool calls: {len(info.pending_tool_calls)}",
            file=out,
        )
        slots = json.loads(info.middle_context_json)
        print("  middleware slots (middle_context):" + ("" if slots else " none written"), file=out)
        for key, value in slots.items():
            print(f"    {key}: {json.dumps(value, sort_keys=True)[:300]}", file=out)
    return outcome


# ---------------------------------------------------------------------------------------------
# Main.


def run(out: Any = sys.stdout) -> int:
    procs: list[Proc] = []
    with tempfile.TemporaryDirectory(prefix="agentmw-demo-") as tmp:
        log_dir = Path(tmp)
        try:
            specs = discover_servers()
            print(f"agentmw demo: starting {len(specs)} middleware servers and the host (logs in {log_dir})", file=out)
            started = [(spec, Proc(spec.name, spec.argv, log_dir)) for spec in specs]
            procs.extend(p for _, p in started)
            flags = []
            for spec, proc in started:
                addr = proc.wait_ready()
                print(f"  middleware {spec.name:<16} {addr:<22} ({spec.what})", file=out)
                flags += ["--middleware", f"{spec.name}={addr}"]
            host = Proc(
                "host",
                [
                    "-m",
                    "agent_host",
                    "--listen",
                    "127.0.0.1:0",
                    "--db",
                    str(log_dir / "sessions.db"),
                    "--log-level",
                    "warning",
                    *flags,
                ],
                log_dir,
            )
            procs.append(host)
            address = host.wait_ready()
            print(f"  agent host            {address:<22} (offline model, sessions in SQLite)", file=out)
            outcome = asyncio.run(converse_demo(address, out))
        except KeyboardInterrupt:
            print("\nagentmw demo: interrupted", file=out)
            return 130
        except Exception as exc:
            print(f"\nagentmw demo: FAILED: {type(exc).__name__}: {exc}", file=out)
            for proc in procs:
                if proc.popen.poll() is not None:
                    print(f"  {proc.name} exited with {proc.popen.returncode}; its log:\n{proc.log_tail()}", file=out)
            return 1
        finally:
            for proc in reversed(procs):
                proc.close()
    if outcome.failures:
        print("\nagentmw demo: FAILED: " + "; ".join(outcome.failures), file=out)
        return 1
    print("\nagentmw demo: OK (every reply completed; all processes stopped)", file=out)
    return 0


def _terminated(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM ends the demo like Ctrl-C, so its children are stopped too


def main() -> int:
    signal.signal(signal.SIGTERM, _terminated)
    return run()


if __name__ == "__main__":
    sys.exit(main())
