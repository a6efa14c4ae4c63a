"""``agent-chat``: talk to a running agent host (``agent-host``) from the terminal.

    agent-chat                                  # interactive, a new session
    agent-chat --session 3f2a...                # continue a session
    agent-chat --message "weather in Paris?"    # one reply, printed, then exit
    agent-chat --message "email bob@example.com saying hi" --yes   # answer confirmations
    agent-chat --message "Alice is 30" --schema @person.json        # and a structured output

Text streams as it arrives; tool calls and results are shown as they finish; a tool that needs
confirmation asks (y / n / edit its input); a tool the client must run asks for its result; audio
(data blocks with an audio/* media type, e.g. from the TTS middleware) is saved as WAV files,
and played with --play.
With ``--schema`` the reply must also fill that JSON schema: its ``structured_output`` is printed
as JSON after the answer.
Ctrl-C while a reply streams interrupts it (the host ends it cleanly); Ctrl-C at the prompt quits
(printing the session id to continue with); end of input (Ctrl-D) at a confirmation denies it.
Interactive commands: /help, /sessions, /usage, /quit. After each reply it shows the tokens used;
hints and the middleware's events (a middleware bypassed because it failed, say) show as they come.

The pieces (``HostClient``, ``converse``, ``View``) are reused by ``clients.demo``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import queue
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import wave
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import grpc

from agent_host.codec import codec
from agent_host.data import (
    CustomEvent,
    DataBlockDeltaEvent,
    DataBlockEndEvent,
    DataBlockStartEvent,
    ExternalExecutionResultEvent,
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
    TextBlockDeltaEvent,
    TextBlockEndEvent,
    ThinkingBlockDeltaEvent,
    ThinkingBlockEndEvent,
    ToolCallBlock,
    ToolCallDeltaEvent,
    ToolCallEndEvent,
    ToolCallStartEvent,
    ToolCallState,
    ToolResultBlock,
    ToolResultDataDeltaEvent,
    ToolResultEndEvent,
    ToolResultStartEvent,
    ToolResultState,
    ToolResultTextDeltaEvent,
    UserConfirmResultEvent,
    UserMsg,
    new_id,
)
from agent_host.data.events import ConfirmResult
from agent_host.security import SecurityError, TlsFiles, client_channel, read_secret
from agentmw.v1 import host_pb2, host_pb2_grpc

DEFAULT_HOST = "127.0.0.1:50070"


# ---------------------------------------------------------------------------------------------
# Talking to the host.


class HostClient:
    """An AgentHost connection (one channel); ``reply()`` starts one Reply call."""

    def __init__(self, address: str, tls: TlsFiles | None = None, token: str = "") -> None:
        self.address = address
        self.channel = client_channel(address, tls, token)  # TLS / token when the host requires them
        self.stub = host_pb2_grpc.AgentHostStub(self.channel)

    def reply(self, session_id: str, inputs: Any, structured_schema: dict[str, Any] | None = None) -> ReplyCall:
        return ReplyCall(self.stub, session_id, inputs, structured_schema)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> HostClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


class ReplyCall:
    """One reply: iterate it for its items (events, then the final Msg); ``cancel()`` interrupts.
    ``structured_schema`` (with a message only): a JSON schema the final Msg's structured_output fills."""

    def __init__(
        self,
        stub: host_pb2_grpc.AgentHostStub,
        session_id: str,
        inputs: Any,
        structured_schema: dict[str, Any] | None = None,
    ) -> None:
        self.session_id = session_id
        self._requests: asyncio.Queue[host_pb2.ReplyRequest | None] = asyncio.Queue()
        start = host_pb2.ReplyRequest()
        record = {"session_id": session_id, "input": inputs, "structured_schema": structured_schema}
        codec.encode_record(record, start.start)
        self._requests.put_nowait(start)
        self.call = stub.Reply(self._send())

    async def _send(self) -> AsyncIterator[host_pb2.ReplyRequest]:
        while (request := await self._requests.get()) is not None:
            yield request

    def cancel(self) -> None:
        self._requests.put_nowait(host_pb2.ReplyRequest(cancel=host_pb2.CancelReply()))

    async def __aiter__(self) -> AsyncIterator[Any]:
        try:
            async for event in self.call:
                self.session_id = event.session_id or self.session_id
                for item in event.items:
                    yield codec.decode_item(item)
        finally:
            self._requests.put_nowait(None)
            self.call.cancel()


