"""Faults with real processes: a middleware that dies, hangs, lies or restarts.

The host must keep running, end the reply clearly (fail_closed: ReplyEndEvent(ERROR) naming the
middleware and hook; fail_open: the reply completes and records a bypass), keep the session
consistent, and use a restarted middleware again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest

from agent_host import metrics
from agent_host.agent import Agent
from agent_host.models import OfflineRuleModel
from agent_host.remote import Policy, RemoteMiddleware
from agent_host.remote.client import HANG_SESSIONS
from agent_host.remote.errors import MiddlewareFailure
from agent_host.remote.protocol import STOP_AFTER_INTERRUPT
from agentmw.data import (
    CustomEvent,
    DataBlockDeltaEvent,
    Msg,
    ReplyEndEvent,
    ReplyFinishedReason,
    Role,
    TextBlock,
    TextBlockDeltaEvent,
    ToolCallBlock,
    ToolResultBlock,
    UserMsg,
)
from agentmw.tools import Toolkit, add_middleware_tools, tool
from clients.launch import ServerProcess, middleware_server, unused_port

from .harness import add

ANSWER = "one two three four five six seven eight nine ten"
slow_started = asyncio.Event()


@tool(description="Takes a while.")
async def slow() -> str:
    slow_started.set()
    await asyncio.sleep(0.5)
    return "slow result"


async def reply(agent: Agent, text: str, *, kill: ServerProcess | None = None) -> list:
    """All items of a reply; with ``kill``, SIGKILL that process at the first text delta."""
    items = []
    async with asyncio.timeout(30):  # never a hung reply
        async for item in agent.reply_stream(UserMsg(text)):
            items.append(item)
            if kill is not None and isinstance(item, TextBlockDeltaEvent):
                kill.kill()
                kill = None
    return items


def end_of(items: list) -> ReplyEndEvent:
    ends = [i for i in items if isinstance(i, ReplyEndEvent)]
    assert len(ends) == 1, ends
    assert isinstance(items[-1], Msg)
    return ends[0]


async def noticed_gone(remote: RemoteMiddleware) -> None:
    """Until the host's channel has seen a killed server's connection close (bounded): the next
    call then finds it gone when it describes it again, not on a stream it still had open (a race
    that either way fails the call, with another error)."""
    async with asyncio.timeout(10):
        while remote.channel.get_state() is grpc.ChannelConnectivity.READY:
            await asyncio.sleep(0.01)


def bypasses(items: list) -> list[CustomEvent]:
    return [i for i in items if isinstance(i, CustomEvent) and i.name == "middleware_bypassed"]


def make_agent(remote: RemoteMiddleware, **model: object) -> Agent:
    return Agent(
        model=OfflineRuleModel(reply_template=ANSWER, delay=0.02, **model),
        toolkit=Toolkit([add]),
        middlewares=[remote],
    )


@contextlib.asynccontextmanager
async def attached(target: str, **policy: Any) -> AsyncIterator[RemoteMiddleware]:
    """tests.conformance_mw's ``target`` served in a process of its own and attached with ``policy``
    (both ended after)."""
    proc = middleware_server(f"tests.conformance_mw:{target}").start()
    try:
        remote = await RemoteMiddleware(proc.address, policy=Policy(**policy)).connect()
        try:
            yield remote
        finally:
            await remote.close()
    finally:
        proc.stop()


@pytest.fixture
def marker():
    proc = middleware_server("tests.conformance_mw:Marker").start()
    yield proc
    proc.stop()


@pytest.mark.parametrize("fail_open", [True, False], ids=["fail_open", "fail_closed"])
async def test_middleware_killed_mid_reply(marker: ServerProcess, fail_open: bool) -> None:
    remote = await RemoteMiddleware(marker.address, policy=Policy(fail_open=fail_open, timeout=5)).connect()
    agent = make_agent(remote)
    items = await reply(agent, "hi", kill=marker)
    end = end_of(items)
    if fail_open:
        assert end.finished_reason == ReplyFinishedReason.COMPLETED
        assert items[-1].text == ANSWER  # nothing lost
        (bypass,) = bypasses(items)
        assert bypass.value["middleware"] == "Marker" and bypass.value["hook"] == "on_reply"
    else:
        assert end.finished_reason == ReplyFinishedReason.ERROR
        assert "middleware 'Marker' failed in on_reply" in end.error.message
        assert items[-1].error == end.error
    # The session stays consistent: the user message, then this reply's answer or (fail_closed) its error.
    assert [m.role for m in agent.state.context] == [Role.USER, Role.ASSISTANT]
    if not fail_open:
        assert agent.state.context[-1].error == end.error
    assert all_calls_answered(agent)
    await remote.close()


async def test_a_fail_open_middleware_that_relays_the_text_and_dies_mid_block_leaves_the_whole_answer() -> None:
    """It passes the model's text block on as emits of its own (one item late) and dies in the
    middle of it: the block is the model's, which goes on with it, so the host does not end it for
    the middleware (a first version of the rule below did, and the model's next delta then broke
    the reply)."""
    async with attached("LagsThenDies", fail_open=True, timeout=5) as remote:
        items = await reply(make_agent(remote), "hi")
        assert end_of(items).finished_reason == ReplyFinishedReason.COMPLETED, end_of(items).error
        assert items[-1].text == ANSWER and len(bypasses(items)) == 1


async def test_a_fail_open_middleware_that_dies_mid_block_leaves_a_completed_reply() -> None:
    """It had started a block of its own (audio, as the TTS server does) when its process died:
    the host goes on without it and ends that block for it, so the reply completes with its answer.
    Before, the reply failed: 'ReplyEndEvent with blocks still open: data block', blamed on it."""
    async with attached("DiesMidBlock", fail_open=True, timeout=5) as remote:
        agent = make_agent(remote)
        items = await reply(agent, "hi")
        end = end_of(items)
        assert end.finished_reason == ReplyFinishedReason.COMPLETED, end.error
        assert items[-1].text == ANSWER
        audio = [i for i in items if getattr(i, "block_id", None) == "speech"]
        assert [type(i).__name__ for i in audio] == ["DataBlockStartEvent", "DataBlockDeltaEvent", "DataBlockEndEvent"]
        (bypass,) = bypasses(items)
        assert bypass.value["middleware"] == "DiesMidBlock"


@pytest.mark.parametrize("fail_open", [True, False], ids=["fail_open", "fail_closed"])
async def test_a_middleware_that_keeps_emitting_after_an_interrupt_is_left_behind(fail_open: bool) -> None:
    """The reply is interrupted while a middleware speaks on (audio deltas without end, as a TTS
    server reading a long text): STOP_AFTER_INTERRUPT later the reply ends without it, well formed
    (fail_open: its audio block ended for it, the bypass recorded; fail_closed: an error naming
    it). Before, the reply went on as long as the middleware did (a host cut it off after 5 s with
    no end at all)."""
    async with attached("SpeaksOn", fail_open=fail_open, timeout=5) as remote:
        agent = make_agent(remote)
        items: list[Any] = []
        interrupted = 0.0
        async with asyncio.timeout(20):
            async for item in agent.reply_stream(UserMsg("hi")):
                items.append(item)
                if isinstance(item, DataBlockDeltaEvent) and not interrupted:
                    agent.interrupt()
                    interrupted = time.monotonic()
        assert time.monotonic() - interrupted < STOP_AFTER_INTERRUPT + 1.5
        end = end_of(items)
        speech = [type(i).__name__ for i in items if getattr(i, "block_id", None) == "speech"]
        assert speech[-1] == "DataBlockEndEvent" and speech.count("DataBlockEndEvent") == 1
        said = f"it still sent items of its own {STOP_AFTER_INTERRUPT:g}s after the reply was interrupted"
        if fail_open:
            assert end.finished_reason != ReplyFinishedReason.ERROR, end.error
            (bypass,) = bypasses(items)
            assert bypass.value["middleware"] == "SpeaksOn" and said in bypass.value["error"]
        else:
            assert end.finished_reason == ReplyFinishedReason.ERROR and said in end.error.message
            assert "middleware 'SpeaksOn' failed in on_reply" in end.error.message


def all_calls_answered(agent: Agent) -> bool:
    blocks = [b for m in agent.state.context for b in m.content]
    calls = [b.id for b in blocks if isinstance(b, ToolCallBlock)]
    return calls == [b.id for b in blocks if isinstance(b, ToolResultBlock)]


async def test_killed_during_tool_round_closes_open_calls(marker: ServerProcess) -> None:
    """fail_closed while a tool call is open: the call gets an error result, never left dangling."""
    remote = await RemoteMiddleware(marker.address, policy=Policy(timeout=5)).connect()
    agent = make_agent(remote, script=[{"tool_calls": [{"name": "slow", "input": {}}]}])
    agent.toolkit.register(slow)
    task = asyncio.create_task(reply(agent, "go slow"))
    await asyncio.wait_for(slow_started.wait(), 10)  # the tool call is saved and running
    marker.kill()
    items = await task
    assert end_of(items).finished_reason == ReplyFinishedReason.ERROR
    assert any(isinstance(b, ToolCallBlock) for b in agent.state.context[-1].content)
    assert all_calls_answered(agent)  # the open call got an error result, never left dangling
    await remote.close()


@pytest.mark.parametrize("fail_open", [True, False], ids=["fail_open", "fail_closed"])
async def test_middleware_that_never_answers_times_out(fail_open: bool) -> None:
    async with attached("Sleeper", fail_open=fail_open, timeout=0.5) as remote:
        agent = make_agent(remote)
        items = await reply(agent, "hi")
        end = end_of(items)
        if fail_open:
            assert end.finished_reason == ReplyFinishedReason.COMPLETED and items[-1].text == ANSWER
            assert "no answer within 0.5s" in bypasses(items)[0].value["error"]
        else:
            assert end.finished_reason == ReplyFinishedReason.ERROR
            assert "middleware 'Sleeper' failed in on_reply: no answer within 0.5s (timeout)" in end.error.message


async def until(condition: Callable[[], object], seconds: float = 5.0) -> None:
    """Until ``condition()`` holds (bounded): e.g. the Describe after a hang has had its answer."""
    async with asyncio.timeout(seconds):
        while not condition():
            await asyncio.sleep(0.02)


async def test_a_fail_open_middleware_that_hangs_is_waited_for_once_then_skipped_for_a_while(
    marker: ServerProcess,
) -> None:
    """It hangs as a whole (SIGSTOP: connected, silent). A reply waits for its first hook call,
    then goes on without it for the rest of the reply (each hook call waited the timeout again:
    on_reasoning and on_model_call at every step). A Describe then gets no answer either, so the
    replies after it skip it at once for its timeout; then one tries it again, and the pause
    doubles."""
    remote = await RemoteMiddleware(marker.address, policy=Policy(fail_open=True, timeout=1)).connect()

    async def errors() -> list[str]:
        agent = make_agent(remote, script=[{"tool_calls": [{"name": "add", "input": {"a": 1, "b": 2}}]}])
        items = await reply(agent, "add")
        assert end_of(items).finished_reason == ReplyFinishedReason.COMPLETED
        assert items[-1].text == "Done: add returned 3."
        assert all_calls_answered(agent)
        return [f"{b.value['hook']}: {b.value['error']}" for b in bypasses(items)]

    os.kill(marker.pid, signal.SIGSTOP)
    try:
        (waited,) = await errors()  # waits 1 s; the Describe after it waits 1 s more, then skips it for 1 s
        assert waited.startswith("on_reply: ") and "no answer within 1s (timeout)" in waited
        await until(remote.skipped)
        (skipped,) = await errors()  # at once: no wait for it
        assert "skipped for" in skipped and "after: no answer within 1s" in skipped
        await until(lambda: not remote.skipped())  # the pause is over: the next reply tries it again
        (waited,) = await errors()  # waits 1 s (its Describe), then skips it for 2 s
        assert "no answer within 1s" in waited
        await asyncio.sleep(1.1)  # still skipped: the pause doubled
        (skipped,) = await errors()
        assert "skipped for" in skipped
    finally:
        os.kill(marker.pid, signal.SIGCONT)
    await remote.close()


async def test_a_fail_closed_middleware_that_hangs_fails_calls_at_once_until_it_answers_again(
    marker: ServerProcess,
) -> None:
    """Required (fail_closed) and hung (SIGSTOP: connected, silent): the reply that finds it so
    fails after its timeout; a Describe then gets no answer either, and the next reply's hook call
    fails at once, saying why (before, each waited the timeout again). A Describe asks it every
    second; once it answers, replies use it."""
    remote = await RemoteMiddleware(marker.address, policy=Policy(fail_open=False, timeout=1)).connect()
    agent = make_agent(remote)
    assert end_of(await reply(agent, "first")).finished_reason == ReplyFinishedReason.COMPLETED
    os.kill(marker.pid, signal.SIGSTOP)
    try:
        end = end_of(await reply(agent, "it hangs"))
        assert end.finished_reason == ReplyFinishedReason.ERROR
        assert "no answer within 1s (timeout)" in end.error.message
        await until(lambda: remote.unresponsive)  # the Describe after it: no answer within 1 s either
        end = end_of(await reply(agent, "still hanging"))
        assert end.finished_reason == ReplyFinishedReason.ERROR
        assert "not called until it answers again after: no answer within 1s at" in end.error.message
        assert remote.unresponsive and metrics.middleware_status(remote)["health"] == "unresponsive"
    finally:
        os.kill(marker.pid, signal.SIGCONT)
    async with asyncio.timeout(15):  # its next Describe is answered (asked every second)
        while remote.unresponsive:
            await asyncio.sleep(0.05)
    items = await reply(agent, "back")
    assert end_of(items).finished_reason == ReplyFinishedReason.COMPLETED and items[-1].text == ANSWER
    await remote.close()


async def test_replies_that_wait_on_the_same_hang_together_count_it_once(marker: ServerProcess) -> None:
    """Concurrent replies all time out on a middleware that hangs (SIGSTOP): one hang, so one
    Describe to confirm it and one pause of its timeout (counted per reply, eight replies had
    paused it for the 5-minute maximum)."""
    remote = await RemoteMiddleware(marker.address, policy=Policy(fail_open=True, timeout=2)).connect()
    os.kill(marker.pid, signal.SIGSTOP)
    try:
        replies = [reply(make_agent(remote), f"reply {i}") for i in range(8)]
        for items in await asyncio.gather(*replies):
            assert end_of(items).finished_reason == ReplyFinishedReason.COMPLETED
        await until(remote.skipped)
        assert remote.hangs == 1
        assert 0 < metrics.middleware_status(remote)["skipped_for"] <= 2
        # Why, without a claim nobody checked: a stopped process answers no Describe either.
        assert "hook calls of" not in remote.skipped() or "Describe answers" not in remote.skipped()
    finally:
        os.kill(marker.pid, signal.SIGCONT)
    await remote.close()


async def test_a_middleware_that_answers_describe_but_hangs_in_its_hooks_stays_in_service() -> None:
    """Every hook call hangs, but the server answers a Describe (a hook's backend is stuck): each
    reply waits one timeout for it and goes on without it (fail_open); it is not taken for hung
    as a whole, as a tool merely slower than the timeout is not: never skipped for a while."""
    async with attached("SleeperEverywhere", fail_open=True, timeout=1) as remote:
        for text in ("one", "two"):
            items = await reply(make_agent(remote), text)
            assert end_of(items).finished_reason == ReplyFinishedReason.COMPLETED
            assert "no answer within 1s (timeout)" in bypasses(items)[0].value["error"]
            assert remote.confirming is not None
            await remote.confirming  # its Describe: answered
            assert not remote.skipped() and remote.hangs == 0


@pytest.mark.parametrize("fail_open", [True, False], ids=["fail_open", "fail_closed"])
async def test_hooks_that_hang_for_several_sessions_suspend_the_middleware_though_describe_answers(
    fail_open: bool,
) -> None:
    """Every hook call hangs, but the server answers a Describe: once hook calls of HANG_SESSIONS
    sessions in a row got no answer, it hangs for everyone. Before, every reply of every session
    waited its timeout for it, for good; now the next reply skips it at once (fail_open) or fails
    at once saying why (fail_closed), until the suspension ends and it is tried again."""
    async with attached("SleeperEverywhere", fail_open=fail_open, timeout=1) as remote:
        for n in range(HANG_SESSIONS):  # a new session each (make_agent)
            started = time.monotonic()
            items = await reply(make_agent(remote), f"session {n}")
            assert time.monotonic() - started >= 1  # it waited the timeout
            assert "no answer within 1s (timeout)" in _failure(items, fail_open)
            assert not remote.skipped() if n < HANG_SESSIONS - 1 else remote.skipped()
        started = time.monotonic()
        items = await reply(make_agent(remote), "the next session")
        assert time.monotonic() - started < 1  # at once
        why = _failure(items, fail_open)
        assert "skipped for" in why and f"hook calls of {HANG_SESSIONS} session(s) in a row" in why, why
        assert remote.hangs == 1
        await until(lambda: not remote.skipped())  # then tried again: it waits once more,
        started = time.monotonic()
        items = await reply(make_agent(remote), "after the pause")
        assert time.monotonic() - started >= 1 and "(timeout)" in _failure(items, fail_open)
        assert remote.skipped() and remote.hangs == 2  # and that trial's hang pauses it again, doubled


def _failure(items: list, fail_open: bool) -> str:
    """Why the middleware was left out of a reply: its bypass (fail_open) or the reply's error."""
    end = end_of(items)
    if fail_open:
        assert end.finished_reason == ReplyFinishedReason.COMPLETED
        return bypasses(items)[0].value["error"]
    assert end.finished_reason == ReplyFinishedReason.ERROR
    return end.error.message


async def test_timeout_is_paused_while_the_inner_pipeline_runs(marker: ServerProcess) -> None:
    """A slow model must not trip the middleware's per-message timeout."""
    remote = await RemoteMiddleware(marker.address, policy=Policy(timeout=0.3)).connect()
    agent = Agent(model=OfflineRuleModel(reply_template="slow answer", delay=0.5), middlewares=[remote])
    items = await reply(agent, "hi")
    assert end_of(items).finished_reason == ReplyFinishedReason.COMPLETED
    assert items[-1].text == "slow answer"
    await remote.close()


LIES = {
    "garbage": "malformed",
    "pull_first": "pull before call_next",
    "bad_forward": "forward_seq 99 is not the held item's seq (1)",
    "foreign_block": "not a block this middleware added",
    "unknown_model": "unknown model id 'no-such-model'",
    "negative_iter": "set_cur_iter below 0",
    "drop_all": "invalid drop_messages: cannot drop the oldest 1 of 1 messages: the newest message stays",
    "early_eof": "the stream ended before finish",
    "steal_id": "is already in the context",
    "forward_twice": "forward_seq 1 names no held intercepted item (seq 1 was emitted already)",
    "reply_result": "on_reply must finish without a result (it sent str)",
}


@pytest.mark.parametrize("mode", sorted(LIES))
async def test_protocol_violations_give_a_clear_error(mode: str) -> None:
    proc = ServerProcess(["-m", "tests.raw_mw", mode, "--address", "127.0.0.1:0"]).start()
    try:
        remote = await RemoteMiddleware(proc.address, policy=Policy(timeout=5)).connect()
        agent = make_agent(remote)
        items = await reply(agent, "hi")
        end = end_of(items)
        assert end.finished_reason == ReplyFinishedReason.ERROR
        assert "middleware 'Raw' failed in on_reply" in end.error.message
        assert LIES[mode] in end.error.message, end.error.message
        # The session holds the user's message and the error of the failed reply, or nothing when
        # it failed before the reply began; the host goes on: the same agent answers the next
        # reply once the liar is detached.
        assert [m.role for m in agent.state.context] in ([], [Role.USER, Role.ASSISTANT])
        agent.set_middlewares([])
        items = await reply(agent, "again")
        assert end_of(items).finished_reason == ReplyFinishedReason.COMPLETED
        assert [m.role for m in agent.state.context][-2:] == [Role.USER, Role.ASSISTANT]
        assert all_calls_answered(agent)
        await remote.close()
    finally:
        proc.stop()


async def test_a_block_id_claimed_before_the_users_message_removes_only_the_middlewares_block() -> None:
    """A middleware (mutate_context) appends a block under the id of the user's text block, which it
    is handed in on_reply's kwargs before the reply stores it, then removes "its" block: its own
    goes, the user's words stay. Before, the later block of that id, the user's, was removed (the
    stored user message was left empty)."""
    proc = ServerProcess(["-m", "tests.raw_mw", "preclaim", "--address", "127.0.0.1:0"]).start()
    try:
        remote = await RemoteMiddleware(proc.address, policy=Policy(timeout=5)).connect()
        agent = make_agent(remote)
        items = await reply(agent, "the user's own words")
        assert end_of(items).finished_reason == ReplyFinishedReason.COMPLETED, end_of(items).error
        texts = [(m.role, [b.text for b in m.content if isinstance(b, TextBlock)]) for m in agent.state.context]
        assert (Role.USER, ["the user's own words"]) in texts, texts
        assert not any("preclaimed" in t for _, ts in texts for t in ts), texts
        await remote.close()
    finally:
        proc.stop()


async def test_restarted_middleware_serves_the_next_reply(marker: ServerProcess) -> None:
    remote = await RemoteMiddleware(marker.address, policy=Policy(timeout=2, connect_timeout=5)).connect()
    agent = make_agent(remote)

    def marked(items: list) -> bool:
        return any(isinstance(i, CustomEvent) and i.name == "marker" for i in items)

    assert marked(await reply(agent, "first"))
    marker.kill()
    await noticed_gone(remote)
    items = await reply(agent, "while it is down")
    assert end_of(items).finished_reason == ReplyFinishedReason.ERROR
    # It waited the hook timeout for a restart, then says why it gave up (not a bare DEADLINE_EXCEEDED).
    error = end_of(items).error
    assert error is not None and re.search(
        rf"failed in Describe: cannot connect to {re.escape(marker.address)} \(waited 2s\): .*(refused|connect)",
        error.message,
    ), error
    marker.restart()  # same port
    assert await remote.wait_ready(5)  # the channel reconnects by itself (backoff at most 1 s)
    items = await reply(agent, "after the restart")
    assert end_of(items).finished_reason == ReplyFinishedReason.COMPLETED
    assert marked(items)
    await remote.close()


async def test_a_restarted_middleware_cannot_take_another_key() -> None:
    """The slot a middleware owns is fixed at attach: a server restarted at its address that reports
    another key (and so would read and write another middleware's slot) is refused, naming both."""
    port = unused_port()

    def budget_server(key: str) -> ServerProcess:
        argv = ["-m", "agentmw.sdk", "mw_servers.budget:ReplyBudget", "--address", f"127.0.0.1:{port}"]
        return ServerProcess([*argv, "--arg", "token_budget=1000000", "--arg", f'key="{key}"'], name=key).start()

    first = budget_server("mine")
    try:
        remote = await RemoteMiddleware(f"127.0.0.1:{port}", policy=Policy(timeout=5)).connect()
        agent = make_agent(remote)
        assert end_of(await reply(agent, "hi")).finished_reason == ReplyFinishedReason.COMPLETED
    finally:
        first.stop()
    await noticed_gone(remote)
    second = budget_server("theirs")
    try:
        end = end_of(await reply(agent, "hi again"))
        assert end.finished_reason == ReplyFinishedReason.ERROR
        assert "protocol violation: key changed from 'mine' to 'theirs'" in end.error.message
        assert "theirs" not in agent.state.middle_context  # it never got to write a slot
        await remote.close()
    finally:
        second.stop()


async def test_unknown_address_fails_to_attach() -> None:
    remote = RemoteMiddleware("127.0.0.1:1", policy=Policy(connect_timeout=0.5))
    with pytest.raises(Exception, match=r"failed in Describe: cannot connect to 127.0.0.1:1: connection refused"):
        await remote.connect()
    await remote.close()


async def test_a_server_that_does_not_answer_describe_fails_to_attach_saying_so() -> None:
    """Connected, but silent: the error says it did not answer (not that it cannot be reached)."""
    proc = ServerProcess(["-m", "tests.raw_mw", "describe_hangs", "--address", "127.0.0.1:0"]).start()
    remote = RemoteMiddleware(proc.address, policy=Policy(connect_timeout=0.5))
    try:
        with pytest.raises(MiddlewareFailure, match=r"failed in Describe: no answer within 0.5s \(DEADLINE_EXCEEDED"):
            await remote.connect()
    finally:
        await remote.close()
        proc.stop()


async def test_a_dead_detached_watcher_never_fails_a_reply() -> None:
    """Even under fail_closed: a watcher is never waited for, so its death costs the reply nothing,
    not even the wait for it to come back (an hour here: reply() gives up after 30 s; each reply
    waited the timeout once per detached invocation before)."""
    proc = middleware_server("tests.conformance_mw:DetachedWatcher").start()
    try:
        remote = await RemoteMiddleware(proc.address, policy=Policy(timeout=3600)).connect()
        agent = make_agent(remote)
        assert end_of(await reply(agent, "first")).finished_reason == ReplyFinishedReason.COMPLETED
        proc.kill()
        for text in ("while it is down", "and again"):
            items = await reply(agent, text)
            assert end_of(items).finished_reason == ReplyFinishedReason.COMPLETED
            assert items[-1].text == ANSWER
        await remote.close()
    finally:
        proc.stop()


async def test_a_hung_detached_watcher_never_holds_a_reply_up() -> None:
    """A watcher that stops answering (SIGSTOP: connected, silent) fails in the background; the
    host then describes it again, and that Describe must not be waited for either (each reply
    waited the timeout for it, once per detached invocation). Its copies are dropped meanwhile."""
    proc = middleware_server("tests.conformance_mw:DetachedWatcher").start()
    try:
        remote = await RemoteMiddleware(proc.address, policy=Policy(timeout=2)).connect()
        agent = make_agent(remote)
        assert end_of(await reply(agent, "first")).finished_reason == ReplyFinishedReason.COMPLETED
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            for text in ("it hangs", "still hanging", "and again"):
                async with asyncio.timeout(1):  # half the timeout: never waited for
                    items = await reply(agent, text)
                assert end_of(items).finished_reason == ReplyFinishedReason.COMPLETED
                await asyncio.sleep(2.5)  # its background deliveries time out meanwhile
            assert remote.bypasses > 0
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        await remote.close()
    finally:
        proc.stop()


@pytest.mark.parametrize("fail_open", [True, False])
async def test_a_middleware_that_is_down_costs_one_reply_the_wait_not_every_reply(
    marker: ServerProcess, fail_open: bool
) -> None:
    """The first reply after the server went away waits up to the timeout for it to come back (a
    restart), then fails or bypasses it; once that Describe found it unreachable, the next replies
    find out at once (each reply waited the timeout before: a fail_open middleware that was down
    stalled every reply), until it is back: then the next reply is served by it again."""
    remote = await RemoteMiddleware(marker.address, policy=Policy(fail_open=fail_open, timeout=3)).connect()
    agent = make_agent(remote)
    expected = ReplyFinishedReason.COMPLETED if fail_open else ReplyFinishedReason.ERROR
    assert end_of(await reply(agent, "first")).finished_reason == ReplyFinishedReason.COMPLETED
    marker.kill()
    await noticed_gone(remote)
    assert end_of(await reply(agent, "the outage is found")).finished_reason == expected  # waits up to 3 s
    for text in ("while it is down", "still down"):
        async with asyncio.timeout(1.5):  # half the timeout: these must not wait for it
            items = await reply(agent, text)
        end = end_of(items)
        assert end.finished_reason == expected
        if fail_open:
            assert bypasses(items)
        else:
            assert end.error is not None and "cannot connect to" in end.error.message, end.error
    marker.restart()
    assert await remote.wait_ready(5)
    items = await reply(agent, "it is back")
    assert end_of(items).finished_reason == ReplyFinishedReason.COMPLETED and not bypasses(items)
    assert remote.outage is None
    await remote.close()


def tool_caller(toolkit: Toolkit, name: str, **tool_input: Any) -> Callable[[], Awaitable[str]]:
    """A reply that calls the tool ``name`` once: what its result says (the reply completes)."""
    call = {"tool_calls": [{"name": name, "input": tool_input}]}

    async def result() -> str:
        agent = Agent(model=OfflineRuleModel(script=[call, {"text": "done"}]), toolkit=toolkit)
        items = await reply(agent, "call it")
        assert end_of(items).finished_reason == ReplyFinishedReason.COMPLETED
        (msg,) = [m for m in agent.state.context if any(isinstance(b, ToolResultBlock) for b in m.content)]
        return str(msg.content)

    return result


async def test_a_tool_whose_server_is_down_costs_one_call_the_wait() -> None:
    """A tool-only middleware is never described again by a hook call: its tool calls find the
    outage themselves. The first call after the server went away waits up to the timeout; the
    next fail at once, each with an error result that says why, until the server is back."""
    proc = middleware_server("tests.conformance_mw:Tools").start()
    try:
        remote = await RemoteMiddleware(proc.address, policy=Policy(timeout=3)).connect()
        toolkit = Toolkit([])
        await add_middleware_tools(toolkit, remote)
        shout = tool_caller(toolkit, "Tools__shout", text="hi")
        assert "HI!" in await shout()
        proc.kill()
        assert "cannot connect to" in await shout()  # waits up to 3 s
        for _ in range(2):
            async with asyncio.timeout(1.5):  # half the timeout: no wait any more
                assert "cannot connect to" in await shout()
        proc.restart()
        assert await remote.wait_ready(5)
        assert "HI!" in await shout()
        assert remote.outage is None
        await remote.close()
    finally:
        proc.stop()


@pytest.mark.parametrize(
    ("fail_open", "skipped"),
    [
        (False, "not called until it answers again after: no answer within 1s"),
        (True, "s more after: no answer within 1s"),
    ],
)
async def test_a_tool_whose_server_hangs_costs_one_call_the_wait(fail_open: bool, skipped: str) -> None:
    """A tool-only middleware that hangs (SIGSTOP: connected, silent): the first tool call waits
    its timeout; a Describe then finds the server silent too, so the next calls fail at once,
    saying why (fail_closed: until it answers again; fail_open: for a pause, as a hook call's
    hang), and once it answers a tool call clears the count of hangs (before, every call waited
    the timeout). A tool merely slower than the timeout fails alone: the server answers the
    Describe, the next call runs."""
    proc = middleware_server("tests.conformance_mw:SlowTools").start()
    try:
        remote = await RemoteMiddleware(proc.address, policy=Policy(timeout=1, fail_open=fail_open)).connect()
        toolkit = Toolkit([])
        await add_middleware_tools(toolkit, remote)
        shout = tool_caller(toolkit, "SlowTools__shout", text="hi")
        assert "no answer within 1s" in await tool_caller(toolkit, "SlowTools__dawdle", seconds=3)()
        await asyncio.gather(*remote.background)  # its Describe: answered
        assert not remote.skipped() and "HI!" in await shout()
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            assert "no answer within 1s" in await shout()
            async with asyncio.timeout(5):  # the Describe after it: no answer within 1 s either
                while not remote.skipped():
                    await asyncio.sleep(0.05)
            for _ in range(2):
                async with asyncio.timeout(0.5):  # half the timeout: no wait any more
                    assert skipped in await shout()
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        async with asyncio.timeout(10):  # fail_closed: asked every second; fail_open: the pause ends
            while remote.skipped():
                await asyncio.sleep(0.05)
        assert "HI!" in await shout()
        assert remote.hangs == 0  # it answers: its next hang pauses it for the timeout again, not twice as long
        await remote.close()
    finally:
        proc.stop()


WORDS = " ".join(f"w{i}" for i in range(100))


async def test_fail_open_loses_no_observed_item() -> None:
    """The observer stalls while the host holds an observed item: the bypass forwards it."""
    async with attached("StallingObserver", fail_open=True, timeout=1) as remote:
        agent = Agent(model=OfflineRuleModel(reply_template=WORDS), middlewares=[remote])
        items = await reply(agent, "hi")
        assert len(bypasses(items)) == 1
        assert "".join(i.delta for i in items if isinstance(i, TextBlockDeltaEvent)) == WORDS
        assert items[-1].text == WORDS


async def test_an_observer_that_raises_is_reported_as_its_exception() -> None:
    async with attached("RaisingObserver", fail_open=True, timeout=5) as remote:
        agent = Agent(model=OfflineRuleModel(reply_template=WORDS), middlewares=[remote])
        end = end_of(await reply(agent, "hi"))
        # Its own exception propagates as in-process (no protocol violation, no silent bypass).
        assert end.finished_reason == ReplyFinishedReason.ERROR
        assert "ValueError: observer gave up at 40 (raised by middleware" in end.error.message


async def test_a_middleware_that_stops_reading_cannot_stall_a_large_write(marker: ServerProcess) -> None:
    """SIGSTOPped with a 4 MB begin on the wire: the send is timed like a read."""
    import signal
    import time

    timeout = 1.0
    remote = await RemoteMiddleware(marker.address, policy=Policy(timeout=timeout)).connect()
    agent = make_agent(remote)
    marker.popen.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        end = end_of(await reply(agent, "x" * 4_000_000))
        assert time.monotonic() - start < timeout * 5  # ended by the timeout, not by the transport
        assert end.finished_reason == ReplyFinishedReason.ERROR
        assert f"middleware 'Marker' failed in on_reply: could not send within {timeout:g}s" in end.error.message
    finally:
        marker.popen.send_signal(signal.SIGCONT)
    await remote.close()


async def test_a_fail_open_bypass_of_on_model_call_keeps_a_response_returned_inside() -> None:
    """A fail_open on_model_call that cannot be reached is bypassed; the layer inside it returns
    one ChatResponse, which stays the call's answer (its text streams as blocks), as with no
    middleware above it."""
    from tests.conformance_mw import ReturnsResponse

    proc = middleware_server("tests.conformance_mw:ModelValueSeen").start()
    remote = await RemoteMiddleware(proc.address, policy=Policy(fail_open=True, timeout=2)).connect()
    proc.stop()
    agent = Agent(model=OfflineRuleModel(), middlewares=[remote, ReturnsResponse()])
    items = await reply(agent, "hi")
    assert end_of(items).finished_reason == ReplyFinishedReason.COMPLETED and items[-1].text == "canned reply"
    assert [type(i).__name__ for i in items if "TextBlock" in type(i).__name__] == [
        "TextBlockStartEvent",
        "TextBlockDeltaEvent",
        "TextBlockEndEvent",
    ]
    assert remote.bypasses == 1
    await remote.close()


async def test_a_message_appended_after_calls_awaiting_results_is_refused() -> None:
    """A middleware appends a message of its own when the reply parks on a confirmation: after the
    assistant's message whose tool call awaits the user. The host refuses it (a protocol violation
    naming the middleware; the same rule as AgentState.append_message in-process), and the failed
    reply closes the call as any failed reply does: nothing is left waiting in the session. Before,
    the reply failed with a ReplyGrammarError and the call stayed stored ASKING with no result, not
    parked, for good: every later turn carried a tool call without its result."""

    @tool(description="Sends a note.", needs_confirmation=True)
    def note(text: str) -> str:
        return f"sent {text}"

    async with attached("NotesWhenParked", timeout=5) as remote:
        agent = Agent(model=OfflineRuleModel(reply_template=ANSWER), toolkit=Toolkit([note]), middlewares=[remote])
        items = await reply(agent, "call note text=hi")
    end = end_of(items)
    assert end.finished_reason == ReplyFinishedReason.ERROR, end
    said = "failed in on_reply: protocol violation: invalid append_message: a message cannot follow tool calls"
    assert f"middleware 'NotesWhenParked' {said}" in end.error.message, end.error
    assert not agent.awaiting_calls() and not [m for m in agent.state.context if m.name == "notes"]
    (call,) = [b for m in agent.state.context for b in m.content if b.type == "tool_call"]
    results = [b for m in agent.state.context for b in m.content if b.type == "tool_result"]
    assert call.state.value == "finished" and [r.id for r in results] == [call.id], agent.state.context
