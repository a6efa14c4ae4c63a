"""TracingMiddleware: OpenTelemetry GenAI spans of replies, model calls and tool calls.

The same class runs in-process (``Agent(middlewares=[TracingMiddleware()])``) or as a server
(``python -m mw_servers.tracing``). Its three hooks are detached: the host never waits for it.
Copies reach a detached hook late, so every span is made when its invocation ends, with start and
end times taken from the items' own timestamps (see docs/tracing.md):

* ``invoke_agent <agent>`` per reply (on_reply): from its first to its last item;
* ``chat <model>`` per model call (on_model_call): ends at the final ChatResponse's ``created_at``
  and starts ``usage.time`` seconds before it (a failed call: its exception's ``partial``);
* ``execute_tool <tool>`` per tool call (on_acting), timed by the reply's ToolResultStartEvent and
  ToolResultEndEvent for that call (tool items carry no timestamps); and one ``execute_tool``
  span per externally executed result, at the time the result arrived.

Parent: the host's span for the hook invocation (``agent.trace_context``) when the host traces,
else the current context. With no SDK TracerProvider installed, every hook is a pass-through.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Status, StatusCode

from agent_host import tracing
from agentmw.data import (
    ChatResponse,
    ExternalExecutionResultEvent,
    FinishedReason,
    Msg,
    ReplyEndEvent,
    ReplyStartEvent,
    RequireExternalExecutionEvent,
    RequireUserConfirmEvent,
    ToolResponse,
    ToolResultEndEvent,
    ToolResultStartEvent,
    UserConfirmResultEvent,
)
from agentmw.middleware import ActingKwargs, MiddlewareBase, ModelCallKwargs, ReplyKwargs, Subscription, subscribe
from agentmw.subscriptions import CHAT_FINAL

log = logging.getLogger("agentmw.tracing")

TRACER = "agentmw.tracing"
NO_SESSION = "[no_session_id]"
MAX_PENDING_TOOLS = 1024  # tool calls waiting for their other half (times or result)

# Provider names of the GenAI conventions, refined by fragments of an OpenAI-compatible base URL.
_PROVIDER_BY_URL = {
    "deepseek": "deepseek",
    "api.x.ai": "x_ai",
    "moonshot": "moonshot",
    "minimax": "minimax",
    "volces": "volcengine",
    "dashscope": "dashscope",
    "anthropic": "anthropic",
    "generativelanguage": "gcp.gemini",
    ":11434": "ollama",
}
_REQUEST_PARAMS = ("temperature", "top_p", "top_k", "max_tokens", "presence_penalty", "frequency_penalty", "seed")


class TracingMiddleware(MiddlewareBase):
    """GenAI spans of what the agent does; never holds it up (all hooks detached)."""

    subscriptions = {
        "on_reply": subscribe(
            observe=[
                ReplyStartEvent,
                ReplyEndEvent,
                RequireUserConfirmEvent,
                RequireExternalExecutionEvent,
                ToolResultStartEvent,
                ToolResultEndEvent,
                Msg,
            ],
            detached=True,
        ),
        "on_model_call": subscribe(observe=[CHAT_FINAL], detached=True),
        "on_acting": subscribe(observe=[ToolResponse], detached=True),
    }

    def __init__(self) -> None:
        self.tools = _ToolSpans()

    def subscription(self, hook: str) -> Subscription:
        # Served without an exporter: ask for no copies at all (a begin and an end per call).
        return super().subscription(hook) if tracing.enabled() else subscribe(detached=True)

    # -- on_reply: invoke_agent ------------------------------------------------------------------

    async def on_reply(self, agent: Any, input_kwargs: ReplyKwargs, next_handler: Any) -> AsyncIterator[Any]:
        if not tracing.enabled():
            async for item in next_handler():
                yield item
            return
        parent = _parent(agent)
        reply = _Reply()
        error: BaseException | None = None
        try:
            async for item in next_handler():
                reply.see(item, self.tools)
                yield item
        except GeneratorExit:
            raise
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._reply_span(agent, input_kwargs.get("inputs"), parent, reply, error)

    def _reply_span(self, agent: Any, inputs: Any, parent: Any, reply: _Reply, error: BaseException | None) -> None:
        conversation = agent.state.session_id or NO_SESSION
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": agent.name,
            "gen_ai.agent.description": agent.description or "No description available",
            "gen_ai.conversation.id": conversation,
        }
        if isinstance(inputs, UserConfirmResultEvent):
            attrs["agentscope.agent.incoming_event_type"] = "user_confirm_result"
        elif isinstance(inputs, ExternalExecutionResultEvent):
            attrs["agentscope.agent.incoming_event_type"] = "external_execution_result"
        elif inputs is not None:
            msgs = [inputs] if isinstance(inputs, Msg) else list(inputs)
            attrs["gen_ai.input.messages"] = _dumps([_message(m, "stop") for m in msgs])
        start = reply.first or _ns(getattr(inputs, "created_at", None))
        end = reply.last or start
        failure = error if isinstance(error, Exception) else None  # not an interruption (CancelledError)
        if failure is not None:  # the failure is the reply's last moment (no end event comes through here)
            when = _failed_at(failure)
            end = when if end is None else max(end, when)
        span = _tracer().start_span(f"invoke_agent {agent.name}", context=parent, attributes=attrs, start_time=start)
        if isinstance(inputs, ExternalExecutionResultEvent):  # the results arrived: spans of their own
            child = trace.set_span_in_context(span)
            for result in inputs.execution_results:
                # When the host took the result in (its ToolResultEndEvent), else when it was sent.
                at = reply.results.get(result.id) or _ns(inputs.created_at) or start
                _tracer().start_span(
                    f"execute_tool {result.name}",
                    context=child,
                    start_time=at,
                    attributes={
                        "gen_ai.operation.name": "execute_tool",
                        "gen_ai.tool.call.id": result.id,
                        "gen_ai.tool.name": result.name,
                        "gen_ai.conversation.id": conversation,
                        "agentscope.agent.is_external_execution": True,
                        "gen_ai.tool.call.result": _dumps(result.output),
                    },
                ).end(end_time=at)
        span.set_attribute("agentscope.agent.reply_id", reply.reply_id or agent.state.reply_id)
        if reply.hitl:
            span.set_attribute("agentscope.agent.hitl_pending_tools", _dumps(reply.hitl))
        if reply.external:
            span.set_attribute("agentscope.agent.external_execution_pending_tools", _dumps(reply.external))
        partial = _partial(failure) if failure is not None else None
        if reply.msg is not None:
            finish = "stop" if reply.msg.finished_reason in (None, "completed") else str(reply.msg.finished_reason)
            span.set_attribute("gen_ai.output.messages", _dumps([_message(reply.msg, finish)]))
        elif partial is not None and _parts(partial.content):  # what the user saw of a failed model call
            output = {"role": "assistant", "parts": _parts(partial.content), "finish_reason": "error"}
            span.set_attribute("gen_ai.output.messages", _dumps([output]))
        _end(span, error, end)

    # -- on_model_call: chat -----------------------------------------------------------------------

    async def on_model_call(self, agent: Any, input_kwargs: ModelCallKwargs, next_handler: Any) -> Any:
        if not tracing.enabled():
            return await next_handler()
        parent = _parent(agent)
        try:
            result = await next_handler()
        except Exception as exc:
            self._chat_span(agent, input_kwargs, parent, None, exc)
            raise
        if isinstance(result, ChatResponse):
            self._chat_span(agent, input_kwargs, parent, result, None)
            return result
        return self._chat_stream(agent, input_kwargs, parent, result)

    async def _chat_stream(self, agent: Any, kwargs: ModelCallKwargs, parent: Any, stream: Any) -> AsyncIterator[Any]:
        # Only the final chunk is the response; a stream cut before it (the reply was interrupted,
        # its client left) has none, in-process (closed) as remotely (its copies just end).
        last: ChatResponse | None = None
        error: BaseException | None = None
        try:
            async for chunk in stream:
                if chunk.is_last:
                    last = chunk
                yield chunk
        except GeneratorExit:
            raise
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._chat_span(agent, kwargs, parent, last, error)

    def _chat_span(
        self, agent: Any, kwargs: ModelCallKwargs, parent: Any, final: ChatResponse | None, error: BaseException | None
    ) -> None:
        model = kwargs.get("current_model")
        model_name = getattr(model, "model_name", "") or getattr(model, "id", "") or str(model or "")
        provider = getattr(model, "provider", "") or "unknown"
        base_url = getattr(model, "base_url", "") or ""
        provider = next((p for frag, p in _PROVIDER_BY_URL.items() if frag in base_url), provider)
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": provider,
            "gen_ai.request.model": model_name,
            "gen_ai.conversation.id": agent.state.session_id or NO_SESSION,
        }
        # What the request carried: the call's own parameters (a middleware's) over the model's.
        params = {**(getattr(model, "parameters", None) or {}), **(kwargs.get("parameters") or {})}
        for name in _REQUEST_PARAMS:
            if isinstance(params.get(name), (int, float)):
                attrs[f"gen_ai.request.{name}"] = params[name]
        if params.get("stop"):
            attrs["gen_ai.request.stop_sequences"] = _dumps(params["stop"])
        tools, choice = kwargs.get("tools") or [], kwargs.get("tool_choice")
        if tools and getattr(choice, "mode", "auto") != "none":
            attrs["gen_ai.tool.definitions"] = _dumps([_tool_definition(t) for t in tools])
        attrs["gen_ai.input.messages"] = _dumps([_message(m, "stop") for m in kwargs.get("messages") or []])
        # A failed call ends in an exception, which carries the response so far (ModelError.partial:
        # its time, duration, usage and content) when a model client raised it.
        failure = error if isinstance(error, Exception) else None  # not an interruption (CancelledError)
        failed = failure is not None
        if final is None and failure is not None:
            final = _partial(failure)
        end = _ns(final.created_at) if final is not None else _failed_at(failure) if failure is not None else None
        seconds = final.usage.time if final is not None and final.usage is not None else 0.0
        start = end - int(seconds * 1e9) if end is not None else None
        span = _tracer().start_span(f"chat {model_name}", context=parent, attributes=attrs, start_time=start)
        if final is None and error is None:  # cut before its response: nothing to report but that
            span.set_attribute("gen_ai.response.finish_reasons", _dumps(["interrupted"]))
        if failed:
            reason = "error"
            span.set_attribute("gen_ai.response.finish_reasons", _dumps([reason]))
            kind = getattr(failure, "error_type", None)  # a ModelError's: upstream, rate_limit, ...
            span.set_attribute("error.type", str(_jsonable(kind)) if kind else type(failure).__name__)
        if final is not None:
            if not failed:
                reason = _FINISH_REASONS.get(final.finished_reason, "unknown")
                span.set_attribute("gen_ai.response.finish_reasons", _dumps([reason]))
            answered = not failed or bool(final.content)  # a call that failed before any chunk has no response
            if answered:
                span.set_attribute("gen_ai.response.id", final.id)
            usage = final.usage
            if usage is not None and (not failed or usage.input_tokens or usage.output_tokens):
                span.set_attribute("gen_ai.usage.input_tokens", usage.input_tokens)
                span.set_attribute("gen_ai.usage.output_tokens", usage.output_tokens)
                for name in ("cache_input_tokens", "cache_creation_input_tokens"):
                    if getattr(usage, name):  # only when the provider reported some
                        span.set_attribute(f"agentscope.usage.{name}", getattr(usage, name))
            if answered:
                output = {"role": "assistant", "parts": _parts(final.content), "finish_reason": reason}
                span.set_attribute("gen_ai.output.messages", _dumps([output]))
        _end(span, error, end)

    # -- on_acting: execute_tool -------------------------------------------------------------------

    async def on_acting(self, agent: Any, input_kwargs: ActingKwargs, next_handler: Any) -> AsyncIterator[Any]:
        if not tracing.enabled():
            async for item in next_handler():
                yield item
            return
        parent = _parent(agent)
        call = input_kwargs["tool_call"]
        last: Any = None
        error: BaseException | None = None
        try:
            async for item in next_handler():
                last = item
                yield item
        except GeneratorExit:  # the agent had its ToolResponse
            raise
        except BaseException as exc:
            error = exc
            raise
        finally:
            attrs = {
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.call.id": call.id,
                "gen_ai.tool.name": call.name,
                "gen_ai.tool.call.arguments": call.input,
                "gen_ai.conversation.id": agent.state.session_id or NO_SESSION,
            }
            if last is not None:
                attrs["gen_ai.tool.call.result"] = _dumps(last)
            key = (agent.state.reply_id, call.id)
            self.tools.acted(key, _ToolCall(f"execute_tool {call.name}", parent, attrs, error))


# ---------------------------------------------------------------------------------------------
# What a reply showed, and tool calls whose span waits for its other half.


class _Reply:
    __slots__ = ("external", "first", "hitl", "last", "msg", "reply_id", "results")

    def __init__(self) -> None:
        self.first: int | None = None
        self.last: int | None = None
        self.reply_id = ""
        self.hitl: list[str] = []
        self.external: list[str] = []
        self.msg: Msg | None = None
        self.results: dict[str, int | None] = {}  # tool call id -> time of its ToolResultEndEvent

    def see(self, item: Any, tools: _ToolSpans) -> None:
        at = _ns(getattr(item, "created_at", None))
        if at is not None:
            self.first = at if self.first is None else min(self.first, at)
            self.last = at if self.last is None else max(self.last, at)
        if isinstance(item, ReplyStartEvent):
            self.reply_id = item.reply_id
        elif isinstance(item, RequireUserConfirmEvent):
            self.hitl.extend(c.name for c in item.tool_calls)
        elif isinstance(item, RequireExternalExecutionEvent):
            self.external.extend(c.name for c in item.tool_calls)
        elif isinstance(item, (ToolResultStartEvent, ToolResultEndEvent)):
            tools.timed((item.reply_id, item.tool_call_id), isinstance(item, ToolResultEndEvent), at)
            if isinstance(item, ToolResultEndEvent):
                self.results[item.tool_call_id] = at
        elif isinstance(item, Msg):
            self.msg = item


@dataclasses.dataclass
class _ToolCall:
    name: str
    parent: Any
    attributes: dict[str, Any]
    error: BaseException | None


_CallKey = tuple[str, str]  # (reply id, tool call id)


class _ToolSpans:
    """A tool span needs on_acting's call and result and on_reply's start and end times, which
    arrive in either order (separate streams): whichever comes second makes the span. Keyed by
    reply and call id: one server traces every session, and call ids repeat across them (models
    number their calls: the offline model's are call_1_0, ... in every reply; a key of the call id
    alone paired one reply's call with another's times). Bounded: the oldest entries go (a call
    without times is then ended at once)."""

    def __init__(self) -> None:
        self.calls: OrderedDict[_CallKey, _ToolCall] = OrderedDict()
        self.times: OrderedDict[_CallKey, list[int | None]] = OrderedDict()

    def acted(self, key: _CallKey, call: _ToolCall) -> None:
        self.calls[key] = call
        self._settle(key)

    def timed(self, key: _CallKey, end: bool, at: int | None) -> None:
        times = self.times.setdefault(key, [None, None])
        times[int(end)] = at
        if end:
            self._settle(key)

    def _settle(self, key: _CallKey) -> None:
        times = self.times.get(key)
        if key in self.calls and times is not None and times[1] is not None:
            del self.times[key]
            self._span(self.calls.pop(key), times[0] or times[1], times[1])
        while len(self.calls) > MAX_PENDING_TOOLS:
            self._span(self.calls.popitem(last=False)[1], None, None)
        while len(self.times) > MAX_PENDING_TOOLS:
            self.times.popitem(last=False)

    @staticmethod
    def _span(call: _ToolCall, start: int | None, end: int | None) -> None:
        span = _tracer().start_span(call.name, context=call.parent, attributes=call.attributes, start_time=start)
        _end(span, call.error, end)


# ---------------------------------------------------------------------------------------------
# Helpers.


def _tracer() -> trace.Tracer:
    return tracing.tracer(TRACER)


def _parent(agent: Any) -> otel_context.Context:
    """The host's span of this hook invocation when it traces, else the current context."""
    carrier = getattr(agent, "trace_context", None)
    return propagate.extract(carrier) if carrier else otel_context.get_current()


