"""Tracing across processes: a host, the tracing server, an author's middleware that makes a span
of its own, and an OTLP receiver (clients/traces.py) in this process, all on 127.0.0.1.

Every wait is bounded; nothing asserts absolute times (only that spans nest in time).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace

from agentmw.data import (
    AssistantMsg,
    ConfirmResult,
    ModelCallEndEvent,
    ReplyFinishedReason,
    Role,
    TextBlock,
    ToolCallBlock,
    ToolResultBlock,
    ToolResultState,
    ToolResultTextDeltaEvent,
    UserMsg,
)
from agentmw.middleware import MiddlewareBase, subscribe
from clients.chat import HostClient, Turn, converse
from clients.launch import ServerProcess
from clients.traces import DEFAULT_SETTLE, Receiver, format_trace

from .host_util import Procs, run_cli
from .model_servers import (
    Reply,
    ScriptedServer,
    dashscope_chunk,
    dashscope_error,
    dashscope_stream,
    openai_chunk,
    openai_stream,
    spec,
)

pytestmark = pytest.mark.timeout(90)

Span = dict[str, Any]
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}  # batches go out every 50 ms, not every 5 s


class AuthorSpans(MiddlewareBase):
    """An author's middleware with no tracing code beyond making a span in the current context
    (the SDK continues the host's trace around it). Served in its own process."""

    subscriptions = {"on_model_call": subscribe(eager_next=True)}

    def __init__(self) -> None:
        from agent_host import tracing

        tracing.configure("author-mw")  # the exporter from the OTEL_* variables of its process

    async def on_model_call(self, agent: Any, input_kwargs: dict[str, Any], next_handler: Any) -> Any:
        from opentelemetry import trace

        with trace.get_tracer("author").start_as_current_span("author work"):
            return await next_handler()


class LowTemperature(MiddlewareBase):
    """Overrides request parameters for each call, as docs/models.md "Per-call parameters from a
    middleware" shows. Served in its own process."""

    async def get_middleware_key(self) -> str:
        return "lowtemp"

    async def on_model_call(self, agent: Any, input_kwargs: dict[str, Any], next_handler: Any) -> Any:
        return await next_handler(parameters={"temperature": 0.1, "max_tokens": 256})


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    rec = Receiver().start()
    try:
        yield rec
    finally:
        rec.stop()


def start(procs: Procs, name: str, argv: list[str], env: dict[str, str]) -> ServerProcess:
    proc = ServerProcess(argv, name=name, env=env, log_dir=procs.log_dir, startup=20, new_session=True)
    procs.procs.append(proc)
    return proc.start()


TRACER = ["-m", "mw_servers.tracing", "--address", "127.0.0.1:{port}"]


HOST = ["-m", "agent_host", "--listen", "127.0.0.1:0", "--db", ":memory:"]


def host_with(
    procs: Procs, tracer: ServerProcess, env: dict[str, str], *args: str, name: str = "host"
) -> ServerProcess:
    """A host (sessions in memory) with the tracing server attached first, then ``args``."""
    return start(procs, name, [*HOST, "--middleware", f"tracing={tracer.address}", *args], env)


def system(procs: Procs, env: dict[str, str]) -> tuple[ServerProcess, ServerProcess]:
    """The tracing server, the author's middleware and the host with both attached (tracing first)."""
    tracer = start(procs, "tracing", TRACER, env)
    author = start(
        procs, "author", ["-m", "agentmw.sdk", "tests.test_tracing:AuthorSpans", "--address", "127.0.0.1:0"], env
    )
    host = host_with(procs, tracer, env, "--middleware", f"author={author.address}")
    return host, tracer


async def talk(address: str, session: str, text: str, **answers: Any) -> Turn:
    async with HostClient(address) as client:
        return await converse(client, session, UserMsg(text), **answers)


def trace_of(receiver: Receiver, reply_id: str, want: dict[str, int], halves: int = 1) -> list[Span]:
    """The spans of the last trace of reply ``reply_id`` (a parked and resumed reply has
    ``halves`` = 2 traces), once it holds at least ``want[name prefix]`` spans of each kind."""
    want = {"reply ": 1, "invoke_agent": 1, **want}  # the host's reply span ends last: maybe a later batch

    def last_trace(spans: list[Span]) -> list[Span]:
        agents = named_for(spans, reply_id)
        if len(agents) < halves:
            return []
        return [s for s in spans if s["trace_id"] == agents[-1]["trace_id"]]

    def complete(spans: list[Span]) -> bool:
        mine = last_trace(spans)
        return all(sum(s["name"].startswith(k) for s in mine) >= n for k, n in want.items())

    everything = receiver.collector.wait_for(complete, 10.0)
    spans = last_trace(everything)
    assert complete(everything), f"incomplete trace for reply {reply_id}:\n{format_trace(spans) if spans else 'none'}"
    return spans


def named(spans: list[Span], prefix: str) -> list[Span]:
    return sorted((s for s in spans if s["name"].startswith(prefix)), key=lambda s: s["start_ns"])


def parent(spans: list[Span], span: Span) -> Span:
    return next(s for s in spans if s["span_id"] == span["parent_span_id"])


def check_shape(spans: list[Span], session: str) -> Span:
    """One trace: the host's reply span is its root; every middleware span hangs under the host's
    span of the hook invocation it came from; spans nest in time. Returns the root."""
    assert len({s["trace_id"] for s in spans}) == 1
    roots = [s for s in spans if not s["parent_span_id"]]
    assert [(r["name"], r["service"]) for r in roots] == [("reply assistant", "agent-host")]
    root = roots[0]
    hook_of = {"invoke_agent": "on_reply tracing", "chat": "on_model_call tracing", "execute_tool": "on_acting tracing"}
    for span in spans:
        kind = span["name"].split(" ")[0]
        if span["service"] == "agentmw-tracing" and not span["attributes"].get(
            "agentscope.agent.is_external_execution"
        ):
            hook = parent(spans, span)
            assert (hook["name"], hook["service"]) == (hook_of[kind], "agent-host"), format_trace(spans)
            assert parent(spans, hook) is root
            assert span["attributes"]["gen_ai.conversation.id"] == session
            assert span["attributes"]["gen_ai.operation.name"] == kind
        if span is not root:
            assert root["start_ns"] <= span["start_ns"] <= span["end_ns"] <= root["end_ns"], format_trace(spans)
    for author in named(spans, "author work"):  # the SDK continued the host's context in plain author code
        hook = parent(spans, author)
        assert (hook["name"], author["service"]) == ("on_model_call author", "author-mw")
        assert parent(spans, hook) is root
    return root


def check_chats(spans: list[Span], turn: Turn) -> None:
    """One chat span per model call, with the usage and finish reason the client saw."""
    ends = [i for i in turn.items if isinstance(i, ModelCallEndEvent)]
    chats = named(spans, "chat ")
    assert [
        (c["attributes"]["gen_ai.usage.input_tokens"], c["attributes"]["gen_ai.usage.output_tokens"]) for c in chats
    ] == [(e.input_tokens, e.output_tokens) for e in ends]
    for chat in chats:
        attrs = chat["attributes"]
        assert json.loads(attrs["gen_ai.response.finish_reasons"]) == ["stop"]
        assert attrs["gen_ai.provider.name"] == "offline" and attrs["gen_ai.request.model"]
        assert {t["name"] for t in json.loads(attrs["gen_ai.tool.definitions"])} >= {"get_weather", "send_email"}
        assert json.loads(attrs["gen_ai.input.messages"])[0]["role"] == "system"
    assert len(named(spans, "author work")) == len(ends)


def tool_text(turn: Turn, call_id: str) -> str:
    return "".join(i.delta for i in turn.items if isinstance(i, ToolResultTextDeltaEvent) and i.tool_call_id == call_id)


async def test_one_trace_per_reply_with_genai_attributes(procs: Procs, receiver: Receiver) -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, **FAST_EXPORT}
    host, _ = system(procs, env)

    # A tool call.
    turn = await talk(host.address, "", "What's the weather in Paris?")
    session = turn.session_id
    spans = trace_of(receiver, turn.final.id, {"invoke_agent": 1, "chat": 2, "execute_tool": 1, "author work": 2})
    check_shape(spans, session)
    check_chats(spans, turn)
    (tool,) = named(spans, "execute_tool")
    attrs = tool["attributes"]
    assert attrs["gen_ai.tool.name"] == "get_weather" and json.loads(attrs["gen_ai.tool.call.arguments"]) == {
        "city": "Paris"
    }
    result = json.loads(attrs["gen_ai.tool.call.result"])
    assert result["content"][0]["text"] == tool_text(turn, attrs["gen_ai.tool.call.id"]) != ""
    (agent,) = named(spans, "invoke_agent")
    assert json.loads(agent["attributes"]["gen_ai.input.messages"])[0]["parts"] == [
        {"type": "text", "content": "What's the weather in Paris?"}
    ]
    output = json.loads(agent["attributes"]["gen_ai.output.messages"])[0]
    assert output["parts"][0]["content"] == turn.final.text

    # Human in the loop: one trace parks, the next one resumes and runs the confirmed tool.
    asked: list[ToolCallBlock] = []

    async def confirm(call: ToolCallBlock) -> ConfirmResult:
        asked.append(call)
        return ConfirmResult(confirmed=True, tool_call=call)

    turn = await talk(host.address, session, "email bob@example.com saying hi", on_confirm=confirm)
    assert turn.end is not None and turn.end.finished_reason == ReplyFinishedReason.COMPLETED
    parked, resumed = both_halves(receiver, turn.final.id)
    assert json.loads(parked["attributes"]["agentscope.agent.hitl_pending_tools"]) == ["send_email"]
    assert resumed["attributes"]["agentscope.agent.incoming_event_type"] == "user_confirm_result"
    spans = trace_of(receiver, turn.final.id, {"execute_tool": 1, "chat": 1}, halves=2)
    check_shape(spans, session)
    (tool,) = named(spans, "execute_tool")
    assert tool["attributes"]["gen_ai.tool.call.id"] == asked[0].id
    assert json.loads(tool["attributes"]["gen_ai.tool.call.arguments"]) == json.loads(asked[0].input)

    # External execution: the result the client sent gets a span of its own under invoke_agent.
    async def external(call: ToolCallBlock) -> ToolResultBlock:
        return ToolResultBlock(id=call.id, name=call.name, output="shipped on Monday", state=ToolResultState.SUCCESS)

    turn = await talk(host.address, session, "where is my order A-17?", on_external=external)
    parked, resumed = both_halves(receiver, turn.final.id)
    assert json.loads(parked["attributes"]["agentscope.agent.external_execution_pending_tools"]) == ["lookup_order"]
    spans = trace_of(receiver, turn.final.id, {"execute_tool": 1, "chat": 1}, halves=2)
    check_shape(spans, session)
    (compensating,) = [s for s in spans if s["attributes"].get("agentscope.agent.is_external_execution")]
    assert compensating["name"] == "execute_tool lookup_order" and parent(spans, compensating) is resumed
    assert json.loads(compensating["attributes"]["gen_ai.tool.call.result"]) == "shipped on Monday"


