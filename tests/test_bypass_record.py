"""A fail_open middleware that fails is recorded in the reply: one CustomEvent "middleware_bypassed"
per failure, whatever the hook, after the reply's start (a resumed reply has none) and before its
end and final Msg. Real processes: tests/evil_mw.py (written from the protos) breaks the protocol in
one hook of one session; in-process agents, and a host process read by a client.

Before, only on_reply and on_reasoning recorded a bypass (inline, in their own stream): failures in
on_system_prompt, on_acting, on_model_call, on_check_permission and on_compress_context were only
counted; an on_reply bypass waited for a ReplyStartEvent, which a resumed reply never has; and one
after the final Msg had gone through it was dropped."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent_host.agent import Agent
from agent_host.models import OfflineRuleModel
from agent_host.remote import Policy, RemoteMiddleware
from agentmw.data import (
    ConfirmResult,
    CustomEvent,
    Msg,
    ReplyEndEvent,
    ReplyFinishedReason,
    ReplyStartEvent,
    RequireUserConfirmEvent,
    UserConfirmResultEvent,
    UserMsg,
)
from agentmw.hooks import HOOKS
from agentmw.tools import Toolkit
from agentmw.v1 import host_pb2
from clients.chat import HostClient
from clients.launch import ServerProcess

from .harness import add
from .host_util import processes, stub

# A message of an invocation that has not begun: a protocol violation at once (no timeout to wait).
BROKEN = {"pull": {}, "_id": "next"}
# Hooks each reply below reaches ("call add" makes a tool call: on_check_permission, on_acting).
ALL_HOOKS = sorted(HOOKS)


@pytest.fixture(scope="module")
def evil(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    """One tests/evil_mw.py serving every hook; a session's script there picks the hook it breaks."""
    scripts = tmp_path_factory.mktemp("scripts")
    argv = ["-m", "tests.evil_mw", "--scripts", str(scripts), "--hooks", ",".join(ALL_HOOKS)]
    proc = ServerProcess([*argv, "--address", "127.0.0.1:0"]).start()
    yield proc, scripts
    proc.stop()


def breaks(scripts: Path, session_id: str, hook: str, **script: Any) -> None:
    (scripts / f"{session_id}.json").write_text(json.dumps({"hooks": [hook], **(script or {"messages": [BROKEN]})}))


def bypasses(items: list[Any]) -> list[CustomEvent]:
    return [i for i in items if isinstance(i, CustomEvent) and i.name == "middleware_bypassed"]


def recorded_once(items: list[Any], hook: str, finished: ReplyFinishedReason, *, resumed: bool = False) -> None:
    """One record of ``hook``'s failure, where the grammar and the docs put it: after the start (a
    resumed reply: anywhere from its first item), before the end, with the reply's id."""
    (record,) = bypasses(items)
    assert record.value["middleware"] == "Evil" and record.value["hook"] == hook, record.value
    assert record.value["error"].startswith(f"middleware 'Evil' failed in {hook}: "), record.value
    (end,) = [i for i in items if isinstance(i, ReplyEndEvent)]
    assert end.finished_reason == finished, end.error
    assert isinstance(items[-1], Msg) and items.index(record) < items.index(end)
    assert record.reply_id == end.reply_id
    starts = [i for i in items if isinstance(i, ReplyStartEvent)]
    if resumed:
        assert not starts
    else:
        assert items.index(starts[0]) < items.index(record)


async def in_process(evil: tuple[ServerProcess, Path], hook: str, model: OfflineRuleModel, **script: Any) -> list:
    proc, scripts = evil
    remote = await RemoteMiddleware(proc.address, policy=Policy(fail_open=True, timeout=5)).connect()
    try:
        agent = Agent(model=model, toolkit=Toolkit([add]), middlewares=[remote])
        breaks(scripts, agent.state.session_id, hook, **script)
        items = [item async for item in agent.reply_stream(UserMsg("call add a=1 b=2"))]
        assert remote.bypasses >= 1
        return items
    finally:
        await remote.close()


