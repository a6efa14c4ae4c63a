"""DashScopeChatModel: the real ``dashscope`` SDK client against a local DashScope wire server.

DashScope is unreachable from here, so the real client (``dashscope.AioGeneration`` over aiohttp)
is tested against a local server on 127.0.0.1 that speaks its wire protocol: the
text-generation endpoint's SSE framing (``id:`` / ``event:result`` / ``:HTTP_STATUS/200`` /
``data:``), ``output.choices[].message`` with ``content``, ``reasoning_content`` and indexed
``tool_calls`` fragments, cumulative ``usage``, and its JSON error bodies (``code``, ``message``).
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import dashscope
import pytest

from agent_host.agent import Agent
from agent_host.models import ModelError, ModelRegistry
from agent_host.models.dashscope import DashScopeChatModel
from agentmw.data import (
    ErrorType,
    ModelCallEndEvent,
    ReplyEndEvent,
    ReplyFinishedReason,
    SystemMsg,
    TextBlock,
    TextBlockDeltaEvent,
    ThinkingBlock,
    ThinkingBlockDeltaEvent,
    ToolCallBlock,
    ToolCallDeltaEvent,
    ToolCallStartEvent,
    ToolChoice,
    ToolResultEndEvent,
    UserMsg,
)
from agentmw.tools import Toolkit, tool
from tests.model_servers import (
    DASHSCOPE_PATH,
    Reply,
    ScriptedServer,
    dashscope_chunk,
    dashscope_error,
    dashscope_stream,
    dashscope_tool_fragment,
    of_type,
    openai_chunk,
    openai_stream,
    openai_usage_chunk,
    run_reply,
)

_opened: list[DashScopeChatModel | ModelRegistry] = []  # closed after each test (each owns an aiohttp session)


@pytest.fixture(autouse=True)
async def _close_sessions() -> Any:
    yield
    while _opened:
        await _opened.pop().aclose()
    await dashscope.close_shared_aio_session()


def ds(**kw: Any) -> DashScopeChatModel:
    model = DashScopeChatModel(**kw)
    _opened.append(model)
    return model


def registry(server: ScriptedServer, max_retries: int = 0, **extra: Any) -> ModelRegistry:
    spec = {
        "provider": "dashscope",
        "model_name": "qwen-plus",
        "base_url": f"{server.url}/api/v1",
        "api_key": "sk-test",
        "max_retries": max_retries,
        **extra,
    }
    reg = ModelRegistry.from_config({"default": "a", "models": {"a": spec}})
    _opened.append(reg)
    return reg


@tool(description="Weather of a city.")
def get_weather(city: str) -> str:
    return f"{city}: sunny, 21C"


@tool(description="Add two integers.")
def add(a: int, b: int) -> str:
    return str(a + b)


async def test_streams_text_and_thinking_with_usage(server: ScriptedServer) -> None:
    server.replies.append(
        dashscope_stream(
            [
                dashscope_chunk(reasoning="The user greets; ", usage=(12, 1)),
                dashscope_chunk(reasoning="answer politely.", usage=(12, 2)),
                dashscope_chunk("Hello", usage=(12, 3)),
                dashscope_chunk(", world", usage=(12, 4)),
                dashscope_chunk("!", finish="stop", usage=(12, 5)),
            ],
            delay=0.01,
        )
    )
    agent = Agent(models=registry(server), model="a", system_prompt="Be brief.")

    events, final = await run_reply(agent, "hi")

    assert [e.delta for e in of_type(events, ThinkingBlockDeltaEvent)] == ["The user greets; ", "answer politely."]
    assert [e.delta for e in of_type(events, TextBlockDeltaEvent)] == ["Hello", ", world", "!"]
    assert final.text == "Hello, world!"
    assert final.finished_reason == ReplyFinishedReason.COMPLETED
    end = of_type(events, ModelCallEndEvent)[0]
    assert (end.input_tokens, end.output_tokens, end.metadata["model"]) == (12, 5, "a")

    (request,) = server.requests
    assert request.path == DASHSCOPE_PATH
    assert request.headers["authorization"] == "Bearer sk-test"
    assert request.headers["x-dashscope-sse"] == "enable"
    assert request.body["model"] == "qwen-plus"
    assert request.body["input"]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    params = request.body["parameters"]
    assert (params["result_format"], params["incremental_output"]) == ("message", True)
    assert "tools" not in params


async def test_model_yields_deltas_then_one_complete_chunk(server: ScriptedServer) -> None:
    server.replies.append(
        dashscope_stream(
            [
                dashscope_chunk(reasoning="hmm", usage=(3, 1)),
                dashscope_chunk("a", usage=(3, 2)),
                dashscope_chunk("b", finish="stop", usage=(3, 3)),
            ]
        )
    )
    model = ds(
        id="m",
        model_name="qwen-plus",
        base_url=f"{server.url}/api/v1",
        api_key="k",
        parameters={"temperature": 0.2, "enable_thinking": True},
    )

    chunks = [c async for c in await model([UserMsg("x")])]

    assert [c.is_last for c in chunks] == [False, False, False, True]
    final = chunks[-1]
    assert [type(b) for b in final.content] == [ThinkingBlock, TextBlock]
    assert (final.content[0].thinking, final.content[1].text) == ("hmm", "ab")
    assert (final.usage.input_tokens, final.usage.output_tokens) == (3, 3)
    assert final.id == "req-ds-1"
    params = server.requests[0].body["parameters"]
    assert (params["temperature"], params["enable_thinking"]) == (0.2, True)


async def test_first_delta_arrives_before_the_stream_ends(server: ScriptedServer) -> None:
    server.replies.append(dashscope_stream([dashscope_chunk("early"), dashscope_chunk("late", finish="stop")], 0.6))
    model = ds(id="m", base_url=f"{server.url}/api/v1", api_key="k")
    started = time.monotonic()

    stream = await model([UserMsg("x")])  # returns with the first chunk
    first = await anext(stream)
    first_at = time.monotonic() - started
    rest = [c async for c in stream]

    assert first.content[0].text == "early" and first_at < 0.5
    assert rest[-1].content[0].text == "earlylate" and time.monotonic() - started >= 0.6


async def test_non_streaming_call(server: ScriptedServer) -> None:
    server.replies.append(Reply(body=dashscope_chunk("whole answer", finish="stop", usage=(7, 2))))
    model = ds(id="m", base_url=f"{server.url}/api/v1", api_key="k", stream=False)

    chunks = [c async for c in await model([UserMsg("x")])]

    assert chunks[-1].content[0].text == "whole answer"
    assert (chunks[-1].usage.input_tokens, chunks[-1].usage.output_tokens) == (7, 2)
    assert "x-dashscope-sse" not in server.requests[0].headers
    assert "incremental_output" not in server.requests[0].body["parameters"]


async def test_streamed_tool_calls_split_across_chunks(server: ScriptedServer) -> None:
    server.replies.append(
        dashscope_stream(
            [
                dashscope_chunk(tool_calls=[dashscope_tool_fragment(0, '{"ci', id="call_w", name="get_weather")]),
                dashscope_chunk(tool_calls=[dashscope_tool_fragment(0, 'ty": "Pa')]),
                dashscope_chunk(tool_calls=[dashscope_tool_fragment(0, 'ris"}')]),
                dashscope_chunk(tool_calls=[dashscope_tool_fragment(1, '{"a": 2,', id="call_a", name="add")]),
                dashscope_chunk(
                    tool_calls=[dashscope_tool_fragment(1, ' "b": 3}')], finish="tool_calls", usage=(30, 9)
                ),
            ]
        )
    )
    server.replies.append(dashscope_stream([dashscope_chunk("Paris is sunny; 2+3=5.", finish="stop", usage=(60, 8))]))
    agent = Agent(models=registry(server), model="a", toolkit=Toolkit([get_weather, add]))

    events, final = await run_reply(agent, "weather in Paris, and 2+3?")

    starts = of_type(events, ToolCallStartEvent)
    assert [(s.tool_call_id, s.tool_call_name) for s in starts] == [("call_w", "get_weather"), ("call_a", "add")]
    deltas: dict[str, str] = {}
    for d in of_type(events, ToolCallDeltaEvent):
        deltas[d.tool_call_id] = deltas.get(d.tool_call_id, "") + d.delta
    assert deltas == {"call_w": '{"city": "Paris"}', "call_a": '{"a": 2, "b": 3}'}
    assert len(of_type(events, ToolResultEndEvent)) == 2
    assert final.text == "Paris is sunny; 2+3=5."

    first, second = server.requests
    assert [t["function"]["name"] for t in first.body["parameters"]["tools"]] == ["get_weather", "add"]
    assert "tool_choice" not in first.body["parameters"]  # "auto" is the default: not sent
    assert second.body["input"]["messages"][2:] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_w",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {"id": "call_a", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_w", "name": "get_weather", "content": "Paris: sunny, 21C"},
        {"role": "tool", "tool_call_id": "call_a", "name": "add", "content": "5"},
    ]


async def test_tool_call_without_id_gets_a_stable_one(server: ScriptedServer) -> None:
    server.replies.append(
        dashscope_stream(
            [
                dashscope_chunk(tool_calls=[dashscope_tool_fragment(0, "", name="get_weather")]),
                dashscope_chunk(tool_calls=[dashscope_tool_fragment(0, '{"city": ')]),
                dashscope_chunk(tool_calls=[dashscope_tool_fragment(0, '"Oslo"}')], finish="tool_calls"),
            ]
        )
    )
    model = ds(id="m", base_url=f"{server.url}/api/v1", api_key="k")
    tools = Toolkit([get_weather]).schemas()

    chunks = [c async for c in await model([UserMsg("x")], tools, ToolChoice(mode="get_weather"))]

    ids = {b.id for c in chunks[:-1] for b in c.content}
    assert len(ids) == 1 and next(iter(ids)).startswith("call_")
    (call,) = chunks[-1].content
    assert isinstance(call, ToolCallBlock)
    assert (call.name, json.loads(call.input)) == ("get_weather", {"city": "Oslo"})
    params = server.requests[0].body["parameters"]
    assert params["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert server.requests[0].body["model"] == "m"  # model_name defaults to the id


async def test_rate_limit_is_retried_then_succeeds(server: ScriptedServer) -> None:
    server.replies += [
        dashscope_error(429, "Throttling.RateQuota", "Requests rate limit exceeded, please try again later."),
        dashscope_stream([dashscope_chunk("ok after a retry", finish="stop", usage=(5, 4))]),
    ]
    agent = Agent(models=registry(server, max_retries=1), model="a")

    events, final = await run_reply(agent, "hi")

    assert final.text == "ok after a retry"
    assert len(server.requests) == 2
    assert of_type(events, ModelCallEndEvent)[0].metadata["model"] == "a"


async def test_auth_error_fails_at_once_with_the_provider_message(server: ScriptedServer) -> None:
    server.replies.append(dashscope_error(401, "InvalidApiKey", "Invalid API-key provided."))
    agent = Agent(models=registry(server, max_retries=3), model="a")

    events, final = await run_reply(agent, "hi")

    assert len(server.requests) == 1  # not retried
    end = of_type(events, ReplyEndEvent)[-1]
    assert end.finished_reason == ReplyFinishedReason.ERROR
    assert end.error.type == ErrorType.AUTHENTICATION
    assert "Invalid API-key provided." in end.error.message and "InvalidApiKey" in end.error.message
    assert final.finished_reason == ReplyFinishedReason.ERROR
    assert "Invalid API-key provided." in final.text


@pytest.mark.parametrize(
    ("status", "code", "kind", "retryable"),
    [
        (500, "InternalError", ErrorType.UPSTREAM, True),
        (503, "ServiceUnavailable", ErrorType.UPSTREAM, True),
        (400, "InvalidParameter", ErrorType.INVALID_REQUEST, False),
        (403, "AccessDenied", ErrorType.PERMISSION, False),
        (400, "Throttling.RateQuota", ErrorType.RATE_LIMIT, True),
        (429, "Throttling.AllocationQuota", ErrorType.RATE_LIMIT, False),  # quota exhausted: waiting won't help
    ],
)
async def test_error_mapping(server: ScriptedServer, status: int, code: str, kind: ErrorType, retryable: bool) -> None:
    server.replies.append(dashscope_error(status, code, f"provider says {code}"))
    model = ds(id="m", base_url=f"{server.url}/api/v1", api_key="k")

    with pytest.raises(ModelError) as info:
        await model([UserMsg("x")])

    assert (info.value.error_type, info.value.retryable, info.value.status) == (kind, retryable, status)
    assert f"provider says {code}" in str(info.value)


async def test_connection_error_is_retryable() -> None:
    with socket.socket() as probe:  # a loopback port with nothing listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    model = ds(id="m", base_url=f"http://127.0.0.1:{port}/api/v1", api_key="k")

    with pytest.raises(ModelError) as info:
        await model([UserMsg("x")])

    assert (info.value.error_type, info.value.retryable) == (ErrorType.CONNECTION, True)


async def test_endpoint_and_key_from_the_environment(server: ScriptedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DASHSCOPE_HTTP_BASE_URL", f"{server.url}/api/v1")
    monkeypatch.setenv("DASHSCOPE_API_KEY", "sk-from-env")
    server.replies.append(dashscope_stream([dashscope_chunk("env", finish="stop")]))
    model = ds(id="qwen-turbo")

    chunks = [c async for c in await model([SystemMsg("s"), UserMsg("x")])]

    assert chunks[-1].content[0].text == "env"
    assert server.requests[0].headers["authorization"] == "Bearer sk-from-env"


async def test_missing_key_is_a_setup_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DASHSCOPE_API_KEY", raising=False)
    monkeypatch.setattr(dashscope, "api_key", None)
    model = ds(id="m", base_url="http://127.0.0.1:9/api/v1")

    with pytest.raises(ModelError) as info:
        await model([UserMsg("x")])

    assert (info.value.error_type, info.value.retryable) == (ErrorType.SETUP, False)
    assert "DASHSCOPE_API_KEY" in str(info.value)


async def test_registry_fallback_after_a_fatal_error(server: ScriptedServer) -> None:
    """The host's own fallback list: a 401 skips a's remaining retries, then model b answers."""
    with ScriptedServer() as server_b:
        server.replies.append(dashscope_error(401, "InvalidApiKey", "Invalid API-key provided."))
        server_b.replies.append(openai_stream([openai_chunk("b here"), openai_usage_chunk(3, 2)]))
        reg = ModelRegistry.from_config(
            {
                "default": "a",
                "models": {
                    "a": {
                        "provider": "dashscope",
                        "base_url": f"{server.url}/api/v1",
                        "api_key": "bad",
                        "max_retries": 2,
                        "fallback": ["b"],
                    },
                    "b": {"provider": "openai", "base_url": f"{server_b.url}/v1"},
                },
            }
        )
        agent = Agent(models=reg, model="a")

        events, final = await run_reply(agent, "hi")
        await reg.aclose()

    assert final.text == "b here"
    assert (len(server.requests), len(server_b.requests)) == (1, 1)
    assert of_type(events, ModelCallEndEvent)[0].metadata["model"] == "b"
