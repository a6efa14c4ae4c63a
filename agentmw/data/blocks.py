"""Content blocks of messages, discriminated by ``type`` (AgentScope's names and fields)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ._common import new_id, now
from .enums import PermissionBehavior, ToolCallState, ToolResultState


@dataclass(slots=True, kw_only=True)
class TextBlock:
    text: str
    id: str = field(default_factory=new_id)
    created_at: str = field(default_factory=now)
    finished_at: str | None = None
    type: Literal["text"] = "text"


@dataclass(slots=True, kw_only=True)
class ThinkingBlock:
    thinking: str
    # Provider extras (signatures, redacted payloads) travel as an open JSON object.
    extras: dict[str, Any] = field(default_factory=dict)
    id: str = field(default_factory=new_id)
    created_at: str = field(default_factory=now)
    finished_at: str | None = None
    type: Literal["thinking"] = "thinking"


@dataclass(slots=True, kw_only=True)
class Base64Source:
    data: str
    media_type: str
    type: Literal["base64"] = "base64"


@dataclass(slots=True, kw_only=True)
class URLSource:
    url: str
    media_type: str
    type: Literal["url"] = "url"


@dataclass(slots=True, kw_only=True)
class DataBlock:
    source: Base64Source | URLSource
    name: str | None = None
    id: str = field(default_factory=new_id)
    created_at: str = field(default_factory=now)
    finished_at: str | None = None
    type: Literal["data"] = "data"


@dataclass(slots=True, kw_only=True)
class HintBlock:
    hint: str | list[TextBlock | DataBlock]
    source: str | None = None
    id: str = field(default_factory=new_id)
    created_at: str = field(default_factory=now)
    finished_at: str | None = field(default_factory=now)
    type: Literal["hint"] = "hint"


@dataclass(slots=True, kw_only=True)
class PermissionRule:
    tool_name: str
    behavior: PermissionBehavior
    rule_content: str | None = None
    source: str = "session"


@dataclass(slots=True, kw_only=True)
class ToolCallBlock:
    id: str
    name: str
    input: str = ""  # raw JSON text, as the model produced it
    state: ToolCallState = ToolCallState.PENDING
    suggested_rules: list[PermissionRule] = field(default_factory=list)
    created_at: str = field(default_factory=now)
    finished_at: str | None = None
    type: Literal["tool_call"] = "tool_call"


@dataclass(slots=True, kw_only=True)
class ToolResultBlock:
    id: str  # the tool call's id
    name: str
    output: str | list[TextBlock | DataBlock] = ""
    state: ToolResultState = ToolResultState.RUNNING
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: str = field(default_factory=now)
    finished_at: str | None = None
    type: Literal["tool_result"] = "tool_result"


ContentBlock = TextBlock | ThinkingBlock | DataBlock | HintBlock | ToolCallBlock | ToolResultBlock


def block_text(blocks: list[Any] | str) -> str:
    """Joined text of text blocks (or the string itself)."""
    if isinstance(blocks, str):
        return blocks
    return "".join(b.text for b in blocks if isinstance(b, TextBlock))
