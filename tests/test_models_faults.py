"""Model clients under faults: the real clients (the ``openai`` and ``dashscope`` SDKs) against the
local wire servers of tests/model_servers.py made to misbehave: Retry-After, quota errors,
repeated and interleaved tool calls, truncated streams, 200 answers that are not event streams,
error frames inside a stream, HTML error pages, cut (length) answers, late answers.

Timing assertions compare the server-side arrival times of requests with each other, with
generous bounds (no absolute deadlines).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import pytest
from dashscope.api_entities import aio_session

from agent_host.models import ModelError, ModelRegistry
from agent_host.models.dashscope import DashScopeChatModel
from agent_host.models.openai_compat import OpenAICompatibleModel
from agentmw.data import (
    ErrorType,
    FinishedReason,
    ModelCallEndEvent,
    ModelCallStartEvent,
    ReplyEndEvent,
    ReplyFinishedReason,
    TextBlockEndEvent,
    TextBlockStartEvent,
    ThinkingBlockEndEvent,
    ToolCallDeltaEvent,
    ToolCallEndEvent,
    ToolCallStartEvent,
    ToolResultEndEvent,
    ToolResultState,
    UserMsg,
)
from agentmw.middleware import MiddlewareBase
from agentmw.tools import Toolkit, tool
from tests.model_servers import (
    Reply,
    ScriptedServer,
    dashscope_chunk,
    dashscope_error_frame,
    dashscope_stream,
    of_type,
    openai_chunk,
    openai_error,
    openai_stream,
    openai_tool_fragment,
    reply,
    spec,
)

calls: list[str] = []


@tool(description="Weather of a city.")
def get_weather(city: str) -> str:
    calls.append(city)
    return f"{city}: sunny"


# -- 1. retries back off, honour Retry-After, skip quota errors; fallback failures name both ------


async def test_retry_waits_as_retry_after_ms_asks(server: ScriptedServer) -> None:
    server.replies += [
        Reply(
            status=429,
            body={"error": {"message": "slow down", "type": "requests", "code": "rate_limit_exceeded"}},
            headers={"retry-after-ms": "300", "x-request-id": "req-429"},
        ),
        openai_stream([openai_chunk("ok")]),
    ]
    reg = ModelRegistry.from_config({"default": "a", "models": {"a": spec(server, max_retries=1)}})

    events, final, _ = await reply(reg)

    assert final.text == "ok"
    first, second = server.requests
    assert 0.25 <= second.at - first.at < 5  # waited as asked (the configured backoff is 0.02 s)
    (start,) = of_type(events, ModelCallStartEvent)
    (failed,) = start.metadata["failed_attempts"]  # the client sees the retry and why
    assert (failed["model"], failed["error_type"], failed["request_id"]) == ("a", "rate_limit", "req-429")
    assert "slow down" in failed["error"]


async def test_backoff_grows_between_attempts(server: ScriptedServer) -> None:
    server.replies += [openai_error(503, "overloaded", "server_error")] * 3 + [openai_stream([openai_chunk("ok")])]
    retry = {"initial_delay": 0.1, "max_delay": 5.0, "deadline": 20.0}
    reg = ModelRegistry.from_config({"default": "a", "models": {"a": spec(server, max_retries=3, retry=retry)}})

    _, final, _ = await reply(reg)

    assert final.text == "ok"
    at = [r.at for r in server.requests]
    gaps = [b - a for a, b in itertools.pairwise(at)]
    assert gaps[0] >= 0.09 and gaps[1] >= 0.19 and gaps[2] >= 0.39  # 0.1, 0.2, 0.4 (+ jitter)


async def test_quota_is_not_retried_and_both_failures_are_named(server: ScriptedServer) -> None:
    with ScriptedServer() as server_b:
        server.replies.append(
            openai_error(429, "You exceeded your current quota.", "insufficient_quota", "insufficient_quota")
        )
        server_b.replies.append(Reply(status=400, body={"code": "InvalidParameter", "message": "bad input b"}))
        reg = ModelRegistry.from_config(
            {
                "default": "a",
                "models": {
                    "a": spec(server, max_retries=3, fallback=["b"]),
                    "b": spec(server_b, "dashscope", max_retries=3),
                },
            }
        )

        events, _, _ = await reply(reg)

    assert (len(server.requests), len(server_b.requests)) == (1, 1)  # neither retried
    end = of_type(events, ReplyEndEvent)[-1]
    assert end.finished_reason == ReplyFinishedReason.ERROR
    assert "You exceeded your current quota." in end.error.message and "bad input b" in end.error.message
    assert "a (attempt 1)" in end.error.message and "b (attempt 1)" in end.error.message


# -- 2. tool-call ids repeated across model calls --------------------------------------------------


async def test_repeated_tool_call_ids_get_fresh_ones(server: ScriptedServer) -> None:
    calls.clear()
    for city in ("Lyon", "Nice"):
        server.replies.append(
            openai_stream(
                [
                    openai_chunk(
                        tool_calls=[
                            openai_tool_fragment(0, json.dumps({"city": city}), id="call_0", name="get_weather")
                        ]
                    ),
                    openai_chunk(finish="tool_calls"),
                ]
            )
        )
    server.replies.append(openai_stream([openai_chunk("done")]))
    reg = ModelRegistry.from_config({"default": "a", "models": {"a": spec(server)}})

    events, final, _ = await reply(reg, toolkit=Toolkit([get_weather]), max_iters=4)

    assert final.text == "done"
    assert calls == ["Lyon", "Nice"]  # the second call ran
    ids = [e.tool_call_id for e in of_type(events, ToolCallStartEvent)]
    assert len(set(ids)) == 2
    sent = [m.get("tool_call_id") for m in server.requests[2].body["messages"] if m["role"] == "tool"]
    assert sent == ids  # the transcript sent back pairs each result with its own call


# -- 3. interleaved fragments of parallel tool calls ----------------------------------------------


async def test_interleaved_tool_call_fragments(server: ScriptedServer) -> None:
    calls.clear()
    server.replies.append(
        openai_stream(
            [
                openai_chunk(tool_calls=[openai_tool_fragment(0, '{"ci', id="call_a", name="get_weather")]),
                openai_chunk(tool_calls=[openai_tool_fragment(1, '{"ci', id="call_b", name="get_weather")]),
                openai_chunk(tool_calls=[openai_tool_fragment(0, 'ty": "Oslo"}')]),
                openai_chunk(tool_calls=[openai_tool_fragment(1, 'ty": "Rome"}')]),
                openai_chunk(finish="tool_calls"),
            ]
        )
    )
    server.replies.append(openai_stream([openai_chunk("both")]))
    reg = ModelRegistry.from_config({"default": "a", "models": {"a": spec(server)}})

    events, final, _ = await reply(reg, toolkit=Toolkit([get_weather]))

    assert final.text == "both" and sorted(calls) == ["Oslo", "Rome"]
    for call_id, city in (("call_a", "Oslo"), ("call_b", "Rome")):
        mine = [
            e
            for e in events
            if isinstance(e, ToolCallStartEvent | ToolCallDeltaEvent | ToolCallEndEvent) and e.tool_call_id == call_id
        ]
        kinds = [type(e) for e in mine]
        assert kinds[0] is ToolCallStartEvent and kinds[-1] is ToolCallEndEvent
        assert kinds.count(ToolCallEndEvent) == 1
        args = "".join(e.delta for e in mine if isinstance(e, ToolCallDeltaEvent))
        assert json.loads(args) == {"city": city}
        assert mine[-1].metadata["input"] == args  # the end carries the complete arguments


# -- 4. a truncated stream, a 200 that is not an event stream --------------------------------------


TRUNCATED = {
    "openai-truncated": ("openai", openai_stream([openai_chunk("Hel"), openai_chunk("lo")], done=False)),
    "openai-html-200": ("openai", Reply(raw="<html><body>Welcome to nginx</body></html>", content_type="text/html")),
    "openai-empty-json-200": ("openai", Reply(body={})),
    "dashscope-truncated": ("dashscope", dashscope_stream([dashscope_chunk("Hel")], complete=False)),
    "dashscope-html-200": ("dashscope", Reply(raw="<html><body>portal</body></html>", content_type="text/html")),
    "dashscope-empty-json-200": ("dashscope", Reply(body={})),
}


@pytest.mark.parametrize("case", list(TRUNCATED))
async def test_incomplete_answers_are_classified_errors(server: ScriptedServer, case: str) -> None:
    provider, bad = TRUNCATED[case]
    server.replies.append(bad)
    cls = OpenAICompatibleModel if provider == "openai" else DashScopeChatModel
    model = cls(id="m", base_url=spec(server, provider)["base_url"], api_key="k")

    with pytest.raises(ModelError) as info:
        async for _ in await model([UserMsg("x")]):
            pass
    await model.aclose()

    assert (info.value.error_type, info.value.retryable, info.value.code) == (ErrorType.UPSTREAM, True, "bad_response")
    assert "bad response" in str(info.value)


# -- 5. errors classified by what they are; request ids; HTML pages summarized ---------------------


async def test_dashscope_error_frame_is_classified_by_its_code(server: ScriptedServer) -> None:
    server.replies += [
        Reply(frames=[dashscope_error_frame("InternalError", "internal failure, try again", request_id="req-e1")]),
        dashscope_stream([dashscope_chunk("recovered")]),
    ]
    reg = ModelRegistry.from_config({"default": "a", "models": {"a": spec(server, "dashscope", max_retries=1)}})

    events, final, _ = await reply(reg)

    assert final.text == "recovered"  # retried: InternalError is the server's fault, whatever the label
    (failed,) = of_type(events, ModelCallStartEvent)[0].metadata["failed_attempts"]
    assert (failed["error_type"], failed["request_id"]) == ("upstream", "req-e1")
    assert of_type(events, ModelCallEndEvent)[0].metadata["request_id"] == "req-ds-1"


@pytest.mark.parametrize("failure", ["error-frame", "reset"])
async def test_dashscope_failure_after_an_event_without_text_is_retried(server: ScriptedServer, failure: str) -> None:
    # The first event carries only usage: the user has seen nothing, so the call has not started.
    (head,) = dashscope_stream([dashscope_chunk("", usage=(12, 0))], complete=False).frames
    if failure == "reset":
        first = Reply(frames=[head], reset=True)
    else:
        first = Reply(frames=[head, dashscope_error_frame("InternalError", "internal failure, try again")])
    server.replies += [first, dashscope_stream([dashscope_chunk("recovered", usage=(12, 1))])]
    reg = ModelRegistry.from_config({"default": "a", "models": {"a": spec(server, "dashscope", max_retries=1)}})

    events, final, _ = await reply(reg)

    assert (final.text, len(server.requests)) == ("recovered", 2)
    (failed,) = of_type(events, ModelCallStartEvent)[0].metadata["failed_attempts"]
    assert failed["error_type"] == ("connection" if failure == "reset" else "upstream")


async def test_gateway_html_page_is_summarized_with_the_request_id(server: ScriptedServer) -> None:
    page = "<html><head><title>502 Bad Gateway</title></head><body>" + "<p>nginx</p>" * 2000 + "</body></html>"
    server.replies.append(Reply(status=502, raw=page, content_type="text/html", headers={"x-request-id": "req-gw"}))
    model = OpenAICompatibleModel(id="m", base_url=f"{server.url}/v1", api_key="k")

    with pytest.raises(ModelError) as info:
        await model([UserMsg("x")])
    await model.aclose()

    message = str(info.value)
    assert "502 Bad Gateway" in message and "req-gw" in message and len(message) < 400
    assert (info.value.error_type, info.value.retryable, info.value.request_id) == (ErrorType.UPSTREAM, True, "req-gw")


# -- 6. a failure mid-stream leaves the reply consistent -------------------------------------------


async def test_mid_stream_failure_keeps_what_the_user_saw(server: ScriptedServer) -> None:
    server.replies.append(openai_stream([openai_chunk("Hello, "), openai_chunk("wor")], done=False))
    reg = ModelRegistry.from_config({"default": "a", "models": {"a": spec(server)}})

    events, final, agent = await reply(reg)

    kinds = [type(e) for e in events]
    assert kinds.index(TextBlockEndEvent) < kinds.index(ModelCallEndEvent) < kinds.index(ReplyEndEvent)
    (end,) = of_type(events, ModelCallEndEvent)
    assert end.finished_reason == FinishedReason.ERROR
    assert final.finished_reason == ReplyFinishedReason.ERROR
    saved = agent.state.context[-1]
    assert saved.text.startswith("Hello, wor")  # kept in the session, and marked incomplete
    assert "truncated" in saved.metadata["incomplete"]["error"]


# -- 7. finish reasons and usage -------------------------------------------------------------------


async def test_cut_tool_call_does_not_run_and_usage_details_are_kept(server: ScriptedServer) -> None:
    calls.clear()
    usage = {
        "prompt_tokens": 50,
        "completion_tokens": 20,
        "total_tokens": 70,
        "prompt_tokens_details": {"cached_tokens": 32},
        "completion_tokens_details": {"reasoning_tokens": 12},
    }
    server.replies += [
        openai_stream(
            [
                openai_chunk(tool_calls=[openai_tool_fragment(0, '{"city": "Os', id="call_x", name="get_weather")]),
                openai_chunk(finish="length"),
                {"id": "chatcmpl-1", "choices": [], "usage": usage},
            ]
        ),
        openai_stream([openai_chunk("sorry", finish="length")]),
    ]
    reg = ModelRegistry.from_config({"default": "a", "models": {"a": spec(server)}})

    events, final, _ = await reply(reg, toolkit=Toolkit([get_weather]))

    assert calls == []  # the cut call never ran
    (result,) = of_type(events, ToolResultEndEvent)
    assert result.state == ToolResultState.ERROR
    first, second = of_type(events, ModelCallEndEvent)
    assert (first.finished_reason, second.finished_reason) == (FinishedReason.LENGTH, FinishedReason.LENGTH)
    assert (first.cache_input_tokens, first.reasoning_tokens) == (32, 12)
    assert final.text == "sorry"


# -- 8. smaller ones -------------------------------------------------------------------------------


async def test_dashscope_late_answer_is_sent_once(server: ScriptedServer) -> None:
    server.replies += [dashscope_stream([dashscope_chunk("late")]), dashscope_stream([dashscope_chunk("late")])]
    server.replies[0].stall = 1.0
    model = DashScopeChatModel(id="m", base_url=f"{server.url}/api/v1", api_key="k", timeout=0.3)

    with pytest.raises(ModelError) as info:
        await model([UserMsg("x")])
    await asyncio.sleep(1.0)  # a resend would have arrived by now
    await model.aclose()

    assert info.value.error_type == ErrorType.CONNECTION
    assert len(server.requests) == 1


async def test_dashscope_plain_call_closes_thinking_before_text_and_its_own_session(server: ScriptedServer) -> None:
    server.replies.append(Reply(body=dashscope_chunk("answer", reasoning="thought", finish="stop", usage=(4, 2))))
    reg = ModelRegistry.from_config({"default": "a", "models": {"a": spec(server, "dashscope", stream=False)}})
    loop = asyncio.get_running_loop()

    events, final, _ = await reply(reg)

    kinds = [type(e) for e in events]
    assert kinds.index(ThinkingBlockEndEvent) < kinds.index(TextBlockStartEvent)
    assert final.text == "answer"
    assert loop not in aio_session._aio_sessions  # the SDK's never-closed shared session is not used


class _Params(MiddlewareBase):
    """An in-process on_model_call middleware that overrides request parameters for one call."""

    async def on_model_call(self, agent: Any, input_kwargs: dict[str, Any], next_handler: Any) -> Any:
        return await next_handler(parameters={"temperature": 0.1, "max_tokens": 7})


async def test_middleware_overrides_request_parameters(server: ScriptedServer) -> None:
    server.replies.append(openai_stream([openai_chunk("ok")]))
    reg = ModelRegistry.from_config(
        {"default": "a", "models": {"a": spec(server, parameters={"temperature": 0.9, "seed": 3})}}
    )

    _, final, _ = await reply(reg, middlewares=[_Params()])

    assert final.text == "ok"
    body = server.requests[0].body
    assert (body["temperature"], body["max_tokens"], body["seed"]) == (0.1, 7, 3)


def test_agent_chat_says_an_error_once_and_a_cut_answer() -> None:
    import io

    from agentmw.data import AssistantMsg, ErrorInfo
    from clients.chat import View

    out = io.StringIO()
    view = View(out=out, color=False)
    error = ErrorInfo(type=ErrorType.UPSTREAM, message="ModelError: openai model 'm': HTTP 502: HTML page: Bad Gateway")
    view.show(ModelCallEndEvent(reply_id="r", finished_reason=FinishedReason.LENGTH))
    view.show(ReplyEndEvent(session_id="s", reply_id="r", finished_reason=ReplyFinishedReason.ERROR, error=error))
    view.show(
        AssistantMsg(f"The reply failed: {error.message}", finished_reason=ReplyFinishedReason.ERROR, error=error)
    )

    text = out.getvalue()
    assert text.count("HTTP 502") == 1, text
    assert "cut at its output token limit" in text