def both_halves(receiver: Receiver, reply_id: str) -> tuple[Span, Span]:
    """The invoke_agent spans of a reply that parked and was resumed."""
    spans = receiver.collector.wait_for(lambda spans: len(named_for(spans, reply_id)) >= 2, 10)
    parked, resumed = named_for(spans, reply_id)
    assert parked["trace_id"] != resumed["trace_id"]  # one trace per Reply call
    return parked, resumed


def named_for(spans: list[Span], reply_id: str) -> list[Span]:
    """The invoke_agent spans of one reply (a parked reply has two: parked, resumed), by time."""
    return sorted(
        (
            s
            for s in spans
            if s["name"].startswith("invoke_agent") and s["attributes"].get("agentscope.agent.reply_id") == reply_id
        ),
        key=lambda s: s["start_ns"],
    )


async def test_span_times_hold_when_the_tracing_server_is_in_another_time_zone(
    procs: Procs, receiver: Receiver
) -> None:
    """The tracing server times its spans by the items' created_at; here it runs nine hours ahead
    of the host (TZ=JST-9, a POSIX zone: no tz database needed). Every span of the reply still lies
    within the host's reply span. Before, created_at had no UTC offset and the server read the
    host's local time as its own: every span started 9 h before the reply."""
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, **FAST_EXPORT}
    tracer = start(procs, "tracing", TRACER, {**env, "TZ": "JST-9"})
    host = host_with(procs, tracer, {**env, "TZ": "UTC0"})
    turn = await talk(host.address, "", "What's the weather in Paris?")
    spans = trace_of(receiver, turn.final.id, {"invoke_agent": 1, "chat": 2, "execute_tool": 1})
    (root,) = named(spans, "reply ")
    for span in spans:
        assert root["start_ns"] <= span["start_ns"] <= span["end_ns"] <= root["end_ns"], format_trace(spans)


