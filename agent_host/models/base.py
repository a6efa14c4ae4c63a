"""The host's model interface: every provider streams delta ChatResponses, then one complete one."""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import AsyncIterator
from typing import Any

from agentmw.data import (
    ChatResponse,
    ChatUsage,
    DataBlock,
    FinishedReason,
    ModelRef,
    Msg,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
    ToolChoice,
)
from agentmw.errors import ModelError  # re-exported: the models raise it


class ChatModel:
    """Base of every chat model. Subclasses implement ``_open`` (raise call-time errors there)."""

    provider = "unknown"

    def __init__(
        self,
        *,
        id: str,
        model_name: str = "",
        context_size: int = 131072,
        stream: bool = True,
        parameters: dict[str, Any] | None = None,
        base_url: str = "",
    ) -> None:
        self.id = id
        self.model_name = model_name or id
        self.context_size = context_size
        self.stream = stream
        self.parameters = dict(parameters or {})
        self.base_url = base_url

    @property
    def ref(self) -> ModelRef:
        """A snapshot, what on_model_call's ``current_model`` is: its ``parameters`` are a copy, so
        a middleware's edit reaches only the call it passes it to, never this shared model."""
        return self._ref(copy.deepcopy(self.parameters))

    def peek_ref(self) -> ModelRef:
        """The ref with this model's own ``parameters`` (no copy): to read or encode at once (a
        hook context, per message), never to hand out."""
        return self._ref(self.parameters)

    def _ref(self, parameters: dict[str, Any]) -> ModelRef:
        return ModelRef(
            id=self.id,
            provider=self.provider,
            model_name=self.model_name,
            base_url=self.endpoint,  # the endpoint in use, for tracing
            stream=self.stream,
            context_size=self.context_size,
            parameters=parameters,
        )

    @property
    def endpoint(self) -> str:
        """Where its requests go (a client's default when ``base_url`` is unset)."""
        return self.base_url

    async def __call__(
        self,
        messages: list[Msg],
        tools: list[dict[str, Any]] | None = None,
        tool_choice: ToolChoice | None = None,
        parameters: dict[str, Any] | None = None,
    ) -> AsyncIterator[ChatResponse]:
        """Start a call. Errors that happen before the first chunk with content raise here (so retry
        and fallback see them); the returned stream yields deltas and ends with one accumulated ``is_last`` chunk.
        ``parameters`` override the configured ones for this call only (e.g. ``temperature``,
        ``max_tokens``, ``response_format``, a thinking budget), as a middleware may ask."""
        started = time.monotonic()
        params = {**self.parameters, **(parameters or {})}
        try:
            deltas = await self._open(messages, tools or [], tool_choice, params)
        except ModelError as exc:
            # Nothing arrived; the (empty) partial still says when the attempt failed and how long it
            # took, so a tracer times it as an answered call.
            exc.partial = Accumulator().result(FinishedReason.ERROR, started)
            self._redact(exc)
            raise
        return self._accumulate(deltas, started)

    def _api_key(self) -> str | None:
        """The key its requests carry (None: none); never in an error text (``_redact``)."""
        return None

    def _redact(self, exc: ModelError) -> None:
        """Keys stay in the host: a provider (a gateway, mostly) may quote the key it was sent in
        its error, which becomes the reply's error, a stored message and log lines. The key is
        masked in the text, and the exception chain it came in (the SDK's own error) is dropped."""
        key = self._api_key()
        if not key or len(key) < 8:  # a placeholder ("unused", "x") is no secret, and masks words
            return
        if key in str(exc):
            exc.args = (str(exc).replace(key, "[api key]"),)
        for cause in (exc.__cause__, exc.__context__):
            if cause is not None and key in str(cause):
                exc.__cause__ = exc.__context__ = None

    async def _open(
        self,
        messages: list[Msg],
        tools: list[dict[str, Any]],
        tool_choice: ToolChoice | None,
        parameters: dict[str, Any],
    ) -> AsyncIterator[ChatResponse]:
        raise NotImplementedError

    async def _accumulate(self, deltas: AsyncIterator[ChatResponse], started: float) -> AsyncIterator[ChatResponse]:
        acc = Accumulator()
        try:
            async for chunk in deltas:
                if chunk.is_last:  # the provider sent its own complete chunk
                    yield chunk
                    return
                acc.add(chunk)
                if chunk.content:
                    yield chunk
        except asyncio.CancelledError:
            yield acc.result(FinishedReason.INTERRUPTED, started)  # with the usage reported so far
            raise
        except ModelError as exc:  # mid-stream: the caller keeps what the user already saw
            exc.partial = acc.result(FinishedReason.ERROR, started)
            self._redact(exc)
            raise
        finally:
            close = getattr(deltas, "aclose", None)
            if close is not None:
                await close()
        yield acc.result(acc.finished, started)

    def count_tokens(self, messages: list[Msg], tools: list[dict[str, Any]] | None = None) -> int:
        """A cheap estimate: UTF-8 bytes / 4 of all text, as AgentScope's default."""
        total = 0
        for msg in messages:
            for block in msg.content:
                for attr in ("text", "thinking", "input", "hint", "output"):
                    value = getattr(block, attr, None)
                    if isinstance(value, str):
                        total += len(value.encode())
        return total // 4


