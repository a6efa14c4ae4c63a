"""The ReAct loop in-process: max_iters, tool validation, HITL, external execution, compression."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from agent_host.agent import MAX_ITERS_HINT, Agent, InputRefused
from agent_host.models import OfflineRuleModel
from agentmw.data import (
    Base64Source,
    ChatResponse,
    ConfirmResult,
    ContextConfig,
    DataBlock,
    ExternalExecutionResultEvent,
    FinishedReason,
    HintBlock,
    ModelCallEndEvent,
    Msg,
    PermissionBehavior,
    PermissionDecision,
    PermissionRule,
    ReplyEndEvent,
    ReplyFinishedReason,
    ReplyStartEvent,
    RequireExternalExecutionEvent,
    RequireUserConfirmEvent,
    TextBlock,
    ToolCallBlock,
    ToolResultBlock,
    ToolResultEndEvent,
    ToolResultState,
    UserConfirmResultEvent,
    UserMsg,
)
from agentmw.middleware import MiddlewareBase
from agentmw.tools import Toolkit, tool

from .conformance_mw import ReturnsPlainIterators
from .harness import add


async def collect(agent: Agent, inputs: object) -> list:
    return [item async for item in agent.reply_stream(inputs)]


def tool_results(agent: Agent) -> list[ToolResultBlock]:
    return [b for m in agent.state.context for b in m.content if isinstance(b, ToolResultBlock)]


async def test_max_iters_forces_a_final_answer_without_tools() -> None:
    calls = [{"tool_calls": [{"name": "add", "input": {"a": i, "b": 1}}]} for i in range(5)]
    model = OfflineRuleModel(script=[*calls[:2], {"text": "giving up"}])
    agent = Agent(model=model, toolkit=Toolkit([add]), max_iters=2)
    items = await collect(agent, UserMsg("loop"))
    end = next(i for i in items if isinstance(i, ReplyEndEvent))
    assert end.finished_reason == ReplyFinishedReason.EXCEED_MAX_ITERS
    assert items[-1].text == "giving up"
    hints = [b for b in agent.state.context[-1].content if isinstance(b, HintBlock)]
    assert [h.hint for h in hints] == [MAX_ITERS_HINT.format(n=2)]


async def test_invalid_tool_input_and_unknown_tools_become_error_results() -> None:
    model = OfflineRuleModel(
        script=[
            {"tool_calls": [{"name": "add", "input": {"a": "not a number", "b": 1}}, {"name": "nope", "input": {}}]},
            {"text": "ok"},
        ]
    )
    agent = Agent(model=model, toolkit=Toolkit([add]))
    items = await collect(agent, UserMsg("x"))
    states = [i.state for i in items if isinstance(i, ToolResultEndEvent)]
    assert states == [ToolResultState.ERROR, ToolResultState.ERROR]
    outputs = [r.output for r in tool_results(agent)]
    assert "invalid input for tool 'add'" in outputs[0] and "'nope' does not exist" in outputs[1]
    assert items[-1].text == "ok"


@tool(description="Send an email.", needs_confirmation=True)
def send_email(to: str, body: str) -> str:
    return f"sent to {to}: {body}"


@tool(description="Look an order up in the shop's system.", is_external_tool=True)
def lookup_order(order_id: str) -> str:
    raise AssertionError("external tools never run in the host")


async def test_confirmation_parks_and_resumes_with_an_edited_input() -> None:
    agent = Agent(model=OfflineRuleModel(), toolkit=Toolkit([send_email]))
    items = await collect(agent, UserMsg('call send_email {"to": "bob", "body": "hi"}'))
    ask = next(i for i in items if isinstance(i, RequireUserConfirmEvent))
    assert not any(isinstance(i, ReplyEndEvent) for i in items)  # parked: no ReplyEndEvent
    call = ask.tool_calls[0]
    call.input = '{"to": "alice", "body": "hi"}'
    resumed = await collect(
        agent,
        UserConfirmResultEvent(reply_id=ask.reply_id, confirm_results=[ConfirmResult(confirmed=True, tool_call=call)]),
    )
    assert not any(isinstance(i, ReplyStartEvent) for i in resumed)
    assert tool_results(agent)[0].output[0].text == "sent to alice: hi"
    assert resumed[-1].text == "Done: send_email returned sent to alice: hi."


async def test_a_rule_given_with_a_confirmation_answers_the_next_such_call() -> None:
    """The user confirms with a rule ("allow send_email"): it is kept in the session's permission
    rules, so the next call of that tool runs without asking again."""
    agent = Agent(model=OfflineRuleModel(), toolkit=Toolkit([send_email]))
    items = await collect(agent, UserMsg('call send_email {"to": "bob", "body": "hi"}'))
    ask = next(i for i in items if isinstance(i, RequireUserConfirmEvent))
    rule = PermissionRule(tool_name="send_email", behavior=PermissionBehavior.ALLOW)
    answer = ConfirmResult(confirmed=True, tool_call=ask.tool_calls[0], rules=[rule])
    await collect(agent, UserConfirmResultEvent(reply_id=ask.reply_id, confirm_results=[answer]))
    again = await collect(agent, UserMsg('call send_email {"to": "carol", "body": "hi"}'))
    assert not any(isinstance(i, RequireUserConfirmEvent) for i in again)
    assert again[-1].text == "Done: send_email returned sent to carol: hi."


class DenyWithReason(MiddlewareBase):
    """Denies every tool call with its own message, and asks for send_email, suggesting a rule."""

    async def on_check_permission(self, agent, input_kwargs, next_handler):
        call = input_kwargs["tool_call"]
        if call.name == "send_email":
            rule = PermissionRule(tool_name="send_email", behavior=PermissionBehavior.ALLOW)
            return PermissionDecision(behavior=PermissionBehavior.ASK, suggested_rules=[rule])
        return PermissionDecision(behavior=PermissionBehavior.DENY, message="adding is off today")


async def test_a_permission_middlewares_denial_and_suggested_rules_reach_the_model_and_the_client() -> None:
    """A denial's own message is the tool result the model sees; rules the permission check
    suggests ride on the confirmation request to the client."""
    agent = Agent(model=OfflineRuleModel(), toolkit=Toolkit([add, send_email]), middlewares=[DenyWithReason()])
    await collect(agent, UserMsg('call add {"a": 1, "b": 2}'))
    (denied,) = tool_results(agent)
    assert denied.state == ToolResultState.DENIED and denied.output == "adding is off today", denied
    items = await collect(agent, UserMsg('call send_email {"to": "bob", "body": "hi"}'))
    ask = next(i for i in items if isinstance(i, RequireUserConfirmEvent))
    assert [(r.tool_name, r.behavior) for r in ask.tool_calls[0].suggested_rules] == [
        ("send_email", PermissionBehavior.ALLOW)
    ]


@pytest.mark.parametrize(
    ("name", "edited", "says"),
    [
        ("send_email", "{not json", "tool input is not valid JSON"),
        ("send_email", '{"body": "hi"}', "'to' is a required property"),
        ("no_such_tool", "{}", "tool 'no_such_tool' does not exist"),
    ],
)
async def test_a_confirmed_call_whose_edited_input_is_invalid_gets_an_error_result(
    name: str, edited: str, says: str
) -> None:
    """The user confirms with an edit the tool cannot take: an error result the model sees, as for
    a model's own invalid call. The agent took the confirmed (ALLOWED) call for one whose Start was
    already out, sent the result without one, and its own reply failed the event grammar
    (ReplyGrammarError: tool result 'call_1_0' was never started)."""
    agent = Agent(model=OfflineRuleModel(), toolkit=Toolkit([send_email]))
    items = await collect(agent, UserMsg('call send_email {"to": "bob", "body": "hi"}'))
    ask = next(i for i in items if isinstance(i, RequireUserConfirmEvent))
    call = ask.tool_calls[0]
    call.name, call.input = name, edited
    resumed = await collect(
        agent,
        UserConfirmResultEvent(reply_id=ask.reply_id, confirm_results=[ConfirmResult(confirmed=True, tool_call=call)]),
    )
    end = next(i for i in resumed if isinstance(i, ReplyEndEvent))
    assert end.finished_reason == ReplyFinishedReason.COMPLETED, resumed[-1].text
    kinds = [type(i).__name__ for i in resumed if type(i).__name__.startswith("ToolResult")]
    assert kinds == ["ToolResultStartEvent", "ToolResultTextDeltaEvent", "ToolResultEndEvent"]
    (result,) = tool_results(agent)
    assert result.state == ToolResultState.ERROR and says in result.output


async def test_inputs_the_parked_agent_cannot_take_are_refused_and_nothing_changes() -> None:
    """A new message while a call waits for its confirmation, or an answer for a call nobody asked
    about: reply_stream raises InputRefused before anything changes (AgentScope raises ValueError;
    the host answers FAILED_PRECONDITION), and the parked call can still be answered. Before, the
    message started a new reply over the unanswered call (a real model API refuses such a context)."""
    agent = Agent(model=OfflineRuleModel(), toolkit=Toolkit([send_email]))
    items = await collect(agent, UserMsg('call send_email {"to": "bob", "body": "hi"}'))
    ask = next(i for i in items if isinstance(i, RequireUserConfirmEvent))
    before = copy.deepcopy(agent.state)
    with pytest.raises(InputRefused, match=r"the reply is parked, waiting on send_email") as refused:
        await collect(agent, UserMsg("never mind, something else"))
    assert not refused.value.malformed
    # No inputs at all start a new reply too (AgentScope: no event while calls wait is a ValueError):
    # it used to run over the parked call, leaving it unanswered for good.
    with pytest.raises(InputRefused, match=r"the reply is parked, waiting on send_email"):
        await collect(agent, None)
    real = agent.awaiting_calls()[0]

    def answer(call: ToolCallBlock) -> UserConfirmResultEvent:
        return UserConfirmResultEvent(
            reply_id=ask.reply_id, confirm_results=[ConfirmResult(confirmed=True, tool_call=call)]
        )

    with pytest.raises(InputRefused, match="are not awaiting this answer"):
        await collect(agent, answer(dataclasses.replace(real, id="no-such-call")))
    assert agent.state == before
    resumed = await collect(agent, answer(real))
    assert resumed[-1].text == "Done: send_email returned sent to bob: hi."


async def test_an_answer_for_another_reply_or_twice_for_one_call_is_refused() -> None:
    """A confirmation of an earlier reply sent again, when the parked reply's call has the same id
    (a model may use an id again: the offline model after a host restart): refused, nothing runs.
    Before, the old call's input replaced the new call's and ran a second time. Answering one call
    twice in one event: refused (both answers were stored)."""
    agent = Agent(model=OfflineRuleModel(), toolkit=Toolkit([send_email]))
    first = next(
        i
        for i in await collect(agent, UserMsg('call send_email {"to": "bob", "body": "one"}'))
        if isinstance(i, RequireUserConfirmEvent)
    )

    def confirm(ask: RequireUserConfirmEvent, *calls: ToolCallBlock) -> UserConfirmResultEvent:
        results = [ConfirmResult(confirmed=True, tool_call=c) for c in calls]
        return UserConfirmResultEvent(reply_id=ask.reply_id, confirm_results=results)

    await collect(agent, confirm(first, first.tool_calls[0]))
    agent.model.calls = 0  # as a restarted host's model: its call ids start again
    second = next(
        i
        for i in await collect(agent, UserMsg('call send_email {"to": "carol", "body": "two"}'))
        if isinstance(i, RequireUserConfirmEvent)
    )
    assert second.tool_calls[0].id == first.tool_calls[0].id
    before = copy.deepcopy(agent.state)
    with pytest.raises(InputRefused, match="is not the parked one"):
        await collect(agent, confirm(first, first.tool_calls[0]))
    with pytest.raises(InputRefused, match="answered more than once"):
        await collect(agent, confirm(second, second.tool_calls[0], second.tool_calls[0]))
    assert agent.state == before
    resumed = await collect(agent, confirm(second, second.tool_calls[0]))
    assert resumed[-1].text == "Done: send_email returned sent to carol: two."
    assert [r.output[0].text for r in tool_results(agent)] == ["sent to bob: one", "sent to carol: two"]


async def test_denied_confirmation_is_a_denied_result() -> None:
    agent = Agent(model=OfflineRuleModel(), toolkit=Toolkit([send_email]))
    items = await collect(agent, UserMsg('call send_email {"to": "bob", "body": "hi"}'))
    ask = next(i for i in items if isinstance(i, RequireUserConfirmEvent))
    await collect(
        agent,
        UserConfirmResultEvent(
            reply_id=ask.reply_id, confirm_results=[ConfirmResult(confirmed=False, tool_call=ask.tool_calls[0])]
        ),
    )
    assert tool_results(agent)[0].state == ToolResultState.DENIED


async def test_external_execution_round_trip() -> None:
    agent = Agent(model=OfflineRuleModel(), toolkit=Toolkit([lookup_order]))
    items = await collect(agent, UserMsg("call lookup_order order_id=A17"))
    ask = next(i for i in items if isinstance(i, RequireExternalExecutionEvent))
    result = ToolResultBlock(
        id=ask.tool_calls[0].id, name="lookup_order", output=[TextBlock(text="shipped")], state=ToolResultState.SUCCESS
    )
    resumed = await collect(agent, ExternalExecutionResultEvent(reply_id=ask.reply_id, execution_results=[result]))
    assert resumed[-1].text == "Done: lookup_order returned shipped."


class SwallowEveryEnd(MiddlewareBase):
    async def on_reply(self, agent, input_kwargs, next_handler):
        async for item in next_handler():
            if not isinstance(item, ReplyEndEvent):
                yield item


async def test_swallowing_every_end_stops_with_an_error_not_a_loop() -> None:
    agent = Agent(model=OfflineRuleModel(), middlewares=[SwallowEveryEnd()], max_iters=3)
    items = await collect(agent, UserMsg("x"))
    assert isinstance(items[-1], Msg) and items[-1].error is not None
    assert "swallowed twice" in items[-1].error.message


class CountCompress(MiddlewareBase):
    calls = 0

    async def on_compress_context(self, agent, input_kwargs, next_handler):
        CountCompress.calls += 1
        await next_handler()


async def test_context_is_compressed_into_a_summary_past_the_trigger() -> None:
    model = OfflineRuleModel(context_size=400)
    agent = Agent(model=model, middlewares=[CountCompress()], context_config=ContextConfig(trigger_ratio=0.5))
    for i in range(6):
        await collect(agent, UserMsg(f"message number {i} " + "padding " * 20))
    assert agent.state.summary.startswith("Summary of")
    assert "message number 0" in agent.state.summary
    assert len(agent.state.context) < 12 and CountCompress.calls >= 6


async def test_context_below_the_trigger_is_left_whole() -> None:
    """Below trigger_ratio nothing is summarized, though the older messages are past what
    reserve_ratio would keep: the trigger alone decides when to compress."""
    model = OfflineRuleModel(context_size=100_000)
    config = ContextConfig(trigger_ratio=0.9, reserve_ratio=0.0001)  # reserve: about 10 tokens
    agent = Agent(model=model, context_config=config)
    for i in range(3):
        await collect(agent, UserMsg(f"message number {i} " + "padding " * 20))
    assert agent.state.summary == ""
    assert len(agent.state.context) == 6  # each message and its answer


class SpeakingModel(MiddlewareBase):
    """on_model_call answering with text, then audio (a base64 data block), as an omni model does."""

    async def on_model_call(self, agent, input_kwargs, next_handler):
        audio = DataBlock(source=Base64Source(data="UklGRg==", media_type="audio/wav"), name="speech")

        async def chunks():
            yield ChatResponse(content=[TextBlock(text="Hello")], is_last=False)
            yield ChatResponse(content=[audio], is_last=False)
            yield ChatResponse(content=[TextBlock(text="Hello"), audio], is_last=True)

        return chunks()


async def test_audio_a_model_streams_is_a_data_block_of_the_reply() -> None:
    """A model's base64 data block (audio) streams as DataBlockStart/Delta/End. A chunk with data
    does not end the open text block (AgentScope's conversion), so both end with the call, text first."""
    agent = Agent(model=OfflineRuleModel(), middlewares=[SpeakingModel()])
    items = await collect(agent, UserMsg("say hello"))
    names = [type(i).__name__ for i in items if "Block" in type(i).__name__]
    assert names == [
        "TextBlockStartEvent",
        "TextBlockDeltaEvent",
        "DataBlockStartEvent",
        "DataBlockDeltaEvent",
        "TextBlockEndEvent",
        "DataBlockEndEvent",
    ], names
    (delta,) = [i for i in items if type(i).__name__ == "DataBlockDeltaEvent"]
    assert (delta.data, delta.media_type) == ("UklGRg==", "audio/wav")


def test_unimplemented_hooks_are_not_in_any_chain() -> None:
    agent = Agent(model=OfflineRuleModel(), middlewares=[SwallowEveryEnd()])
    assert [h for h, layers in agent.layers.items() if layers] == ["on_reply"]
    assert agent._reasoning_chain.layers == []  # the core is called directly


async def test_concurrency_safe_calls_run_together() -> None:
    """Two concurrency-safe calls overlap (docs/behaviour.md#acting); the unsafe one after them runs alone."""
    import asyncio

    running: list[str] = []
    overlap: list[int] = []

    @tool(description="Slow and safe.", is_concurrency_safe=True)
    async def safe_wait(name: str) -> str:
        running.append(name)
        overlap.append(len(running))
        await asyncio.sleep(0.05)
        running.remove(name)
        return name

    @tool(description="Slow and unsafe.")
    async def unsafe_wait(name: str) -> str:
        overlap.append(len(running) + 1)
        await asyncio.sleep(0.01)
        return name

    calls = [
        {"name": "safe_wait", "input": {"name": "a"}},
        {"name": "safe_wait", "input": {"name": "b"}},
        {"name": "unsafe_wait", "input": {"name": "c"}},
    ]
    model = OfflineRuleModel(script=[{"tool_calls": calls}, {"text": "all done"}])
    agent = Agent(model=model, toolkit=Toolkit([safe_wait, unsafe_wait]))
    items = await collect(agent, UserMsg("go"))
    assert overlap == [1, 2, 1]
    assert [r.output[0].text for r in tool_results(agent)] == ["a", "b", "c"]
    assert items[-1].text == "all done"


async def test_a_huge_tool_result_is_cut_to_the_limit_in_the_context() -> None:
    @tool(description="Returns a lot.")
    def dump() -> str:
        return "x" * 10_000

    model = OfflineRuleModel(script=[{"tool_calls": [{"name": "dump", "input": {}}]}, {"text": "ok"}])
    agent = Agent(model=model, toolkit=Toolkit([dump]), context_config=ContextConfig(tool_result_limit=100))
    items = await collect(agent, UserMsg("go"))
    saved = tool_results(agent)[0].output
    assert saved[0].text == "x" * 400 and "<<<TRUNCATED>>>" in saved[-1].text
    from agentmw.data import ToolResultTextDeltaEvent

    assert (
        sum(len(i.delta) for i in items if isinstance(i, ToolResultTextDeltaEvent)) == 10_000
    )  # the client gets it all


async def test_a_failed_reply_leaves_no_tool_task_writing_later() -> None:
    """The reply fails while a concurrent batch runs: every call ends with exactly one result."""
    import asyncio

    @tool(description="Fast.", is_concurrency_safe=True)
    async def fast() -> str:
        return "fast"

    release, ended = asyncio.Event(), asyncio.Event()

    @tool(description="Slow.", is_concurrency_safe=True)
    async def slow() -> str:
        try:
            await release.wait()
            return "slow"
        finally:
            ended.set()

    class FailOnFirstResult(MiddlewareBase):
        async def on_reply(self, agent, input_kwargs, next_handler):
            async for item in next_handler():
                if isinstance(item, ToolResultEndEvent):
                    raise RuntimeError("the budget service went away")
                yield item

    calls = [{"name": "fast", "input": {}}, {"name": "slow", "input": {}}]
    model = OfflineRuleModel(script=[{"tool_calls": calls}, {"text": "never"}])
    agent = Agent(model=model, toolkit=Toolkit([fast, slow]), middlewares=[FailOnFirstResult()])
    items = await collect(agent, UserMsg("go"))
    assert items[-1].error is not None and "budget service went away" in items[-1].error.message
    # No task of the reply outlives it: "slow" was stopped when the reply ended, not left running
    # to add a result later (releasing it now would let a leaked task write).
    assert ended.is_set()
    release.set()
    await asyncio.sleep(0)
    ids = [r.id for r in tool_results(agent)]
    assert sorted(ids) == sorted(set(ids)) and len(ids) == 2


async def test_a_middleware_max_iters_survives_a_pause_and_a_new_agent() -> None:
    """The host builds a new Agent per reply from the stored state: a reply-scoped max_iters must
    come back with it (and end with the reply)."""
    from agentmw.codec import codec

    class Tight(MiddlewareBase):
        async def on_reply(self, agent, input_kwargs, next_handler):
            async for item in next_handler():
                if isinstance(item, ReplyStartEvent):
                    agent.max_iters = 1
                yield item

    agent = Agent(model=OfflineRuleModel(), toolkit=Toolkit([send_email]), middlewares=[Tight()], max_iters=10)
    items = await collect(agent, UserMsg('call send_email {"to": "bob", "body": "hi"}'))
    ask = next(i for i in items if isinstance(i, RequireUserConfirmEvent))
    stored = codec.decode(codec.encode(agent.state))  # as the session store keeps it
    again = Agent(model=OfflineRuleModel(), toolkit=Toolkit([send_email]), state=stored, max_iters=10)
    assert again.max_iters == 1
    resumed = await collect(
        again,
        UserConfirmResultEvent(
            reply_id=ask.reply_id, confirm_results=[ConfirmResult(confirmed=True, tool_call=ask.tool_calls[0])]
        ),
    )
    end = next(i for i in resumed if isinstance(i, ReplyEndEvent))
    assert end.finished_reason == ReplyFinishedReason.EXCEED_MAX_ITERS  # the limit of 1 held
    await collect(again, UserMsg("next"))
    assert again.max_iters == 10  # a new reply starts from the agent's own limit


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


async def test_structured_output_ends_the_reply_with_the_tools_input() -> None:
    from agent_host.agent import STRUCTURED_OUTPUT_TOOL

    agent = Agent(model=OfflineRuleModel(), toolkit=Toolkit([add]))
    items = [i async for i in agent.reply_stream(UserMsg("Alice is 30 years old"), structured_schema=PERSON)]
    final = items[-1]
    assert final.structured_output == {"name": "Alice", "age": 30}
    assert final.text == "The required structured output is generated."
    assert next(i for i in items if isinstance(i, ReplyEndEvent)).finished_reason == ReplyFinishedReason.COMPLETED
    assert STRUCTURED_OUTPUT_TOOL not in agent.toolkit.tools  # the shared toolkit is left as it was
    # A plain reply afterwards owes nothing.
    assert (await agent.reply(UserMsg("hi"))).structured_output is None


async def test_structured_output_is_forced_then_given_up_on() -> None:
    """Text answers do not end a reply that owes a structured output: it is reminded, forced at
    max_iters, and ends EXCEED_MAX_ITERS after the grace rounds."""
    from agent_host.agent import STRUCTURED_OUTPUT_GRACE_ITERS, STRUCTURED_OUTPUT_TOOL

    class Recorder(MiddlewareBase):
        choices: list = []

        async def on_model_call(self, agent, input_kwargs, next_handler):
            Recorder.choices.append(getattr(input_kwargs["tool_choice"], "mode", None))
            return await next_handler()

    stubborn = OfflineRuleModel(script=[{"text": "I refuse"}] * 20)
    agent = Agent(model=stubborn, middlewares=[Recorder()], max_iters=2)
    items = [i async for i in agent.reply_stream(UserMsg("who?"), structured_schema=PERSON)]
    end = next(i for i in items if isinstance(i, ReplyEndEvent))
    assert end.finished_reason == ReplyFinishedReason.EXCEED_MAX_ITERS
    assert Recorder.choices == [None, None] + [STRUCTURED_OUTPUT_TOOL] * STRUCTURED_OUTPUT_GRACE_ITERS
    hints = [b for b in agent.state.context[-1].content if isinstance(b, HintBlock)]
    assert len(hints) == 2 + STRUCTURED_OUTPUT_GRACE_ITERS and "GenerateStructuredOutput" in hints[0].hint[0].text


async def test_a_layer_may_return_any_async_iterator() -> None:
    """A hook returns an async iterator; it need not be an async generator. The agent closes each
    stream as it can (before, a reply through such a layer failed with AttributeError: no aclose)."""
    agent = Agent(
        model=OfflineRuleModel(script=[{"tool_calls": [{"name": "add", "input": {"a": 1, "b": 2}}]}, {"text": "3"}]),
        toolkit=Toolkit([add]),
        middlewares=[ReturnsPlainIterators()],
    )
    items = [item async for item in agent.reply_stream(UserMsg("add"))]
    (end,) = [i for i in items if isinstance(i, ReplyEndEvent)]
    assert end.finished_reason == ReplyFinishedReason.COMPLETED, end.error
    assert items[-1].text == "3"


async def test_an_interrupt_during_on_model_call_is_not_retried() -> None:
    """The reply is interrupted while an on_model_call middleware awaits (before it calls next):
    the call ends interrupted, once. Before, the retry policy took the CancelledError for a failed
    attempt and called the chain again (max_retries 2: the middleware ran twice, the model once)."""
    import asyncio

    from agent_host.models.registry import ModelRegistry

    calls: list[int] = []
    waiting = asyncio.Event()

    class Slow(MiddlewareBase):
        async def on_model_call(self, agent, input_kwargs, next_handler):
            calls.append(1)
            waiting.set()
            await asyncio.sleep(5)
            return await next_handler()

    registry = ModelRegistry(default="m")
    registry.add(OfflineRuleModel(id="m"), max_retries=2)
    agent = Agent(models=registry, model="m", middlewares=[Slow()])

    async def interrupt() -> None:
        await waiting.wait()
        agent.interrupt()

    interrupter = asyncio.ensure_future(interrupt())
    async with asyncio.timeout(4):  # a retry would sleep 5 s in the middleware again
        items = [item async for item in agent.reply_stream(UserMsg("hello"))]
    await interrupter
    assert calls == [1]
    ends = [i.finished_reason for i in items if isinstance(i, (ModelCallEndEvent, ReplyEndEvent))]
    assert ends == [FinishedReason.INTERRUPTED, ReplyFinishedReason.INTERRUPTED]
