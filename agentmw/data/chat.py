"""ChatResponse and ChatUsage: what a model call yields (deltas, then one ``is_last`` complete chunk)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._common import new_id, now
from .blocks import DataBlock, TextBlock, ThinkingBlock, ToolCallBlock
from .enums import FinishedReason


@dataclass(slots=True, kw_only=True)
class ChatUsage:
    input_tokens: int = 0
    output_tokens: int = 0
    time: float = 0.0
    cache_creation_input_tokens: int = 0
    cache_input_tokens: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    reasoning_tokens: int = 0


@dataclass(slots=True, kw_only=True)
class ChatResponse:
    content: list[TextBlock | ToolCallBlock | ThinkingBlock | DataBlock]
    is_last: bool = True
    id: str = field(default_factory=new_id)
    created_at: str = field(default_factory=now)
    usage: ChatUsage | None = None
    finished_reason: FinishedReason = FinishedReason.COMPLETED
    metadata: dict[str, Any] = field(default_factory=dict)
