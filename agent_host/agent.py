"""The ReAct agent: reply -> (compress, reasoning, acting)* rounds, with every hook position a chain.

Behavior follows AgentScope 2.0.11, as described in docs/behaviour.md; comments point at its
sections by anchor. Middleware are layers of ``Chain``s; in-process and remote
layers are mixed freely, the first in the list outermost.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol

from opentelemetry import propagate, trace

from agentmw.chain import Chain, transform
from agentmw.data import (
    RESUME_EVENTS,
    AssistantMsg,
    ChatResponse,
    ContextConfig,
    DataBlock,
    DataBlockDeltaEvent,
    DataBlockEndEvent,
    DataBlockStartEvent,
    ErrorInfo,
    ErrorType,
    ExceedMaxItersEvent,
    ExternalExecutionResultEvent,
    FinishedReason,
    HintBlock,
    HintBlockEvent,
    ModelCallEndEvent,
    ModelCallStartEvent,
    Msg,
    PermissionBehavior,
    PermissionDecision,
    ReplyContext,
    ReplyEndEvent,
    ReplyFinishedReason,
    ReplyStartEvent,
    RequireExternalExecutionEvent,
    RequireUserConfirmEvent,
    Role,
    SystemMsg,
    TextBlock,
    TextBlockDeltaEvent,
    TextBlockEndEvent,
    TextBlockStartEvent,
    ThinkingBlock,
    ThinkingBlockDeltaEvent,
    ThinkingBlockEndEvent,
    ThinkingBlockStartEvent,
    ToolCallBlock,
    ToolCallDeltaEvent,
    ToolCallEndEvent,
    ToolCallStartEvent,
    ToolCallState,
    ToolChoice,
    ToolChunk,
    ToolDescriptor,
    ToolResponse,
    ToolResultBlock,
    ToolResultDataDeltaEvent,
    ToolResultEndEvent,
    ToolResultStartEvent,
    ToolResultState,
    ToolResultTextDeltaEvent,
    Usage,
    UserConfirmResultEvent,
    UserInterruptEvent,
    UserMsg,
    block_text,
    new_id,
)
from agentmw.data.state import AgentState
from agentmw.hooks import HOOKS
from agentmw.tools import INTERRUPTED_TOOL_TEXT, Tool, ToolInputError, Toolkit

from . import metrics
from .models import ChatModel, ModelRegistry
from .models.retry import call_with_fallback
from .reply_grammar import ReplyGrammar, blame_of
from .runtime_state import RuntimeState

log = logging.getLogger("agentmw.agent")

YIELD_EVERY_CHUNKS = 16  # fairness under concurrency costs ~3% CPU on a 1,000-delta reply (bench)
WAITING_MESSAGE = "I'm waiting for your permission or the external execution to finish."
INTERRUPTION_MESSAGE = "I notice the interruption. How can I help you?"
# The result of a tool call in a model output that was cut (finish reason length / content_filter).
_CUT_CALL = (
    "<system-reminder>Not run: the model's output was cut ({reason}) before this call was complete, "
    "so its arguments may be incomplete.</system-reminder>"
)
MAX_ITERS_HINT = (  # AgentScope's wording
    "<system-reminder>You have reached the maximum of {n} reasoning-acting iterations. Summarize the work "
    "and findings so far and return the final answer as text. Do not call any tools.</system-reminder>"
)
EXCEEDED_MESSAGE = "The maximum reasoning-acting iterations are exceeded."
STRUCTURED_OUTPUT_TOOL = "GenerateStructuredOutput"
STRUCTURED_OUTPUT_GRACE_ITERS = 5  # extra rounds a reply owing a structured output may take
STRUCTURED_OUTPUT_SOURCE = '{"label": "System", "sublabel": "Structured Output Requirement"}'
STRUCTURED_OUTPUT_DESCRIPTION = (
    "Generate the required structured output by this tool. Its input schema is the required output. "
    "You MUST end your response by calling it, once you have what you need; its input is sent to the user."
)
TRUNCATED_REMINDER = (
    "<<<TRUNCATED>>><system-reminder>The tool result was {size} bytes; only the first {limit} are kept "
    "here. Ask for a narrower result if you need the rest.</system-reminder>"
)
MAX_ITERS_SOURCE = '{"label": "System", "sublabel": "Max Iterations Reached"}'
# What closing a reply that did not end writes into the context; {cause} says why it did not end.
HOST_STOPPED = "The host stopped"
CUT_OFF = "The reply was interrupted and then cut off"
IN_DOUBT_TOOL_TEXT = (
    "<system-reminder>{cause} while this tool call ran, before its result was recorded: it may or "
    "may not have taken effect. It was not run again.</system-reminder>"
)
NOT_RUN_TOOL_TEXT = "<system-reminder>{cause} before this tool call ran; it was not run.</system-reminder>"
UNENDED_REPLY_TEXT = "<system-reminder>{cause} before this reply ended; the reply was closed.</system-reminder>"
COMPRESSION_PROMPT = (
    "<compress-context>Summarize the conversation above for your future self: the task, the current "
    "state, important discoveries, next steps. Reply with the summary only.</compress-context>"
)


class ReplyError(RuntimeError):
    """A reply cannot go on; the reply ends with ReplyEndEvent(ERROR) carrying this message."""

    error_type = ErrorType.INTERNAL


def implements(layer: Any, hook: str) -> bool:
    """Whether a layer takes part in a hook position (in-process: overrides it; remote: Describe)."""
    check = getattr(layer, "implements", None)
    if check is not None:
        return check(hook)
    return type(layer).is_implemented(hook)


def check_input_messages(inputs: Any) -> list[Msg]:
    """The messages of a new reply, or ReplyError saying why they cannot be one: no system messages,
    no tool calls, tool results or thinking, and the role rules (docs/behaviour.md#reply-loop)."""
    msgs = [] if inputs is None else [inputs] if isinstance(inputs, Msg) else list(inputs)
    for msg in msgs:
        if not isinstance(msg, Msg):
            raise ReplyError(f"reply inputs must be Msg objects, got {type(msg).__name__}")
        if msg.role == Role.SYSTEM:
            raise ReplyError("a reply input cannot be a system message")
        if any(b.type in ("tool_call", "tool_result", "thinking") for b in msg.content):
            raise ReplyError("a reply input cannot carry tool_call, tool_result or thinking blocks")
        try:
            msg.check_role()
        except ValueError as exc:
            raise ReplyError(str(exc)) from None
    return msgs


class ReplyJournal(Protocol):
    """Where the agent makes a reply's progress durable as it goes (the host passes its session
    store's ``Journal``). Each call returns once the step is stored."""

    async def begin_reply(self) -> None: ...  # the user turn is in the state

    async def record_step(self) -> None: ...  # tool decisions / client results are in the state

    async def record_tool_started(self, call_id: str) -> None: ...  # before the tool runs

    async def record_tool_result(self, call_id: str) -> None: ...  # its result is in the state


@dataclass
class _Action:
    kind: str  # "reasoning" | "acting" | "exit"
    tool_choice: ToolChoice | None = None
    hint: HintBlock | None = None
    tool_calls: list[ToolCallBlock] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)
    msg: Msg | None = None


