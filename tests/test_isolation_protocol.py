"""The middleware boundary isolates: a misbehaving middleware process (tests/evil_mw.py, written
from the protos) cannot reach another invocation, hang a reply, flood it, or put items into a hook
position that cannot yield them. Every wait is bounded relative to the policy's timeout."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent_host.agent import Agent
from agent_host.config import ConfigError, load_config
from agent_host.models import OfflineRuleModel
from agent_host.remote import Policy, RemoteMiddleware
from agent_host.remote.errors import ProtocolError
from agentmw.codec import codec
from agentmw.data import (
    ConfirmResult,
    CustomEvent,
    ReplyFinishedReason,
    RequireUserConfirmEvent,
    ToolResultBlock,
    ToolResultEndEvent,
    ToolResultState,
    UserConfirmResultEvent,
    UserMsg,
)
from agentmw.data.blocks import block_text
from agentmw.tools import Toolkit, add_middleware_tools, tool
from agentmw.v1 import host_pb2
from clients.chat import HostClient, converse
from clients.launch import ServerProcess, middleware_server

from .host_util import get_session, processes, stub
from .test_faults import ANSWER, end_of, make_agent, reply

TIMEOUT = 1.0


@pytest.fixture
def scripts(tmp_path: Path) -> Path:
    path = tmp_path / "scripts"
    path.mkdir()
    return path


@pytest.fixture
def evil(scripts: Path) -> Iterator[Any]:
    """Starts tests/evil_mw.py processes (reading scripts from ``scripts``), stopped at the end."""
    procs: list[ServerProcess] = []

    def start(*flags: str) -> ServerProcess:
        argv = ["-m", "tests.evil_mw", "--scripts", str(scripts), "--address", "127.0.0.1:0", *flags]
        procs.append(ServerProcess(argv).start())
        return procs[-1]

    yield start
    for proc in procs:
        proc.stop()


@pytest.fixture
def raw() -> Iterator[Callable[[str], ServerProcess]]:
    """Starts tests/raw_mw.py servers, one mode each, stopped at the end."""
    procs: list[ServerProcess] = []

    def start(mode: str) -> ServerProcess:
        procs.append(ServerProcess(["-m", "tests.raw_mw", mode, "--address", "127.0.0.1:0"]).start())
        return procs[-1]

    yield start
    for proc in procs:
        proc.stop()


def script(scripts: Path, agent: Agent, **body: Any) -> None:
    (scripts / f"{agent.state.session_id}.json").write_text(json.dumps(body))


def custom(name: str) -> dict[str, Any]:
    return {"actions": [{"emit": {"item": {"custom": {"name": name, "value": {}}}}}]}


# -- 1. no message crosses invocations --------------------------------------------------------------


@pytest.mark.parametrize(
    "after",
    [
        [{**custom("from_a"), "finish": {}}],  # an extra emit + finish after A finished
        [{"pull": {}}],  # a stray pull
        [{"callNext": {}}],  # a stray call_next
        [{**custom("next"), "finish": {}, "_id": "next"}],  # labelled with the id plus one
        [{**custom("unlabelled"), "finish": {}, "_id": "zero"}],  # without an id
    ],
    ids=["emit_finish", "pull", "call_next", "next_id", "no_id"],
)
async def test_messages_after_finish_never_reach_the_next_invocation(evil: Any, scripts: Path, after: list) -> None:
    proc = evil()
    remote = await RemoteMiddleware(proc.address, policy=Policy(timeout=5)).connect()
    a, b = make_agent(remote), make_agent(remote)  # two sessions over the same (reused) stream
    script(scripts, a, after=after)
    assert end_of(await reply(a, "session A")).finished_reason == ReplyFinishedReason.COMPLETED
    await asyncio.sleep(0.2)  # the extra messages are on the wire now
    items = await reply(b, "session B")
    assert end_of(items).finished_reason == ReplyFinishedReason.COMPLETED, end_of(items).error
    assert items[-1].text == ANSWER
    assert not [i for i in items if isinstance(i, CustomEvent)]
    assert remote.stale_messages >= 1
    await remote.close()


async def test_done_with_inner_ends_the_call_at_inner_done_and_drops_what_comes_later(evil: Any, scripts: Path) -> None:
    """A hook declared done_with_inner (hooks.proto HookDescription) ends when the host sends
    inner_done: an emit and a slot change sent after it never reach the reply or the session, the
    next invocation on the same stream is unaffected, and the late finish is not a stale message."""
    proc = evil("--done-with-inner")
    remote = await RemoteMiddleware(proc.address, policy=Policy(timeout=5)).connect()
    a, b = make_agent(remote), make_agent(remote)
    script(
        scripts,
        a,
        at_done=[
            {**custom("too_late"), "actions": [*custom("too_late")["actions"], {"mutate": {"setSlot": {"late": True}}}]}
        ],
    )
    items = await reply(a, "session A")
    assert end_of(items).finished_reason == ReplyFinishedReason.COMPLETED, end_of(items).error
    assert items[-1].text == ANSWER and not [i for i in items if isinstance(i, CustomEvent)]
    assert "Evil" not in a.state.middle_context
    await asyncio.sleep(0.2)  # the late messages are on the wire now
    items = await reply(b, "session B")
    assert end_of(items).finished_reason == ReplyFinishedReason.COMPLETED, end_of(items).error
    assert items[-1].text == ANSWER and not [i for i in items if isinstance(i, CustomEvent)]
    assert remote.stale_messages == 1  # the one with actions; the bare finish is expected
    await remote.close()


async def test_done_with_inner_does_not_wait_for_the_finish(evil: Any, scripts: Path) -> None:
    """A middleware declared done_with_inner that never sends its finish does not hold the reply
    up: the host ended the call at inner_done. The same script without the declaration fails the
    reply after the timeout."""
    for flags, completes in ((("--done-with-inner",), True), ((), False)):
        proc = evil(*flags)
        remote = await RemoteMiddleware(proc.address, policy=Policy(timeout=2)).connect()
        agent = make_agent(remote)
        script(scripts, agent, no_finish=True)
        items = await reply(agent, "no finish")
        reason = end_of(items).finished_reason
        assert (reason == ReplyFinishedReason.COMPLETED) == completes, (flags, end_of(items).error)
        await remote.close()


async def test_done_with_inner_with_observed_items_is_refused_at_attach(evil: Any) -> None:
    proc = evil("--done-with-inner", "--default-mode", "observe")
    with pytest.raises(ProtocolError, match="done_with_inner cannot go with observed items"):
        await RemoteMiddleware(proc.address, policy=Policy(timeout=5)).connect()


async def test_a_hook_described_twice_is_refused_at_attach(evil: Any) -> None:
    """Two descriptions of one hook (say, one intercepting, one detached): which holds? Neither, the
    attach fails saying so (before, the last one silently won)."""
    proc = evil("--hooks", "on_reply,on_reply")
    with pytest.raises(ProtocolError, match="describes on_reply twice"):
        await RemoteMiddleware(proc.address, policy=Policy(timeout=5)).connect()


async def test_a_key_that_is_a_document_is_refused_at_attach(evil: Any) -> None:
    """The key names the middleware's slot in every session it touches: 257 characters and more
    are refused (before, any length was taken and stored with each session)."""
    with pytest.raises(ProtocolError, match=r"a middleware key of 257 characters \(at most 256\)"):
        await RemoteMiddleware(evil("--key", "k" * 257).address, policy=Policy(timeout=5)).connect()
    longest = await RemoteMiddleware(evil("--key", "k" * 256).address, policy=Policy(timeout=5)).connect()
    assert longest.key == "k" * 256
    await longest.close()


async def test_an_onion_declared_cacheable_is_refused_at_attach(evil: Any) -> None:
    proc = evil("--cacheable")
    with pytest.raises(ProtocolError, match="on_reply cannot be cacheable"):
        await RemoteMiddleware(proc.address, policy=Policy(timeout=5)).connect()


@pytest.mark.parametrize(
    ("which", "error"),
    [
        ("zero", "MiddlewareMessage.invocation is missing"),
        ("next", "has not begun"),
    ],
)
async def test_a_missing_or_future_invocation_id_is_a_violation(
    evil: Any, scripts: Path, which: str, error: str
) -> None:
    proc = evil()
    remote = await RemoteMiddleware(proc.address, policy=Policy(timeout=5)).connect()
    agent = make_agent(remote)
    script(scripts, agent, messages=[{"callNext": {}, "_id": which}])
    end = end_of(await reply(agent, "hi"))
    assert end.finished_reason == ReplyFinishedReason.ERROR
    assert "middleware 'Evil' failed in on_reply: protocol violation" in end.error.message
    assert error in end.error.message, end.error.message
    await remote.close()


# -- 2. every wait has a deadline -----------------------------------------------------------------


@pytest.mark.parametrize("fail_open", [True, False], ids=["fail_open", "fail_closed"])
async def test_replies_beyond_what_the_server_admits_end_within_the_timeout(evil: Any, fail_open: bool) -> None:
    """The server admits one stream at a time (the idle stream holds it): further streams queue in
    the client. Before, their begin never got written and the replies hung (the session's too)."""
    proc = evil("--max-streams", "1")
    remote = await RemoteMiddleware(proc.address, policy=Policy(timeout=TIMEOUT, fail_open=fail_open)).connect()
    agents = [make_agent(remote) for _ in range(3)]
    start = time.monotonic()
    results = await asyncio.gather(*(reply(agent, f"hi {i}") for i, agent in enumerate(agents)))
    assert time.monotonic() - start < TIMEOUT * 5
    for items in results:
        end = end_of(items)
        if fail_open:
            assert end.finished_reason == ReplyFinishedReason.COMPLETED and items[-1].text == ANSWER
        elif end.finished_reason == ReplyFinishedReason.ERROR:
            assert f"could not send within {TIMEOUT:g}s (timeout)" in end.error.message, end.error.message
    # The session goes on: its next reply is bounded too.
    start = time.monotonic()
    end_of(await reply(agents[1], "again"))
    assert time.monotonic() - start < TIMEOUT * 5
    await remote.close()


@pytest.mark.parametrize("fail_open", [True, False], ids=["fail_open", "fail_closed"])
async def test_a_hang_in_one_session_leaves_the_middleware_to_every_other(
    evil: Any, scripts: Path, fail_open: bool
) -> None:
    """The middleware's calls hang for one session only (a per-user slow path) while it serves
    every other session. The hung call fails alone, after its timeout (fail_open: bypassed); the
    Describe that follows is answered, so the replies of the other sessions, running meanwhile
    and started after it, keep using the middleware. Before, that one timeout took it away from
    every session: fail_open skipped it for its timeout (doubling at each further one), fail_closed
    failed the others' hook calls at once (and the host refused their replies) until a Describe
    answered (here after half the timeout)."""
    proc = evil("--describe-delay", str(TIMEOUT / 2))
    remote = await RemoteMiddleware(proc.address, policy=Policy(fail_open=fail_open, timeout=TIMEOUT)).connect()
    hung = make_agent(remote)
    script(scripts, hung, stop_reading=True)
    hanging = asyncio.create_task(reply(hung, "hi"))
    served = 0
    async with asyncio.timeout(20):
        while not hanging.done() or served < 10:  # others meanwhile, and after it
            items = await reply(make_agent(remote), "hi")
            end = end_of(items)
            assert end.finished_reason == ReplyFinishedReason.COMPLETED, end.error
            assert not [i for i in items if isinstance(i, CustomEvent) and i.name == "middleware_bypassed"]
            served += hanging.done()
    items = hanging.result()
    end, why = end_of(items), "middleware 'Evil' failed in on_reply: no answer within 1s (timeout)"
    if fail_open:
        assert end.finished_reason == ReplyFinishedReason.COMPLETED
        assert [i.value["error"] for i in items if isinstance(i, CustomEvent)] == [why]
    else:
        assert end.finished_reason == ReplyFinishedReason.ERROR and why in end.error.message, end.error
    assert remote.confirming is not None and remote.confirming.done()  # the Describe after it: answered
    assert not remote.skipped() and not remote.unresponsive and remote.hangs == 0
    await remote.close()


@pytest.mark.parametrize(
    "mode", ["grants_forever", "suspends_forever", "empties_forever", "mutates_forever", "grants_after_done"]
)
async def test_a_middleware_busy_with_messages_that_answer_nothing_times_out_as_a_silent_one(
    raw: Any, mode: str
) -> None:
    """It takes the first item and never answers it, but every 0.2 s sends a message that moves
    nothing (tests/raw_mw.py): a credit grant (answers_seq another item's), a suspend with no emit,
    neither command nor action, or a change of its slot alone; or it passes every item on and then
    sends credit grants instead of its finish. Each one used to restart the
    timeout, so the reply was held for as long as the middleware kept it up; now the wait keeps
    its deadline, and the call fails after the timeout, saying what came meanwhile."""
    remote = await RemoteMiddleware(raw(mode).address, policy=Policy(timeout=TIMEOUT)).connect()
    start = time.monotonic()
    end = end_of(await reply(make_agent(remote), "hi"))
    assert time.monotonic() - start < TIMEOUT * 4
    assert end.finished_reason == ReplyFinishedReason.ERROR
    said = re.search(r"no answer within 1s \(timeout; (\d+) messages meanwhile answered nothing", end.error.message)
    assert said and int(said.group(1)) >= 2, end.error.message
    await remote.close()


async def test_a_flood_of_messages_that_answer_nothing_is_a_violation_at_once(raw: Any) -> None:
    """The same with credit grants as fast as it can write them: the host no longer reads them until
    the timeout (18,344 in 3 s took 2.3 s of its CPU), but fails the call after a thousand."""
    remote = await RemoteMiddleware(raw("grants_flood").address, policy=Policy(timeout=10)).connect()
    start = time.monotonic()
    end = end_of(await reply(make_agent(remote), "hi"))
    assert time.monotonic() - start < 5  # not the timeout
    assert end.finished_reason == ReplyFinishedReason.ERROR
    said = "protocol violation: more than 1000 messages in a row that answered nothing"
    assert said in end.error.message, end.error.message
    await remote.close()


@pytest.mark.parametrize("mode", ["break_reused", "break_reused_eager"])
async def test_a_reused_stream_that_breaks_before_any_answer_is_replaced_once(raw: Any, mode: str) -> None:
    """The host keeps a middleware's streams for the next call. Restarted between two replies, the
    server takes those streams with its connection, and a host that has not noticed yet (under
    load its gRPC threads lag) sends the next begin on one of them. Here the server breaks the
    stream at that begin (tests/raw_mw.py break_reused): the middleware answered nothing, so what
    the host sent (the begin; declared eager_next, the first item too) goes again on a new stream,
    and the reply completes. Before, that reply failed."""
    proc = raw(mode)
    remote = await RemoteMiddleware(proc.address, policy=Policy(timeout=TIMEOUT)).connect()
    agent = make_agent(remote)
    for _ in range(3):  # the first opens the stream; each later one finds it kept, and broken
        end = end_of(await reply(agent, "hi"))
        assert end.finished_reason == ReplyFinishedReason.COMPLETED, end.error
    proc.wait_for_line("breaking a reused stream")
    await remote.close()


async def test_a_reused_stream_a_live_server_refuses_is_not_tried_again(raw: Any) -> None:
    """Only a stream that went with its connection starts over: one the server ends with a status
    of its own (RESOURCE_EXHAUSTED here) is its answer, and the call fails as it did."""
    remote = await RemoteMiddleware(raw("refuse_reused").address, policy=Policy(timeout=TIMEOUT)).connect()
    agent = make_agent(remote)
    assert end_of(await reply(agent, "hi")).finished_reason == ReplyFinishedReason.COMPLETED
    end = end_of(await reply(agent, "hi"))
    assert end.finished_reason == ReplyFinishedReason.ERROR
    assert "RESOURCE_EXHAUSTED: no more streams for you" in end.error.message, end.error.message
    await remote.close()


async def test_a_failure_is_judged_by_the_description_the_call_began_with(
    evil: Any, scripts: Path, tmp_path: Path
) -> None:
    """A fail_closed middleware's call hangs; meanwhile the middleware is described anew (another
    session's call broke the protocol, the next one described it again) and now declares the hook
    detached, as a new version rolled out behind its address could. The hung call still fails the
    reply when it times out: it began intercepting, and what it did until then is in the reply.
    Before, the host read the new description and bypassed it silently: the reply completed with
    no error and no bypass record."""
    flip = tmp_path / "detached"
    proc = evil("--detached-while", str(flip))
    remote = await RemoteMiddleware(proc.address, policy=Policy(fail_open=False, timeout=2.0)).connect()
    hung = make_agent(remote)
    script(scripts, hung, stop_reading=True)
    hanging = asyncio.create_task(reply(hung, "hi"))
    await asyncio.sleep(0.3)  # its call is open
    flip.write_text("")
    broken = make_agent(remote)
    script(scripts, broken, messages=[{"pull": {}}])  # a protocol violation: described again next
    assert end_of(await reply(broken, "hi")).finished_reason == ReplyFinishedReason.ERROR
    assert end_of(await reply(make_agent(remote), "hi")).finished_reason == ReplyFinishedReason.COMPLETED
    assert remote.tables["on_reply"].detached and not hanging.done()  # described anew, A still open
    end = end_of(await hanging)
    assert end.finished_reason == ReplyFinishedReason.ERROR, end
    assert "middleware 'Evil' failed in on_reply: no answer within 2s" in end.error.message, end.error
    await remote.close()


def nested(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {"leaf": 1}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


@pytest.mark.parametrize("where", ["slot", "event", "message"])
async def test_a_value_nested_too_deep_to_pass_on_is_a_violation(evil: Any, scripts: Path, where: str) -> None:
    """A middleware sends a JSON value nested 30 levels deep (protobuf parses it: its limit is 100
    message levels, three per JSON object): as its slot, a custom event's value, a message's
    metadata. The host refuses it as a protocol violation naming the middleware, keeps none of it,
    and the session goes on. Before, it kept it and passed it on inside messages a few levels
    deeper, which nobody could parse: every later hook call of the session failed blaming whatever
    middleware got it next, or the client's GetSession failed ('Exception deserializing')."""
    deep = nested(30)
    action = {
        "slot": {"mutate": {"setSlot": deep}},
        "event": {"emit": {"item": {"custom": {"name": "deep", "value": deep}}}},
        "message": {"mutate": {"appendMessage": {"name": "m", "role": "ROLE_USER", "metadata": deep}}},
    }[where]
    proc = evil()
    remote = await RemoteMiddleware(proc.address, policy=Policy(timeout=5)).connect()
    agent = make_agent(remote)
    script(scripts, agent, messages=[{"actions": [action]}])
    end = end_of(await reply(agent, "hi"))
    assert end.finished_reason == ReplyFinishedReason.ERROR, end
    assert "middleware 'Evil' failed in on_reply: protocol violation" in end.error.message, end.error
    assert "nested deeper than 24 levels" in end.error.message, end.error
    assert "Evil" not in agent.state.middle_context
    assert not any(m.metadata for m in agent.state.context), agent.state.context
    (scripts / f"{agent.state.session_id}.json").unlink()  # it behaves again: so does the session
    assert end_of(await reply(agent, "again")).finished_reason == ReplyFinishedReason.COMPLETED
    await remote.close()


async def test_a_client_message_nested_too_deep_is_refused(tmp_path: Path) -> None:
    """The same from a client: a user message whose metadata nests 30 levels is refused at once
    (INVALID_ARGUMENT), not stored to break the session's later hook calls (blaming a middleware)."""
    with processes(tmp_path) as procs:
        host = procs.host(tmp_path / "s.db")
        async with HostClient(host.address) as client:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await converse(client, "", UserMsg("hi", metadata=nested(30)))
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "nested deeper than 24 levels" in (refused.value.details() or "")


def test_a_tool_input_nested_too_deep_is_the_models_error() -> None:
    """And from a model: a tool input it nests 30 levels deep is a ToolInputError (the model gets
    it as the tool's error result), not passed to remote middleware in on_check_permission."""
    from agentmw.tools import ToolInputError, parse_input

    assert parse_input(json.dumps(nested(20))) == nested(20)
    with pytest.raises(ToolInputError, match="nested deeper than 24 levels"):
        parse_input(json.dumps(nested(30)))


async def test_a_middleware_killed_mid_call_is_reported_as_gone(evil: Any, scripts: Path) -> None:
    """Its server exits after call_next (killed mid-call); the host's next write on the stream
    fails: the error says the server went away or the connection was lost, with the status (a
    write that found the call already ended said only "the stream is closed"; one that failed
    itself, only the status)."""
    proc = evil("--hooks", "on_reasoning")
    remote = await RemoteMiddleware(proc.address, policy=Policy(timeout=5)).connect()
    agent = Agent(model=OfflineRuleModel(reply_template=ANSWER, delay=0.5), middlewares=[remote])
    script(scripts, agent, exit_after_next=True)
    end = end_of(await reply(agent, "hi"))
    assert end.finished_reason == ReplyFinishedReason.ERROR
    gone = "middleware 'Evil' failed in on_reasoning: the server went away or the connection was lost (UNAVAILABLE: "
    assert gone in end.error.message, end.error.message
    await remote.close()


@pytest.mark.parametrize("fail_open", [True, False], ids=["fail_open", "fail_closed"])
async def test_a_watcher_that_stops_reading_its_copies_ends_the_call_within_the_timeout(
    evil: Any, scripts: Path, fail_open: bool
) -> None:
    """Observed copies are written in the background, several to a message: a middleware that asks
    for them and then stops reading fills the stream until the host's write blocks. That write is
    bounded like any other: the call fails (fail_closed: the reply ends with the error) or is
    bypassed (fail_open: the reply completes), within the timeout."""
    proc = evil("--default-mode", "observe")
    remote = await RemoteMiddleware(proc.address, policy=Policy(timeout=TIMEOUT, fail_open=fail_open)).connect()
    words = " ".join(f"{i:04d}" + "x" * 16000 for i in range(600))  # ~10 MB of deltas: more than the windows
    agent = Agent(model=OfflineRuleModel(reply_template=words), middlewares=[remote])
    script(scripts, agent, stop_after_next=True)
    start = time.monotonic()
    items = await reply(agent, "a long answer")
    assert time.monotonic() - start < TIMEOUT * 5
    end = end_of(items)
    if fail_open:
        assert end.finished_reason == ReplyFinishedReason.COMPLETED and items[-1].text == words
    else:
        assert end.finished_reason == ReplyFinishedReason.ERROR
        assert f"could not send within {TIMEOUT:g}s (timeout)" in end.error.message, end.error.message
    await remote.close()


@pytest.mark.parametrize(("value", "yaml_text"), [(math.nan, ".nan"), (math.inf, ".inf"), (0.0, "0"), (-1.0, "-1")])
async def test_a_timeout_that_cannot_work_is_refused(value: float, yaml_text: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="finite number of seconds above 0"):
        Policy(timeout=value)
    yaml = tmp_path / "host.yaml"
    yaml.write_text(f"middleware:\n  - {{address: 127.0.0.1:1, timeout: {yaml_text}}}\n")
    with pytest.raises(ConfigError, match=r"middleware\[0\]\.timeout"):
        load_config(yaml, env={})


async def test_attach_refuses_a_nan_timeout_and_a_malformed_address(tmp_path: Path) -> None:
    """Both INVALID_ARGUMENT, saying why (a malformed address was PERMISSION_DENIED, 'not an
    allowed address', as if the form were right and the host refused it)."""
    with processes(tmp_path) as procs:
        host = procs.host(tmp_path / "s.db")
        async with grpc.aio.insecure_channel(host.address) as channel:
            for request, says in [
                (host_pb2.AttachMiddlewareRequest(address="127.0.0.1:1", timeout=math.nan), "finite number of seconds"),
                (host_pb2.AttachMiddlewareRequest(address="foo"), "address: 'foo' is not HOST:PORT"),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub(channel).AttachMiddleware(request, timeout=10)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
                assert says in info.value.details(), info.value.details()


# -- 3. bounded output ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("limits", "size", "what"),
    [({"max_items": 300}, 8, "emitted more than 300 items"), ({"max_bytes": 1 << 20}, 20_000, "sent more than")],
    ids=["items", "bytes"],
)
async def test_a_runaway_emitter_is_stopped(evil: Any, scripts: Path, limits: dict, size: int, what: str) -> None:
    proc = evil()
    remote = await RemoteMiddleware(proc.address, policy=Policy(timeout=5, **limits)).connect()
    agent = make_agent(remote)
    script(scripts, agent, flood={"size": size})
    end = end_of(await reply(agent, "hi"))
    assert end.finished_reason == ReplyFinishedReason.ERROR
    assert "middleware 'Evil' failed in on_reply" in end.error.message and what in end.error.message
    await remote.close()


async def test_cancelling_a_reply_stops_its_hook_call(evil: Any, scripts: Path) -> None:
    proc = evil()
    remote = await RemoteMiddleware(proc.address, policy=Policy(timeout=5)).connect()
    agent = make_agent(remote)
    script(scripts, agent, flood={})
    seen = 0

    async def consume() -> None:
        nonlocal seen
        async for item in agent.reply_stream(UserMsg("hi")):
            seen += isinstance(item, CustomEvent)

    task = asyncio.create_task(consume())
    async with asyncio.timeout(10):
        while seen < 50:
            await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    marker = scripts / f"{agent.state.session_id}.cancelled"
    async with asyncio.timeout(5):  # the middleware sees its stream cancelled
        while not marker.exists():
            await asyncio.sleep(0.02)
    await remote.close()


# -- 4. only legal items per hook position ----------------------------------------------------------


ILLEGAL = {
    "chat_response": {"chatResponse": {"content": [{"text": {"text": "model chunk"}}]}},
    "tool_response": {"toolResponse": {"content": [{"text": {"text": "tool output"}}]}},
}


@pytest.mark.parametrize("kind", sorted(ILLEGAL))
async def test_on_reply_cannot_yield_model_chunks_or_tool_responses(evil: Any, scripts: Path, kind: str) -> None:
    proc = evil()
    remote = await RemoteMiddleware(proc.address, policy=Policy(timeout=5)).connect()
    agent = make_agent(remote)
    script(scripts, agent, messages=[{"actions": [{"emit": {"item": ILLEGAL[kind]}}]}])
    items = await reply(agent, "hi")
    end = end_of(items)
    assert end.finished_reason == ReplyFinishedReason.ERROR
    name = {"chat_response": "ChatResponse", "tool_response": "ToolResponse"}[kind]
    assert f"protocol violation: on_reply cannot yield {name}" in end.error.message, end.error.message
    await remote.close()


@tool(description="Send an email.", needs_confirmation=True)
def send_email(to: str, body: str) -> str:
    return f"sent to {to}: {body}"


async def test_an_on_reply_override_cannot_start_a_new_reply_over_a_parked_one(evil: Any, scripts: Path) -> None:
    """A reply parks on a confirmation; the client answers it, and the on_reply middleware calls next
    with a new user message instead. The core refuses it (as AgentScope's _reply_impl does), the
    reply ends with an error (this middleware then finishes with no item: the grammar's error), and
    the parked call gets an error result. Before, the core started a new reply over it: the call was
    left without a result for good, and every later model request of the session carried an
    unanswered tool call (which real providers refuse)."""
    proc = evil()
    remote = await RemoteMiddleware(proc.address, policy=Policy(timeout=5)).connect()
    agent = Agent(model=OfflineRuleModel(), toolkit=Toolkit([send_email]), middlewares=[remote])
    parked = await reply(agent, 'call send_email {"to": "bob", "body": "hi"}')
    ask = next(i for i in parked if isinstance(i, RequireUserConfirmEvent))
    message = {"id": "injected", "name": "user", "role": "ROLE_USER", "content": [{"text": {"id": "b1", "text": "hi"}}]}
    script(scripts, agent, messages=[{"callNext": {"overrides": {"onReply": {"message": message}}}}])
    answer = ConfirmResult(confirmed=True, tool_call=ask.tool_calls[0])
    items = []
    async with asyncio.timeout(30):
        async for item in agent.reply_stream(UserConfirmResultEvent(reply_id=ask.reply_id, confirm_results=[answer])):
            items.append(item)
    end = end_of(items)
    assert end.finished_reason == ReplyFinishedReason.ERROR
    blocks = [b for m in agent.state.context for b in m.content]
    calls = {b.id for b in blocks if b.type == "tool_call"}
    results = {b.id: b for b in blocks if isinstance(b, ToolResultBlock)}
    assert calls == set(results) == {ask.tool_calls[0].id}, (calls, set(results))
    assert results[ask.tool_calls[0].id].state == ToolResultState.ERROR
    assert not agent.awaiting_calls()
    assert "injected" not in {m.id for m in agent.state.context}
    await remote.close()


async def test_a_model_response_holding_a_tool_result_is_refused(evil: Any, scripts: Path) -> None:
    """on_model_call answers with a response that holds a tool_result block (which no model makes:
    types.proto ChatResponse). The reply ends with an error naming the middleware, and nothing of
    it enters the session. Before, the result was saved as the assistant's turn: a result without
    its call in the session for good (a context real providers refuse)."""
    proc = evil("--hooks", "on_model_call")
    remote = await RemoteMiddleware(proc.address, policy=Policy(timeout=5)).connect()
    agent = make_agent(remote)
    forged = {"toolResult": {"id": "forged", "name": "add", "outputText": "42"}}
    response = {"content": [forged, {"text": {"id": "t1", "text": "hi"}}], "isLast": True}
    script(scripts, agent, messages=[{"actions": [{"emit": {"item": {"chatResponse": response}}}]}])
    end = end_of(await reply(agent, "hi"))
    assert end.finished_reason == ReplyFinishedReason.ERROR
    assert "holds a tool_result block" in end.error.message, end.error.message
    assert "on_model_call middleware 'Evil'" in end.error.message, end.error.message
    blocks = [b for m in agent.state.context for b in m.content]
    assert not [b for b in blocks if isinstance(b, ToolResultBlock)]
    await remote.close()


# -- 5. nothing a middleware sends reaches a client in a message a default client refuses ------------


async def default_client_reply(address: str, session_id: str) -> list[Any]:
    """A reply read as any gRPC client with default options reads it (4 MiB per message at most)."""
    start = host_pb2.StartReply(session_id=session_id)
    codec.encode(UserMsg("hi"), start.message)
    items = []
    async with grpc.aio.insecure_channel(address) as channel:
        async for event in stub(channel).Reply(iter([host_pb2.ReplyRequest(start=start)]), timeout=30):
            assert event.session_id == session_id
            items += [codec.decode_item(i) for i in event.items]
    return items


def big(name: str, size: int) -> dict[str, Any]:
    return {"emit": {"item": {"custom": {"name": name, "value": {"pad": "x" * size}}}}}


async def test_what_a_middleware_sends_reaches_a_default_client(evil: Any, scripts: Path, tmp_path: Path) -> None:
    """Through a real host, read by a client with gRPC's default 4 MiB limit per message:
    - 40 items of 100 kB emitted at once arrive (over several ReplyEvents): before, the host put
      them in one message of 8 MB, which the client refused (RESOURCE_EXHAUSTED) without having seen
      even the session id;
    - an item of 2.5 MB, over the middleware's max_item_bytes, ends the reply with an error naming
      the middleware; a slot value as large, the same: before, the item broke the client's stream,
      and the slot made every later GetSession of the session fail."""
    proc = evil()
    with processes(tmp_path) as procs:
        host = procs.host(tmp_path / "s.db", "--middleware", f"evil={proc.address}")
        (scripts / "many.json").write_text(
            json.dumps({"messages": [{"actions": [big(f"e{i}", 100_000) for i in range(40)]}]})
        )
        items = await default_client_reply(host.address, "many")
        assert [i.name for i in items if isinstance(i, CustomEvent)] == [f"e{i}" for i in range(40)]

        (scripts / "one.json").write_text(json.dumps({"messages": [{"actions": [big("one", 2_500_000)]}]}))
        end = end_of(await default_client_reply(host.address, "one"))
        assert end.finished_reason == ReplyFinishedReason.ERROR
        assert "middleware 'evil' failed in on_reply: emitted an item of" in end.error.message, end.error.message
        assert "(limit 2097152)" in end.error.message

        slot = {"mutate": {"setSlot": {"pad": "x" * 2_500_000}}}
        (scripts / "slot.json").write_text(json.dumps({"messages": [{"actions": [slot]}]}))
        end = end_of(await default_client_reply(host.address, "slot"))
        assert "set a slot of" in end.error.message, end.error.message
        async with grpc.aio.insecure_channel(host.address) as channel:
            session = await stub(channel).GetSession(host_pb2.GetSessionRequest(session_id="slot"), timeout=10)
        assert json.loads(session.middle_context_json or "{}") == {}


async def test_a_tool_chunk_over_the_item_limit_is_an_error_result(evil: Any, tmp_path: Path) -> None:
    path = tmp_path / "tools.json"
    path.write_text(json.dumps([{"name": "huge", "inputSchema": {"type": "object"}}]))
    proc = evil("--tools", str(path), "--hooks", "on_check_permission")
    remote = await RemoteMiddleware(proc.address, policy=Policy(timeout=5)).connect()
    toolkit = Toolkit()
    await add_middleware_tools(toolkit, remote)
    agent = Agent(
        model=OfflineRuleModel(script=[{"tool_calls": [{"name": "Evil__huge", "input": {}}]}, {"text": "ok"}]),
        toolkit=toolkit,
    )
    async with asyncio.timeout(30):
        items = [item async for item in agent.reply_stream(UserMsg("go"))]
    assert end_of(items).finished_reason == ReplyFinishedReason.COMPLETED
    (stored,) = [b for m in agent.state.context for b in m.content if isinstance(b, ToolResultBlock)]
    text = block_text(stored.output)
    assert "failed in CallTool: a tool sent a chunk of" in text and "(limit 2097152)" in text, text
    await remote.close()


MB5 = "x" * 5_000_000
THREE_BLOCKS = [{"text": {"id": f"b{i}", "text": "x" * 1_900_000}} for i in range(3)]  # each within 2 MiB
USER_MSG = {"id": "m", "name": "user", "role": "ROLE_USER", "content": [{"text": {"id": "b", "text": MB5}}]}


@pytest.mark.parametrize(
    ("hook", "message", "says"),
    [
        (
            "on_model_call",
            {"finish": {"result": {"chatResponse": {"content": [{"text": {"text": MB5}}]}}}},
            "finished with a result of",
        ),
        ("on_reply", {"actions": [{"mutate": {"appendMessage": USER_MSG}}]}, "sent a change (append_message) of"),
        ("on_reply", {"callNext": {"overrides": {"onReply": {"message": USER_MSG}}}}, "sent call_next overrides of"),
        (  # each change within the limit, together not (before: a 5.7 MB session)
            "on_reply",
            {"actions": [{"mutate": {"appendBlocks": {"blocks": [block]}}} for block in THREE_BLOCKS]},
            "its changes of the session in one call add up to",
        ),
    ],
    ids=["finish_result", "append_message", "call_next_overrides", "changes_together"],
)
async def test_whatever_a_middleware_sends_to_be_stored_is_within_its_item_limit(
    evil: Any, scripts: Path, hook: str, message: dict, says: str
) -> None:
    """Each way of getting content into the session (a returned model response, a context change,
    all of one call's changes together, a reply's inputs replaced) is held to max_item_bytes, as
    emitted items are: before, 5 MB went into the session, after which no default client could
    read it (GetSession, RESOURCE_EXHAUSTED)."""
    proc = evil("--hooks", hook)
    remote = await RemoteMiddleware(proc.address, policy=Policy(timeout=5)).connect()
    agent = make_agent(remote)
    script(scripts, agent, messages=[message])
    end = end_of(await reply(agent, "hi"))
    assert end.finished_reason == ReplyFinishedReason.ERROR
    assert f"middleware 'Evil' failed in {hook}: {says}" in end.error.message, end.error.message
    assert "(limit 2097152)" in end.error.message
    # Nothing of it stored beyond the limit (one change of the three may be: within it).
    assert sum(codec.encode(m).ByteSize() for m in agent.state.context) < 2_097_152 + 100_000
    await remote.close()


async def test_a_fail_message_reaches_the_client_clipped(evil: Any, scripts: Path) -> None:
    """A Fail's message goes into the reply's error, which a client receives: it is clipped (8192
    characters, saying how much more there was). Before, 5 MB broke a default client's stream."""
    proc = evil()
    remote = await RemoteMiddleware(proc.address, policy=Policy(timeout=5)).connect()
    agent = make_agent(remote)
    script(scripts, agent, messages=[{"fail": {"type": "T" * 1000, "message": MB5}}])
    items = await reply(agent, "hi")
    end = end_of(items)
    # Where it was raised is kept at the end of the clipped text (8192 characters, saying how much
    # more there was).
    assert end.error.message.endswith(" more characters) (raised by middleware 'Evil' in on_reply)"), end.error.message[
        -80:
    ]
    assert len(end.error.message) <= 8192 + 40  # what a reply's error keeps, and how much more there was
    assert end.error.message.startswith("T" * 256 + "... (744 more characters): ")  # its type name, clipped
    assert "T" * 257 not in end.error.message
    await remote.close()


@pytest.mark.parametrize("fail_open", [False, True])
@pytest.mark.parametrize(
    ("hook", "message"),
    [
        ("on_model_call", {"finish": {"result": {"chatResponse": {"finishedReason": 999}}}}),
        ("on_check_permission", {"finish": {"result": {"permissionDecision": {"behavior": 999}}}}),
        ("on_reply", {"callNext": {"overrides": {"onReply": {"message": {"id": "m", "name": "u", "role": 999}}}}}),
    ],
    ids=["model_result", "permission", "overrides"],
)
async def test_an_enum_number_the_host_does_not_know_is_a_protocol_violation(
    evil: Any, scripts: Path, hook: str, message: dict, fail_open: bool
) -> None:
    """Before, a bare KeyError ended the reply: the middleware was not named, and fail_open did not
    bypass it."""
    proc = evil("--hooks", hook)
    remote = await RemoteMiddleware(proc.address, policy=Policy(timeout=5, fail_open=fail_open)).connect()
    agent = make_agent(remote)
    script(scripts, agent, messages=[message])
    items = await reply(agent, "call add a=1 b=2" if hook == "on_check_permission" else "hi")
    end = end_of(items)
    if fail_open:
        assert end.finished_reason == ReplyFinishedReason.COMPLETED, end.error
        assert remote.bypasses >= 1
    else:
        assert end.finished_reason == ReplyFinishedReason.ERROR
        assert f"middleware 'Evil' failed in {hook}: protocol violation: malformed" in end.error.message
        assert "unknown enum number 999" in end.error.message, end.error.message
    await remote.close()


async def test_an_unknown_error_type_in_a_fail_is_as_if_none(evil: Any, scripts: Path) -> None:
    proc = evil()
    remote = await RemoteMiddleware(proc.address, policy=Policy(timeout=5)).connect()
    agent = make_agent(remote)
    script(scripts, agent, messages=[{"fail": {"type": "Oops", "message": "no", "errorType": 999}}])
    end = end_of(await reply(agent, "hi"))
    assert end.error.type.value == "internal"
    assert "Oops: no (raised by middleware 'Evil' in on_reply)" in end.error.message
    await remote.close()


async def test_an_inner_middlewares_failure_is_not_blamed_on_the_one_around_it(evil: Any, scripts: Path) -> None:
    """A (a sound SDK middleware) wraps B, which hangs: A's code sees B's failure as its inner
    pipeline's and lets it through (fail from_inner). The reply's error names B, and A is not taken
    for hung: another session's reply through A is not refused. Before, A was marked unresponsive
    for B's hang, and every reply of every session failed with 'middleware 'A' ... not called until
    it answers again' (fail_open: A was bypassed)."""
    outer = middleware_server("tests.conformance_mw:Marker").start()
    inner = evil()
    a = await RemoteMiddleware(outer.address, name="A", policy=Policy(timeout=5)).connect()
    b = await RemoteMiddleware(inner.address, name="B", policy=Policy(timeout=0.5, fail_open=True)).connect()
    b_closed = await RemoteMiddleware(inner.address, name="B", policy=Policy(timeout=0.5)).connect()
    try:
        hung = Agent(model=OfflineRuleModel(reply_template=ANSWER), middlewares=[a, b_closed])
        script(scripts, hung, stop_reading=True)
        end = end_of(await reply(hung, "hi"))
        assert end.finished_reason == ReplyFinishedReason.ERROR
        assert "middleware 'B' failed in on_reply: no answer" in end.error.message, end.error.message
        assert not a.unresponsive and not a.skipped()
        other = Agent(model=OfflineRuleModel(reply_template=ANSWER), middlewares=[a, b])
        items = await reply(other, "hi")
        assert end_of(items).finished_reason == ReplyFinishedReason.COMPLETED, end_of(items).error
        assert [i.name for i in items if isinstance(i, CustomEvent)] == ["marker"]
    finally:
        for remote in (a, b, b_closed):
            await remote.close()
        outer.stop()


async def test_removing_a_block_that_compression_dropped_is_no_violation(evil: Any, scripts: Path) -> None:
    """A middleware adds a block; later the oldest messages are dropped, that block with them (and
    its owner record); then the middleware removes it. Nothing to remove: as in-process
    (state.remove_block finds nothing), not a protocol violation blaming the middleware, which
    failed the reply before."""
    proc = evil()
    remote = await RemoteMiddleware(proc.address, policy=Policy(timeout=5)).connect()
    agent = make_agent(remote)
    add = {"mutate": {"appendBlocks": {"blocks": [{"text": {"id": "b1", "text": "mine"}}]}}}
    script(scripts, agent, at_done=[{"actions": [add]}])
    assert end_of(await reply(agent, "first")).finished_reason == ReplyFinishedReason.COMPLETED
    drop_then_remove = [{"mutate": {"dropMessages": 2}}, {"mutate": {"removeBlock": "b1"}}]
    script(scripts, agent, at_done=[{"actions": drop_then_remove}])
    end = end_of(await reply(agent, "second"))
    assert end.finished_reason == ReplyFinishedReason.COMPLETED, end.error
    assert [m.text for m in agent.state.context if m.role.value == "user"] == ["second"]
    await remote.close()


async def test_a_retry_of_a_message_compression_dropped_is_refused(evil: Any, scripts: Path, tmp_path: Path) -> None:
    """Two turns; the second one's middleware drops the oldest two messages (as compression does),
    the first user message among them. The client then sends that first message again: it was
    answered, so ALREADY_EXISTS (and the session keeps its one answer), as for any answered message.
    Before, its id was no longer in the context: it was stored and answered again (its tools run
    again)."""
    proc = evil()
    with processes(tmp_path) as procs:
        host = procs.host(tmp_path / "s.db", "--middleware", f"evil={proc.address}")
        first, second = UserMsg("first question"), UserMsg("second question")
        async with HostClient(host.address) as client:
            async for _ in client.reply("dropped", first):
                pass
            (scripts / "dropped.json").write_text(
                json.dumps({"at_done": [{"actions": [{"mutate": {"dropMessages": 2}}]}]})
            )
            async for _ in client.reply("dropped", second):
                pass
            (scripts / "dropped.json").unlink()
            with pytest.raises(grpc.aio.AioRpcError) as again:
                async for _ in client.reply("dropped", first):
                    pass
        assert again.value.code() == grpc.StatusCode.ALREADY_EXISTS, again.value
        _, state, _ = await get_session(host.address, "dropped")
    assert [m.text for m in state.context if m.role.value == "user"] == ["second question"]


async def test_a_pass_through_that_finishes_with_none_passes_an_inner_response_on(evil: Any) -> None:
    """A middleware written from the protos as a pass-through on_model_call (it forwards every item,
    then finishes with no result) over a layer that returns one whole ChatResponse: since that
    response travels in InnerDone.result, not as an item, finish{} passes it on (the inner
    pipeline's output), and the client gets its text. Before, the reply failed: 'returned an
    empty streaming response', blaming the model."""
    from .conformance_mw import ReturnsResponse

    proc = evil("--hooks", "on_model_call")
    remote = await RemoteMiddleware(proc.address, policy=Policy(timeout=5)).connect()
    agent = Agent(model=OfflineRuleModel(), middlewares=[remote, ReturnsResponse()])
    items = await reply(agent, "hi")
    assert end_of(items).finished_reason == ReplyFinishedReason.COMPLETED, end_of(items).error
    assert "".join(i.delta for i in items if type(i).__name__ == "TextBlockDeltaEvent") == "canned reply"
    await remote.close()


async def test_a_model_stream_without_its_last_chunk_names_the_middleware(evil: Any, scripts: Path) -> None:
    """An on_model_call middleware answers with a stream of text chunks and no last one
    (is_last), never calling the model: the reply's error names the middleware. Before, it said
    the model had returned an empty streaming response."""
    proc = evil("--hooks", "on_model_call")
    remote = await RemoteMiddleware(proc.address, policy=Policy(timeout=5)).connect()
    agent = make_agent(remote)
    chunk = {"chatResponse": {"content": [{"text": {"text": "made up"}}]}}
    script(scripts, agent, messages=[{"actions": [{"emit": {"item": chunk}}]}])
    end = end_of(await reply(agent, "hi"))
    assert end.finished_reason == ReplyFinishedReason.ERROR, end
    assert end.error.message == (
        "ReplyError: the response stream of the call to model 'offline' had no last chunk (is_last) "
        "(on_model_call middleware 'Evil')"
    ), end.error
    await remote.close()


# -- 6. tool descriptors, health, restarts ----------------------------------------------------------


BAD_TOOLS = {
    "schema": ([{"name": "t", "inputSchema": {"type": "no-such-type"}}], "input_schema: not a valid JSON schema"),
    # A reference outside the schema: jsonschema would fetch it at each call, blocking the host's loop
    # (every session waited on a slow URL), and a file's content reached the tool result.
    "url_ref": (
        [{"name": "t", "inputSchema": {"properties": {"a": {"$ref": "http://127.0.0.1:9/a.json"}}}}],
        "input_schema: $ref 'http://127.0.0.1:9/a.json' is not within the schema",
    ),
    "file_ref": (
        [{"name": "t", "inputSchema": {"properties": {"a": {"$ref": "file:///etc/hostname"}}}}],
        "input_schema: $ref 'file:///etc/hostname' is not within the schema",
    ),
    # Accepted before, it failed every reply that called the tool with a bare PointerToNowhere.
    "dangling_ref": (
        [{"name": "t", "inputSchema": {"properties": {"a": {"$ref": "#/$defs/none"}}}}],
        "input_schema: $ref '#/$defs/none' points to nothing in the schema",
    ),
    "name": ([{"name": "has space"}], "not 1-64 of [a-zA-Z0-9_-]"),
    "empty_name": ([{"name": ""}], "an empty name"),  # registered as "Evil__" before
    # accepted before: every model request offering it would be refused by an OpenAI-style provider
    "array_input": ([{"name": "t", "inputSchema": {"type": "array"}}], "input_schema is of type 'array'"),
    "long_name": ([{"name": "x" * 70}], "not 1-64 of"),
    "duplicate": ([{"name": "t"}, {"name": "t"}], "listed twice"),
    "size": ([{"name": "t", "description": "d" * 300_000}], "bytes (limit 262144)"),
    "count": ([{"name": f"t{i}"} for i in range(129)], "one too many: a middleware lists at most 128 tools"),
}


@pytest.mark.parametrize("case", sorted(BAD_TOOLS))
async def test_tool_descriptors_are_checked_at_attach(evil: Any, tmp_path: Path, case: str) -> None:
    tools, error = BAD_TOOLS[case]
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(tools))
    proc = evil("--tools", str(path))
    remote = RemoteMiddleware(proc.address, policy=Policy(timeout=5))
    with pytest.raises(Exception, match="middleware 'Evil' failed in ListTools") as info:
        await remote.connect()  # describing it lists its tools
    assert f"tool {tools[-1]['name']!r}" in str(info.value) and error in str(info.value), info.value
    await remote.close()


@pytest.mark.parametrize(
    ("flags", "call", "says"),
    [
        (["--garbage-describe"], "Describe", "an answer that does not parse as a MiddlewareDescription"),
        ([], "ListTools", "an answer that does not parse as a ToolDescriptorList"),
    ],
    ids=["describe", "list_tools"],
)
async def test_an_answer_that_does_not_parse_is_a_protocol_violation_at_attach(
    evil: Any, tmp_path: Path, flags: list[str], call: str, says: str
) -> None:
    """Describe or ListTools answered with bytes that are no message: grpc.aio hands the host None.
    Before, the host read its fields and raised AttributeError, which no caller expects: the host
    did not start, and a required middleware attached later was dropped, its replies run without it."""
    path = tmp_path / "tools.json"
    path.write_text(json.dumps([{"name": "t"}]))
    path.with_suffix(".garbage").write_text("")
    remote = RemoteMiddleware(evil("--tools", str(path), *flags).address, policy=Policy(timeout=5))
    with pytest.raises(ProtocolError) as refused:
        await remote.connect()
    assert f"failed in {call}: protocol violation: {says}" in str(refused.value), refused.value  # named by address
    await remote.close()


@pytest.mark.parametrize(
    ("name", "schema", "says"),
    [
        # each a bare exception that failed the whole reply, or a stored result in state RUNNING
        ("garbage", {}, "failed in CallTool: protocol violation: an answer that does not parse as an Item"),
        ("running", {}, "failed in CallTool: protocol violation: a tool_response in state RUNNING"),
        ("progress_text", {}, "CallTool: protocol violation: a tool chunk whose metadata.mcp_progress is a str"),
        ("loop", {"$ref": "#"}, "tool 'loop' has an input schema whose $refs loop without end"),
    ],
)
async def test_a_tool_that_answers_what_cannot_be_a_result_gets_an_error_result_and_the_reply_goes_on(
    evil: Any, tmp_path: Path, name: str, schema: dict[str, Any], says: str
) -> None:
    path = tmp_path / "tools.json"
    path.write_text(json.dumps([{"name": name, "inputSchema": schema}]))
    remote = await RemoteMiddleware(evil("--tools", str(path)).address, policy=Policy(timeout=5)).connect()
    toolkit = Toolkit()
    await add_middleware_tools(toolkit, remote)
    model = OfflineRuleModel(script=[{"tool_calls": [{"name": f"Evil__{name}", "input": {}}]}, {"text": "ok"}])
    agent = Agent(model=model, toolkit=toolkit)
    async with asyncio.timeout(30):
        items = [item async for item in agent.reply_stream(UserMsg("go"))]
    assert end_of(items).finished_reason == ReplyFinishedReason.COMPLETED, end_of(items)
    (result,) = [e for e in items if isinstance(e, ToolResultEndEvent)]
    assert result.state == ToolResultState.ERROR
    (stored,) = [b for m in agent.state.context for b in m.content if isinstance(b, ToolResultBlock)]
    assert says in block_text(stored.output) and stored.state == ToolResultState.ERROR, stored
    await remote.close()


async def test_an_on_acting_response_in_state_running_is_a_protocol_violation(evil: Any, scripts: Path) -> None:
    """What on_acting yields ends the call as a tool's own response does: a response in state
    RUNNING is refused as from CallTool. Before, the client got ToolResultEndEvent(RUNNING), stored."""
    remote = await RemoteMiddleware(evil("--hooks", "on_acting").address, policy=Policy(timeout=5)).connect()
    agent = make_agent(remote, script=[{"tool_calls": [{"name": "add", "input": {"a": 1, "b": 2}}]}, {"text": "ok"}])
    running = {"toolResponse": {"state": "TOOL_RESULT_STATE_RUNNING"}}
    script(scripts, agent, messages=[{"actions": [{"emit": {"item": running}}]}])
    items = await reply(agent, "add them")
    assert not [e for e in items if isinstance(e, ToolResultEndEvent) and e.state == ToolResultState.RUNNING]
    end = end_of(items)
    assert end.finished_reason == ReplyFinishedReason.ERROR, end
    assert "protocol violation: a tool_response in state RUNNING" in end.error.message, end.error
    await remote.close()


async def test_a_tool_that_streams_without_end_is_cut_off_by_the_output_limit(evil: Any, tmp_path: Path) -> None:
    """A middleware's tool that never stops streaming chunks: the call fails once it passes the
    middleware's max_items (as a hook call does), the agent gets an error result naming it, the
    server's stream is cancelled and the reply completes. Before, only a hook call's output was
    bounded: the reply ran, and its stored result grew, until the client gave up."""
    path = tmp_path / "tools.json"
    path.write_text(json.dumps([{"name": "flood", "inputSchema": {"type": "object"}}]))
    proc = evil("--tools", str(path), "--hooks", "on_check_permission")
    remote = await RemoteMiddleware(proc.address, policy=Policy(timeout=5, max_items=200)).connect()
    toolkit = Toolkit()
    await add_middleware_tools(toolkit, remote)
    agent = Agent(
        model=OfflineRuleModel(script=[{"tool_calls": [{"name": "Evil__flood", "input": {}}]}, {"text": "ok"}]),
        toolkit=toolkit,
    )
    async with asyncio.timeout(30):
        items = [item async for item in agent.reply_stream(UserMsg("go"))]
    assert end_of(items).finished_reason == ReplyFinishedReason.COMPLETED
    (result,) = [e for e in items if isinstance(e, ToolResultEndEvent)]
    assert result.state == ToolResultState.ERROR
    (stored,) = [b for m in agent.state.context for b in m.content if isinstance(b, ToolResultBlock)]
    assert "middleware 'Evil' failed in CallTool: a tool sent more than 200 chunks" in block_text(stored.output), (
        stored.output
    )
    for _ in range(100):  # bounded: the cancel reaches the server at once
        if path.with_suffix(".cancelled").exists():
            break
        await asyncio.sleep(0.05)
    else:
        pytest.fail("the runaway tool call was not cancelled")
    await remote.close()


async def test_host_health_follows_a_fail_closed_middleware(tmp_path: Path) -> None:
    with processes(tmp_path) as procs:
        marker = procs.start(
            "marker", ["-m", "agentmw.sdk", "tests.conformance_mw:Marker", "--address", "127.0.0.1:{port}"]
        )
        host = procs.host(tmp_path / "s.db", "--middleware", f"marker={marker.address}")
        async with grpc.aio.insecure_channel(host.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)

            async def status_becomes(wanted: int) -> None:
                async with asyncio.timeout(15):
                    while (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status != wanted:
                        await asyncio.sleep(0.1)

            await status_becomes(health_pb2.HealthCheckResponse.SERVING)
            marker.kill()
            await status_becomes(health_pb2.HealthCheckResponse.NOT_SERVING)
            marker.restart()
            await status_becomes(health_pb2.HealthCheckResponse.SERVING)


async def test_the_reply_right_after_a_restart_waits_for_the_middleware() -> None:
    proc = middleware_server("tests.conformance_mw:Marker").start()
    try:
        remote = await RemoteMiddleware(proc.address, policy=Policy(timeout=5)).connect()
        agent = make_agent(remote)
        assert end_of(await reply(agent, "first")).finished_reason == ReplyFinishedReason.COMPLETED
        proc.kill()
        await asyncio.sleep(0.3)  # the channel notices: it is reconnecting now
        proc.restart()  # same port; no wait_ready: the reply itself waits, bounded by the timeout
        items = await reply(agent, "right after the restart")
        assert end_of(items).finished_reason == ReplyFinishedReason.COMPLETED, end_of(items).error
        assert any(isinstance(i, CustomEvent) and i.name == "marker" for i in items)
        await remote.close()
    finally:
        proc.stop()
