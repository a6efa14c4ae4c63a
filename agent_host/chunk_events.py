"""Chunk-to-event conversion: a model's streamed ChatResponses and a tool's chunks and output, as the
reply's block events (docs/behaviour.md#reasoning and #acting)."""

from __future__ import annotations

import copy
import time
from typing import Any

from agentmw.data import (
    ChatResponse,
    ChatUsage,
    DataBlock,
    DataBlockDeltaEvent,
    DataBlockEndEvent,
    DataBlockStartEvent,
    FinishedReason,
    TextBlock,
    TextBlockDeltaEvent,
    TextBlockEndEvent,
    TextBlockStartEvent,
    ThinkingBlock,
    ThinkingBlockDeltaEvent,
    ThinkingBlockEndEvent,
    ThinkingBlockStartEvent,
    ToolCallBlock,
    ToolCallDeltaEvent,
    ToolCallEndEvent,
    ToolCallStartEvent,
    ToolChunk,
    ToolResultDataDeltaEvent,
    ToolResultTextDeltaEvent,
    new_id,
)


class ChunkConverter:
    """Turns delta ChatResponses into block events (docs/behaviour.md#reasoning); text/thinking event ids are fresh."""

    # (start, delta, end) event classes of the two streamed text-like block kinds, in close order
    _TEXTUAL = {
        "text": (TextBlockStartEvent, TextBlockDeltaEvent, TextBlockEndEvent),
        "thinking": (ThinkingBlockStartEvent, ThinkingBlockDeltaEvent, ThinkingBlockEndEvent),
    }

    def __init__(self, reply_id: str) -> None:
        self.reply_id = reply_id
        self.open_ids: dict[str, str | None] = {"text": None, "thinking": None}
        self.tool_ids: list[str] = []
        self.tool_names: dict[str, str] = {}
        self.open_tools: set[str] = set()
        self.tool_args: dict[str, list[str]] = {}  # call id -> its argument pieces, for the end event
        self.data_ids: set[str] = set()
        # What was streamed, as text: each text / thinking block's pieces in order, and the latest
        # usage. Strings, not the chunks: a long answer's 25k chunks kept alive cost collections
        # of the garbage collector that stalled the loop (tests/test_linear.py).
        self.streamed: list[tuple[str, list[str]]] = []
        self.open_pieces: dict[str, list[str]] = {}
        self.usage: ChatUsage | None = None

    def so_far(self, finished: FinishedReason, started: float) -> ChatResponse:
        """The response the converted deltas make up: what to save when a stream ends without its
        own (interrupted while the reasoning was suspended between items, or failed)."""
        content: list[Any] = [
            TextBlock(text="".join(pieces)) if kind == "text" else ThinkingBlock(thinking="".join(pieces))
            for kind, pieces in self.streamed
        ]
        content += [
            ToolCallBlock(id=i, name=self.tool_names[i], input="".join(self.tool_args.get(i, [])))
            for i in self.tool_ids
        ]
        usage = copy.copy(self.usage) if self.usage is not None else ChatUsage()
        usage.time = usage.time or round(time.monotonic() - started, 6)
        return ChatResponse(content=content, usage=usage, finished_reason=finished)

    def _textual(self, kind: str, piece: str, has_data: bool, out: list[Any]) -> None:
        start, delta, end = self._TEXTUAL[kind]
        block_id = self.open_ids[kind]
        if piece:
            if kind == "text" and self.open_ids["thinking"] is not None:  # the answer ends the thinking
                out.append(ThinkingBlockEndEvent(reply_id=self.reply_id, block_id=self.open_ids["thinking"]))
                self.open_ids["thinking"] = None
            if block_id is None:
                block_id = self.open_ids[kind] = new_id()
                out.append(start(reply_id=self.reply_id, block_id=block_id))
                pieces: list[str] = []
                self.open_pieces[kind] = pieces
                self.streamed.append((kind, pieces))
            self.open_pieces[kind].append(piece)
            out.append(delta(reply_id=self.reply_id, block_id=block_id, delta=piece))
        elif block_id is not None and not has_data:  # a chunk without this kind closes it
            out.append(end(reply_id=self.reply_id, block_id=block_id))
            self.open_ids[kind] = None

    def convert(self, chunk: ChatResponse) -> list[Any]:
        rid = self.reply_id
        out: list[Any] = []
        if chunk.usage is not None:
            self.usage = chunk.usage
        has_data = any(isinstance(b, DataBlock) for b in chunk.content)
        thinking = "".join(b.thinking for b in chunk.content if isinstance(b, ThinkingBlock))
        self._textual("thinking", thinking, has_data, out)
        self._textual("text", "".join(b.text for b in chunk.content if isinstance(b, TextBlock)), has_data, out)
        # Tool calls stay open until the model call ends: parallel calls' fragments may interleave,
        # so a chunk without a call does not mean that call is complete.
        for block in chunk.content:
            if isinstance(block, ToolCallBlock):
                if block.id not in self.open_tools and block.id not in self.tool_ids:
                    self.tool_ids.append(block.id)
                    self.tool_names[block.id] = block.name
                    self.open_tools.add(block.id)
                    out.append(ToolCallStartEvent(reply_id=rid, tool_call_id=block.id, tool_call_name=block.name))
                if block.input:
                    self.tool_args.setdefault(block.id, []).append(block.input)
                    out.append(ToolCallDeltaEvent(reply_id=rid, tool_call_id=block.id, delta=block.input))
        for block in chunk.content:
            if isinstance(block, DataBlock) and block.source.type == "base64":
                media_type = block.source.media_type
                if block.id not in self.data_ids:
                    self.data_ids.add(block.id)
                    out.append(
                        DataBlockStartEvent(reply_id=rid, block_id=block.id, media_type=media_type, name=block.name)
                    )
                out.append(
                    DataBlockDeltaEvent(reply_id=rid, block_id=block.id, media_type=media_type, data=block.source.data)
                )
        return out

    def close_all(self) -> list[Any]:
        rid = self.reply_id
        out: list[Any] = []
        for kind, (_, _, end) in self._TEXTUAL.items():
            if self.open_ids[kind] is not None:
                out.append(end(reply_id=rid, block_id=self.open_ids[kind]))
                self.open_ids[kind] = None
        out.extend(
            ToolCallEndEvent(reply_id=rid, tool_call_id=i, metadata={"input": "".join(self.tool_args.get(i, []))})
            for i in self.tool_ids
            if i in self.open_tools
        )
        out.extend(DataBlockEndEvent(reply_id=rid, block_id=i) for i in sorted(self.data_ids))
        self.open_tools.clear()
        self.data_ids.clear()
        return out