async def test_the_tracing_servers_service_name_flag_wins_over_the_environment(
    procs: Procs, receiver: Receiver
) -> None:
    """--service-name names the tracing server's spans even with OTEL_SERVICE_NAME set, as every
    other flag wins over the environment. Before, the flag was only the default and the variable
    won."""
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, **FAST_EXPORT}
    tracer = start(procs, "tracing", [*TRACER, "--service-name", "flagname"], {**env, "OTEL_SERVICE_NAME": "envname"})
    host = host_with(procs, tracer, env)
    turn = await talk(host.address, "", "hi")
    spans = trace_of(receiver, turn.final.id, {"invoke_agent": 1, "chat": 1})
    assert {s["service"] for s in spans} == {"agent-host", "flagname"}, format_trace(spans)


async def test_a_call_cut_at_the_token_limit_is_traced_as_length(procs: Procs, receiver: Receiver) -> None:
    """The model's answer is cut at its token limit (finish reason length): the chat span says
    "length", the GenAI convention's value, in finish_reasons and its output message. It said
    "unknown": only AgentScope's stop and interrupted were mapped."""
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, **FAST_EXPORT}
    config = procs.log_dir / "cut.yaml"
    config.write_text(
        "models:\n  default: cut\n  models:\n"
        '    cut: {provider: offline, script: [{text: "a cut answer", finish: length}]}\n'
    )
    tracer = start(procs, "tracing", TRACER, env)
    host = host_with(procs, tracer, env, "--config", str(config))
    turn = await talk(host.address, "", "hi")
    (chat,) = named(trace_of(receiver, turn.final.id, {"invoke_agent": 1, "chat": 1}), "chat ")
    assert json.loads(chat["attributes"]["gen_ai.response.finish_reasons"]) == ["length"]
    assert json.loads(chat["attributes"]["gen_ai.output.messages"])[0]["finish_reason"] == "length"


