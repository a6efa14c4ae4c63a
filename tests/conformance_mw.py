"""Middleware used by the conformance suite: each runs in the host's process and, unchanged, in a
separate process served by ``serve()`` (``python -m agentmw.sdk tests.conformance_mw:Class``)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from agentmw.data import (
    AssistantMsg,
    ChatResponse,
    CustomEvent,
    DataBlockDeltaEvent,
    DataBlockEndEvent,
    DataBlockStartEvent,
    ErrorType,
    HintBlock,
    ModelCallEndEvent,
    ModelRef,
    Msg,
    ReplyEndEvent,
    ReplyStartEvent,
    TextBlock,
    TextBlockDeltaEvent,
    TextBlockEndEvent,
    TextBlockStartEvent,
    ToolChoice,
    ToolChunk,
    ToolResponse,
    UserMsg,
)
from agentmw.errors import ModelError, UnknownModelError
from agentmw.middleware import MiddlewareBase, Mode, subscribe
from agentmw.tools import tool


class PassThrough(MiddlewareBase):
    """Every hook, changing nothing."""

    async def on_reply(self, agent, input_kwargs, next_handler):
        async for item in next_handler(**input_kwargs):
            yield item

    async def on_reasoning(self, agent, input_kwargs, next_handler):
        async for item in next_handler():
            yield item

    async def on_acting(self, agent, input_kwargs, next_handler):
        async for item in next_handler():
            yield item

    async def on_check_permission(self, agent, input_kwargs, next_handler):
        return await next_handler()

    async def on_model_call(self, agent, input_kwargs, next_handler):
        return await next_handler()

    async def on_compress_context(self, agent, input_kwargs, next_handler):
        await next_handler()

    async def on_system_prompt(self, agent, prompt):
        return prompt


class Override(MiddlewareBase):
    """Overrides kwargs: tool_choice in on_reasoning (in place, AgentScope style), messages in on_model_call."""

    async def on_reasoning(self, agent, input_kwargs, next_handler):
        input_kwargs["tool_choice"] = ToolChoice(mode="none")
        async for item in next_handler():
            yield item

    async def on_model_call(self, agent, input_kwargs, next_handler):
        messages = [*input_kwargs["messages"], UserMsg("the override speaks")]
        return await next_handler(messages=messages)


class ModelFallback(MiddlewareBase):
    """The docs' ModelFallbackMiddleware: call next again with another model id when it fails."""

    def __init__(self, fallback: str = "backup") -> None:
        self.fallback = fallback

    async def on_model_call(self, agent, input_kwargs, next_handler):
        try:
            return await next_handler()
        except Exception:
            return await next_handler(current_model=self.fallback)


class ShortCircuitReasoning(MiddlewareBase):
    """Answers without calling the model."""

    async def on_reasoning(self, agent, input_kwargs, next_handler):
        yield CustomEvent(name="short_circuit", value={"iter": agent.state.cur_iter})
        yield AssistantMsg("canned answer", name=agent.name, id=agent.state.reply_id)


class ShortCircuitActing(MiddlewareBase):
    """Answers a tool call without running the tool."""

    async def on_acting(self, agent, input_kwargs, next_handler):
        call = input_kwargs["tool_call"]
        yield ToolChunk(content=[TextBlock(text="stubbed ")])
        yield ToolResponse(content=[TextBlock(text=f"stubbed {call.name}")], id=call.id)


class SwallowFirstEnd(MiddlewareBase):
    """Swallows the first ReplyEndEvent of a reply, forcing another round (count kept in its slot)."""

    subscriptions = {"on_reply": subscribe(intercept=[ReplyEndEvent, ReplyStartEvent])}

    async def on_reply(self, agent, input_kwargs, next_handler):
        key = await self.get_middleware_key()
        async for item in next_handler():
            if isinstance(item, ReplyStartEvent):
                agent.state.middle_context[key] = {"swallowed": 0}
            if isinstance(item, ReplyEndEvent) and agent.state.middle_context[key]["swallowed"] == 0:
                agent.state.middle_context[key]["swallowed"] += 1
                continue
            yield item


class InjectAfterText(MiddlewareBase):
    """Injects an event after every TextBlockEndEvent."""

    subscriptions = {"on_reply": subscribe(intercept=[TextBlockEndEvent])}

    async def on_reply(self, agent, input_kwargs, next_handler):
        async for item in next_handler():
            yield item
            if isinstance(item, TextBlockEndEvent):
                yield CustomEvent(name="after_text", value={"block": item.block_id})


class PromptTag(MiddlewareBase):
    """Appends its tag to the system prompt."""

    def __init__(self, tag: str = "A") -> None:
        self.tag = tag

    async def on_system_prompt(self, agent, prompt):
        return f"{prompt} +{self.tag}"

    async def get_middleware_key(self) -> str:
        return f"PromptTag{self.tag}"


class PromptNote(MiddlewareBase):
    """Appends its note to the system prompt, declared cacheable: the answer depends on the input
    prompt alone, so the host asks once and reuses it (until it describes the server again)."""

    subscriptions = {"on_system_prompt": subscribe(cacheable=True)}

    def __init__(self, note: str = "noted") -> None:
        self.note = note

    async def on_system_prompt(self, agent, prompt):
        return f"{prompt} +{self.note}"


class PromptBySlot(MiddlewareBase):
    """Appends the name in its own slot to the system prompt, declared cacheable: the answer depends
    on the input prompt and its slot alone, so the host reuses it only for the same slot."""

    subscriptions = {"on_system_prompt": subscribe(cacheable=True)}

    async def get_middleware_key(self) -> str:
        return "by_slot"

    async def on_system_prompt(self, agent, prompt):
        slot = agent.state.middle_context.get("by_slot") or {}
        return f"{prompt} +{slot.get('who', 'nobody')}"


@tool(description="Shout a text back in capitals.", is_read_only=True)
def shout(text: str) -> str:
    return text.upper() + "!"


class Tools(MiddlewareBase):
    """Contributes a tool through list_tools."""

    async def list_tools(self):
        return [shout]


