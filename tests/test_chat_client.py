"""``agent-chat`` as users run it: ``python -m clients.chat --message ...`` against a real host process.

The host (and, for audio, a test middleware, tests/audio_mw.py) run as processes on loopback port 0
with a temporary SQLite db; every process is stopped in teardown, every wait is bounded.
"""

from __future__ import annotations

import itertools
import re
import subprocess
import wave
from pathlib import Path

import pytest

from agent_host.codec import codec
from agent_host.data import ToolCallState, ToolResultState
from clients.launch import ServerProcess

from .audio_mw import FREQUENCY, RATE, SECONDS, tone
from .host_util import Procs, chat, get_session, processes

pytestmark = pytest.mark.timeout(60)

SESSION = re.compile(r"^\(session ([0-9A-Za-z_-]+)\)$", re.M)  # what --message prints on stderr
WAITING = re.compile(r"answer with: agent-chat --session ([0-9A-Za-z_-]+) --yes \| --deny")
EMAIL = "email bob@example.com saying hi"


def session_of(done: subprocess.CompletedProcess[str]) -> str:
    """The session id as a user finds it: the ``(session ID)`` line agent-chat prints on stderr."""
    found = SESSION.findall(done.stderr)
    assert len(found) == 1, f"agent-chat printed no session id:\n{done.stdout}\n{done.stderr}"
    return found[0]


