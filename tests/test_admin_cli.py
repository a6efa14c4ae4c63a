"""``agentmw`` (clients/admin.py) and what the host tells its operator: the per-reply log line, one
warning per middleware outage, MiddlewareInfo's status fields, and the /metrics endpoint.

Real processes only: a host (with --metrics-port 0), a middleware server (the recorder of
tests/host_util.py), ``python -m clients.admin`` and ``python -m clients.chat`` as users run them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from clients.launch import ServerProcess, middleware_server, unused_port

from .host_util import Procs, chat, processes, run_cli, run_cli_aside

pytestmark = pytest.mark.timeout(90)

METRICS = re.compile(r"agentmw host metrics at (http://\S+/metrics)")


def agentmw(host: ServerProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli("clients.admin", "--host", host.address, *args, timeout=30)


def agentmw_json(host: ServerProcess, *args: str) -> object:
    done = agentmw(host, "--json", *args)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def host_log(proc: ServerProcess, wanted: str, timeout: float = 10.0) -> str:
    """The host's output (its last 200 lines, kept by the launcher) once it contains ``wanted``."""
    deadline = time.monotonic() + timeout
    while True:
        text = "\n".join(line.strip() for line in proc.tail(200).splitlines())
        if wanted in text or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[Procs, ServerProcess, ServerProcess]]:
    with processes(tmp_path) as procs:
        recorder = procs.recorder()
        host = procs.host(tmp_path / "sessions.db", "--metrics-port", "0")
        yield procs, host, recorder


