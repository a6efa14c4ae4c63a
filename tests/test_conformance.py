"""Conformance: a middleware behaves the same in the host's process and in another process.

Each scenario runs twice — the middleware in-process, then the same class served by ``serve()``
in its own process over gRPC — and must give the same outward event sequence and the same final
state. Each scenario also asserts what the behavior is, so that "the same" cannot mean "both broken".
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from agentmw.hooks import HOOKS, Kind

from .harness import FAST_RETRY, Layer, Scenario, Servers, final_text, kinds, run

ONION_HOOKS = {name: spec for name, spec in HOOKS.items() if spec.kind is not Kind.TRANSFORM}

EVERY_HOOK_SCRIPT = [
    {"tool_calls": [{"name": "add", "input": {"a": 2, "b": 3}}]},
    {"text": "The sum is 5.", "thinking": "easy"},
]

# -- what each scenario must do (asserted on the in-process run; the remote run equals it) -------

Check = Callable[[list, dict], Awaitable[None] | None]


def _pass_through(events, state):
    assert kinds(events)[0] == "ReplyStartEvent" and kinds(events)[-2:] == ["ReplyEndEvent", "Msg"]
    assert "ToolResultEndEvent" in kinds(events) and "ThinkingBlockDeltaEvent" in kinds(events)
    assert final_text(events) == "The sum is 5."


def _override(events, state):
    assert "ToolCallStartEvent" not in kinds(events)  # tool_choice "none" although the user asked for a tool
    assert final_text(events) == "You said: the override speaks"


def _fallback(events, state):
    assert final_text(events).startswith("backup answered")
    start = next(e for e in events if e["class"] == "ModelCallStartEvent")
    end = next(e for e in events if e["class"] == "ModelCallEndEvent")
    assert start["model_name"] == "backup" and end["metadata"] == {"model": "backup"}  # the model that answered


def _short_reasoning(events, state):
    assert "ModelCallStartEvent" not in kinds(events)
    assert final_text(events) == "canned answer"


def _short_acting(events, state):
    deltas = [e["delta"] for e in events if e["class"] == "ToolResultTextDeltaEvent"]
    assert deltas == ["stubbed "]
    result = state["context"][-1]["content"][1]
    assert result["class"] == "ToolResultBlock" and result["output"][0]["text"] == "stubbed add"


def _swallow(events, state):
    assert kinds(events).count("ReplyEndEvent") == 1
    assert kinds(events).count("ModelCallStartEvent") == 2
    assert final_text(events) == "second answer"
    assert state["middle_context"]["SwallowFirstEnd"] == {"swallowed": 1}


def _stops_when_interrupted(events, state):
    # Interrupted at its first tick, it stops at once (remotely: told by the host's Interrupted
    # notice, also while it emits without reading), and the reply ends as interrupted replies do.
    ticks = [e["value"] for e in events if e["class"] == "CustomEvent"]
    assert ticks == [{"n": 1}, {"ticks": 1, "interrupted": True}]
    assert kinds(events)[-2:] == ["ReplyEndEvent", "Msg"] and events[-2]["error"] is None


def _inject(events, state):
    names = kinds(events)
    i = names.index("TextBlockEndEvent")
    assert names[i + 1] == "CustomEvent" and events[i + 1]["name"] == "after_text"


def _tool(events, state):
    start = next(e for e in events if e["class"] == "ToolResultStartEvent")
    assert start["tool_call_name"] == "Tools__shout"
    assert any(e.get("delta") == "HELLO!" for e in events)


def _slot(events, state):
    seen = [e["value"] for e in events if e["class"] == "CustomEvent" and e["name"] == "slot_seen"]
    assert seen and all(v["value"] == "marked at reply start" for v in seen)
    assert [v["iter"] for v in seen] == [0, 1]


def _acting_without_response(events, state):
    end = next(e for e in events if e["class"] == "ToolResultEndEvent")
    assert end["state"] == "error"
    assert kinds(events)[-1] == "Msg" and kinds(events).count("ToolResultEndEvent") == 1


def _budget(events, state):
    assert state["middle_context"]["Budget"]  # counted
    hints = [b for m in state["context"] for b in m["content"] if b["class"] == "HintBlock"]
    assert [h["hint"] for h in hints] == ["Budget spent: answer now."]
    assert kinds(events).count("ToolCallStartEvent") == 1  # the second round could not call tools


def _observe(events, state):
    seen = state["middle_context"]["ObserveCounter"]
    assert seen["ReplyStartEvent"] == 1 and seen["Msg"] == 1 and seen["ToolResultEndEvent"] == 1
    assert sum(seen.values()) == len(events)


def _set_model(events, state):
    assert final_text(events).startswith("B: ")


def _memory(events, state):
    assert state["context"][1]["name"] == "memory"


def _deny(events, state):
    end = next(e for e in events if e["class"] == "ToolResultEndEvent")
    assert end["state"] == "denied"
    assert any(e.get("delta") == "adding is not allowed here" for e in events)


def _raises(events, state):
    end = events[-2]
    assert end["class"] == "ReplyEndEvent" and end["finished_reason"] == "error"
    assert "budget service says no" in end["error"]["message"]
    assert end["error"]["type"] == "internal"  # a ValueError carries no error_type


def _wrong_value(expected: str) -> Check:
    def check(events, state):
        """A value hook's wrong return fails the reply as the layer's TypeError, the same both ways
        (before: a TypeError from deep in the host or a ReplyError in-process, a protocol
        violation blamed on the server remotely)."""
        end = events[-2]
        assert end["class"] == "ReplyEndEvent" and end["finished_reason"] == "error"
        assert end["error"]["type"] == "internal" and end["error"]["message"].endswith(expected), end["error"]

    return check


def _no_decision(events, state):
    """on_check_permission's wrong return is the layer's TypeError, which the tool call gets as its
    error result (as any exception of its permission check), the same both ways (before: a
    ReplyError in-process, a protocol violation blamed on the server remotely)."""
    results = [e["delta"] for e in events if e["class"] == "ToolResultTextDeltaEvent"]
    wrong = "TypeError: on_check_permission must return a PermissionDecision, not NoneType"
    assert results == [f"<system-reminder>{wrong}</system-reminder>"]


def _compress_value_ignored(events, state):
    """What on_compress_context returns is ignored, as in AgentScope (remotely it was a violation)."""
    assert events[-2]["class"] == "ReplyEndEvent" and events[-2]["finished_reason"] == "completed"


def _raises_typed(events, state):
    """The reply's error type is the one the middleware's exception carries."""
    end = events[-2]
    assert end["error"]["type"] == "permission" and "not allowed for this user" in end["error"]["message"]


def _returns_response(events, state):
    """A ChatResponse returned by on_model_call is the call's answer: its text streams as blocks."""
    names = kinds(events)
    start, end = names.index("ModelCallStartEvent"), names.index("ModelCallEndEvent")
    assert names[start + 1 : end] == ["TextBlockStartEvent", "TextBlockDeltaEvent", "TextBlockEndEvent"]
    assert final_text(events) == "canned reply"


def _returns_last_chunk(events, state):
    """The inner stream's last chunk, returned: its whole text comes as one delta."""
    assert [e["delta"] for e in events if e["class"] == "TextBlockDeltaEvent"] == ["You said: hello there"]
    assert final_text(events) == "You said: hello there"


def _response_through_outer(events, state):
    """A layer over one that returns a ChatResponse gets that response from next_handler()."""
    assert state["middle_context"]["ModelValueSeen"] == {"returned": "ChatResponse"}
    _returns_response(events, state)


def _not_retryable(events, state):
    """A non-retryable ModelError raised by on_model_call itself is not retried (max_retries 2)."""
    assert state["middle_context"]["QuotaGuard"] == {"calls": 1}
    end = events[-2]
    assert end["error"]["type"] == "rate_limit" and "quota exhausted" in end["error"]["message"]


def _each_model_failed(events, state):
    """With a fallback model, the error names each model's failure (AllModelsFailed)."""
    assert state["middle_context"]["QuotaGuard"] == {"calls": 2}
    message = events[-2]["error"]["message"]
    assert "main (attempt 1): quota exhausted" in message and "backup (attempt 1): quota exhausted" in message


def _two_layers(events, state):
    # The outer layer injects after each text end it sees; the inner one swallowed the first end,
    # so both answers pass the outer layer, each followed by its injected event.
    assert [e["name"] for e in events if e["class"] == "CustomEvent"] == ["after_text", "after_text"]
    assert final_text(events) == "two"


def _eager(events, state):
    names = kinds(events)
    assert names[1] == "CustomEvent" and events[1]["name"] == "eager_seen_start"
    assert final_text(events) == "Done: add returned 4."


async def _detached(events, state):
    """A watcher changes nothing: every event and the state are those of the reply without it."""
    bare_events, bare_state = await run(Scenario("bare", [], message="call add a=2 b=2"), [], None)
    assert final_text(events) == "Done: add returned 4."
    assert events == bare_events and state == bare_state