class Accumulator:
    """Merges delta chunks by block id (text/thinking concatenate, tool-call input concatenates).

    The pieces of each block are kept in a list and joined once, in ``result``: ``block.text +=
    piece`` copies the whole text on every chunk (quadratic: 400k chunks took 5.5 s)."""

    def __init__(self) -> None:
        self.blocks: dict[str, Any] = {}
        self.pieces: dict[str, list[str]] = {}  # block id -> its streamed pieces, in order
        self.usage: ChatUsage | None = None
        self.id = ""
        self.metadata: dict[str, Any] = {}  # e.g. the provider's request id
        # A delta chunk's finished_reason other than COMPLETED (LENGTH, CONTENT_FILTER) sticks.
        self.finished = FinishedReason.COMPLETED

    def add(self, chunk: ChatResponse) -> None:
        self.id = self.id or chunk.id
        self.metadata.update(chunk.metadata)
        if chunk.finished_reason != FinishedReason.COMPLETED:
            self.finished = chunk.finished_reason
        if chunk.usage is not None:
            self.usage = chunk.usage
        for block in chunk.content:
            have = self.blocks.get(block.id)
            if have is None:
                have = self.blocks[block.id] = _copy_block(block)
                if _streamed_field(have) is not None:
                    self.pieces[block.id] = [_streamed(have)]
                continue
            pieces = self.pieces.get(block.id)
            if pieces is not None and type(block) is type(have):
                pieces.append(_streamed(block))
            if isinstance(block, ToolCallBlock) and isinstance(have, ToolCallBlock):
                have.name = have.name or block.name

    def result(self, finished: FinishedReason, started: float) -> ChatResponse:
        for block_id, pieces in self.pieces.items():
            block = self.blocks[block_id]
            joined = "".join(pieces)
            pieces[:] = [joined]  # a second result() costs nothing more
            field = _streamed_field(block)
            assert field is not None  # only a block with a streamed field has pieces
            setattr(block.source if isinstance(block, DataBlock) else block, field, joined)
        usage = self.usage or ChatUsage()
        usage.time = usage.time or round(time.monotonic() - started, 6)
        kw = {"id": self.id} if self.id else {}
        return ChatResponse(
            content=list(self.blocks.values()),
            is_last=True,
            usage=usage,
            finished_reason=finished,
            metadata=dict(self.metadata),
            **kw,
        )


# The text field each kind of streamed block grows by (a data block: its base64 source's data).
_STREAMED = {TextBlock: "text", ThinkingBlock: "thinking", ToolCallBlock: "input"}


def _streamed_field(block: Any) -> str | None:
    if isinstance(block, DataBlock):
        return "data" if isinstance(getattr(block.source, "data", None), str) else None
    return _STREAMED.get(type(block))


def _streamed(block: Any) -> str:
    if isinstance(block, DataBlock):
        return getattr(block.source, "data", "") or ""
    return getattr(block, _STREAMED[type(block)])


def _copy_block(block: Any) -> Any:
    return copy.deepcopy(block)
