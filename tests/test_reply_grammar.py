"""Only well-formed replies reach a client: a real middleware process forges items into a reply
(tests/forger_mw.py) and the host must end that reply with ReplyEndEvent(ERROR) naming what was
wrong, keep the session consistent, and store what happened. Also: undecodable requests to the
AgentHost service are INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from agent_host.agent import Agent
from agent_host.models import OfflineRuleModel
from agent_host.remote import Policy, RemoteMiddleware
from agentmw.data import (
    CustomEvent,
    Msg,
    ReplyEndEvent,
    ReplyFinishedReason,
    ReplyStartEvent,
    Role,
    ToolCallBlock,
    ToolResultBlock,
    UserMsg,
)
from agentmw.tools import Toolkit
from clients.chat import HostClient
from clients.launch import ServerProcess

from .harness import add
from .host_util import get_session, kinds, processes

pytestmark = pytest.mark.timeout(60)

# mode -> what the error must say
FORGERIES = {
    "confirm_unknown": "RequireUserConfirmEvent for tool calls ['no-such-call'] that are not awaiting it",
    "second_end": "a second ReplyEndEvent",
    "foreign_start": "the ReplyStartEvent carries reply id 'another-reply', not this reply's",
    "stray_delta": "TextBlockDeltaEvent: text block 'nowhere' was never started",
    "foreign_delta": "TextBlockDeltaEvent of reply 'another-reply' in reply",
    "start_twice": "was already started",
    "left_open": "ReplyEndEvent with blocks still open: text block 'dangling'",
    "no_next": "the reply ended without a ReplyEndEvent and a final Msg",
}

# An oracle independent of the host's checker: event class name -> (block kind, op).
_BLOCKS = {
    **{
        f"{kind}{op}Event": (kind, op)
        for kind in ("TextBlock", "ThinkingBlock", "DataBlock", "ToolCall", "ToolResult")
        for op in ("Start", "Delta", "End")
    },
    "ToolResultTextDeltaEvent": ("ToolResult", "Delta"),
    "ToolResultDataDeltaEvent": ("ToolResult", "Delta"),
}


def assert_well_formed(items: list) -> ReplyEndEvent:
    """One start first, one reply id, balanced blocks, one ReplyEndEvent right before the final
    Msg. Returns the end."""
    assert isinstance(items[0], ReplyStartEvent), kinds(items)
    reply_id = items[0].reply_id
    assert isinstance(items[-1], Msg) and isinstance(items[-2], ReplyEndEvent), kinds(items)
    assert kinds(items).count("ReplyStartEvent") == 1 and kinds(items).count("ReplyEndEvent") == 1
    open_blocks: set[tuple[str, str]] = set()
    for item in items[:-1]:
        if isinstance(item, CustomEvent):
            continue
        assert item.reply_id == reply_id, item
        kind, op = _BLOCKS.get(type(item).__name__, (None, None))
        if kind is None:
            continue
        key = (kind, item.tool_call_id if kind.startswith("Tool") else item.block_id)
        if op == "Start":
            assert key not in open_blocks, item
            open_blocks.add(key)
        elif op == "Delta":
            assert key in open_blocks, item
        else:
            open_blocks.remove(key)
    assert not open_blocks, open_blocks
    return items[-2]


async def reply(agent: Agent, text: str) -> list:
    async with asyncio.timeout(30):
        return [item async for item in agent.reply_stream(UserMsg(text))]


def all_calls_answered(agent: Agent) -> bool:
    blocks = [b for m in agent.state.context for b in m.content]
    calls = [b.id for b in blocks if isinstance(b, ToolCallBlock)]
    return calls == [b.id for b in blocks if isinstance(b, ToolResultBlock)]


@pytest.mark.parametrize("mode", sorted(FORGERIES))
async def test_a_forged_reply_ends_with_an_error(mode: str) -> None:
    proc = ServerProcess(["-m", "tests.forger_mw", mode, "--address", "127.0.0.1:0"]).start()
    try:
        remote = await RemoteMiddleware(proc.address, policy=Policy(timeout=5)).connect()
        agent = Agent(
            model=OfflineRuleModel(reply_template="one two three"), toolkit=Toolkit([add]), middlewares=[remote]
        )
        items = await reply(agent, "hi")
        end = assert_well_formed(items)
        assert end.finished_reason == ReplyFinishedReason.ERROR, kinds(items)
        assert "on_reply middleware 'Forger'" in end.error.message
        assert FORGERIES[mode] in end.error.message, end.error.message
        assert items[-1].error == end.error
        # The session is consistent: the failed reply's user message and its error, or nothing
        # when the reply never began; the next reply (forger detached) completes.
        context = agent.state.context
        if mode == "no_next":
            assert context == []
        else:
            assert [m.role for m in context] == [Role.USER, Role.ASSISTANT]
            assert context[-1].finished_reason == ReplyFinishedReason.ERROR and context[-1].error == end.error
        agent.set_middlewares([])
        items = await reply(agent, "again")
        assert assert_well_formed(items).finished_reason == ReplyFinishedReason.COMPLETED
        assert items[-1].text == "one two three"
        assert all_calls_answered(agent)
        await remote.close()
    finally:
        proc.stop()


async def test_a_failed_reply_is_stored_with_its_error(tmp_path: Path) -> None:
    """Through the host service: a fail_closed middleware breaks mid-reply; the stored session has
    the user message, then the error (and the next reply's model input stays valid)."""
    with processes(tmp_path) as procs:
        forger = procs.start("forger", ["-m", "tests.forger_mw", "second_end", "--address", "127.0.0.1:0"])
        host = procs.host(tmp_path / "sessions.db", "--middleware", f"forger={forger.address}")
        async with HostClient(host.address) as client:
            call = client.reply("", UserMsg("hello there"))
            items = [item async for item in call]
        end = assert_well_formed(items)
        assert end.finished_reason == ReplyFinishedReason.ERROR and "a second ReplyEndEvent" in end.error.message
        _, state, _ = await get_session(host.address, call.session_id)
        user, error = state.context
        assert (user.role, user.text) == (Role.USER, "hello there")
        assert error.role == Role.ASSISTANT and error.id == end.reply_id
        assert error.finished_reason == ReplyFinishedReason.ERROR and error.error == end.error
        assert "a second ReplyEndEvent" in error.text


async def test_undecodable_requests_are_invalid_argument(tmp_path: Path) -> None:
    """Bytes that are no request proto: INVALID_ARGUMENT (not UNKNOWN), for streams and unary calls."""
    with processes(tmp_path) as procs:
        host = procs.host(tmp_path / "sessions.db")
        garbage = b"\xff\xff\xff\xff not a protobuf"
        async with grpc.aio.insecure_channel(host.address) as channel:
            reply = channel.stream_stream("/agentmw.v1.AgentHost/Reply")
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in reply(iter([garbage]), timeout=10):
                    pass
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
            get = channel.unary_unary("/agentmw.v1.AgentHost/GetSession")
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await get(garbage, timeout=10)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
