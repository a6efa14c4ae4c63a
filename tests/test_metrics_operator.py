"""What the host tells its operator about middleware that fail: the per-reply log line, the
status fields of ListMiddleware (``agentmw status``) and /metrics, kept to what the host knows.

Real processes only: a host (with --metrics-port 0), middleware servers (the tracing server, a
pass-through on every hook, the recorder of tests/host_util.py), ``python -m clients.admin`` and
``python -m clients.chat`` as users run them.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from clients.launch import ServerProcess

from .host_util import chat, configured_host, processes
from .test_admin_cli import METRICS, agentmw, agentmw_json, host_log, scrape

pytestmark = pytest.mark.timeout(120)

TRACER = ["-m", "mw_servers.tracing", "--address", "127.0.0.1:0"]
REPLY = re.compile(r"INFO reply (session=\S+ reply=\S+) outcome=\S+ duration=\S+ tokens=\S+ (middleware=.*)$")


def replies(host: ServerProcess) -> list[tuple[str, str]]:
    """(``session=… reply=…``, the rest of its line from ``middleware=`` on) of each reply logged."""
    found = (REPLY.search(line.strip()) for line in host.tail(400).splitlines())
    return [(m.group(1), m.group(2)) for m in found if m]


def attach(host: ServerProcess, address: str, name: str, *flags: str) -> None:
    done = agentmw(host, "middleware", "attach", address, "--name", name, *flags)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_watcher_is_not_reported_as_having_acted_before_its_copies_are_delivered(tmp_path: Path) -> None:
    """The tracing server (every hook detached), killed between two replies: the reply after the
    kill ran its invocations on the host's side, and their copies then went nowhere. The reply
    lines do not list the watcher as having acted (a watcher's copies go out after the line is
    written); the failed delivery is a warning naming that reply. Before, the line said
    ``middleware=tr`` for it, as for the replies before the kill."""
    with processes(tmp_path) as procs:
        tracer = procs.start("tracing", TRACER)
        host = procs.host(tmp_path / "sessions.db")
        attach(host, tracer.address, "tr", "--fail-open", "--timeout", "1")
        assert chat(host.address, "--message", "hello").returncode == 0
        host_log(host, "outcome=completed")
        tracer.kill()
        assert chat(host.address, "--message", "after the kill").returncode == 0
        log = host_log(host, "stopped watching")
        assert chat(host.address, "--message", "bypassed now").returncode == 0
        host_log(host, "bypassed=tr")
        lines = replies(host)
    assert len(lines) == 3, log
    assert [rest for _, rest in lines] == ["middleware=-", "middleware=-", "middleware=- bypassed=tr"], lines
    watching = [x for x in log.splitlines() if "detached middleware 'tr' stopped watching" in x]
    assert watching and all(f"of {lines[1][0]}:" in x for x in watching), (watching, lines)


def test_describing_a_watcher_again_is_not_counted_as_a_hook_failure(tmp_path: Path) -> None:
    """The tracing server killed: each reply re-describes it aside, and each of those Describes
    fails. They are counted as Describes (agentmw_middleware_describe_failures_total), not as
    failed or bypassed hook calls under a hook named "Describe", nor in status' hook failures,
    which are the hook calls /metrics counts. Before, every Describe was one more failure and one
    more bypass of a hook "Describe", and status' failures counted them too."""
    with processes(tmp_path) as procs:
        tracer = procs.start("tracing", TRACER)
        host = procs.host(tmp_path / "sessions.db", "--metrics-port", "0")
        url = METRICS.search(host.tail(50))
        assert url is not None, host.tail(50)
        attach(host, tracer.address, "tr", "--fail-open", "--timeout", "1")
        tracer.kill()
        deadline = time.monotonic() + 30
        while True:  # replies until a Describe aside has failed (each takes up to the timeout, 1 s)
            assert chat(host.address, "--message", "hello").returncode == 0
            (tr,) = agentmw_json(host, "middleware", "list")  # type: ignore[misc]
            if "failed in Describe" in tr["last_error"] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert "failed in Describe" in tr["last_error"], tr

        def of_tr() -> dict[tuple[str, str | None], float]:
            samples = scrape(url.group(1))
            return {(name, dict(by).get("hook")): v for (name, by), v in samples.items() if ("middleware", "tr") in by}

        # Copies to the dead watcher fail in the background, after the reply: status and /metrics
        # are compared from reads with no failure counted in between.
        for _ in range(50):
            before = of_tr()
            (tr,) = agentmw_json(host, "middleware", "list")  # type: ignore[misc]
            metrics = of_tr()
            if before == metrics:
                break
            time.sleep(0.2)
    assert not [key for key in metrics if key[1] == "Describe"], metrics
    hook_failures = sum(v for (name, _), v in metrics.items() if name == "agentmw_middleware_failures_total")
    assert tr["failures"] == hook_failures, (tr, metrics)
    assert metrics[("agentmw_middleware_describe_failures_total", None)] >= 1, metrics


