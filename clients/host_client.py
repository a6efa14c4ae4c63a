"""Talking to an agent host: ``HostClient`` (a gRPC channel and the Reply stream), ``converse``
(one user turn and its resumptions, answering confirmations and external tools), ``Turn``.
Used by agent-chat (clients/chat.py) and clients.demo."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from agent_host.security import SecurityError, TlsFiles, client_channel, read_secret, tls_hint
from agentmw.codec import codec
from agentmw.data import (
    ExternalExecutionResultEvent,
    Msg,
    ReplyEndEvent,
    RequireExternalExecutionEvent,
    RequireUserConfirmEvent,
    ToolCallBlock,
    ToolCallState,
    ToolResultBlock,
    ToolResultEndEvent,
    UserConfirmResultEvent,
)
from agentmw.data.events import ConfirmResult
from agentmw.v1 import host_pb2, host_pb2_grpc

DEFAULT_HOST = "127.0.0.1:50070"


def add_security_arguments(parser: argparse.ArgumentParser) -> None:
    """How a client reaches a secured host (docs/security.md): agent-chat's and agentmw's flags.
    Their defaults are applied by ``credentials`` (argparse.SUPPRESS here), so that a parser
    shared by subcommands, as agentmw's, takes them before or after the command."""
    group = parser.add_argument_group("security (see docs/security.md)")
    hidden = argparse.SUPPRESS
    group.add_argument("--tls-ca", default=hidden, help="connect over TLS, trusting this CA (env AGENTMW_TLS_CA)")
    group.add_argument("--tls-cert", default=hidden, help="client certificate, mTLS (env AGENTMW_TLS_CLIENT_CERT)")
    group.add_argument("--tls-key", default=hidden, help="its private key (env AGENTMW_TLS_CLIENT_KEY)")
    group.add_argument("--tls-server-name", default=hidden, help="the name the host's certificate carries")
    group.add_argument("--token-file", default=hidden, help="a file holding the bearer token (else env AGENTMW_TOKEN)")
    # A token given on the command line is refused without being repeated (it would be in the
    # error, as argparse quotes what it does not take; an abbreviation would read it as a file).
    group.add_argument("--token", nargs="?", action=_NoTokenHere, default=hidden, help=hidden)


class CommandLine(argparse.ArgumentParser):
    """agent-chat's and agentmw's parser (their subcommands' too): no abbreviations (``--tok``
    is not ``--token-file``), and an error never repeats what followed an option that looks like
    a misspelt token flag (argparse quotes what it does not take: ``unrecognized arguments: --tok
    SECRET``, ``invalid choice: 'SECRET'``)."""

    argv: list[str] = []  # the whole command line under way, for error() of whichever parser fails
    parsing = False  # a subcommand's parser runs inside its parent's parse

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if CommandLine.parsing:
            return super().parse_known_args(args, namespace)
        CommandLine.argv, CommandLine.parsing = list(sys.argv[1:] if args is None else args), True
        try:
            return super().parse_known_args(args, namespace)
        finally:
            CommandLine.parsing = False

    def error(self, message: str) -> Any:
        for secret in _secrets(CommandLine.argv):
            message = message.replace(secret, "***")
        super().error(message)


def _secrets(argv: list[str]) -> list[str]:
    """Words that may be a token: the value of any option that looks like a misspelt ``--token``
    (``--tok``, ``--tokne``, ``-Token``, ``--token_file``: an option whose letters begin with "to"
    and hold a "k"), given after it or after ``=``."""
    found = []
    for i, word in enumerate(argv):
        name, eq, value = word.partition("=")
        letters = name.lstrip("-").lower()
        if name.startswith("-") and letters.startswith("to") and "k" in letters:
            if eq:
                found.append(value)
            elif i + 1 < len(argv):
                found.append(argv[i + 1])
    return [f for f in found if f]


