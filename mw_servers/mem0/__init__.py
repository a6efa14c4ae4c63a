"""Mem0Middleware: long-term memory across sessions, backed by mem0 (see docs/mem0.md).

``python -m mw_servers.mem0`` serves it (run it with the mem0 environment, ``make mem0``). Modes:

* ``static``: before each new reply it searches the user's memories for the user's words and, at
  ``ReplyStartEvent``, adds them to the context as a memory hint; after the reply it writes the
  exchange back (awaited before the final message, or in the background);
* ``agent``: the model manages memory itself with the tools ``search_memory`` and ``add_memory``
  (executed here, through ``CallTool``), told how by ``on_system_prompt``; on_reply only notes
  whose memory it is;
* ``both`` (default): all of it.

Memory is scoped by user and agent: the user is the user message's ``metadata["user_id"]``, else
its ``name`` when that is not the generic "user", else the configured default; the agent is the
configured ``agent_id``, else the agent's name. on_reply keeps the scope in its session slot, so
tools (which get the slot with each call) act for the same user. mem0 is synchronous: its calls
run in a worker thread, never on the server's event loop. A failed search or write is logged and
reported to the client as ``CustomEvent("mem0_error")``; the reply goes on.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from agentmw.data import (
    AssistantMsg,
    CustomEvent,
    HintBlock,
    Msg,
    ReplyStartEvent,
    Role,
    ToolDescriptor,
    ToolResultState,
)
from agentmw.middleware import MiddlewareBase, ReplyKwargs, Subscription, subscribe
from agentmw.tools import Tool, ToolOutput, error_response

log = logging.getLogger("agentmw.mem0")

KEY = "mem0"
MODES = ("static", "agent", "both")
ERROR_EVENT = "mem0_error"
HEADER = "## Long-term memory"
INTRO = "Facts remembered from earlier conversations with this user (they may be outdated):"
TOOL_INSTRUCTIONS = (
    "## Long-term memory tools\n"
    "You have a long-term memory that outlives this conversation. Use {prefix}search_memory with short, "
    "targeted keywords to recall what you know about the user before answering questions that depend on it. "
    "Use {prefix}add_memory to save lasting facts, preferences and decisions worth remembering, "
    "each as a standalone sentence."
)
SEARCH_SCHEMA = {
    "type": "object",
    "properties": {
        "keywords": {
            "type": "array",
            "items": {"type": "string"},
            "description": "Short, targeted phrases to search the memory for (one search each).",
        },
        "limit": {"type": "integer", "default": 5, "description": "The most memories to return per keyword."},
    },
    "required": ["keywords"],
}
ADD_SCHEMA = {
    "type": "object",
    "properties": {
        "thinking": {"type": "string", "description": "Why these facts are worth remembering (not saved)."},
        "content": {
            "type": "array",
            "items": {"type": "string"},
            "description": "The facts to remember, each a standalone sentence.",
        },
    },
    "required": ["thinking", "content"],
}
# The hint is one item the host takes at most max_item_bytes of (2 MiB by default): memories stored
# from long messages would make every later reply of their user fail. Each is clipped, and the hint
# holds memories only while it stays under this many characters (at most 4 bytes each in UTF-8).
MAX_MEMORY_CHARS = 4000
MAX_HINT_CHARS = 100_000
MAX_PENDING = 1024  # sessions whose background-write failure waits for their next reply
# Mem0Middleware's options (also ``agentmw:`` in the server's --config file): name -> types taken.
OPTIONS: dict[str, tuple[type, ...]] = {
    "mode": (str,),
    "user_id": (str,),
    "agent_id": (str, type(None)),
    "top_k": (int,),
    "threshold": (int, float, type(None)),
    "scope_by_agent": (bool,),
    "await_write": (bool,),
    "infer": (bool,),
    "tool_prefix": (str,),
    "workers": (int,),
}


def check_option(name: str, value: Any) -> Any:
    """``value`` if Mem0Middleware takes it as its option ``name``, else a ValueError naming it:
    the constructor's check, and the server's of its --config file before mem0 loads."""
    kinds = OPTIONS.get(name)
    if kinds is None:
        raise ValueError(f"unknown option {name!r} (known: {', '.join(OPTIONS)})")
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):  # a bool is an int
        want = " or ".join("null" if kind is type(None) else kind.__name__ for kind in kinds)
        raise ValueError(f"{name} must be {want}, got {type(value).__name__} {value!r}")
    if name == "mode" and value not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {value!r}")
    if name in ("top_k", "workers") and isinstance(value, int) and value < 1:  # (narrowed for mypy)
        raise ValueError(f"{name} must be at least 1, got {value}")
    if name == "user_id" and isinstance(value, str) and (not value.strip() or _SPACE.search(value)):
        raise ValueError(f"user_id must name a user without spaces (mem0 refuses others), got {value!r}")
    return value


class Mem0Middleware(MiddlewareBase):
    """Long-term memory. ``memory`` is a synchronous mem0 ``Memory`` (or anything with its
    ``search(query, filters=, top_k=, threshold=)`` and ``add(messages, user_id=, agent_id=, infer=)``)."""

    def __new__(cls, memory: Any = None, *, mode: str = "both", **kw: Any) -> Mem0Middleware:
        # The host asks for a hook only if the class implements it: static mode gets a subclass
        # without the prompt hook and the tools (no prompt round trips per model call).
        check_option("mode", mode)
        return super().__new__(_mode_class(cls, mode))  # type: ignore[arg-type]  # a class is hashable; mypy checks its instances

    def __init__(
        self,
        memory: Any,
        *,
        mode: str = "both",
        user_id: str = "default",
        agent_id: str | None = None,
        top_k: int = 5,
        threshold: float | None = None,
        scope_by_agent: bool = True,
        await_write: bool = True,
        infer: bool = False,
        tool_prefix: str = "mem0__",
        workers: int = 1,
    ) -> None:
        arguments = locals()  # the options are this signature's keyword arguments
        for name in OPTIONS:
            check_option(name, arguments[name])
        self.memory = memory
        self.mode = mode
        self.user_id, self.agent_id = user_id, agent_id
        self.top_k, self.threshold = top_k, threshold
        self.scope_by_agent, self.await_write, self.infer = scope_by_agent, await_write, infer
        self.instructions = TOOL_INSTRUCTIONS.format(prefix=tool_prefix)
        # One worker by default: Qdrant's local mode and SQLite are not made for concurrent use.
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mem0")
        self.background: set[asyncio.Task[None]] = set()
        self.pending_errors: OrderedDict[str, list[CustomEvent]] = OrderedDict()

    async def get_middleware_key(self) -> str:
        return KEY

    def subscription(self, hook: str) -> Subscription:
        if hook == "on_system_prompt":  # the instructions are fixed: one call serves every step
            return subscribe(cacheable=True)
        if hook != "on_reply":
            return super().subscription(hook)
        if self.mode == "agent":  # on_reply only notes whose memory the tools use
            return subscribe()
        # Held: ReplyStartEvent (the hint must be in the context before reasoning) and, when the
        # write is awaited, the final Msg (written before the client gets it). Nothing else.
        # What runs after a yield (pending error reports) needs nothing from the consumer: run_ahead;
        # nothing follows the inner pipeline's end: done_with_inner (not with an observed Msg).
        if self.await_write:
            return subscribe(intercept=[ReplyStartEvent, Msg], run_ahead=True, done_with_inner=True)
        return subscribe(intercept=[ReplyStartEvent], observe=[Msg], run_ahead=True)

    # -- mem0, off the event loop ----------------------------------------------------------------

    async def _run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, partial(fn, *args, **kwargs))

    async def search(self, query: str, scope: dict[str, str], limit: int) -> list[str]:
        filters = {"user_id": scope["user_id"]}
        if self.scope_by_agent and scope.get("agent_id"):
            filters["agent_id"] = scope["agent_id"]
        kwargs: dict[str, Any] = {"filters": filters, "top_k": limit}
        if self.threshold is not None:
            kwargs["threshold"] = self.threshold
        result = await self._run(self.memory.search, query, **kwargs)
        return [r["memory"] for r in _results(result) if r.get("memory")]

    async def add(self, messages: list[dict[str, str]], scope: dict[str, str]) -> list[dict[str, Any]]:
        kwargs = {"user_id": scope["user_id"], "agent_id": scope.get("agent_id") or None}
        results = _results(await self._run(self.memory.add, messages, infer=self.infer, **kwargs))
        if self.infer and not results:  # the LLM extracted nothing: keep the words as they are
            results = _results(await self._run(self.memory.add, messages, infer=False, **kwargs))
        return results

    def scope(self, agent: Any, inputs: Any) -> dict[str, str]:
        """Whose memories: the session's owner on a host with authentication (what a message
        claims never counts there: a user could read another's); else the user message's
        ``metadata["user_id"]``, its name unless generic, or ``--user-id``."""
        owner = getattr(agent.state, "owner", "")
        user_id = owner or self.user_id
        user = next((m for m in _messages(inputs) if m.role == Role.USER), None)
        if user is not None and not owner:
            named = user.name if user.name.strip() not in ("", "user") else None
            claimed = str(user.metadata.get("user_id") or "").strip()  # blank: as if none (mem0 refuses it)
            user_id = _SPACE.sub("_", (claimed or named or self.user_id).strip())  # "Ada Lovelace": Ada_Lovelace
        return {"user_id": user_id, "agent_id": self.agent_id or getattr(agent, "name", "") or ""}

    def _failure(self, operation: str, scope: dict[str, str], exc: BaseException) -> CustomEvent:
        log.error("mem0 %s failed for user %r: %s: %s", operation, scope.get("user_id"), type(exc).__name__, exc)
        error = f"{type(exc).__name__}: {exc}"
        return CustomEvent(name=ERROR_EVENT, value={"operation": operation, "error": error, **scope})

    # -- hooks -----------------------------------------------------------------------------------

    async def on_reply(self, agent: Any, input_kwargs: ReplyKwargs, next_handler: Any) -> AsyncIterator[Any]:
        inputs = input_kwargs.get("inputs")
        users = [m for m in _messages(inputs) if m.role == Role.USER]
        query = "\n".join(m.text for m in users if m.text.strip()) or None  # mem0 refuses a blank query
        if users:  # a new turn (a resumed reply keeps its scope): the tools act for its user (the slot)
            scope = self.scope(agent, inputs)
            agent.state.middle_context[KEY] = scope
        if query is None or self.mode == "agent":  # a resumed reply, or the model manages memory itself
            async for item in next_handler():
                yield item
            return
        reports = self.pending_errors.pop(agent.state.session_id, [])
        try:
            memories = await self.search(query, scope, self.top_k)
        except Exception as exc:
            memories, reports = [], [*reports, self._failure("search", scope, exc)]
        started = False
        async for item in next_handler():
            if isinstance(item, ReplyStartEvent) and not started:
                started = True
                if memories:  # lands right after the user's message, before any reasoning
                    hint = _hint(memories)
                    agent.state.context.append(AssistantMsg([HintBlock(hint=hint, source=KEY)], name="memory"))
                yield item
                for report in reports:
                    yield report
                reports = []
                continue
            if isinstance(item, Msg) and item.role == Role.ASSISTANT and item.text:
                exchange = [{"role": "user", "content": query}, {"role": "assistant", "content": item.text}]
                if self.await_write:
                    try:
                        await self.add(exchange, scope)
                    except Exception as exc:
                        yield self._failure("add", scope, exc)  # before the final Msg, as the grammar wants
                else:
                    self._write_later(exchange, scope, agent.state.session_id)
            yield item

    def _write_later(self, exchange: list[dict[str, str]], scope: dict[str, str], session_id: str) -> None:
        async def write() -> None:
            try:
                await self.add(exchange, scope)
            except Exception as exc:  # reported at this session's next reply (and logged now)
                self.pending_errors.setdefault(session_id, []).append(self._failure("add", scope, exc))
                while len(self.pending_errors) > MAX_PENDING:
                    self.pending_errors.popitem(last=False)

        task = asyncio.ensure_future(write())
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def close(self) -> None:
        """Let background write-backs finish (a stopping server would drop them: memories lost)."""
        if self.background:
            await asyncio.gather(*self.background, return_exceptions=True)

    async def on_system_prompt(self, agent: Any, prompt: str) -> str:
        return f"{prompt}\n\n{self.instructions}"

    async def list_tools(self) -> list[Any]:
        return [
            _MemoryTool(
                self._search_tool,
                ToolDescriptor(
                    name="search_memory",
                    description="Search your long-term memory of this user for facts related to the keywords.",
                    input_schema=SEARCH_SCHEMA,
                    is_concurrency_safe=True,
                    is_read_only=True,
                ),
                self,
            ),
            _MemoryTool(
                self._add_tool,
                ToolDescriptor(
                    name="add_memory",
                    description="Save facts about this user to your long-term memory, for later conversations.",
                    input_schema=ADD_SCHEMA,
                ),
                self,
            ),
        ]

    # -- tools -----------------------------------------------------------------------------------

    def tool_scope(self, state: Any) -> dict[str, str]:
        """The scope of a tool call: the session's owner first (``scope``: on a host with
        authentication nothing else counts, also where this reply's on_reply did not set the slot,
        a reply resumed after this middleware was attached), then the slot, then ``--user-id``."""
        slot = (state.middle_context.get(KEY) if state is not None else None) or {}
        owner = getattr(state, "owner", "") if state is not None else ""
        user_id = owner or slot.get("user_id") or self.user_id
        return {"user_id": user_id, "agent_id": slot.get("agent_id") or self.agent_id or ""}

    async def _search_tool(self, tool_input: dict[str, Any], scope: dict[str, str]) -> ToolOutput:
        keywords = [k.strip() for k in tool_input.get("keywords") or [] if k.strip()]
        if not keywords:
            return "(no keywords supplied — nothing to search)"
        limit = int(tool_input.get("limit") or 5)
        found = await asyncio.gather(*(self.search(k, scope, limit) for k in keywords))
        unique = list(dict.fromkeys(m for memories in found for m in memories))
        return "\n".join(f"- {m}" for m in unique) if unique else "(no relevant memories found)"

    async def _add_tool(self, tool_input: dict[str, Any], scope: dict[str, str]) -> ToolOutput:
        facts = [f.strip() for f in tool_input.get("content") or [] if f.strip()]
        if not facts:
            return error_response("Error: nothing to remember (content is empty).", "")
        results = await self.add([{"role": "user", "content": f} for f in facts], scope)
        saved = "; ".join(r.get("memory", "") for r in results)
        return f"Remembered {len(results)} item(s) (why: {tool_input.get('thinking', '')}): {saved}"


class _MemoryTool(Tool):
    """A memory tool: runs in this server with the scope of the session it is called for."""

    def __init__(self, run: Callable[..., Any], descriptor: ToolDescriptor, mw: Mem0Middleware) -> None:
        super().__init__(descriptor)
        self.run, self.mw = run, mw

    async def call(self, tool_input: dict[str, Any], state: Any = None) -> ToolOutput:
        scope = self.mw.tool_scope(state)
        try:
            return await self.run(tool_input, scope)
        except Exception as exc:
            event = self.mw._failure(self.descriptor.name, scope, exc)
            return error_response(f"Error: {event.value['error']}", "", ToolResultState.ERROR)


def _messages(inputs: Any) -> list[Msg]:
    if isinstance(inputs, Msg):
        return [inputs]
    if isinstance(inputs, list):
        return [m for m in inputs if isinstance(m, Msg)]
    return []


def _results(result: Any) -> list[dict[str, Any]]:
    """mem0 answers ``{"results": [...]}`` (older versions: a bare list)."""
    items = result.get("results", []) if isinstance(result, dict) else result
    return [r for r in items or [] if isinstance(r, dict)]


_SPACE = re.compile(r"\s+")


def _hint(memories: list[str]) -> str:
    """The hint block's text: memories clipped to MAX_MEMORY_CHARS, as many as fit MAX_HINT_CHARS."""
    lines, size = [HEADER, INTRO], len(HEADER) + len(INTRO)
    for memory in memories:
        line = f"- {memory if len(memory) <= MAX_MEMORY_CHARS else memory[:MAX_MEMORY_CHARS] + ' …'}"
        if size + len(line) > MAX_HINT_CHARS:
            break
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)


@functools.cache
def _mode_class(cls: type[Mem0Middleware], mode: str) -> type[Mem0Middleware]:
    # Resetting a hook to the base's function makes it "not implemented" for the host.
    if mode != "static":
        return cls
    hooks = {h: getattr(MiddlewareBase, h) for h in ("on_system_prompt", "list_tools")}
    return type(f"{cls.__name__}Static", (cls,), hooks)


__all__ = [
    "ADD_SCHEMA",
    "ERROR_EVENT",
    "KEY",
    "MAX_HINT_CHARS",
    "MODES",
    "OPTIONS",
    "SEARCH_SCHEMA",
    "Mem0Middleware",
    "check_option",
]