async def test_a_model_call_cut_by_an_interrupt_is_traced_as_interrupted(procs: Procs, receiver: Receiver) -> None:
    """A reply interrupted while its answer streams: the chat span says "interrupted" and has no
    output, in-process and remote alike. Before, in-process it said "stop" with the last delta as
    the whole answer, and remotely it had no finish reason at all."""
    tracer = start(procs, "tracing", TRACER, {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, **FAST_EXPORT})
    out = run_cli("tests.tracing_cut", receiver.endpoint, tracer.address, env=FAST_EXPORT)
    assert out.returncode == 0, out.stderr
    sessions = out.stdout.split()
    found = receiver.collector.wait_for(
        lambda spans: {s["attributes"].get("gen_ai.conversation.id") for s in named(spans, "chat ")} >= set(sessions),
        10.0,
    )
    for session in sessions:
        (chat,) = [s for s in named(found, "chat ") if s["attributes"].get("gen_ai.conversation.id") == session]
        assert json.loads(chat["attributes"]["gen_ai.response.finish_reasons"]) == ["interrupted"]
        assert "gen_ai.output.messages" not in chat["attributes"]


async def test_failed_model_calls_are_traced_as_errors_within_their_reply(procs: Procs, receiver: Receiver) -> None:
    """A DashScope answer cut mid-stream (the user saw "Partial answer", usage 10/2), then a reply
    whose call fails twice with a 500 before any chunk. Each failed call's chat span says "error"
    (finish reason, error.type, status), carries the usage and output the host had, and lies
    within its reply, as does the failed reply's invoke_agent span, which ends at the failure and
    shows what the user saw. Before, they had no finish reason, usage nor output, the chat spans
    were timed when the late copies arrived (after the reply), and invoke_agent lasted 0 ms."""
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, **FAST_EXPORT}
    with ScriptedServer() as server:
        config = procs.log_dir / "dashscope.yaml"
        model = {**spec(server, "dashscope"), "max_retries": 1}
        config.write_text(json.dumps({"models": {"default": "a", "models": {"a": model}}}))
        tracer = start(procs, "tracing", TRACER, env)
        host = host_with(procs, tracer, env, "--config", str(config))
        (head,) = dashscope_stream([dashscope_chunk("Partial ans", usage=(10, 1))], complete=False).frames
        (tail,) = dashscope_stream([dashscope_chunk("wer", usage=(10, 2))], complete=False).frames
        server.replies.append(Reply(frames=[head, tail], reset=True))
        cut = await talk(host.address, "", "hi")
        server.replies += [dashscope_error(500, "InternalError", "internal failure")] * 2
        failed = await talk(host.address, cut.session_id, "again")

    for turn, calls in ((cut, 1), (failed, 2)):
        assert turn.final.finished_reason == ReplyFinishedReason.ERROR
        spans = trace_of(receiver, turn.final.id, {"chat": calls})
        check_shape(spans, turn.session_id)  # every span within the reply
        chats = named(spans, "chat ")
        assert len(chats) == calls
        (agent,) = named(spans, "invoke_agent")
        assert agent["status"] == "error" and agent["end_ns"] >= chats[-1]["end_ns"] > agent["start_ns"]
        for chat in chats:
            attrs = chat["attributes"]
            assert chat["status"] == "error" and json.loads(attrs["gen_ai.response.finish_reasons"]) == ["error"]
            assert attrs["error.type"] == ("connection" if turn is cut else "upstream")
    (chat,) = named(trace_of(receiver, cut.final.id, {"chat": 1}), "chat ")
    attrs = chat["attributes"]
    assert (attrs["gen_ai.usage.input_tokens"], attrs["gen_ai.usage.output_tokens"]) == (10, 2)
    (output,) = json.loads(attrs["gen_ai.output.messages"])
    assert (output["parts"], output["finish_reason"]) == ([{"type": "text", "content": "Partial answer"}], "error")
    (agent,) = named(trace_of(receiver, cut.final.id, {"chat": 1}), "invoke_agent")
    assert json.loads(agent["attributes"]["gen_ai.output.messages"])[0]["parts"] == output["parts"]
    for chat in named(trace_of(receiver, failed.final.id, {"chat": 2}), "chat "):  # nothing arrived
        assert not {"gen_ai.usage.input_tokens", "gen_ai.output.messages"} & chat["attributes"].keys()


