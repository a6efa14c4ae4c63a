"""MiddlewareBase: the authoring API, identical in-process and in a remote server.

Subclass it and override any of the hooks with AgentScope's signatures. ``subscriptions``
tells a remote host which items each hook wants to see (and whether it holds them, INTERCEPT,
or only watches them, OBSERVE); an in-process middleware sees every item regardless.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypedDict

from .hooks import HOOKS
from .subscriptions import Mode, Subscription, subscribe

if TYPE_CHECKING:
    from .data import (
        AgentEvent,
        ChatResponse,
        ContextConfig,
        ExternalExecutionResultEvent,
        HintBlock,
        Msg,
        PermissionDecision,
        ToolCallBlock,
        ToolChoice,
        ToolChunk,
        ToolResponse,
        UserConfirmResultEvent,
        UserInterruptEvent,
    )

    AgentEventOrMsg = AgentEvent | Msg

__all__ = [
    "ActingKwargs",
    "CheckPermissionKwargs",
    "CompressContextKwargs",
    "MiddlewareBase",
    "Mode",
    "ModelCallKwargs",
    "ReasoningKwargs",
    "ReplyKwargs",
    "Subscription",
    "subscribe",
]


NextHandler = Callable[..., Any]

# What ``input_kwargs`` holds at each hook (every key is present; None when unset). Edit it in
# place and call a bare ``next_handler()``, or pass overrides as ``next_handler(key=value)``:
# both reach the inner pipeline, in-process and remote alike (the SDK sends the differences from
# what it received as CallNext overrides; a key deleted or set to None is cleared).


class ReplyKwargs(TypedDict):
    """on_reply: the reply's input and the required structured output, if any."""

    inputs: Msg | list[Msg] | UserConfirmResultEvent | ExternalExecutionResultEvent | UserInterruptEvent | None
    structured_schema: dict[str, Any] | None  # JSON schema


class ReasoningKwargs(TypedDict):
    """on_reasoning: one reasoning step."""

    tool_choice: ToolChoice | None  # None: the model chooses


class ActingKwargs(TypedDict):
    """on_acting: one tool call's execution."""

    tool_call: ToolCallBlock


class CheckPermissionKwargs(TypedDict):
    """on_check_permission: the decision for one tool call."""

    tool_call: ToolCallBlock
    tool: Any  # the Tool in-process; its ToolDescriptor (name, description, flags) remotely
    tool_input: dict[str, Any]  # parsed and schema-validated


class ModelCallKwargs(TypedDict):
    """on_model_call: one model call. ``current_model`` is a ``ModelRef``, a snapshot of the
    registered model (in-process and remote alike): editing its ``parameters`` changes this call's
    request parameters, as ``parameters`` does, never the model other calls and sessions use. Override
    it with a registered id, a ModelRef (its ``parameters`` apply too) or, in-process, a model."""

    current_model: Any  # ModelRef (an override: str | ModelRef | model)
    messages: list[Msg]  # the full input: system prompt, summary, context
    tools: list[dict[str, Any]] | None  # OpenAI-style function schemas
    tool_choice: ToolChoice | None
    parameters: dict[str, Any] | None  # this call's request parameters, over the model's


class CompressContextKwargs(TypedDict):
    """on_compress_context: one compression."""

    context_config: ContextConfig
    instructions: HintBlock | None


