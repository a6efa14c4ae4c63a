"""Behaviour the host shares with AgentScope 2.0.11 (docs/behaviour.md), checked in-process.

What must also hold for remote middleware is in test_conformance.py (FIDELITY_CASES)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from agent_host.agent import Agent
from agent_host.config import ConfigError, load_config
from agent_host.models import OfflineRuleModel
from agent_host.runtime_state import SOURCE, TEMPLATE, RuntimeState
from agentmw.data import (
    CustomEvent,
    HintBlock,
    HintBlockEvent,
    ReplyStartEvent,
    ToolCallBlock,
    UserMsg,
)
from agentmw.data.state import AgentState
from agentmw.middleware import MiddlewareBase


class Clock:
    """A settable clock: injection is deterministic."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


class ReasoningSeen(MiddlewareBase):
    """Records the class of every item on_reasoning passes."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def on_reasoning(self, agent, input_kwargs, next_handler):
        async for item in next_handler():
            self.seen.append(type(item).__name__)
            yield item


def _time_hint(stamp: str, zone: str = "UTC") -> str:
    return TEMPLATE.replace("{runtime_state}", f"<current-time>{stamp}</current-time>\n<timezone>{zone}</timezone>")


async def test_runtime_state_is_injected_before_the_first_model_call() -> None:
    clock = Clock(datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC))
    watcher = ReasoningSeen()
    agent = Agent(model=OfflineRuleModel(), middlewares=[watcher], runtime_state=RuntimeState(clock=clock))
    events = [e async for e in agent.reply_stream(UserMsg("hi"))]
    names = [type(e).__name__ for e in events]
    assert names[:3] == ["ReplyStartEvent", "HintBlockEvent", "ModelCallStartEvent"]
    hint_event = events[1]
    assert hint_event.hint == _time_hint("2026-01-02T03:04:05") and hint_event.source == SOURCE
    reply = agent.state.context[-1]
    first = reply.content[0]
    assert isinstance(first, HintBlock) and first.id == hint_event.block_id and first.hint == hint_event.hint
    assert "HintBlockEvent" not in watcher.seen  # injected by the loop, outside on_reasoning

    clock.now += timedelta(minutes=10)  # the recorded time is recent: nothing new
    events = [e async for e in agent.reply_stream(UserMsg("again"))]
    assert not any(isinstance(e, HintBlockEvent) for e in events)
    clock.now += timedelta(minutes=30)  # 40 minutes since the recorded time: more than 0.5 h
    events = [e async for e in agent.reply_stream(UserMsg("later"))]
    hints = [e for e in events if isinstance(e, HintBlockEvent)]
    assert [h.hint for h in hints] == [_time_hint("2026-01-02T03:44:05")]


async def test_runtime_state_in_another_timezone_and_off_by_default() -> None:
    clock = Clock(datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC))
    agent = Agent(model=OfflineRuleModel(), runtime_state=RuntimeState(timezone="Asia/Shanghai", clock=clock))
    events = [e async for e in agent.reply_stream(UserMsg("hi"))]
    hint = next(e for e in events if isinstance(e, HintBlockEvent))
    assert hint.hint == _time_hint("2026-01-02T11:04:05", "Asia/Shanghai")
    plain = Agent(model=OfflineRuleModel())
    assert not [e async for e in plain.reply_stream(UserMsg("hi")) if isinstance(e, HintBlockEvent)]
    with pytest.raises(ValueError, match="unknown timezone"):
        RuntimeState(timezone="Mars/Olympus")


def test_runtime_state_host_config(tmp_path) -> None:
    path = tmp_path / "host.yaml"
    path.write_text("agent: {inject_runtime_state: true, timezone: Europe/Paris}\n")
    cfg = load_config(path, env={}, flags={})
    assert cfg.inject_runtime_state and cfg.timezone == "Europe/Paris"
    path.write_text("agent: {timezone: Nowhere/Land}\n")
    with pytest.raises(ConfigError, match=r"agent\.timezone"):
        load_config(path, env={}, flags={})


def test_a_fresh_state_has_a_reply_id() -> None:
    first, second = AgentState(), AgentState()
    assert first.reply_id and second.reply_id and first.reply_id != second.reply_id


def test_append_message_checks_the_role_rules() -> None:
    state = AgentState()
    bad = UserMsg("hi")
    bad.content.append(ToolCallBlock(id="c1", name="add", input="{}"))
    with pytest.raises(ValueError, match="a user message holds only text/data blocks, not tool_call"):
        state.append_message(bad)
    assert state.context == []
    state.append_message(UserMsg("fine"))
    assert [m.text for m in state.context] == ["fine"]


class AppendsBadMessage(MiddlewareBase):
    async def on_reasoning(self, agent, input_kwargs, next_handler):
        msg = UserMsg("look")
        msg.content.append(ToolCallBlock(id="c1", name="add", input="{}"))
        agent.state.append_message(msg)
        async for item in next_handler():
            yield item


async def test_a_middleware_appending_a_message_against_the_role_rules_fails_the_reply() -> None:
    agent = Agent(model=OfflineRuleModel(), middlewares=[AppendsBadMessage()])
    events = [e async for e in agent.reply_stream(UserMsg("hi"))]
    assert events[-2].finished_reason.value == "error" and "not tool_call" in events[-2].error.message
    assert not any(b.type == "tool_call" for m in agent.state.context if m.role.value == "user" for b in m.content)


class InjectsCustom(MiddlewareBase):
    def __init__(self, reply_id: str | None) -> None:
        self.reply_id = reply_id  # None: this reply's

    async def on_reply(self, agent, input_kwargs, next_handler):
        async for item in next_handler():
            yield item
            if isinstance(item, ReplyStartEvent):
                yield CustomEvent(name="note", reply_id=self.reply_id or item.reply_id)


async def test_a_custom_event_carries_this_replys_id_or_none() -> None:
    agent = Agent(model=OfflineRuleModel(), middlewares=[InjectsCustom(None)])
    events = [e async for e in agent.reply_stream(UserMsg("hi"))]
    assert events[1].reply_id == events[0].reply_id and events[-2].finished_reason.value == "completed"
    agent = Agent(model=OfflineRuleModel(), middlewares=[InjectsCustom("another-reply")])
    events = [e async for e in agent.reply_stream(UserMsg("hi"))]
    assert events[-2].finished_reason.value == "error"
    assert "CustomEvent of reply 'another-reply'" in events[-2].error.message


async def test_a_raising_function_tool_stores_its_message() -> None:
    from agentmw.tools import Toolkit, tool

    @tool(description="Always fails.")
    def broken(x: int) -> str:
        raise ValueError(f"x={x} is out of range")

    agent = Agent(model=OfflineRuleModel(), toolkit=Toolkit([broken]))
    events = [e async for e in agent.reply_stream(UserMsg("call broken x=7"))]
    assert [e.delta for e in events if type(e).__name__ == "ToolResultTextDeltaEvent"] == ["x=7 is out of range"]
    result = next(b for m in agent.state.context for b in m.content if b.type == "tool_result")
    assert result.state.value == "error" and [b.text for b in result.output] == ["x=7 is out of range"]