def _count_after_yield(events, state):
    assert state["middle_context"]["CountAfterYield"] == {"n": 7}  # start, 5 deltas, the final Msg


def _slot_deleted(events, state):
    assert "SlotSetThenDeleted" not in state["middle_context"], state["middle_context"]  # gone, not null


def _next_reply_completes(state):
    """The reply after a failed one completes: the middleware answers it (it is not suspended)."""
    assert state["later"] == [["completed", "You said: hello again"]]


def _raises_cancelled(events, state):
    """A CancelledError the middleware's own code raises (not a cancellation of the reply) is
    raised at its hook position: in on_reasoning the agent takes it as an interruption, as any
    CancelledError in its core. (Remotely the SDK did not answer at all: the host waited out its
    timeout, failed the reply, then suspended the middleware, failing the next reply too.)"""
    assert events[-2]["finished_reason"] == "interrupted" and events[-2]["error"] is None
    assert final_text(events) == "I notice the interruption. How can I help you?"
    _next_reply_completes(state)


def _failed_with(events, text):
    end = events[-2]
    assert end["finished_reason"] == "error" and end["error"]["type"] == "internal"
    assert end["error"]["message"].endswith(text)


def _on_reply_raises_cancelled(events, state):
    """Out of on_reply, such a CancelledError fails the reply (in-process it escaped reply_stream,
    where the host would take it for a cancellation of its own task: its shutdown)."""
    _failed_with(events, ": cancelled raised in on_reply")
    _next_reply_completes(state)


def _raises_base_exception(events, state):
    """A BaseException that is not an Exception fails the reply like any exception (in-process it
    escaped reply_stream; remotely it went unanswered as a CancelledError did)."""
    _failed_with(events, ": base raised in on_reasoning")
    _next_reply_completes(state)


def _tool_raises_base_exception(events, state):
    """A list_tools tool raising a BaseException gets an error result with its message, as for an
    Exception (in-process it escaped the reply; remotely CallTool went unanswered)."""
    end = next(e for e in events if e["class"] == "ToolResultEndEvent")
    assert end["state"] == "error"
    assert [e["delta"] for e in events if e["class"] == "ToolResultTextDeltaEvent"] == ["the tool cannot take 'x'"]
    assert events[-2]["finished_reason"] == "completed"
    _next_reply_completes(state)


def _not_an_exception(hook: str, kind: str, message: str = "hello there") -> Scenario:
    layer = Layer(
        "RaisesNonExceptionInReply" if hook == "on_reply" else "RaisesNonException", {"hook": hook, "kind": kind}
    )
    return Scenario(f"{hook}_raises_{kind}", [layer], message=message, later=["hello again"])


CASES: list[tuple[Scenario, Check]] = [
    (Scenario("pass_through", [Layer("PassThrough")], models={"main": {"script": EVERY_HOOK_SCRIPT}}), _pass_through),
    (Scenario("override_kwargs", [Layer("Override")], message="call add a=1 b=2"), _override),
    (
        Scenario(
            "model_fallback_next_twice",
            [Layer("ModelFallback", {"fallback": "backup"})],
            models={
                "main": {"script": [{"error": {"type": "rate_limit", "message": "main is throttled"}}]},
                "backup": {"reply_template": "backup answered: {text}"},
            },
        ),
        _fallback,
    ),
    (Scenario("short_circuit_reasoning", [Layer("ShortCircuitReasoning")]), _short_reasoning),
    (Scenario("short_circuit_acting", [Layer("ShortCircuitActing")], message="call add a=1 b=2"), _short_acting),
    (
        Scenario(
            "swallow_reply_end",
            [Layer("SwallowFirstEnd")],
            models={"main": {"script": [{"text": "first answer"}, {"text": "second answer"}]}},
        ),
        _swallow,
    ),
    (Scenario("inject_after_text", [Layer("InjectAfterText")]), _inject),
    (Scenario("list_tools_tool", [Layer("Tools")], message="call Tools__shout text=hello"), _tool),
    (Scenario("slot_across_hooks", [Layer("SlotAcrossHooks")], message="call add a=4 b=4"), _slot),
    (
        Scenario("acting_without_response", [Layer("ActingWithoutResponse")], message="call add a=1 b=1"),
        _acting_without_response,
    ),
    (
        Scenario(
            "budget_hint_and_tool_choice",
            [Layer("Budget", {"token_budget": 5})],
            message="call add a=1 b=1",
            models={"main": {"script": [{"tool_calls": [{"name": "add", "input": {"a": 1, "b": 1}}]}]}},
        ),
        _budget,
    ),
    (Scenario("observe_counter", [Layer("ObserveCounter")], message="call get_weather city=Paris"), _observe),
    (
        Scenario(
            "set_model_at_start",
            [Layer("SetModelAtStart")],
            models={"main": {}, "backup": {"reply_template": "B: {text}"}},
        ),
        _set_model,
    ),
    (Scenario("append_memory_message", [Layer("AppendMemory")]), _memory),
    (Scenario("permission_deny", [Layer("PermissionDenyShout")], message="call add a=1 b=1"), _deny),
    (Scenario("middleware_raises", [Layer("Raises")]), _raises),
    (Scenario("middleware_raises_typed", [Layer("RaisesTyped")]), _raises_typed),
    (
        Scenario("system_prompt_returns_none", [Layer("PromptNone")]),
        _wrong_value("on_system_prompt must return the prompt (a str), not NoneType"),
    ),
    (Scenario("permission_returns_none", [Layer("PermissionNone")], message="call add a=1 b=2"), _no_decision),
    (Scenario("compress_returns_value", [Layer("CompressReturnsValue")]), _compress_value_ignored),
    (Scenario("model_call_raises_not_retryable", [Layer("QuotaGuard")], max_retries=2), _not_retryable),
    (
        Scenario(
            "model_call_raises_for_each_model",
            [Layer("QuotaGuard")],
            models={"main": {}, "backup": {}},
            fallback={"main": ["backup"]},
        ),
        _each_model_failed,
    ),
    (_not_an_exception("on_reasoning", "cancelled"), _raises_cancelled),
    (_not_an_exception("on_reply", "cancelled"), _on_reply_raises_cancelled),
    (_not_an_exception("on_reasoning", "base"), _raises_base_exception),
    (_not_an_exception("tool", "base", "call RaisesNonException__unexceptional text=x"), _tool_raises_base_exception),
    (Scenario("model_call_returns_response", [Layer("ReturnsResponse")]), _returns_response),
    (Scenario("model_call_returns_last_chunk", [Layer("ReturnsLastChunk")]), _returns_last_chunk),
    (
        Scenario("model_call_response_through_outer", [Layer("ModelValueSeen"), Layer("ReturnsResponse")]),
        _response_through_outer,
    ),
    (Scenario("eager_next", [Layer("EagerPassThrough")], message="call add a=2 b=2"), _eager),
    (
        Scenario(
            "slot_written_after_yield", [Layer("CountAfterYield")], models={"main": {"reply_template": "a b c d e"}}
        ),
        _count_after_yield,
    ),
    (Scenario("detached_watcher", [Layer("DetachedWatcher")], message="call add a=2 b=2"), _detached),
    *(
        (
            Scenario(
                f"stops_when_interrupted{'_run_ahead' if ahead else ''}",
                [Layer("StopsWhenInterrupted", {"run_ahead": ahead})],
                interrupt_at="CustomEvent",
            ),
            _stops_when_interrupted,
        )
        for ahead in (False, True)
    ),
    (Scenario("slot_set_then_deleted", [Layer("SlotSetThenDeleted")]), _slot_deleted),
    (
        Scenario(
            "two_layers_order",
            [Layer("InjectAfterText"), Layer("SwallowFirstEnd")],
            models={"main": {"script": [{"text": "one"}, {"text": "two"}]}},
        ),
        _two_layers,
    ),
]
SCENARIOS = [scenario for scenario, _ in CASES]


SUMMARY_IN_PROCESS = Scenario("summary_in_process", [Layer("SummaryReader"), Layer("SummaryAtTextEnd")])


@pytest.fixture(scope="module")
def servers():
    started = Servers(
        [*SCENARIOS, PROMPT_ORDER, RUN_AHEAD, SUMMARY_IN_PROCESS, Scenario("trace", [Layer("TraceEcho")])]
    )
    yield started
    started.stop()


@pytest.mark.parametrize(("scenario", "check"), CASES, ids=[s.id for s, _ in CASES])
async def test_same_in_process_and_remote(scenario: Scenario, check: Check, servers: Servers) -> None:
    local_events, local_state = await run(scenario, ["local"] * len(scenario.layers), None)
    remote_events, remote_state = await run(scenario, ["remote"] * len(scenario.layers), servers)
    assert errors_compared(unwrapped(remote_events)) == errors_compared(local_events)
    assert states_compared(unwrapped(remote_state)) == states_compared(local_state)
    checked: Any = check(local_events, local_state)
    if inspect.isawaitable(checked):
        await checked
    if scenario.id == "middleware_raises":  # remotely, the error also says which middleware raised
        message = remote_events[-2]["error"]["message"]
        assert "ValueError: budget service says no (raised by middleware 'Raises' in on_reasoning)" in message
    if scenario.id == "model_call_raises_for_each_model":  # the same for each model of a fallback
        message = remote_events[-2]["error"]["message"]
        assert message.count("quota exhausted (raised by middleware 'QuotaGuard' in on_model_call)") == 2, message