async def test_chat_span_shows_the_parameters_a_middleware_set_for_the_call(procs: Procs, receiver: Receiver) -> None:
    """A middleware outside the tracing server sends the call with temperature 0.1 and max_tokens
    256 over the model's configured temperature 0.9: the chat span says what the request carried.
    Before, it read only the model's parameters: 0.9, and no max_tokens."""
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, **FAST_EXPORT}
    with ScriptedServer() as server:
        config = procs.log_dir / "openai.yaml"
        model = {**spec(server), "parameters": {"temperature": 0.9, "top_p": 0.5}}
        config.write_text(json.dumps({"models": {"default": "a", "models": {"a": model}}}))
        low = start(
            procs, "low", ["-m", "agentmw.sdk", "tests.test_tracing:LowTemperature", "--address", "127.0.0.1:0"], env
        )
        tracer = start(procs, "tracing", TRACER, env)
        middleware = ["--middleware", f"lowtemp={low.address}", "--middleware", f"tracing={tracer.address}"]
        host = start(procs, "host", [*HOST, "--config", str(config), *middleware], env)
        server.replies.append(openai_stream([openai_chunk("hello", finish="stop")]))
        turn = await talk(host.address, "", "hi")
        sent = server.requests[0].body
    assert (sent["temperature"], sent["max_tokens"], sent["top_p"]) == (0.1, 256, 0.5)
    (chat,) = named(trace_of(receiver, turn.final.id, {"chat": 1}), "chat ")
    attrs = chat["attributes"]
    assert (attrs["gen_ai.request.temperature"], attrs["gen_ai.request.max_tokens"]) == (0.1, 256)
    assert attrs["gen_ai.request.top_p"] == 0.5  # the model's own, under the call's


