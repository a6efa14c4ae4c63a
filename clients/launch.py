"""Start child processes that announce themselves with "... listening on HOST:PORT".

The one launcher for the demo (``clients.demo``), the tests and the benchmark: every middleware
server, the echo server and the agent host print such a line once they serve.

    proc = ServerProcess(["-m", "agent_host", "--listen", "127.0.0.1:{port}"], name="host").start()
    proc.address, proc.port   # "127.0.0.1:50321", 50321
    proc.kill()               # SIGKILL, e.g. to simulate a crash
    proc.restart()            # the same port again: "{port}" in argv becomes the port it had
    proc.stop()               # SIGTERM, then SIGKILL if it does not exit in time

A non-Python server (e.g. the Node.js example middleware) runs with ``executable``:
``ServerProcess(["mw_servers/examples/node/server.js", "--address", "127.0.0.1:{port}"], executable="node")``.

Output (stdout and stderr together) is drained by a thread so the child never blocks on a full
pipe; the last lines are kept in memory and, with ``log_dir``, all of them go to a log file.
"""

from __future__ import annotations

import collections
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
LISTENING = re.compile(r"listening on (\S+:\d+)")
KEEP_LINES = 200  # output lines kept in memory per process (the log file, if any, has them all)


class LaunchError(RuntimeError):
    """A child process exited or stayed silent instead of printing its listening line."""