class _NoTokenHere(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        parser.error(
            "--token: a token is never given on the command line (others can read it): "
            "use --token-file FILE or the environment variable AGENTMW_TOKEN"
        )


def credentials(args: argparse.Namespace) -> tuple[TlsFiles, str]:
    """The TLS files and the token of ``add_security_arguments``' flags (the token from
    AGENTMW_TOKEN or --token-file: never a command-line argument, which others can read in ps).
    Raises SecurityError for a token file that cannot be read."""

    def flag(name: str, env: str = "") -> str:
        return getattr(args, name, "") or (os.environ.get(env, "") if env else "")

    tls = TlsFiles(
        cert=flag("tls_cert", "AGENTMW_TLS_CLIENT_CERT"),
        key=flag("tls_key", "AGENTMW_TLS_CLIENT_KEY"),
        ca=flag("tls_ca", "AGENTMW_TLS_CA"),
        server_name=flag("tls_server_name"),
    )
    token_file = flag("token_file")
    token = read_secret(file=token_file, where="--token-file") if token_file else ""
    token = token or os.environ.get("AGENTMW_TOKEN", "")
    if token and not (token.isascii() and token.isprintable() and " " not in token):  # else "Invalid metadata"
        where = "--token-file" if token_file else "AGENTMW_TOKEN"
        raise SecurityError(f"{where}: the token has characters a header cannot carry (one line, no spaces)")
    return tls, token


def tls_note(exc: Any, args: argparse.Namespace, form: str = " ({})") -> str:
    """What a call that could not reach the host may owe to TLS, in ``form``, to append to its
    error ("" when nothing points there): a mismatch says only "Socket closed", and a user would
    look for a host that is down. ``exc``: a grpc (or grpc.aio) RpcError."""
    tls, _ = credentials(args)
    hint = tls_hint(exc.details(), tls.enabled, use_tls="--tls-ca", client_cert="--tls-cert, --tls-key")
    return form.format(hint) if hint else ""


class HostClient:
    """An AgentHost connection (one channel); ``reply()`` starts one Reply call."""

    def __init__(self, address: str, tls: TlsFiles | None = None, token: str = "") -> None:
        self.address = address
        self.channel = client_channel(address, tls, token)  # TLS / token when the host requires them
        self.stub = host_pb2_grpc.AgentHostStub(self.channel)

    def reply(
        self,
        session_id: str,
        inputs: Any,
        structured_schema: dict[str, Any] | None = None,
        *,
        refuse_if_busy: bool = False,
    ) -> ReplyCall:
        return ReplyCall(self.stub, session_id, inputs, structured_schema, refuse_if_busy=refuse_if_busy)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> HostClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


class ReplyCall:
    """One reply: iterate it for its items (events, then the final Msg); ``cancel()`` interrupts.
    ``structured_schema`` (with a message only): a JSON schema the final Msg's structured_output fills.
    ``refuse_if_busy``: a session busy with another reply fails the call with ABORTED at once
    instead of waiting for it."""

    def __init__(
        self,
        stub: host_pb2_grpc.AgentHostStub,
        session_id: str,
        inputs: Any,
        structured_schema: dict[str, Any] | None = None,
        *,
        refuse_if_busy: bool = False,
    ) -> None:
        self.session_id = session_id
        # The host sent a ReplyEvent, which it does once it accepted the reply (host.proto): the
        # connection worked, and the session (session_id) holds the message.
        self.answered = False
        self._requests: asyncio.Queue[host_pb2.ReplyRequest | None] = asyncio.Queue()
        start = host_pb2.ReplyRequest()
        record = {
            "session_id": session_id,
            "input": inputs,
            "structured_schema": structured_schema,
            "refuse_if_busy": refuse_if_busy or None,
        }
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
                self.answered = True
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
    # Calls asked for again after every one of MAX_CONFIRMS confirmations (answering stopped).
    asked_again: list[ToolCallBlock] = field(default_factory=list)


# Confirmations of one call in one turn before ``converse`` stops answering: the host runs the
# permission chain again for a confirmed call (as AgentScope does), so a middleware that asks for
# every call, confirmed or not, would have the reply ask, and an answering client confirm, for ever.
MAX_CONFIRMS = 3


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
    refuse_if_busy: bool = False,
) -> Turn:
    """Run a reply (``inputs``: a message or a resumption event) and answer whatever it parks on,
    until it ends. ``inputs=None`` with ``parked_on``/``reply_id``: answer a reply parked earlier.
    ``structured_schema`` goes with the first call only (the message; the resumptions keep it);
    ``refuse_if_busy`` with every call (a busy session fails it with ABORTED instead of waiting)."""
    turn = Turn(session_id)
    pending = {c.id: c for c in parked_on}
    confirmed: Counter[str] = Counter()
    while True:
        if inputs is None:
            turn.asked_again = [
                c for c in pending.values() if c.state == ToolCallState.ASKING and confirmed[c.id] >= MAX_CONFIRMS
            ]
            if not turn.asked_again:
                inputs = await answer(list(pending.values()), reply_id, on_confirm, on_external)
            if inputs is None:
                turn.parked = bool(pending)
                return turn
            if isinstance(inputs, UserConfirmResultEvent):
                confirmed.update(r.tool_call.id for r in inputs.confirm_results if r.confirmed)
        call = client.reply(turn.session_id, inputs, structured_schema, refuse_if_busy=refuse_if_busy)
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
