"""Showing a reply in the terminal: ``View`` prints its items readably as they arrive, saves audio
to WAV files and plays them (``Player``). Used by agent-chat (clients/chat.py) and clients.demo."""

from __future__ import annotations

import base64
import json
import queue
import re
import shutil
import subprocess
import sys
import threading
import wave
from pathlib import Path
from typing import Any, TextIO

from agentmw.data import (
    CustomEvent,
    DataBlockDeltaEvent,
    DataBlockEndEvent,
    DataBlockStartEvent,
    ExceedMaxItersEvent,
    FinishedReason,
    HintBlockEvent,
    ModelCallEndEvent,
    ModelCallStartEvent,
    Msg,
    ReplyEndEvent,
    ReplyFinishedReason,
    ReplyStartEvent,
    RequireExternalExecutionEvent,
    RequireUserConfirmEvent,
    TextBlock,
    TextBlockDeltaEvent,
    TextBlockEndEvent,
    ThinkingBlockDeltaEvent,
    ThinkingBlockEndEvent,
    ToolCallDeltaEvent,
    ToolCallEndEvent,
    ToolCallStartEvent,
    ToolResultDataDeltaEvent,
    ToolResultEndEvent,
    ToolResultStartEvent,
    ToolResultState,
    ToolResultTextDeltaEvent,
)

# Model calls that ended short of a complete answer, as agent-chat says it.
_CUT = {
    FinishedReason.LENGTH: "the model's answer was cut at its output token limit",
    FinishedReason.CONTENT_FILTER: "the model's answer was withheld by the provider's content filter",
    FinishedReason.ERROR: "the model call failed mid-answer; what arrived is kept",
}


