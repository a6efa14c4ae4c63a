"""OfflineRuleModel's rule kinds: tool calls, text templates and simulated failures."""

from __future__ import annotations

from typing import Any

import pytest

from agent_host.agent import Agent
from agent_host.models import ModelRegistry, OfflineRuleModel
from agent_host.models.base import ModelError
from agentmw.data import (
    ErrorType,
    ModelCallEndEvent,
    Msg,
    ReplyEndEvent,
    ReplyFinishedReason,
    SystemMsg,
    ToolCallBlock,
    ToolChoice,
    UserMsg,
)
from agentmw.middleware import MiddlewareBase

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
RULES: list[dict[str, Any]] = [
    {"pattern": r"weather in (\w+)", "tool": "get_weather", "input": {"city": "{0}"}},
    {"pattern": r"what do you know about (?P<topic>\w+)", "text": "About {topic} ({0}): {system}"},
    {"pattern": r"simulate an? (outage|overload)", "error": {"type": "upstream", "message": "{0} down"}},
    {"pattern": r"throttle me", "error": {"type": "rate_limit", "message": "slow down", "retryable": False}},
    {"pattern": r"about", "text": "a later text rule: {text}"},
]


async def final(model: OfflineRuleModel, messages: list[Msg], tools: list[dict] | None = None, **kw: Any) -> Any:
    """The accumulated last chunk of one call."""
    chunks = [c async for c in await model(messages, tools, **kw)]
    assert chunks[-1].is_last
    return chunks[-1]


def text_of(response: Any) -> str:
    return "".join(getattr(b, "text", "") for b in response.content)


async def test_text_rule_answers_with_its_template() -> None:
    model = OfflineRuleModel(rules=RULES)
    messages = [SystemMsg("Be brief.\n## Current Context\nTime: noon"), UserMsg("What do you know about today?")]
    answer = await final(model, messages, [WEATHER])
    # named and positional groups, the system prompt; the first matching text rule wins
    assert text_of(answer) == "About today (today): Be brief.\n## Current Context\nTime: noon"
    assert answer.usage.output_tokens == len(text_of(answer).split())


async def test_text_rule_takes_the_user_text_and_empty_unmatched_groups() -> None:
    model = OfflineRuleModel(rules=[{"pattern": r"hi( there)?", "text": "[{0}] {text}"}])
    answer = await final(model, [UserMsg("hi")])
    assert text_of(answer) == "[] hi"


async def test_error_rule_fails_the_call_before_the_first_chunk() -> None:
    model = OfflineRuleModel(rules=RULES)
    with pytest.raises(ModelError) as info:
        await model([UserMsg("please simulate an outage")], [WEATHER])
    # the message is used as given (no template), upstream errors are retryable by default
    assert str(info.value) == "{0} down"
    assert info.value.error_type == ErrorType.UPSTREAM and info.value.retryable
    with pytest.raises(ModelError) as info:
        await model([UserMsg("throttle me")])
    assert info.value.error_type == ErrorType.RATE_LIMIT and not info.value.retryable
    assert model.calls == 2


async def test_tool_calls_come_before_text_and_error_rules() -> None:
    model = OfflineRuleModel(rules=RULES)
    answer = await final(model, [UserMsg("weather in Paris, or simulate an outage")], [WEATHER])
    calls = [b for b in answer.content if isinstance(b, ToolCallBlock)]
    assert [(c.name, c.input) for c in calls] == [("get_weather", '{"city": "Paris"}')]
    # without the tool offered (or with tool_choice none) the error rule applies
    with pytest.raises(ModelError):
        await model([UserMsg("weather in Paris, or simulate an outage")], [WEATHER], ToolChoice(mode="none"))
    with pytest.raises(ModelError):
        await model([UserMsg("weather in Paris, or simulate an outage")], [])


async def test_no_rule_matches_falls_back_to_the_reply_template() -> None:
    model = OfflineRuleModel(rules=RULES, reply_template="{text}! ({system})")
    answer = await final(model, [SystemMsg("sys"), UserMsg("hello")])
    assert text_of(answer) == "hello! (sys)"


async def test_script_and_tool_results_come_before_rules() -> None:
    model = OfflineRuleModel(rules=RULES, script=[{"text": "scripted"}])
    assert text_of(await final(model, [UserMsg("simulate an outage")])) == "scripted"
    agent = Agent(model=OfflineRuleModel(rules=RULES))
    items = [i async for i in agent.reply_stream(UserMsg("what do you know about cats?"))]
    assert items[-1].text == "About cats (cats): You are a helpful assistant."


@pytest.mark.parametrize(
    "rule, complaint",
    [
        ({"pattern": "x"}, "exactly one of"),
        ({"pattern": "x", "tool": "add", "text": "y"}, "exactly one of"),
        ({"text": "y"}, "'pattern'"),
        ({"pattern": "x", "error": "down"}, "expected a mapping"),
        ({"pattern": "x", "error": {"type": "meltdown"}}, "unknown 'meltdown'"),
        ({"pattern": "(", "text": "y"}, "rules[0].pattern"),
    ],
)
def test_malformed_rules_are_rejected(rule: dict, complaint: str) -> None:
    with pytest.raises(ValueError, match="rules\\[0\\]") as info:
        OfflineRuleModel(rules=[rule])
    assert complaint in str(info.value)


def test_a_malformed_rule_in_the_registry_config_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        spec = {"provider": "offline", "rules": [{"pattern": "x"}]}
        ModelRegistry.from_config({"default": "m", "models": {"m": spec}})


class Fallback(MiddlewareBase):
    async def on_model_call(self, agent: Any, input_kwargs: dict[str, Any], next_handler: Any) -> Any:
        try:
            return await next_handler()
        except ModelError:
            return await next_handler(current_model="backup")


async def test_an_error_rule_drives_a_fallback_to_another_model() -> None:
    registry = ModelRegistry(default="main")
    registry.add(OfflineRuleModel(id="main", rules=RULES))
    registry.add(OfflineRuleModel(id="backup", reply_template="backup: {text}"))
    agent = Agent(models=registry, middlewares=[Fallback()])
    items = [i async for i in agent.reply_stream(UserMsg("simulate an outage"))]
    ends = [i for i in items if isinstance(i, ModelCallEndEvent)]
    assert [e.metadata["model"] for e in ends] == ["backup"]
    assert items[-1].text == "backup: simulate an outage"
    assert next(i for i in items if isinstance(i, ReplyEndEvent)).finished_reason == ReplyFinishedReason.COMPLETED
    # without the middleware the reply fails
    plain = Agent(models=registry)
    items = [i async for i in plain.reply_stream(UserMsg("simulate an outage"))]
    end = next(i for i in items if isinstance(i, ReplyEndEvent))
    assert end.finished_reason == ReplyFinishedReason.ERROR and "{0} down" in end.error.message