def _partial(error: BaseException) -> ChatResponse | None:
    """A failed model call's response so far (ModelError.partial; a remote hook's InnerError.partial)."""
    partial = getattr(error, "partial", None)
    return partial if isinstance(partial, ChatResponse) else None


def _failed_at(error: BaseException) -> int:
    """When ``error`` happened: a remote hook gets it late, with the time (InnerError.created_at);
    in process it arrives as it happens."""
    at = _ns(getattr(error, "created_at", None))
    return at if at is not None else time.time_ns()


def _end(span: Any, error: BaseException | None, end: int | None) -> None:
    if error is not None:
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    else:
        span.set_status(Status(StatusCode.OK))
    start = getattr(span, "start_time", None)
    span.end(end_time=max(end, start) if end is not None and start is not None else end)


# gen_ai.response.finish_reasons: AgentScope's "stop" / "interrupted", and for the reasons this
# host adds (a cut or failed call) the GenAI semantic convention's own values.
_FINISH_REASONS = {
    FinishedReason.COMPLETED: "stop",
    FinishedReason.INTERRUPTED: "interrupted",
    FinishedReason.LENGTH: "length",
    FinishedReason.CONTENT_FILTER: "content_filter",
    FinishedReason.ERROR: "error",
}


def _ns(timestamp: str | None) -> int | None:
    """ISO-8601 (the wire's created_at, local time when it has no zone) -> ns since the epoch."""
    if not timestamp:
        return None
    try:
        return int(datetime.fromisoformat(timestamp).timestamp() * 1e9)
    except ValueError:
        return None