def lines(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


async def test_message_prints_tool_call_result_and_answer_then_session_continues(host: ServerProcess) -> None:
    done = chat(host.address, "--message", "use add a=2 b=40")
    assert done.returncode == 0, done.stdout + done.stderr
    assert lines(done) == ['→ add({"a": 2, "b": 40})', "← add: 42", "Done: add returned 42."]
    session = session_of(done)

    again = chat(host.address, "--session", session, "--message", "and now?")
    assert again.returncode == 0, again.stdout + again.stderr
    assert lines(again) == ["You said: and now?"]
    assert session_of(again) == session

    info, state, _ = await get_session(host.address, session)
    assert not info.summary.parked and not info.replying
    assert [(m.role.value, m.text) for m in state.context] == [
        ("user", "use add a=2 b=40"),
        ("assistant", "Done: add returned 42."),
        ("user", "and now?"),
        ("assistant", "You said: and now?"),
    ]


async def test_yes_and_deny_answer_the_confirmation(host: ServerProcess) -> None:
    allowed = chat(host.address, "--message", EMAIL, "--yes")
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    out = lines(allowed)
    assert out[0] == '→ send_email({"to": "bob@example.com", "body": "hi"})'
    assert "? send_email needs your confirmation" in out
    assert '? send_email({"to": "bob@example.com", "body": "hi"}): allowed (--yes)' in out
    assert "← send_email: email to bob@example.com sent (2 characters)" in out
    assert out[-1] == "Done: send_email returned email to bob@example.com sent (2 characters)."
    info, state, _ = await get_session(host.address, session_of(allowed))
    assert not info.pending_tool_calls and not info.summary.parked
    results = [b for m in state.context for b in m.content if getattr(b, "type", "") == "tool_result"]
    assert [r.state for r in results] == [ToolResultState.SUCCESS]

    denied = chat(host.address, "--message", EMAIL, "--deny")
    assert denied.returncode == 0, denied.stdout + denied.stderr
    out = lines(denied)
    assert '? send_email({"to": "bob@example.com", "body": "hi"}): denied (--deny)' in out
    assert any(line.startswith("← send_email [denied]:") for line in out), out
    assert not any("sent (" in line for line in out), "a denied email was sent"
    info, state, _ = await get_session(host.address, session_of(denied))
    assert not info.pending_tool_calls and not info.summary.parked
    results = [b for m in state.context for b in m.content if getattr(b, "type", "") == "tool_result"]
    assert [r.state for r in results] == [ToolResultState.DENIED]


async def test_parked_session_exit_3_then_answered_first(host: ServerProcess) -> None:
    # No answer given: the reply is left waiting, exit 3, and the client says how to answer it.
    parked = chat(host.address, "--message", EMAIL)
    assert parked.returncode == 3, parked.stdout + parked.stderr
    session = session_of(parked)
    assert WAITING.findall(parked.stdout) == [session]
    info, _, _ = await get_session(host.address, session)
    assert info.summary.parked and [c.name for c in info.pending_tool_calls] == ["send_email"]
    assert [codec.decode(c).state for c in info.pending_tool_calls] == [ToolCallState.ASKING]

    # A message to the parked session without an answer: still waiting (exit 3), the message not sent.
    still = chat(host.address, "--session", session, "--message", "are you there?")
    assert still.returncode == 3, still.stdout + still.stderr
    assert WAITING.findall(still.stdout) == [session]
    info, state, _ = await get_session(host.address, session)
    assert info.summary.parked and [c.name for c in info.pending_tool_calls] == ["send_email"]
    assert [m.text for m in state.context if m.role.value == "user"] == [EMAIL]

    # With --yes: what it waits on is answered first, then the message is sent.
    answered = chat(host.address, "--session", session, "--message", "are you there?", "--yes")
    assert answered.returncode == 0, answered.stdout + answered.stderr
    out = lines(answered)
    assert out == [
        '? send_email({"to": "bob@example.com", "body": "hi"}): allowed (--yes)',
        "← send_email: email to bob@example.com sent (2 characters)",
        "Done: send_email returned email to bob@example.com sent (2 characters).",
        "You said: are you there?",
    ]
    assert session_of(answered) == session
    info, state, _ = await get_session(host.address, session)
    assert not info.summary.parked and not info.pending_tool_calls
    assert [m.text for m in state.context if m.role.value == "user"] == [EMAIL, "are you there?"]
    assert state.context[-1].text == "You said: are you there?"

    # --deny with no message answers a parked session and exits.
    parked = chat(host.address, "--message", "email carol@example.com saying yo")
    assert parked.returncode == 3
    session = session_of(parked)
    denied = chat(host.address, "--session", session, "--deny")
    assert denied.returncode == 0, denied.stdout + denied.stderr
    assert any(line.startswith("← send_email [denied]:") for line in lines(denied))
    info, _, _ = await get_session(host.address, session)
    assert not info.summary.parked


def test_unknown_session_is_an_error_not_a_new_conversation(host: ServerProcess) -> None:
    result = chat(host.address, "--session", "no-such-session", "--message", "hi")
    assert result.returncode == 1
    assert "no session no-such-session" in result.stderr


def test_answer_flags_without_a_message_never_go_interactive(host: ServerProcess) -> None:
    first = chat(host.address, "--message", "use add a=1 b=1")
    session = first.stderr.split("(session ")[1].split(")")[0]
    result = chat(host.address, "--session", session, "--yes")
    assert result.returncode == 0
    assert "waits on nothing" in result.stdout and "you>" not in result.stdout


async def test_audio_blocks_saved_as_wav(tmp_path: Path) -> None:
    audio_dir = tmp_path / "audio"
    with processes(tmp_path) as procs:
        host = _audio_host(procs, tmp_path)
        done = chat(host.address, "--message", "hi", "--audio-dir", str(audio_dir))
    assert done.returncode == 0, done.stdout + done.stderr
    assert lines(done)[0] == "You said: hi"
    said = re.findall(r"\[audio saved to (.+\.wav)\]", done.stdout)
    assert len(said) == 1, done.stdout
    path = Path(said[0])
    assert path.parent == audio_dir and path.is_file()
    with wave.open(str(path), "rb") as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, RATE)
        assert w.getnframes() == int(RATE * SECONDS)
        frames = w.readframes(w.getnframes())
    assert path.read_bytes() == tone()
    # It is the tone: a 440 Hz sine crosses zero upwards about 44 times in 0.1 s.
    samples = memoryview(frames).cast("h")
    rising = sum(1 for a, b in itertools.pairwise(samples) if a < 0 <= b)
    assert abs(rising - FREQUENCY * SECONDS) <= 1


def _audio_host(procs: Procs, tmp_path: Path) -> ServerProcess:
    beep = procs.start("beep", ["-m", "mw_servers.sdk", "tests.audio_mw:Beep", "--address", "127.0.0.1:0"])
    return procs.host(tmp_path / "sessions.db", "--middleware", f"beep={beep.address}")
