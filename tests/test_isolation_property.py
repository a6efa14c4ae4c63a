"""Property: whatever sequence of MiddlewareMessages a middleware sends, the host contains it.

A real server process (tests/evil_mw.py) plays back a generated sequence per invocation (looked up
by the session id), then a finish. The host (an Agent with that remote middleware, fail_closed and
fail_open) must end every reply, keep a concurrently running well-behaved session unaffected, and
give the client a well-formed reply end. The host side runs on its own event loop in a thread, so
the well-behaved session keeps running between examples.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_host.agent import Agent
from agent_host.models import OfflineRuleModel
from agent_host.remote import Policy, RemoteMiddleware
from agentmw.data import Msg, ReplyEndEvent, ReplyFinishedReason, UserMsg
from clients.launch import ServerProcess

ANSWER = "fine thanks"
EXAMPLES = 300  # per test; each example is one short reply (~10 ms)

# -- generated MiddlewareMessages (protobuf JSON, as tests/evil_mw.py plays them) ---------------

_text = st.text("abc xyz", max_size=8)
_items = st.one_of(
    st.builds(lambda n: {"custom": {"name": n, "value": {}}}, _text),
    st.builds(lambda t: {"msg": {"role": "ROLE_ASSISTANT", "content": [{"text": {"text": t}}]}}, _text),
    st.builds(lambda t: {"textBlockDelta": {"blockId": "b", "delta": t}}, _text),
    st.just({"replyEnd": {"finishedReason": "REPLY_FINISHED_REASON_COMPLETED"}}),
    st.just({"chatResponse": {"content": [{"text": {"text": "chunk"}}]}}),
    st.just({"toolResponse": {"content": [{"text": {"text": "out"}}]}}),
)
_actions = st.one_of(
    st.builds(lambda i: {"emit": {"item": i}}, _items),
    st.builds(lambda n: {"emit": {"forwardSeq": str(n)}}, st.integers(0, 4)),
    st.builds(lambda v: {"mutate": {"setSlot": v}}, st.one_of(st.none(), st.integers(-3, 3), _text)),
    st.builds(lambda n: {"mutate": {"setCurIter": n}}, st.integers(-1, 3)),
    st.builds(lambda n: {"mutate": {"setMaxIters": n}}, st.integers(-1, 3)),
    st.just({"mutate": {"removeBlock": "not-mine"}}),
    st.just({}),
)
_commands = st.one_of(
    st.just({}),
    st.builds(lambda c: {"callNext": {"credits": c}}, st.integers(0, 3)),
    st.builds(lambda c: {"pull": {"credits": c}}, st.integers(0, 3)),
    st.just({"finish": {}}),
    st.builds(lambda f: {"fail": {"type": "Oops", "message": "raised", "fromInner": f}}, st.booleans()),
)
_ids = st.sampled_from(["current"] * 6 + ["previous", "next", "zero"])
MESSAGES = st.lists(
    st.builds(lambda a, c, i: {"actions": a, **c, "_id": i}, st.lists(_actions, max_size=3), _commands, _ids),
    max_size=6,
)


# -- the host side, on its own loop ---------------------------------------------------------------


@dataclass
class World:
    loop: asyncio.AbstractEventLoop
    scripts: Path
    proc: ServerProcess
    remotes: dict[bool, RemoteMiddleware] = field(default_factory=dict)
    good_replies: int = 0
    good_failures: list[str] = field(default_factory=list)
    stop: asyncio.Event | None = None

    def run(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


def agent(remote: RemoteMiddleware) -> Agent:
    return Agent(model=OfflineRuleModel(reply_template=ANSWER, delay=0), middlewares=[remote])


async def reply(a: Agent, text: str) -> list[Any]:
    async with asyncio.timeout(20):  # a hung reply fails the test, never the suite
        return [item async for item in a.reply_stream(UserMsg(text))]


async def good_session(world: World) -> None:
    """A well-behaved session next to the misbehaving ones: every reply must complete unchanged."""
    good = agent(world.remotes[False])  # fail_closed: any leak from another invocation shows
    assert world.stop is not None
    while not world.stop.is_set():
        items = await reply(good, "hello")
        ends = [i for i in items if isinstance(i, ReplyEndEvent)]
        if len(ends) != 1 or ends[0].finished_reason != ReplyFinishedReason.COMPLETED or items[-1].text != ANSWER:
            world.good_failures.append(repr(items[-3:]))
        world.good_replies += 1
        await asyncio.sleep(0.01)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    scripts = tmp_path_factory.mktemp("scripts")
    proc = ServerProcess(["-m", "tests.evil_mw", "--scripts", str(scripts), "--address", "127.0.0.1:0"]).start()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    w = World(loop, scripts, proc)

    async def setup() -> asyncio.Task[None]:
        for fail_open in (False, True):
            policy = Policy(fail_open=fail_open, timeout=2)
            w.remotes[fail_open] = await RemoteMiddleware(proc.address, policy=policy).connect()
        w.stop = asyncio.Event()
        return asyncio.create_task(good_session(w))

    task = w.run(setup())
    try:
        yield w
    finally:
        assert w.stop is not None
        loop.call_soon_threadsafe(w.stop.set)
        w.run(asyncio.wait_for(asyncio.shield(task), 25))

        async def teardown() -> None:
            for remote in w.remotes.values():
                await remote.close()

        w.run(teardown())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        proc.stop()


def play(world: World, messages: list[dict], fail_open: bool) -> list[Any]:
    a = agent(world.remotes[fail_open])
    (world.scripts / f"{a.state.session_id}.json").write_text(json.dumps({"messages": messages}))
    return world.run(reply(a, "hi"))


def contained(world: World) -> None:
    assert world.proc.popen.poll() is None, "the middleware process died"
    assert not world.good_failures, world.good_failures[:3]


_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_SETTINGS
@given(messages=MESSAGES, fail_open=st.booleans())
def test_any_message_sequence_is_contained(world: World, messages: list[dict], fail_open: bool) -> None:
    """Every reply ends (no hang, no crash, nothing raised to the client), and the well-behaved
    session next to it is unaffected. (Its shape is the next test's business.)"""
    play(world, messages, fail_open)
    contained(world)


@_SETTINGS
@given(messages=MESSAGES, fail_open=st.booleans())
def test_any_message_sequence_gives_a_well_formed_reply_end(
    world: World, messages: list[dict], fail_open: bool
) -> None:
    """Every reply a client gets ends with exactly one ReplyEndEvent followed by the final Msg."""
    items = play(world, messages, fail_open)
    ends = [i for i, item in enumerate(items) if isinstance(item, ReplyEndEvent)]
    assert len(ends) == 1, [type(i).__name__ for i in items]
    assert ends[0] == len(items) - 2 and isinstance(items[-1], Msg), [type(i).__name__ for i in items]
    contained(world)


def test_the_well_behaved_session_kept_replying(world: World) -> None:
    contained(world)
    assert world.good_replies > 0