def test_status_middleware_and_sessions_commands(setup: tuple[Procs, ServerProcess, ServerProcess]) -> None:
    _procs, host, recorder = setup
    done = agentmw(host, "status")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[0] == f"host {host.address}: SERVING"
    assert "(no middleware attached)" in done.stdout

    attached = agentmw(host, "middleware", "attach", recorder.address, "--name", "rec", "--position", "0")
    assert attached.returncode == 0, attached.stdout + attached.stderr
    assert attached.stdout.startswith(f"attached rec at {recorder.address}")
    assert attached.stderr == ""  # no protobuf DeprecationWarning (FieldDescriptor.label) for the operator
    again = agentmw(host, "middleware", "attach", recorder.address, "--name", "rec")
    assert again.returncode == 1 and "ALREADY_EXISTS" in again.stderr
    # The host answers UNAVAILABLE for a middleware it cannot attach: its words, not "cannot reach
    # the host" (which the CLI said, sending the operator after a host that was fine). The answer
    # comes after the host's anti-scan delay (5 s): the commands below run meanwhile (a failed
    # attach adds nothing), and its answer is checked at the end.
    nobody = f"127.0.0.1:{unused_port()}"
    down_aside = run_cli_aside(
        "clients.admin", "--host", host.address, "middleware", "attach", nobody, "--name", "down"
    )
    # A name that cannot prefix tools is the operator's mistake, said at once (it was that same
    # 'no usable middleware server' after the anti-scan delay, blamed on the server's tools).
    spaced = agentmw(host, "middleware", "attach", recorder.address, "--name", "my mw")
    assert spaced.returncode == 1 and spaced.stderr.strip() == (
        f"agentmw: {host.address}: INVALID_ARGUMENT: middleware name 'my mw' is not 1-64 of [a-zA-Z0-9_-] "
        "(it prefixes its tools)"
    ), spaced.stderr

    listed = agentmw_json(host, "middleware", "list")
    assert isinstance(listed, list) and [m["name"] for m in listed] == ["rec"]
    (rec,) = listed
    assert rec["address"] == recorder.address and rec["health"] == "reachable"
    assert rec["hooks"] == ["on_reply"] and rec["tools"] == ["rec__shout", "rec__nap"]
    assert rec["last_error"] == "" and not rec["failing"]
    assert (rec["failures"], rec["bypasses"]) == (0, 0), rec  # numbers, not the strings of proto's JSON int64

    said = chat(host.address, "--message", "use rec__shout text=hi")
    assert said.returncode == 0, said.stdout + said.stderr
    sessions = agentmw_json(host, "sessions", "list")
    assert isinstance(sessions, list) and len(sessions) == 1
    sid = sessions[0]["session_id"]
    assert sessions[0]["title"] == "use rec__shout text=hi"
    assert chat(host.address, "--message", "a second session").returncode == 0
    newest = agentmw_json(host, "sessions", "list", "--limit", "1")  # newest first, at most one
    assert isinstance(newest, list) and [s["title"] for s in newest] == ["a second session"]
    assert len(agentmw_json(host, "sessions", "list")) == 2  # type: ignore[arg-type]

    shown = agentmw_json(host, "sessions", "show", sid)
    assert isinstance(shown, dict)
    assert [m["role"] for m in shown["messages"]] == ["user", "assistant"]
    assert shown["middle_context"]["recorder"]["starts"] == 1
    text = agentmw(host, "sessions", "show", sid)
    assert text.returncode == 0 and "user: use rec__shout text=hi" in text.stdout

    assert agentmw(host, "sessions", "delete", sid).stdout.strip() == f"deleted {sid}"
    gone = agentmw(host, "sessions", "delete", sid)
    assert gone.returncode == 1 and gone.stdout.strip() == f"no session {sid}"
    missing = agentmw(host, "sessions", "show", sid)
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr

    # Read by a pipe that closes early (`agentmw ... | head -1`): the output just stops, no traceback.
    piped = subprocess.Popen(
        [sys.executable, "-m", "clients.admin", "--host", host.address, "status"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert piped.stdout is not None
    piped.stdout.close()
    _, err = piped.communicate(timeout=30)
    assert "Traceback" not in err and "BrokenPipe" not in err, err

    detached = agentmw(host, "middleware", "detach", "rec")
    # Only that: the middleware's state lines said "attached once its server answers" for one not
    # attached yet, the opposite of what detaching it does.
    assert (detached.returncode, detached.stdout) == (0, f"detached rec at {recorder.address}\n"), detached.stdout
    assert agentmw_json(host, "middleware", "list") == []

    down = down_aside.result()
    assert down.returncode == 1, down.stdout + down.stderr
    assert down.stderr.strip() == (
        f"agentmw: {host.address}: UNAVAILABLE: cannot attach {nobody}: no usable middleware server "
        "answered there (the host's log says why)"
    ), down.stderr


def test_attach_checks_the_address_form_first(tmp_path: Path) -> None:
    """An address that is not HOST:PORT (nor a gRPC target name) is a usage error said by the CLI,
    with the host's own config check; the host only answered PERMISSION_DENIED 'not an allowed
    address', as if the address were fine but forbidden."""
    with processes(tmp_path) as procs:
        host = procs.host(tmp_path / "sessions.db")
        done = agentmw(host, "middleware", "attach", "foo")
        assert agentmw_json(host, "middleware", "list") == []
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines()[-1] == (
        "agentmw middleware attach: error: address: 'foo' is not HOST:PORT (a port of 0-65535; 0: any free port)"
    ), done.stderr


@pytest.mark.parametrize(
    ("args", "error"),
    [
        # --limit -1 listed every session (0 = all).
        (
            ["sessions", "list", "--limit", "-1"],
            "agentmw sessions list: error: argument --limit: must be 0 or more, not -1",
        ),
        # Beyond ListSessionsRequest's int32: a protobuf ValueError traceback.
        (
            ["sessions", "list", "--limit", "99999999999"],
            "agentmw sessions list: error: argument --limit: must be 2147483647 or less, not 99999999999",
        ),
        # The host refused these (INVALID_ARGUMENT, exit 1) after the call.
        *(
            (
                ["middleware", "attach", "127.0.0.1:9", "--timeout", bad],
                "agentmw middleware attach: error: argument --timeout: "
                f"must be 0 (the host's default) or finite and above 0, not {bad}",
            )
            for bad in ("-1", "nan", "inf")
        ),
    ],
)
def test_a_bad_number_is_a_usage_error(args: list[str], error: str) -> None:
    """Refused in one line with exit 2 (docs/host.md: a usage error) before any call."""
    done = run_cli("clients.admin", "--host", "127.0.0.1:1", *args, timeout=30)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines()[-1] == error, done.stderr


@pytest.mark.parametrize(
    "module",
    [
        "agent_host",
        "clients.chat",
        "clients.admin",
        "clients.traces",
        "agentmw.sdk",
        "mw_servers.budget",
        "mw_servers.tracing",
        "mw_servers.tts",
        "mw_servers.mem0",
    ],
)
def test_every_commands_help_is_plain_text(module: str) -> None:
    """--help shows no reStructuredText markup: the servers' and agentmw-traces' printed their
    module docstrings with ``double backticks`` as they are."""
    done = run_cli(module, "--help", timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "``" not in done.stdout, done.stdout


def test_unreachable_host_is_one_line_and_exit_1(tmp_path: Path) -> None:
    done = run_cli("clients.admin", "--host", "127.0.0.1:1", "status", timeout=30)
    assert done.returncode == 1
    assert done.stderr.strip() == "agentmw: cannot reach the host at 127.0.0.1:1 (UNAVAILABLE)"


def test_host_reports_replies_outages_and_metrics(setup: tuple[Procs, ServerProcess, ServerProcess]) -> None:
    """A fail_open middleware that goes down: replies go on (bypassed), the host logs one warning for
    the outage (no traceback), one info line per reply, status shows the last error, and /metrics
    counts replies, hook latency, failures and bypasses."""
    _procs, host, recorder = setup
    url = METRICS.search(host.tail(50))
    assert url is not None, host.tail(50)
    attach = agentmw(host, "middleware", "attach", recorder.address, "--name", "rec", "--fail-open", "--timeout", "1")
    assert attach.returncode == 0, attach.stdout + attach.stderr

    ok = chat(host.address, "--message", "hello")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    log = host_log(host, "outcome=completed")
    line = next(x for x in log.splitlines() if "agentmw.host INFO reply session=" in x)
    assert re.search(r"outcome=completed duration=\d+\.\d+s tokens=\d+/\d+ middleware=rec$", line), line

    recorder.kill()
    for i in range(2):
        down = chat(host.address, "--message", f"still there {i}?")
        assert down.returncode == 0, down.stdout + down.stderr
        assert f"You said: still there {i}?" in down.stdout
    log = host_log(host, "bypassed=rec")
    replies = [x for x in log.splitlines() if "INFO reply session=" in x]
    assert len(replies) == 3 and all("bypassed=rec" in x for x in replies[1:]), replies
    warnings = [x for x in log.splitlines() if "WARNING" in x]
    assert len(warnings) == 1 and "middleware rec at" in warnings[0] and "is failing" in warnings[0], warnings
    assert "Traceback" not in log

    status = agentmw(host, "status")
    assert status.returncode == 0, status.stdout + status.stderr  # fail_open: the host still serves
    (rec,) = agentmw_json(host, "middleware", "list")  # type: ignore[misc]
    assert rec["failing"] and rec["health"] in ("unreachable", "connecting")
    assert "middleware 'rec' failed" in rec["last_error"] and rec["last_error_at"]
    assert isinstance(rec["failures"], int) and isinstance(rec["bypasses"], int), rec
    assert rec["failures"] >= 2 and rec["bypasses"] >= 2
    assert "last error (no call has succeeded since)" in status.stdout

    samples = scrape(url.group(1))
    assert samples[("agentmw_replies_total", (("outcome", "completed"),))] == 3
    assert samples[("agentmw_open_replies", ())] == 0
    assert samples[("agentmw_tokens_total", (("kind", "input"),))] > 0
    hook = (("hook", "on_reply"), ("middleware", "rec"))
    assert samples[("agentmw_hook_duration_seconds_count", hook)] >= 3
    assert samples[("agentmw_middleware_failures_total", hook)] >= 2
    assert samples[("agentmw_middleware_bypasses_total", hook)] >= 2


def test_example_middleware_contributes_a_tool(setup: tuple[Procs, ServerProcess, ServerProcess]) -> None:
    procs, host, _recorder = setup
    target = "mw_servers.examples.world_clock:WorldClockMiddleware"
    clock = procs.start("clock", ["-m", "agentmw.sdk", target, "--address", "127.0.0.1:0"])
    attached = agentmw_json(host, "middleware", "attach", clock.address, "--name", "clock")
    assert isinstance(attached, dict) and attached["tools"] == ["clock__time_in"] and attached["hooks"] == []
    done = chat(host.address, "--message", "use clock__time_in timezone=Asia/Tokyo")
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"← clock__time_in: \d{4}-\d\d-\d\d \d\d:\d\d \(Asia/Tokyo, UTC\+0900\)", done.stdout), done.stdout
    bad = chat(host.address, "--message", "use clock__time_in timezone=Mars/Olympus")
    assert "unknown time zone 'Mars/Olympus'" in bad.stdout, bad.stdout


def test_status_shows_a_hung_fail_open_middleware_skipped(setup: tuple[Procs, ServerProcess, ServerProcess]) -> None:
    """A fail_open middleware that hangs (SIGSTOP: connected, silent): the reply goes on without it
    after its timeout (5 s); a Describe then gets no answer either (5 s more), and the operator
    sees that every reply skips it for a while (the next 5 s: time for two CLI runs, also on a
    loaded machine)."""
    _procs, host, _recorder = setup
    hung = middleware_server("tests.conformance_mw:Marker").start()
    try:
        attach = agentmw(host, "middleware", "attach", hung.address, "--name", "slow", "--fail-open", "--timeout", "5")
        assert attach.returncode == 0, attach.stdout + attach.stderr
        os.kill(hung.pid, signal.SIGSTOP)
        done = chat(host.address, "--message", "hello")
        assert done.returncode == 0 and "You said: hello" in done.stdout, done.stdout + done.stderr
        deadline = time.monotonic() + 10
        while True:  # until the Describe after the hang has had no answer either (bounded)
            status = agentmw(host, "status")
            if "skipped by every reply for" in status.stdout or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert "skipped by every reply for" in status.stdout, status.stdout
        (slow,) = agentmw_json(host, "middleware", "list")  # type: ignore[misc]
        assert 0 < float(slow["skipped_for"]) <= 5 and "no answer within 5s" in slow["last_error"], slow
    finally:
        os.kill(hung.pid, signal.SIGCONT)
        hung.stop()


def test_alive_answers_for_a_not_serving_host_and_fails_for_a_frozen_one(tmp_path: Path) -> None:
    """`agentmw alive` (deploy/k8s's liveness probe): exit 0 while the host is NOT_SERVING (its
    fail_closed middleware is down: readiness fails, a restart would not help), exit 1 in one line
    once it is frozen (SIGSTOP, as a wedged event loop: the TCP connection is still accepted, which
    is all the tcpSocket probe it replaces checked)."""
    with processes(tmp_path) as procs:
        host = procs.host(tmp_path / "sessions.db", "--middleware", f"rec=127.0.0.1:{unused_port()}")
        assert agentmw(host, "status").returncode == 1, "NOT_SERVING: the middleware is not up"
        alive = agentmw(host, "alive")
        assert alive.returncode == 0 and alive.stdout.strip() == f"host {host.address}: answers (NOT_SERVING)", alive
        os.kill(host.pid, signal.SIGSTOP)
        try:
            frozen = agentmw(host, "alive", "--timeout", "1")
        finally:
            os.kill(host.pid, signal.SIGCONT)
    assert frozen.returncode == 1, frozen.stdout + frozen.stderr
    assert frozen.stderr.strip() == f"agentmw: cannot reach the host at {host.address} (DEADLINE_EXCEEDED)", frozen
