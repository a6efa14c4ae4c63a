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
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import dashscope
from dashscope.api_entities import aiohttp_request, http_request

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

# Errors of the transport below the SDK: worth another attempt.
_TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)
_SDK_TIMEOUT = 24 * 3600  # seconds: effectively none (this class enforces ``timeout`` itself)


async def _send_once(send: Callable[[], Awaitable[aiohttp.ClientResponse]]) -> aiohttp.ClientResponse:
    return await send()


# The SDK sends a request again when its connection fails before the answer (taking it for an idle
# pooled one the server closed), but a fresh connection reset after the server read the request
# fails the same way: the request would be sent twice, unseen by the host's retry policy, the
# on_model_call middleware and the metrics. Each attempt is one request; the host decides on more.
# (dashscope is pinned; tests/test_models_wire.py checks the requests a reset costs.)
for _module in (http_request, aiohttp_request):
    _module.send_with_retry_async = _send_once  # type: ignore[attr-defined]


class _ErrorAnswer(Exception):
    """A 200 answer whose JSON body is the provider's error, which the SDK would take for an answer
    (and fail on, its code and message dropped)."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(body.get("message"))
        self.body = body


class _Response(aiohttp.ClientResponse):
    """The responses of the model's own session: an error body under status 200 raises _ErrorAnswer."""

    async def json(self, *args: Any, **kwargs: Any) -> Any:
        body = await super().json(*args, **kwargs)
        if self.status == 200 and isinstance(body, dict) and body.get("code") and not body.get("output"):
            raise _ErrorAnswer(body)
        return body


def _lower(headers: Any) -> dict[str, str]:
    return {str(k).lower(): str(v) for k, v in (headers or {}).items()}


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
        # Seconds without data from the server, enforced here for streamed and plain calls alike
        # (the SDK's own timeout is a total for plain calls, and it resends a request whose
        # answer is late, taking the read timeout for a dropped pooled connection).
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None  # ours, closed by aclose()
        self._session_loop: asyncio.AbstractEventLoop | None = None

    @property
    def endpoint(self) -> str:
        return self.base_url or os.environ.get("DASHSCOPE_HTTP_BASE_URL") or dashscope.base_http_api_url

    def _aio(self) -> aiohttp.ClientSession:
        """One aiohttp session per event loop, owned by the model (the SDK's shared one is never
        closed: "Unclosed client session" at every shutdown)."""
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            self._session = aiohttp.ClientSession(trust_env=True, response_class=_Response)
            self._session_loop = loop
        return self._session

    def _api_key(self) -> str | None:
        return self.api_key or os.environ.get("DASHSCOPE_API_KEY") or dashscope.api_key

    async def aclose(self) -> None:
        if self._session is not None and self._session_loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = self._session_loop = None

    async def _open(
        self,
        messages: list[Msg],
        tools: list[dict[str, Any]],
        tool_choice: ToolChoice | None,
        parameters: dict[str, Any],
    ) -> AsyncIterator[ChatResponse]:
        api_key = self._api_key()
        if not api_key:
            raise ModelError(
                f"dashscope model {self.id!r}: no API key (set api_key or DASHSCOPE_API_KEY)",
                error_type=ErrorType.SETUP,
            )
        request: dict[str, Any] = {
            **parameters,
            "model": self.model_name,
            "messages": to_chat_messages(messages),
            "api_key": api_key,
            "result_format": "message",
            "base_address": self.endpoint,
            # The SDK's timeout stays out of the way (see __init__); ours is per event.
            "request_timeout": _SDK_TIMEOUT,
            "session": self._aio(),
        }
        if self.stream:
            request.update(stream=True, incremental_output=True)
        if tools:
            request["tools"] = tools
            choice = to_tool_choice(tool_choice, tools, required=False)
            if choice is not None:
                request["tool_choice"] = choice
        return await primed(self._deltas(request, DeltaBlocks(history_call_ids(messages))))

    async def _next(self, awaitable: Any) -> Any:
        try:
            async with asyncio.timeout(self.timeout):
                return await awaitable
        except TimeoutError:
            raise TimeoutError(f"no data from the server for {self.timeout:g} s") from None

    async def _deltas(self, request: dict[str, Any], deltas: DeltaBlocks) -> AsyncGenerator[ChatResponse, None]:
        usage: dict[str, Any] | None = None
        request_id = ""
        finished: str | None = None
        responses: Any = None
        try:
            result = await self._next(dashscope.AioGeneration.call(**request))
            responses = result if self.stream else _once(result)
            while (response := await self._next(anext(responses, None))) is not None:
                request_id = response.get("request_id") or request_id
                self._check(response, request_id)
                # Cumulative: the last one counts. Passed on as it changes, so a call that fails or is
                # interrupted mid-stream reports the usage so far (the accumulator keeps the latest).
                changed = bool(response.get("usage")) and response.get("usage") != usage
                usage = response.get("usage") or usage
                output = response.get("output") or {}
                blocks: list[Any] = []
                for choice in output.get("choices") or []:
                    message = choice.get("message") or {}
                    text = _content_text(message.get("content"))
                    blocks += deltas.add(message.get("reasoning_content"), text, message.get("tool_calls"))
                    if choice.get("finish_reason") not in (None, "", "null"):
                        finished = choice["finish_reason"]
                if blocks or changed:
                    yield ChatResponse(
                        content=blocks,
                        is_last=False,
                        id=request_id or new_id(),
                        usage=_usage(usage) if changed else None,
                        metadata={"request_id": request_id} if request_id else {},
                    )
            if finished is None:
                raise protocol_error(
                    self.provider, self.model_name, "the stream ended without a finish reason (truncated)", request_id
                )
        except _ErrorAnswer as exc:
            body = exc.body
            raise http_error(
                self.provider,
                self.model_name,
                200,
                str(body.get("message") or ""),
                str(body.get("code")),
                request_id=str(body.get("request_id") or request_id),
            ) from exc
        except aiohttp.ContentTypeError as exc:  # a 200 that is not an event stream (a gateway's page)
            raise protocol_error(
                self.provider, self.model_name, f"not an event stream: {exc.message}", request_id
            ) from exc
        except _TRANSPORT_ERRORS as exc:
            raise connection_error(self.provider, self.model_name, exc, request_id) from exc
        except (TypeError, KeyError, ValueError, AttributeError) as exc:  # the SDK choked on the body
            raise protocol_error(
                self.provider, self.model_name, f"unreadable answer ({type(exc).__name__}: {exc})", request_id
            ) from exc
        finally:
            if responses is not None:  # release the HTTP response now if the reader stopped early
                await responses.aclose()
        yield ChatResponse(
            content=deltas.finish(),
            is_last=False,
            id=request_id or new_id(),
            usage=_usage(usage),
            finished_reason=finish_reason(finished),
            metadata={"request_id": request_id} if request_id else {},
        )

    def _check(self, response: Any, request_id: str) -> None:
        status = int(response.get("status_code") or 200)
        if status != 200:
            raise http_error(
                self.provider,
                self.model_name,
                status,
                response.get("message") or "",
                response.get("code") or "",
                request_id=request_id,
                retry_after=parse_retry_after(_lower(response.get("headers"))),
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
    return usage_of(
        usage.get("input_tokens"),
        usage.get("output_tokens"),
        details.get("cached_tokens"),
        output_details.get("reasoning_tokens"),
    )


__all__ = ["DashScopeChatModel"]