WHERE = re.compile(r" \(raised by middleware '[^']*' in \w+\)")


def unwrapped(value: Any) -> Any:
    """``value`` with a remote exception's text, where it became a tool's error result, as the
    in-process one's: "T: message" (remotely, the text also says where it was raised, hooks.md)."""
    if isinstance(value, str):
        return WHERE.sub("", value)
    if isinstance(value, dict):
        return {k: unwrapped(v) for k, v in value.items()}
    if isinstance(value, list):
        return [unwrapped(v) for v in value]
    return value


def errors_compared(events: list) -> list:
    """Error infos reduced to their type and the original message: a remote error adds where it
    came from to the message."""
    out = []
    for event in events:
        if event.get("error"):
            tail = event["error"]["message"].rsplit(": ", 1)[-1]
            event = {**event, "error": (event["error"]["type"], tail)}
            if event["class"] == "Msg":
                event["content"] = tail
        out.append(event)
    return out


def states_compared(state: dict) -> dict:
    """The state with the stored error of a failed reply reduced as in ``errors_compared``."""

    def reduced(block: dict) -> dict:
        text = block.get("text", "")
        return {**block, "text": text.rsplit(": ", 1)[-1]} if text.startswith("The reply failed: ") else block

    context = [
        {
            **m,
            "error": (m["error"]["type"], m["error"]["message"].rsplit(": ", 1)[-1]),
            "content": [reduced(b) for b in m["content"]],
        }
        if m.get("error")
        else m
        for m in state["context"]
    ]
    return {**state, "context": context}


PROMPT_ORDER = Scenario(
    "system_prompt_order",
    [Layer("PromptTag", {"tag": "A"}), Layer("PromptTag", {"tag": "B"}), Layer("PromptTag", {"tag": "C"})],
    models={"main": {"reply_template": "{system}"}},
)


async def test_system_prompt_pipeline_order_mixed(servers: Servers) -> None:
    """Three on_system_prompt middleware, local-remote-local, apply in list order."""
    local_events, _ = await run(PROMPT_ORDER, ["local", "local", "local"], None)
    mixed_events, _ = await run(PROMPT_ORDER, ["local", "remote", "local"], servers)
    remote_events, _ = await run(PROMPT_ORDER, ["remote", "remote", "remote"], servers)
    assert final_text(local_events) == "You are a test agent. +A +B +C"
    assert mixed_events == local_events == remote_events


async def test_a_detached_watcher_sees_what_it_subscribed_to(servers: Servers) -> None:
    """Never waited for, yet it gets every copy: read back through its own tool."""
    import json

    from agent_host.agent import Agent
    from agent_host.models import OfflineRuleModel
    from agent_host.remote import RemoteMiddleware
    from agentmw.data import ToolCallBlock, UserMsg
    from agentmw.tools import Toolkit, add_middleware_tools

    from .harness import add

    remote = await RemoteMiddleware(servers.address(Layer("DetachedWatcher"))).connect()
    toolkit = Toolkit([add])
    await add_middleware_tools(toolkit, remote)
    agent = Agent(model=OfflineRuleModel(), toolkit=toolkit, middlewares=[remote])
    events = [e async for e in agent.reply_stream(UserMsg("call add a=2 b=2"))]
    for _ in range(50):  # its last copies are read in the background
        stats = json.loads(
            [
                c
                async for c in toolkit.call_tool(
                    ToolCallBlock(
                        id="s",
                        name="DetachedWatcher__watch_stats",
                        input=json.dumps({"session_id": agent.state.session_id}),
                    )
                )
            ][-1]
            .content[0]
            .text
        )
        # Each hook's copies travel on their own stream: wait until the last of them is read.
        if all(stats.get(k) for k in ("on_reply:Msg", "on_reasoning:ModelCallEndEvent", "on_acting:ToolResponse")):
            break
        await asyncio.sleep(0.05)
    assert stats["on_reply:Msg"] == 1 and sum(v for k, v in stats.items() if k.startswith("on_reply:")) == len(events)
    assert stats["on_reasoning:ModelCallEndEvent"] == 2
    assert stats["on_model_call:ChatResponse"] == 2  # the final chunk of each model call
    assert stats["on_acting:ToolResponse"] == 1
    await remote.close()


async def test_trace_context_reaches_middleware_in_and_out_of_process(servers: Servers) -> None:
    """The host's current span continues in the middleware: W3C traceparent in its HookContext."""
    from opentelemetry.sdk.trace import TracerProvider

    from agent_host.agent import Agent
    from agent_host.models import OfflineRuleModel
    from agent_host.remote import RemoteMiddleware
    from agentmw.data import UserMsg

    from . import conformance_mw

    tracer = TracerProvider().get_tracer("test")  # a local provider: the global one stays untouched
    remote = await RemoteMiddleware(servers.address(Layer("TraceEcho"))).connect()
    for layer in (conformance_mw.TraceEcho(), remote):
        agent = Agent(model=OfflineRuleModel(), middlewares=[layer])
        with tracer.start_as_current_span("host reply") as span:
            [i async for i in agent.reply_stream(UserMsg("hi"))]
        trace_id = format(span.get_span_context().trace_id, "032x")
        assert agent.state.middle_context["TraceEcho"]["traceparent"].split("-")[1] == trace_id
    agent = Agent(model=OfflineRuleModel(), middlewares=[remote])  # no span: nothing is sent
    [i async for i in agent.reply_stream(UserMsg("hi"))]
    assert agent.state.middle_context["TraceEcho"] == {}
    await remote.close()


# -- fidelity with AgentScope (docs/behaviour.md): each check runs on both placements ----------


def _acting_drained(events, state):
    """The on_acting chain runs to its end: code after the middleware's loop ran; the chunk it
    yielded after the ToolResponse is dropped (a call has one result)."""
    assert state["middle_context"]["ActingAfterLoop"] == {"seen": ["ToolChunk", "ToolResponse"]}
    assert [e["delta"] for e in events if e["class"] == "ToolResultTextDeltaEvent"] == ["3"]
    results = [b for m in state["context"] for b in m["content"] if b["class"] == "ToolResultBlock"]
    assert len(results) == 1 and results[0]["output"][0]["text"] == "3"
    assert kinds(events).count("ToolResultEndEvent") == 1


def _tool_raises(events, state):
    """A raising tool: its message streams as result text and is the stored result, as in AgentScope."""
    deltas = [e["delta"] for e in events if e["class"] == "ToolResultTextDeltaEvent"]
    assert deltas == ["working on x; ", "cannot handle 'x'"]
    end = next(e for e in events if e["class"] == "ToolResultEndEvent")
    assert end["state"] == "error"
    result = next(b for m in state["context"] for b in m["content"] if b["class"] == "ToolResultBlock")
    assert result["state"] == "error" and result["output"][0]["text"] == "working on x; cannot handle 'x'"


def _ordered_custom_event(events, state):
    """An injected CustomEvent keeps its reply id and its value's key order."""
    custom = next(e for e in events if e["class"] == "CustomEvent")
    assert custom["reply_id"] == events[0]["reply_id"]
    assert list(custom["value"]) == ["zeta", "alpha", "mid"] and list(custom["value"]["alpha"]) == ["y", "b"]


def _every_kwarg_present(events, state):
    """Each hook's input_kwargs holds every parameter of the hook table, None when unset (in-process,
    on_model_call had no ``parameters``: ``input_kwargs["parameters"]`` raised KeyError)."""
    assert state["middle_context"]["KwargKeys"] == {name: sorted(spec.params) for name, spec in ONION_HOOKS.items()}
    assert final_text(events) == "Done: add returned 3."


def _deleted_kwarg_cleared(events, state):
    """A key deleted from input_kwargs reaches the core as None: the model got no tools (in-process,
    the core was called without ``tools``: TypeError)."""
    assert "ToolCallStartEvent" not in kinds(events)
    assert final_text(events) == "You said: call add a=1 b=2"


def _max_iters_zero(events, state):
    """max_iters = 0 is taken as is, as AgentScope does: the forced final answer (no tools) at once,
    ending EXCEED_MAX_ITERS; a negative one is refused at the assignment. (In-process, 0 meant the
    default and the tool ran; remote, the host refused set_max_iters below 1 and the reply failed.)"""
    assert state["middle_context"]["MaxItersZero"] == {"refused": "max_iters must be 0 or more, not -1", "now": 0}
    assert "ToolCallStartEvent" not in kinds(events)
    assert events[-2]["finished_reason"] == "exceed_max_iters"
    assert final_text(events) == "You said: call add a=1 b=2"


