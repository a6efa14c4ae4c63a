"""What a model server may send, or how its connection may fail, that the host must take in its
stride: the real clients (the ``openai`` and ``dashscope`` SDKs) against the local wire servers of
tests/model_servers.py, in process and through a real host process.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from agent_host.agent import Agent
from agent_host.config import ConfigError, load_config
from agent_host.models import ModelRegistry
from agentmw.codec import codec
from agentmw.data import (
    CustomEvent,
    ErrorType,
    FinishedReason,
    ModelCallEndEvent,
    ModelCallStartEvent,
    ReplyEndEvent,
    ReplyFinishedReason,
    TextBlockDeltaEvent,
    ThinkingBlock,
    UserMsg,
)
from agentmw.middleware import MiddlewareBase
from agentmw.tools import Toolkit, tool
from clients.chat import HostClient
from tests.host_util import Procs, configured_host, get_session, run_cli
from tests.model_servers import (
    Reply,
    ScriptedServer,
    dashscope_chunk,
    dashscope_tool_fragment,
    of_type,
    openai_chunk,
    openai_stream,
    openai_tool_fragment,
    reply,
    run_reply,
    spec,
)

pytestmark = pytest.mark.timeout(60)


def registry(server: ScriptedServer, provider: str = "openai", **extra: Any) -> ModelRegistry:
    return ModelRegistry.from_config({"default": "a", "models": {"a": spec(server, provider, **extra)}})


def stream(provider: str, parts: list[dict[str, Any]], finish: str = "stop") -> Reply:
    """A complete stream of events, each ``{"text": ..., "reasoning": ..., "tool": (index, args,
    id, name)}``, its JSON ASCII-escaped as JSON encoders do by default (so a lone UTF-16 half
    travels as a ``\\uXXXX`` escape, as from a server that cuts UTF-16 strings)."""
    chunks: list[dict[str, Any]] = []
    for part in parts:
        tool_calls = None
        if "tool" in part:
            index, args, call_id, name = part["tool"]
            make = openai_tool_fragment if provider == "openai" else dashscope_tool_fragment
            tool_calls = [make(index, args, id=call_id, name=name) if call_id else make(index, args)]
        if provider == "openai":
            chunks.append(openai_chunk(part.get("text"), reasoning=part.get("reasoning"), tool_calls=tool_calls))
        else:
            kw = {"reasoning": part.get("reasoning", ""), "tool_calls": tool_calls, "usage": (10, len(chunks) + 1)}
            chunks.append(dashscope_chunk(part.get("text", ""), **kw))
    if provider == "openai":
        return openai_stream([*chunks, openai_chunk(finish=finish)])
    chunks.append(dashscope_chunk(finish=finish, usage=(10, len(chunks) + 1)))
    frames = [f"id:{i}\nevent:result\n:HTTP_STATUS/200\ndata:{json.dumps(c)}\n\n" for i, c in enumerate(chunks, 1)]
    return Reply(frames=frames)


cities: list[str] = []


@tool(description="Weather of a city.")
def get_weather(city: str) -> str:
    cities.append(city)
    return f"{city}: sunny"


# -- 1. UTF-16 surrogate halves (JSON \uXXXX escapes) ----------------------------------------------


@pytest.mark.parametrize("provider", ["openai", "dashscope"])
async def test_surrogate_halves_are_joined_across_events_and_a_lone_one_replaced(
    server: ScriptedServer, provider: str
) -> None:
    """A pair split across two events is one character; a lone half (here a low one, and a high one
    whose partner never comes) is U+FFFD, in text, thinking and tool-call arguments alike. Before,
    they stayed lone surrogates, which no UTF-8 encoder takes: the session could not be sent or
    stored any more."""
    cities.clear()
    server.replies += [
        stream(
            provider,
            [
                {"reasoning": "hm \ude00"},
                {"text": "smile \ud83d"},
                {"text": "\ude00 ok \ud83d"},
                {"tool": (0, '{"city": "Nice \ud83d', "call_1", "get_weather")},
                {"tool": (0, '\ude00"}', None, None)},
            ],
            finish="tool_calls",
        ),
        stream(provider, [{"text": "done \ud83d"}]),
    ]

    events, final, agent = await reply(registry(server, provider), toolkit=Toolkit([get_weather]))

    assert final.finished_reason == ReplyFinishedReason.COMPLETED, of_type(events, ReplyEndEvent)
    assert cities == ["Nice \U0001f600"]
    first = agent.state.context[1]
    assert first.text.startswith("smile \U0001f600 ok \ufffd")
    assert [b.thinking for b in first.content if isinstance(b, ThinkingBlock)] == ["hm \ufffd"]
    assert final.text == "done \ufffd"
    codec.encode(agent.state)  # the whole session encodes (it raised UnicodeEncodeError)


async def test_a_session_whose_model_sent_a_split_pair_goes_on(tmp_path: Path) -> None:
    """Through a real host: the reply, a later reply in the same session and GetSession all work
    (before, each failed with UNKNOWN: UnicodeEncodeError, for good)."""
    with ScriptedServer() as model:
        model.replies += [stream("openai", [{"text": "smile \ud83d"}, {"text": "\ude00 ok"}])]
        model.replies += [stream("openai", [{"text": "again"}])]
        config = f'models:\n  default: a\n  models:\n    a: {{provider: openai, base_url: "{model.url}/v1"}}\n'
        with configured_host(tmp_path, config) as host:
            async with HostClient(host.address) as client:
                call = client.reply("", UserMsg("hi"))
                first = [item async for item in call]
                second = [item async for item in client.reply(call.session_id, UserMsg("and?"))]
            _, state, _ = await get_session(host.address, call.session_id)

    assert first[-1].text == "smile \U0001f600 ok"
    assert second[-1].text == "again"
    assert [m.text for m in state.context] == ["hi", "smile \U0001f600 ok", "and?", "again"]


# -- 2. request fields the openai SDK does not know ------------------------------------------------


class _Thinking(MiddlewareBase):
    """An on_model_call middleware that asks for thinking for one call, as docs/models.md shows."""

    async def on_model_call(self, agent: Any, input_kwargs: dict[str, Any], next_handler: Any) -> Any:
        return await next_handler(parameters={"enable_thinking": True, "chat_template_kwargs": {"x": 1}})


async def test_openai_parameters_the_sdk_does_not_know_are_sent_in_the_body(server: ScriptedServer) -> None:
    """vLLM's and Qwen3's fields reach the server, configured or per call (before: TypeError from
    create(), nothing sent, retried as an internal error)."""
    server.replies.append(openai_stream([openai_chunk("ok")]))
    parameters = {"temperature": 0.5, "top_k": 20, "repetition_penalty": 1.05, "enable_thinking": False}
    reg = registry(server, parameters={**parameters, "extra_body": {"min_p": 0.1}}, max_retries=2)

    _, final, _ = await reply(reg, middlewares=[_Thinking()])

    assert final.text == "ok"
    (request,) = server.requests
    sent = {k: request.body.get(k) for k in ("temperature", "top_k", "repetition_penalty", "min_p")}
    assert sent == {"temperature": 0.5, "top_k": 20, "repetition_penalty": 1.05, "min_p": 0.1}
    assert (request.body["enable_thinking"], request.body["chat_template_kwargs"]) == (True, {"x": 1})


async def test_openai_parameters_the_sdk_refuses_are_an_invalid_request_not_retried(server: ScriptedServer) -> None:
    reg = registry(server, parameters={"top_k": 20, "extra_body": ["not", "a", "mapping"]}, max_retries=2)

    events, _, _ = await reply(reg)

    (end,) = of_type(events, ReplyEndEvent)
    assert end.error.type == ErrorType.INVALID_REQUEST and "bad request parameters" in end.error.message
    assert server.requests == []


# -- 3. the DashScope SDK's own resend ---------------------------------------------------------------


async def test_dashscope_sends_each_attempt_once_when_the_connection_is_reset(server: ScriptedServer) -> None:
    """A connection reset after the server read the request is one failed attempt, which the host's
    policy retries (seen by the client and the metrics). Before, the SDK sent the request again on
    its own: twice the requests, and a reset then an answer looked like a first-time success."""
    server.replies += [Reply(reset=True), stream("dashscope", [{"text": "ok"}])]

    events, final, _ = await reply(registry(server, "dashscope", max_retries=1))

    assert final.text == "ok"
    assert len(server.requests) == 2
    (start,) = of_type(events, ModelCallStartEvent)
    (failed,) = start.metadata["failed_attempts"]
    assert failed["error_type"] == "connection"

    server.requests.clear()
    server.replies += [Reply(reset=True)] * 4
    events, _, _ = await reply(registry(server, "dashscope", max_retries=1))

    assert of_type(events, ReplyEndEvent)[0].error.type == ErrorType.CONNECTION
    assert len(server.requests) == 2  # max_retries + 1, as the policy says (was 4)


# -- 5. DashScope usage so far -----------------------------------------------------------------------


def _ds_frames(*chunks: dict[str, Any]) -> list[str]:
    return [f"id:{i}\nevent:result\n:HTTP_STATUS/200\ndata:{json.dumps(c)}\n\n" for i, c in enumerate(chunks, 1)]


async def test_dashscope_call_cut_mid_stream_reports_the_usage_so_far(server: ScriptedServer) -> None:
    """DashScope sends the usage so far in every event: a call that fails or is interrupted
    mid-stream reports it, as docs/models.md says (before: 0/0, the usage came with the last chunk only)."""
    hello, world = dashscope_chunk("Hello ", usage=(120, 2)), dashscope_chunk("world", usage=(120, 3))
    server.replies += [
        Reply(frames=_ds_frames(hello, world), reset=True),
        Reply(frames=_ds_frames(hello, world, dashscope_chunk(finish="stop", usage=(120, 4))), delay=0.5),
    ]

    events, _, agent = await reply(registry(server, "dashscope"))

    (end,) = of_type(events, ModelCallEndEvent)
    assert end.finished_reason == FinishedReason.ERROR
    assert (end.input_tokens, end.output_tokens) == (120, 3)
    assert agent.state.context[-1].usage.output_tokens == 3

    items, _ = await interrupted_at_world(registry(server, "dashscope"), later=0.05)  # in the wait for more

    (end,) = of_type(items, ModelCallEndEvent)
    assert end.finished_reason == FinishedReason.INTERRUPTED
    assert (end.input_tokens, end.output_tokens) == (120, 3)


async def interrupted_at_world(reg: Any, later: float | None = None) -> tuple[list[Any], Agent]:
    """The items (and agent) of a reply of model "a" whose reader interrupts it on the "world"
    delta (``later`` seconds after, from the event loop); the registry is closed after."""
    agent = Agent(models=reg, model="a")
    items: list[Any] = []
    try:
        async for item in agent.reply_stream(UserMsg("hi")):
            items.append(item)
            if isinstance(item, TextBlockDeltaEvent) and item.delta == "world":
                if later is None:
                    agent.interrupt()
                else:
                    asyncio.get_running_loop().call_later(later, agent.interrupt)
    finally:
        await reg.aclose()
    return items, agent


# -- 4. an interrupt while the reply is paused between streamed items ------------------------------


def _hello_world(provider: str) -> Reply:
    """ "Hello ", "world", then the end 0.6 s later (the model is still streaming)."""
    if provider == "openai":
        return openai_stream([openai_chunk("Hello "), openai_chunk("world")], delay=0.6)
    chunks = [dashscope_chunk(t, usage=(120, n)) for n, t in ((2, "Hello "), (3, "world"))]
    return Reply(frames=_ds_frames(*chunks, dashscope_chunk(finish="stop", usage=(120, 4))), delay=0.6)


@pytest.mark.parametrize("provider", ["openai", "dashscope"])
async def test_an_interrupt_between_streamed_items_keeps_what_was_streamed(
    server: ScriptedServer, provider: str
) -> None:
    """The reader of the reply interrupts on the "world" delta, while the reasoning is suspended
    at it (not awaiting the model): the partial answer is saved as when the interrupt lands in the
    wait for the model (docs/behaviour.md#interruption). Before, it was dropped from the session."""
    server.replies.append(_hello_world(provider))
    items, agent = await interrupted_at_world(registry(server, provider))

    assert items[-1].finished_reason == ReplyFinishedReason.INTERRUPTED
    (end,) = of_type(items, ModelCallEndEvent)
    assert end.finished_reason == FinishedReason.INTERRUPTED
    assert [(m.role.value, m.text) for m in agent.state.context][:2] == [("user", "hi"), ("assistant", "Hello world")]
    if provider == "dashscope":  # the usage so far (DashScope sends it in every event)
        assert (end.input_tokens, end.output_tokens) == (120, 3)


async def test_an_interrupt_while_an_on_reply_middleware_holds_the_reply_keeps_the_partial(
    procs: Procs, tmp_path: Path
) -> None:
    """Through a real host, with a remote on_reply middleware that holds the "world" delta: the
    client cancels meanwhile, and the session keeps "Hello world"."""
    pause = procs.start("pause", ["-m", "agentmw.sdk", "tests.pause_mw:PauseAtWorld", "--address", "127.0.0.1:0"])
    with ScriptedServer() as model:
        model.replies.append(_hello_world("openai"))
        config = tmp_path / "host.yaml"
        config.write_text(f'models:\n  models:\n    a: {{provider: openai, base_url: "{model.url}/v1"}}\n')
        host = procs.host(tmp_path / "sessions.db", "--config", str(config), "--middleware", f"pause={pause.address}")
        items: list[Any] = []
        async with HostClient(host.address) as client:
            call = client.reply("", UserMsg("hi"))
            async with asyncio.timeout(20):
                async for item in call:
                    items.append(item)
                    if isinstance(item, CustomEvent) and item.name == "paused":
                        call.cancel()
        _, state, _ = await get_session(host.address, call.session_id)

    assert of_type(items, ReplyEndEvent)[0].finished_reason == ReplyFinishedReason.INTERRUPTED
    assert [(m.role.value, m.text) for m in state.context][:2] == [("user", "hi"), ("assistant", "Hello world")]
    # One info line per reply (docs/host.md), not one more per model request from the SDK's client.
    await asyncio.to_thread(host.wait_for_line, "outcome=interrupted")
    log = host.tail(200)
    assert "HTTP Request" not in log, log


# -- 6, 7. errors a server sends with status 200: in the stream, or as the body ---------------------

KEY_ERROR = {"message": "Incorrect API key provided", "type": "invalid_request_error", "code": "invalid_api_key"}
RATE_ERROR = {"message": "Rate limit reached", "type": "requests", "code": "rate_limit_exceeded"}
DS_KEY_ERROR = {"code": "InvalidApiKey", "message": "Invalid API-key provided.", "request_id": "req-k"}
ERRORS_200 = {  # provider, answer, error type, requests made with max_retries 2, the provider's message
    "openai-stream-key": ("openai", openai_stream([{"error": KEY_ERROR}]), "authentication", 1, KEY_ERROR),
    "openai-stream-rate": ("openai", openai_stream([{"error": RATE_ERROR}]), "rate_limit", 3, RATE_ERROR),
    "openai-body-key": ("openai", Reply(body={"error": KEY_ERROR}), "authentication", 1, KEY_ERROR),
    "openai-plain-body-key": ("openai-plain", Reply(body={"error": KEY_ERROR}), "authentication", 1, KEY_ERROR),
    "dashscope-body-key": ("dashscope", Reply(body=DS_KEY_ERROR), "authentication", 1, DS_KEY_ERROR),
}


@pytest.mark.parametrize("case", list(ERRORS_200))
async def test_an_error_sent_with_status_200_is_classified_by_the_providers_code(
    server: ScriptedServer, case: str
) -> None:
    """Before: an in-stream error was labelled "HTTP 500" and classified by its type (an invalid
    key retried as upstream, a rate limit not a rate limit); an error body under status 200 lost
    its code (openai) or its whole message (DashScope), and was retried as a bad response."""
    provider, bad, kind, requests, error = ERRORS_200[case]
    server.replies += [bad] * 3
    extra = {"stream": False} if provider == "openai-plain" else {}
    reg = registry(server, provider.removesuffix("-plain"), max_retries=2, **extra)

    events, _, _ = await reply(reg)

    (end,) = of_type(events, ReplyEndEvent)
    assert end.error.type == ErrorType(kind), end.error
    assert f"HTTP 200 {error['code']}: {error['message']}" in end.error.message
    assert len(server.requests) == requests


# -- 10. a mid-stream failure is a failed attempt ----------------------------------------------------


async def test_a_call_that_fails_mid_stream_counts_as_a_failed_attempt(server: ScriptedServer) -> None:
    """agentmw_model_failed_attempts counts attempts "followed by a retry, a fallback, or the reply's
    error": a reset after part of the answer is one (before: not counted, only the reply's error was)."""
    server.replies.append(Reply(frames=openai_stream([openai_chunk("Hello wor")]).frames[:1], reset=True))

    def failed() -> float:
        return REGISTRY.get_sample_value("agentmw_model_failed_attempts_total", {"model": "mid-stream"}) or 0.0

    before = failed()
    reg = ModelRegistry.from_config({"default": "mid-stream", "models": {"mid-stream": spec(server)}})
    events, _, _ = await reply(reg)

    assert of_type(events, ModelCallEndEvent)[0].finished_reason == FinishedReason.ERROR
    assert failed() - before == 1


# -- 11. text blocks of one message in the model input ---------------------------------------------


@pytest.mark.parametrize("provider", ["openai", "dashscope"])
async def test_text_blocks_of_one_message_reach_the_model_on_lines_of_their_own(
    server: ScriptedServer, provider: str
) -> None:
    """After a mid-stream failure the assistant's turn holds the partial answer and the failure note:
    the next request sends them one per line (AgentScope sends separate text parts), not run together."""
    first = stream(provider, [{"text": "Hello "}, {"text": "world"}])
    server.replies += [Reply(frames=first.frames[:2], reset=True), stream(provider, [{"text": "again"}])]
    reg = registry(server, provider)
    agent = Agent(models=reg, model="a")
    try:
        await run_reply(agent, "first")
        await run_reply(agent, "second")
    finally:
        await reg.aclose()

    body = server.requests[1].body
    messages = body["messages"] if provider == "openai" else body["input"]["messages"]
    (assistant,) = [m for m in messages if m["role"] == "assistant"]
    assert assistant["content"].startswith("Hello world\nThe reply failed: "), assistant


# -- 8. model settings checked by value ------------------------------------------------------------

BAD_SETTINGS = {  # a model's settings -> the one-line error naming the key
    "max_retries: abc": ({"max_retries": "abc"}, "max_retries: expected a whole number >= 0, got 'abc'"),
    "max_retries: -1": ({"max_retries": -1}, "max_retries: expected a whole number >= 0, got -1"),
    "fallback: a string": ({"fallback": "local"}, "fallback: expected a list of strings, got 'local'"),
    "fallback: itself": ({"fallback": ["a"]}, "fallback: a model cannot fall back to itself"),
    "retry: 5": ({"retry": 5}, "retry: expected a mapping of initial_delay, max_delay, deadline, got 5"),
    "retry deadline < 0": ({"retry": {"deadline": -1}}, "retry: deadline: expected seconds >= 0, got -1"),
    "timeout: abc": ({"timeout": "abc"}, "timeout: expected a number > 0, got 'abc'"),
    "timeout: 0": ({"timeout": 0}, "timeout: expected a number > 0, got 0"),
    "stream: 'false'": ({"stream": "false"}, "stream: expected true or false, got 'false'"),
    "include_usage: 'false'": ({"include_usage": "false"}, "include_usage: expected true or false, got 'false'"),
    "context_size: big": ({"context_size": "big"}, "context_size: expected a whole number > 0, got 'big'"),
    "parameters: a list": ({"parameters": [1, 2]}, "parameters: expected a mapping, got [1, 2]"),
    "headers: numbers": ({"headers": {"X-N": 5}}, "headers: expected a mapping of strings, got {'X-N': 5}"),
    "base_url: 5": ({"base_url": 5}, "base_url: expected a string, got 5"),
    "base_url: no scheme": ({"base_url": "127.0.0.1:8000/v1"}, "base_url: expected a URL starting with http://"),
    "two keys": ({"api_key": "k", "api_key_env": "K"}, "give one of api_key, api_key_env, api_key_file, not"),
}


@pytest.mark.parametrize("case", list(BAD_SETTINGS))
def test_a_bad_model_setting_is_one_error_naming_the_model_and_key(tmp_path: Path, case: str) -> None:
    """As agent-host --config reads them (before: accepted, then misbehaving at every call, or an
    error from int()/list() naming neither the model nor the key)."""
    settings, error = BAD_SETTINGS[case]
    path = tmp_path / "host.yaml"
    models = {"default": "a", "models": {"a": {"provider": "openai", "base_url": "http://127.0.0.1:9/v1", **settings}}}
    path.write_text(json.dumps({"models": models}))  # JSON is YAML

    with pytest.raises(ConfigError) as info:
        load_config(path, env={}).build_models()

    assert f"models: model 'a': {error}" in str(info.value) and "\n" not in str(info.value)


def test_the_host_refuses_a_bad_model_setting_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "host.yaml"
    path.write_text('models:\n  models:\n    a: {provider: openai, base_url: "http://127.0.0.1:9/v1", timeout: abc}\n')

    done = run_cli("agent_host", "--config", str(path), "--db", str(tmp_path / "x.db"), "--listen", "127.0.0.1:0")

    assert done.returncode == 2, done.stderr
    error = f"{path}: models: model 'a': timeout: expected a number > 0, got 'abc'"
    assert done.stderr.strip().splitlines() == [f"agent-host: configuration error: {error}"]


# -- 9. a model's key from the environment or a file -----------------------------------------------


async def test_each_model_reads_its_own_key_from_the_environment_or_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two OpenAI-compatible services with different keys, neither in the file (before:
    api_key_env / api_key_file were unknown keys, and every openai model got OPENAI_API_KEY)."""
    monkeypatch.setenv("GATEWAY_KEY", "sk-gateway")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-shared")
    key_file = tmp_path / "openai.key"
    key_file.write_text("sk-from-file\n")
    with ScriptedServer() as first, ScriptedServer() as second:
        first.replies.append(stream("openai", [{"text": "one"}]))
        second.replies.append(stream("openai", [{"text": "two"}]))
        path = tmp_path / "host.yaml"
        path.write_text(
            "models:\n  default: a\n  models:\n"
            f'    a: {{provider: openai, base_url: "{first.url}/v1", api_key_env: GATEWAY_KEY}}\n'
            f'    b: {{provider: openai, base_url: "{second.url}/v1", api_key_file: "{key_file}"}}\n'
        )
        reg = load_config(path).build_models()
        for model_id in ("a", "b"):
            agent = Agent(models=reg, model=model_id)
            await run_reply(agent, "hi")
        await reg.aclose()
        assert reg.get("a").ref.parameters == {} and "sk-" not in repr(reg.get("a").ref)

    assert first.requests[0].headers["authorization"] == "Bearer sk-gateway"
    assert second.requests[0].headers["authorization"] == "Bearer sk-from-file"

    monkeypatch.delenv("GATEWAY_KEY")
    with pytest.raises(ConfigError, match="model 'a': api_key: the environment variable GATEWAY_KEY is not set"):
        load_config(path).build_models()
