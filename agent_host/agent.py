"""The ReAct agent: reply -> (compress, reasoning, acting)* rounds, with every hook position a chain.

Behavior follows AgentScope 2.0.11, as described in docs/behaviour.md; comments point at its
sections by anchor. Middleware are layers of ``Chain``s; in-process and remote
layers are mixed freely, the first in the list outermost. This module is the reply loop; the
reasoning, acting and compression steps are in their own modules (see ``Agent``).
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opentelemetry import propagate, trace

from agentmw.chain import Chain, Layer, closing
from agentmw.data import (
    RESUME_EVENTS,
    AssistantMsg,
    ContextConfig,
    CustomEvent,
    ErrorInfo,
    ErrorType,
    ExceedMaxItersEvent,
    ExternalExecutionResultEvent,
    FinishedReason,
    HintBlock,
    HintBlockEvent,
    ModelCallEndEvent,
    Msg,
    ReplyContext,
    ReplyEndEvent,
    ReplyFinishedReason,
    ReplyStartEvent,
    Role,
    TextBlock,
    ToolCallBlock,
    ToolCallState,
    ToolChoice,
    ToolResultState,
    UserConfirmResultEvent,
    UserInterruptEvent,
    new_id,
)
from agentmw.data.state import AgentState, checked_max_iters
from agentmw.errors import error_text, exception_error_type, own_cancellation
from agentmw.hooks import HOOKS
from agentmw.tools import INTERRUPTED_TOOL_TEXT, Toolkit
from agentmw.wire import EMITTABLE

from . import metrics
from .acting import CUT_OFF, HOST_STOPPED, NOT_RUN_TOOL_TEXT, Acting
from .agent_base import InputRefused, NoJournal, ReplyError, ReplyJournal
from .compression import Compression
from .models import ChatModel, ModelRegistry
from .reasoning import Reasoning
from .reply_grammar import ReplyGrammar, blame_of
from .runtime_state import RuntimeState
from .structured_output import STRUCTURED_OUTPUT_GRACE_ITERS, STRUCTURED_OUTPUT_SOURCE, STRUCTURED_OUTPUT_TOOL

if TYPE_CHECKING:  # both kinds of layer are chain.Layers: mypy checks it here
    from agentmw.middleware import MiddlewareBase

    from .remote.client import RemoteMiddleware

    _IN_PROCESS: type[Layer] = MiddlewareBase
    _REMOTE: type[Layer] = RemoteMiddleware

log = logging.getLogger("agentmw.agent")

WAITING_MESSAGE = "I'm waiting for your permission or the external execution to finish."
INTERRUPTION_MESSAGE = "I notice the interruption. How can I help you?"
MAX_ITERS_HINT = (  # AgentScope's wording
    "<system-reminder>You have reached the maximum of {n} reasoning-acting iterations. Summarize the work "
    "and findings so far and return the final answer as text. Do not call any tools.</system-reminder>"
)
EXCEEDED_MESSAGE = "The maximum reasoning-acting iterations are exceeded."
MAX_ITERS_SOURCE = '{"label": "System", "sublabel": "Max Iterations Reached"}'


def implements(layer: Layer, hook: str) -> bool:
    """Whether a layer takes part in a hook position (in-process: overrides it; remote: Describe)."""
    return layer.implements(hook)


_PROPAGATED = (GeneratorExit, KeyboardInterrupt, SystemExit)
_REASONING_ITEMS = EMITTABLE["on_reasoning"]  # what a reasoning step may yield (a Msg is taken apart)


def input_messages(inputs: Any) -> list[Any]:
    """The items of a reply's message input as a list (None: none), unchecked."""
    return [] if inputs is None else [inputs] if isinstance(inputs, Msg) else list(inputs)


def check_input_messages(inputs: Any) -> list[Msg]:
    """The messages of a new reply, or ReplyError saying why they cannot be one: no system messages,
    no tool calls, tool results or thinking, and the role rules (docs/behaviour.md#reply-loop)."""
    msgs = input_messages(inputs)
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


@dataclass
class _Action:
    kind: str  # "reasoning" | "acting" | "exit"
    tool_choice: ToolChoice | None = None
    hint: HintBlock | None = None
    tool_calls: list[ToolCallBlock] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)
    msg: Msg | None = None


