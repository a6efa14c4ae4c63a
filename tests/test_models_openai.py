"""OpenAICompatibleModel against a local chat-completions server; the shared message conversion;
and model fallback driven by the example fallback middleware served in its own process.

Neither OpenAI nor DashScope is reachable from here, so the real clients (httpx for OpenAI-style
servers, the ``dashscope`` SDK) are tested against local servers on 127.0.0.1 speaking their wire
protocols: chat-completions SSE (``data: {...}`` chunks, a usage-only chunk for
``stream_options.include_usage``, ``data: [DONE]``) and OpenAI's ``{"error": {...}}`` bodies.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import dashscope
import pytest

from agent_host.agent import Agent
from agent_host.models import ModelError, ModelRegistry
from agent_host.models._format import to_chat_messages, to_tool_choice
from agent_host.models.openai_compat import OpenAICompatibleModel
from agent_host.remote import RemoteMiddleware
from agentmw.data import (
    AssistantMsg,
    ErrorType,
    HintBlock,
    ModelCallEndEvent,
    Msg,
    ReplyEndEvent,
    ReplyFinishedReason,
    Role,
    SystemMsg,
    TextBlock,
    TextBlockDeltaEvent,
    ThinkingBlock,
    ThinkingBlockDeltaEvent,
    ToolCallBlock,
    ToolCallDeltaEvent,
    ToolCallStartEvent,
    ToolChoice,
    ToolResultBlock,
    UserMsg,
)
from agentmw.tools import Toolkit, tool
from clients.launch import middleware_server
from tests.model_servers import (
    OPENAI_PATH,
    Reply,
    ScriptedServer,
    dashscope_chunk,
    dashscope_stream,
    of_type,
    openai_chunk,
    openai_error,
    openai_stream,
    openai_tool_fragment,
    openai_usage_chunk,
    run_reply,
)


def registry(server: ScriptedServer, max_retries: int = 0, **extra: Any) -> ModelRegistry:
    spec = {
        "provider": "openai",
        "model_name": "qwen2.5-7b-instruct",
        "base_url": f"{server.url}/v1",
        "api_key": "sk-local",
        "max_retries": max_retries,
        **extra,
    }
    return ModelRegistry.from_config({"default": "a", "models": {"a": spec}})


async def close_models(reg: ModelRegistry) -> None:
    for entry in reg.entries.values():
        close = getattr(entry.model, "aclose", None)
        if close is not None:
            await close()


@tool(description="Weather of a city.")
def get_weather(city: str) -> str:
    return f"{city}: sunny, 21C"


async def test_streams_text_reasoning_and_usage(server: ScriptedServer) -> None:
    server.replies.append(
        openai_stream(
            [
                openai_chunk("", reasoning=None),  # the role-only first chunk many servers send
                openai_chunk(reasoning="Greeting; "),
                openai_chunk(reasoning="reply."),
                openai_chunk("Hi"),
                openai_chunk(" there"),
                openai_chunk(finish="stop"),
                openai_usage_chunk(17, 6, cached=10, reasoning=4),
            ],
            delay=0.01,
        )
    )
    reg = registry(server)
    agent = Agent(models=reg, model="a", system_prompt="Be brief.")

    events, final = await run_reply(agent, "hello")
    await close_models(reg)

    assert [e.delta for e in of_type(events, ThinkingBlockDeltaEvent)] == ["Greeting; ", "reply."]
    assert [e.delta for e in of_type(events, TextBlockDeltaEvent)] == ["Hi", " there"]
    # The thinking block ends when a chunk without thinking comes (AgentScope's conversion order).
    blocks = [type(e).__name__ for e in events if "BlockStart" in type(e).__name__ or "BlockEnd" in type(e).__name__]
    assert blocks == ["ThinkingBlockStartEvent", "ThinkingBlockEndEvent", "TextBlockStartEvent", "TextBlockEndEvent"]
    assert final.text == "Hi there"
    end = of_type(events, ModelCallEndEvent)[0]
    assert (end.input_tokens, end.output_tokens, end.metadata["model"]) == (17, 6, "a")
    assert (end.cache_input_tokens, end.reasoning_tokens) == (10, 4)  # the usage details, as reported

    (request,) = server.requests
    assert request.path == OPENAI_PATH
    assert request.headers["authorization"] == "Bearer sk-local"
    assert request.body == {
        "model": "qwen2.5-7b-instruct",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def test_streamed_tool_calls_split_across_chunks(server: ScriptedServer) -> None:
    server.replies.append(
        openai_stream(
            [
                openai_chunk("Let me check. "),
                openai_chunk(tool_calls=[openai_tool_fragment(0, "", id="call_1", name="get_weather")]),
                openai_chunk(tool_calls=[openai_tool_fragment(0, '{"city"')]),
                openai_chunk(tool_calls=[openai_tool_fragment(0, ': "Lyon"}')]),
                openai_chunk(tool_calls=[openai_tool_fragment(1, '{"city": ', id="call_2", name="get_weather")]),
                openai_chunk(tool_calls=[openai_tool_fragment(1, '"Nice"}')]),
                openai_chunk(finish="tool_calls"),
                openai_usage_chunk(40, 20),
            ]
        )
    )
    server.replies.append(openai_stream([openai_chunk("Both sunny."), openai_usage_chunk(80, 3)]))
    reg = registry(server)
    agent = Agent(models=reg, model="a", toolkit=Toolkit([get_weather]))

    events, final = await run_reply(agent, "weather in Lyon and Nice")
    await close_models(reg)

    starts = of_type(events, ToolCallStartEvent)
    assert [s.tool_call_id for s in starts] == ["call_1", "call_2"]
    # The first chunk without text ends the text block, before the calls start (AgentScope's order).
    kinds = [type(e).__name__ for e in events]
    assert kinds.index("TextBlockEndEvent") < kinds.index("ToolCallStartEvent"), kinds
    assert [s.tool_call_name for s in starts] == ["get_weather", "get_weather"]
    deltas: dict[str, str] = {}
    for d in of_type(events, ToolCallDeltaEvent):
        deltas[d.tool_call_id] = deltas.get(d.tool_call_id, "") + d.delta
    assert deltas == {"call_1": '{"city": "Lyon"}', "call_2": '{"city": "Nice"}'}
    assert final.text == "Both sunny."
    ends = of_type(events, ModelCallEndEvent)
    assert [(e.input_tokens, e.output_tokens) for e in ends] == [(40, 20), (80, 3)]

    first, second = server.requests
    assert first.body["tools"] == Toolkit([get_weather]).schemas()
    assert "tool_choice" not in first.body
    assert [m["role"] for m in second.body["messages"]] == ["system", "user", "assistant", "tool", "tool"]
    assert [m["tool_call_id"] for m in second.body["messages"][3:]] == ["call_1", "call_2"]
    assert [m["content"] for m in second.body["messages"][3:]] == ["Lyon: sunny, 21C", "Nice: sunny, 21C"]


async def test_tool_choice_and_non_streaming(server: ScriptedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    answer = {
        "id": "chatcmpl-9",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_x",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'},
                        },
                    ],
                },
            }
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13},
    }
    server.replies.append(Reply(body=answer))
    model = OpenAICompatibleModel(id="local", base_url=f"{server.url}/v1/", stream=False, parameters={"seed": 7})

    stream = await model([UserMsg("x")], Toolkit([get_weather]).schemas(), ToolChoice(mode="required"))
    chunks = [c async for c in stream]
    await model.aclose()

    (call,) = chunks[-1].content
    assert (call.id, call.name, call.input) == ("call_x", "get_weather", '{"city":"Rome"}')
    assert (chunks[-1].usage.input_tokens, chunks[-1].usage.output_tokens) == (9, 4)
    request = server.requests[0]
    assert "authorization" not in request.headers  # no key configured: local servers need none
    assert (request.body["stream"], request.body["tool_choice"], request.body["seed"]) == (False, "required", 7)
    assert request.body["model"] == "local"


@pytest.mark.parametrize(
    "error",
    [
        openai_error(429, "Rate limit reached for requests", "requests", "rate_limit_exceeded"),
        openai_error(408, "Request timed out", "timeout"),  # a proxy or the server gave up waiting
        openai_error(409, "Conflict: the model is being reloaded", "conflict"),  # retry later
    ],
    ids=["429", "408", "409"],
)
async def test_transient_errors_are_retried_then_succeed(server: ScriptedServer, error: Reply) -> None:
    server.replies += [
        error,
        openai_stream([openai_chunk("second time lucky"), openai_usage_chunk(4, 3)]),
    ]
    reg = registry(server, max_retries=1)
    agent = Agent(models=reg, model="a")

    _events, final = await run_reply(agent, "hi")
    await close_models(reg)

    assert final.text == "second time lucky"
    assert len(server.requests) == 2


async def reply_to_a_401(server: ScriptedServer, message: str) -> tuple[list[Any], Any, Agent]:
    """A reply whose model answers 401 (an invalid key) with ``message``: its events, final Msg, agent."""
    server.replies.append(openai_error(401, message, "invalid_request_error", "invalid_api_key"))
    reg = registry(server, max_retries=2)
    agent = Agent(models=reg, model="a")
    events, final = await run_reply(agent, "hi")
    await close_models(reg)
    return events, final, agent


async def test_auth_error_fails_at_once_with_the_provider_message(server: ScriptedServer) -> None:
    message = "Incorrect API key provided: sk-bad. You can find your API key at your account page."
    events, final, _ = await reply_to_a_401(server, message)

    assert len(server.requests) == 1
    end = of_type(events, ReplyEndEvent)[-1]
    assert (end.finished_reason, end.error.type) == (ReplyFinishedReason.ERROR, ErrorType.AUTHENTICATION)
    assert message in end.error.message
    assert final.finished_reason == ReplyFinishedReason.ERROR and message in final.text


async def test_a_key_the_provider_quotes_in_its_error_never_leaves_the_model_client(
    server: ScriptedServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A gateway that quotes the whole key in its 401: the reply's error, the stored message and
    the host's log say "[api key]" instead (docs/models.md: keys stay in the host)."""
    message = "Incorrect API key provided: sk-local. You can find your API key at your account page."
    events, final, agent = await reply_to_a_401(server, message)

    end = of_type(events, ReplyEndEvent)[-1]
    assert "Incorrect API key provided: [api key]." in end.error.message, end.error.message
    assert "sk-local" not in end.error.message + final.text + str(agent.state.context) + caplog.text


