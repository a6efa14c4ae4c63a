"""Acting (docs/behaviour.md#acting): tool execution batch by batch through the permission and
on_acting chains; the answers to parked calls (confirmation, external execution); closing a reply
that did not end."""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from agentmw.chain import closing
from agentmw.data import (
    ErrorInfo,
    ErrorType,
    PermissionBehavior,
    PermissionDecision,
    ReplyFinishedReason,
    RequireExternalExecutionEvent,
    RequireUserConfirmEvent,
    TextBlock,
    ToolCallBlock,
    ToolCallState,
    ToolResponse,
    ToolResultEndEvent,
    ToolResultStartEvent,
    ToolResultState,
    ToolResultTextDeltaEvent,
    UserConfirmResultEvent,
)
from agentmw.tools import INTERRUPTED_TOOL_TEXT, Tool, ToolInputError

from .agent_base import END, AgentBase, ReplyError
from .chunk_events import tool_chunk_events, tool_output_events
from .reply_grammar import blame_of

log = logging.getLogger("agentmw.agent")

# What closing a reply that did not end writes into the context; {cause} says why it did not end.
HOST_STOPPED = "The host stopped"
CUT_OFF = "The reply was interrupted and then cut off"
IN_DOUBT_TOOL_TEXT = (
    "<system-reminder>{cause} while this tool call ran, before its result was recorded: it may or "
    "may not have taken effect. It was not run again.</system-reminder>"
)
NOT_RUN_TOOL_TEXT = "<system-reminder>{cause} before this tool call ran; it was not run.</system-reminder>"
UNENDED_REPLY_TEXT = "<system-reminder>{cause} before this reply ended; the reply was closed.</system-reminder>"