FIDELITY_CASES: list[tuple[Scenario, Check]] = [
    (Scenario("acting_drained", [Layer("ActingAfterLoop")], message="call add a=1 b=2"), _acting_drained),
    (Scenario("tool_raises", [Layer("RaisingTool")], message="call RaisingTool__fragile text=x"), _tool_raises),
    (Scenario("ordered_custom_event", [Layer("OrderedCustomEvent")]), _ordered_custom_event),
    (Scenario("every_kwarg_present", [Layer("KwargKeys")], message="call add a=1 b=2"), _every_kwarg_present),
    (Scenario("deleted_kwarg_cleared", [Layer("DeletesTools")], message="call add a=1 b=2"), _deleted_kwarg_cleared),
    (Scenario("max_iters_zero", [Layer("MaxItersZero")], message="call add a=1 b=2"), _max_iters_zero),
]


ACTING_YIELDS_CUSTOM = Scenario("acting_yields_custom", [Layer("ActingYieldsCustom")], message="call add a=1 b=2")
REASONING_YIELDS_BLOCK = Scenario("reasoning_yields_block", [Layer("ReasoningYieldsBlock")])
PLAIN_TOOL_CHOICE = Scenario("plain_tool_choice", [Layer("PlainToolChoice")], message="call add a=1 b=2")
ADDS_KWARG = Scenario("adds_kwarg", [Layer("AddsKwarg")])
SET_IN_SLOT = {
    then_raise: Scenario(f"set_in_slot_{then_raise}", [Layer("SetInSlot", {"then_raise": then_raise})])
    for then_raise in (False, True)
}
YIELDS_NONE = {
    hook: Scenario(f"yields_none_{hook}", [Layer("YieldsNone", {"hook": hook})], message="call add a=1 b=2")
    for hook in ("on_reply", "on_reasoning", "on_acting", "on_model_call")
}


@pytest.fixture(scope="module")
def fidelity_servers():
    started = Servers(
        [
            *(scenario for scenario, _ in FIDELITY_CASES),
            ACTING_YIELDS_CUSTOM,
            REASONING_YIELDS_BLOCK,
            PLAIN_TOOL_CHOICE,
            ADDS_KWARG,
            *SET_IN_SLOT.values(),
            *YIELDS_NONE.values(),
        ]
    )
    yield started
    started.stop()


@pytest.mark.parametrize(("scenario", "check"), FIDELITY_CASES, ids=[s.id for s, _ in FIDELITY_CASES])
async def test_fidelity_same_in_process_and_remote(scenario: Scenario, check: Check, fidelity_servers: Servers) -> None:
    local_events, local_state = await run(scenario, ["local"] * len(scenario.layers), None)
    remote_events, remote_state = await run(scenario, ["remote"] * len(scenario.layers), fidelity_servers)
    check(local_events, local_state)
    check(remote_events, remote_state)  # each placement on its own: key order is not seen by ==
    assert remote_events == local_events and remote_state == local_state


async def test_on_reasoning_yielding_a_block_names_the_middleware_in_process_as_remotely(
    fidelity_servers: Servers,
) -> None:
    """on_reasoning yields a TextBlock (a block, not an event): the reply fails naming the
    middleware and the hook, in-process as remotely. In-process the reply grammar caught it and
    blamed 'no on_reply middleware: the agent itself'."""
    scenario = REASONING_YIELDS_BLOCK
    local_events, _ = await run(scenario, ["local"], None)
    remote_events, _ = await run(scenario, ["remote"], fidelity_servers)
    local_error, remote_error = local_events[-2]["error"]["message"], remote_events[-2]["error"]["message"]
    assert local_error == (
        "ReplyError: the reasoning step broke the hook contract (on_reasoning middleware 'ReasoningYieldsBlock'): "
        "on_reasoning cannot yield TextBlock"
    )
    # (The SDK sends nothing a hook cannot yield: the author's yield raises there.)
    assert remote_error == (
        "TypeError: on_reasoning cannot yield TextBlock (raised by middleware 'ReasoningYieldsBlock' in on_reasoning)"
    )


@pytest.mark.parametrize("hook", list(YIELDS_NONE))
async def test_a_middleware_yielding_none_fails_the_reply_at_once_in_process_as_remotely(
    hook: str, fidelity_servers: Servers
) -> None:
    """None is no item. Remotely the SDK took it for an observed copy (None is the default of its
    lookup), sent nothing and waited for the host, which waited for it: the reply hung until the
    host's timeout. In-process, on_acting and on_model_call took None for the stream's end: the
    tool ran (or the model call had no last chunk)."""
    scenario = YIELDS_NONE[hook]
    local_events, _ = await run(scenario, ["local"], None)
    started = time.monotonic()
    remote_events, _ = await run(scenario, ["remote"], fidelity_servers)
    assert time.monotonic() - started < 5  # not the host's timeout (10 s here)
    if hook == "on_model_call":  # the remote call fails before it answers: no model call events
        assert [k for k in kinds(local_events) if not k.startswith("ModelCall")] == kinds(remote_events)
    else:
        assert kinds(remote_events) == kinds(local_events)
    assert kinds(local_events)[-2:] == ["ReplyEndEvent", "Msg"]
    assert "3" not in [e.get("delta") for e in local_events + remote_events]  # add(1, 2) never ran
    local_error, remote_error = local_events[-2]["error"]["message"], remote_events[-2]["error"]["message"]
    said = "a NoneType is not an item of a reply" if hook == "on_reply" else f"{hook} cannot yield NoneType"
    assert said in local_error, local_error
    assert remote_error == f"TypeError: {hook} cannot yield NoneType (raised by middleware 'YieldsNone' in {hook})"


async def test_an_override_of_the_wrong_type_fails_the_reply_in_process_as_remotely(fidelity_servers: Servers) -> None:
    """``next_handler(tool_choice="none")``: in-process the reasoning step fails (a str has no
    ``tools``). Remotely the SDK encoded the str as an empty ToolChoice: the model called the tool
    and the reply completed."""
    local_events, _ = await run(PLAIN_TOOL_CHOICE, ["local"], None)
    remote_events, _ = await run(PLAIN_TOOL_CHOICE, ["remote"], fidelity_servers)
    assert kinds(remote_events) == kinds(local_events) == ["ReplyStartEvent", "ReplyEndEvent", "Msg"]
    local_error, remote_error = local_events[-2]["error"]["message"], remote_events[-2]["error"]["message"]
    assert local_error == "AttributeError: 'str' object has no attribute 'tools'"
    assert remote_error == (
        "CodecError: expected a ToolChoice, got str 'none' (raised by middleware 'PlainToolChoice' in on_reasoning)"
    )


async def test_a_key_added_to_input_kwargs_in_place_fails_the_reply_in_process_as_remotely(
    fidelity_servers: Servers,
) -> None:
    """Remotely the SDK dropped a key the hook does not take: the reply went on. In-process it
    failed the agent's own function (Python's TypeError, as in AgentScope). Both now say which."""
    local_events, _ = await run(ADDS_KWARG, ["local"], None)
    remote_events, _ = await run(ADDS_KWARG, ["remote"], fidelity_servers)
    assert kinds(remote_events) == kinds(local_events) == ["ReplyStartEvent", "ReplyEndEvent", "Msg"]
    said = "TypeError: on_reasoning: input_kwargs has keys the hook does not take: ['bogus']"
    assert local_events[-2]["error"]["message"] == said
    assert remote_events[-2]["error"]["message"] == f"{said} (raised by middleware 'AddsKwarg' in on_reasoning)"


@pytest.mark.parametrize("then_raise", [False, True], ids=["set", "set_then_raise"])
async def test_a_slot_that_is_not_json_is_the_middlewares_own_error(
    then_raise: bool, fidelity_servers: Servers
) -> None:
    """A set in a remote middleware's slot ended its stream UNKNOWN (a TypeError in the SDK's own
    code), a failure of the middleware ("upstream": fail_open skipped it); its own error raised
    after setting it was lost the same way. Now it is the author's error, at its next step."""
    events, state = await run(SET_IN_SLOT[then_raise], ["remote"], fidelity_servers)
    assert kinds(events) == ["ReplyStartEvent", "ReplyEndEvent", "Msg"]
    where = " (raised by middleware 'set_in_slot' in on_reply)"  # (named by its key)
    said = (
        "ValueError: my own error"
        if then_raise
        else "TypeError: middle_context['set_in_slot'] must hold JSON (objects with str keys, lists, str, "
        "numbers, bools, None): Object of type set is not JSON serializable"
    )
    assert events[-2]["error"] == {"class": "ErrorInfo", "type": "internal", "message": said + where}
    assert "set_in_slot" not in state["middle_context"]