def tool_chunk_events(reply_id: str, call_id: str, chunk: ToolChunk) -> list[Any]:
    out: list[Any] = []
    progress = chunk.metadata.get("mcp_progress")
    if progress is not None:
        from agentmw.data import CustomEvent

        value = {**progress, "reply_id": reply_id, "tool_call_id": call_id}
        out.append(CustomEvent(name="mcp_progress", value=value, reply_id=reply_id))
    out.extend(tool_output_events(reply_id, call_id, chunk.content))
    return out


def tool_output_events(reply_id: str, call_id: str, output: Any) -> list[Any]:
    if isinstance(output, str):
        return [ToolResultTextDeltaEvent(reply_id=reply_id, tool_call_id=call_id, delta=output)] if output else []
    out: list[Any] = []
    for block in output:
        if isinstance(block, TextBlock):
            out.append(ToolResultTextDeltaEvent(reply_id=reply_id, tool_call_id=call_id, delta=block.text))
        elif isinstance(block, DataBlock):
            src = block.source
            out.append(
                ToolResultDataDeltaEvent(
                    reply_id=reply_id,
                    tool_call_id=call_id,
                    block_id=block.id,
                    media_type=src.media_type,
                    data=getattr(src, "data", None),
                    url=getattr(src, "url", None),
                )
            )
    return out