class Agent(Reasoning, Acting, Compression):
    """The reply loop and its decision table. Its parts are mixins over ``AgentBase`` (agent_base.py):
    reasoning.py (the model call), acting.py (tool execution, answers to parked calls),
    compression.py (context compression); structured_output.py and chunk_events.py serve them."""

    def __init__(
        self,
        *,
        name: str = "assistant",
        system_prompt: str = "You are a helpful assistant.",
        model: ChatModel | str | None = None,
        models: ModelRegistry | None = None,
        toolkit: Toolkit | None = None,
        middlewares: Sequence[Layer] = (),
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
            default_model_id = model or self.models.default
            if default_model_id is None:
                raise ValueError("the agent needs a model (a ChatModel or a registered model id)")
            self.default_model_id = default_model_id
        self.models.get(self.default_model_id)
        self.toolkit = toolkit or Toolkit()
        self.state = state or AgentState()
        self.default_max_iters = checked_max_iters(max_iters)
        self.context_config = context_config or ContextConfig()
        # The current time told to the model before reasoning (None: off); docs/behaviour.md#runtime-state
        self.runtime_state = runtime_state
        # Where the reply's progress is made durable as it goes (the host's session store).
        self.journal: ReplyJournal = journal or NoJournal()
        self._receive_reply_end = False
        self.replies_started = 0  # reply_stream calls: tells one reply from the next (the reply id is set later)
        # Tool results whose ToolResultStartEvent this reply's stream has carried (or the parked one
        # did: results handed out for external execution). Not the call's state: a call the user
        # confirmed is ALLOWED before its Start, and its error result (its edited input invalid,
        # the reply interrupted first) needs one.
        self.results_started: set[str] = set()
        self.interrupted_at: float | None = None  # time.monotonic() of this reply's interrupt()
        self.open_calls: set[Any] = set()  # remote hook calls of this reply now on a stream (told of an interrupt)
        self._core_tasks: set[asyncio.Task] = set()  # tasks awaiting core work now (see _interruptible)
        self._cancelled_tasks: set[asyncio.Task] = set()
        self._tool_tasks: set[asyncio.Task] = set()  # concurrent tool calls in flight (see _concurrently)
        self._reply_tools: tuple[ReplyContext, Toolkit] | None = None  # see ``tools``
        self._bypassed: list[dict[str, str]] | None = None  # the reply's records not sent yet (record_bypass)
        self._input_ids: list[str] = []  # the ids of the messages reply_stream was given (ReplyContext.input_ids)
        self.set_middlewares(middlewares)

    # -- configuration ---------------------------------------------------------------------

    def set_middlewares(self, middlewares: Sequence[Layer]) -> None:
        """Filter the list once into per-hook layer lists and build the chains (between replies)."""
        self.middlewares = list(middlewares)
        self.layers = {hook: [m for m in self.middlewares if implements(m, hook)] for hook in HOOKS}
        self._reply_chain = Chain("on_reply", self.layers["on_reply"], self._reply_impl)
        self._reasoning_chain = Chain("on_reasoning", self.layers["on_reasoning"], self._reasoning_impl)
        self._acting_chain = Chain("on_acting", self.layers["on_acting"], self._acting_impl)
        self._permission_chain = Chain(
            "on_check_permission", self.layers["on_check_permission"], self._check_permission_impl
        )
        self._model_chain = Chain(
            "on_model_call", self.layers["on_model_call"], self._model_call_impl, adapt=self._model_override
        )
        self._compress_chain = Chain(
            "on_compress_context", self.layers["on_compress_context"], self._compress_context_impl
        )

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
        chosen = self.state.reply_context.max_iters
        return self.default_max_iters if chosen is None else chosen  # 0 is a limit (AgentScope)

    @max_iters.setter
    def max_iters(self, value: int) -> None:
        self.state.reply_context.max_iters = checked_max_iters(value)
        self.state.version += 1

    def set_model(self, model_id: str) -> None:
        """Use a registered model for the rest of this reply (unknown ids raise)."""
        self.models.get(model_id)
        self.state.reply_context.model_id = model_id
        self.state.version += 1

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
        if not isinstance(inputs, UserInterruptEvent):  # one that interrupts nothing yields nothing (AgentScope)
            self.check_inputs(inputs)
        # As the caller gave them: an on_reply layer may pass new messages on (ReplyContext.input_ids).
        self._input_ids = [m.id for m in input_messages(inputs)] if isinstance(inputs, Msg | list) else []
        self._receive_reply_end = False
        self.replies_started += 1
        self.results_started = {c.id for c in self._unanswered_calls() if c.state == ToolCallState.SUBMITTED}
        grammar = ReplyGrammar(
            self, resuming=isinstance(inputs, RESUME_EVENTS), blame=blame_of(self.layers["on_reply"])
        )
        held: list[Any] = []  # the ReplyEndEvent / final Msg and anything after them
        failure: BaseException | None = None
        bypassed: list[dict[str, str]] = []  # record_bypass appends, the stream below sends
        self._bypassed = bypassed
        try:
            try:
                async with closing(
                    self._reply_chain(self, inputs=inputs, structured_schema=structured_schema)
                ) as items:
                    async for item in items:
                        if bypassed and grammar.reply_id is not None and not grammar.closing:
                            for event in self._bypass_events(grammar.reply_id):  # before what followed the failure
                                yield event
                        grammar.feed(item)
                        if grammar.closing:
                            self._receive_reply_end = grammar.ended
                            held.append(item)
                        else:
                            yield item
                grammar.finish()
            except BaseException as exc:
                # Whatever a layer raised fails the reply, a BaseException too: a CancelledError
                # that does not cancel this task (a layer awaited a cancelled task, say; the core
                # takes its own as an interruption) would read as a cancellation of the caller, the
                # host's shutdown. The caller's own cancellation, the consumer closing the stream,
                # and a process exit go on.
                if isinstance(exc, _PROPAGATED) or own_cancellation(exc):
                    raise
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
            elif held and grammar.reply_id is not None:  # failures after the end went through: still before it
                held[:0] = self._bypass_events(grammar.reply_id)
            for item in held:
                yield item
            if not self.awaiting_calls():  # the reply is over (not parked): its choices end with it
                self.state.reply_context.model_id = None
        finally:
            self.interrupted_at = None
            self._bypassed = None

    def record_bypass(self, middleware: str, hook: str, error: str) -> None:
        """A fail_open middleware failed in ``hook`` and the reply goes on without it: the reply's
        stream carries one CustomEvent "middleware_bypassed" for it. Whatever the hook, the event
        goes out here, in the stream as the client gets it: after the reply's start (a resumed
        reply has none), before the next item (the end and the final Msg are held until the
        reply is over). Middleware do not see it. Outside a reply there is none to record it in."""
        if self._bypassed is not None:
            self._bypassed.append({"middleware": middleware, "hook": hook, "error": error})

    def _bypass_events(self, reply_id: str) -> list[CustomEvent]:
        """The records not sent yet, as events of reply ``reply_id`` (the grammar allows a
        CustomEvent anywhere between the start and the final Msg: they are not fed to it)."""
        records = self._bypassed or []
        events = [CustomEvent(name="middleware_bypassed", reply_id=reply_id, value=r) for r in records]
        records.clear()
        return events

    async def _stop_tool_tasks(self) -> None:
        tasks = list(self._tool_tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _end_with_error(self, exc: BaseException, grammar: ReplyGrammar) -> AsyncIterator[Any]:
        """The end of a failed reply, well formed whatever the client saw so far (a ReplyStartEvent
        if it saw none, its open blocks closed, one ReplyEndEvent(ERROR), the error Msg); the error
        is stored in the reply's message when the reply had begun (its user message is stored)."""
        error = ErrorInfo(type=exception_error_type(exc) or ErrorType.INTERNAL, message=error_text(exc))
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
        assert reply_id is not None  # the client saw a start, or was given one above
        for event in self._close_unfinished_tool_calls(
            ToolResultState.ERROR, f"<system-reminder>{error.message}</system-reminder>"
        ):
            if grammar.accepts(event):  # skips what the client's view cannot take (e.g. a forged start)
                yield event
        for event in grammar.closing_events():
            yield event
        for event in self._bypass_events(reply_id):
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
                parked = self._parked()
                if parked is not None:
                    raise ReplyError(parked)
                given = self._input_ids if inputs is not None else state.reply_context.input_ids  # a continuation: kept
                self._handle_incoming_messages(inputs)
                state.reply_context = ReplyContext(
                    reply_id=new_id(), structured_schema=structured_schema, input_ids=list(given)
                )
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
                    checked = bool(self.layers["on_reasoning"])  # the core yields nothing else
                    async with closing(self._reasoning_chain(self, tool_choice=action.tool_choice)) as items:
                        async for item in items:
                            if isinstance(item, Msg):
                                final_msg = item
                                continue
                            if checked and type(item) not in _REASONING_ITEMS:  # one lookup per item
                                self.check_yield("on_reasoning", "the reasoning step", item)
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
            # A host stop is not the user's doing: the calls that did not start say so (as after a crash).
            not_run = NOT_RUN_TOOL_TEXT.format(cause=HOST_STOPPED) if self.host_stopping else INTERRUPTED_TOOL_TEXT
            for event in self._close_unfinished_tool_calls(ToolResultState.INTERRUPTED, not_run):
                yield event
            yield ReplyEndEvent(
                session_id=state.session_id, reply_id=state.reply_id, finished_reason=ReplyFinishedReason.INTERRUPTED
            )
            reply_msg = state.reply_message(self.name)
            if reply_msg is not None:  # what it stored so far is marked as cut short (a retry continues it)
                reply_msg.finished_reason = ReplyFinishedReason.INTERRUPTED
                state.version += 1
            yield AssistantMsg(
                INTERRUPTION_MESSAGE,
                name=self.name,
                id=state.reply_id,
                usage=reply_msg.usage if reply_msg else None,
                finished_reason=ReplyFinishedReason.INTERRUPTED,
            )

    def _inject_runtime_state(self) -> list[Any]:
        """Append the runtime-state hint when one is due; its HintBlockEvent (docs/behaviour.md#runtime-state)."""
        runtime_state = self.runtime_state
        hint = runtime_state.hint(self.state.context) if runtime_state is not None else None
        if runtime_state is None or hint is None:
            return []
        self.state.append_context(self.name, [hint])
        if not runtime_state.emit_hint_event:
            return []
        return [HintBlockEvent(reply_id=self.state.reply_id, block_id=hint.id, source=hint.source, hint=hint.hint)]

    def check_inputs(self, inputs: Any) -> None:
        """Raise InputRefused, before anything changes, for inputs that cannot go to this agent now:
        messages that cannot start a reply; a new reply (a message, or no inputs) while tool calls
        wait for their answer (they would be left unanswered); a confirmation or execution result
        that no call waits for.
        AgentScope raises ValueError for these; the host answers INVALID_ARGUMENT or
        FAILED_PRECONDITION. (reply_stream checks; a failure after it ends the reply instead.)"""
        if isinstance(inputs, (UserConfirmResultEvent, ExternalExecutionResultEvent)):
            try:
                self.check_incoming_event(inputs)
            except ReplyError as exc:
                raise InputRefused(str(exc), malformed=False) from None
            return
        if inputs is not None and not isinstance(inputs, (Msg, list, tuple)):
            raise InputRefused(f"cannot reply to {type(inputs).__name__}", malformed=True)
        try:
            check_input_messages(inputs)
        except ReplyError as exc:
            raise InputRefused(str(exc), malformed=True) from None
        parked = self._parked()
        if parked is not None:
            raise InputRefused(parked, malformed=False)

    def _parked(self) -> str | None:
        """Why no new reply may start now, or None: tool calls of a parked reply wait for their
        answer, which a new reply would leave unanswered for good. Asked of the client's inputs
        (check_inputs) and again of what reaches the core, which an on_reply layer may have replaced
        (as AgentScope's _check_incoming_event does in _reply_impl)."""
        awaiting = self.awaiting_calls()
        if not awaiting:
            return None
        names = ", ".join(f"{c.name} ({c.id})" for c in awaiting)
        return (
            f"the reply is parked, waiting on {names}: answer with a UserConfirmResultEvent or "
            "ExternalExecutionResultEvent, or end it with a UserInterruptEvent"
        )

    def _handle_incoming_messages(self, inputs: Any) -> None:
        msgs = check_input_messages(inputs)
        for msg in msgs:
            self.state.context.append(copy.deepcopy(msg))
        # Ids the caller gave that an on_reply layer passed on as other messages: the session took
        # them all the same (a retry of one is known: host._is_retry).
        stored = {m.id for m in msgs}
        self.state.remember_user_ids([i for i in self._input_ids if i not in stored])
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


__all__ = [  # and what other modules and tests import from here since the parts moved out
    "CUT_OFF",
    "HOST_STOPPED",
    "MAX_ITERS_HINT",
    "STRUCTURED_OUTPUT_GRACE_ITERS",
    "STRUCTURED_OUTPUT_TOOL",
    "Agent",
    "InputRefused",
    "ReplyError",
    "ReplyJournal",
    "check_input_messages",
    "implements",
]
