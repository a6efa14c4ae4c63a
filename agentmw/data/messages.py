"""Msg, Usage and ErrorInfo (AgentScope's names and fields)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ._common import new_id, now
from .blocks import ContentBlock, TextBlock, block_text
from .enums import ErrorType, ReplyFinishedReason, Role


@dataclass(slots=True, kw_only=True)
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    cache_input_tokens: int = 0
    cache_creation_input_tokens: int = 0
    reasoning_tokens: int = 0

    def add(self, other: Usage) -> None:
        self.input_tokens += other.input_tokens
        self.output_tokens += other.output_tokens
        self.cache_input_tokens += other.cache_input_tokens
        self.cache_creation_input_tokens += other.cache_creation_input_tokens
        self.reasoning_tokens += other.reasoning_tokens


@dataclass(slots=True, kw_only=True)
class ErrorInfo:
    type: ErrorType = ErrorType.UNKNOWN
    message: str = ""


@dataclass(slots=True, kw_only=True)
class Msg:
    name: str
    content: list[ContentBlock]
    role: Role
    id: str = field(default_factory=new_id)
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: str = field(default_factory=now)
    usage: Usage | None = None
    finished_at: str | None = None
    finished_reason: ReplyFinishedReason | None = None
    structured_output: dict[str, Any] | None = None
    error: ErrorInfo | None = None

    @property
    def text(self) -> str:
        return block_text(self.content)

    def blocks(self, kind: str) -> list[Any]:
        return [b for b in self.content if b.type == kind]

    def append_usage(self, usage: Usage) -> None:
        if self.usage is None:
            self.usage = Usage()
        self.usage.add(usage)

    def check_role(self) -> None:
        """Raise ValueError unless the blocks fit the role (AgentScope's Msg validation): a user
        message holds only text and data, a system message only text; an assistant message any."""
        allowed = _ROLE_BLOCKS.get(self.role)
        if allowed is None:
            return
        bad = sorted({b.type for b in self.content if b.type not in allowed})
        if bad:
            raise ValueError(f"a {self.role.value} message holds only {'/'.join(allowed)} blocks, not {'/'.join(bad)}")


# Which block types a message of each role may hold (a role not listed: any).
_ROLE_BLOCKS: dict[Role, tuple[str, ...]] = {Role.USER: ("text", "data"), Role.SYSTEM: ("text",)}


def UserMsg(text: str, name: str = "user", **kw: Any) -> Msg:
    msg = Msg(name=name, content=[TextBlock(text=text)], role=Role.USER, **kw)
    msg.finished_at = msg.finished_at or msg.created_at
    return msg


def AssistantMsg(content: str | Sequence[ContentBlock], name: str = "assistant", **kw: Any) -> Msg:
    if isinstance(content, str):
        blocks: list[ContentBlock] = [TextBlock(text=content)]
    else:
        blocks = content if isinstance(content, list) else list(content)
    return Msg(name=name, content=blocks, role=Role.ASSISTANT, **kw)


def SystemMsg(text: str, name: str = "system", **kw: Any) -> Msg:
    msg = Msg(name=name, content=[TextBlock(text=text)], role=Role.SYSTEM, **kw)
    msg.finished_at = msg.finished_at or msg.created_at
    return msg