@tool(description="Takes its time.", is_read_only=True)
async def dawdle(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return "done at last"


class SlowTools(Tools):
    """Tools' tool and one that takes as long as it is told."""

    async def list_tools(self):
        return [shout, dawdle]


class PlainIterator:
    """An async iterator over ``inner`` that is not a generator: it has no aclose."""

    def __init__(self, inner):
        self.inner = inner

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await anext(self.inner)


class ReturnsPlainIterators(MiddlewareBase):
    """Passes every stream on wrapped in a PlainIterator instead of yielding from it (in-process:
    a hook returns an async iterator, not necessarily an async generator)."""

    def on_reply(self, agent, input_kwargs, next_handler):
        return PlainIterator(next_handler())

    def on_reasoning(self, agent, input_kwargs, next_handler):
        return PlainIterator(next_handler())

    def on_acting(self, agent, input_kwargs, next_handler):
        return PlainIterator(next_handler())

    async def on_model_call(self, agent, input_kwargs, next_handler):
        result = await next_handler()
        return result if isinstance(result, ChatResponse) else PlainIterator(result)


class SlotAcrossHooks(MiddlewareBase):
    """Writes its slot in on_reply at ReplyStart; on_reasoning of the same reply reads it."""

    subscriptions = {"on_reply": subscribe(intercept=[ReplyStartEvent])}

    async def on_reply(self, agent, input_kwargs, next_handler):
        key = await self.get_middleware_key()
        async for item in next_handler():
            if isinstance(item, ReplyStartEvent):
                agent.state.middle_context[key] = {item.reply_id: "marked at reply start"}
            yield item

    async def on_reasoning(self, agent, input_kwargs, next_handler):
        key = await self.get_middleware_key()
        seen = agent.state.middle_context.get(key, {}).get(agent.state.reply_id)
        yield CustomEvent(name="slot_seen", value={"value": seen, "iter": agent.state.cur_iter})
        async for item in next_handler():
            yield item


class ActingWithoutResponse(MiddlewareBase):
    """Forwards tool chunks but drops the ToolResponse: the host must turn that into a tool error."""

    async def on_acting(self, agent, input_kwargs, next_handler):
        async for item in next_handler():
            if isinstance(item, ToolChunk):
                yield item


class Budget(MiddlewareBase):
    """A token budget in the spirit of AgentScope's ReplyBudgetControlMiddleware: counts usage on
    ModelCallEndEvent (intercepted, so the count lands before the next step), and once over budget
    appends a hint and forbids tools."""

    subscriptions = {"on_reply": subscribe(intercept=[ReplyStartEvent, ModelCallEndEvent])}

    def __init__(self, token_budget: float = 10) -> None:
        self.token_budget = token_budget

    async def on_reply(self, agent, input_kwargs, next_handler):
        key = await self.get_middleware_key()
        async for item in next_handler():
            if isinstance(item, ReplyStartEvent):
                agent.state.middle_context[key] = {item.reply_id: 0}
            elif isinstance(item, ModelCallEndEvent):
                agent.state.middle_context[key][item.reply_id] += item.input_tokens + item.output_tokens
            yield item

    async def on_reasoning(self, agent, input_kwargs, next_handler):
        key = await self.get_middleware_key()
        used = agent.state.middle_context.get(key, {}).get(agent.state.reply_id, 0)
        if used >= self.token_budget:
            agent.state.append_to_last_assistant(agent.name, [HintBlock(hint="Budget spent: answer now.")])
            input_kwargs["tool_choice"] = ToolChoice(mode="none")
        async for item in next_handler(**input_kwargs):
            yield item


class ObserveCounter(MiddlewareBase):
    """Observes every item of on_reply (never holds the pipeline) and records what it saw."""

    subscriptions = {"on_reply": subscribe(default=Mode.OBSERVE)}

    async def on_reply(self, agent, input_kwargs, next_handler):
        kinds: dict[str, int] = {}
        async for item in next_handler():
            kinds[type(item).__name__] = kinds.get(type(item).__name__, 0) + 1
            yield item
        agent.state.middle_context[await self.get_middleware_key()] = kinds


class EndOnlyCounter(MiddlewareBase):
    """Subscribed to ReplyEndEvent and Msg only: everything else must bypass it."""

    subscriptions = {"on_reply": subscribe(intercept=[ReplyEndEvent, Msg])}

    async def on_reply(self, agent, input_kwargs, next_handler):
        seen = []
        async for item in next_handler():
            seen.append(type(item).__name__)
            yield item
        agent.state.middle_context[await self.get_middleware_key()] = seen


class SetModelAtStart(MiddlewareBase):
    """Chooses the model of the reply at ReplyStartEvent (the model router's move)."""

    subscriptions = {"on_reply": subscribe(intercept=[ReplyStartEvent])}

    def __init__(self, model: str = "backup") -> None:
        self.model = model

    async def on_reply(self, agent, input_kwargs, next_handler):
        async for item in next_handler():
            if isinstance(item, ReplyStartEvent):
                agent.set_model(self.model)
            yield item


class AppendMemory(MiddlewareBase):
    """Appends a memory message to the context at ReplyStartEvent (Mem0's move)."""

    subscriptions = {"on_reply": subscribe(intercept=[ReplyStartEvent])}

    async def on_reply(self, agent, input_kwargs, next_handler):
        async for item in next_handler():
            if isinstance(item, ReplyStartEvent):
                agent.state.context.append(AssistantMsg([HintBlock(hint="Memory: the user likes tea.")], name="memory"))
            yield item


class PermissionDenyShout(MiddlewareBase):
    """Denies one tool, lets the rest through the inner decision."""

    async def on_check_permission(self, agent, input_kwargs, next_handler):
        from agentmw.data import PermissionBehavior, PermissionDecision

        if input_kwargs["tool"].name == "add":
            return PermissionDecision(behavior=PermissionBehavior.DENY, message="adding is not allowed here")
        return await next_handler()


class Raises(MiddlewareBase):
    """Its code raises: propagated like an in-process middleware's exception."""

    async def on_reasoning(self, agent, input_kwargs, next_handler):
        raise ValueError("budget service says no")
        yield  # pragma: no cover


class QuotaGuard(MiddlewareBase):
    """on_model_call refuses with a non-retryable ModelError of its own (a spent quota), counting
    its calls: the model's retries must not call it again."""

    async def on_model_call(self, agent, input_kwargs, next_handler):
        key = await self.get_middleware_key()
        calls = (agent.state.middle_context.get(key) or {"calls": 0})["calls"] + 1
        agent.state.middle_context[key] = {"calls": calls}
        raise ModelError("quota exhausted", error_type=ErrorType.RATE_LIMIT, retryable=False)


class NotAllowed(Exception):
    """An exception of the middleware's own that says what kind of error it is."""

    error_type = ErrorType.PERMISSION


class RaisesTyped(MiddlewareBase):
    """Its code raises an exception carrying an error_type: the reply's error has that type."""

    async def on_reasoning(self, agent, input_kwargs, next_handler):
        raise NotAllowed("not allowed for this user")
        yield  # pragma: no cover


class ReturnsResponse(MiddlewareBase):
    """on_model_call short-circuits with one whole ChatResponse (not a stream)."""

    async def on_model_call(self, agent, input_kwargs, next_handler):
        return ChatResponse(content=[TextBlock(text="canned reply")], is_last=True)


class ReturnsLastChunk(MiddlewareBase):
    """on_model_call reads the inner stream and returns its last chunk, the whole response."""

    async def on_model_call(self, agent, input_kwargs, next_handler):
        last = None
        async for chunk in await next_handler():
            last = chunk
        return last


class ReturnsLastChunkBypassingDeltas(ReturnsLastChunk):
    """ReturnsLastChunk that lets the deltas pass by (remotely they go out before its answer)."""

    subscriptions = {"on_model_call": subscribe(intercept=["chat_response_final"], default=Mode.BYPASS)}


class ModelValueSeen(MiddlewareBase):
    """on_model_call notes what next_handler() returned (a stream, or one ChatResponse) and
    returns it as it is."""

    async def on_model_call(self, agent, input_kwargs, next_handler):
        value = await next_handler()
        seen = "ChatResponse" if isinstance(value, ChatResponse) else "stream"
        agent.state.middle_context[await self.get_middleware_key()] = {"returned": seen}
        return value


class Sleeper(MiddlewareBase):
    """Never answers: sleeps before calling next."""

    async def on_reply(self, agent, input_kwargs, next_handler):
        import asyncio

        await asyncio.sleep(3600)
        async for item in next_handler():
            yield item


class SleeperEverywhere(MiddlewareBase):
    """Never answers, in any of its hooks (a middleware that hangs)."""

    async def on_reply(self, agent, input_kwargs, next_handler):
        await asyncio.sleep(3600)
        async for item in next_handler():
            yield item

    async def on_reasoning(self, agent, input_kwargs, next_handler):
        await asyncio.sleep(3600)
        async for item in next_handler():
            yield item

    async def on_model_call(self, agent, input_kwargs, next_handler):
        await asyncio.sleep(3600)
        return await next_handler()


class Marker(MiddlewareBase):
    """Intercepts every item of on_reply and injects a marker event at ReplyStart."""

    async def on_reply(self, agent, input_kwargs, next_handler):
        async for item in next_handler():
            yield item
            if isinstance(item, ReplyStartEvent):
                yield CustomEvent(name="marker", value={})


class EagerPassThrough(MiddlewareBase):
    """Calls next first thing (declared eager_next), holds every item of on_reply and on_acting."""

    subscriptions = {
        "on_reply": subscribe(default=Mode.INTERCEPT, eager_next=True),
        "on_acting": subscribe(default=Mode.INTERCEPT, eager_next=True),
        "on_check_permission": subscribe(eager_next=True),
    }

    async def on_reply(self, agent, input_kwargs, next_handler):
        async for item in next_handler():
            yield item
            if isinstance(item, ReplyStartEvent):
                yield CustomEvent(name="eager_seen_start", value={})

    async def on_acting(self, agent, input_kwargs, next_handler):
        async for item in next_handler():
            yield item

    async def on_check_permission(self, agent, input_kwargs, next_handler):
        return await next_handler()


class DetachedWatcher(MiddlewareBase):
    """A tracer's shape: watches four hooks, never waited for. What it saw is kept in this process
    (per session) and read back with its ``watch_stats`` tool."""

    subscriptions = {
        "on_reply": subscribe(default=Mode.OBSERVE, detached=True),
        "on_reasoning": subscribe(observe=[ModelCallEndEvent], detached=True),
        "on_model_call": subscribe(observe=["chat_response_final"], detached=True),
        "on_acting": subscribe(observe=[ToolResponse], detached=True),
    }

    def __init__(self) -> None:
        self.seen: dict[str, dict[str, int]] = {}

    def _count(self, agent, hook: str, item) -> None:
        per_session = self.seen.setdefault(agent.state.session_id, {})
        key = f"{hook}:{type(item).__name__}"
        per_session[key] = per_session.get(key, 0) + 1

    async def on_reply(self, agent, input_kwargs, next_handler):
        async for item in next_handler():
            self._count(agent, "on_reply", item)
            yield item

    async def on_reasoning(self, agent, input_kwargs, next_handler):
        async for item in next_handler():
            self._count(agent, "on_reasoning", item)
            yield item

    async def on_model_call(self, agent, input_kwargs, next_handler):
        stream = await next_handler()
        if isinstance(stream, ChatResponse):  # the inner pipeline returned one response
            self._count(agent, "on_model_call:returned", stream)
            return stream

        async def watch():
            async for chunk in stream:
                self._count(agent, "on_model_call", chunk)
                yield chunk

        return watch()

    async def on_acting(self, agent, input_kwargs, next_handler):
        async for item in next_handler():
            self._count(agent, "on_acting", item)
            yield item

    async def list_tools(self):
        import json

        @tool(description="What the watcher saw in a session.", is_read_only=True)
        def watch_stats(session_id: str) -> str:
            return json.dumps(self.seen.get(session_id, {}), sort_keys=True)

        return [watch_stats]


class StallingObserver(MiddlewareBase):
    """Observes text deltas and stops answering at the 40th (past its first credit grant)."""

    subscriptions = {"on_reply": subscribe(observe=[TextBlockDeltaEvent])}

    async def on_reply(self, agent, input_kwargs, next_handler):
        import asyncio

        seen = 0
        async for item in next_handler():
            seen += 1
            if seen == 40:
                await asyncio.sleep(3600)
            yield item


class RaisingObserver(MiddlewareBase):
    """Observes text deltas; its code raises at the 40th."""

    subscriptions = {"on_reply": subscribe(observe=[TextBlockDeltaEvent])}

    async def on_reply(self, agent, input_kwargs, next_handler):
        seen = 0
        async for item in next_handler():
            seen += 1
            if seen == 40:
                raise ValueError("observer gave up at 40")
            yield item


class CountAfterYield(MiddlewareBase):
    """Yields each item, then counts it in its slot (the TTS pattern: work after the yield)."""

    subscriptions = {"on_reply": subscribe(observe=[TextBlockDeltaEvent], intercept=[ReplyStartEvent, Msg])}

    async def on_reply(self, agent, input_kwargs, next_handler):
        key = await self.get_middleware_key()
        async for item in next_handler():
            yield item
            if isinstance(item, (ReplyStartEvent, TextBlockDeltaEvent, Msg)):  # what it subscribed to
                slot = agent.state.middle_context.setdefault(key, {"n": 0})
                slot["n"] += 1


class StopsWhenInterrupted(MiddlewareBase):
    """Speaks on after the text (the TTS pattern): "tick" events, each after a wait of up to 2 s in
    which it looks at ``agent.interrupted`` every 10 ms; once the reply is interrupted it stops and
    says how many it sent. ``run_ahead``: it emits without waiting for the consumer, as TTS does."""

    def __init__(self, run_ahead: bool = False) -> None:
        self.subscriptions = {"on_reply": subscribe(intercept=[TextBlockEndEvent], run_ahead=run_ahead)}

    async def on_reply(self, agent, input_kwargs, next_handler):
        async for item in next_handler():
            yield item
            if not isinstance(item, TextBlockEndEvent):
                continue
            ticks = 0
            while ticks < 3 and not agent.interrupted:
                ticks += 1
                yield CustomEvent(name="tick", value={"n": ticks})
                for _ in range(200):
                    if agent.interrupted:
                        break
                    await asyncio.sleep(0.01)
            yield CustomEvent(name="stopped", value={"ticks": ticks, "interrupted": agent.interrupted})


class SlotSetThenDeleted(MiddlewareBase):
    """Sets its slot when the reply starts and deletes it when the reply ends: none is left."""

    subscriptions = {"on_reply": subscribe(intercept=[ReplyStartEvent, ReplyEndEvent])}

    async def on_reply(self, agent, input_kwargs, next_handler):
        key = await self.get_middleware_key()
        async for item in next_handler():
            if isinstance(item, ReplyStartEvent):
                agent.state.middle_context[key] = {"open": True}
            elif isinstance(item, ReplyEndEvent):
                del agent.state.middle_context[key]
            yield item


class Replica(MiddlewareBase):
    """Says which process served: injects its pid after ReplyStartEvent."""

    subscriptions = {"on_reply": subscribe(intercept=[ReplyStartEvent])}

    async def on_reply(self, agent, input_kwargs, next_handler):
        import os

        async for item in next_handler():
            yield item
            if isinstance(item, ReplyStartEvent):
                yield CustomEvent(name="served_by", value={"pid": os.getpid()})


class TraceEcho(MiddlewareBase):
    """Keeps the host's trace context of its on_reply call in its slot."""

    async def on_reply(self, agent, input_kwargs, next_handler):
        agent.state.middle_context[await self.get_middleware_key()] = dict(agent.trace_context)
        async for item in next_handler():
            yield item


MIDDLEWARE: dict[str, type[MiddlewareBase]] = {
    name: obj
    for name, obj in list(globals().items())
    if isinstance(obj, type) and issubclass(obj, MiddlewareBase) and obj is not MiddlewareBase
}


def make(name: str, **kwargs: Any) -> MiddlewareBase:
    return MIDDLEWARE[name](**kwargs)


# -- fidelity with AgentScope (docs/behaviour.md) ---------------------------------------------


class ActingAfterLoop(MiddlewareBase):
    """Code after its ``async for`` loop over on_acting's next_handler (a span's end, an audit
    record): records how many items it saw, then yields a chunk after the ToolResponse (dropped)."""

    async def on_acting(self, agent, input_kwargs, next_handler):
        seen = []
        async for item in next_handler():
            seen.append(type(item).__name__)
            yield item
        agent.state.middle_context[await self.get_middleware_key()] = {"seen": seen}
        yield ToolChunk(content=[TextBlock(text="after the response")])


class RaisingTool(MiddlewareBase):
    """Contributes a tool that streams a little, then raises."""

    async def list_tools(self):
        @tool(description="Streams a line, then fails.")
        async def fragile(text: str):
            async def run():
                yield ToolChunk(content=[TextBlock(text=f"working on {text}; ")])
                raise ValueError(f"cannot handle {text!r}")

            return run()

        return [fragile]


class OrderedCustomEvent(MiddlewareBase):
    """Injects, after ReplyStartEvent, a CustomEvent of this reply whose value has keys out of
    alphabetical order (a Struct on the wire would reorder them)."""

    subscriptions = {"on_reply": subscribe(intercept=[ReplyStartEvent])}

    async def on_reply(self, agent, input_kwargs, next_handler):
        async for item in next_handler():
            yield item
            if isinstance(item, ReplyStartEvent):
                value = {"zeta": 1, "alpha": {"y": 2, "b": 3}, "mid": [1, "two"]}
                yield CustomEvent(name="ordered", value=value, reply_id=item.reply_id)


MIDDLEWARE.update({cls.__name__: cls for cls in (ActingAfterLoop, RaisingTool, OrderedCustomEvent)})


class Unexceptional(BaseException):
    """Not an Exception: what ``except Exception`` lets through."""


def _not_an_exception(kind: str, text: str) -> BaseException:
    return {"cancelled": asyncio.CancelledError, "exit": SystemExit}.get(kind, Unexceptional)(text)


class RaisesNonException(MiddlewareBase):
    """Raises in ``hook``, once per session (it passes through after), what is not an Exception:
    a CancelledError of its own code (``kind`` "cancelled": it awaited a task that was cancelled,
    say), another BaseException ("base"), or SystemExit ("exit": never in-process, it would end the
    test). Its tool raises one every time."""

    def __init__(self, hook: str = "on_reasoning", kind: str = "cancelled") -> None:
        self.hook, self.kind = hook, kind

    async def _raise_once(self, agent, hook):
        key = await self.get_middleware_key()
        if hook == self.hook and agent.state.middle_context.get(key) is None:
            agent.state.middle_context[key] = {"raised in": hook}
            raise _not_an_exception(self.kind, f"{self.kind} raised in {hook}")

    async def on_reasoning(self, agent, input_kwargs, next_handler):
        await self._raise_once(agent, "on_reasoning")
        async for item in next_handler():
            yield item

    async def list_tools(self):
        kind = self.kind

        @tool(description="Fails with what is not an Exception.")
        async def unexceptional(text: str) -> str:
            raise _not_an_exception(kind, f"the tool cannot take {text!r}")

        return [unexceptional]


class RaisesNonExceptionInReply(RaisesNonException):
    """The same, with on_reply too (for a hook="on_reply")."""

    async def get_middleware_key(self) -> str:
        return "RaisesNonException"

    async def on_reply(self, agent, input_kwargs, next_handler):
        await self._raise_once(agent, "on_reply")
        async for item in next_handler():
            yield item


MIDDLEWARE.update({cls.__name__: cls for cls in (RaisesNonException, RaisesNonExceptionInReply)})


# -- fidelity, SDK side (in-place edits, lock-step after yield, errors, shared slots, credits) ---


class InPlaceToolChoice(MiddlewareBase):
    """AgentScope style: edits input_kwargs in place, then calls a bare next_handler()."""

    async def on_reasoning(self, agent, input_kwargs, next_handler):
        input_kwargs["tool_choice"] = ToolChoice(mode="none")
        async for item in next_handler():
            yield item


class InPlaceAppendMessage(MiddlewareBase):
    """Appends to on_model_call's ``messages`` list in place, then a bare next_handler()."""

    async def on_model_call(self, agent, input_kwargs, next_handler):
        input_kwargs["messages"].append(UserMsg("appended in place"))
        return await next_handler()


class InPlaceEditMessage(MiddlewareBase):
    """Edits the text of a message inside on_model_call's ``messages`` in place, then next_handler(**input_kwargs)."""

    async def on_model_call(self, agent, input_kwargs, next_handler):
        input_kwargs["messages"][-1].content[0].text = "edited in place"
        return await next_handler(**input_kwargs)


class CopiedKwargsEdit(MiddlewareBase):
    """Reaches a message through a copy of ``input_kwargs``, edits it in place, then a bare
    next_handler(): in-process the model sees the edit (the copy shares the message)."""

    async def on_model_call(self, agent, input_kwargs, next_handler):
        kwargs = {**input_kwargs}
        kwargs["messages"][-1].content[0].text = "edited through a copy"
        return await next_handler()


class InPlaceToolInput(MiddlewareBase):
    """Reads on_acting's ``tool_call`` (a flat dataclass: the SDK checks it by a snapshot of its
    fields), edits its ``input`` in place, then a bare next_handler(): the tool runs on the edit."""

    async def on_acting(self, agent, input_kwargs, next_handler):
        call = input_kwargs["tool_call"]
        if call.name == "add":
            call.input = '{"a": 40, "b": 2}'
        async for item in next_handler():
            yield item


class DoneWithInner(PassThrough):
    """PassThrough declaring done_with_inner wherever it may (every onion): nothing after the inner
    pipeline ends. Counts the reply's start into its slot (on an intercepted item, before
    inner_done), so the host ends each call at inner_done, one round trip early."""

    subscriptions = {
        "on_reply": subscribe(intercept=[ReplyStartEvent], done_with_inner=True),
        "on_reasoning": subscribe(done_with_inner=True),
        "on_acting": subscribe(done_with_inner=True),
        "on_check_permission": subscribe(done_with_inner=True),
        "on_model_call": subscribe(done_with_inner=True, default=Mode.BYPASS),
        "on_compress_context": subscribe(done_with_inner=True),
    }

    async def on_reply(self, agent, input_kwargs, next_handler):
        async for item in next_handler():
            if isinstance(item, ReplyStartEvent):
                agent.state.middle_context[await self.get_middleware_key()] = {"started": item.reply_id != ""}
            yield item


class LateAfterInner(MiddlewareBase):
    """Declares done_with_inner on on_reply, then breaks the promise: writes its slot after its
    inner pipeline ended. Served remotely, the SDK refuses that in the hook's code (the host would
    never read it); in-process nothing checks the declaration."""

    subscriptions = {"on_reply": subscribe(intercept=[ReplyStartEvent], done_with_inner=True)}

    async def on_reply(self, agent, input_kwargs, next_handler):
        async for item in next_handler():
            yield item
        agent.state.middle_context[await self.get_middleware_key()] = {"late": True}


class InPlaceContextHint(MiddlewareBase):
    """AgentScope's budget move: appends a hint block to ``agent.state.context[-1]`` in place when
    the tail is this agent's assistant message (after a tool round)."""

    subscriptions = {"on_reasoning": subscribe(wants_context=True)}

    async def on_reasoning(self, agent, input_kwargs, next_handler):
        tail = agent.state.context[-1]
        if tail.role == "assistant" and tail.name == agent.name:
            tail.content.append(HintBlock(hint="Over budget: answer now."))
        async for item in next_handler():
            yield item


class InPlaceUserEdit(MiddlewareBase):
    """Edits the user's message in place: a remote view cannot carry that (ContextEditError)."""

    subscriptions = {"on_reasoning": subscribe(wants_context=True)}

    async def on_reasoning(self, agent, input_kwargs, next_handler):
        agent.state.context[0].content.append(TextBlock(text="edited"))
        async for item in next_handler():
            yield item


class MaxItersAtStart(MiddlewareBase):
    """Outer layer: lowers max_iters when it receives ReplyStartEvent."""

    subscriptions = {"on_reply": subscribe(intercept=[ReplyStartEvent])}

    async def on_reply(self, agent, input_kwargs, next_handler):
        async for item in next_handler():
            if isinstance(item, ReplyStartEvent):
                agent.max_iters = 7
            yield item


class AfterYieldReads(MiddlewareBase):
    """Inner layer: after yielding ReplyStartEvent, records what max_iters is then. In-process that
    code runs when the consumer asks for the next item, so it sees what outer layers did."""

    subscriptions = {"on_reply": subscribe(intercept=[ReplyStartEvent])}

    async def on_reply(self, agent, input_kwargs, next_handler):
        async for item in next_handler():
            yield item
            if isinstance(item, ReplyStartEvent):
                agent.state.middle_context[await self.get_middleware_key()] = {"max_iters": agent.max_iters}


class CatchModelError(MiddlewareBase):
    """Catches the inner pipeline's ModelError by class (and keeps what it saw of it), then falls
    back to another model."""

    async def on_model_call(self, agent, input_kwargs, next_handler):
        from agent_host.models.base import ModelError

        try:
            return await next_handler()
        except ModelError as exc:
            seen = {
                "message": str(exc),
                "retryable": exc.retryable,
                "error_type": exc.error_type.value,
                "runtime": isinstance(exc, RuntimeError),
            }
            agent.state.middle_context[await self.get_middleware_key()] = seen
            return await next_handler(current_model="backup")


class BreaksModelCall(MiddlewareBase):
    """on_model_call raises a RuntimeError of its own (an exception with no ``retryable``)."""

    async def on_model_call(self, agent, input_kwargs, next_handler):
        raise RuntimeError("inner broke")


class CatchInnerRuntimeError(MiddlewareBase):
    """Catches the inner pipeline's RuntimeError and notes which attributes it has (none but its
    message, as in-process), then answers itself."""

    async def on_model_call(self, agent, input_kwargs, next_handler):
        try:
            return await next_handler()
        except RuntimeError as exc:
            seen = {"message": str(exc), "has_retryable": hasattr(exc, "retryable")}
            agent.state.middle_context[await self.get_middleware_key()] = seen
            return ChatResponse(content=[TextBlock(text="caught it")], is_last=True)


class RaisesKeyError(MiddlewareBase):
    """on_model_call raises a KeyError of its own."""

    async def on_model_call(self, agent, input_kwargs, next_handler):
        raise KeyError("user_42")


class CatchInnerByClass(MiddlewareBase):
    """Catches the inner pipeline's exception by a class it is (a KeyError is a LookupError), notes
    what it saw of it, then answers itself."""

    async def on_model_call(self, agent, input_kwargs, next_handler):
        try:
            return await next_handler()
        except LookupError as exc:
            seen = {
                "class": type(exc).__name__,
                "args": list(exc.args),
                "str": str(exc),
                "runtime": isinstance(exc, RuntimeError),
            }
            agent.state.middle_context[await self.get_middleware_key()] = seen
            return ChatResponse(content=[TextBlock(text="caught it")], is_last=True)


class RaisesStopAsyncIteration(MiddlewareBase):
    """Its coroutine hook ``hook`` raises StopAsyncIteration (an ``await anext(it)`` on a spent
    iterator, say); its other hooks pass through."""

    def __init__(self, hook: str = "on_model_call") -> None:
        self.hook = hook

    async def on_check_permission(self, agent, input_kwargs, next_handler):
        if self.hook == "on_check_permission":
            raise StopAsyncIteration("no more in on_check_permission")
        return await next_handler()

    async def on_model_call(self, agent, input_kwargs, next_handler):
        if self.hook == "on_model_call":
            raise StopAsyncIteration("no more in on_model_call")
        return await next_handler()


class CatchInnerStop(MiddlewareBase):
    """Catches the inner pipeline's StopAsyncIteration by class in its coroutine hooks, notes what it
    saw of it, then decides itself (the tool is allowed, the model call answered)."""

    async def _seen(self, agent, hook: str, exc: BaseException) -> None:
        key = await self.get_middleware_key()
        seen = {"class": type(exc).__name__, "str": str(exc), "runtime": isinstance(exc, RuntimeError)}
        agent.state.middle_context[key] = {**(agent.state.middle_context.get(key) or {}), hook: seen}

    async def on_check_permission(self, agent, input_kwargs, next_handler):
        from agentmw.data import PermissionBehavior, PermissionDecision

        try:
            return await next_handler()
        except StopAsyncIteration as exc:
            await self._seen(agent, "on_check_permission", exc)
            return PermissionDecision(behavior=PermissionBehavior.ALLOW)

    async def on_model_call(self, agent, input_kwargs, next_handler):
        try:
            return await next_handler()
        except StopAsyncIteration as exc:
            await self._seen(agent, "on_model_call", exc)
            return ChatResponse(content=[TextBlock(text="caught it")], is_last=True)


class _SpeaksAfterText(MiddlewareBase):
    """After the text block ends it starts a block of its own, audio with id "speech" (as the TTS
    server does), and ``speak``s into it."""

    subscriptions = {"on_reply": subscribe(intercept=[TextBlockEndEvent])}

    async def on_reply(self, agent, input_kwargs, next_handler):
        async for item in next_handler():
            yield item
            if isinstance(item, TextBlockEndEvent):
                audio = {"reply_id": item.reply_id, "block_id": "speech", "media_type": "audio/pcm"}
                yield DataBlockStartEvent(**audio)
                async for event in self.speak(audio):
                    yield event


class DiesMidBlock(_SpeaksAfterText):
    """Sends part of its audio, then its process dies: a TTS server killed while it speaks."""

    async def speak(self, audio):
        import os

        yield DataBlockDeltaEvent(**audio, data="AAAA")
        await asyncio.sleep(0.3)  # it went out
        os._exit(1)


class SpeaksOn(_SpeaksAfterText):
    """Does not stop speaking by itself: a TTS server reading out a very long text."""

    async def speak(self, audio):
        for _ in range(100_000):  # bounded all the same
            yield DataBlockDeltaEvent(**audio, data="AAAA")
            await asyncio.sleep(0.02)
        yield DataBlockEndEvent(**audio)


class LagsThenDies(MiddlewareBase):
    """Passes each text event on one item late (as a sentence splitter does), so what it yields
    are emits of its own, not forwards of held items; its process dies in the middle of the text
    block, after passing on the block's start and two deltas."""

    subscriptions = {"on_reply": subscribe(intercept=[TextBlockStartEvent, TextBlockDeltaEvent, TextBlockEndEvent])}

    async def on_reply(self, agent, input_kwargs, next_handler):
        import os

        held, deltas = None, 0
        async for item in next_handler():
            if not isinstance(item, TextBlockStartEvent | TextBlockDeltaEvent | TextBlockEndEvent):
                yield item
                continue
            if held is not None:
                yield held
                deltas += isinstance(held, TextBlockDeltaEvent)
                if deltas == 2:
                    await asyncio.sleep(0.3)  # what it yielded went out
                    os._exit(1)
            held = item
        if held is not None:
            yield held


class SharedCounter(MiddlewareBase):
    """Counts intercepted text deltas in a slot shared by every instance (one key)."""

    subscriptions = {"on_reply": subscribe(intercept=[TextBlockDeltaEvent])}

    async def get_middleware_key(self) -> str:
        return "Shared"

    async def on_reply(self, agent, input_kwargs, next_handler):
        async for item in next_handler():
            if isinstance(item, TextBlockDeltaEvent):
                slot = agent.state.middle_context.get("Shared") or {"n": 0}
                agent.state.middle_context["Shared"] = {"n": slot["n"] + 1}
            yield item


class SlotFromTwoHooks(MiddlewareBase):
    """on_reply writes its slot at ReplyStartEvent and again at ReplyEndEvent; on_reasoning of the
    same reply writes it in between. In-process all three see one dict."""

    subscriptions = {"on_reply": subscribe(intercept=[ReplyStartEvent, ReplyEndEvent])}

    async def on_reply(self, agent, input_kwargs, next_handler):
        key = await self.get_middleware_key()
        async for item in next_handler():
            if isinstance(item, ReplyStartEvent):
                agent.state.middle_context[key] = {"start": 1, "reasoning": 0}
            elif isinstance(item, ReplyEndEvent):
                agent.state.middle_context[key] = {**agent.state.middle_context[key], "end": 1}
            yield item

    async def on_reasoning(self, agent, input_kwargs, next_handler):
        key = await self.get_middleware_key()
        slot = agent.state.middle_context[key]
        agent.state.middle_context[key] = {**slot, "reasoning": slot["reasoning"] + 1}
        async for item in next_handler():
            yield item


class ObserveDeltasInterceptEnd(MiddlewareBase):
    """The TTS server's shape: observes text deltas, intercepts the block end, counts both."""

    subscriptions = {"on_reply": subscribe(observe=[TextBlockDeltaEvent], intercept=[TextBlockEndEvent])}

    async def on_reply(self, agent, input_kwargs, next_handler):
        seen = {"deltas": 0, "ends": 0}
        async for item in next_handler():
            if isinstance(item, (TextBlockDeltaEvent, TextBlockEndEvent)):  # what it subscribed to
                seen["deltas" if isinstance(item, TextBlockDeltaEvent) else "ends"] += 1
            yield item
        agent.state.middle_context[await self.get_middleware_key()] = seen


MIDDLEWARE.update(
    {
        cls.__name__: cls
        for cls in (
            InPlaceToolChoice,
            InPlaceAppendMessage,
            InPlaceEditMessage,
            CopiedKwargsEdit,
            InPlaceToolInput,
            DoneWithInner,
            LateAfterInner,
            InPlaceContextHint,
            InPlaceUserEdit,
            MaxItersAtStart,
            AfterYieldReads,
            CatchModelError,
            BreaksModelCall,
            CatchInnerRuntimeError,
            RaisesKeyError,
            CatchInnerByClass,
            RaisesStopAsyncIteration,
            CatchInnerStop,
            DiesMidBlock,
            SpeaksOn,
            LagsThenDies,
            SharedCounter,
            SlotFromTwoHooks,
            ObserveDeltasInterceptEnd,
        )
    }
)


class AfterYieldRunsAhead(AfterYieldReads):
    """AfterYieldReads declaring ``run_ahead``: served remotely, its code after ``yield`` runs
    before the outer layer has handled the item (a documented trade: one round trip less per item)."""

    subscriptions = {"on_reply": subscribe(intercept=[ReplyStartEvent], run_ahead=True)}

    async def get_middleware_key(self) -> str:
        return "AfterYieldReads"


MIDDLEWARE[AfterYieldRunsAhead.__name__] = AfterYieldRunsAhead


class OnlyWhen(MiddlewareBase):
    """on_reasoning declared ``only_when="armed"``: it acts (a CustomEvent per step) once on_reply
    has counted a model call and set the flag; until then it is a pure pass-through, as the
    declaration promises. Remotely the host does not call it while the flag is off."""

    subscriptions = {
        "on_reply": subscribe(intercept=[ModelCallEndEvent]),
        "on_reasoning": subscribe(only_when="armed"),
    }

    async def on_reply(self, agent, input_kwargs, next_handler):
        async for item in next_handler():
            if isinstance(item, ModelCallEndEvent):
                slot = agent.state.middle_context.get(await self.get_middleware_key()) or {"calls": 0}
                calls = slot["calls"] + 1
                agent.state.middle_context[await self.get_middleware_key()] = {"calls": calls, "armed": calls >= 1}
            yield item

    async def on_reasoning(self, agent, input_kwargs, next_handler):
        slot = agent.state.middle_context.get(await self.get_middleware_key())
        if isinstance(slot, dict) and slot.get("armed") is True:
            yield CustomEvent(name="armed_step", value={"calls": slot["calls"]})
        async for item in next_handler():
            yield item


class OnlyWhenTattletale(OnlyWhen):
    """OnlyWhen whose on_reasoning fails when it is called with its flag off: served remotely, a
    reply ends well only if the host skipped it then."""

    async def on_reasoning(self, agent, input_kwargs, next_handler):
        slot = agent.state.middle_context.get(await self.get_middleware_key())
        if not (isinstance(slot, dict) and slot.get("armed") is True):
            raise RuntimeError("on_reasoning was called while its only_when flag was off")
        async for item in super().on_reasoning(agent, input_kwargs, next_handler):
            yield item


MIDDLEWARE.update({cls.__name__: cls for cls in (OnlyWhen, OnlyWhenTattletale)})


class SlotAfterYield(MiddlewareBase):
    """Outer layer: after yielding its k-th text delta, sets its slot to ``{"n": k}`` (code after
    a yield, which runs before it asks its inner pipeline for the next item)."""

    subscriptions = {"on_reply": subscribe(intercept=[TextBlockDeltaEvent])}

    async def on_reply(self, agent, input_kwargs, next_handler):
        key, n = await self.get_middleware_key(), 0
        async for item in next_handler():
            yield item
            if isinstance(item, TextBlockDeltaEvent):
                n += 1
                agent.state.middle_context[key] = {"n": n}


class ReadsOuterSlot(MiddlewareBase):
    """Inner layer (in-process): notes SlotAfterYield's ``n`` as each text delta passes it."""

    async def on_reply(self, agent, input_kwargs, next_handler):
        key, seen = await self.get_middleware_key(), []
        async for item in next_handler():
            if isinstance(item, TextBlockDeltaEvent):
                seen.append((agent.state.middle_context.get("SlotAfterYield") or {}).get("n", 0))
                agent.state.middle_context[key] = {"seen": list(seen)}
            yield item


MIDDLEWARE.update({cls.__name__: cls for cls in (SlotAfterYield, ReadsOuterSlot)})


# -- fidelity of the kwargs (every key present, a deleted key cleared) ----------------------------


class KwargKeys(MiddlewareBase):
    """Records, for each onion hook, its input_kwargs' keys (each hook's every parameter); reads
    on_model_call's ``parameters`` by ``[]``, as the hook table allows. Then passes through."""

    def _note(self, agent: Any, hook: str, input_kwargs: Any) -> None:
        agent.state.middle_context.setdefault("KwargKeys", {})[hook] = sorted(input_kwargs)

    async def on_reply(self, agent, input_kwargs, next_handler):
        self._note(agent, "on_reply", input_kwargs)
        async for item in next_handler():
            yield item

    async def on_reasoning(self, agent, input_kwargs, next_handler):
        self._note(agent, "on_reasoning", input_kwargs)
        async for item in next_handler():
            yield item

    async def on_acting(self, agent, input_kwargs, next_handler):
        self._note(agent, "on_acting", input_kwargs)
        async for item in next_handler():
            yield item

    async def on_check_permission(self, agent, input_kwargs, next_handler):
        self._note(agent, "on_check_permission", input_kwargs)
        return await next_handler()

    async def on_model_call(self, agent, input_kwargs, next_handler):
        self._note(agent, "on_model_call", input_kwargs)
        params = dict(input_kwargs["parameters"] or {})  # the hook table: present, None when unset
        return await next_handler(parameters={**params, "temperature": 0})

    async def on_compress_context(self, agent, input_kwargs, next_handler):
        self._note(agent, "on_compress_context", input_kwargs)
        await next_handler()


class DeletesTools(MiddlewareBase):
    """Deletes ``tools`` from on_model_call's input_kwargs: the model gets none (cleared)."""

    async def on_model_call(self, agent, input_kwargs, next_handler):
        del input_kwargs["tools"]
        return await next_handler()


MIDDLEWARE.update({cls.__name__: cls for cls in (KwargKeys, DeletesTools)})


class MaxItersZero(MiddlewareBase):
    """At ReplyStartEvent: tries max_iters = -1 (refused at the assignment), then sets 0."""

    subscriptions = {"on_reply": subscribe(intercept=[ReplyStartEvent])}

    async def on_reply(self, agent, input_kwargs, next_handler):
        async for item in next_handler():
            if isinstance(item, ReplyStartEvent):
                try:
                    agent.max_iters = -1
                except ValueError as exc:
                    agent.state.middle_context["MaxItersZero"] = {"refused": str(exc)}
                agent.max_iters = 0
                agent.state.middle_context["MaxItersZero"]["now"] = agent.max_iters
            yield item


MIDDLEWARE[MaxItersZero.__name__] = MaxItersZero


class ActingYieldsCustom(MiddlewareBase):
    """on_acting yields a CustomEvent, which is no tool item, before the tool's own."""

    async def on_acting(self, agent, input_kwargs, next_handler):
        yield CustomEvent(name="acting_note", value={}, reply_id=agent.state.reply_id)
        async for item in next_handler():
            yield item


MIDDLEWARE[ActingYieldsCustom.__name__] = ActingYieldsCustom


class ReasoningYieldsBlock(MiddlewareBase):
    """on_reasoning yields a TextBlock, which is no item of a reasoning step, before the step's own."""

    async def on_reasoning(self, agent, input_kwargs, next_handler):
        yield TextBlock(text="a block, not an event")
        async for item in next_handler():
            yield item


MIDDLEWARE[ReasoningYieldsBlock.__name__] = ReasoningYieldsBlock


class YieldsNone(MiddlewareBase):
    """Yields None (no item at all) first in ``hook``, passing everything else through."""

    def __init__(self, hook: str = "on_reply") -> None:
        self.hook = hook

    async def _stream(self, hook, next_handler):
        if hook == self.hook:
            yield None
        async for item in next_handler():
            yield item

    def on_reply(self, agent, input_kwargs, next_handler):
        return self._stream("on_reply", next_handler)

    def on_reasoning(self, agent, input_kwargs, next_handler):
        return self._stream("on_reasoning", next_handler)

    def on_acting(self, agent, input_kwargs, next_handler):
        return self._stream("on_acting", next_handler)

    async def on_model_call(self, agent, input_kwargs, next_handler):
        inner = await next_handler()
        if self.hook != "on_model_call":
            return inner

        async def chunks():
            yield None
            async for chunk in inner:
                yield chunk

        return chunks()


MIDDLEWARE[YieldsNone.__name__] = YieldsNone


class PlainToolChoice(MiddlewareBase):
    """Overrides tool_choice with a plain string, not a ToolChoice (a mistake)."""

    async def on_reasoning(self, agent, input_kwargs, next_handler):
        async for item in next_handler(tool_choice="none"):
            yield item


MIDDLEWARE[PlainToolChoice.__name__] = PlainToolChoice


class AddsKwarg(MiddlewareBase):
    """Adds a key on_reasoning does not take to its input_kwargs, in place, then calls next."""

    async def on_reasoning(self, agent, input_kwargs, next_handler):
        input_kwargs["bogus"] = 1
        async for item in next_handler():
            yield item


MIDDLEWARE[AddsKwarg.__name__] = AddsKwarg


class SetInSlot(MiddlewareBase):
    """Puts a set (not JSON) into its slot at the reply's start; ``then_raise``: raises after."""

    def __init__(self, then_raise: bool = False) -> None:
        self.then_raise = then_raise

    async def get_middleware_key(self) -> str:
        return "set_in_slot"

    async def on_reply(self, agent, input_kwargs, next_handler):
        async for item in next_handler():
            if isinstance(item, ReplyStartEvent):
                agent.state.middle_context["set_in_slot"] = {"seen": {1, 2}}
                if self.then_raise:
                    raise ValueError("my own error")
            yield item


MIDDLEWARE[SetInSlot.__name__] = SetInSlot


class ColdModel(MiddlewareBase):
    """Asks for a low temperature when the user says "cold": on the ``current_model`` it is given,
    in place (``how`` "in_place"), or by passing an edited copy of it as the override
    ("override"). Records what ``current_model`` is."""

    def __init__(self, how: str = "in_place") -> None:
        self.how = how

    async def on_model_call(self, agent, input_kwargs, next_handler):
        model = input_kwargs["current_model"]
        agent.state.middle_context[await self.get_middleware_key()] = {"current_model": type(model).__name__}
        if "cold" not in input_kwargs["messages"][-1].text:
            return await next_handler()
        if self.how == "in_place":
            model.parameters["temperature"] = 0.1
            return await next_handler()
        return await next_handler(current_model=replace(model, parameters={**model.parameters, "temperature": 0.1}))


class OverrideModel(MiddlewareBase):
    """Sends every model call to ``model`` with a temperature of its own: a ModelRef override."""

    def __init__(self, model: str = "backup") -> None:
        self.model = model

    async def on_model_call(self, agent, input_kwargs, next_handler):
        return await next_handler(current_model=ModelRef(id=self.model, parameters={"temperature": 0.2}))


class ModelSeen(MiddlewareBase):
    """Records the current_model it gets: its type, id and parameters."""

    async def on_model_call(self, agent, input_kwargs, next_handler):
        model = input_kwargs["current_model"]
        seen = [type(model).__name__, getattr(model, "id", model), getattr(model, "parameters", None)]
        agent.state.middle_context[await self.get_middleware_key()] = seen
        return await next_handler()


MIDDLEWARE.update({cls.__name__: cls for cls in (ColdModel, OverrideModel, ModelSeen)})


# -- the view shows the middleware's own changes at once, as in-process ---------------------------


class SetModelThenRead(MiddlewareBase):
    """Chooses the backup model, then reads ``agent.model``."""

    async def on_reasoning(self, agent, input_kwargs, next_handler):
        agent.set_model("backup")
        yield CustomEvent(name="model_now", value={"id": agent.model.id}, reply_id=agent.state.reply_id)
        async for item in next_handler():
            yield item


class SetModelUnknown(MiddlewareBase):
    """Asks for a model id the host does not have, and records what its code saw."""

    subscriptions = {"on_reply": subscribe(intercept=[ReplyStartEvent])}

    async def on_reply(self, agent, input_kwargs, next_handler):
        async for item in next_handler():
            if isinstance(item, ReplyStartEvent):
                try:
                    agent.set_model("no-such-model")
                    caught = None
                except UnknownModelError as exc:
                    caught = str(exc)
                agent.state.middle_context[await self.get_middleware_key()] = {"caught": caught}
            yield item


class ChangeContextThenRead(MiddlewareBase):
    """In the first step: appends a hint, appends another to the tail, removes the first, reading
    ``agent.state.context`` after each."""

    subscriptions = {"on_reasoning": subscribe(wants_context=True)}

    async def on_reasoning(self, agent, input_kwargs, next_handler):
        if agent.state.cur_iter == 0:
            context = agent.state.context
            seen = [len(context)]
            agent.state.append_context(agent.name, [HintBlock(hint="one")])
            seen.append([len(context), [b.hint for b in context[-1].content]])
            agent.state.append_to_last_assistant(agent.name, [HintBlock(hint="two")])
            seen.append([len(context), [b.hint for b in context[-1].content]])
            agent.state.remove_block(context[-1].content[0].id)
            seen.append([len(context), [b.hint for b in context[-1].content]])
            yield CustomEvent(name="context_now", value={"seen": seen}, reply_id=agent.state.reply_id)
        async for item in next_handler():
            yield item


MIDDLEWARE.update({cls.__name__: cls for cls in (SetModelThenRead, SetModelUnknown, ChangeContextThenRead)})


class CompressOldest(MiddlewareBase):
    """Compresses the context itself (the core's compression is not called): the messages before the
    newest two go into the summary and are dropped, by ``del`` in an even step and by assigning
    the newest ones in an odd one; reads the view after each. Notes every model input."""

    subscriptions = {"on_compress_context": subscribe(wants_context=True)}

    async def on_compress_context(self, agent, input_kwargs, next_handler):
        state = agent.state
        n = len(state.context) - 2
        if n <= 0:
            return
        said = " / ".join(m.text for m in state.context[:n] if m.text)
        state.summary = f"{state.summary} / {said}" if state.summary else said
        if state.cur_iter % 2 == 0:
            del state.context[:n]
        else:
            state.context = state.context[n:]
        slot = state.middle_context.setdefault("CompressOldest", {})
        slot.setdefault("seen", []).append([len(state.context), state.summary])

    async def on_model_call(self, agent, input_kwargs, next_handler):
        slot = agent.state.middle_context.setdefault("CompressOldest", {})
        slot.setdefault("inputs", []).append([f"{m.role}: {m.text}" for m in input_kwargs["messages"]])
        return await next_handler()


class CompressIntoMessage(MiddlewareBase):
    """Replaces the oldest message by a message of its own: in-process a plain list assignment;
    remotely not a drop of the oldest messages, so refused."""

    subscriptions = {"on_compress_context": subscribe(wants_context=True)}

    async def on_compress_context(self, agent, input_kwargs, next_handler):
        context = agent.state.context
        if len(context) > 1:
            agent.state.context = [UserMsg(f"earlier: {context[0].text}"), *context[1:]]


MIDDLEWARE.update({cls.__name__: cls for cls in (CompressOldest, CompressIntoMessage)})


class SummaryAtTextEnd(MiddlewareBase):
    """on_reasoning sets the summary as the text block ends (in place: no version bump)."""

    async def on_reasoning(self, agent, input_kwargs, next_handler):
        async for item in next_handler():
            if isinstance(item, TextBlockEndEvent):
                agent.state.summary = "noted at the text's end"
            yield item


class SummaryReader(MiddlewareBase):
    """Records the summary it sees when the text block's end passes (the context comes with each
    delta and the end, when it changed)."""

    subscriptions = {"on_reply": subscribe(intercept=[TextBlockDeltaEvent, TextBlockEndEvent], wants_context=True)}

    async def on_reply(self, agent, input_kwargs, next_handler):
        async for item in next_handler():
            if isinstance(item, TextBlockEndEvent):
                agent.state.middle_context[await self.get_middleware_key()] = agent.state.summary
            yield item


MIDDLEWARE.update({cls.__name__: cls for cls in (SummaryAtTextEnd, SummaryReader)})


class PromptNone(MiddlewareBase):
    """on_system_prompt forgets to return the prompt."""

    async def on_system_prompt(self, agent, prompt):
        prompt += " (edited)"


class PermissionNone(MiddlewareBase):
    """on_check_permission forgets to return the decision."""

    async def on_check_permission(self, agent, input_kwargs, next_handler):
        await next_handler()


class CompressReturnsValue(MiddlewareBase):
    """on_compress_context returns something (AgentScope ignores it)."""

    async def on_compress_context(self, agent, input_kwargs, next_handler):
        await next_handler()
        return "compressed"


MIDDLEWARE.update({cls.__name__: cls for cls in (PromptNone, PermissionNone, CompressReturnsValue)})


# -- exceptions of a class of one's own: bases and fields cross the wire ------------------------


class QuotaError(ValueError):
    """A middleware's own exception class: a ValueError with fields of its own."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code
        self.detail = {"left": 0, "tiers": ["free", "pro"]}


class RaisesOwnError(MiddlewareBase):
    """on_model_call raises an exception of its own: ``kind`` "quota", a QuotaError; "model", a
    ModelError with a status, a code and the delay the provider asked for; "throttled", that
    ModelError retryable and asking for 4 ms, once per reply (the retry then passes)."""

    def __init__(self, kind: str = "quota") -> None:
        self.kind = kind

    async def on_model_call(self, agent, input_kwargs, next_handler):
        if self.kind == "quota":
            raise QuotaError("quota gone", code=42)
        key = await self.get_middleware_key()
        if self.kind == "throttled" and agent.state.middle_context.get(key) == agent.state.reply_id:
            return await next_handler()
        agent.state.middle_context[key] = agent.state.reply_id
        throttled = self.kind == "throttled"  # a delay under the tests' retry policy's 10 ms backoff
        raise ModelError(
            "slow down", retryable=throttled, status=429, code="throttled", retry_after=0.004 if throttled else 1.5
        )


class CatchByBase(MiddlewareBase):
    """Catches the inner pipeline's exception by a base class it has (ValueError, ModelError), notes
    its class and fields, then answers itself."""

    async def on_reasoning(self, agent, input_kwargs, next_handler):
        try:
            async for item in next_handler():
                yield item
        except (ValueError, ModelError) as exc:
            fields = ("code", "detail", "status", "retry_after", "error_type")
            agent.state.middle_context[await self.get_middleware_key()] = {
                "class": type(exc).__name__,
                "ValueError": isinstance(exc, ValueError),
                "ModelError": isinstance(exc, ModelError),
                **{name: str(getattr(exc, name)) for name in fields if hasattr(exc, name)},
            }
            yield AssistantMsg(name=agent.name, content=[TextBlock(text="caught it")])


MIDDLEWARE.update({cls.__name__: cls for cls in (RaisesOwnError, CatchByBase)})


class AsksEveryTime(MiddlewareBase):
    """on_check_permission asks the user for every call, also one the user has confirmed (its
    state ALLOWED): the mistake docs/hooks.md warns of."""

    async def on_check_permission(self, agent, input_kwargs, next_handler):
        from agentmw.data import PermissionBehavior, PermissionDecision

        return PermissionDecision(behavior=PermissionBehavior.ASK, message="sure?")


MIDDLEWARE[AsksEveryTime.__name__] = AsksEveryTime


class ToolsAfterWarmup(MiddlewareBase):
    """A tool source whose backend is down until the file ``ready`` exists: its list_tools raises
    until then, and lists one tool after."""

    def __init__(self, ready: str = "") -> None:
        self.ready = ready

    async def list_tools(self):
        import os

        if not os.path.exists(self.ready):
            raise ConnectionError("the tool backend is down")

        @tool
        def lookup(item: str) -> str:
            """Looks an item up."""
            return f"found {item}"

        return [lookup]


MIDDLEWARE[ToolsAfterWarmup.__name__] = ToolsAfterWarmup


from agentmw.data import events  # noqa: E402 (beside the class that needs it)


class NotesWhenParked(MiddlewareBase):
    """When the reply parks on a confirmation it appends a note of its own, a message after the
    assistant's, whose tool call awaits the user (which the host refuses)."""

    subscriptions = {"on_reply": subscribe(intercept=[events.RequireUserConfirmEvent], wants_context=True)}

    async def on_reply(self, agent, input_kwargs, next_handler):
        async for item in next_handler():
            if isinstance(item, events.RequireUserConfirmEvent):
                agent.state.context.append(AssistantMsg("(waiting for a confirmation)", name="notes"))
            yield item


MIDDLEWARE[NotesWhenParked.__name__] = NotesWhenParked


class PassesANewMessage(MiddlewareBase):
    """on_reply passes the user's message on as a new one (a redactor's way: a new UserMsg, a new
    id), masking digits."""

    async def on_reply(self, agent, input_kwargs, next_handler):
        inputs = input_kwargs.get("inputs")
        if isinstance(inputs, Msg) and inputs.role.value == "user":
            masked = UserMsg("".join("#" if c.isdigit() else c for c in inputs.text), name=inputs.name)
            input_kwargs["inputs"] = masked
        async for item in next_handler():
            yield item


MIDDLEWARE[PassesANewMessage.__name__] = PassesANewMessage
