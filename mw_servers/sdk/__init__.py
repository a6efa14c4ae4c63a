"""The Python SDK for writing a middleware server.

from mw_servers.sdk import MiddlewareBase, serve

class Hello(MiddlewareBase):
    async def on_system_prompt(self, agent, prompt):
        return prompt + "\\nSay hello."

serve(Hello(), "127.0.0.1:50061")
"""

from agent_host.data import *  # noqa: F403 - the data model, for authors
from agent_host.middleware import MiddlewareBase, Mode, Subscription, subscribe
from agent_host.tools import FunctionTool, Tool, tool

from .server import ServeSecurity, describe, serve, serve_async, start
from .session import InnerPipelineError

__all__ = [
    "FunctionTool",
    "InnerPipelineError",
    "MiddlewareBase",
    "Mode",
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