@dataclass
class Turn:
    """What one user turn came to, over all its resumptions."""

    session_id: str
    final: Msg | None = None
    end: ReplyEndEvent | None = None
    parked: bool = False  # it still waits for a confirmation / external result
    items: list[Any] = field(default_factory=list)


ConfirmAnswer = Callable[[ToolCallBlock], Awaitable[ConfirmResult | None]]
ExternalAnswer = Callable[[ToolCallBlock], Awaitable[ToolResultBlock | None]]


async def answer(
    calls: list[ToolCallBlock], reply_id: str, on_confirm: ConfirmAnswer | None, on_external: ExternalAnswer | None
) -> Any | None:
    """The event that resumes a reply parked on ``calls``: the confirmations first, else the external
    results. None when there is no answerer, or an answerer gave none (the reply stays parked)."""
    asks = [c for c in calls if c.state == ToolCallState.ASKING]
    if asks:
        if on_confirm is None:
            return None
        confirmed = [r for c in asks if (r := await on_confirm(c)) is not None]
        if len(confirmed) < len(asks):
            return None
        return UserConfirmResultEvent(reply_id=reply_id, confirm_results=confirmed)
    submitted = [c for c in calls if c.state == ToolCallState.SUBMITTED]
    if on_external is None or not submitted:
        return None
    blocks = [b for c in submitted if (b := await on_external(c)) is not None]
    if len(blocks) < len(submitted):
        return None
    return ExternalExecutionResultEvent(reply_id=reply_id, execution_results=blocks)


async def converse(
    client: HostClient,
    session_id: str,
    inputs: Any,
    *,
    on_item: Callable[[Any], None] = lambda item: None,
    on_confirm: ConfirmAnswer | None = None,
    on_external: ExternalAnswer | None = None,
    on_call: Callable[[ReplyCall], None] = lambda call: None,
    parked_on: list[ToolCallBlock] = (),  # type: ignore[assignment]
    reply_id: str = "",
    structured_schema: dict[str, Any] | None = None,
) -> Turn:
    """Run a reply (``inputs``: a message or a resumption event) and answer whatever it parks on,
    until it ends. ``inputs=None`` with ``parked_on``/``reply_id``: answer a reply parked earlier.
    ``structured_schema`` goes with the first call only (the message; the resumptions keep it)."""
    turn = Turn(session_id)
    pending = {c.id: c for c in parked_on}
    while True:
        if inputs is None:
            inputs = await answer(list(pending.values()), reply_id, on_confirm, on_external)
            if inputs is None:
                turn.parked = bool(pending)
                return turn
        call = client.reply(turn.session_id, inputs, structured_schema)
        structured_schema = None
        on_call(call)
        turn.final = None
        async for item in call:
            turn.items.append(item)
            on_item(item)
            if isinstance(item, RequireUserConfirmEvent | RequireExternalExecutionEvent):
                pending.update((c.id, c) for c in item.tool_calls)
            elif isinstance(item, ToolResultEndEvent):
                pending.pop(item.tool_call_id, None)
            elif isinstance(item, ReplyEndEvent):
                turn.end = item
            elif isinstance(item, Msg):
                turn.final = item
        turn.session_id = call.session_id
        if turn.end is not None or turn.final is None or not pending:
            return turn
        reply_id, inputs = turn.final.id, None


