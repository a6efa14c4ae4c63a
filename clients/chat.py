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

This module is the command line; talking to the host is clients/host_client.py (``HostClient``,
``converse``), showing a reply clients/chat_view.py (``View``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import signal
import sys
from pathlib import Path
from typing import Any

import grpc

from agent_host.security import SecurityError
from agentmw.codec import codec
from agentmw.data import (
    ReplyFinishedReason,
    ToolCallBlock,
    ToolResultBlock,
    ToolResultState,
    UserMsg,
    new_id,
)
from agentmw.data.events import ConfirmResult
from agentmw.v1 import host_pb2
from clients.chat_view import Player, View
from clients.host_client import (
    DEFAULT_HOST,
    MAX_CONFIRMS,
    CommandLine,
    ConfirmAnswer,
    ExternalAnswer,
    HostClient,
    ReplyCall,
    Turn,
    add_security_arguments,
    converse,
    credentials,
    tls_note,
)

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
        async with HostClient(args.host, *credentials(args)) as client:
            return await converse(
                client,
                session_id,
                inputs,
                on_item=view.show,
                on_confirm=on_confirm,
                on_external=on_external,
                on_call=current.append,
                structured_schema=structured_schema,
                refuse_if_busy=args.no_wait,
                **resume,
            )
    except grpc.aio.AioRpcError as exc:
        answered = [c for c in current if c.answered]
        if answered:
            raise BrokenReply(exc, answered[-1].session_id) from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGINT)


class UnknownSession(Exception):
    pass


class BrokenReply(Exception):
    """A reply failed after the host had accepted it (e.g. the host died), which its first
    ReplyEvent tells: the connection worked, so TLS is no suspect, and the session keeps what was
    stored, so its id is worth printing."""

    def __init__(self, error: grpc.aio.AioRpcError, session_id: str) -> None:
        super().__init__(error.details())
        self.error, self.session_id = error, session_id

    def why(self) -> str:
        """What broke, for the user. UNAVAILABLE once the stream had begun is the host gone (killed,
        restarting, draining) or the connection lost, whose details ("Socket closed") do not say so;
        or the host's own outage (its store), which its details name."""
        what = f"{self.error.code().name}: {self.error.details()}"
        if self.error.code() is grpc.StatusCode.UNAVAILABLE:
            return f"the reply broke off: the host went away or could not go on ({what})"
        return f"the reply broke off ({what})"


async def _parked(args: argparse.Namespace, session_id: str) -> dict[str, Any]:
    """What a session is parked on, as ``converse`` resume arguments ({} when it is not)."""
    async with HostClient(args.host, *credentials(args)) as client:
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


def _audio_dir(parser: argparse.ArgumentParser, text: str) -> Path:
    """``--audio-dir``: a directory, or one that can be made under its nearest existing parent (it
    is made when audio first arrives, so that a chat without audio leaves nothing behind)."""
    path = Path(text)
    existing = next((p for p in (path, *path.parents) if p.exists()), path)  # "." or "/" at the latest
    if not existing.is_dir():
        parser.error(f"--audio-dir {text}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        parser.error(f"--audio-dir {text}: {existing} is not writable")
    return path


def _report(turn: Turn) -> int:
    if turn.asked_again:
        names = ", ".join(sorted({c.name for c in turn.asked_again}))
        print(
            f"  (the host asked again for {names} after each of {MAX_CONFIRMS} confirmations: a permission"
            " middleware asks for every call, confirmed ones too; stopped answering)"
        )
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


async def _check_host(args: argparse.Namespace) -> str:
    """The host's health (SERVING / NOT_SERVING); raises AioRpcError when it cannot be reached."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with HostClient(args.host, *credentials(args)) as client:  # TLS as the replies will use it
        reply = await health_pb2_grpc.HealthStub(client.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def _sessions(args: argparse.Namespace, current: str) -> str:
    async with HostClient(args.host, *credentials(args)) as client:
        found = await client.stub.ListSessions(host_pb2.ListSessionsRequest(limit=20), timeout=10)
    rows = [
        f"  {'*' if s.session_id == current else ' '} {s.session_id}  {s.updated_at}  {s.title}" for s in found.sessions
    ]
    return "\n".join(rows) or "  (no sessions)"


def _failure(args: argparse.Namespace, exc: grpc.aio.AioRpcError | BrokenReply) -> str:
    if isinstance(exc, BrokenReply):  # it had connected: no TLS hint
        return f"{args.host}: {exc.why()}"
    return f"{args.host}: {exc.code().name}: {exc.details()}{tls_note(exc, args)}"


def _interactive(args: argparse.Namespace, session_id: str, parked: dict[str, Any], view: View) -> int:
    """The chat loop. Returns the exit status: 1 if the last reply failed (or could not be sent)."""
    try:
        health = asyncio.run(_check_host(args))
    except grpc.aio.AioRpcError as exc:
        print(
            f"agent-chat: cannot reach the host at {args.host} ({exc.code().name}{tls_note(exc, args, '; {}')})",
            file=sys.stderr,
        )
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
                        print(asyncio.run(_sessions(args, session_id)))
                    except grpc.aio.AioRpcError as exc:
                        print(f"agent-chat: {_failure(args, exc)}", file=sys.stderr)
                else:
                    print(f"unknown command {text.split()[0]}; /help lists them (a message cannot start with /)")
                continue
            if not text:
                continue
            try:
                turn = asyncio.run(_turn(args, session_id, UserMsg(text), view, interactive=True))
            except BrokenReply as exc:  # begun, so stored in part: not "not answered"; the chat goes on
                sid = exc.session_id
                print(
                    f"agent-chat: {_failure(args, exc)}; session {sid} keeps what was stored: once the host"
                    f" is back, go on here or with agent-chat --session {sid}"
                )
                status = 1
                continue
            except grpc.aio.AioRpcError as exc:  # e.g. the host restarting: the chat goes on
                print(f"agent-chat: {_failure(args, exc)} (not answered; try again)")
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
    parser = CommandLine(prog="agent-chat", description="Chat with a running agentmw host.")
    parser.add_argument(
        "--host",
        default=os.environ.get("AGENTMW_HOST", DEFAULT_HOST),
        help=f"the host's address (default {DEFAULT_HOST}; env AGENTMW_HOST)",
    )
    parser.add_argument("--session", default="", help="continue this session (default: a new one)")
    parser.add_argument("--message", "-m", help="send this one message, print the reply and exit")
    parser.add_argument(
        "--no-wait",
        action="store_true",
        help="when the session is busy with another reply (on any host), fail at once instead of waiting",
    )
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
    add_security_arguments(parser)
    args = parser.parse_args(argv)
    if args.schema is not None and args.message is None:
        parser.error("--schema goes with --message")
    schema = _schema(parser, args.schema) if args.schema is not None else None
    view = View(audio_dir=_audio_dir(parser, args.audio_dir))
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
        print(f"agent-chat: {_failure(args, exc)}", file=sys.stderr)
        return 1
    except BrokenReply as exc:  # the session holds what the reply stored: say which, to go on with it
        print(f"agent-chat: {_failure(args, exc)}", file=sys.stderr)
        print(f"(session {exc.session_id})", file=sys.stderr)
        return 1
    except SecurityError as exc:
        print(f"agent-chat: {exc}", file=sys.stderr)
        return 2
    finally:
        if view.player is not None:
            view.player.close()


if __name__ == "__main__":
    sys.exit(main())
