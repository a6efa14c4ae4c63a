"""clients/launch.py's ServerProcess, on a child that prints: the listening line starts it, and
wait_for_line waits for output that reaches the parent after the child said it (a reader thread)."""

from __future__ import annotations

import time

import pytest

from clients.launch import LaunchError, ServerProcess

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
