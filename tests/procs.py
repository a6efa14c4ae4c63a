"""Start real middleware server processes for tests (loopback only, always cleaned up)."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
_LISTENING = re.compile(r"listening on (\S+:\d+)")


class ServerProcess:
    """``python -m <module> <args>`` that prints "... listening on HOST:PORT" once it serves."""

    def __init__(self, argv: list[str], *, port: int = 0, startup: float = 30.0) -> None:
        self.argv = argv
        self.port = port
        self.startup = startup
        self.proc: subprocess.Popen[str] | None = None
        self.address = ""

    def start(self) -> ServerProcess:
        argv = [a.replace("{port}", str(self.port)) for a in self.argv]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        deadline = time.monotonic() + self.startup
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if ready:
                line = self.proc.stdout.readline()
                match = _LISTENING.search(line)
                if match:
                    self.address = match.group(1)
                    self.port = int(self.address.rsplit(":", 1)[1])
                    return self
            if self.proc.poll() is not None:
                break
        err = self.proc.stderr.read() if self.proc.poll() is not None and self.proc.stderr else ""
        self.stop()
        raise RuntimeError(f"{' '.join(argv)} did not start: {err[-2000:]}")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        for stream in (self.proc.stdout, self.proc.stderr) if self.proc else ():
            if stream:
                stream.close()

    def restart(self) -> ServerProcess:
        """Start again on the same port (after a kill)."""
        self.stop()
        return self.start()


def middleware_server(target: str, **kwargs: Any) -> ServerProcess:
    """A MiddlewareBase subclass ``module:Class`` served by the SDK in its own process."""
    argv = ["-m", "mw_servers.sdk", target, "--address", "127.0.0.1:{port}"]
    for key, value in kwargs.items():
        argv += ["--arg", f"{key}={json.dumps(value)}"]
    return ServerProcess(argv)


def start_all(servers: list[ServerProcess]) -> list[ServerProcess]:
    """Start several at once (each startup is mostly interpreter and grpc import time)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(lambda s: s.start(), servers))