async def test_tracing_server_down_and_restarted_between_replies(procs: Procs, receiver: Receiver) -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, **FAST_EXPORT}
    host, tracer = system(procs, env)
    first = await talk(host.address, "", "What's the weather in Paris?")
    trace_of(receiver, first.final.id, {"invoke_agent": 1, "chat": 2, "execute_tool": 1})

    tracer.kill()  # SIGKILL: gone without a word
    down = await talk(host.address, first.session_id, "What's the weather in Rome?")
    assert down.end is not None and down.end.finished_reason == ReplyFinishedReason.COMPLETED
    assert "Rome" in down.final.text  # the reply is the same with the tracer gone

    tracer.restart()  # the same port
    for _ in range(20):  # bounded: the host's channel reconnects within a second
        turn = await talk(host.address, first.session_id, "What's the weather in Oslo?")
        spans = receiver.collector.wait_for(lambda s, rid=turn.final.id: bool(named_for(s, rid)), 2.0)
        if named_for(spans, turn.final.id):
            break
    else:
        pytest.fail("no spans from the restarted tracing server")
    spans = trace_of(receiver, turn.final.id, {"invoke_agent": 1, "chat": 2, "execute_tool": 1})
    check_shape(spans, first.session_id)
    # The copies of the reply made while it was down waited in the background (up to the host's
    # timeout) for it to come back: that reply is traced late and in full, or not at all.
    if named_for(receiver.collector.spans, down.final.id):
        check_shape(
            trace_of(receiver, down.final.id, {"invoke_agent": 1, "chat": 2, "execute_tool": 1}), first.session_id
        )


async def test_replicas_sharing_one_tracing_server_keep_their_tool_spans_apart(
    procs: Procs, receiver: Receiver, tmp_path: Path
) -> None:
    """Two hosts (replicas) send to one tracing server, whose tool spans pair on_acting's call with
    on_reply's times. Tool call ids repeat across hosts (each offline model numbers its calls
    call_1_0, ...; real providers may too). Keyed by call id alone, host B's call overwrote host
    A's while A's times were still to come, and A's execute_tool span was lost (the bench counted
    ~30% fewer spans remote than in-process). Here A is slow, so that its tool call's copy has
    arrived (the host holds it at most 0.5 s) and its times have not when B's whole reply arrives."""
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, **FAST_EXPORT}
    tracer = start(procs, "tracing", TRACER, env)
    slow = tmp_path / "slow.yaml"
    slow.write_text("models:\n  default: slow\n  models:\n    slow: {provider: offline, delay: 0.2}\n")
    host_a = host_with(procs, tracer, env, "--config", str(slow), name="host-a")
    host_b = host_with(procs, tracer, env, name="host-b")

    slow_turn = asyncio.create_task(talk(host_a.address, "", "use get_weather city=Paris"))  # call_1_0
    await asyncio.sleep(1.2)  # its tool has run, and its call's copy gone out; its answer streams for ~2 s
    fast = await talk(host_b.address, "", "use get_weather city=Rome")  # call_1_0 too
    assert not slow_turn.done(), "host A's reply must still be running"
    turns = {"Paris": await slow_turn, "Rome": fast}
    for city, turn in turns.items():
        assert turn.final is not None and city in turn.final.text
        spans = trace_of(receiver, turn.final.id, {"invoke_agent": 1, "chat": 2, "execute_tool": 1})
        root = check_shape(spans, turn.session_id)  # in its own reply's trace, inside it
        (tool,) = named(spans, "execute_tool")
        assert tool["attributes"]["gen_ai.tool.call.id"] == "call_1_0", format_trace(spans)
        assert json.loads(tool["attributes"]["gen_ai.tool.call.arguments"]) == {"city": city}, format_trace(spans)
        assert root["start_ns"] <= tool["start_ns"] <= tool["end_ns"] <= root["end_ns"]


