"""OpenAICompatibleModel: any chat-completions endpoint (OpenAI, vLLM, Ollama, llama.cpp, LM Studio).

Built on the official ``openai`` SDK (``AsyncOpenAI``): it sends ``{base_url}/chat/completions``
with ``stream: true`` and ``stream_options.include_usage`` and parses the server-sent events.
The SDK's own retries are off (``max_retries=0``): the host's retry policy (``retry.py``) runs
every attempt through the on_model_call chain, honours Retry-After, skips quota exhaustion, and
reports each failure. ``base_url`` is the config's, else ``OPENAI_BASE_URL``, else OpenAI's; the
API key is the config's ``api_key``, else ``OPENAI_API_KEY``, else none (local servers usually
need none: no ``Authorization`` header is sent then).

What the SDK accepts silently and this class does not: a stream that ends without a finish
reason (truncated), and a 200 answer that is not an event stream (a gateway's HTML page).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import openai
from openai import AsyncOpenAI
from openai.resources.chat.completions import AsyncCompletions

from agentmw.data import ChatResponse, ChatUsage, ErrorType, Msg, ToolChoice, new_id

from ._format import (
    DeltaBlocks,
    connection_error,
    finish_reason,
    history_call_ids,
    http_error,
    parse_retry_after,
    primed,
    protocol_error,
    to_chat_messages,
    to_tool_choice,
    usage_of,
)
from .base import ChatModel, ModelError

DEFAULT_BASE_URL = "https://api.openai.com/v1"

# The request fields the SDK's create() takes as keywords; any other one is sent in ``extra_body``.
_SDK_FIELDS = frozenset(inspect.signature(AsyncCompletions.create).parameters) - {"self"}


def request_fields(parameters: dict[str, Any]) -> dict[str, Any]:
    """``parameters`` as create() keywords: the fields the SDK does not know (vLLM's ``top_k``,
    ``repetition_penalty``, Qwen3's ``enable_thinking``, ``chat_template_kwargs``) go in the JSON
    body through ``extra_body``, as the SDK intends, merged under a given ``extra_body``. (As
    keywords, create() would raise TypeError before sending anything.)"""
    known = {k: v for k, v in parameters.items() if k in _SDK_FIELDS}
    extra = {k: v for k, v in parameters.items() if k not in _SDK_FIELDS}
    given = known.get("extra_body") or {}
    if extra and isinstance(given, dict):  # else create() refuses the extra_body given
        known["extra_body"] = {**extra, **given}
    return known


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
        self._client: AsyncOpenAI | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None

    @property
    def endpoint(self) -> str:
        return (self.base_url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")

    def _sdk(self) -> AsyncOpenAI:
        """One client per event loop (its httpx pool cannot move between loops)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            self._client = AsyncOpenAI(
                api_key=self._api_key() or "unused",  # the SDK insists on one; see _open
                base_url=self.endpoint,
                default_headers=self.headers,
                timeout=openai.Timeout(self.timeout, connect=min(self.timeout, 10.0)),
                max_retries=0,
            )
            self._client_loop = loop
        return self._client

    def _api_key(self) -> str | None:
        return self.api_key or os.environ.get("OPENAI_API_KEY")

    async def aclose(self) -> None:
        if self._client is not None and self._client_loop is asyncio.get_running_loop():
            await self._client.close()
        self._client = self._client_loop = None

    async def _open(
        self,
        messages: list[Msg],
        tools: list[dict[str, Any]],
        tool_choice: ToolChoice | None,
        parameters: dict[str, Any],
    ) -> AsyncIterator[ChatResponse]:
        body: dict[str, Any] = {
            **request_fields(parameters),
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
        if not self._api_key():  # local servers need no key: send no Authorization header at all
            body["extra_headers"] = {"Authorization": openai.omit}
        return await primed(self._deltas(body, DeltaBlocks(history_call_ids(messages))))

    def _error(self, exc: Exception, request_id: str = "") -> ModelError:
        """The SDK's exception as a classified ModelError."""
        if isinstance(exc, openai.APIStatusError):
            response = exc.response
            return http_error(
                self.provider,
                self.model_name,
                response.status_code,
                *_error_text(response.text),
                request_id=exc.request_id or request_id,
                retry_after=parse_retry_after(response.headers),
            )
        if isinstance(exc, openai.APIConnectionError):  # APITimeoutError included
            cause = exc.__cause__ or exc
            return connection_error(self.provider, self.model_name, cause, request_id)
        if isinstance(exc, openai.APIError):  # an error event inside the (200) stream: its body is the error
            error = exc.body if isinstance(exc.body, dict) else {}
            code = error.get("code")
            return http_error(
                self.provider,
                self.model_name,
                code if isinstance(code, int) else 200,  # vLLM sends the status as the code
                exc.message,
                str((code if isinstance(code, str) else "") or error.get("type") or ""),  # as _error_text
                request_id=request_id,
            )
        raise exc

    async def _deltas(self, body: dict[str, Any], deltas: DeltaBlocks) -> AsyncGenerator[ChatResponse, None]:
        usage: ChatUsage | None = None
        response_id = request_id = ""
        finished: str | None = None
        try:
            try:
                raw = await self._sdk().chat.completions.with_raw_response.create(**body)
            except TypeError as exc:  # the SDK refused a parameter before sending: no retry can help
                raise ModelError(
                    f"{self.provider} model {self.model_name!r}: bad request parameters: {exc}",
                    error_type=ErrorType.INVALID_REQUEST,
                    retryable=False,
                ) from exc
            request_id = raw.headers.get("x-request-id", "")
            meta = {"request_id": request_id} if request_id else {}
            content_type = raw.headers.get("content-type", "")
            expected = "text/event-stream" if self.stream else "json"
            if expected not in content_type or not self.stream:
                text = (await raw.http_response.aread()).decode(errors="replace")
                if "json" in content_type and _is_error_body(text):  # the provider's error, with status 200
                    raise http_error(self.provider, self.model_name, 200, *_error_text(text), request_id=request_id)
                if expected not in content_type:  # e.g. a gateway's HTML page with status 200
                    what = f"expected {expected}, got {content_type or 'no content type'}: {text or 'empty body'}"
                    raise protocol_error(self.provider, self.model_name, what, request_id)
            parsed = raw.parse()
            events = parsed if self.stream else _once(parsed)
            async for event in events:
                event = event.model_dump(exclude_none=True) if hasattr(event, "model_dump") else event
                response_id = event.get("id") or response_id
                if event.get("usage"):
                    usage = _usage(event["usage"])
                for choice in event.get("choices") or []:
                    # Streams carry ``delta``s; a non-streamed answer one complete ``message``.
                    part = choice.get("delta") or choice.get("message") or {}
                    reasoning = part.get("reasoning_content") or part.get("reasoning")
                    blocks = deltas.add(reasoning, part.get("content"), part.get("tool_calls"))
                    finished = choice.get("finish_reason") or finished
                    if blocks:
                        yield ChatResponse(content=blocks, is_last=False, id=response_id or new_id(), metadata=meta)
            if finished is None:
                raise protocol_error(
                    self.provider, self.model_name, "the stream ended without a finish reason (truncated)", request_id
                )
        except openai.OpenAIError as exc:
            raise self._error(exc, request_id) from exc
        except ValueError as exc:  # a malformed event (JSON)
            raise protocol_error(self.provider, self.model_name, f"malformed event: {exc}", request_id) from exc
        yield ChatResponse(
            content=deltas.finish(),
            is_last=False,
            id=response_id or new_id(),
            usage=usage,
            finished_reason=finish_reason(finished),
            metadata=meta,
        )


def _error_text(raw: str) -> tuple[str, str]:
    """(message, code) from the error bodies servers send: OpenAI/vLLM ``{"error": {...}}`` or
    ``{"message": ...}``, Ollama ``{"error": "..."}``, FastAPI ``{"detail": ...}``, or plain text
    (an HTML page included: ``http_error`` summarizes it)."""
    try:
        body = json.loads(raw)
    except ValueError:
        return raw, ""
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):
        message = error.get("message") or error.get("detail") or json.dumps(error)
        return str(message), str(error.get("code") or error.get("type") or "")
    return str(error), ""


def _is_error_body(raw: str) -> bool:
    """An error body of a server (OpenAI/Ollama ``{"error": ...}``, vLLM ``{"object": "error"}``)."""
    try:
        body = json.loads(raw)
    except ValueError:
        return False
    return isinstance(body, dict) and (bool(body.get("error")) or body.get("object") == "error")


async def _once(answer: Any) -> AsyncIterator[Any]:
    yield answer


def _usage(usage: dict[str, Any]) -> ChatUsage:
    prompt_details = usage.get("prompt_tokens_details") or {}
    completion_details = usage.get("completion_tokens_details") or {}
    return usage_of(
        usage.get("prompt_tokens"),
        usage.get("completion_tokens"),
        prompt_details.get("cached_tokens"),
        completion_details.get("reasoning_tokens"),
    )


__all__ = ["OpenAICompatibleModel"]