class View:
    """Prints a reply's items readably, as they arrive; saves audio to WAV files."""

    def __init__(
        self, out: TextIO = sys.stdout, audio_dir: str | Path = "agent-audio", color: bool | None = None
    ) -> None:
        self.out = out
        self.audio_dir = Path(audio_dir)
        self.color = out.isatty() if color is None else color
        self.in_text = False
        self.streamed: dict[str, str] = {}  # text block id -> its text streamed in this reply
        self.calls: dict[str, list[str]] = {}  # tool call id -> [name, input so far]
        self.results: dict[str, list[str]] = {}  # tool call id -> [name, output so far]
        self.audio: dict[str, tuple[str, list[str]]] = {}  # block id -> (media type, base64 pieces)
        self.saved: list[Path] = []
        self.player: Player | None = None  # plays each saved file (--play)
        self.failed = False  # the reply's end reported an error

    def _dim(self, text: str) -> str:
        return f"\033[2m{text}\033[0m" if self.color else text

    def _line(self, text: str) -> None:
        if self.in_text:
            self.out.write("\n")
            self.in_text = False
        self.out.write(text + "\n")
        self.out.flush()

    def show(self, item: Any) -> None:
        if isinstance(item, ReplyStartEvent):
            self.streamed, self.failed = {}, False
        elif isinstance(item, TextBlockDeltaEvent):
            self.out.write(item.delta)
            self.out.flush()
            self.in_text = True
            self.streamed[item.block_id] = self.streamed.get(item.block_id, "") + item.delta
        elif isinstance(item, TextBlockEndEvent | ThinkingBlockEndEvent):
            if self.in_text:
                self.out.write("\n")
                self.in_text = False
        elif isinstance(item, ThinkingBlockDeltaEvent):
            self.out.write(self._dim(item.delta))
            self.in_text = True
        elif isinstance(item, ToolCallStartEvent):
            self.calls[item.tool_call_id] = [item.tool_call_name, ""]
        elif isinstance(item, ToolCallDeltaEvent):
            self.calls.setdefault(item.tool_call_id, ["?", ""])[1] += item.delta
        elif isinstance(item, ToolCallEndEvent):
            name, raw = self.calls.get(item.tool_call_id, ["?", ""])
            self._line(f"  → {name}({raw})")
        elif isinstance(item, ToolResultStartEvent):
            self.results[item.tool_call_id] = [item.tool_call_name, ""]
        elif isinstance(item, ToolResultTextDeltaEvent):
            self.results.setdefault(item.tool_call_id, ["?", ""])[1] += item.delta
        elif isinstance(item, ToolResultDataDeltaEvent):
            self._audio_piece(item.block_id, item.media_type, item.data)
        elif isinstance(item, ToolResultEndEvent):
            name, text = self.results.pop(item.tool_call_id, ["?", ""])
            state = "" if item.state == ToolResultState.SUCCESS else f" [{item.state.value}]"
            self._line(f"  ← {name}{state}: {_short(text)}")
        elif isinstance(item, DataBlockStartEvent | DataBlockDeltaEvent):
            self._audio_piece(item.block_id, item.media_type, getattr(item, "data", None))
        elif isinstance(item, DataBlockEndEvent):
            self._save_audio(item.block_id)
        elif isinstance(item, RequireUserConfirmEvent):
            for call in item.tool_calls:
                self._line(f"  ? {call.name} needs your confirmation")
        elif isinstance(item, RequireExternalExecutionEvent):
            for call in item.tool_calls:
                self._line(f"  ? {call.name} must be run by the client")
        elif isinstance(item, CustomEvent) and item.name == "middleware_bypassed" and isinstance(item.value, dict):
            v = item.value
            self._line(f"  ! middleware {v.get('middleware')} skipped in {v.get('hook')} (it failed): {v.get('error')}")
        elif isinstance(item, CustomEvent):
            self._line(self._dim(f"  · {item.name}: {json.dumps(item.value, sort_keys=True)}"))
        elif isinstance(item, HintBlockEvent):
            hint = item.hint if isinstance(item.hint, str) else " ".join(getattr(b, "text", "") for b in item.hint)
            self._line(self._dim(f"  hint{f' ({item.source})' if item.source else ''}: {_short(hint)}"))
        elif isinstance(item, ModelCallStartEvent):
            for failure in item.metadata.get("failed_attempts") or []:  # retries and fallbacks before it
                self._line(self._dim(f"  (model {failure.get('model')} failed: {failure.get('error')})"))
        elif isinstance(item, ModelCallEndEvent) and item.finished_reason in _CUT:
            self._line(f"  ({_CUT[item.finished_reason]})")
        elif isinstance(item, ExceedMaxItersEvent):
            self._line("  (the agent reached its limit of reasoning-acting iterations, max_iters: the reply ends here)")
        elif isinstance(item, ReplyEndEvent):
            self.failed = item.finished_reason == ReplyFinishedReason.ERROR and item.error is not None
            for block_id in list(self.audio):
                self._save_audio(block_id)
            if item.finished_reason == ReplyFinishedReason.INTERRUPTED:
                self._line("  (reply interrupted)")
            elif item.finished_reason == ReplyFinishedReason.ERROR and item.error is not None:
                self._line(f"  (reply failed: {item.error.message})")
        elif isinstance(item, Msg) and not (self.failed and item.finished_reason == ReplyFinishedReason.ERROR):
            # The final message repeats what streamed (under other block ids): only the text that
            # did not stream is shown (the parked or max_iters notice, a non-streamed answer).
            # A failed reply's message repeats the error its end already showed.
            streamed = set(self.streamed.values())
            unseen = [b.text for b in item.content if isinstance(b, TextBlock) and b.text not in streamed]
            if "".join(unseen):
                self._line("".join(unseen))

    def _audio_piece(self, block_id: str, media_type: str, data: str | None) -> None:
        if not media_type.startswith("audio/"):
            return
        entry = self.audio.setdefault(block_id, (media_type, []))
        if data:
            entry[1].append(data)

    def _save_audio(self, block_id: str) -> None:
        entry = self.audio.pop(block_id, None)
        if entry is None or not entry[1]:
            return
        media_type, pieces = entry
        try:
            path = save_audio(b"".join(base64.b64decode(p) for p in pieces), media_type, self.audio_dir, block_id)
        except OSError as exc:  # a lost recording must not end the reply (or the chat)
            self._line(f"  ! audio not saved to {self.audio_dir}: {exc.strerror or exc}")
            return
        self.saved.append(path)
        self._line(f"  [audio saved to {path}]")
        if self.player is not None:
            self.player.play(path)


# Players tried in order for --play; each takes a WAV file's path last.
PLAYERS = (["aplay", "-q"], ["paplay"], ["ffplay", "-nodisp", "-autoexit", "-loglevel", "quiet"])


class Player:
    """Plays WAV files one after another on a thread of its own, so the reply streams on meanwhile."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.files: queue.Queue[Path | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="player", daemon=True)
        self.thread.start()

    @classmethod
    def find(cls) -> Player | None:
        for name, *flags in PLAYERS:
            if path := shutil.which(name):
                return cls([path, *flags])
        return None

    def play(self, path: Path) -> None:
        self.files.put(path)

    def _run(self) -> None:
        while (path := self.files.get()) is not None:
            subprocess.run([*self.argv, str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)

    def close(self, timeout: float = 120.0) -> None:
        """Let what is queued finish playing (bounded)."""
        self.files.put(None)
        self.thread.join(timeout)


def save_audio(data: bytes, media_type: str, directory: Path, name: str) -> Path:
    """A WAV file of audio bytes: WAV data as is, raw PCM (audio/pcm, audio/L16; rate=...) wrapped."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{re.sub(r'[^A-Za-z0-9_-]', '', name)[:32] or 'audio'}.wav"
    if data[:4] == b"RIFF":
        path.write_bytes(data)
        return path
    params = dict(re.findall(r";\s*(\w+)=([\w.]+)", media_type))
    rate = int(params.get("rate") or params.get("sample_rate") or 24000)
    channels = int(params.get("channels", 1))
    with wave.open(str(path), "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(data)
    return path


def _short(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