async def test_no_exporter_configured_no_spans(procs: Procs, receiver: Receiver, tmp_path: Path) -> None:
    # The endpoint is set but the exporter is "none": neither the host nor the tracing server
    # (nor the author's middleware) may send anything.
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_TRACES_EXPORTER": "none", **FAST_EXPORT}
    host, tracer = system(procs, env)
    turn = await talk(host.address, "", "What's the weather in Paris?")
    assert turn.end is not None and turn.end.finished_reason == ReplyFinishedReason.COMPLETED
    assert receiver.collector.wait_for(bool, 1.0) == []
    assert "no span exporter configured" in tracer.tail()


def exporting(service: str, endpoint: str) -> Any:
    """A TracerProvider of ``service`` that exports each span as it ends (as one process would)."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


def printed(viewer: ServerProcess, through: str = "") -> list[str]:
    """The viewer's output lines (indentation kept), once one contains ``through``: the last line of
    the block a test reads, since the lines come in one by one through a reader thread."""
    if through:
        viewer.wait_for_line(through)
    return [line[4:] for line in viewer.tail(200).splitlines()]  # tail() indents by 4


def test_viewer_prints_late_spans_under_their_parents_and_pending_ones_at_exit(procs: Procs) -> None:
    """The spans of one trace come in batches from several processes, by default 5 s apart: the
    viewer printed a trace once quiet for --settle seconds (1 by default) and dropped whatever came
    for it later, even at exit. Now later spans are printed as late additions to that trace, each
    under its parent; at exit, whatever is pending."""
    assert DEFAULT_SETTLE > 5.0  # the OTel SDK's default batch delay (OTEL_BSP_SCHEDULE_DELAY)
    argv = ["-m", "clients.traces", "--listen", "127.0.0.1:{port}", "--settle", "1"]
    viewer = start(procs, "viewer", argv, {})
    host = exporting("agent-host", f"http://{viewer.address}")
    tracer = exporting("agentmw-tracing", f"http://{viewer.address}")
    try:
        spans = host.get_tracer("t")
        with (
            spans.start_as_current_span("reply assistant") as root,
            spans.start_as_current_span("on_reply tracing") as hook,
        ):
            pass
        trace_id = f"{root.get_span_context().trace_id:032x}"
        lines = printed(viewer, f"trace {trace_id}  2 spans")
        assert any(line.startswith(f"trace {trace_id}  2 spans") for line in lines), lines

        # The tracing server's batch, after the host's was printed: placed under the host's hook span.
        in_hook = trace.set_span_in_context(hook)
        with tracer.get_tracer("t").start_as_current_span("invoke_agent assistant", context=in_hook) as agent:
            pass
        late = f"late additions to trace {trace_id}  1 spans (of 3), agentmw-tracing"
        lines = printed(viewer, "invoke_agent assistant")
        assert late in lines, lines
        at = lines.index(late)
        assert lines[at + 1 : at + 3] == [
            "  reply assistant  [agent-host]  (printed before)",
            "    on_reply tracing  [agent-host]  (printed before)",
        ]
        assert re.fullmatch(r"      invoke_agent assistant  \d+\.\d ms  \[agentmw-tracing\]", lines[at + 3]), lines

        # One more, and the viewer stopped at once (SIGTERM): printed at exit, not dropped.
        with tracer.get_tracer("t").start_as_current_span("chat m", context=trace.set_span_in_context(agent)):
            pass
    finally:
        host.shutdown()
        tracer.shutdown()
    assert viewer.stop() == 0
    lines = printed(viewer)
    last = f"late additions to trace {trace_id}  1 spans (of 4), agentmw-tracing"
    assert lines[-5:-1] == [
        last,
        "  reply assistant  [agent-host]  (printed before)",
        "    on_reply tracing  [agent-host]  (printed before)",
        "      invoke_agent assistant  [agentmw-tracing]  (printed before)",
    ], lines
    assert re.fullmatch(r"        chat m  \d+\.\d ms  \[agentmw-tracing\]", lines[-1]), lines


def test_a_second_viewer_on_a_taken_port_is_refused(receiver: Receiver) -> None:
    """Without the servers' options (SO_REUSEPORT left on) a second agentmw-traces started on the
    first one's port, and each got some of the exports."""
    done = run_cli("clients.traces", "--listen", receiver.address, timeout=15)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.splitlines() == [f"agentmw-traces: cannot listen on {receiver.address} (address already in use)"]
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--listen", "bad"], "--listen: 'bad' is not HOST:PORT (a port of 0-65535; 0: any free port)"),
        (["--listen", "127.0.0.1:0", "--settle", "-1"], "argument --settle: must be 0 or more, not -1"),
    ],
    ids=["listen", "settle"],
)
def test_the_viewers_usage_errors_exit_2(argv: list[str], says: str) -> None:
    """A malformed --listen and a negative --settle are usage errors (exit 2), as every command's
    are. Before, the first exited 1 (a failure to start) and the second was taken (no wait)."""
    done = run_cli("clients.traces", *argv, timeout=10)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines()[-1] == f"agentmw-traces: error: {says}", done.stderr


