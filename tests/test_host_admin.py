"""Ending and removing sessions through the host service: a UserInterruptEvent for a parked reply,
and DeleteSession. One host process for the module (conftest ``host``); every wait is bounded."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from agentmw.data import (
    Msg,
    ReplyEndEvent,
    ReplyFinishedReason,
    RequireUserConfirmEvent,
    ToolCallState,
    ToolResultEndEvent,
    ToolResultState,
    UserInterruptEvent,
    UserMsg,
)
from agentmw.v1 import host_pb2
from clients.chat import HostClient
from clients.launch import ServerProcess

from .host_util import get_session, stub

pytestmark = pytest.mark.timeout(60)


async def _reply(address: str, session_id: str, inputs: Any) -> list[Any]:
    async with HostClient(address) as client:
        async with asyncio.timeout(20):
            return [item async for item in client.reply(session_id, inputs)]


async def _park(address: str, session_id: str) -> str:
    """A reply parked on the confirmation of send_email; its reply id."""
    items = await _reply(address, session_id, UserMsg("email bob@example.com saying hi"))
    assert any(isinstance(i, RequireUserConfirmEvent) for i in items), items
    info, _, _ = await get_session(address, session_id)
    assert info.summary.parked
    return items[-1].id


async def test_user_interrupt_ends_a_parked_reply(host: ServerProcess) -> None:
    reply_id = await _park(host.address, "admin-interrupt")
    items = await _reply(host.address, "admin-interrupt", UserInterruptEvent(reply_id=reply_id))
    end = next(i for i in items if isinstance(i, ReplyEndEvent))
    assert end.finished_reason == ReplyFinishedReason.INTERRUPTED and end.reply_id == reply_id
    assert [r.state for r in items if isinstance(r, ToolResultEndEvent)] == [ToolResultState.INTERRUPTED]
    assert isinstance(items[-1], Msg) and items[-1].finished_reason == ReplyFinishedReason.INTERRUPTED

    # Saved: no longer parked, the email call closed (never sent), and the session goes on.
    info, state, _ = await get_session(host.address, "admin-interrupt")
    assert not info.summary.parked and not info.pending_tool_calls
    blocks = [b for m in state.context for b in m.content]
    calls = [b for b in blocks if getattr(b, "type", "") == "tool_call"]
    results = [b for b in blocks if getattr(b, "type", "") == "tool_result"]
    assert [(c.name, c.state) for c in calls] == [("send_email", ToolCallState.FINISHED)]
    assert [(r.id, r.state) for r in results] == [(calls[0].id, ToolResultState.INTERRUPTED)]
    items = await _reply(host.address, "admin-interrupt", UserMsg("hello again"))
    assert items[-1].text == "You said: hello again"

    # With nothing parked any more, another interrupt is refused.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _reply(host.address, "admin-interrupt", UserInterruptEvent(reply_id=reply_id))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "has no parked reply" in (refused.value.details() or "")


async def test_delete_session(host: ServerProcess) -> None:
    await _park(host.address, "admin-delete")  # a parked session can be deleted too
    await _reply(host.address, "admin-keep", UserMsg("keep me"))
    async with grpc.aio.insecure_channel(host.address) as channel:
        host_stub = stub(channel)
        delete = host_pb2.DeleteSessionRequest
        assert (await host_stub.DeleteSession(delete(session_id="admin-delete"), timeout=10)).deleted
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await host_stub.GetSession(host_pb2.GetSessionRequest(session_id="admin-delete"), timeout=10)
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND
        listed = await host_stub.ListSessions(host_pb2.ListSessionsRequest(), timeout=10)
        ids = {s.session_id for s in listed.sessions}
        assert "admin-delete" not in ids and "admin-keep" in ids
        # Deleting again (or an unknown session) deletes nothing and says so.
        assert not (await host_stub.DeleteSession(delete(session_id="admin-delete"), timeout=10)).deleted

    # The id is free again: a new message starts a new conversation under it.
    await _reply(host.address, "admin-delete", UserMsg("fresh start"))
    _, state, _ = await get_session(host.address, "admin-delete")
    assert [m.text for m in state.context] == ["fresh start", "You said: fresh start"]
    _, state, _ = await get_session(host.address, "admin-keep")
    assert [m.text for m in state.context] == ["keep me", "You said: keep me"]
