"""Structured output through the host service: ``StartReply.structured_schema`` and ``agent-chat --schema``.

A real host process on loopback port 0 with a temporary SQLite db (stopped in teardown); the CLI
runs as ``python -m clients.chat``; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from agentmw.data import (
    ConfirmResult,
    Msg,
    ReplyEndEvent,
    ReplyFinishedReason,
    RequireUserConfirmEvent,
    ToolResultEndEvent,
    ToolResultState,
    UserConfirmResultEvent,
    UserInterruptEvent,
    UserMsg,
    new_id,
)
from agentmw.v1 import host_pb2
from clients.chat import HostClient
from clients.launch import ServerProcess

from .host_util import chat, configured_host, get_session, stub

pytestmark = pytest.mark.timeout(60)

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
SESSION = re.compile(r"^\(session ([0-9A-Za-z_-]+)\)$", re.M)  # what --message prints on stderr


def printed_json(stdout: str) -> Any:
    """The pretty JSON object agent-chat prints last on stdout (from its last line "{" on)."""
    lines = stdout.splitlines()
    starts = [i for i, line in enumerate(lines) if line == "{"]
    assert starts, f"no JSON object on stdout:\n{stdout}"
    return json.loads("\n".join(lines[starts[-1] :]))


def assert_person(value: Any, name: str, age: int) -> None:
    """The object the input implies, exactly (an age of 30.0 or "30" is not 30)."""
    assert value == {"name": name, "age": age}, value
    assert type(value["age"]) is int, value


async def _reply(address: str, session_id: str, inputs: Any, schema: dict[str, Any] | None) -> list[Any]:
    async with HostClient(address) as client:
        call = client.reply(session_id, inputs, schema)
        async with asyncio.timeout(20):
            return [item async for item in call]


async def _not_found(address: str, session_id: str) -> bool:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            await stub(channel).GetSession(host_pb2.GetSessionRequest(session_id=session_id), timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code() == grpc.StatusCode.NOT_FOUND
    return False


# ---------------------------------------------------------------------------------------------
# (a) agent-chat --schema: the structured output printed as JSON after the answer, and stored.


def test_chat_schema_prints_structured_output(host: ServerProcess) -> None:
    done = chat(host.address, "--message", "Alice is 30 years old", "--schema", json.dumps(PERSON))
    assert done.returncode == 0, done.stdout + done.stderr
    assert_person(printed_json(done.stdout), "Alice", 30)
    assert len(SESSION.findall(done.stderr)) == 1, done.stderr


async def test_reply_final_msg_carries_structured_output(host: ServerProcess) -> None:
    items = await _reply(host.address, "so-grpc", UserMsg("Carol is 25 years old"), PERSON)
    end = next(i for i in items if isinstance(i, ReplyEndEvent))
    assert end.finished_reason == ReplyFinishedReason.COMPLETED
    assert isinstance(items[-1], Msg)
    assert_person(items[-1].structured_output, "Carol", 25)
    info, _, _ = await get_session(host.address, "so-grpc")  # saved as usual
    assert not info.summary.parked and not info.replying


def test_chat_schema_from_file(host: ServerProcess, tmp_path: Path) -> None:
    path = tmp_path / "person.json"
    path.write_text(json.dumps(PERSON), encoding="utf-8")
    done = chat(host.address, "--message", "Bob is 41 years old", "--schema", f"@{path}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert_person(printed_json(done.stdout), "Bob", 41)


def test_chat_without_schema_prints_no_json(host: ServerProcess) -> None:
    done = chat(host.address, "--message", "Alice is 30 years old")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == ["You said: Alice is 30 years old"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--schema", json.dumps(PERSON)], "--schema goes with --message"),
        (["--message", "hi", "--schema", "{not json"], "not JSON"),
        (["--message", "hi", "--schema", "[1, 2]"], "a JSON schema is a JSON object"),
        (["--message", "hi", "--schema", "@/nonexistent/schema.json"], "cannot read it"),
    ],
)
def test_chat_schema_usage_errors(host: ServerProcess, args: list[str], says: str) -> None:
    done = chat(host.address, *args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert says in done.stderr


# ---------------------------------------------------------------------------------------------
# (b) a schema that is not a JSON schema of type object: INVALID_ARGUMENT, nothing stored.


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ({"type": 12}, "not a valid JSON schema"),
        ({"type": "object", "properties": {"age": {"minimum": "ten"}}}, "not a valid JSON schema"),
        ({"type": "string"}, '"type": "object"'),
        ({"properties": {"name": {"type": "string"}}}, '"type": "object"'),
        # before: accepted, and the reply ran its 15 model calls into a tool error each
        ({"type": "object", "properties": {"a": {"$ref": "#/defs/nope"}}}, "points to nothing in the schema"),
        ({"type": "object", "properties": {"a": {"$ref": "http://127.0.0.1:9/a.json"}}}, "is not within the schema"),
    ],
)
async def test_invalid_schema_refused_and_nothing_stored(
    host: ServerProcess, schema: dict[str, Any], says: str
) -> None:
    session = f"so-invalid-{new_id()}"
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _reply(host.address, session, UserMsg("Alice is 30 years old"), schema)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert says in refused.value.details()
    assert await _not_found(host.address, session)


def test_chat_invalid_schema_exit_1(host: ServerProcess) -> None:
    done = chat(host.address, "--message", "Alice is 30 years old", "--schema", '{"type": 12}')
    assert done.returncode == 1, done.stdout + done.stderr
    assert "INVALID_ARGUMENT" in done.stderr and "structured_schema" in done.stderr


# ---------------------------------------------------------------------------------------------
# (c) a schema with a resumption event: INVALID_ARGUMENT, the parked reply left as it was.


async def test_schema_with_resumption_event_refused(host: ServerProcess) -> None:
    items = await _reply(host.address, "so-parked", UserMsg("email bob@example.com saying hi"), None)
    asks = [i for i in items if isinstance(i, RequireUserConfirmEvent)]
    assert asks, items
    reply_id = items[-1].id
    call = asks[0].tool_calls[0]
    allow = UserConfirmResultEvent(reply_id=reply_id, confirm_results=[ConfirmResult(confirmed=True, tool_call=call)])

    for event in (allow, UserInterruptEvent(reply_id=reply_id)):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _reply(host.address, "so-parked", event, PERSON)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
        assert "only with a new message" in refused.value.details()

    # Nothing changed: still parked on the same call; the answer without a schema resumes it.
    info, state, _ = await get_session(host.address, "so-parked")
    assert info.summary.parked and [c.id for c in info.pending_tool_calls] == [call.id]
    assert state.reply_context.structured_schema is None
    items = await _reply(host.address, "so-parked", allow, None)
    end = next(i for i in items if isinstance(i, ReplyEndEvent))
    assert end.finished_reason == ReplyFinishedReason.COMPLETED and end.reply_id == reply_id
    assert isinstance(items[-1], Msg) and items[-1].structured_output is None

    # Refused before the session is looked up: an unknown session stays unknown.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _reply(host.address, "so-unknown", allow, PERSON)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await _not_found(host.address, "so-unknown")


# ---------------------------------------------------------------------------------------------
# (d) a structured output that does not fit the schema: refused as the tool's input, asked again.

# The offline model's tool rules apply while the user's turn has no tool results: its first call
# is this invalid object; after the refusal it fills the schema from the user's words.
INVALID_FIRST = """
models:
  default: main
  models:
    main:
      provider: offline
      rules:
        - {pattern: "thirty", tool: GenerateStructuredOutput, input: {name: Alice, age: thirty}}