def test_status_and_metrics_count_the_same_bypasses(tmp_path: Path) -> None:
    """A fail_open middleware on every hook, killed: in each reply its first hook call fails and
    is bypassed, and the host goes on without it for the rest of the reply, skipping its other
    hook calls (README: counted as bypasses); then a watcher whose copies go nowhere. Status'
    ``bypasses`` and agentmw_middleware_bypasses_total say the same number, for each. Before,
    status counted the skipped calls and /metrics did not."""
    with processes(tmp_path) as procs:
        every = procs.start(
            "every", ["-m", "agentmw.sdk", "tests.conformance_mw:PassThrough", "--address", "127.0.0.1:0"]
        )
        tracer = procs.start("tracing", TRACER)
        host = procs.host(tmp_path / "sessions.db", "--metrics-port", "0")
        url = METRICS.search(host.tail(50))
        assert url is not None, host.tail(50)
        attach(host, every.address, "every", "--fail-open", "--timeout", "1")
        attach(host, tracer.address, "tr", "--fail-open", "--timeout", "1")
        assert chat(host.address, "--message", "hello").returncode == 0
        every.kill()
        tracer.kill()
        for i in range(2):
            assert chat(host.address, "--message", f"call add a={i} b=2").returncode == 0
        host_log(host, "stopped watching")
        deadline = time.monotonic() + 20
        while True:  # the watcher's deliveries fail after their replies, each after its timeout (1 s)
            listed: list = agentmw_json(host, "middleware", "list")  # type: ignore[assignment]
            status = {m["name"]: m["bypasses"] for m in listed}
            counted = bypasses_counted(scrape(url.group(1)))
            if status == counted or time.monotonic() > deadline:
                break
            time.sleep(0.3)
    assert status["every"] > 0 and status["tr"] > 0, status
    assert status == counted


def bypasses_counted(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, float]:
    """agentmw_middleware_bypasses_total per middleware, its hooks summed."""
    counted: dict[str, float] = {}
    for (metric, labels), value in samples.items():
        if metric == "agentmw_middleware_bypasses_total":
            name = dict(labels)["middleware"]
            counted[name] = counted.get(name, 0) + value
    return counted


def test_a_middleware_back_after_an_outage_is_not_failing_on_an_idle_host(tmp_path: Path) -> None:
    """A fail_open middleware killed, a reply that goes on without it (failing), then its server
    restarted on the same port, and no reply after that: status soon shows it reachable and no
    longer failing (the host describes it anew once it is connected again), and the host says it
    answers again. Before, it stayed "failing now" until a reply called it."""
    with processes(tmp_path) as procs:
        target = "tests.host_util:RecorderMiddleware"
        rec = procs.start("rec", ["-m", "agentmw.sdk", target, "--address", "127.0.0.1:{port}"])
        host = procs.host(tmp_path / "sessions.db")
        attach(host, rec.address, "rec", "--fail-open", "--timeout", "1")
        rec.kill()
        assert chat(host.address, "--message", "hello").returncode == 0
        (down,) = agentmw_json(host, "middleware", "list")  # type: ignore[misc]
        assert down["failing"] and down["health"] != "reachable", down
        rec.restart()
        deadline = time.monotonic() + 15
        while True:  # the channel reconnects within a second (its backoff is 1 s at most)
            (back,) = agentmw_json(host, "middleware", "list")  # type: ignore[misc]
            if not back["failing"] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert back["health"] == "reachable" and not back["failing"], back
        assert back["last_error"], back  # the last error is still there to read, without "failing"
        status = agentmw(host, "status").stdout
        assert "last error at" in status and "no call has succeeded since" not in status, status
        assert f"middleware rec at {rec.address} answers again" in host_log(host, "answers again")
        assert len(replies(host)) == 1  # no reply told it


FLAKY_MODEL = """
models:
  default: flaky
  models:
    flaky:
      provider: offline
      max_retries: 1
      retry: {initial_delay: 0.01}
      script: [{error: {type: upstream, message: try again}}, {text: second time lucky}]
"""


def test_a_model_retry_warning_names_its_session_and_reply(tmp_path: Path) -> None:
    """A model call that fails once and is retried: the host's warning says in which session and
    reply, as that reply's own line does (on a busy host, retries of many sessions interleave).
    Before, it named the model alone."""
    with configured_host(tmp_path, FLAKY_MODEL) as host:
        said = chat(host.address, "--message", "hello")
        assert said.returncode == 0 and "second time lucky" in said.stdout, said.stdout + said.stderr
        log = host_log(host, "outcome=completed")
        (reply,) = replies(host)
    (warning,) = [x for x in log.splitlines() if "WARNING" in x and "model flaky" in x]
    assert f"model flaky attempt 1 failed in {reply[0]}, retrying in" in warning, (warning, reply)