async def test_on_acting_yielding_a_non_tool_item_fails_the_reply_in_process_as_remotely(
    fidelity_servers: Servers,
) -> None:
    """on_acting yields only ToolChunks and a ToolResponse: a CustomEvent fails the reply, naming
    the middleware and the hook, in-process as remotely (the SDK raises at the author's yield; what
    another language's middleware sends is a protocol violation: test_isolation_protocol). In-process
    it was dropped and the tool ran."""
    scenario = ACTING_YIELDS_CUSTOM
    local_events, local_state = await run(scenario, ["local"], None)
    remote_events, remote_state = await run(scenario, ["remote"], fidelity_servers)
    assert kinds(remote_events) == kinds(local_events)
    assert kinds(local_events)[-5:] == [
        "ToolResultStartEvent",
        "ToolResultTextDeltaEvent",
        "ToolResultEndEvent",
        "ReplyEndEvent",
        "Msg",
    ]
    local_error, remote_error = local_events[-2]["error"]["message"], remote_events[-2]["error"]["message"]
    assert local_error == (
        "ReplyError: the tool call broke the hook contract (on_acting middleware 'ActingYieldsCustom'): "
        "on_acting cannot yield CustomEvent"
    )
    assert remote_error == (
        "TypeError: on_acting cannot yield CustomEvent (raised by middleware 'ActingYieldsCustom' in on_acting)"
    )
    # Stored as the program's own error on both sides (a protocol violation would be "upstream"),
    # the remote one naming where it was raised.
    local_type, local_text = states_compared(local_state)["context"][-1]["error"]
    remote_type, remote_text = states_compared(remote_state)["context"][-1]["error"]
    assert (local_type, remote_type, local_text) == ("internal", "internal", "on_acting cannot yield CustomEvent")
    assert remote_text == f"{local_text} (raised by middleware 'ActingYieldsCustom' in on_acting)"
    assert "3" not in [e.get("delta") for e in local_events]  # the tool did not run


# -- fidelity, SDK side: each scenario fails remotely without the fix it names -------------------

WORDS_25 = " ".join(f"w{i}" for i in range(25))  # with the reply's other events: 32 items, one grant
WORDS_64 = " ".join(f"w{i}" for i in range(64))  # 64 deltas: the grant runs out right before the end


def _in_place_tool_choice(events, state):
    """input_kwargs edited in place, then a bare next_handler(): the edit is an override."""
    assert "ToolCallStartEvent" not in kinds(events)
    assert final_text(events) == "You said: call add a=1 b=2"


EDIT_MODEL_MESSAGE = Scenario("edit_model_message", [Layer("InPlaceEditMessage")])
COPIED_KWARGS_EDIT = Scenario("copied_kwargs_edit", [Layer("CopiedKwargsEdit")])
LATE_AFTER_INNER = Scenario("late_after_inner", [Layer("LateAfterInner")])
ONLY_WHEN_TATTLETALE = Scenario("only_when_tattletale", [Layer("OnlyWhenTattletale")], message="call add a=1 b=2")
IN_PLACE_TOOL_INPUT = Scenario("in_place_tool_input", [Layer("InPlaceToolInput")], message="call add a=1 b=2")


def _done_with_inner(events, state):
    """Every call of a done_with_inner middleware ends at inner_done; what it did before stands."""
    assert state["middle_context"]["DoneWithInner"] == {"started": True}
    assert [e["delta"] for e in events if e["class"] == "ToolResultTextDeltaEvent"] == ["3"]
    assert kinds(events)[-1] == "Msg"


def _only_when(events, state):
    """on_reasoning acts from the step after the first model call (its flag set), not before."""
    armed = [e["value"] for e in events if e["class"] == "CustomEvent" and e["name"] == "armed_step"]
    assert armed == [{"calls": 1}] and state["middle_context"]["OnlyWhen"] == {"calls": 2, "armed": True}
    assert kinds(events)[-1] == "Msg"


def _in_place_append_message(events, state):
    """A message appended in place to on_model_call's messages list reaches the model."""
    assert final_text(events) == "You said: appended in place"


def _in_place_context_hint(events, state):
    """A block appended in place to the agent's last message reaches the host's context."""
    hints = [b["hint"] for m in state["context"] for b in m["content"] if b["class"] == "HintBlock"]
    assert hints == ["Over budget: answer now."]


def _after_yield_sees_outer(events, state):
    """Code after ``yield`` runs once the outer layer has handled the item (it lowered max_iters)."""
    assert state["middle_context"]["AfterYieldReads"] == {"max_iters": 7}


def _catch_model_error(events, state):
    """The inner pipeline's ModelError is caught by class, with its message, retryability and error
    type (remote, the type was ModelError's default, unknown, before InnerError carried it)."""
    assert state["middle_context"]["CatchModelError"] == {
        "message": "main is throttled",
        "retryable": True,
        "error_type": "rate_limit",
        "runtime": False,
    }
    assert final_text(events).startswith("backup answered")


def _catch_inner_runtime_error(events, state):
    """An inner exception with no ``retryable`` has none when caught (remote, it had
    ``retryable=False`` before InnerError.retryable became optional: not the same exception)."""
    assert state["middle_context"]["CatchInnerRuntimeError"] == {"message": "inner broke", "has_retryable": False}
    assert final_text(events) == "caught it"


def _slot_from_two_hooks(events, state):
    """on_reply's late write keeps on_reasoning's (two reasoning steps)."""
    assert state["middle_context"]["SlotFromTwoHooks"] == {"start": 1, "reasoning": 2, "end": 1}


def _observe_last_uses_grant(events, state):
    """The last observed item uses up the grant: the refill crosses inner_done harmlessly."""
    assert len(events) == 32 and sum(state["middle_context"]["ObserveCounter"].values()) == 32


def _observe_deltas_intercept_end(events, state):
    """A refill pull sent as the grant runs out does not answer the intercepted end."""
    assert state["middle_context"]["ObserveDeltasInterceptEnd"] == {"deltas": 64, "ends": 1}
    assert kinds(events).count("TextBlockEndEvent") == 1 and kinds(events)[-1] == "Msg"


def _custom(events, name):
    return next(e["value"] for e in events if e["class"] == "CustomEvent" and e["name"] == name)


def _set_model_then_read(events, state):
    """After ``agent.set_model(id)``, ``agent.model`` is that model (remotely: it was the old one
    until the host sent its state again)."""
    assert _custom(events, "model_now") == {"id": "backup"}
    assert final_text(events) == "B: hello there"


def _set_model_unknown(events, state):
    """``agent.set_model`` of an id the host does not have raises UnknownModelError at the call,
    where the code can catch it (remotely: the view did not know the ids, and the reply failed later
    with a protocol violation)."""
    assert state["middle_context"]["SetModelUnknown"] == {
        "caught": "unknown model id 'no-such-model' (registered: main)"
    }
    assert final_text(events) == "You said: hello there"


def _change_context_then_read(events, state):
    """The context shows the middleware's own appends and removal at once (remotely: not until the
    host sent its state again)."""
    assert _custom(events, "context_now") == {"seen": [1, [2, ["one"]], [2, ["one", "two"]], [2, ["two"]]]}
    assert [b["hint"] for b in state["context"][1]["content"] if b["class"] == "HintBlock"] == ["two"]


SUMMARY = "first question / You said: first question / second question / You said: second question"


def _compress_oldest(events, state):
    """on_compress_context sets the summary and drops the oldest messages (``del context[:n]``,
    then ``context = context[n:]``), seeing both at once; the model gets the summary and the newest
    messages (remotely: the summary was dropped and both edits raised)."""
    assert state["summary"] == SUMMARY
    assert [[b["class"] for b in m["content"]] for m in state["context"]] == [
        ["TextBlock"],
        ["ToolCallBlock", "ToolResultBlock", "TextBlock"],
    ]
    slot = state["middle_context"]["CompressOldest"]
    assert slot["seen"] == [[2, "first question"], [2, SUMMARY.rsplit(" / ", 1)[0]], [2, SUMMARY]]
    assert slot["inputs"][-1] == [
        "system: You are a test agent.",
        f"user: {SUMMARY}",
        "user: call add a=1 b=2",
        "assistant: ",
    ]
    assert final_text(events) == "Done: add returned 3."


def _cold_model(events, state):
    """current_model is a ModelRef in both places, a snapshot: the temperature a middleware sets on
    it (in place, or on a copy passed as the override) reaches that call's request, and not the
    reply after (in-process it was the registry's shared model, changed for every later call of
    every session; remotely the edit was dropped)."""
    layer = next(iter(state["middle_context"]))
    assert state["middle_context"][layer] == {"current_model": "ModelRef"}
    assert final_text(events) == 'You said: cold please, with {"temperature": 0.1, "top_p": 0.5}'
    assert state["later"] == [["completed", 'You said: warm please, with {"top_p": 0.5}']]


def _cold_model_scenario(how: str) -> Scenario:
    model = {"reply_template": "You said: {text}, with {parameters}", "parameters": {"top_p": 0.5}}
    return Scenario(
        f"current_model_edited_{how}",
        [Layer("ColdModel", {"how": how})],
        message="cold please",
        later=["warm please"],
        models={"main": model},
    )


