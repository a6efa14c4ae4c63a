"""The data model: AgentScope's names and fields as slotted dataclasses."""

from ._common import new_id, now, set_id_factory, set_time_factory
from .blocks import (
    Base64Source,
    ContentBlock,
    DataBlock,
    HintBlock,
    PermissionRule,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
    ToolResultBlock,
    URLSource,
    block_text,
)
from .chat import ChatResponse, ChatUsage
from .enums import (
    ErrorType,
    FinishedReason,
    PermissionBehavior,
    ReplyFinishedReason,
    Role,
    ToolCallState,
    ToolResultState,
)
from .events import *  # noqa: F403 - every event class
from .events import EVENT_CLASSES, RESUME_EVENTS, AgentEvent, ConfirmResult, EventBase
from .messages import AssistantMsg, ErrorInfo, Msg, SystemMsg, Usage, UserMsg
from .models import ContextConfig, ModelRef
from .permission import PermissionDecision
from .state import AgentState, ReplyContext
from .tools import ToolChoice, ToolChunk, ToolDescriptor, ToolResponse

__all__ = [
    "new_id",
    "now",
    "set_id_factory",
    "set_time_factory",
    "Base64Source",
    "ContentBlock",
    "DataBlock",
    "HintBlock",
    "PermissionRule",
    "TextBlock",
    "ThinkingBlock",
    "ToolCallBlock",
    "ToolResultBlock",
    "URLSource",
    "block_text",
    "ChatResponse",
    "ChatUsage",
    "ErrorType",
    "FinishedReason",
    "PermissionBehavior",
    "ReplyFinishedReason",
    "Role",
    "ToolCallState",
    "ToolResultState",
    "EVENT_CLASSES",
    "RESUME_EVENTS",
    "AgentEvent",
    "ConfirmResult",
    "EventBase",
    *(c.__name__ for c in EVENT_CLASSES),
    "AssistantMsg",
    "ErrorInfo",
    "Msg",
    "SystemMsg",
    "Usage",
    "UserMsg",
    "ContextConfig",
    "ModelRef",
    "PermissionDecision",
    "AgentState",
    "ReplyContext",
    "ToolChoice",
    "ToolChunk",
    "ToolDescriptor",
    "ToolResponse",
]
