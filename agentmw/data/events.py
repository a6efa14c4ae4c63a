"""Every AgentScope event type. ``type`` is the discriminator; enum values are strings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ._common import new_id, now
from .blocks import DataBlock, PermissionRule, TextBlock, ToolCallBlock, ToolResultBlock
from .enums import FinishedReason, ReplyFinishedReason, ToolResultState
from .messages import ErrorInfo


@dataclass(slots=True, kw_only=True)
class EventBase:
    type: ClassVar[str] = ""
    id: str = field(default_factory=new_id)
    created_at: str = field(default_factory=now)
    metadata: dict[str, Any] = field(default_factory=dict)


def _event(type_name: str):
    def wrap(cls):
        cls.type = type_name
        return cls

    return wrap


@_event("REPLY_START")
@dataclass(slots=True, kw_only=True)
class ReplyStartEvent(EventBase):
    session_id: str
    reply_id: str
    name: str
    role: str = "assistant"


@_event("REPLY_END")
@dataclass(slots=True, kw_only=True)
class ReplyEndEvent(EventBase):
    session_id: str
    reply_id: str
    finished_reason: ReplyFinishedReason = ReplyFinishedReason.COMPLETED
    error: ErrorInfo | None = None


@_event("MODEL_CALL_START")
@dataclass(slots=True, kw_only=True)
class ModelCallStartEvent(EventBase):
    reply_id: str
    model_name: str


@_event("MODEL_CALL_END")
@dataclass(slots=True, kw_only=True)
class ModelCallEndEvent(EventBase):
    reply_id: str
    input_tokens: int = 0
    output_tokens: int = 0
    cache_input_tokens: int = 0
    cache_creation_input_tokens: int = 0
    finished_reason: FinishedReason = FinishedReason.COMPLETED
    reasoning_tokens: int = 0


@_event("TEXT_BLOCK_START")
@dataclass(slots=True, kw_only=True)
class TextBlockStartEvent(EventBase):
    reply_id: str
    block_id: str


@_event("TEXT_BLOCK_DELTA")
@dataclass(slots=True, kw_only=True)
class TextBlockDeltaEvent(EventBase):
    reply_id: str
    block_id: str
    delta: str


@_event("TEXT_BLOCK_END")
@dataclass(slots=True, kw_only=True)
class TextBlockEndEvent(EventBase):
    reply_id: str
    block_id: str
    text: str | None = None


@_event("THINKING_BLOCK_START")
@dataclass(slots=True, kw_only=True)
class ThinkingBlockStartEvent(EventBase):
    reply_id: str
    block_id: str


@_event("THINKING_BLOCK_DELTA")
@dataclass(slots=True, kw_only=True)
class ThinkingBlockDeltaEvent(EventBase):
    reply_id: str
    block_id: str
    delta: str


@_event("THINKING_BLOCK_END")
@dataclass(slots=True, kw_only=True)
class ThinkingBlockEndEvent(EventBase):
    reply_id: str
    block_id: str


@_event("DATA_BLOCK_START")
@dataclass(slots=True, kw_only=True)
class DataBlockStartEvent(EventBase):
    reply_id: str
    block_id: str
    media_type: str
    name: str | None = None


@_event("DATA_BLOCK_DELTA")
@dataclass(slots=True, kw_only=True)
class DataBlockDeltaEvent(EventBase):
    reply_id: str
    block_id: str
    media_type: str
    data: str | None = None  # incremental base64; exactly one of data / url
    url: str | None = None


@_event("DATA_BLOCK_END")
@dataclass(slots=True, kw_only=True)
class DataBlockEndEvent(EventBase):
    reply_id: str
    block_id: str


@_event("HINT_BLOCK")
@dataclass(slots=True, kw_only=True)
class HintBlockEvent(EventBase):
    reply_id: str
    block_id: str
    hint: str | list[TextBlock | DataBlock]
    source: str | None = None


@_event("TOOL_CALL_START")
@dataclass(slots=True, kw_only=True)
class ToolCallStartEvent(EventBase):
    reply_id: str
    tool_call_id: str
    tool_call_name: str


@_event("TOOL_CALL_DELTA")
@dataclass(slots=True, kw_only=True)
class ToolCallDeltaEvent(EventBase):
    reply_id: str
    tool_call_id: str
    delta: str


@_event("TOOL_CALL_END")
@dataclass(slots=True, kw_only=True)
class ToolCallEndEvent(EventBase):
    reply_id: str
    tool_call_id: str


@_event("TOOL_RESULT_START")
@dataclass(slots=True, kw_only=True)
class ToolResultStartEvent(EventBase):
    reply_id: str
    tool_call_id: str
    tool_call_name: str


@_event("TOOL_RESULT_TEXT_DELTA")
@dataclass(slots=True, kw_only=True)
class ToolResultTextDeltaEvent(EventBase):
    reply_id: str
    tool_call_id: str
    delta: str


@_event("TOOL_RESULT_DATA_DELTA")
@dataclass(slots=True, kw_only=True)
class ToolResultDataDeltaEvent(EventBase):
    reply_id: str
    tool_call_id: str
    block_id: str
    media_type: str
    data: str | None = None
    url: str | None = None


@_event("TOOL_RESULT_END")
@dataclass(slots=True, kw_only=True)
class ToolResultEndEvent(EventBase):
    reply_id: str
    tool_call_id: str
    state: ToolResultState = ToolResultState.SUCCESS  # the result's metadata rides in ``metadata``


@_event("EXCEED_MAX_ITERS")
@dataclass(slots=True, kw_only=True)
class ExceedMaxItersEvent(EventBase):
    reply_id: str
    name: str


@_event("REQUIRE_USER_CONFIRM")
@dataclass(slots=True, kw_only=True)
class RequireUserConfirmEvent(EventBase):
    reply_id: str
    tool_calls: list[ToolCallBlock]


@_event("REQUIRE_EXTERNAL_EXECUTION")
@dataclass(slots=True, kw_only=True)
class RequireExternalExecutionEvent(EventBase):
    reply_id: str
    tool_calls: list[ToolCallBlock]


@dataclass(slots=True, kw_only=True)
class ConfirmResult:
    confirmed: bool
    tool_call: ToolCallBlock
    rules: list[PermissionRule] = field(default_factory=list)


@_event("USER_CONFIRM_RESULT")
@dataclass(slots=True, kw_only=True)
class UserConfirmResultEvent(EventBase):
    reply_id: str
    confirm_results: list[ConfirmResult]


@_event("USER_INTERRUPT")
@dataclass(slots=True, kw_only=True)
class UserInterruptEvent(EventBase):
    reply_id: str


@_event("EXTERNAL_EXECUTION_RESULT")
@dataclass(slots=True, kw_only=True)
class ExternalExecutionResultEvent(EventBase):
    reply_id: str
    execution_results: list[ToolResultBlock]


@_event("CUSTOM")
@dataclass(slots=True, kw_only=True)
class CustomEvent(EventBase):
    name: str
    value: dict[str, Any] = field(default_factory=dict)
    # The reply it belongs to, when it is injected into one ("" = none; AgentScope's CustomEvent
    # has no such field: an extension so that every event of a reply can name it).
    reply_id: str = ""


EVENT_CLASSES: tuple[type[EventBase], ...] = tuple(
    c for c in list(globals().values()) if isinstance(c, type) and issubclass(c, EventBase) and c.type
)
RESUME_EVENTS = (UserConfirmResultEvent, ExternalExecutionResultEvent, UserInterruptEvent)
AgentEvent = EventBase