"""


@pytest.fixture(scope="module")
def invalid_first_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with configured_host(tmp_path_factory.mktemp("invalid-first-host"), INVALID_FIRST) as host:
        yield host


async def test_invalid_structured_output_is_refused_then_generated_again(invalid_first_host: ServerProcess) -> None:
    address = invalid_first_host.address
    items = await _reply(address, "so-retry", UserMsg("Alice is 30 (thirty) years old"), PERSON)
    results = [i for i in items if isinstance(i, ToolResultEndEvent)]
    assert [r.state for r in results] == [ToolResultState.ERROR, ToolResultState.SUCCESS]
    end = next(i for i in items if isinstance(i, ReplyEndEvent))
    assert end.finished_reason == ReplyFinishedReason.COMPLETED
    assert_person(items[-1].structured_output, "Alice", 30)
    # The model was told why: the schema's complaint is in the refused call's result.
    _, state, _ = await get_session(address, "so-retry")
    outputs = [b.output for m in state.context for b in m.content if getattr(b, "type", "") == "tool_result"]
    refusal = outputs[0] if isinstance(outputs[0], str) else "".join(getattr(x, "text", "") for x in outputs[0])
    assert "invalid input for tool 'GenerateStructuredOutput'" in refusal and "'thirty'" in refusal, refusal