@pytest.mark.parametrize("hook", ALL_HOOKS)
async def test_a_failure_in_any_hook_is_recorded_once(evil: tuple[ServerProcess, Path], hook: str) -> None:
    items = await in_process(evil, hook, OfflineRuleModel())
    recorded_once(items, hook, ReplyFinishedReason.COMPLETED)
    assert items[-1].text == "Done: add returned 3."  # the reply went on without it


async def test_an_on_reply_failure_after_the_final_msg_is_recorded_before_the_end(
    evil: tuple[ServerProcess, Path],
) -> None:
    """on_reply breaks the protocol at inner_done, after it forwarded the final Msg: the record
    goes before the ReplyEndEvent (held until the reply is over). Before, it was dropped."""
    at_done = [{"actions": [{"mutate": {"setCurIter": -1}}]}]
    items = await in_process(evil, "on_reply", OfflineRuleModel(), at_done=at_done)
    recorded_once(items, "on_reply", ReplyFinishedReason.COMPLETED)
    assert "set_cur_iter below 0" in bypasses(items)[0].value["error"]


async def test_a_failed_reply_keeps_the_record_of_an_earlier_bypass(evil: tuple[ServerProcess, Path]) -> None:
    """on_system_prompt is bypassed, then the model fails: the record still goes out, before the
    ReplyEndEvent(ERROR) that the host makes."""
    model = OfflineRuleModel(script=[{"error": {"type": "invalid_request"}}])
    items = await in_process(evil, "on_system_prompt", model)
    recorded_once(items, "on_system_prompt", ReplyFinishedReason.ERROR)


async def reply(client: HostClient, session_id: str, inputs: Any) -> list[Any]:
    return [item async for item in client.reply(session_id, inputs)]


async def bypass_count(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        listed = await stub(channel).ListMiddleware(host_pb2.ListMiddlewareRequest(), timeout=10)
    return sum(m.bypasses for m in listed.middleware)


async def test_the_host_sends_every_record_to_its_client(evil: tuple[ServerProcess, Path], tmp_path: Path) -> None:
    """Through a host process: an on_reply failure in a resumed reply (a confirmation answered),
    and a failure in each other hook; each reply's client gets its one record, and the host's
    bypass counter went up for each."""
    proc, scripts = evil
    config = tmp_path / "host.yaml"
    middleware = {"name": "Evil", "address": proc.address, "fail_open": True, "timeout": 5}
    config.write_text(
        json.dumps({"models": {"default": "m", "models": {"m": {"provider": "offline"}}}, "middleware": [middleware]})
    )
    with processes(tmp_path) as procs:
        host = procs.host(tmp_path / "s.db", "--config", str(config))
        async with HostClient(host.address) as client:
            parked = await reply(client, "resumed", UserMsg("call send_email to=bob body=hi"))
            assert not bypasses(parked)
            ask = next(i for i in parked if isinstance(i, RequireUserConfirmEvent))
            breaks(scripts, "resumed", "on_reply")
            before = await bypass_count(host.address)
            confirmed = [ConfirmResult(confirmed=True, tool_call=call) for call in ask.tool_calls]
            answer = UserConfirmResultEvent(reply_id=ask.reply_id, confirm_results=confirmed)
            items = await reply(client, "resumed", answer)
            recorded_once(items, "on_reply", ReplyFinishedReason.COMPLETED, resumed=True)
            assert items[0] is bypasses(items)[0] and items[0].reply_id == ask.reply_id
            assert await bypass_count(host.address) > before
            for hook in ALL_HOOKS:
                session_id = f"s_{hook}"
                breaks(scripts, session_id, hook)
                before = await bypass_count(host.address)
                items = await reply(client, session_id, UserMsg("call add a=1 b=2"))
                recorded_once(items, hook, ReplyFinishedReason.COMPLETED)
                assert items[-1].text == "Done: add returned 3."
                assert await bypass_count(host.address) > before