class Acting(AgentBase):
    # The interrupt comes from the host stopping (Host.close), not from the user: a tool cut short
    # is then said to have maybe taken effect, as after a crash, not to have been stopped by the user.
    host_stopping: bool = False

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

    async def _one_by_one(self, batch: list[ToolCallBlock]) -> AsyncGenerator[Any, None]:
        for call in batch:
            stop = False
            async for event in self._execute_tool_call(call):
                stop = stop or _parks(event) or _interrupted(event)
                yield event
            if stop:
                return

    async def _concurrently(self, batch: list[ToolCallBlock]) -> AsyncGenerator[Any, None]:
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
            errors = [exc for t in tasks if (exc := t.exception()) is not None]
            if errors:
                raise errors[0]
        finally:  # an abandoned batch leaves no task behind to write into the context later
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _execute_tool_call(self, call: ToolCallBlock) -> AsyncGenerator[Any, None]:
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
            if call.state == ToolCallState.ALLOWED:  # asked again, as AgentScope does: said, since it never ends
                log.warning(
                    "session=%s: tool call %s (%s) was confirmed by the user and is asked for again (%s): a "
                    "permission middleware must let a confirmed call (tool_call.state ALLOWED) through",
                    self.state.session_id,
                    call.id,
                    call.name,
                    blame_of(self.layers["on_check_permission"], "on_check_permission"),
                )
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
        self.results_started.add(call.id)
        yield ToolResultStartEvent(reply_id=reply_id, tool_call_id=call.id, tool_call_name=call.name)
        if tool.is_external_tool:
            call.state = ToolCallState.SUBMITTED
            self.state.version += 1
            yield RequireExternalExecutionEvent(reply_id=reply_id, tool_calls=[copy.deepcopy(call)])
            return
        await self.journal.record_tool_started(call.id)  # after a crash: in doubt, never run again
        response: ToolResponse | None = None
        async with closing(self._acting_chain(self, tool_call=call)) as items:
            try:
                # The end is a marker of its own: a layer that yields None breaks the contract (below).
                while (item := await self._interruptible(anext(items, END))) is not END:
                    if isinstance(item, ToolResponse):
                        response = item
                        break
                    if self._interrupt_requested and getattr(item, "state", None) == ToolResultState.INTERRUPTED:
                        # The toolkit's own end of the cancelled run: the interruption's text is
                        # streamed once, below, not once from here and once from there.
                        raise asyncio.CancelledError
                    self.check_yield("on_acting", "the tool call", item)
                    for event in tool_chunk_events(reply_id, call.id, item):
                        yield event
            except asyncio.CancelledError:  # the tool run was interrupted (docs/behaviour.md#interruption)
                if not self._interrupt_requested:  # e.g. its batch was abandoned: no result of its own
                    raise
                text = IN_DOUBT_TOOL_TEXT.format(cause=HOST_STOPPED) if self.host_stopping else INTERRUPTED_TOOL_TEXT
                response = ToolResponse(content=[TextBlock(text=text)], state=ToolResultState.INTERRUPTED, id=call.id)
                yield ToolResultTextDeltaEvent(reply_id=reply_id, tool_call_id=call.id, delta=text)
                drain = False
            else:
                drain = response is not None
            if response is None:  # never loop forever on an on_acting that produced no result
                error = TextBlock(text="Error: the on_acting middleware chain ended without a ToolResponse.")
                response = ToolResponse(content=[error], state=ToolResultState.ERROR, id=call.id)
                yield ToolResultTextDeltaEvent(reply_id=reply_id, tool_call_id=call.id, delta=error.text)
            task = asyncio.current_task()
            if task is not None and task.cancelling() and not self._interrupt_requested:
                raise asyncio.CancelledError  # its batch was abandoned: the reply ended without this result
            events = self._save_result(call, response.content, response.state, response.metadata)
            try:
                await self.journal.record_tool_result(call.id)  # durable before anyone hears of it
            except asyncio.CancelledError:
                # Cut off while the write was slow (it goes on, shielded): the result is the
                # reply's already, so its end goes out before the reply's, which would else find
                # the result open (the call counts as answered, so nothing else ends it).
                for event in events:
                    yield event
                raise
            for event in events:
                yield event
            if drain:
                await self._drain_acting(items, call)

    async def _drain_acting(self, items: AsyncIterator[Any], call: ToolCallBlock) -> None:
        """Run the on_acting chain to its end once its result is saved and announced, as AgentScope
        drains it: code after a middleware's loop (a span's end, an audit record) runs, in-process
        and remote alike. A call has one result, the first ToolResponse: tool items after it are
        dropped, any other item fails the reply as before it (docs/behaviour.md#acting). Middleware
        code, not core work: an interruption does not cut it."""
        async for item in items:
            self.check_yield("on_acting", "the tool call", item)
            log.warning(
                "on_acting yielded a %s after the ToolResponse of call %s (%s): dropped",
                type(item).__name__,
                call.id,
                call.name,
            )

    async def _acting_impl(self, tool_call: ToolCallBlock) -> AsyncIterator[Any]:
        # The start was recorded before the on_acting chain, which may have held the call past the
        # lease: a host whose session another host took over since (and closed this call as "may
        # or may not have taken effect") must not run the tool now. Without a layer nothing held
        # it: recording the start has just renewed the lease (one store round trip fewer).
        if self.layers["on_acting"]:
            await self.journal.check_lease()
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

    def check_incoming_event(self, event: Any) -> None:
        """Raise ReplyError unless ``event`` (a confirm or execution result) answers waiting tool calls
        of the parked reply, each once. Call ids alone do not say which reply: a model may use an
        id again in a later reply (after a host restart, the offline model does), and an old
        confirmation sent again would then run the old call's input in its place."""
        name = type(event).__name__
        awaiting = {c.id: c for c in self.awaiting_calls()}
        if not awaiting:
            raise ReplyError(f"{name}: no tool call is waiting for an answer")
        self.check_reply_id(event)
        if isinstance(event, UserConfirmResultEvent):
            ids = [r.tool_call.id for r in event.confirm_results]
            wanted = ToolCallState.ASKING
        else:
            ids = [r.id for r in event.execution_results]
            wanted = ToolCallState.SUBMITTED
        bad = [i for i in ids if i not in awaiting or awaiting[i].state != wanted]
        if bad or not ids:
            raise ReplyError(f"{name}: tool call ids {bad or ids} are not awaiting this answer")
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice:
            raise ReplyError(f"{name}: tool call ids {twice} are answered more than once")

    def check_reply_id(self, event: Any) -> None:
        """Raise ReplyError when a resumption event (a confirmation, an execution result, an
        interrupt) names another reply than the parked one (an unset reply_id names none)."""
        if event.reply_id and event.reply_id != self.state.reply_id:
            parked = self.state.reply_id
            raise ReplyError(f"{type(event).__name__}: reply {event.reply_id} is not the parked one ({parked})")

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
            events += tool_output_events(reply_id, call.id, result.output)
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


def _parks(event: Any) -> bool:
    """The call now waits for the user or the client: its batch is the reply's last for now."""
    return isinstance(event, (RequireUserConfirmEvent, RequireExternalExecutionEvent))


def _interrupted(event: Any) -> bool:
    return isinstance(event, ToolResultEndEvent) and event.state == ToolResultState.INTERRUPTED
