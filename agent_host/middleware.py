"""MiddlewareBase: the authoring API, identical in-process and in a remote server.

Subclass it and override any of the hooks with AgentScope's signatures. ``subscriptions``
tells a remote host which items each hook wants to see (and whether it holds them, INTERCEPT,
or only watches them, OBSERVE); an in-process middleware sees every item regardless.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from .hooks import HOOKS
from .subscriptions import Mode, Subscription, subscribe

__all__ = ["MiddlewareBase", "Mode", "Subscription", "subscribe"]


NextHandler = Callable[..., Any]


class MiddlewareBase:
    """Base class of every middleware. Unimplemented hooks are skipped with no cost."""

    subscriptions: dict[str, Subscription] = {}

    async def on_reply(self, agent: Any, input_kwargs: dict[str, Any], next_handler: NextHandler) -> AsyncIterator[Any]:
        raise RuntimeError(f"{type(self).__name__} does not implement on_reply")
        yield  # pragma: no cover

    async def on_reasoning(
        self, agent: Any, input_kwargs: dict[str, Any], next_handler: NextHandler
    ) -> AsyncIterator[Any]:
        raise RuntimeError(f"{type(self).__name__} does not implement on_reasoning")
        yield  # pragma: no cover

    async def on_acting(
        self, agent: Any, input_kwargs: dict[str, Any], next_handler: NextHandler
    ) -> AsyncIterator[Any]:
        raise RuntimeError(f"{type(self).__name__} does not implement on_acting")
        yield  # pragma: no cover

    async def on_check_permission(self, agent: Any, input_kwargs: dict[str, Any], next_handler: NextHandler) -> Any:
        raise RuntimeError(f"{type(self).__name__} does not implement on_check_permission")

    async def on_model_call(self, agent: Any, input_kwargs: dict[str, Any], next_handler: NextHandler) -> Any:
        raise RuntimeError(f"{type(self).__name__} does not implement on_model_call")

    async def on_compress_context(self, agent: Any, input_kwargs: dict[str, Any], next_handler: NextHandler) -> None:
        raise RuntimeError(f"{type(self).__name__} does not implement on_compress_context")

    async def on_system_prompt(self, agent: Any, prompt: str) -> str:
        raise RuntimeError(f"{type(self).__name__} does not implement on_system_prompt")

    async def list_tools(self) -> list[Any]:
        """Tools this middleware contributes (``agent_host.tools.Tool`` objects)."""
        return []

    async def get_middleware_key(self) -> str:
        """Names this middleware's slot in ``agent.state.middle_context``."""
        return type(self).__name__

    @classmethod
    def is_implemented(cls, hook: str) -> bool:
        return getattr(cls, hook) is not getattr(MiddlewareBase, hook)

    @classmethod
    def implemented_hooks(cls) -> list[str]:
        return [name for name in HOOKS if cls.is_implemented(name)]

    def subscription(self, hook: str) -> Subscription:
        return self.subscriptions.get(hook, Subscription())