# ---------------------------------------------------------------------------------------------
# Showing a reply.


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
        self.streamed_text = False
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
            self.streamed_text = self.failed = False
        elif isinstance(item, TextBlockDeltaEvent):
            self.out.write(item.delta)
            self.out.flush()
            self.in_text = self.streamed_text = True
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
        elif isinstance(item, ReplyEndEvent):
            self.failed = item.finished_reason == ReplyFinishedReason.ERROR and item.error is not None
            for block_id in list(self.audio):
                self._save_audio(block_id)
            if item.finished_reason == ReplyFinishedReason.INTERRUPTED:
                self._line("  (reply interrupted)")
            elif item.finished_reason == ReplyFinishedReason.ERROR and item.error is not None:
                self._line(f"  (reply failed: {item.error.message})")
        elif (
            isinstance(item, Msg)
            and not (self.failed and item.finished_reason == ReplyFinishedReason.ERROR)
            and (not self.streamed_text or item.finished_reason != ReplyFinishedReason.COMPLETED)
        ):  # a failed reply's message repeats the error its end already showed
            self._line(item.text)

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
        path = save_audio(b"".join(base64.b64decode(p) for p in pieces), media_type, self.audio_dir, block_id)
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


# ---------------------------------------------------------------------------------------------
# The command line.


def _input(prompt: str) -> str:
    """input(), with Ctrl-C noticed at once. The kernel may hand SIGINT to one of gRPC's threads;
    Python then runs its handler in the main thread only at the next bytecode, which a main thread
    blocked reading stdin never reaches. Waiting in short select() steps keeps it reaching one."""
    print(prompt, end="", flush=True)
    while not select.select([sys.stdin], [], [], 0.2)[0]:
        pass
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.removesuffix("\n")


def _ask(prompt: str) -> str | None:
    """A line of input; None at the end of input (so a prompt cannot ask again forever)."""
    try:
        return _input(prompt)
    except EOFError:
        print()
        return None


async def _ask_confirm(call: ToolCallBlock) -> ConfirmResult | None:
    print(f"  ? allow {call.name}({call.input})?")
    while True:
        answer = _ask("    [y]es / [n]o / [e]dit input: ")
        if answer is None:
            print(f"    (end of input: {call.name} denied)")
            return ConfirmResult(confirmed=False, tool_call=call)
        answer = answer.strip().lower()
        if answer in ("y", "yes"):
            return ConfirmResult(confirmed=True, tool_call=call)
        if answer in ("n", "no"):
            return ConfirmResult(confirmed=False, tool_call=call)
        if answer in ("e", "edit"):
            raw = _ask("    new input (JSON): ")
            if raw is None:
                print(f"    (end of input: {call.name} denied)")
                return ConfirmResult(confirmed=False, tool_call=call)
            raw = raw.strip()
            try:
                json.loads(raw)
            except json.JSONDecodeError as exc:
                print(f"    not JSON: {exc}")
                continue
            edited = ToolCallBlock(id=call.id, name=call.name, input=raw, state=call.state)
            return ConfirmResult(confirmed=True, tool_call=edited)


async def _ask_external(call: ToolCallBlock) -> ToolResultBlock | None:
    text = _ask(f"  ? {call.name}({call.input}) runs on your side; its result: ")
    if text is None:  # end of input: the reply stays parked, to be answered later
        return None
    return ToolResultBlock(id=call.id, name=call.name, output=text, state=ToolResultState.SUCCESS)


def _auto_confirm(allow: bool) -> ConfirmAnswer:
    async def answer(call: ToolCallBlock) -> ConfirmResult:
        print(f"  ? {call.name}({call.input}): {'allowed' if allow else 'denied'} (--{'yes' if allow else 'deny'})")
        return ConfirmResult(confirmed=allow, tool_call=call)

    return answer


