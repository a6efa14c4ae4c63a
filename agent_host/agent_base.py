"""What every part of the Agent shares: its attributes, interruptible core work, the model input, and
the reply's tool calls with their results in the context. The parts (reasoning.py, acting.py,
compression.py) are mixins of this base; agent.py puts them together around the ReAct loop."""

from __future__ import annotations

import asyncio
import copy
import time
from typing import Any, Protocol

from agentmw.chain import Chain, Layer, transform
from agentmw.data import (
    ContextConfig,
    ErrorType,
    Msg,
    ReplyContext,
    SystemMsg,
    TextBlock,
    ToolCallBlock,
    ToolCallState,
    ToolChoice,
    ToolResultBlock,
    ToolResultEndEvent,
    ToolResultStartEvent,
    ToolResultState,
    ToolResultTextDeltaEvent,
    UserMsg,
)
from agentmw.data.state import AgentState
from agentmw.tools import Toolkit
from agentmw.wire import EMITTABLE

from .models import ChatModel, ModelRegistry
from .reply_grammar import blame_of
from .structured_output import StructuredOutputTool

# The end of a layer's stream, as ``anext``'s default: not None, which a layer may yield by mistake
# (it must then fail the reply as any item the hook cannot yield, not end the stream quietly).
END: Any = object()

TRUNCATED_REMINDER = (
    "<<<TRUNCATED>>><system-reminder>The tool result was {size} bytes; only the first {limit} are kept "
    "here. Ask for a narrower result if you need the rest.</system-reminder>"
)


class NoJournal:
    """No durable record (an Agent used as a library): every step is a no-op."""

    async def begin_reply(self) -> None:
        pass

    async def record_step(self) -> None:
        pass

    async def record_tool_started(self, call_id: str) -> None:
        pass

    async def record_tool_result(self, call_id: str) -> None:
        pass

    async def check_lease(self) -> None:
        pass


class ReplyError(RuntimeError):
    """A reply cannot go on; the reply ends with ReplyEndEvent(ERROR) carrying this message."""

    error_type = ErrorType.INTERNAL


class InputRefused(ReplyError):
    """Inputs the agent cannot take now, refused before anything changes (Agent.check_inputs):
    ``malformed`` (a message that cannot start a reply), else not now (a message while tool calls
    wait for their answer, an answer no call waits for)."""

    def __init__(self, message: str, *, malformed: bool) -> None:
        super().__init__(message)
        self.malformed = malformed


class ReplyJournal(Protocol):
    """Where the agent makes a reply's progress durable as it goes (the host passes its session
    store's ``Journal``). Each call returns once the step is stored."""

    async def begin_reply(self) -> None: ...  # the user turn is in the state

    async def record_step(self) -> None: ...  # tool decisions / client results are in the state

    async def record_tool_started(self, call_id: str) -> None: ...  # before the tool runs

    async def record_tool_result(self, call_id: str) -> None: ...  # its result is in the state

    async def check_lease(self) -> None: ...  # right before the tool is called: the session is still ours


