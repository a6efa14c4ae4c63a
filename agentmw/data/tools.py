"""Tool-side types: ToolChoice, tool descriptors, ToolChunk and ToolResponse."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._common import new_id
from .blocks import DataBlock, TextBlock
from .enums import ToolResultState


@dataclass(slots=True, kw_only=True)
class ToolChoice:
    """``mode``: "auto" | "none" | "required" | a tool name (force that tool); ``tools``: a whitelist."""

    mode: str = "auto"
    tools: list[str] | None = None


@dataclass(slots=True, kw_only=True)
class ToolDescriptor:
    """What crosses the wire in place of a live tool object."""

    name: str
    description: str = ""
    input_schema: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    is_concurrency_safe: bool = False
    is_read_only: bool = False
    is_external_tool: bool = False
    needs_confirmation: bool = False
    metadata_schema: dict[str, Any] | None = None
    # Where the tool executes: "" for the host's own toolkit, else the owning middleware's name.
    owner: str = ""


@dataclass(slots=True, kw_only=True)
class ToolChunk:
    content: list[TextBlock | DataBlock] = field(default_factory=list)
    state: ToolResultState = ToolResultState.RUNNING
    is_last: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)
    id: str = field(default_factory=new_id)


@dataclass(slots=True, kw_only=True)
class ToolResponse:
    content: list[TextBlock | DataBlock] = field(default_factory=list)
    state: ToolResultState = ToolResultState.SUCCESS
    metadata: dict[str, Any] = field(default_factory=dict)
    id: str = field(default_factory=new_id)

    def append_chunk(self, chunk: ToolChunk) -> None:
        """Merge a chunk: adjacent text joins, error is sticky, interrupted/denied override success."""
        for block in chunk.content:
            last = self.content[-1] if self.content else None
            if isinstance(block, TextBlock) and isinstance(last, TextBlock):
                last.text += block.text
            else:
                self.content.append(block)
        if self.state != ToolResultState.ERROR and chunk.state in (
            ToolResultState.ERROR,
            ToolResultState.INTERRUPTED,
            ToolResultState.DENIED,
        ):
            self.state = chunk.state
        self.metadata.update({k: v for k, v in chunk.metadata.items() if k != "mcp_progress"})