@pytest.mark.parametrize("endpoint", ["notaurl:::", "http://127.0.0.1:99999", "ftp://collector:4317", "http://:4317"])
def test_a_bad_otlp_endpoint_is_refused_at_start(endpoint: str, tmp_path: Path) -> None:
    """The exporter takes any text and then fails at each export, in the background: the tracing
    server and the host refuse it at start instead, with one line naming it."""
    done = run_cli("mw_servers.tracing", "--address", "127.0.0.1:0", "--otlp-endpoint", endpoint, timeout=30)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == (
        f"mw_servers.tracing: endpoint: {endpoint!r} is not an OTLP/gRPC endpoint (e.g. http://127.0.0.1:4317)"
    )
    config = tmp_path / "host.yaml"
    config.write_text(f"tracing: {{endpoint: '{endpoint}'}}\n")
    host = run_cli("agent_host", "--config", str(config), "--listen", "127.0.0.1:0", "--db", ":memory:", timeout=30)
    assert host.returncode == 2 and f"{endpoint!r} is not an OTLP/gRPC endpoint" in host.stderr, host.stderr


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("OTEL_EXPORTER_OTLP_COMPRESSION", "bogus", 'OTLP exporter: Invalid value "bogus" for compression'),
        ("OTEL_EXPORTER_OTLP_CERTIFICATE", "/nonexistent.pem", "OTEL_EXPORTER_OTLP_CERTIFICATE: '/nonexistent.pem' is"),
    ],
)
def test_a_bad_otlp_variable_is_one_line_at_start(variable: str, value: str, says: str) -> None:
    """Before: a traceback and exit 1 (a bad compression), or a traceback and the server serving
    without the certificate it was given (a missing file)."""
    env = {variable: value}
    done = run_cli(
        "mw_servers.tracing", "--address", "127.0.0.1:0", "--otlp-endpoint", "http://127.0.0.1:4317", env=env
    )
    assert done.returncode == 2 and done.stderr.strip().startswith(f"mw_servers.tracing: {says}"), done.stderr
    assert "Traceback" not in done.stderr


def test_span_json_is_written_as_before_on_the_fast_path() -> None:
    """_dumps lets json's encoder walk the plain data (dataclasses and enums through its default):
    the same text as converting it all first (_jsonable), also where json refuses a key."""
    from mw_servers.tracing import _dumps, _jsonable, _message

    result = ToolResultBlock(id="c1", name="t", output=[TextBlock(text="42")], state=ToolResultState.SUCCESS)
    msg = AssistantMsg([TextBlock(text="hé"), ToolCallBlock(id="c1", name="t", input='{"a": 1}'), result])
    for value in ([_message(msg, "stop")], {"role": Role.USER, "n": [1, 2.5, None, True]}, {("a", 1): "tuple key"}):
        assert _dumps(value) == json.dumps(_jsonable(value), ensure_ascii=False, default=str)