class MiddlewareBase:
    """Base of every middleware. Unimplemented hooks are skipped with no cost.

    The onion hooks get ``agent`` (the Agent in-process; a view with the same names remotely, see
    agentmw/sdk/view.py), ``input_kwargs`` (a dict, typed per hook below) and
    ``next_handler(**overrides)`` (the inner pipeline; call it zero, one or several times). Code
    after a ``yield`` runs when the consumer asks for the next item, in either place. An exception
    of the inner pipeline reaches a remote middleware as the host's class when the SDK knows it
    (``except ModelError`` works), else as ``InnerPipelineError`` named after the type.
    """

    subscriptions: dict[str, Subscription] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Mistakes in a class's declaration, said where it is defined (in-process as when served):
        ``subscriptions`` that is not hook names mapped to ``subscribe(...)`` (TypeError), and a
        method named like a misspelt hook (a warning: it would never be called)."""
        super().__init_subclass__(**kwargs)
        where = f"{cls.__module__}.{cls.__qualname__}"
        declared = cls.__dict__.get("subscriptions", {})
        if not isinstance(declared, dict):
            raise TypeError(f"{where}.subscriptions: expected a dict of hook name -> subscribe(...)")
        for hook, sub in declared.items():
            if hook not in HOOKS:
                raise TypeError(f"{where}.subscriptions: {hook!r} is not a hook position ({', '.join(HOOKS)})")
            if not isinstance(sub, Subscription):
                raise TypeError(f"{where}.subscriptions[{hook!r}]: expected subscribe(...), got {type(sub).__name__}")
        for name, value in cls.__dict__.items():
            if name.startswith("on_") and name not in HOOKS and callable(value):
                like = difflib.get_close_matches(name, HOOKS, n=1, cutoff=0.8)
                if like:
                    warnings.warn(
                        f"{where}.{name} is not a hook position, so it is never called: {like[0]}?", stacklevel=2
                    )

    async def on_reply(
        self, agent: Any, input_kwargs: ReplyKwargs, next_handler: NextHandler
    ) -> AsyncIterator[AgentEventOrMsg]:
        """A whole reply. ``next_handler()`` yields the reply's events and, last, the final Msg;
        yield what goes outward (forward, rewrite, drop, add events)."""
        raise RuntimeError(f"{type(self).__name__} does not implement on_reply")
        yield  # pragma: no cover

    async def on_reasoning(
        self, agent: Any, input_kwargs: ReasoningKwargs, next_handler: NextHandler
    ) -> AsyncIterator[AgentEventOrMsg]:
        """One reasoning step (a model call and its events). ``next_handler()`` yields events and,
        last, the step's assistant Msg; yield what goes outward."""
        raise RuntimeError(f"{type(self).__name__} does not implement on_reasoning")
        yield  # pragma: no cover

    async def on_acting(
        self, agent: Any, input_kwargs: ActingKwargs, next_handler: NextHandler
    ) -> AsyncIterator[ToolChunk | ToolResponse]:
        """One tool execution. ``next_handler()`` yields ToolChunks and one ToolResponse (last);
        yield chunks and exactly one ToolResponse."""
        raise RuntimeError(f"{type(self).__name__} does not implement on_acting")
        yield  # pragma: no cover

    async def on_check_permission(
        self, agent: Any, input_kwargs: CheckPermissionKwargs, next_handler: NextHandler
    ) -> PermissionDecision:
        """The permission decision for one tool call. ``await next_handler()`` returns the inner
        decision; return a PermissionDecision."""
        raise RuntimeError(f"{type(self).__name__} does not implement on_check_permission")

    async def on_model_call(
        self, agent: Any, input_kwargs: ModelCallKwargs, next_handler: NextHandler
    ) -> ChatResponse | AsyncIterator[ChatResponse]:
        """One model call. ``await next_handler()`` returns the stream of ChatResponse chunks (the
        last one accumulated, ``is_last``); return a stream or one ChatResponse."""
        raise RuntimeError(f"{type(self).__name__} does not implement on_model_call")

    async def on_compress_context(
        self, agent: Any, input_kwargs: CompressContextKwargs, next_handler: NextHandler
    ) -> None:
        """Context compression. ``await next_handler()`` compresses (returns None); return None."""
        raise RuntimeError(f"{type(self).__name__} does not implement on_compress_context")

    async def on_system_prompt(self, agent: Any, prompt: str) -> str:
        """A transformer: gets the previous layer's prompt, returns the whole new prompt."""
        raise RuntimeError(f"{type(self).__name__} does not implement on_system_prompt")

    async def list_tools(self) -> list[Any]:
        """Tools this middleware contributes (``agentmw.tools.Tool`` objects)."""
        return []

    async def get_middleware_key(self) -> str:
        """Names this middleware's slot in ``agent.state.middle_context``."""
        return type(self).__name__

    async def close(self) -> None:
        """Finish work left running in the background (a write-back, a flush): ``serve()`` awaits it
        once, after the last hook call, when the server stops (for up to its grace period); an
        application embedding the class calls it itself. Nothing by default."""

    @classmethod
    def is_implemented(cls, hook: str) -> bool:
        return getattr(cls, hook) is not getattr(MiddlewareBase, hook)

    def implements(self, hook: str) -> bool:
        """Whether this middleware takes part in a hook position (a layer's question, chain.Layer)."""
        return type(self).is_implemented(hook)

    @classmethod
    def implemented_hooks(cls) -> list[str]:
        return [name for name in HOOKS if cls.is_implemented(name)]

    def subscription(self, hook: str) -> Subscription:
        return self.subscriptions.get(hook, Subscription())