SDK_FIDELITY_CASES: list[tuple[Scenario, Check]] = [
    (_cold_model_scenario("in_place"), _cold_model),
    (_cold_model_scenario("override"), _cold_model),
    (Scenario("in_place_tool_choice", [Layer("InPlaceToolChoice")], message="call add a=1 b=2"), _in_place_tool_choice),
    (Scenario("in_place_append_message", [Layer("InPlaceAppendMessage")]), _in_place_append_message),
    (Scenario("done_with_inner", [Layer("DoneWithInner")], message="call add a=1 b=2"), _done_with_inner),
    (Scenario("only_when", [Layer("OnlyWhen")], message="call add a=1 b=2"), _only_when),
    (
        Scenario("in_place_context_hint", [Layer("InPlaceContextHint")], message="call add a=1 b=2"),
        _in_place_context_hint,
    ),
    (
        Scenario("after_yield_sees_outer", [Layer("MaxItersAtStart"), Layer("AfterYieldReads")]),
        _after_yield_sees_outer,
    ),
    (
        Scenario(
            "catch_model_error_by_class",
            [Layer("CatchModelError")],
            models={
                "main": {"script": [{"error": {"type": "rate_limit", "message": "main is throttled"}}]},
                "backup": {"reply_template": "backup answered: {text}"},
            },
        ),
        _catch_model_error,
    ),
    (
        Scenario("catch_inner_runtime_error", [Layer("CatchInnerRuntimeError"), Layer("BreaksModelCall")]),
        _catch_inner_runtime_error,
    ),
    (Scenario("slot_from_two_hooks", [Layer("SlotFromTwoHooks")], message="call add a=1 b=2"), _slot_from_two_hooks),
    (
        Scenario(
            "set_model_then_read",
            [Layer("SetModelThenRead")],
            models={"main": {}, "backup": {"reply_template": "B: {text}"}},
        ),
        _set_model_then_read,
    ),
    (Scenario("change_context_then_read", [Layer("ChangeContextThenRead")]), _change_context_then_read),
    (Scenario("set_model_unknown", [Layer("SetModelUnknown")]), _set_model_unknown),
    (
        Scenario(
            "compress_summary_and_drop",
            [Layer("CompressOldest")],
            message="call add a=1 b=2",
            earlier=["first question", "second question"],
        ),
        _compress_oldest,
    ),
    (
        Scenario("observe_last_uses_grant", [Layer("ObserveCounter")], models={"main": {"reply_template": WORDS_25}}),
        _observe_last_uses_grant,
    ),
    (
        Scenario(
            "observe_deltas_intercept_end",
            [Layer("ObserveDeltasInterceptEnd")],
            models={"main": {"reply_template": WORDS_64}},
        ),
        _observe_deltas_intercept_end,
    ),
]
MODEL_OVERRIDE = Scenario(
    "model_override_seen",
    [Layer("OverrideModel"), Layer("ModelSeen")],
    models={"main": {}, "backup": {"reply_template": "B: {parameters}", "parameters": {"top_p": 0.3}}},
)
CATCH_BY_CLASS = Scenario("catch_by_class", [Layer("CatchInnerByClass"), Layer("RaisesKeyError")])
CATCH_STOP = {
    hook: Scenario(
        f"catch_stop_in_{hook}",
        [Layer("CatchInnerStop"), Layer("RaisesStopAsyncIteration", {"hook": hook})],
        message="call add a=1 b=2",
    )
    for hook in ("on_check_permission", "on_model_call")
}
STOP = {
    hook: Scenario(f"stop_in_{hook}", [Layer("RaisesStopAsyncIteration", {"hook": hook})], message="call add a=1 b=2")
    for hook in ("on_check_permission", "on_model_call")
}
SLOT_AFTER_YIELD = Scenario(
    "slot_after_yield",
    [Layer("SlotAfterYield"), Layer("ReadsOuterSlot")],
    models={"main": {"reply_template": "one two three four"}},
)
COMPRESS_INTO_MESSAGE = Scenario("compress_into_message", [Layer("CompressIntoMessage")], message="call add a=1 b=2")
SHARED_SLOT = Scenario(
    "shared_slot", [Layer("SharedCounter"), Layer("SharedCounter")], models={"main": {"reply_template": WORDS_25}}
)


@pytest.fixture(scope="module")
def sdk_fidelity_servers():
    started = Servers(
        [
            *(scenario for scenario, _ in SDK_FIDELITY_CASES),
            SHARED_SLOT,
            ONLY_WHEN_TATTLETALE,
            Scenario("edit", [Layer("InPlaceUserEdit")]),
            COMPRESS_INTO_MESSAGE,
            EDIT_MODEL_MESSAGE,
            COPIED_KWARGS_EDIT,
            IN_PLACE_TOOL_INPUT,
            LATE_AFTER_INNER,
            SLOT_AFTER_YIELD,
            Scenario("raises", [Layer("Raises")]),
            MODEL_OVERRIDE,
            CATCH_BY_CLASS,
            *CATCH_STOP.values(),
            *STOP.values(),
        ]
    )
    yield started
    started.stop()


@pytest.mark.parametrize(("scenario", "check"), SDK_FIDELITY_CASES, ids=[s.id for s, _ in SDK_FIDELITY_CASES])
async def test_sdk_fidelity_same_in_process_and_remote(
    scenario: Scenario, check: Check, sdk_fidelity_servers: Servers
) -> None:
    local_events, local_state = await run(scenario, ["local"] * len(scenario.layers), None)
    remote_events, remote_state = await run(scenario, ["remote"] * len(scenario.layers), sdk_fidelity_servers)
    check(local_events, local_state)
    check(remote_events, remote_state)
    assert remote_events == local_events and remote_state == local_state


async def test_a_layer_inside_an_override_of_current_model_sees_the_models_snapshot(
    sdk_fidelity_servers: Servers,
) -> None:
    """What a layer passes as current_model (here a ModelRef of another id, with a temperature)
    reaches the layers inside it as that registered model's snapshot, its parameters over the
    model's own, in every placement. (Before, an in-process inner layer got the override as passed,
    and a remote one behind an in-process override of an id got a ModelRef with an empty id.)"""
    placements = [["local", "local"], ["local", "remote"], ["remote", "local"], ["remote", "remote"]]
    results = [await run(MODEL_OVERRIDE, placement, sdk_fidelity_servers) for placement in placements]
    events, state = results[0]
    assert state["middle_context"]["ModelSeen"] == ["ModelRef", "backup", {"temperature": 0.2, "top_p": 0.3}]
    assert final_text(events) == 'B: {"temperature": 0.2, "top_p": 0.3}'
    assert all(result == results[0] for result in results[1:])


async def test_a_layer_catches_an_inner_layers_exception_by_class_in_every_placement(
    sdk_fidelity_servers: Servers,
) -> None:
    """An inner layer raises KeyError("user_42"); the outer one catches it as a LookupError and
    sees its class, its args (the key, not its repr) and its text as in-process, whichever of the
    two runs remotely. Before, an in-process layer around a remote one got a RuntimeError
    (RemoteMiddlewareError) its ``except LookupError`` missed, and a remote one got the key quoted."""
    placements = [["local", "local"], ["local", "remote"], ["remote", "local"], ["remote", "remote"]]
    results = [await run(CATCH_BY_CLASS, placement, sdk_fidelity_servers) for placement in placements]
    for placement, (events, state) in zip(placements, results, strict=True):
        seen = state["middle_context"].get("CatchInnerByClass")
        assert seen == {"class": "KeyError", "args": ["user_42"], "str": "'user_42'", "runtime": False}, placement
        assert final_text(events) == "caught it", placement


_THROTTLED = {"error": {"type": "rate_limit", "message": "throttled"}}
OWN_ERRORS = {
    "quota": Scenario("own_error_quota", [Layer("CatchByBase"), Layer("RaisesOwnError", {"kind": "quota"})]),
    "model": Scenario("own_error_model", [Layer("CatchByBase"), Layer("RaisesOwnError", {"kind": "model"})]),
    "all_failed": Scenario(
        "all_models_failed",
        [Layer("CatchByBase")],
        models={"main": {"script": [_THROTTLED]}, "backup": {"script": [_THROTTLED]}},
        fallback={"main": ["backup"]},
    ),
    "retry_after": Scenario("retry_after", [Layer("RaisesOwnError", {"kind": "throttled"})], max_retries=1),
}


@pytest.fixture(scope="module")
def own_error_servers():
    started = Servers(list(OWN_ERRORS.values()))
    yield started
    started.stop()


