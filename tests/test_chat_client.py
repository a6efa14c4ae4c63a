"""``agent-chat`` as users run it: ``python -m clients.chat --message ...`` against a real host process.

The host (and, for audio, a test middleware, tests/audio_mw.py) run as processes on loopback port 0
with a temporary SQLite db; every process is stopped in teardown, every wait is bounded.
"""

from __future__ import annotations

import itertools
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import wave
from pathlib import Path

import pytest

from agentmw.codec import codec
from agentmw.data import ToolCallState, ToolResultState
from clients.launch import ROOT, ServerProcess

from .audio_mw import FREQUENCY, RATE, SECONDS, tone
from .durable_mw import lines as effect_lines
from .host_util import Procs, chat, configured_host, get_session, processes
from .test_durable_sessions import side_effects

pytestmark = pytest.mark.timeout(60)

SESSION = re.compile(r"^\(session ([0-9A-Za-z_-]+)\)$", re.M)  # what --message prints on stderr
WAITING = re.compile(r"answer with: agent-chat --session ([0-9A-Za-z_-]+) --yes \| --deny")
EMAIL = "email bob@example.com saying hi"


def session_of(done: subprocess.CompletedProcess[str] | str) -> str:
    """The session id as a user finds it: the ``(session ID)`` line agent-chat prints on stderr
    (of a finished run, or in all it printed)."""
    said = done if isinstance(done, str) else done.stderr
    found = SESSION.findall(said)
    printed = said if isinstance(done, str) else f"{done.stdout}\n{done.stderr}"
    assert len(found) == 1, f"agent-chat printed no session id:\n{printed}"
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


def test_an_unusable_audio_dir_is_refused_or_warned_not_a_crash(tmp_path: Path) -> None:
    """A file in the --audio-dir path is refused up front (exit 2, as other bad flags); a directory
    that cannot be made all the same (/proc/nope) costs the audio only, with one warning: the reply
    and its session id are printed (it was a traceback mid-reply, and no session id)."""
    (tmp_path / "afile").write_text("")
    bad = chat("127.0.0.1:1", "--message", "hi there", "--audio-dir", str(tmp_path / "afile" / "sub"))
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert bad.stderr.splitlines()[-1] == (
        f"agent-chat: error: --audio-dir {tmp_path / 'afile' / 'sub'}: {tmp_path / 'afile'} is not a directory"
    )
    if not Path("/proc").is_dir():
        pytest.skip("needs /proc, where no directory can be made")
    with processes(tmp_path) as procs:
        host = _audio_host(procs, tmp_path)
        done = chat(host.address, "--message", "hi there", "--audio-dir", "/proc/nope")
    assert done.returncode == 0, done.stdout + done.stderr
    assert lines(done) == ["You said: hi there", "! audio not saved to /proc/nope: No such file or directory"]
    assert "Traceback" not in done.stderr
    session_of(done)


def test_a_reply_past_max_iters_is_shown_once_and_says_so(tmp_path: Path) -> None:
    """max_iters 0: the forced final answer streams, and the final message repeats it with
    finished_reason EXCEED_MAX_ITERS; it was printed twice, and the limit never mentioned."""
    with configured_host(tmp_path, "agent: {max_iters: 0}\n") as host:
        done = chat(host.address, "--message", "hello")
    assert done.returncode == 0, done.stdout + done.stderr
    assert lines(done) == [
        "You said: hello",
        "(the agent reached its limit of reasoning-acting iterations, max_iters: the reply ends here)",
    ]


def _audio_host(procs: Procs, tmp_path: Path) -> ServerProcess:
    beep = procs.start("beep", ["-m", "agentmw.sdk", "tests.audio_mw:Beep", "--address", "127.0.0.1:0"])
    return procs.host(tmp_path / "sessions.db", "--middleware", f"beep={beep.address}")


# ---------------------------------------------------------------------------------------------
# Interactive agent-chat (stdin piped, as a script or a closed terminal gives it).

FAILING_MODEL = """
models:
  default: offline
  models:
    offline:
      provider: offline
      rules:
        - {pattern: "please fail", error: {type: invalid_request, message: "no such thing"}}
"""