def _auto_external(result: str | None) -> ExternalAnswer:
    async def answer(call: ToolCallBlock) -> ToolResultBlock:
        if result is None:
            return ToolResultBlock(
                id=call.id,
                name=call.name,
                state=ToolResultState.ERROR,
                output="agent-chat cannot run this tool (no --external-result given)",
            )
        return ToolResultBlock(id=call.id, name=call.name, output=result, state=ToolResultState.SUCCESS)

    return answer


async def _turn(
    args: argparse.Namespace,
    session_id: str,
    inputs: Any,
    view: View,
    *,
    interactive: bool,
    structured_schema: dict[str, Any] | None = None,
    **resume: Any,
) -> Turn:
    """One turn, with Ctrl-C while streaming sending a cancel (a second Ctrl-C gives up)."""
    loop = asyncio.get_running_loop()
    current: list[ReplyCall] = []
    presses = 0

    def on_sigint() -> None:
        nonlocal presses
        presses += 1
        if presses > 1 or not current:
            raise KeyboardInterrupt
        view._line("  (interrupting…)")
        current[-1].cancel()

    def prompting(ask: Any) -> Any:
        async def wrapped(call: ToolCallBlock) -> Any:
            loop.remove_signal_handler(signal.SIGINT)  # at a prompt, Ctrl-C quits as usual
            try:
                return await ask(call)
            finally:
                loop.add_signal_handler(signal.SIGINT, on_sigint)

        return wrapped

    if interactive:
        on_confirm: ConfirmAnswer | None = prompting(_ask_confirm)
        on_external: ExternalAnswer | None = prompting(_ask_external)
    else:
        on_confirm = _auto_confirm(True) if args.yes else _auto_confirm(False) if args.deny else None
        on_external = _auto_external(args.external_result)
    loop.add_signal_handler(signal.SIGINT, on_sigint)
    try:
        async with HostClient(args.host, *_credentials(args)) as client:
            return await converse(
                client,
                session_id,
                inputs,
                on_item=view.show,
                on_confirm=on_confirm,
                on_external=on_external,
                on_call=current.append,
                structured_schema=structured_schema,
                **resume,
            )
    finally:
        loop.remove_signal_handler(signal.SIGINT)


class UnknownSession(Exception):
    pass


def _credentials(args: argparse.Namespace) -> tuple[TlsFiles, str]:
    """TLS files and the token (from AGENTMW_TOKEN or --token-file: never a command-line argument)."""
    tls = TlsFiles(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca, server_name=args.tls_server_name)
    token = read_secret(file=args.token_file, where="--token-file") if args.token_file else ""
    return tls, token or os.environ.get("AGENTMW_TOKEN", "")


async def _parked(args: argparse.Namespace, session_id: str) -> dict[str, Any]:
    """What a session is parked on, as ``converse`` resume arguments ({} when it is not)."""
    async with HostClient(args.host, *_credentials(args)) as client:
        try:
            session = await client.stub.GetSession(host_pb2.GetSessionRequest(session_id=session_id), timeout=10)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:  # a mistyped id must not start a new conversation
                raise UnknownSession(session_id) from None
            raise
    calls = [codec.decode(c) for c in session.pending_tool_calls]
    return {"parked_on": calls, "reply_id": session.state.reply_context.reply_id} if calls else {}


def _schema(parser: argparse.ArgumentParser, text: str) -> dict[str, Any]:
    """``--schema``: a JSON object, given inline or as @path (whether it is a valid JSON schema is
    the host's to say)."""
    where = "--schema"
    if text.startswith("@"):
        where = f"--schema {text}"
        try:
            text = Path(text[1:]).read_text(encoding="utf-8")
        except OSError as exc:
            parser.error(f"{where}: cannot read it: {exc.strerror or exc}")
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        parser.error(f"{where}: not JSON: {exc}")
    if not isinstance(schema, dict):
        parser.error(f"{where}: a JSON schema is a JSON object, got {type(schema).__name__}")
    return schema


