"""clients/launch.py's ServerProcess, on a child that prints: the listening line starts it, and
wait_for_line waits for output that reaches the parent after the child said it (a reader thread)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from clients.launch import LaunchError, ServerProcess, unused_port

CHILD = "import time; print('listening on 127.0.0.1:1', flush=True); time.sleep(0.5); print('late line', flush=True)"


def test_wait_for_line_waits_for_a_line_printed_after_it_is_asked() -> None:
    child = ServerProcess(["-c", CHILD + "; time.sleep(30)"], name="printer").start()
    try:
        assert "late line" not in child.tail()  # not yet printed: looking once would miss it
        assert child.wait_for_line("late") == "late line"
    finally:
        child.kill()


def test_wait_for_line_says_what_did_not_come() -> None:
    child = ServerProcess(["-c", CHILD + "; time.sleep(30)"], name="printer").start()
    try:
        with pytest.raises(LaunchError, match=r"printer printed no line with 'never' within 1s") as missed:
            child.wait_for_line("never", timeout=1)
        assert "late line" in str(missed.value), "with its last output"
    finally:
        child.kill()


def test_wait_for_line_stops_waiting_once_its_output_ends() -> None:
    child = ServerProcess(["-c", CHILD], name="printer").start()  # exits after the late line
    started = time.monotonic()
    with pytest.raises(LaunchError):
        child.wait_for_line("never", timeout=20)
    assert time.monotonic() - started < 10, "it did not wait out the timeout for a child that exited"
    child.stop()


def test_unused_port_hands_out_no_port_twice() -> None:
    # start_all starts dozens at once: two of them given one port, one fails to listen.
    ports = [unused_port() for _ in range(500)]
    assert 0 not in ports
    assert len(set(ports)) == len(ports)


@pytest.mark.parametrize(
    "refusal",
    [
        "agentmw middleware X: cannot listen on 127.0.0.1:{port} (address already in use)",  # transport.listen
        "RuntimeError: Failed to bind to address 127.0.0.1:{port}; set GRPC_VERBOSITY=debug",  # raw grpcio
    ],
    ids=["ours", "raw_grpcio"],
)
def test_a_child_that_lost_its_chosen_port_is_started_on_another(tmp_path: Path, refusal: str) -> None:
    # The port is free when probed and taken before the child binds it: the child says so, and
    # start() tries another port instead of failing the test.
    lost = tmp_path / "lost"
    child_code = (
        "import pathlib, sys, time; port = sys.argv[1]; lost = pathlib.Path(sys.argv[2])\n"
        "if not lost.exists():\n"
        "    lost.write_text(port)\n"
        f"    sys.exit(f{refusal!r})\n"
        "print(f'listening on 127.0.0.1:{port}', flush=True); time.sleep(30)"
    )
    child = ServerProcess(["-c", child_code, "{port}", str(lost)], name="racer").start()
    try:
        assert child.port != int(lost.read_text()), "it was started again on another port"
    finally:
        child.kill()
