"""DashScopeChatModel: Qwen and the other DashScope chat models through the ``dashscope`` SDK.

Streams with ``AioGeneration.call(stream=True, incremental_output=True, result_format="message")``:
every SSE event then carries only the new text / reasoning / tool-call fragments, plus the usage
so far. The endpoint is the config's ``base_url``, else ``DASHSCOPE_HTTP_BASE_URL``, else the SDK's
``dashscope.base_http_api_url``; it is passed per request, so two models may use different ones.
The API key is the config's ``api_key``, else ``DASHSCOPE_API_KEY``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp
import dashscope

from ..data import ChatResponse, ChatUsage, ErrorType, ModelRef, Msg, TextBlock, ThinkingBlock, ToolChoice, new_id
from ._format import ToolCallMerger, connection_error, http_error, primed, to_chat_messages, to_tool_choice
from .base import ChatModel, ModelError

# Errors of the transport below the SDK: worth another attempt.
_TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)


class DashScopeChatModel(ChatModel):
    provider = "dashscope"

    def __init__(
        self,
        *,
        id: str,
        model_name: str = "",
        api_key: str | None = None,
        base_url: str = "",
        timeout: float = 120.0,
        **kw: Any,
    ) -> None:
        super().__init__(id=id, model_name=model_name, base_url=base_url, **kw)
        self.api_key = api_key
        self.timeout = timeout  # seconds without a byte from the server (the SDK's sock_read)

    @property
    def ref(self) -> ModelRef:
        return replace(super().ref, base_url=self.endpoint)  # the endpoint in use, for tracing

    @property
    def endpoint(self) -> str:
        return self.base_url or os.environ.get("DASHSCOPE_HTTP_BASE_URL") or dashscope.base_http_api_url

    async def _open(
        self, messages: list[Msg], tools: list[dict[str, Any]], tool_choice: ToolChoice | None
    ) -> AsyncIterator[ChatResponse]:
        api_key = self.api_key or os.environ.get("DASHSCOPE_API_KEY") or dashscope.api_key
        if not api_key:
            raise ModelError(
                f"dashscope model {self.id!r}: no API key (set api_key or DASHSCOPE_API_KEY)",
                error_type=ErrorType.SETUP,
            )
        request: dict[str, Any] = {
            **self.parameters,
            "model": self.model_name,
            "messages": to_chat_messages(messages),
            "api_key": api_key,
            "result_format": "message",
            "base_address": self.endpoint,
            "request_timeout": self.timeout,
        }
        if self.stream:
            request.update(stream=True, incremental_output=True)
        if tools:
            request["tools"] = tools
            choice = to_tool_choice(tool_choice, tools, required=False)
            if choice is not None:
                request["tool_choice"] = choice
        return await primed(self._deltas(request))

    async def _deltas(self, request: dict[str, Any]) -> AsyncGenerator[ChatResponse, None]:
        text_id, thinking_id = new_id(), new_id()
        merger = ToolCallMerger()
        usage: dict[str, Any] | None = None
        request_id = ""
        responses: Any = None
        try:
            result = await dashscope.AioGeneration.call(**request)
            responses = result if self.stream else _once(result)
            async for response in responses:
                self._check(response)
                request_id = response.get("request_id") or request_id
                usage = response.get("usage") or usage  # cumulative: the last one counts
                output = response.get("output") or {}
                for choice in output.get("choices") or []:
                    message = choice.get("message") or {}
                    blocks: list[Any] = []
                    if message.get("reasoning_content"):
                        blocks.append(ThinkingBlock(id=thinking_id, thinking=message["reasoning_content"]))
                    text = _content_text(message.get("content"))
                    if text:
                        blocks.append(TextBlock(id=text_id, text=text))
                    blocks.extend(merger.add(message.get("tool_calls")))
                    if blocks:
                        yield ChatResponse(content=blocks, is_last=False, id=request_id or new_id())
        except _TRANSPORT_ERRORS as exc:
            raise connection_error(self.provider, self.model_name, exc) from exc
        finally:
            if responses is not None:  # release the HTTP response now if the reader stopped early
                await responses.aclose()
        yield ChatResponse(content=merger.finish(), is_last=False, id=request_id or new_id(), usage=_usage(usage))

    def _check(self, response: Any) -> None:
        status = int(response.get("status_code") or 200)
        if status != 200:
            raise http_error(
                self.provider, self.model_name, status, response.get("message") or "", response.get("code") or ""
            )


async def _once(response: Any) -> AsyncIterator[Any]:
    yield response


def _content_text(content: Any) -> str:
    """``content`` is a string, or (for some models) a list of ``{"text": ...}`` parts."""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


def _usage(usage: dict[str, Any] | None) -> ChatUsage | None:
    if not usage:
        return None
    details = usage.get("prompt_tokens_details") or {}
    output_details = usage.get("output_tokens_details") or {}
    metadata = {"reasoning_tokens": output_details["reasoning_tokens"]} if "reasoning_tokens" in output_details else {}
    return ChatUsage(
        input_tokens=int(usage.get("input_tokens") or 0),
        output_tokens=int(usage.get("output_tokens") or 0),
        cache_input_tokens=int(details.get("cached_tokens") or 0),
        metadata=metadata,
    )


__all__ = ["DashScopeChatModel"]