def _report(turn: Turn) -> int:
    if turn.parked:
        print(f"  (the reply is waiting; answer with: agent-chat --session {turn.session_id} --yes | --deny)")
        return 3
    return 1 if _failed(turn) else 0


def _failed(turn: Turn) -> bool:
    """The reply ended with an error (said by its end event, or by its final message alone)."""
    reasons = {turn.end.finished_reason if turn.end is not None else None}
    reasons.add(turn.final.finished_reason if turn.final is not None else None)
    return ReplyFinishedReason.ERROR in reasons


def _usage(turn: Turn) -> tuple[int, int]:
    usage = turn.final.usage if turn.final is not None else None
    return (usage.input_tokens, usage.output_tokens) if usage is not None else (0, 0)


HELP = """commands:
  /help       this list
  /sessions   the host's sessions, most recent first (continue one with: agent-chat --session ID)
  /usage      tokens used in this chat so far
  /quit       leave (also Ctrl-D); Ctrl-C interrupts a reply, or leaves at the prompt
anything else is a message to the agent"""


async def _check_host(address: str) -> str:
    """The host's health (SERVING / NOT_SERVING); raises AioRpcError when it cannot be reached."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def _sessions(address: str, current: str) -> str:
    async with HostClient(address) as client:
        found = await client.stub.ListSessions(host_pb2.ListSessionsRequest(limit=20), timeout=10)
    rows = [
        f"  {'*' if s.session_id == current else ' '} {s.session_id}  {s.updated_at}  {s.title}" for s in found.sessions
    ]
    return "\n".join(rows) or "  (no sessions)"


def _interactive(args: argparse.Namespace, session_id: str, parked: dict[str, Any], view: View) -> int:
    """The chat loop. Returns the exit status: 1 if the last reply failed (or could not be sent)."""
    try:
        health = asyncio.run(_check_host(args.host))
    except grpc.aio.AioRpcError as exc:
        print(f"agent-chat: cannot reach the host at {args.host} ({exc.code().name})", file=sys.stderr)
        return 1
    note = "" if health == "SERVING" else f" (its health: {health}; `agentmw status` says why)"
    print(f"agent-chat: connected to {args.host}{note}. /help lists commands; Ctrl-C interrupts a reply.")
    session_id = session_id or new_id()  # known from the start, so that every way out can name it
    tokens = [0, 0]
    status = 0
    try:
        if parked:
            print(f"session {session_id} is waiting on {', '.join(c.name for c in parked['parked_on'])}")
            asyncio.run(_turn(args, session_id, None, view, interactive=True, **parked))
        while True:
            try:
                text = _input("you> ").strip()
            except EOFError:
                print()
                break
            if text in ("/quit", "/exit"):
                break
            if text.startswith("/"):
                if text == "/help":
                    print(HELP)
                elif text == "/usage":
                    print(f"  tokens this chat: {tokens[0]} in, {tokens[1]} out (session {session_id})")
                elif text == "/sessions":
                    try:
                        print(asyncio.run(_sessions(args.host, session_id)))
                    except grpc.aio.AioRpcError as exc:
                        print(f"agent-chat: {args.host}: {exc.code().name}: {exc.details()}", file=sys.stderr)
                else:
                    print(f"unknown command {text.split()[0]}; /help lists them (a message cannot start with /)")
                continue
            if not text:
                continue
            try:
                turn = asyncio.run(_turn(args, session_id, UserMsg(text), view, interactive=True))
            except grpc.aio.AioRpcError as exc:  # e.g. the host restarting: the chat goes on
                print(f"agent-chat: {args.host}: {exc.code().name}: {exc.details()} (not answered; try again)")
                status = 1
                continue
            used = _usage(turn)
            tokens[0] += used[0]
            tokens[1] += used[1]
            if any(used):
                view._line(view._dim(f"  ({used[0]} tokens in, {used[1]} out)"))
            status = 1 if _failed(turn) else 0
    except KeyboardInterrupt:
        print()
        status = 130
    print(f"(session {session_id}; continue with: agent-chat --session {session_id})")
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agent-chat", description="Chat with a running agentmw host.")
    parser.add_argument(
        "--host",
        default=os.environ.get("AGENTMW_HOST", DEFAULT_HOST),
        help=f"the host's address (default {DEFAULT_HOST}; env AGENTMW_HOST)",
    )
    parser.add_argument("--session", default="", help="continue this session (default: a new one)")
    parser.add_argument("--message", "-m", help="send this one message, print the reply and exit")
    parser.add_argument(
        "--schema",
        metavar="JSON",
        help="with --message: a JSON schema (type object), inline or @path to a file, that the reply must "
        "fill; its structured output is printed as JSON after the answer",
    )
    answers = parser.add_mutually_exclusive_group()
    answers.add_argument("--yes", action="store_true", help="non-interactive: allow every tool confirmation")
    answers.add_argument("--deny", action="store_true", help="non-interactive: deny every tool confirmation")
    parser.add_argument("--external-result", help="non-interactive: the result to give client-side tools")
    parser.add_argument("--audio-dir", default="agent-audio", help="where audio is saved (default ./agent-audio)")
    parser.add_argument("--play", action="store_true", help="play saved audio (with aplay, paplay or ffplay)")
    security = parser.add_argument_group("security (see docs/security.md)")
    env = os.environ.get
    security.add_argument("--tls-ca", default=env("AGENTMW_TLS_CA", ""), help="connect over TLS, trusting this CA")
    security.add_argument("--tls-cert", default=env("AGENTMW_TLS_CLIENT_CERT", ""), help="client certificate (mTLS)")
    security.add_argument("--tls-key", default=env("AGENTMW_TLS_CLIENT_KEY", ""), help="its private key")
    security.add_argument("--tls-server-name", default="", help="the name the host's certificate carries")
    security.add_argument("--token-file", help="a file holding the bearer token (else env AGENTMW_TOKEN)")
    args = parser.parse_args(argv)
    if args.schema is not None and args.message is None:
        parser.error("--schema goes with --message")
    schema = _schema(parser, args.schema) if args.schema is not None else None
    view = View(audio_dir=args.audio_dir)
    view.player = Player.find() if args.play else None
    if args.play and view.player is None:
        print("agent-chat: --play: no player found (aplay, paplay, ffplay); audio is only saved", file=sys.stderr)
    session_id = args.session
    try:
        parked = asyncio.run(_parked(args, session_id)) if session_id else {}
        non_interactive = args.message is not None or args.yes or args.deny or args.external_result is not None
        if non_interactive:
            if not parked and args.message is None:
                print(f"agent-chat: session {session_id or '(new)'} waits on nothing; give --message")
                return 0
            if parked:  # answer what the session waits on first
                turn = asyncio.run(_turn(args, session_id, None, view, interactive=False, **parked))
                if turn.parked or args.message is None:
                    return _report(turn)
            turn = asyncio.run(
                _turn(args, session_id, UserMsg(args.message), view, interactive=False, structured_schema=schema)
            )
            if turn.final is not None and turn.final.structured_output is not None:
                print(json.dumps(turn.final.structured_output, indent=2, ensure_ascii=False), flush=True)
            used = _usage(turn)
            if any(used):
                print(f"({used[0]} tokens in, {used[1]} out)", file=sys.stderr)
            print(f"(session {turn.session_id})", file=sys.stderr)
            return _report(turn)
        return _interactive(args, session_id, parked, view)
    except UnknownSession:
        print(f"agent-chat: no session {session_id} on {args.host}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print()
        return 130
    except grpc.aio.AioRpcError as exc:
        print(f"agent-chat: {args.host}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except SecurityError as exc:
        print(f"agent-chat: {exc}", file=sys.stderr)
        return 2
    finally:
        if view.player is not None:
            view.player.close()


if __name__ == "__main__":
    sys.exit(main())
