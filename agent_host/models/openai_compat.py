"""OpenAICompatibleModel: any chat-completions endpoint (OpenAI, vLLM, Ollama, llama.cpp, LM Studio).

Talks HTTP with ``httpx`` directly (no SDK): ``POST {base_url}/chat/completions`` with
``stream: true`` and ``stream_options.include_usage``, read as server-sent events until
``[DONE]``. ``base_url`` is the config's, else ``OPENAI_BASE_URL``, else OpenAI's; the API key is
the config's ``api_key``, else ``OPENAI_API_KEY``, else none (local servers usually need none).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace
from typing import Any

import httpx

from ..data import ChatResponse, ChatUsage, ErrorType, ModelRef, Msg, TextBlock, ThinkingBlock, ToolChoice, new_id
from ._format import ToolCallMerger, connection_error, http_error, primed, to_chat_messages, to_tool_choice
from .base import ChatModel, ModelError

DEFAULT_BASE_URL = "https://api.openai.com/v1"


class OpenAICompatibleModel(ChatModel):
    provider = "openai"

    def __init__(
        self,
        *,
        id: str,
        model_name: str = "",
        api_key: str | None = None,
        base_url: str = "",
        timeout: float = 120.0,
        headers: dict[str, str] | None = None,
        include_usage: bool = True,
        image_parts: bool = False,
        **kw: Any,
    ) -> None:
        super().__init__(id=id, model_name=model_name, base_url=base_url, **kw)
        self.api_key = api_key
        self.timeout = timeout
        self.headers = dict(headers or {})
        # Some older local servers reject ``stream_options``; they can turn it off.
        self.include_usage = include_usage
        self.image_parts = image_parts  # send image DataBlocks as image_url parts (vision models)
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None

    @property
    def ref(self) -> ModelRef:
        return replace(super().ref, base_url=self.endpoint)  # the endpoint in use, for tracing

    @property
    def endpoint(self) -> str:
        return (self.base_url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")

    def _http(self) -> httpx.AsyncClient:
        """One pooled client per event loop (an httpx client cannot move between loops)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._client.is_closed or self._client_loop is not loop:
            timeout = httpx.Timeout(self.timeout, connect=min(self.timeout, 10.0))
            self._client, self._client_loop = httpx.AsyncClient(timeout=timeout), loop
        return self._client

    async def aclose(self) -> None:
        if self._client is not None and self._client_loop is asyncio.get_running_loop():
            await self._client.aclose()
        self._client = self._client_loop = None

    async def _open(
        self, messages: list[Msg], tools: list[dict[str, Any]], tool_choice: ToolChoice | None
    ) -> AsyncIterator[ChatResponse]:
        body: dict[str, Any] = {
            **self.parameters,
            "model": self.model_name,
            "messages": to_chat_messages(messages, image_parts=self.image_parts),
            "stream": self.stream,
        }
        if self.stream and self.include_usage:
            body["stream_options"] = {"include_usage": True}
        if tools:
            body["tools"] = tools
            choice = to_tool_choice(tool_choice, tools)
            if choice is not None:
                body["tool_choice"] = choice
        headers = {**self.headers, "Accept": "text/event-stream" if self.stream else "application/json"}
        api_key = self.api_key or os.environ.get("OPENAI_API_KEY")
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        return await primed(self._deltas(body, headers))

    async def _deltas(self, body: dict[str, Any], headers: dict[str, str]) -> AsyncGenerator[ChatResponse, None]:
        text_id, thinking_id = new_id(), new_id()
        merger = ToolCallMerger()
        usage: ChatUsage | None = None
        response_id = ""
        try:
            async with self._http().stream(
                "POST", f"{self.endpoint}/chat/completions", json=body, headers=headers
            ) as response:
                if response.status_code != 200:
                    await response.aread()
                    raise http_error(self.provider, self.model_name, response.status_code, *_error_text(response.text))
                events = _sse_events(response) if self.stream else _json_body(response)
                async for event in events:
                    if event.get("error"):  # some servers report failures inside the stream
                        error = event["error"]
                        status = error.get("code") if isinstance(error, dict) else None
                        raise http_error(
                            self.provider,
                            self.model_name,
                            status if isinstance(status, int) else 500,
                            *_error_text(json.dumps(event)),
                        )
                    response_id = event.get("id") or response_id
                    if event.get("usage"):
                        usage = _usage(event["usage"])
                    for choice in event.get("choices") or []:
                        # Streams carry ``delta``s; a non-streamed answer one complete ``message``.
                        part = choice.get("delta") or choice.get("message") or {}
                        blocks: list[Any] = []
                        reasoning = part.get("reasoning_content") or part.get("reasoning")
                        if reasoning:
                            blocks.append(ThinkingBlock(id=thinking_id, thinking=reasoning))
                        if part.get("content"):
                            blocks.append(TextBlock(id=text_id, text=part["content"]))
                        blocks.extend(merger.add(part.get("tool_calls")))
                        if blocks:
                            yield ChatResponse(content=blocks, is_last=False, id=response_id or new_id())
        except httpx.TransportError as exc:
            raise connection_error(self.provider, self.model_name, exc) from exc
        except json.JSONDecodeError as exc:
            raise ModelError(
                f"{self.provider} model {self.model_name!r}: malformed stream event: {exc}",
                error_type=ErrorType.UPSTREAM,
                retryable=True,
            ) from exc
        yield ChatResponse(content=merger.finish(), is_last=False, id=response_id or new_id(), usage=usage)


async def _sse_events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON payloads of a server-sent event stream, up to ``[DONE]``."""
    data: list[str] = []
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
            continue
        if line or not data:  # comments, event:/id: fields, or a blank line with nothing pending
            continue
        payload, data = "\n".join(data), []
        if payload.strip() == "[DONE]":
            return
        yield json.loads(payload)
    if data and "\n".join(data).strip() != "[DONE]":  # a last event without its blank line
        yield json.loads("\n".join(data))


async def _json_body(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    await response.aread()
    yield response.json()


def _error_text(raw: str) -> tuple[str, str]:
    """(message, code) from the error bodies servers send: OpenAI/vLLM ``{"error": {...}}`` or
    ``{"message": ...}``, Ollama ``{"error": "..."}``, FastAPI ``{"detail": ...}``, or plain text."""
    try:
        body = json.loads(raw)
    except ValueError:
        return raw.strip()[:2000], ""
    if not isinstance(body, dict):
        return raw.strip()[:2000], ""
    error = body.get("error", body)
    if isinstance(error, str):
        return error, ""
    if isinstance(error, dict):
        message = error.get("message") or error.get("detail") or json.dumps(error)
        code = error.get("code") or error.get("type") or ""
        return str(message), str(code)
    return raw.strip()[:2000], ""


def _usage(usage: dict[str, Any]) -> ChatUsage:
    prompt_details = usage.get("prompt_tokens_details") or {}
    completion_details = usage.get("completion_tokens_details") or {}
    reasoning = completion_details.get("reasoning_tokens")
    return ChatUsage(
        input_tokens=int(usage.get("prompt_tokens") or 0),
        output_tokens=int(usage.get("completion_tokens") or 0),
        cache_input_tokens=int(prompt_details.get("cached_tokens") or 0),
        metadata={"reasoning_tokens": reasoning} if reasoning else {},
    )


__all__ = ["OpenAICompatibleModel"]