@pytest.mark.parametrize("case", list(OWN_ERRORS))
async def test_an_exception_keeps_its_bases_and_fields_in_every_placement(
    case: str, own_error_servers: Servers
) -> None:
    """An exception of a class the other side does not know is caught by the base class it has
    (ValueError, ModelError) and carries its fields (a QuotaError's code and detail, a ModelError's
    status, code and retry_after, which the host's retry waits), whichever layer runs remotely.
    Before, only its name crossed: a remote QuotaError(ValueError) missed an outer ``except
    ValueError``, a remote layer's ``except ModelError`` missed the host's AllModelsFailed (two
    models configured), and a remote ModelError's retry_after was lost, so the host retried at
    once instead of after the delay the provider asked for."""
    scenario = OWN_ERRORS[case]
    placements = [list(p) for p in itertools.product(["local", "remote"], repeat=len(scenario.layers))]
    results = [await run(scenario, placement, own_error_servers) for placement in placements]
    events, state = results[0]
    seen = state["middle_context"].get("CatchByBase")
    if case == "quota":
        assert seen == {
            "class": "QuotaError",
            "ValueError": True,
            "ModelError": False,
            "code": "42",
            "detail": "{'left': 0, 'tiers': ['free', 'pro']}",
        }
    elif case == "retry_after":  # waited what it asked for, not the policy's backoff
        (start,) = [e for e in events if e["class"] == "ModelCallStartEvent" and e["metadata"]]
        assert start["metadata"]["failed_attempts"][0]["retry_in"] == 0.004 < FAST_RETRY.initial_delay, start
    else:
        assert seen is not None and seen["ModelError"] and not seen["ValueError"], seen
        assert seen["class"] == ("ModelError" if case == "model" else "AllModelsFailed"), seen
        if case == "model":
            assert (seen["status"], seen["code"], seen["retry_after"]) == ("429", "throttled", "1.5"), seen
    if case != "retry_after":
        assert final_text(events) == "caught it"
    for placement, result in zip(placements[1:], results[1:], strict=True):  # texts say where it was raised
        assert tuple(map(unwrapped, result)) == results[0], placement


@pytest.mark.parametrize("hook", ["on_check_permission", "on_model_call"])
async def test_a_stop_async_iteration_of_a_coroutine_hook_is_caught_by_class_in_every_placement(
    hook: str, sdk_fidelity_servers: Servers
) -> None:
    """An inner layer's coroutine hook raises StopAsyncIteration: in-process the layer around it
    gets it as it is (a coroutine passes it on), and so it does now when the inner layer is remote.
    Before, the host raised it inside its protocol generators, which Python turns into
    RuntimeError('async generator raised StopAsyncIteration'), so ``except StopAsyncIteration``
    around a remote layer missed it."""
    placements = [["local", "local"], ["local", "remote"], ["remote", "local"], ["remote", "remote"]]
    for placement in placements:
        events, state = await run(CATCH_STOP[hook], placement, sdk_fidelity_servers)
        seen = state["middle_context"].get("CatchInnerStop", {})
        assert seen == {hook: {"class": "StopAsyncIteration", "str": f"no more in {hook}", "runtime": False}}, (
            placement,
            seen,
        )
        assert events[-2]["finished_reason"] == "completed", (placement, events[-2])


@pytest.mark.parametrize("hook", ["on_check_permission", "on_model_call"])
async def test_a_stop_async_iteration_uncaught_fails_alike_in_process_and_remote(
    hook: str, sdk_fidelity_servers: Servers
) -> None:
    """Uncaught, it reaches the agent's own generators, which make it Python's RuntimeError, in
    process and out alike. In on_model_call it failed in-process with an UnboundLocalError instead:
    the model retry loop (tenacity's ``async for``) took the re-raised StopAsyncIteration for its
    own end and went on with no result."""
    local = await run(STOP[hook], ["local"], None)
    remote = await run(STOP[hook], ["remote"], sdk_fidelity_servers)
    assert errors_compared(unwrapped(remote[0])) == errors_compared(local[0])
    assert states_compared(unwrapped(remote[1])) == states_compared(local[1])
    error = "RuntimeError: async generator raised StopAsyncIteration"
    if hook == "on_check_permission":  # the tool call's error result, as for any permission check's error
        results = [e["delta"] for e in local[0] if e["class"] == "ToolResultTextDeltaEvent"]
        assert results == [f"<system-reminder>{error}</system-reminder>"]
    else:
        end = local[0][-2]
        assert end["finished_reason"] == "error" and end["error"]["message"] == error, end


async def test_a_slot_set_after_a_yield_reaches_inner_layers_before_the_next_item(
    sdk_fidelity_servers: Servers,
) -> None:
    """The outer layer's code after ``yield`` sets its slot, then asks for the next item: in-process
    the inner layer producing that item sees the new value. Served remotely, the change goes with
    the pull that asks for the item (the SDK syncs the view there), so it sees the same."""
    local_events, local_state = await run(SLOT_AFTER_YIELD, ["local", "local"], None)
    remote_events, remote_state = await run(SLOT_AFTER_YIELD, ["remote", "local"], sdk_fidelity_servers)
    deltas = sum(e["class"] == "TextBlockDeltaEvent" for e in local_events)
    assert deltas >= 3
    assert local_state["middle_context"]["ReadsOuterSlot"] == {"seen": list(range(deltas))}
    assert remote_state["middle_context"] == local_state["middle_context"]
    assert remote_events == local_events


async def test_a_model_call_message_edited_in_place_reaches_the_model(sdk_fidelity_servers: Servers) -> None:
    """A message's text edited in place inside on_model_call's messages, then next_handler(**input_kwargs),
    is sent as an override. (Remote only: in-process the message is also the context's own object.)"""
    events, _ = await run(EDIT_MODEL_MESSAGE, ["remote"], sdk_fidelity_servers)
    assert final_text(events) == "You said: edited in place"


async def test_a_message_edited_through_a_copy_of_input_kwargs_reaches_the_model(
    sdk_fidelity_servers: Servers,
) -> None:
    """The same edit, reached through ``{**input_kwargs}`` and followed by a bare next_handler():
    the SDK must see that the kwargs were read (it skips the comparison only when they were not)."""
    for placement in (["local"], ["remote"]):
        events, _ = await run(COPIED_KWARGS_EDIT, placement, sdk_fidelity_servers)
        assert final_text(events) == "You said: edited through a copy", placement


async def test_a_tool_call_read_and_edited_in_place_reaches_the_tool(sdk_fidelity_servers: Servers) -> None:
    """on_acting reads ``tool_call`` (the SDK clears an unedited one by a snapshot of its fields,
    without encoding) and sets its ``input`` in place: the tool runs on the edit in both places.
    (The stored context differs: in-process the kwarg is the context's own block; remotely the
    edit reaches the host as an override, README "limits".)"""
    local_events, _ = await run(IN_PLACE_TOOL_INPUT, ["local"], None)
    remote_events, _ = await run(IN_PLACE_TOOL_INPUT, ["remote"], sdk_fidelity_servers)
    assert [e["delta"] for e in remote_events if e["class"] == "ToolResultTextDeltaEvent"] == ["42"]
    assert remote_events == local_events


async def test_a_hook_that_breaks_its_done_with_inner_promise_is_refused_remotely(
    sdk_fidelity_servers: Servers,
) -> None:
    """A slot write after the inner pipeline ended, from a hook declared done_with_inner: the host
    ended the call at inner_done and would never read it, so the SDK raises in the hook's code
    instead of letting it vanish unnoticed (logged by the middleware and, as a late fail, by the
    host). The reply is whole, and the next one too. In-process the declaration is not checked
    and the write stands."""
    for _ in range(2):
        events, state = await run(LATE_AFTER_INNER, ["remote"], sdk_fidelity_servers)
        assert kinds(events)[-1] == "Msg" and "LateAfterInner" not in state["middle_context"]
    server = sdk_fidelity_servers.procs[LATE_AFTER_INNER.layers[0].ident]
    for _ in range(200):  # its log line is drained from the pipe by a thread (a busy machine: slowly)
        # the whole log kept, not the last lines: a traceback follows each refusal
        if "is declared done_with_inner: after its inner pipeline ended it cannot change its slot" in server.tail(1000):
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError(f"the SDK did not refuse the late write:\n{server.tail(60)}")
    _, state = await run(LATE_AFTER_INNER, ["local"], None)
    assert state["middle_context"]["LateAfterInner"] == {"late": True}


async def test_a_hook_declared_only_when_is_not_called_while_its_flag_is_off(sdk_fidelity_servers: Servers) -> None:
    """The host skips an only_when hook while its slot flag is off: this one fails when called
    then, and the reply still ends well, with the step that found the flag set acted on. In-process
    the declaration has no effect: the same class fails the reply at its first step."""
    for _ in range(2):  # the second on the reused streams
        events, state = await run(ONLY_WHEN_TATTLETALE, ["remote"], sdk_fidelity_servers)
        armed = [e["value"] for e in events if e["class"] == "CustomEvent" and e["name"] == "armed_step"]
        assert armed == [{"calls": 1}] and kinds(events)[-1] == "Msg"
        assert state["middle_context"]["OnlyWhenTattletale"] == {"calls": 2, "armed": True}
    events, _ = await run(ONLY_WHEN_TATTLETALE, ["local"], None)
    assert "only_when flag was off" in str(events[-1])