@pytest.mark.parametrize(
    ("reply", "message", "kind", "retryable"),
    [
        (
            Reply(status=503, body={"object": "error", "message": "engine overloaded", "code": 503}),
            "engine overloaded",
            ErrorType.UPSTREAM,
            True,
        ),  # vLLM's error shape
        (
            Reply(status=404, body={"error": "model 'llama9' not found"}),
            "model 'llama9' not found",
            ErrorType.INVALID_REQUEST,
            False,
        ),  # Ollama's
        (
            Reply(status=422, body={"detail": "messages: field required"}),
            "messages: field required",
            ErrorType.INVALID_REQUEST,
            False,
        ),  # FastAPI validation
        (Reply(status=500, body="upstream exploded"), "upstream exploded", ErrorType.UPSTREAM, True),
        (Reply(status=408, body={"error": "request timeout"}), "request timeout", ErrorType.UPSTREAM, True),
        (Reply(status=409, body={"error": "conflict"}), "conflict", ErrorType.UPSTREAM, True),
    ],
)
async def test_error_mapping(
    server: ScriptedServer, reply: Reply, message: str, kind: ErrorType, retryable: bool
) -> None:
    server.replies.append(reply)
    model = OpenAICompatibleModel(id="m", base_url=f"{server.url}/v1")

    with pytest.raises(ModelError) as info:
        await model([UserMsg("x")])
    await model.aclose()

    assert (info.value.error_type, info.value.retryable, info.value.status) == (kind, retryable, reply.status)
    assert message in str(info.value)