def interactive(address: str, stdin: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    """agent-chat without --message, its input given at once and then closed."""
    argv = [sys.executable, "-m", "clients.chat", "--host", address]
    try:
        return subprocess.run(argv, cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(
            f"agent-chat did not exit within {timeout}s; output {len(exc.stdout or b'')} bytes"
        ) from None


class Chat:
    """agent-chat running interactively: send lines, wait (bounded) for its output."""

    def __init__(self, address: str, *args: str) -> None:
        argv = [sys.executable, "-m", "clients.chat", "--host", address, *args]
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.out: queue.Queue[str] = queue.Queue()
        self.seen = ""
        self.mark = 0  # where the next expect() starts looking
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        while chunk := self.proc.stdout.read(1):
            self.out.put(chunk)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, *texts: str, timeout: float = 15) -> str:
        """Wait for the first of ``texts`` printed after what earlier calls consumed; which one."""
        deadline = time.monotonic() + timeout
        while True:
            found = [(self.seen.find(t, self.mark), t) for t in texts]
            hits = sorted((i, t) for i, t in found if i >= 0)
            if hits:
                self.mark = hits[0][0] + len(hits[0][1])
                return hits[0][1]
            left = deadline - time.monotonic()
            try:
                self.seen += self.out.get(timeout=max(left, 0.01))
            except queue.Empty:
                if left <= 0:
                    raise AssertionError(f"agent-chat never printed {texts}; it printed:\n{self.seen}") from None

    def finish(self, timeout: float = 30) -> tuple[int, str]:
        """Its exit status and all it printed, once it exits by itself (bounded)."""
        status = self.proc.wait(timeout)
        reader_done = time.monotonic() + 5  # the reader thread ends at EOF, right after the exit
        while time.monotonic() < reader_done:
            try:
                self.seen += self.out.get(timeout=0.2)
            except queue.Empty:
                break
        return status, self.seen

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def test_end_of_input_at_a_confirmation_denies_and_exits(host: ServerProcess) -> None:
    done = interactive(host.address, f"{EMAIL}\n")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr
    assert len(done.stdout) < 10_000, f"{len(done.stdout)} bytes of output"
    assert done.stdout.count("[y]es / [n]o / [e]dit input:") == 1
    assert "(end of input: send_email denied)" in done.stdout
    assert "← send_email [denied]" in done.stdout and "sent (" not in done.stdout


def test_unreachable_host_is_not_connected() -> None:
    done = interactive("127.0.0.1:1", "hello\n")
    assert done.returncode == 1
    assert "connected to" not in done.stdout
    assert "agent-chat: cannot reach the host at 127.0.0.1:1 (UNAVAILABLE)" in done.stderr


def test_commands_are_not_messages_and_usage_is_shown(host: ServerProcess) -> None:
    done = interactive(host.address, "/help\n/usage\nhello there\n/usage\n/sessions\n/nope\n")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "You said: /" not in out, "a command went to the model"
    assert "/sessions   the host's sessions" in out and "unknown command /nope" in out
    session = re.findall(r"\(session (\w+); continue with: agent-chat --session \1\)", out)
    assert len(session) == 1, out
    usage = re.findall(r"tokens this chat: (\d+) in, (\d+) out", out)
    assert usage[0] == ("0", "0") and int(usage[1][0]) > 0 and int(usage[1][1]) > 0, usage
    assert re.search(r"You said: hello there\n\s+\(\d+ tokens in, \d+ out\)", out), out
    assert f"* {session[0]}" in out  # /sessions marks the current one


async def test_host_restart_does_not_end_the_chat_and_ctrl_c_names_the_session(tmp_path: Path) -> None:
    with processes(tmp_path) as procs:
        host = procs.start("host", ["-m", "agent_host", "--listen", "127.0.0.1:{port}", "--db", str(tmp_path / "s.db")])
        chat_ = Chat(host.address)
        try:
            chat_.expect("you> ")
            chat_.send("hello")
            chat_.expect("You said: hello")
            host.stop()
            chat_.send("anyone?")
            chat_.expect("(not answered; try again)")
            host.start()
            for _attempt in range(20):  # as a user would: again, until the reconnect backoff lets it through
                chat_.expect("you> ")
                chat_.send("back again")
                if chat_.expect("You said: back again", "(not answered; try again)") == "You said: back again":
                    break
                time.sleep(0.5)
            chat_.expect("you> ")
            chat_.proc.send_signal(signal.SIGINT)  # Ctrl-C at the prompt
            assert chat_.proc.wait(15) == 130
            chat_.expect("continue with")
            out = chat_.seen
        finally:
            chat_.close()
        (session,) = re.findall(r"\(session (\w+); continue with", out)
        _info, state, _ = await get_session(host.address, session)
        assert [m.text for m in state.context if m.role.value == "user"] == ["hello", "back again"]


async def test_a_host_dying_mid_reply_is_not_blamed_on_tls_and_its_session_is_named(
    procs: Procs, tmp_path: Path
) -> None:
    """agent-chat -m while the host is killed mid-reply: it says the stream broke, without the TLS
    hint (the connection had worked), and prints the session id, which the restarted host goes on
    with. Before, it suggested TLS and never printed the id of the session it had stored."""
    effects, db = tmp_path / "effects.txt", tmp_path / "sessions.db"
    fx = side_effects(procs, effects)
    host = procs.host(db, "--middleware", f"fx={fx.address}")
    chat_ = Chat(host.address, "-m", "call fx__slow_note text=x seconds=30")
    try:
        # Killed mid-reply: once the client has printed the tool call, and the tool runs.
        chat_.expect("→ fx__slow_note")
        for _ in range(200):  # bounded: until the tool runs
            if effect_lines(effects):
                break
            time.sleep(0.05)
        host.kill()
        status, said = chat_.finish()
    finally:
        chat_.close()
    assert status == 1, said
    assert "UNAVAILABLE" in said and "TLS" not in said, said
    session = session_of(said)
    host = procs.host(db, "--middleware", f"fx={fx.address}", name="host2")
    _, state, _ = await get_session(host.address, session)
    assert [m.text for m in state.context if m.role.value == "user"] == ["call fx__slow_note text=x seconds=30"]


async def test_a_host_dying_before_the_first_event_still_names_the_session(procs: Procs, tmp_path: Path) -> None:
    """agent-chat -m while an on_reply middleware holds the ReplyStartEvent (the message stored)
    and the host is killed: it still prints the id of the session the host minted, which the
    restarted host shows with the message. Before, nothing had reached the client, so it printed
    no id: the stored session was lost to the user."""
    db = tmp_path / "sessions.db"
    held = procs.start("held", ["-m", "tests.raw_mw", "hold_first", "--address", "127.0.0.1:0"])
    host = procs.host(db, "--middleware", f"held={held.address}")
    chat_ = Chat(host.address, "-m", "hello")
    try:
        line = held.wait_for_line("holding the first item, reply_start", timeout=20)
        time.sleep(0.5)  # the host sent the client its first ReplyEvent before this item (loopback: at once)
        host.kill()
        status, said = chat_.finish()
    finally:
        chat_.close()
    assert status == 1, said
    session = session_of(said)
    assert line.endswith(f"session {session}"), (line, said)
    host = procs.host(db, name="host2")
    _, state, _ = await get_session(host.address, session)
    assert [m.text for m in state.context if m.role.value == "user"] == ["hello"]


async def test_a_host_dying_mid_reply_in_the_chat_says_so_and_names_the_session(procs: Procs, tmp_path: Path) -> None:
    """Interactive agent-chat while the host is killed mid-reply: it says the host went away during
    the reply and names the session (stored, to go on with), not "(not answered; try again)", which
    tells the user nothing was stored. The chat goes on, with the restarted host, in that session."""
    effects, db = tmp_path / "effects.txt", tmp_path / "sessions.db"
    fx = side_effects(procs, effects)
    host = procs.host(db, "--middleware", f"fx={fx.address}")
    chat_ = Chat(host.address)
    try:
        chat_.expect("you> ")
        chat_.send("call fx__slow_note text=x seconds=30")
        chat_.expect("→ fx__slow_note")
        for _ in range(200):  # bounded: until the tool runs
            if effect_lines(effects):
                break
            time.sleep(0.05)
        host.kill()
        said = chat_.expect("(not answered; try again)", "went away")
        chat_.expect("you> ")
        out = chat_.seen
        assert said == "went away" and "TLS" not in out, out
        (session,) = re.findall(r"session (\w+) keeps", out)
        assert f"agent-chat --session {session}" in out, out
        host = procs.host(db, "--middleware", f"fx={fx.address}", name="host2")
        _, state, _ = await get_session(host.address, session)
        assert [m.text for m in state.context if m.role.value == "user"] == ["call fx__slow_note text=x seconds=30"]
    finally:
        chat_.close()


def test_failed_reply_exits_non_zero_and_a_bypass_is_shown(tmp_path: Path) -> None:
    with processes(tmp_path) as procs:
        recorder = procs.recorder()
        config = tmp_path / "host.yaml"
        config.write_text(
            FAILING_MODEL
            + f"middleware:\n  - {{name: rec, address: '{recorder.address}', fail_open: true, timeout: 1}}\n"
        )
        host = procs.host(tmp_path / "s.db", "--config", str(config))
        ok = chat(host.address, "--message", "hello")
        assert ok.returncode == 0 and "!" not in ok.stdout, ok.stdout
        assert re.search(r"^\(\d+ tokens in, \d+ out\)$", ok.stderr, re.M), ok.stderr

        recorder.kill()
        bypassed = chat(host.address, "--message", "hello again")
        assert bypassed.returncode == 0, bypassed.stdout + bypassed.stderr
        assert "! middleware rec skipped in on_reply (it failed): middleware 'rec' failed" in bypassed.stdout
        assert "You said: hello again" in bypassed.stdout

        failed = chat(host.address, "--message", "please fail")
        assert failed.returncode == 1, failed.stdout + failed.stderr
        typed = interactive(host.address, "please fail\n")
        assert typed.returncode == 1, typed.stdout + typed.stderr
        assert "no such thing" in typed.stdout