def _jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def _json_default(obj: Any) -> Any:
    """What json cannot write itself (a dataclass, an enum): as _jsonable makes it, else its str."""
    value = _jsonable(obj)
    return str(obj) if value is obj else value


def _dumps(obj: Any) -> str:
    # json's C encoder walks the plain dicts and lists (a whole prompt per model call), and only
    # dataclasses and enums come back here: 2.6x faster than walking it all with _jsonable first.
    # Keys json refuses (not from a Struct: an in-process tool's own objects) take the slow path.
    try:
        return json.dumps(obj, ensure_ascii=False, default=_json_default)
    except TypeError:
        return json.dumps(_jsonable(obj), ensure_ascii=False, default=str)


def _part(block: Any) -> dict[str, Any] | None:
    """A content block as a GenAI message part; hint blocks are left out."""
    kind = getattr(block, "type", "")
    if kind == "text":
        return {"type": "text", "content": block.text}
    if kind == "thinking":
        return {"type": "reasoning", "content": block.thinking}
    if kind == "tool_call":
        try:
            arguments = json.loads(block.input) if block.input else {}
        except ValueError:
            arguments = block.input
        return {"type": "tool_call", "id": block.id, "name": block.name, "arguments": arguments}
    if kind == "tool_result":
        return {"type": "tool_call_response", "id": block.id, "response": block.output}  # _dumps converts it
    if kind == "data":
        source = block.source
        modality = source.media_type.split("/", 1)[0]
        if getattr(source, "url", None):
            return {"type": "uri", "uri": source.url, "modality": modality}
        return {"type": "blob", "content": source.data, "media_type": source.media_type, "modality": modality}
    return None


def _parts(blocks: Any) -> list[dict[str, Any]]:
    if isinstance(blocks, str):
        return [{"type": "text", "content": blocks}]
    return [p for p in (_part(b) for b in blocks or []) if p is not None]


def _message(msg: Msg, finish_reason: str) -> dict[str, Any]:
    out = {"role": _jsonable(msg.role), "parts": _parts(msg.content), "finish_reason": finish_reason}
    if msg.name:
        out["name"] = msg.name
    return out


def _tool_definition(schema: dict[str, Any]) -> dict[str, Any]:
    fn = schema.get("function", schema)
    return {
        "type": schema.get("type", "function"),
        "name": fn.get("name", ""),
        "description": fn.get("description", ""),
        "parameters": fn.get("parameters", {}),
    }


__all__ = ["TracingMiddleware"]