async def test_error_inside_the_stream(server: ScriptedServer) -> None:
    server.replies.append(openai_stream([{"error": {"message": "context length exceeded", "code": 400}}]))
    model = OpenAICompatibleModel(id="m", base_url=f"{server.url}/v1")

    with pytest.raises(ModelError, match="context length exceeded") as info:
        await model([UserMsg("x")])
    await model.aclose()

    assert (info.value.status, info.value.retryable) == (400, False)


async def test_connection_error_is_retryable(server: ScriptedServer) -> None:
    url = f"{server.url}/v1"
    server.__exit__(None, None, None)  # nothing listens there any more
    model = OpenAICompatibleModel(id="m", base_url=url)

    with pytest.raises(ModelError) as info:
        await model([UserMsg("x")])
    await model.aclose()

    assert (info.value.error_type, info.value.retryable) == (ErrorType.CONNECTION, True)


async def test_key_and_base_url_from_the_environment(server: ScriptedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", f"{server.url}/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    server.replies.append(openai_stream([openai_chunk("env")]))
    model = OpenAICompatibleModel(id="gpt-4o-mini")

    chunks = [c async for c in await model([UserMsg("x")])]
    await model.aclose()

    assert chunks[-1].content[0].text == "env"
    assert server.requests[0].headers["authorization"] == "Bearer sk-env"


# -- the shared Msg -> chat messages conversion ---------------------------------------------------


def test_chat_messages_split_replies_around_tool_results() -> None:
    reply = Msg(
        name="assistant",
        role=Role.ASSISTANT,
        content=[
            ThinkingBlock(thinking="not sent back"),
            TextBlock(text="Let me check."),
            ToolCallBlock(id="c1", name="get_weather", input='{"city": "Oslo"}'),
            ToolCallBlock(id="c2", name="now", input=""),
            ToolResultBlock(id="c1", name="get_weather", output=[TextBlock(text="Oslo: snow")]),
            ToolResultBlock(id="c2", name="now", output="12:00"),
            HintBlock(hint="You have reached the maximum of iterations."),
            TextBlock(text="Snowing at noon."),
        ],
    )
    messages = [SystemMsg("sys"), UserMsg("weather?"), reply, AssistantMsg("Anything else?"), UserMsg("no")]

    assert to_chat_messages(messages) == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
                {"id": "c2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "Oslo: snow"},
        {"role": "tool", "tool_call_id": "c2", "name": "now", "content": "12:00"},
        {"role": "user", "content": "You have reached the maximum of iterations."},
        {"role": "assistant", "content": "Snowing at noon."},
        {"role": "assistant", "content": "Anything else?"},
        {"role": "user", "content": "no"},
    ]


def test_tool_choice_mapping() -> None:
    tools = Toolkit([get_weather]).schemas()
    forced = {"type": "function", "function": {"name": "get_weather"}}
    assert to_tool_choice(None, tools) is None
    assert to_tool_choice(ToolChoice(mode="auto"), tools) is None
    assert to_tool_choice(ToolChoice(mode="none"), tools) == "none"
    assert to_tool_choice(ToolChoice(mode="required"), tools) == "required"
    assert to_tool_choice(ToolChoice(mode="required"), tools, required=False) == forced  # one tool: force it
    assert to_tool_choice(ToolChoice(mode="get_weather"), tools) == forced
    assert to_tool_choice(ToolChoice(mode="none"), []) is None  # never without tools


# -- fallback through the remote example middleware -----------------------------------------------


@pytest.fixture
def fallback_server() -> Iterator[str]:
    """The example ModelFallbackMiddleware in its own process, on a free loopback port."""
    with middleware_server("mw_servers.examples.fallback:ModelFallbackMiddleware", fallback="b") as proc:
        yield proc.address


async def test_fallback_middleware_switches_to_the_second_model(fallback_server: str) -> None:
    with ScriptedServer() as server_a, ScriptedServer() as server_b:
        server_a.replies.append(openai_error(401, "Invalid key for model a.", "invalid_request_error"))
        server_b.replies.append(dashscope_stream([dashscope_chunk("Answer from "), dashscope_chunk("model b")]))
        reg = ModelRegistry.from_config(
            {
                "default": "a",
                "models": {
                    "a": {
                        "provider": "openai",
                        "model_name": "a-model",
                        "base_url": f"{server_a.url}/v1",
                        "api_key": "bad",
                        "max_retries": 2,
                    },
                    "b": {
                        "provider": "dashscope",
                        "model_name": "qwen-plus",
                        "base_url": f"{server_b.url}/api/v1",
                        "api_key": "sk-b",
                    },
                },
            }
        )
        remote = await RemoteMiddleware(fallback_server).connect()
        try:
            agent = Agent(models=reg, model="a", middlewares=[remote])
            events, final = await run_reply(agent, "hi")
        finally:
            await remote.close()
            await close_models(reg)
            await dashscope.close_shared_aio_session()

    assert remote.key == "ModelFallbackMiddleware" and remote.implements("on_model_call")
    assert final.text == "Answer from model b", final.text
    assert [e.delta for e in of_type(events, TextBlockDeltaEvent)] == ["Answer from ", "model b"]
    assert of_type(events, ModelCallEndEvent)[0].metadata["model"] == "b"
    assert len(server_a.requests) == 1  # the middleware fell back inside the first attempt
    assert len(server_b.requests) == 1
    assert server_b.requests[0].body["input"]["messages"][-1] == {"role": "user", "content": "hi"}