class Agent:
    def __init__(
        self,
        *,
        name: str = "assistant",
        system_prompt: str = "You are a helpful assistant.",
        model: ChatModel | str | None = None,
        models: ModelRegistry | None = None,
        toolkit: Toolkit | None = None,
        middlewares: Sequence[Any] = (),
        state: AgentState | None = None,
        max_iters: int = 10,
        context_config: ContextConfig | None = None,
        description: str = "",
        journal: ReplyJournal | None = None,
        runtime_state: RuntimeState | None = None,
    ) -> None:
        self.name = name
        self.description = description or "No description available"
        self.system_prompt = system_prompt
        self.models = models or ModelRegistry()
        if isinstance(model, ChatModel):
            if model.id not in self.models.entries:
                self.models.add(model)
            self.default_model_id = model.id
        else:
            self.default_model_id = model or self.models.default
        if self.default_model_id is None:
            raise ValueError("the agent needs a model (a ChatModel or a registered model id)")
        self.models.get(self.default_model_id)
        self.toolkit = toolkit or Toolkit()
        self.state = state or AgentState()
        self.default_max_iters = max_iters
        self.context_config = context_config or ContextConfig()
        # The current time told to the model before reasoning (None: off); docs/behaviour.md#runtime-state
        self.runtime_state = runtime_state
        # Where the reply's progress is made durable as it goes (the host's session store).
        self.journal: ReplyJournal = journal or _NoJournal()
        self._receive_reply_end = False
        self._interrupt_requested = False
        self._core_tasks: set[asyncio.Task] = set()  # tasks awaiting core work now (see _interruptible)
        self._cancelled_tasks: set[asyncio.Task] = set()
        self._tool_tasks: set[asyncio.Task] = set()  # concurrent tool calls in flight (see _concurrently)
        self._reply_tools: tuple[ReplyContext, Toolkit] | None = None  # see ``tools``
        self.set_middlewares(middlewares)

    # -- configuration ---------------------------------------------------------------------

    def set_middlewares(self, middlewares: Sequence[Any]) -> None:
        """Filter the list once into per-hook layer lists and build the chains (between replies)."""
        self.middlewares = list(middlewares)
        self.layers = {hook: [m for m in self.middlewares if implements(m, hook)] for hook in HOOKS}
        self._reply_chain = Chain("on_reply", self.layers["on_reply"], self._reply_impl)
        self._reasoning_chain = Chain("on_reasoning", self.layers["on_reasoning"], self._reasoning_impl)
        self._acting_chain = Chain("on_acting", self.layers["on_acting"], self._acting_impl)
        self._permission_chain = Chain(
            "on_check_permission", self.layers["on_check_permission"], self._check_permission_impl
        )
        self._model_chain = Chain("on_model_call", self.layers["on_model_call"], self._model_call_impl)
        self._compress_chain = Chain(
            "on_compress_context", self.layers["on_compress_context"], self._compress_context_impl
        )

    @property
    def tools(self) -> Toolkit:
        """The toolkit of this reply: the agent's, plus the structured-output tool while one is owed
        (built once per reply: it is looked up for every call and schema list)."""
        rc = self.state.reply_context
        if rc.structured_schema is None or rc.structured_output is not None:
            return self.toolkit
        if self._reply_tools is None or self._reply_tools[0] is not rc:
            self._reply_tools = (rc, self.toolkit.overlay(_StructuredOutputTool(rc.structured_schema, self.state)))
        return self._reply_tools[1]

    @property
    def trace_context(self) -> dict[str, str]:
        """The W3C trace context of the current span ("traceparent", ...); empty when not tracing.
        A remote middleware reads the same from its ``agent`` view."""
        carrier: dict[str, str] = {}
        if trace.get_current_span().get_span_context().is_valid:
            propagate.inject(carrier)
        return carrier

    @property
    def max_iters(self) -> int:
        """This reply's limit: a middleware's change (kept with the reply, across a pause) or the default."""
        return self.state.reply_context.max_iters or self.default_max_iters

    @max_iters.setter
    def max_iters(self, value: int) -> None:
        self.state.reply_context.max_iters = value
        self.state.version += 1

    @property
    def model(self) -> ChatModel:
        """The model this reply uses: a middleware's choice (``set_model``) or the default."""
        return self.models.get(self.state.reply_context.model_id or self.default_model_id)

    def set_model(self, model_id: str) -> None:
        """Use a registered model for the rest of this reply (unknown ids raise)."""
        self.models.get(model_id)
        self.state.reply_context.model_id = model_id
        self.state.version += 1

    # -- interruption (docs/behaviour.md#interruption) -------------------------------------------

    def interrupt(self) -> None:
        """Interrupt the reply in progress. Only the in-flight core work (the model stream, the tool
        run) is cancelled, and core work not yet started is skipped; the reply itself goes on to close
        open tool calls and end with ReplyEndEvent(INTERRUPTED), which flows out through every on_reply
        middleware (remote ones too) like any other event."""
        self._interrupt_requested = True
        for task in self._core_tasks - self._cancelled_tasks:
            self._cancelled_tasks.add(task)
            task.cancel()

    async def _interruptible(self, awaitable: Any) -> Any:
        """Await one step of core work so that ``interrupt()`` can cancel exactly that await.

        Like ``asyncio.timeout()``, the cancellation is delivered to the awaiting task only while it
        waits here and is withdrawn (``uncancel``) on the way out, so it never lands in middleware code
        outside the core and the task is not left cancelled. (A child task per step would do the same
        at ~6 µs per streamed chunk, a third of AgentScope's whole per-reply budget.)"""
        if self._interrupt_requested:
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

    # -- reply -------------------------------------------------------------------------------

    async def reply(self, inputs: Any = None, structured_schema: dict | None = None) -> Msg:
        final = None
        async for item in self.reply_stream(inputs, structured_schema):
            if isinstance(item, Msg):
                final = item
        if final is None:
            raise RuntimeError("Agent did not produce a final message.")
        return final

    async def reply_stream(self, inputs: Any = None, structured_schema: dict | None = None) -> AsyncIterator[Any]:
        """Every event of the reply and, last, the final Msg. Failures end the reply with
        ReplyEndEvent(ERROR) and an error Msg instead of raising.

        Every item is checked against the reply grammar (reply_grammar.py); a violation fails the
        reply like an exception. The ReplyEndEvent and what follows it are held back until the
        chain has finished, so a failure after it still ends the reply with ERROR: the client never
        sees a completed end followed by an error. Nothing before the end is held."""
        self._receive_reply_end = False
        grammar = ReplyGrammar(
            self, resuming=isinstance(inputs, RESUME_EVENTS), blame=blame_of(self.layers["on_reply"])
        )
        held: list[Any] = []  # the ReplyEndEvent / final Msg and anything after them
        failure: BaseException | None = None
        try:
            try:
                async with aclosing(
                    self._reply_chain(self, inputs=inputs, structured_schema=structured_schema)
                ) as items:
                    async for item in items:
                        grammar.feed(item)
                        if grammar.closing:
                            self._receive_reply_end = grammar.ended
                            held.append(item)
                        else:
                            yield item
                grammar.finish()
            except Exception as exc:
                quiet = metrics.quiet_failure(exc)  # told by the reply's log line; a host bug gets a traceback
                log.log(
                    logging.DEBUG if quiet else logging.WARNING,
                    "a reply of session %s failed",
                    self.state.session_id,
                    exc_info=True,
                )
                failure = exc
            await self._stop_tool_tasks()  # e.g. a batch left behind by a middleware that raised
            if failure is not None:
                held = [item async for item in self._end_with_error(failure, grammar)]
            for item in held:
                yield item
            if not self.awaiting_calls():  # the reply is over (not parked): its choices end with it
                self.state.reply_context.model_id = None
        finally:
            self._interrupt_requested = False

    async def _stop_tool_tasks(self) -> None:
        tasks = list(self._tool_tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _end_with_error(self, exc: BaseException, grammar: ReplyGrammar) -> AsyncIterator[Any]:
        """The end of a failed reply, well formed whatever the client saw so far (a ReplyStartEvent
        if it saw none, its open blocks closed, one ReplyEndEvent(ERROR), the error Msg); the error
        is stored in the reply's message when the reply had begun (its user message is stored)."""
        error = ErrorInfo(type=getattr(exc, "error_type", ErrorType.INTERNAL), message=f"{type(exc).__name__}: {exc}")
        state = self.state
        grammar.retract()  # the held end / final Msg are dropped: the clean-up continues the stream
        began = grammar.parked or state.reply_id != grammar.previous_reply_id
        if grammar.reply_id is None:  # the client saw no start (e.g. a middleware failed before next)
            start = ReplyStartEvent(
                session_id=state.session_id, reply_id=state.reply_id if began else new_id(), name=self.name
            )
            grammar.feed(start)
            yield start
        reply_id = grammar.reply_id
        for event in self._close_unfinished_tool_calls(
            ToolResultState.ERROR, f"<system-reminder>{error.message}</system-reminder>"
        ):
            if grammar.accepts(event):  # skips what the client's view cannot take (e.g. a forged start)
                yield event
        for event in grammar.closing_events():
            yield event
        if began:  # a failed reply keeps what happened, its error included
            msg = state.append_context(self.name, [TextBlock(text=f"The reply failed: {error.message}")])
            msg.finished_reason, msg.error = ReplyFinishedReason.ERROR, error
        yield ReplyEndEvent(
            session_id=state.session_id, reply_id=reply_id, finished_reason=ReplyFinishedReason.ERROR, error=error
        )
        yield AssistantMsg(
            f"The reply failed: {error.message}",
            name=self.name,
            id=reply_id,
            finished_reason=ReplyFinishedReason.ERROR,
            error=error,
        )

    async def _reply_impl(self, inputs: Any = None, structured_schema: dict | None = None) -> AsyncIterator[Any]:
        state = self.state
        interrupted = False
        try:
            if isinstance(inputs, UserInterruptEvent):  # docs/behaviour.md#interruption
                if self.awaiting_calls():
                    raise asyncio.CancelledError
                return
            if isinstance(inputs, (UserConfirmResultEvent, ExternalExecutionResultEvent)):
                self.check_incoming_event(inputs)
                async for event in self._handle_incoming_event(inputs):
                    yield event
            else:
                self._handle_incoming_messages(inputs)
                state.reply_context = ReplyContext(reply_id=new_id(), structured_schema=structured_schema)
                state.version += 1
                await self.journal.begin_reply()  # the accepted user turn, before anything can happen
                yield ReplyStartEvent(session_id=state.session_id, reply_id=state.reply_id, name=self.name)

            final_msg: Msg | None = None
            made_progress = True
            while True:
                action = self._next_action(final_msg)
                if action.kind == "exit":
                    if not action.events:  # parked on HITL / external execution: no ReplyEndEvent
                        yield action.msg
                        return
                    for event in action.events:
                        yield event
                    if self._receive_reply_end:
                        yield action.msg
                        return
                    # The ReplyEndEvent was swallowed by a middleware: go another round (docs/behaviour.md#reply-loop).
                    if not made_progress:
                        raise ReplyError("the ReplyEndEvent was swallowed twice with no reasoning or acting between")
                    made_progress, final_msg = False, None
                    continue
                made_progress = True
                if action.kind == "reasoning":
                    if action.hint is not None:
                        state.append_context(self.name, [action.hint])
                    await self.compress_context()
                    for event in self._inject_runtime_state():  # on_reply sees it, on_reasoning does not
                        yield event
                    async with aclosing(self._reasoning_chain(self, tool_choice=action.tool_choice)) as items:
                        async for item in items:
                            if isinstance(item, Msg):
                                final_msg = item
                                continue
                            yield item
                            if (
                                isinstance(item, ModelCallEndEvent)
                                and item.finished_reason == FinishedReason.INTERRUPTED
                            ):
                                raise asyncio.CancelledError
                else:
                    async for event in self._acting(action.tool_calls):
                        yield event
                if not self._unanswered_calls():
                    state.cur_iter += 1
        except asyncio.CancelledError:
            interrupted = True
        if interrupted:  # docs/behaviour.md#interruption: cleanup still flows out through every on_reply middleware
            for event in self._close_unfinished_tool_calls(ToolResultState.INTERRUPTED, INTERRUPTED_TOOL_TEXT):
                yield event
            yield ReplyEndEvent(
                session_id=state.session_id, reply_id=state.reply_id, finished_reason=ReplyFinishedReason.INTERRUPTED
            )
            reply_msg = state.reply_message(self.name)
            yield AssistantMsg(
                INTERRUPTION_MESSAGE,
                name=self.name,
                id=state.reply_id,
                usage=reply_msg.usage if reply_msg else None,
                finished_reason=ReplyFinishedReason.INTERRUPTED,
            )

    def _inject_runtime_state(self) -> list[Any]:
        """Append the runtime-state hint when one is due; its HintBlockEvent (docs/behaviour.md#runtime-state)."""
        hint = self.runtime_state.hint(self.state.context) if self.runtime_state is not None else None
        if hint is None:
            return []
        self.state.append_context(self.name, [hint])
        if not self.runtime_state.emit_hint_event:
            return []
        return [HintBlockEvent(reply_id=self.state.reply_id, block_id=hint.id, source=hint.source, hint=hint.hint)]

    def _handle_incoming_messages(self, inputs: Any) -> None:
        for msg in check_input_messages(inputs):
            self.state.context.append(copy.deepcopy(msg))
        self.state.version += 1

    # -- the decision table (docs/behaviour.md#decision-table) ------------------------------------

    def _exit(self, msg: Msg | str, reason: ReplyFinishedReason | None = None, **fields: Any) -> _Action:
        """End the reply with ``msg`` (or an assistant message of that text): ReplyEndEvent, preceded
        by the deprecated ExceedMaxItersEvent when it ends for that. ``reason`` None: COMPLETED, and a
        given message keeps its own finished_reason."""
        state = self.state
        finished = reason or ReplyFinishedReason.COMPLETED
        if isinstance(msg, str):
            msg = AssistantMsg(msg, name=self.name, id=state.reply_id, finished_reason=finished, **fields)
        elif reason is not None:
            msg.finished_reason = reason
        end = ReplyEndEvent(session_id=state.session_id, reply_id=state.reply_id, finished_reason=finished)
        events: list[Any] = [end]
        if end.finished_reason == ReplyFinishedReason.EXCEED_MAX_ITERS:
            events.insert(0, ExceedMaxItersEvent(reply_id=state.reply_id, name=self.name))
        return _Action("exit", events=events, msg=msg)

    def _reply_usage(self) -> Any:
        msg = self.state.reply_message(self.name)
        return copy.copy(msg.usage) if msg is not None and msg.usage is not None else None

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

    def _next_action(self, final_msg: Msg | None) -> _Action:
        state = self.state
        unanswered = self._unanswered_calls()
        awaiting = [c for c in unanswered if c.state in (ToolCallState.ASKING, ToolCallState.SUBMITTED)]
        executable = [
            c
            for c in unanswered
            if c.state == ToolCallState.ALLOWED or (c.state == ToolCallState.PENDING and not awaiting)
        ]
        if executable:
            return _Action("acting", tool_calls=executable)
        if awaiting:
            return _Action("exit", msg=AssistantMsg(WAITING_MESSAGE, name=self.name, id=state.reply_id))
        rc = state.reply_context
        if rc.structured_schema is not None:  # decision table rules 3-4: only the structured output ends it
            if rc.structured_output is not None:
                return self._exit(
                    "The required structured output is generated.",
                    usage=self._reply_usage(),
                    structured_output=copy.deepcopy(rc.structured_output),
                )
            if state.cur_iter >= self.max_iters + STRUCTURED_OUTPUT_GRACE_ITERS:
                return self._exit(
                    EXCEEDED_MESSAGE,
                    ReplyFinishedReason.EXCEED_MAX_ITERS,
                    usage=self._reply_usage(),
                )
            forced = state.cur_iter >= self.max_iters
            suffix = (
                "You have reached the maximum reasoning-acting iterations, so call this tool at once to "
                "generate the final structured output."
                if forced
                else "Call it when you are ready to generate the final structured output."
            )
            hint = HintBlock(
                hint=[
                    TextBlock(
                        text=f"<system-reminder>You're required to generate structured output by calling the "
                        f"'{STRUCTURED_OUTPUT_TOOL}' tool. {suffix}</system-reminder>"
                    )
                ],
                source=STRUCTURED_OUTPUT_SOURCE,
            )
            return _Action(
                "reasoning", hint=hint, tool_choice=ToolChoice(mode=STRUCTURED_OUTPUT_TOOL) if forced else None
            )
        if final_msg is not None:
            exceeded = state.cur_iter > self.max_iters  # the forced final answer
            return self._exit(final_msg, ReplyFinishedReason.EXCEED_MAX_ITERS if exceeded else None)
        if state.cur_iter == self.max_iters:
            hint = HintBlock(hint=MAX_ITERS_HINT.format(n=self.max_iters), source=MAX_ITERS_SOURCE)
            return _Action("reasoning", hint=hint, tool_choice=ToolChoice(mode="none"))
        if state.cur_iter > self.max_iters:
            return self._exit(
                EXCEEDED_MESSAGE,
                ReplyFinishedReason.EXCEED_MAX_ITERS,
            )
        return _Action("reasoning")

    # -- reasoning (docs/behaviour.md#reasoning) ------------------------------------------------

    async def get_system_prompt(self) -> str:
        return await transform("on_system_prompt", self.layers["on_system_prompt"], self, self.system_prompt)

    async def prepare_model_input(self, tool_choice: ToolChoice | None) -> tuple[list[Msg], list[dict]]:
        messages = [SystemMsg(await self.get_system_prompt())]
        if self.state.summary:
            messages.append(UserMsg(self.state.summary))
        messages.extend(self.state.context)
        only = tool_choice.tools if tool_choice is not None else None
        return messages, self.tools.schemas(only)

    async def _reasoning_impl(self, tool_choice: ToolChoice | None = None) -> AsyncIterator[Any]:
        state = self.state
        reply_id = state.reply_id
        messages, tools = await self.prepare_model_input(tool_choice)
        completed: ChatResponse | None = None
        converter = _ChunkConverter(reply_id)
        used = self.model.id
        started = False
        failure: Exception | None = None
        self._model_failures: list[dict[str, Any]] = []  # failed attempts before this call answered
        try:
            result, used = await self._interruptible(self._call_model(messages, tools, tool_choice))
            # Emitted once the call is under way, so it names the model that answers (after any
            # retry or fallback), not merely the one first asked; the failures before it ride along.
            yield ModelCallStartEvent(reply_id=reply_id, model_name=used, metadata=self._call_metadata(used))
            started = True
            if isinstance(result, ChatResponse):
                completed = result
                for event in converter.convert(result):
                    yield event
            else:
                async with aclosing(result) as chunks:
                    count = 0
                    while (chunk := await self._interruptible(anext(chunks, None))) is not None:
                        if chunk.is_last:
                            completed = chunk
                            continue
                        for event in converter.convert(chunk):
                            yield event
                        count += 1
                        if count % YIELD_EVERY_CHUNKS == 0:
                            # A fast model never suspends: let other sessions' replies stream too.
                            await asyncio.sleep(0)
        except asyncio.CancelledError:  # docs/behaviour.md#interruption; the model's partial response, if it sent one
            if not self._interrupt_requested:  # not an interruption (the host is stopping): propagate
                raise
            if completed is None:
                completed = ChatResponse(content=[], finished_reason=FinishedReason.INTERRUPTED)
            if not started:
                yield ModelCallStartEvent(reply_id=reply_id, model_name=used, metadata=self._call_metadata(used))
        except Exception as exc:
            if not started:  # nothing reached the client: the reply fails as before
                raise
            # Failed mid-stream: close what is open, end the call, keep what the user saw (below).
            failure = exc
            completed = getattr(exc, "partial", None) or ChatResponse(content=[])
            completed.finished_reason = FinishedReason.ERROR
        for event in converter.close_all():
            yield event
        if completed is None:
            raise ReplyError(f"model {used!r} returned an empty streaming response")
        usage = completed.usage
        # An interrupted or failed reply stops at the end event, so its partial content is saved before it
        # (docs/behaviour.md#interruption).
        partial = completed.finished_reason in (FinishedReason.INTERRUPTED, FinishedReason.ERROR)
        saved = self._save_to_context(completed) if partial and completed.content else None
        if failure is not None and saved is not None:
            saved.metadata["incomplete"] = {"model": used, "error": f"{type(failure).__name__}: {failure}"}
        metadata = self._call_metadata(used)
        metadata.update({k: v for k, v in completed.metadata.items() if k == "request_id"})
        if failure is not None and getattr(failure, "request_id", ""):
            metadata["request_id"] = failure.request_id
        yield ModelCallEndEvent(
            reply_id=reply_id,
            input_tokens=usage.input_tokens if usage else 0,
            output_tokens=usage.output_tokens if usage else 0,
            cache_input_tokens=usage.cache_input_tokens if usage else 0,
            cache_creation_input_tokens=usage.cache_creation_input_tokens if usage else 0,
            reasoning_tokens=usage.reasoning_tokens if usage else 0,
            finished_reason=completed.finished_reason,
            metadata=metadata,
        )
        if failure is not None:
            raise failure
        if not partial:
            saved = self._save_to_context(completed)
        calls = [b for b in completed.content if isinstance(b, ToolCallBlock)]
        if calls and completed.finished_reason in (FinishedReason.LENGTH, FinishedReason.CONTENT_FILTER):
            # The output was cut: the calls' arguments may be incomplete JSON. Never run them.
            for call in calls:
                for event in self._error_result(
                    call, _CUT_CALL.format(reason=completed.finished_reason), ToolResultState.ERROR
                ):
                    yield event
        thinking_only = bool(completed.content) and all(isinstance(b, ThinkingBlock) for b in completed.content)
        if not partial and not calls and not thinking_only:
            yield AssistantMsg(
                copy.deepcopy(completed.content),
                name=self.name,
                id=reply_id,
                usage=copy.copy(saved.usage) if saved else None,
                finished_reason=ReplyFinishedReason.COMPLETED,
            )

    def _call_metadata(self, used: str) -> dict[str, Any]:
        metadata: dict[str, Any] = {"model": used}
        if self._model_failures:
            metadata["failed_attempts"] = copy.deepcopy(self._model_failures)
        return metadata

    def _save_to_context(self, completed: ChatResponse) -> Msg | None:
        blocks = [
            copy.deepcopy(b)
            for b in completed.content
            if not (isinstance(b, DataBlock) and b.source.media_type.startswith("audio/"))
        ]
        msg = self.state.append_context(self.name, blocks)
        if completed.usage is not None:
            u = completed.usage
            msg.append_usage(
                Usage(
                    input_tokens=u.input_tokens,
                    output_tokens=u.output_tokens,
                    cache_input_tokens=u.cache_input_tokens,
                    cache_creation_input_tokens=u.cache_creation_input_tokens,
                    reasoning_tokens=u.reasoning_tokens,
                )
            )
        return msg

    async def _call_model(
        self, messages: list[Msg], tools: list[dict], tool_choice: ToolChoice | None
    ) -> tuple[Any, str]:
        """Retries with backoff, then the fallbacks, around the whole on_model_call chain (docs/behaviour.md#reasoning;
        the policy is models/retry.py). Each failed attempt is noted for the model-call events."""

        async def attempt(model_id: str) -> tuple[Any, str]:
            self._models_used: list[str] = []
            result = await self._model_chain(
                self, current_model=self.models.get(model_id), messages=messages, tools=tools, tool_choice=tool_choice
            )
            return result, (self._models_used[-1] if self._models_used else model_id)

        (result, used), _ = await call_with_fallback(
            self.models.candidates(self.model.id),
            attempt,
            lambda f: self._model_failures.append(metrics.model_attempt_failed(f)),
        )
        return result, used

    async def _model_call_impl(
        self,
        current_model: Any,
        messages: list[Msg],
        tools: list[dict],
        tool_choice: ToolChoice | None,
        parameters: dict[str, Any] | None = None,
    ) -> Any:
        model = self.models.resolve(current_model)
        self._models_used.append(model.id)
        return await model(messages, tools, tool_choice, parameters)

    # -- acting (docs/behaviour.md#acting) ------------------------------------------------------

    async def _acting(self, tool_calls: list[ToolCallBlock]) -> AsyncIterator[Any]:
        """Run the executable calls batch by batch (docs/behaviour.md#acting): consecutive concurrency-safe calls run
        together, the others one by one. Stop after a batch in which a call parked (confirmation,
        external execution); an interrupted tool ends the reply as INTERRUPTED."""
        for concurrent, batch in self._batches(tool_calls):
            parked = interrupted = False
            events = self._concurrently(batch) if concurrent else self._one_by_one(batch)
            async with aclosing(events) as stream:
                async for event in stream:
                    parked = parked or _parks(event)
                    interrupted = interrupted or _interrupted(event)
                    yield event
            if interrupted:
                raise asyncio.CancelledError
            if parked:
                return

    def _batches(self, calls: list[ToolCallBlock]) -> list[tuple[bool, list[ToolCallBlock]]]:
        batches: list[tuple[bool, list[ToolCallBlock]]] = []
        for call in calls:
            tool = self.tools.get(call.name)
            safe = tool is None or tool.is_concurrency_safe  # an unknown tool only yields an error
            if safe and batches and batches[-1][0]:
                batches[-1][1].append(call)
            else:
                batches.append((safe, [call]))
        return [(safe and len(batch) > 1, batch) for safe, batch in batches]

    async def _one_by_one(self, batch: list[ToolCallBlock]) -> AsyncIterator[Any]:
        for call in batch:
            stop = False
            async for event in self._execute_tool_call(call):
                stop = stop or _parks(event) or _interrupted(event)
                yield event
            if stop:
                return

    async def _concurrently(self, batch: list[ToolCallBlock]) -> AsyncIterator[Any]:
        """Every call of the batch runs to its end; their events come out as they happen."""
        queue: asyncio.Queue[Any] = asyncio.Queue()
        done = object()

        async def run(call: ToolCallBlock) -> None:
            try:
                async with aclosing(self._execute_tool_call(call)) as events:
                    async for event in events:
                        queue.put_nowait(event)
            finally:
                queue.put_nowait(done)

        tasks = [asyncio.create_task(run(call)) for call in batch]
        for task in tasks:  # tracked by the agent too: a reply never ends with tool tasks still running
            self._tool_tasks.add(task)
            task.add_done_callback(self._tool_tasks.discard)
        try:
            remaining = len(tasks)
            while remaining:
                event = await queue.get()
                if event is done:
                    remaining -= 1
                else:
                    yield event
            errors = [t.exception() for t in tasks if t.exception() is not None]
            if errors:
                raise errors[0]
        finally:  # an abandoned batch leaves no task behind to write into the context later
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _execute_tool_call(self, call: ToolCallBlock) -> AsyncIterator[Any]:
        reply_id = self.state.reply_id
        tool = self.tools.get(call.name)
        if tool is None:
            for event in self._error_result(call, f"Error: tool {call.name!r} does not exist.", ToolResultState.ERROR):
                yield event
            return
        try:
            tool_input = tool.validate(call)
        except ToolInputError as exc:
            for event in self._error_result(call, f"Error: {exc}", ToolResultState.ERROR):
                yield event
            return
        decision = await self._permission_chain(
            self, tool_call=copy.deepcopy(call), tool=tool, tool_input=copy.deepcopy(tool_input)
        )
        behavior = getattr(decision, "behavior", None)
        if behavior in (PermissionBehavior.ASK, PermissionBehavior.PASSTHROUGH):
            call.state = ToolCallState.ASKING
            call.suggested_rules = list(decision.suggested_rules)
            self.state.version += 1
            yield RequireUserConfirmEvent(reply_id=reply_id, tool_calls=[copy.deepcopy(call)])
            return
        if behavior == PermissionBehavior.DENY:
            message = decision.message or f"Permission to use {call.name!r} was denied."
            for event in self._error_result(call, message, ToolResultState.DENIED):
                yield event
            return
        if behavior != PermissionBehavior.ALLOW:
            raise ReplyError(f"on_check_permission returned {decision!r}, not a PermissionDecision")
        call.state = ToolCallState.ALLOWED
        yield ToolResultStartEvent(reply_id=reply_id, tool_call_id=call.id, tool_call_name=call.name)
        if tool.is_external_tool:
            call.state = ToolCallState.SUBMITTED
            self.state.version += 1
            yield RequireExternalExecutionEvent(reply_id=reply_id, tool_calls=[copy.deepcopy(call)])
            return
        await self.journal.record_tool_started(call.id)  # after a crash: in doubt, never run again
        response: ToolResponse | None = None
        async with aclosing(self._acting_chain(self, tool_call=call)) as items:
            try:
                while (item := await self._interruptible(anext(items, None))) is not None:
                    if isinstance(item, ToolResponse):
                        response = item
                        break
                    if isinstance(item, ToolChunk):
                        for event in _chunk_events(reply_id, call.id, item):
                            yield event
            except asyncio.CancelledError:  # the tool run was interrupted (docs/behaviour.md#interruption)
                if not self._interrupt_requested:  # e.g. its batch was abandoned: no result of its own
                    raise
                response = ToolResponse(
                    content=[TextBlock(text=INTERRUPTED_TOOL_TEXT)], state=ToolResultState.INTERRUPTED, id=call.id
                )
                yield ToolResultTextDeltaEvent(reply_id=reply_id, tool_call_id=call.id, delta=INTERRUPTED_TOOL_TEXT)
                drain = False
            else:
                drain = response is not None
            if response is None:  # never loop forever on an on_acting that produced no result
                response = ToolResponse(
                    content=[TextBlock(text="Error: the on_acting middleware chain ended without a ToolResponse.")],
                    state=ToolResultState.ERROR,
                    id=call.id,
                )
                yield ToolResultTextDeltaEvent(reply_id=reply_id, tool_call_id=call.id, delta=response.content[0].text)
            task = asyncio.current_task()
            if task is not None and task.cancelling() and not self._interrupt_requested:
                raise asyncio.CancelledError  # its batch was abandoned: the reply ended without this result
            events = self._save_result(call, response.content, response.state, response.metadata)
            await self.journal.record_tool_result(call.id)  # durable before anyone hears of it
            for event in events:
                yield event
            if drain:
                await self._drain_acting(items, call)

    async def _drain_acting(self, items: AsyncIterator[Any], call: ToolCallBlock) -> None:
        """Run the on_acting chain to its end once its result is saved and announced, as AgentScope
        drains it: code after a middleware's loop (a span's end, an audit record) runs, in-process
        and remote alike. A call has one result, the first ToolResponse: items after it are dropped
        (docs/behaviour.md#acting). Middleware code, not core work: an interruption does not cut it."""
        async for item in items:
            log.warning(
                "on_acting yielded a %s after the ToolResponse of call %s (%s): dropped",
                type(item).__name__,
                call.id,
                call.name,
            )

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

    def _error_result(self, call: ToolCallBlock, message: str, state: ToolResultState) -> list[Any]:
        reply_id = self.state.reply_id
        events: list[Any] = []
        if call.state not in (ToolCallState.ALLOWED, ToolCallState.SUBMITTED):  # those already had a Start
            events.append(ToolResultStartEvent(reply_id=reply_id, tool_call_id=call.id, tool_call_name=call.name))
        events.append(ToolResultTextDeltaEvent(reply_id=reply_id, tool_call_id=call.id, delta=message))
        return events + self._save_result(call, message, state, {})

    async def _acting_impl(self, tool_call: ToolCallBlock) -> AsyncIterator[Any]:
        async for item in self.tools.call_tool(tool_call, self.state):
            yield item

    async def _check_permission_impl(
        self, tool_call: ToolCallBlock, tool: Tool, tool_input: dict
    ) -> PermissionDecision:
        if tool_call.state == ToolCallState.ALLOWED:  # the user confirmed it
            return PermissionDecision(behavior=PermissionBehavior.ALLOW)
        for rule in self.state.permission_rules:
            if rule.tool_name == tool_call.name and (rule.rule_content in (None, "", tool_call.input)):
                return PermissionDecision(behavior=rule.behavior, message=f"by rule ({rule.source})")
        if tool.needs_confirmation:
            return PermissionDecision(behavior=PermissionBehavior.ASK, message=f"{tool_call.name} needs confirmation")
        return PermissionDecision(behavior=PermissionBehavior.ALLOW)

    # -- human in the loop (docs/behaviour.md#hitl and #external-execution) ----------------------

    def check_incoming_event(self, event: Any) -> None:
        """Raise ReplyError unless ``event`` (a confirm or execution result) answers waiting tool calls."""
        awaiting = {c.id: c for c in self.awaiting_calls()}
        if not awaiting:
            raise ReplyError(f"{type(event).__name__}: no tool call is waiting for an answer")
        if isinstance(event, UserConfirmResultEvent):
            ids = [r.tool_call.id for r in event.confirm_results]
            wanted = ToolCallState.ASKING
        else:
            ids = [r.id for r in event.execution_results]
            wanted = ToolCallState.SUBMITTED
        bad = [i for i in ids if i not in awaiting or awaiting[i].state != wanted]
        if bad or not ids:
            raise ReplyError(f"{type(event).__name__}: tool call ids {bad or ids} are not awaiting this answer")

    async def _handle_incoming_event(self, event: Any) -> AsyncIterator[Any]:
        calls = {c.id: c for c in self._unanswered_calls()}
        reply_id = self.state.reply_id
        if isinstance(event, UserConfirmResultEvent):
            for result in event.confirm_results:
                call = calls[result.tool_call.id]
                if result.confirmed:
                    call.state = ToolCallState.ALLOWED
                    call.name, call.input = result.tool_call.name, result.tool_call.input
                    self.state.permission_rules.extend(result.rules)
                else:
                    for ev in self._error_result(
                        call,
                        "<system-reminder>The user denied this tool call.</system-reminder>",
                        ToolResultState.DENIED,
                    ):
                        yield ev
            self.state.version += 1
            await self.journal.record_step()  # the decisions: a confirmed call never runs twice
            return
        events: list[Any] = []
        for result in event.execution_results:
            call = calls[result.id]
            events += _output_events(reply_id, call.id, result.output)
            events += self._save_result(call, result.output, result.state, result.metadata)
        await self.journal.record_step()
        for ev in events:
            yield ev

    def close_interrupted_reply(self, in_doubt: frozenset[str] | None, cause: str = HOST_STOPPED) -> None:
        """Close a reply that did not end: its host stopped during it (found OPEN at load), or it was
        cut off. A call started without a recorded result gets an error result saying it may have run
        (it is never run again), any other unanswered call one saying it did not run; the reply's
        message ends with a note. ``in_doubt`` None: every call that was allowed to run may have run."""
        for call in self._unanswered_calls():
            doubtful = call.state == ToolCallState.ALLOWED if in_doubt is None else call.id in in_doubt
            text = IN_DOUBT_TOOL_TEXT if doubtful else NOT_RUN_TOOL_TEXT
            self._save_result(call, text.format(cause=cause), ToolResultState.ERROR, {})
        msg = self.state.append_context(self.name, [TextBlock(text=UNENDED_REPLY_TEXT.format(cause=cause))])
        msg.finished_reason = ReplyFinishedReason.INTERRUPTED
        msg.error = ErrorInfo(type=ErrorType.INTERNAL, message=f"{cause} during the reply")
        self.state.reply_context.model_id = None

    def _close_unfinished_tool_calls(self, state: ToolResultState, text: str) -> list[Any]:
        reply_id = self.state.reply_id
        events: list[Any] = []
        for call in self._unanswered_calls():
            if call.state not in (ToolCallState.ALLOWED, ToolCallState.SUBMITTED):
                events.append(ToolResultStartEvent(reply_id=reply_id, tool_call_id=call.id, tool_call_name=call.name))
            events.append(ToolResultTextDeltaEvent(reply_id=reply_id, tool_call_id=call.id, delta=text))
            events.extend(self._save_result(call, text, state, {}))
        return events

    # -- context compression (docs/behaviour.md#compression) -------------------------------------

    async def compress_context(self, context_config: Any = None, instructions: HintBlock | None = None) -> None:
        await self._compress_chain(self, context_config=context_config, instructions=instructions)

    async def _compress_context_impl(self, context_config: Any = None, instructions: HintBlock | None = None) -> None:
        cfg = context_config or self.context_config
        model = self.model
        messages, _ = await self.prepare_model_input(None)
        if model.count_tokens(messages) < cfg.trigger_ratio * model.context_size:
            return
        context = self.state.context
        keep_budget = cfg.reserve_ratio * model.context_size
        split = len(context) - 1  # the newest message (this reply's) is always kept
        kept = model.count_tokens(context[split:])
        while split > 0 and kept + model.count_tokens(context[split - 1 : split]) <= keep_budget:
            split -= 1
            kept += model.count_tokens(context[split : split + 1])
        if split <= 0:
            return
        old = context[:split]
        prompt = [SystemMsg(COMPRESSION_PROMPT)]
        if self.state.summary:
            prompt.append(UserMsg(f"Earlier summary:\n{self.state.summary}"))
        prompt.extend(old)
        prompt.append(UserMsg(COMPRESSION_PROMPT + (f"\n{block_text([instructions])}" if instructions else "")))
        try:
            stream = await model(prompt, [], ToolChoice(mode="none"))
            summary = ""
            async for chunk in stream:
                if chunk.is_last:
                    summary = block_text(chunk.content)
            if not summary.strip():
                raise ReplyError("the model returned an empty summary")
        except Exception:
            if not cfg.compression_fallback_to_truncation:
                raise
            summary = (self.state.summary + "\n" if self.state.summary else "") + (
                f"({len(old)} earlier messages were truncated.)"
            )
        self.state.summary = summary
        self.state.context = context[split:]
        live = {b.id for m in self.state.context for b in m.content}  # forget owners of summarized blocks
        self.state.block_owners = {k: v for k, v in self.state.block_owners.items() if k in live}
        self.state.version += 1


class _NoJournal:
    """No durable record (an Agent used as a library): every step is a no-op."""

    async def begin_reply(self) -> None:
        pass

    async def record_step(self) -> None:
        pass

    async def record_tool_started(self, call_id: str) -> None:
        pass

    async def record_tool_result(self, call_id: str) -> None:
        pass


class _StructuredOutputTool(Tool):
    """The reply's GenerateStructuredOutput tool: its input, valid against the schema, is the output."""

    def __init__(self, schema: dict, state: AgentState) -> None:
        super().__init__(
            ToolDescriptor(name=STRUCTURED_OUTPUT_TOOL, description=STRUCTURED_OUTPUT_DESCRIPTION, input_schema=schema)
        )
        self.state = state

    async def call(self, tool_input: dict[str, Any], state: Any = None) -> str:
        self.state.reply_context.structured_output = copy.deepcopy(tool_input)
        self.state.version += 1
        return "The structured output is generated."


# -- streaming conversions --------------------------------------------------------------------


class _ChunkConverter:
    """Turns delta ChatResponses into block events (docs/behaviour.md#reasoning); text/thinking event ids are fresh."""

    # (start, delta, end) event classes of the two streamed text-like block kinds, in close order
    _TEXTUAL = {
        "text": (TextBlockStartEvent, TextBlockDeltaEvent, TextBlockEndEvent),
        "thinking": (ThinkingBlockStartEvent, ThinkingBlockDeltaEvent, ThinkingBlockEndEvent),
    }

    def __init__(self, reply_id: str) -> None:
        self.reply_id = reply_id
        self.open_ids: dict[str, str | None] = {"text": None, "thinking": None}
        self.tool_ids: list[str] = []
        self.open_tools: set[str] = set()
        self.tool_args: dict[str, list[str]] = {}  # call id -> its argument pieces, for the end event
        self.data_ids: set[str] = set()

    def _textual(self, kind: str, piece: str, has_data: bool, out: list[Any]) -> None:
        start, delta, end = self._TEXTUAL[kind]
        block_id = self.open_ids[kind]
        if piece:
            if kind == "text" and self.open_ids["thinking"] is not None:  # the answer ends the thinking
                out.append(ThinkingBlockEndEvent(reply_id=self.reply_id, block_id=self.open_ids["thinking"]))
                self.open_ids["thinking"] = None
            if block_id is None:
                block_id = self.open_ids[kind] = new_id()
                out.append(start(reply_id=self.reply_id, block_id=block_id))
            out.append(delta(reply_id=self.reply_id, block_id=block_id, delta=piece))
        elif block_id is not None and not has_data:  # a chunk without this kind closes it
            out.append(end(reply_id=self.reply_id, block_id=block_id))
            self.open_ids[kind] = None

    def convert(self, chunk: ChatResponse) -> list[Any]:
        rid = self.reply_id
        out: list[Any] = []
        has_data = any(isinstance(b, DataBlock) for b in chunk.content)
        thinking = "".join(b.thinking for b in chunk.content if isinstance(b, ThinkingBlock))
        self._textual("thinking", thinking, has_data, out)
        self._textual("text", "".join(b.text for b in chunk.content if isinstance(b, TextBlock)), has_data, out)
        # Tool calls stay open until the model call ends: parallel calls' fragments may interleave,
        # so a chunk without a call does not mean that call is complete.
        for block in chunk.content:
            if isinstance(block, ToolCallBlock):
                if block.id not in self.open_tools and block.id not in self.tool_ids:
                    self.tool_ids.append(block.id)
                    self.open_tools.add(block.id)
                    out.append(ToolCallStartEvent(reply_id=rid, tool_call_id=block.id, tool_call_name=block.name))
                if block.input:
                    self.tool_args.setdefault(block.id, []).append(block.input)
                    out.append(ToolCallDeltaEvent(reply_id=rid, tool_call_id=block.id, delta=block.input))
        for block in chunk.content:
            if isinstance(block, DataBlock) and block.source.type == "base64":
                media_type = block.source.media_type
                if block.id not in self.data_ids:
                    self.data_ids.add(block.id)
                    out.append(
                        DataBlockStartEvent(reply_id=rid, block_id=block.id, media_type=media_type, name=block.name)
                    )
                out.append(
                    DataBlockDeltaEvent(reply_id=rid, block_id=block.id, media_type=media_type, data=block.source.data)
                )
        return out

    def close_all(self) -> list[Any]:
        rid = self.reply_id
        out: list[Any] = []
        for kind, (_, _, end) in self._TEXTUAL.items():
            if self.open_ids[kind] is not None:
                out.append(end(reply_id=rid, block_id=self.open_ids[kind]))
                self.open_ids[kind] = None
        out.extend(
            ToolCallEndEvent(reply_id=rid, tool_call_id=i, metadata={"input": "".join(self.tool_args.get(i, []))})
            for i in self.tool_ids
            if i in self.open_tools
        )
        out.extend(DataBlockEndEvent(reply_id=rid, block_id=i) for i in sorted(self.data_ids))
        self.open_tools.clear()
        self.data_ids.clear()
        return out


def _parks(event: Any) -> bool:
    """The call now waits for the user or the client: its batch is the reply's last for now."""
    return isinstance(event, (RequireUserConfirmEvent, RequireExternalExecutionEvent))


def _interrupted(event: Any) -> bool:
    return isinstance(event, ToolResultEndEvent) and event.state == ToolResultState.INTERRUPTED


def _chunk_events(reply_id: str, call_id: str, chunk: ToolChunk) -> list[Any]:
    out: list[Any] = []
    progress = chunk.metadata.get("mcp_progress")
    if progress is not None:
        from agentmw.data import CustomEvent

        value = {**progress, "reply_id": reply_id, "tool_call_id": call_id}
        out.append(CustomEvent(name="mcp_progress", value=value, reply_id=reply_id))
    out.extend(_output_events(reply_id, call_id, chunk.content))
    return out


def _output_events(reply_id: str, call_id: str, output: Any) -> list[Any]:
    if isinstance(output, str):
        return [ToolResultTextDeltaEvent(reply_id=reply_id, tool_call_id=call_id, delta=output)] if output else []
    out: list[Any] = []
    for block in output:
        if isinstance(block, TextBlock):
            out.append(ToolResultTextDeltaEvent(reply_id=reply_id, tool_call_id=call_id, delta=block.text))
        elif isinstance(block, DataBlock):
            src = block.source
            out.append(
                ToolResultDataDeltaEvent(
                    reply_id=reply_id,
                    tool_call_id=call_id,
                    block_id=block.id,
                    media_type=src.media_type,
                    data=getattr(src, "data", None),
                    url=getattr(src, "url", None),
                )
            )
    return out


__all__ = ["Agent", "ReplyError", "ReplyJournal", "check_input_messages", "implements"]