class AgentBase:
    """The attributes that Agent.__init__ and set_middlewares set (agent.py), declared for the parts."""

    name: str
    system_prompt: str
    models: ModelRegistry
    default_model_id: str
    toolkit: Toolkit
    state: AgentState
    context_config: ContextConfig
    journal: ReplyJournal
    layers: dict[str, list[Layer]]
    results_started: set[str]  # tool results with a ToolResultStartEvent in this reply (Agent.__init__)
    interrupted_at: float | None  # time.monotonic() of the reply's interrupt() (remote layers cut late emits)
    open_calls: set[Any]  # remote hook calls on a stream now (remote.protocol.HookCall): told of an interrupt
    _core_tasks: set[asyncio.Task]
    _cancelled_tasks: set[asyncio.Task]
    _tool_tasks: set[asyncio.Task]
    _reply_tools: tuple[ReplyContext, Toolkit] | None
    _model_failures: list[dict[str, Any]]  # failed attempts before the current model call answered
    _models_used: list[str]
    _reasoning_chain: Chain
    _acting_chain: Chain
    _permission_chain: Chain
    _model_chain: Chain
    _compress_chain: Chain

    @property
    def tools(self) -> Toolkit:
        """The toolkit of this reply: the agent's, plus the structured-output tool while one is owed
        (built once per reply: it is looked up for every call and schema list)."""
        rc = self.state.reply_context
        if rc.structured_schema is None or rc.structured_output is not None:
            return self.toolkit
        if self._reply_tools is None or self._reply_tools[0] is not rc:
            self._reply_tools = (rc, self.toolkit.overlay(StructuredOutputTool(rc.structured_schema, self.state)))
        return self._reply_tools[1]

    @property
    def model(self) -> ChatModel:
        """The model this reply uses: a middleware's choice (``set_model``) or the default."""
        return self.models.get(self.state.reply_context.model_id or self.default_model_id)

    # -- interruption (docs/behaviour.md#interruption) -------------------------------------------

    @property
    def _interrupt_requested(self) -> bool:
        return self.interrupted_at is not None

    @property
    def interrupted(self) -> bool:
        """The reply in progress was interrupted: what is left of it is cleanup. A middleware that
        does something for the listener alone (speech) stops; a remote one's view says the same at
        once (hooks.proto, Interrupted)."""
        return self.interrupted_at is not None

    def interrupt(self) -> None:
        """Interrupt the reply in progress. Only the in-flight core work (the model stream, the tool
        run) is cancelled, and core work not yet started is skipped; the reply itself goes on to close
        open tool calls and end with ReplyEndEvent(INTERRUPTED), which flows out through every on_reply
        middleware (remote ones too) like any other event. Remote middleware in the middle of a call
        are told at once (hooks.proto, Interrupted), as in-process ones see ``interrupted``."""
        if self.interrupted_at is None:
            self.interrupted_at = time.monotonic()
            for call in list(self.open_calls):
                call.notify_interrupted()
        for task in self._core_tasks - self._cancelled_tasks:
            self._cancelled_tasks.add(task)
            task.cancel()

    async def _interruptible(self, awaitable: Any) -> Any:
        """Await one step of core work so that ``interrupt()`` can cancel exactly that await.

        Like ``asyncio.timeout()``, the cancellation is delivered to the awaiting task only while it
        waits here and is withdrawn (``uncancel``) on the way out, so it never lands in middleware code
        outside the core and the task is not left cancelled. (A child task per step would do the same
        at ~6 µs per streamed chunk, a third of AgentScope's whole per-reply budget.)"""
        if self.interrupted_at is not None:  # the attribute, not the property: this runs per chunk
            close = getattr(awaitable, "close", None)
            if close is not None:
                close()
            raise asyncio.CancelledError
        task = asyncio.current_task()
        assert task is not None
        self._core_tasks.add(task)
        try:
            return await awaitable
        finally:
            self._core_tasks.discard(task)
            if task in self._cancelled_tasks:
                self._cancelled_tasks.discard(task)
                task.uncancel()

    # -- the model input (docs/behaviour.md#reasoning) ------------------------------------------

    async def get_system_prompt(self) -> str:
        return await transform("on_system_prompt", self.layers["on_system_prompt"], self, self.system_prompt)

    async def prepare_model_input(self, tool_choice: ToolChoice | None) -> tuple[list[Msg], list[dict]]:
        messages = [SystemMsg(await self.get_system_prompt())]
        if self.state.summary:
            messages.append(UserMsg(self.state.summary))
        messages.extend(self.state.context)
        only = tool_choice.tools if tool_choice is not None else None
        return messages, self.tools.schemas(only)

    # -- the reply's tool calls and their results in the context --------------------------------

    def _tool_calls(self) -> tuple[list[ToolCallBlock], set[str]]:
        msg = self.state.reply_message(self.name)
        if msg is None:
            return [], set()
        calls = [b for b in msg.content if isinstance(b, ToolCallBlock)]
        answered = {b.id for b in msg.content if isinstance(b, ToolResultBlock)}
        return calls, answered

    def _unanswered_calls(self) -> list[ToolCallBlock]:
        calls, answered = self._tool_calls()
        return [c for c in calls if c.id not in answered]

    def awaiting_calls(self) -> list[ToolCallBlock]:
        """The unanswered tool calls waiting for a user confirmation or an external execution result."""
        return [c for c in self._unanswered_calls() if c.state in (ToolCallState.ASKING, ToolCallState.SUBMITTED)]

    def _save_result(self, call: ToolCallBlock, output: Any, state: ToolResultState, metadata: dict) -> list[Any]:
        output = self._truncate(copy.deepcopy(output))
        result = ToolResultBlock(id=call.id, name=call.name, output=output, state=state, metadata=dict(metadata))
        self.state.append_context(self.name, [result])
        call.state = ToolCallState.FINISHED
        return [
            ToolResultEndEvent(reply_id=self.state.reply_id, tool_call_id=call.id, state=state, metadata=dict(metadata))
        ]

    def _truncate(self, output: Any) -> Any:
        """Keep a tool result within ``tool_result_limit`` tokens (≈ 4 bytes each) in the context,
        with a reminder that the rest was cut (docs/behaviour.md#acting); the client's events carry it all."""
        limit = self.context_config.tool_result_limit * 4
        blocks = [TextBlock(text=output)] if isinstance(output, str) else output
        size = sum(len(b.text.encode()) for b in blocks if isinstance(b, TextBlock))
        if size <= limit:
            return output
        kept: list[Any] = []
        budget = limit
        for block in blocks:
            if isinstance(block, TextBlock):
                text = block.text.encode()[: max(budget, 0)].decode(errors="ignore")
                budget -= len(text.encode())
                if text:
                    kept.append(TextBlock(text=text, id=block.id))
            else:
                kept.append(block)
        kept.append(TextBlock(text=TRUNCATED_REMINDER.format(size=size, limit=limit)))
        return kept

    def check_yield(self, hook: str, what: str, item: Any) -> None:
        """A layer of ``hook`` yields only what that position takes (wire.EMITTABLE): anything else
        fails the reply naming the layers, as a remote layer's emit of it is a protocol violation."""
        if type(item) not in EMITTABLE[hook]:
            blame = blame_of(self.layers[hook], hook)
            raise ReplyError(f"{what} broke the hook contract ({blame}): {hook} cannot yield {type(item).__name__}")

    def _error_result(self, call: ToolCallBlock, message: str, state: ToolResultState) -> list[Any]:
        events = self._result_start(call)
        events.append(ToolResultTextDeltaEvent(reply_id=self.state.reply_id, tool_call_id=call.id, delta=message))
        return events + self._save_result(call, message, state, {})

    def _result_start(self, call: ToolCallBlock) -> list[Any]:
        """The call's ToolResultStartEvent unless this reply (or its parked half) already had it."""
        if call.id in self.results_started:
            return []
        self.results_started.add(call.id)
        return [ToolResultStartEvent(reply_id=self.state.reply_id, tool_call_id=call.id, tool_call_name=call.name)]

    def _close_unfinished_tool_calls(self, state: ToolResultState, text: str) -> list[Any]:
        return [event for call in self._unanswered_calls() for event in self._error_result(call, text, state)]