_ports = random.Random()  # its own generator: choosing ports touches no global random state
_handed_out: set[int] = set()  # never twice from one process: start_all starts dozens at once
_handed_out_lock = threading.Lock()
# What a child that lost the race for its port prints: servers binding through
# agentmw.transport.listen (and the Node example) say the first; those on the raw grpcio API
# (tests/raw_server.py, as a server in another language would) fail with grpcio's own words.
_PORT_TAKEN = ("cannot listen on", "Failed to bind to address")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def unused_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range (0 if none is found).

    A child asked for port 0 gets one from that range, and once it is gone the port can become the
    source port of any outgoing connection, even of a reconnect attempt to that very port (which then
    connects to itself): a restart on it fails to bind. Ports below the range are never handed out
    that way."""
    low = _ephemeral_low()
    for _ in range(50):
        with _handed_out_lock:
            port = _ports.randrange(max(1024, low - 12000), low)
            if port in _handed_out:
                continue
            _handed_out.add(port)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    return 0


class ServerProcess:
    """``python <argv>`` run from the repository root, ready once it prints "listening on HOST:PORT".

    ``argv`` may contain ``{port}``: it becomes ``port``; when that is 0, a free one below the
    ephemeral range (``unused_port``), and after a start, the port it announced, so that
    ``restart()`` binds the same one again.
    ``executable`` runs ``<executable> <argv>`` instead (e.g. "node"); the default is this Python.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        name: str = "",
        env: dict[str, str] | None = None,
        log_dir: Path | None = None,
        port: int = 0,
        startup: float = 30.0,
        new_session: bool = False,
        executable: str | None = None,
    ) -> None:
        self.argv = list(argv)
        self.executable = executable or sys.executable
        self.name = name or " ".join(self.argv)
        self.env = env or {}
        self.log_path = log_dir / (re.sub(r"[^\w.-]", "_", self.name) + ".log") if log_dir else None
        self.port = port
        self.startup = startup
        self.new_session = new_session  # a Ctrl-C in the terminal then reaches only the parent
        self.address = ""
        self.popen: subprocess.Popen[str] | None = None
        self._lines: collections.deque[str] = collections.deque(maxlen=KEEP_LINES)
        self._log: IO[str] | None = None
        self._drain: threading.Thread | None = None
        # Notified on each line it prints and when its output ends (start, wait_for_line).
        self._printed = threading.Condition()
        self._output_ended = False
        self._stopping = False

    def __repr__(self) -> str:
        return f"<ServerProcess {self.name} {self.address or 'not started'}>"

    # -- starting -----------------------------------------------------------------------------

    def start(self) -> ServerProcess:
        """Start it and wait (at most ``startup`` seconds) for its listening line.

        Raises LaunchError with its last output if it exits or stays silent; nothing is left running.
        """
        if self.running:
            raise LaunchError(f"{self.name} is already running at {self.address}")
        chosen = self.port == 0 and any("{port}" in a for a in self.argv)
        attempts = 3 if chosen else 1
        while True:
            attempts -= 1
            try:
                return self._start(unused_port() if chosen else self.port)
            except LaunchError as exc:
                # A port chosen here can be taken between the probe and the child's bind: another one.
                if attempts == 0 or not any(words in str(exc) for words in _PORT_TAKEN):
                    raise

    def _start(self, port: int) -> ServerProcess:
        argv = [a.replace("{port}", str(port)) for a in self.argv]
        if self.log_path is not None:
            self._log = self.log_path.open("a" if self.popen else "w", buffering=1)  # line by line; a restart appends
        self.address = ""
        self._lines.clear()
        self._output_ended = False
        self._stopping = False
        self.popen = subprocess.Popen(
            [self.executable, *argv],
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=self.new_session,
        )
        self._drain = threading.Thread(target=self._read, args=(self.popen,), name=f"drain-{self.name}", daemon=True)
        self._drain.start()
        with self._printed:  # until the listening line, or the end of its output
            ended = self._printed.wait_for(lambda: self.address or self._output_ended, self.startup)
        if not self.address:
            code = self.stop(timeout=5)
            why = f"exited with {code}" if ended else f"printed no listening line within {self.startup:g}s"
            raise LaunchError(f"{self.name} did not start ({why}); its last output:\n{self.tail()}")
        self.port = int(self.address.rsplit(":", 1)[1])
        return self

    def _read(self, popen: subprocess.Popen[str]) -> None:
        assert popen.stdout is not None
        for line in popen.stdout:  # keep draining, so the child never blocks on a full pipe
            with self._printed:
                if not self.address and (match := LISTENING.search(line)):
                    self.address = match.group(1)
                self._lines.append(line.rstrip("\n"))
                self._printed.notify_all()
            if self._log is not None:
                self._log.write(line)
        with self._printed:  # start() and wait_for_line need not wait any longer
            self._output_ended = True
            self._printed.notify_all()

    # -- state --------------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        assert self.popen is not None, "not started"
        return self.popen.pid

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def died(self) -> bool:
        """It exited without stop() or kill() asking it to (a crash, or an error at startup)."""
        return self.popen is not None and self.popen.poll() is not None and not self._stopping

    @property
    def returncode(self) -> int | None:
        return self.popen.poll() if self.popen is not None else None

    def tail(self, lines: int = 15) -> str:
        """Its last output lines, indented, for error messages."""
        return "\n".join("    " + line for line in list(self._lines)[-lines:])

    def wait_for_line(self, text: str, timeout: float = 10.0) -> str:
        """The last of its kept output lines that contains ``text``, once one does (at most
        ``timeout`` seconds). Its output reaches this process through a reader thread, so a line it
        printed before answering a call may arrive here after the answer: wait, never just look.

        Raises LaunchError with its last output if no such line comes.
        """

        def found() -> str | None:
            return next((line for line in reversed(self._lines) if text in line), None)

        with self._printed:
            if self._printed.wait_for(lambda: found() is not None or self._output_ended, timeout):
                line = found()
                if line is not None:
                    return line
        why = f"printed no line with {text!r} within {timeout:g}s"
        raise LaunchError(f"{self.name} {why}; its last output:\n{self.tail()}")

    # -- stopping -----------------------------------------------------------------------------

    def kill(self) -> None:
        """SIGKILL, no chance to clean up: a crash as far as its peers can tell."""
        if self.running:
            assert self.popen is not None
            self._stopping = True
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(10)
        self._close_output()

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited after ``timeout`` seconds; its exit status."""
        if self.popen is None:
            return None
        self._stopping = True
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self._close_output()
        return self.popen.returncode

    def restart(self) -> ServerProcess:
        """Stop it if it still runs (e.g. after a kill()) and start it again on the same port."""
        self.stop()
        return self.start()

    def _close_output(self) -> None:
        # The drain thread ends at EOF, soon after the exit; bounded, since a grandchild that
        # inherited the pipe could keep it open.
        if self._drain is not None:
            self._drain.join(5)
        if self._log is not None and (self._drain is None or not self._drain.is_alive()):
            self._log.close()
            self._log = None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def middleware_server(target: str, **kwargs: Any) -> ServerProcess:
    """The MiddlewareBase subclass ``module:Class`` served by the SDK launcher in its own process,
    its constructor getting ``kwargs`` (as JSON); not started yet."""
    argv = ["-m", "agentmw.sdk", target, "--address", "127.0.0.1:{port}"]
    for key, value in kwargs.items():
        argv += ["--arg", f"{key}={json.dumps(value)}"]
    return ServerProcess(argv, name=target.rsplit(":", 1)[-1])


def start_all(servers: Iterable[ServerProcess]) -> list[ServerProcess]:
    """Start several at once (each startup is mostly interpreter and grpc import time).

    All or none: if one does not start, the others are stopped and its LaunchError is raised.
    """
    servers = list(servers)
    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(s.start) for s in servers]
    errors = [e for f in futures if (e := f.exception()) is not None]
    if errors:
        for server in servers:
            server.stop()
        raise errors[0]
    return servers
