"""The Python SDK for writing a middleware server.

from agentmw.sdk import MiddlewareBase, serve

class Hello(MiddlewareBase):
    async def on_system_prompt(self, agent, prompt):
        return prompt + "\\nSay hello."

serve(Hello(), "127.0.0.1:50061")
"""

from agentmw import data as _data
from agentmw.data import *  # noqa: F403 - the data model, for authors (exported below)
from agentmw.errors import ModelError
from agentmw.middleware import (
    ActingKwargs,
    CheckPermissionKwargs,
    CompressContextKwargs,
    MiddlewareBase,
    Mode,
    ModelCallKwargs,
    ReasoningKwargs,
    ReplyKwargs,
    Subscription,
    subscribe,
)
from agentmw.tools import FunctionTool, Tool, tool
from agentmw.wire import KNOWN_ERRORS

from .server import ServeSecurity, describe, serve, serve_async, start
from .session import InnerPipelineError
from .view import ContextEditError

__all__ = [
    "KNOWN_ERRORS",
    "ActingKwargs",
    "CheckPermissionKwargs",
    "CompressContextKwargs",
    "ContextEditError",
    "FunctionTool",
    "InnerPipelineError",
    "MiddlewareBase",
    "Mode",
    "ModelCallKwargs",
    "ModelError",
    "ReasoningKwargs",
    "ReplyKwargs",
    "ServeSecurity",
    "Subscription",
    "Tool",
    "describe",
    "serve",
    "serve_async",
    "start",
    "subscribe",
    "tool",
]
__all__ += _data.__all__
