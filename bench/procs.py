"""Server processes for the benchmark: started with subprocess, bound to 127.0.0.1 only."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_LISTENING = re.compile(r"listening on (127\.0\.0\.1:\d+)")


@dataclass
class ServerProcess:
    """One server process; ``address`` is the HOST:PORT it printed."""

    name: str
    proc: subprocess.Popen[str]
    address: str
    output: list[str] = field(default_factory=list)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


def start_server(name: str, args: Sequence[str], *, timeout: float = 20.0) -> ServerProcess:
    """Run ``python <args>`` from the repo root and wait for its "listening on 127.0.0.1:PORT" line."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    found: list[str] = []
    ready = threading.Event()

    def pump() -> None:  # keep draining the pipe so the server never blocks on a full buffer
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip())
            if not found and (match := _LISTENING.search(line)):
                found.append(match.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=pump, name=f"pump-{name}", daemon=True).start()
    if not ready.wait(timeout) or not found:
        proc.kill()
        proc.wait(timeout=5)
        raise RuntimeError(f"{name} did not start: {' | '.join(lines[-10:])}")
    return ServerProcess(name, proc, found[0], lines)


def start_middleware(class_name: str) -> ServerProcess:
    return start_server(
        class_name, ["-m", "mw_servers.sdk", f"bench.middlewares:{class_name}", "--address", "127.0.0.1:0"]
    )


def start_echo() -> ServerProcess:
    return start_server("echo", ["-m", "bench.echo_server", "--address", "127.0.0.1:0"])