async def test_a_slot_shared_by_an_in_process_and_a_remote_layer(sdk_fidelity_servers: Servers) -> None:
    """Two instances with one key, one in the host's process: the remote one sees the other's
    in-place writes (25 deltas, counted by both)."""
    local_events, local_state = await run(SHARED_SLOT, ["local", "local"], None)
    for placement in (["local", "remote"], ["remote", "local"]):
        events, state = await run(SHARED_SLOT, placement, sdk_fidelity_servers)
        assert state["middle_context"]["Shared"] == local_state["middle_context"]["Shared"] == {"n": 50}, placement
        assert events == local_events


async def test_an_in_place_edit_a_remote_view_cannot_carry_fails_loudly(sdk_fidelity_servers: Servers) -> None:
    """Editing the user's message in place works in-process; remotely it is refused with an error
    that says what the view supports (not silently lost)."""
    events, _ = await run(Scenario("edit", [Layer("InPlaceUserEdit")]), ["remote"], sdk_fidelity_servers)
    end = events[-2]
    assert end["class"] == "ReplyEndEvent" and end["finished_reason"] == "error"
    assert "ContextEditError" in end["error"]["message"]
    assert "agent.state.context[0] was edited in place" in end["error"]["message"]


async def test_a_context_replaced_by_other_than_its_newest_messages_fails_loudly(
    sdk_fidelity_servers: Servers,
) -> None:
    """A compression that puts a message of its own in place of the oldest one works in-process;
    remotely only dropping the oldest messages is carried, so it is refused with an error that
    says what the view supports (before: an SDK-internal AttributeError)."""
    events, state = await run(COMPRESS_INTO_MESSAGE, ["local"], None)
    assert state["context"][0]["content"][0]["text"] == "earlier: call add a=1 b=2"
    events, _ = await run(COMPRESS_INTO_MESSAGE, ["remote"], sdk_fidelity_servers)
    end = events[-2]
    assert end["class"] == "ReplyEndEvent" and end["finished_reason"] == "error"
    assert "ContextEditError" in end["error"]["message"]
    assert "agent.state.context replaced by messages that are not its newest ones" in end["error"]["message"]


async def test_a_hook_declared_but_not_served_fails_at_attach() -> None:
    """Describe names on_reasoning, the server has no OnReasoning service: caught at attach."""
    from agent_host.remote import RemoteMiddleware
    from clients.launch import ServerProcess

    proc = ServerProcess(["-m", "tests.raw_mw", "unserved", "--address", "127.0.0.1:0"]).start()
    try:
        remote = RemoteMiddleware(proc.address)
        with pytest.raises(Exception, match="declares on_reasoning but does not serve it"):
            await remote.connect()
        await remote.close()
    finally:
        proc.stop()


async def test_a_remote_exception_keeps_its_traceback(sdk_fidelity_servers: Servers, caplog) -> None:
    """The SDK sends the traceback in Fail; the host logs it with the middleware's name."""
    import logging

    with caplog.at_level(logging.ERROR, logger="agentmw.remote"):
        await run(Scenario("raises", [Layer("Raises")]), ["remote"], sdk_fidelity_servers)
    (record,) = [r for r in caplog.records if "middleware 'Raises' raised in on_reasoning" in r.getMessage()]
    assert 'raise ValueError("budget service says no")' in record.getMessage()
    assert "ValueError: budget service says no" in record.getMessage()


@pytest.mark.parametrize("mode", ["seqs", "burst"])
async def test_every_delivered_item_is_numbered_and_a_burst_of_copies_comes_batched(mode: str) -> None:
    """Observed copies carry their own seq (1, 2, ... with the intercepted ones), not 0; and the
    copies of a burst of deltas (an instant model's 200 words) travel several to a message (a
    Batch, handled in order: hooks.proto) instead of costing one write each."""
    from agent_host.agent import Agent
    from agent_host.models import OfflineRuleModel
    from agent_host.remote import RemoteMiddleware
    from agentmw.data import UserMsg
    from clients.launch import ServerProcess

    proc = ServerProcess(["-m", "tests.raw_mw", mode, "--address", "127.0.0.1:0"]).start()
    try:
        remote = await RemoteMiddleware(proc.address).connect()
        model = OfflineRuleModel(reply_template=" ".join(f"w{i}" for i in range(200)))
        agent = Agent(model=model, middlewares=[remote])
        events = [e async for e in agent.reply_stream(UserMsg("hello"))]
        assert events[-2].finished_reason == "completed", events[-2].error
        await remote.close()
    finally:
        proc.stop()


async def finish_early_over(core: Any) -> list[Any]:
    """The items of an on_reply chain of ``core`` under raw_mw's finish_early: it observes every
    item with one credit and finishes after the first copy."""
    from agent_host.agent import Agent
    from agent_host.models import OfflineRuleModel
    from agent_host.remote import RemoteMiddleware
    from agentmw.chain import Chain
    from clients.launch import ServerProcess

    proc = ServerProcess(["-m", "tests.raw_mw", "finish_early", "--address", "127.0.0.1:0"]).start()
    try:
        remote = await RemoteMiddleware(proc.address).connect()
        chain = Chain("on_reply", [remote], core)
        agent = Agent(model=OfflineRuleModel(), middlewares=[])
        out = [item async for item in chain(agent, inputs=None, structured_schema=None)]
        await remote.close()
        return out
    finally:
        proc.stop()


def _deltas(inputs: Any = None, structured_schema: Any = None) -> Any:
    from agentmw.data import TextBlockDeltaEvent

    async def stream() -> Any:
        for i in range(5):
            yield TextBlockDeltaEvent(reply_id="r", block_id="b", delta=f"w{i}")

    return stream()


async def test_an_observed_item_in_hand_is_forwarded_when_the_middleware_finishes_instead_of_granting() -> None:
    """The host took the second item from the inner pipeline and waits for credits to copy it; the
    middleware finishes instead. The item is the host's to forward (observed items never wait on the
    middleware), so the stream ends after it: nothing taken from the inner pipeline is lost."""
    assert [d.delta for d in await finish_early_over(_deltas)] == ["w0", "w1"]


async def test_an_inner_layer_that_returns_a_plain_async_iterator_is_closed_without_aclose() -> None:
    """A layer's hook may return any async iterator (``return Wrapped(next_handler())``), not only an
    async generator. When the middleware above it finishes with the inner pipeline half-read, the
    host closes it if it can be closed, and ends the call cleanly (the inner pipeline as it was
    given, with no generator around it, raised AttributeError: no aclose)."""
    from tests.conformance_mw import PlainIterator

    plain = await finish_early_over(lambda inputs=None, structured_schema=None: PlainIterator(_deltas()))
    assert [d.delta for d in plain] == ["w0", "w1"]


async def test_a_response_returned_after_bypassed_chunks_ends_the_stream_they_started() -> None:
    """on_model_call returns the inner stream's last chunk, having let the deltas pass by: remotely
    those went out first, so the host had handed out a stream, and the response returned is that
    stream's last item (hooks.proto, finish). The reply ends with the model's answer (in-process,
    with no declaration to act on, it is the returned response alone)."""
    scenario = Scenario(
        "last_chunk_bypassing_deltas",
        [Layer("ReturnsLastChunkBypassingDeltas")],
        models={"main": {"reply_template": "a b c"}},
    )
    started = Servers([scenario])
    try:
        events, _ = await run(scenario, ["remote"], started)
    finally:
        started.stop()
    assert [e["delta"] for e in events if e["class"] == "TextBlockDeltaEvent"] == ["a ", "b ", "c"]
    assert final_text(events) == "a b c" and events[-2]["finished_reason"] == "completed"


RUN_AHEAD = Scenario("run_ahead", [Layer("MaxItersAtStart"), Layer("AfterYieldRunsAhead")])


async def test_run_ahead_trades_lock_step_after_yield_for_a_round_trip(servers: Servers) -> None:
    """A hook declaring ``run_ahead`` is not suspended at its yields when served remotely: its code
    after ``yield`` runs before the outer layer handles the item. In-process nothing changes."""
    _, local_state = await run(RUN_AHEAD, ["local", "local"], None)
    _, remote_state = await run(RUN_AHEAD, ["local", "remote"], servers)
    assert local_state["middle_context"]["AfterYieldReads"] == {"max_iters": 7}
    assert remote_state["middle_context"]["AfterYieldReads"] == {"max_iters": 10}


async def test_a_remote_layer_sees_a_summary_set_in_process(servers: Servers) -> None:
    """An in-process layer sets agent.state.summary (no version bump, no context change); a remote
    layer around it reads the summary at its next item, as an in-process one would. Before, the host
    resent the context only when the state version or the context length moved: the summary read
    was the one of the begin."""
    for placement in (["local", "local"], ["remote", "local"]):
        _, state = await run(SUMMARY_IN_PROCESS, placement, servers)
        assert state["middle_context"]["SummaryReader"] == "noted at the text's end", placement
