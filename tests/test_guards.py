"""Guards of the remote protocol that only show when a middleware server misbehaves or restarts:
one key per slot, a key that must not change, a prompt cache that sees the slot, idle streams of a
dead server, and the context sent only to hooks that asked for it. Real processes throughout
(tests/guard_mw.py); every wait is bounded."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from agent_host.agent import Agent
from agent_host.models import OfflineRuleModel
from agent_host.remote import Policy, RemoteMiddleware
from agentmw.data import Msg, ReplyEndEvent, ReplyFinishedReason, UserMsg
from agentmw.v1 import host_pb2
from clients.launch import ServerProcess, middleware_server

from .host_util import KEY, processes, stub

pytestmark = pytest.mark.timeout(60)


def keyed(key: str, port: int = 0) -> ServerProcess:
    """tests.guard_mw:Keyed reporting ``key``; on ``port`` to stand in for a restart."""
    proc = middleware_server("tests.guard_mw:Keyed", key=key)
    proc.port = port
    return proc.start()


@pytest.fixture
def servers() -> Iterator[list[ServerProcess]]:
    """Processes a test starts go in here; all are stopped at the end."""
    started: list[ServerProcess] = []
    yield started
    for proc in started:
        proc.stop()


async def reply(agent: Agent, text: str) -> tuple[ReplyEndEvent, Msg]:
    async with asyncio.timeout(30):
        items = [item async for item in agent.reply_stream(UserMsg(text))]
    ends = [i for i in items if isinstance(i, ReplyEndEvent)]
    assert len(ends) == 1 and isinstance(items[-1], Msg), items
    return ends[0], items[-1]


async def second_refused(host: ServerProcess, first: ServerProcess, second: ServerProcess) -> grpc.aio.AioRpcError:
    """Attach ``first`` as "one", then ``second`` as "two", which must be refused; "one" stays alone."""
    async with grpc.aio.insecure_channel(host.address) as channel:
        host_stub = stub(channel)
        attach = host_pb2.AttachMiddlewareRequest
        await host_stub.AttachMiddleware(attach(address=first.address, name="one"), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await host_stub.AttachMiddleware(attach(address=second.address, name="two"), timeout=10)
        listed = await host_stub.ListMiddleware(host_pb2.ListMiddlewareRequest(), timeout=5)
    assert [m.name for m in listed.middleware] == ["one"]
    return refused.value


async def test_two_servers_with_one_key_cannot_both_attach(tmp_path: Path) -> None:
    """One key is one middle_context slot: a second server reporting it is refused at attach."""
    with processes(tmp_path) as procs:
        first, second = procs.recorder(), procs.recorder()  # both report the key "recorder"
        refused = await second_refused(procs.host(tmp_path / "sessions.db"), first, second)
    assert refused.code() == grpc.StatusCode.ALREADY_EXISTS
    assert f"reports key {KEY!r}, already used by middleware 'one'" in (refused.details() or "")


async def test_a_restarted_middleware_with_another_key_is_refused(servers: list[ServerProcess]) -> None:
    """The slot a middleware owns is fixed at attach: after a restart it must report the same key."""
    servers.append(keyed("one"))
    # timeout: what the reply while it is down waits for it to come back
    remote = await RemoteMiddleware(servers[0].address, policy=Policy(timeout=2)).connect()
    agent = Agent(model=OfflineRuleModel(), middlewares=[remote])
    try:
        end, _ = await reply(agent, "first")
        assert end.finished_reason == ReplyFinishedReason.COMPLETED
        assert agent.state.middle_context == {"one": {"replies": 1}}

        servers[0].kill()
        end, _ = await reply(agent, "while it is down")  # fails: the next call describes again
        assert end.finished_reason == ReplyFinishedReason.ERROR
        servers.append(keyed("two", port=servers[0].port))
        assert await remote.wait_ready(5)
        end, _ = await reply(agent, "after the restart")
        assert end.finished_reason == ReplyFinishedReason.ERROR
        assert "key changed from 'one' to 'two'" in end.error.message
        assert agent.state.middle_context == {"one": {"replies": 1}}  # nothing under the new key
    finally:
        await remote.close()


async def test_idle_streams_of_a_restarted_middleware_are_not_reused(servers: list[ServerProcess]) -> None:
    """No reply failed in between, so nothing dropped the idle stream: the host must see it ended."""
    servers.append(keyed("keyed"))
    remote = await RemoteMiddleware(servers[0].address, policy=Policy(timeout=5)).connect()
    agent = Agent(model=OfflineRuleModel(), middlewares=[remote])
    try:
        assert (await reply(agent, "first"))[0].finished_reason == ReplyFinishedReason.COMPLETED
        assert len(remote.idle["on_reply"]) == 1  # the stream waits for the next invocation
        servers[0].restart()  # same port, same key
        assert await remote.wait_ready(5)
        end, msg = await reply(agent, "after the restart")
        assert end.finished_reason == ReplyFinishedReason.COMPLETED, end.error
        assert msg.text == "You said: after the restart"
        assert agent.state.middle_context == {"keyed": {"replies": 2}}
    finally:
        await remote.close()


async def test_system_prompt_cache_sees_the_slot(servers: list[ServerProcess]) -> None:
    """The prompt is built twice per iteration; the slot changes in between (in on_reasoning): the
    second, the one the model gets, must be built with the new slot, not taken from the cache."""
    servers.append(middleware_server("tests.guard_mw:SlotPrompt").start())
    remote = await RemoteMiddleware(servers[0].address, policy=Policy(timeout=5)).connect()
    agent = Agent(model=OfflineRuleModel(reply_template="{system}"), middlewares=[remote])
    try:
        end, msg = await reply(agent, "hi")
        assert end.finished_reason == ReplyFinishedReason.COMPLETED, end.error
        assert msg.text == "You are a helpful assistant. [slot: reasoning 0]"
    finally:
        await remote.close()


async def test_wants_context_sends_the_context(servers: list[ServerProcess]) -> None:
    servers.append(middleware_server("tests.guard_mw:ContextReader").start())
    remote = await RemoteMiddleware(servers[0].address, policy=Policy(timeout=5)).connect()
    agent = Agent(model=OfflineRuleModel(), middlewares=[remote])
    try:
        for text in ("first", "second"):
            end, _ = await reply(agent, text)
            assert end.finished_reason == ReplyFinishedReason.COMPLETED, end.error
        # At the second ReplyStartEvent: the first turn and the new user message.
        assert agent.state.middle_context["ContextReader"] == ["first", "You said: first", "second"]
    finally:
        await remote.close()


async def test_a_middleware_restarted_between_replies_is_described_again(servers: list[ServerProcess]) -> None:
    """As above, but no reply ran while it was down: the restart alone must lead to a new Describe."""
    servers.append(keyed("one"))
    remote = await RemoteMiddleware(servers[0].address, policy=Policy(timeout=5)).connect()
    agent = Agent(model=OfflineRuleModel(), middlewares=[remote])
    try:
        assert (await reply(agent, "first"))[0].finished_reason == ReplyFinishedReason.COMPLETED
        servers[0].kill()
        servers.append(keyed("two", port=servers[0].port))
        assert await remote.wait_ready(5)
        end, _ = await reply(agent, "after the restart")
        assert end.finished_reason == ReplyFinishedReason.ERROR
        assert "key changed from 'one' to 'two'" in end.error.message
    finally:
        await remote.close()


def test_servers_listen_below_the_ephemeral_range_so_a_restart_finds_their_port_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server that picked port 0 got one from the kernel's ephemeral range; once it was killed,
    that port could become the source port of any outgoing connection (a reconnect attempt to it
    even connects to itself), and the restart on it failed to bind (a guard test failed so once).
    The launcher picks ports below that range, and picks another when one is taken between its
    probe and the child's bind."""
    from clients import launch

    low = launch._ephemeral_low()
    assert all(1024 <= launch.unused_port() < low for _ in range(20))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        free = launch.unused_port()
        chosen = iter([taken.getsockname()[1], free])
        monkeypatch.setattr(launch, "unused_port", lambda: next(chosen))
        proc = ServerProcess(["-m", "tests.raw_mw", "garbage", "--address", "127.0.0.1:{port}"]).start()
    try:
        assert proc.port == free
        proc.kill()
        assert proc.restart().port == free
    finally:
        proc.stop()


async def test_the_tools_of_all_middleware_together_fit_in_a_model_request(tmp_path: Path) -> None:
    """Each middleware may list up to 128 tools, but the model is offered all of them in every
    request: one that would bring the total past 128 is refused at attach (RESOURCE_EXHAUSTED,
    saying how many come from whom) and the host goes on with the others. Before, it was attached,
    and the provider then refused every model call of every reply."""
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"name": f"t{i}", "inputSchema": {"type": "object"}} for i in range(100)]))
    with processes(tmp_path) as procs:
        first, second = (procs.start(k, ["-m", "tests.evil_mw", "--tools", str(tools), "--key", k]) for k in ("a", "b"))
        refused = await second_refused(procs.host(tmp_path / "sessions.db"), first, second)
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.details() == (
        "the model would be offered 204 tools (the host's own: 4; one: 100, two: 100), "
        "and a model request takes at most 128"
    )
