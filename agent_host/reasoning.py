"""Reasoning (docs/behaviour.md#reasoning): one model call through the on_model_call chain, with
retries and fallbacks, streamed as block events and saved to the context."""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import AsyncIterator
from typing import Any

from agentmw.chain import closing
from agentmw.data import (
    AssistantMsg,
    ChatResponse,
    DataBlock,
    FinishedReason,
    ModelCallEndEvent,
    ModelCallStartEvent,
    Msg,
    ReplyFinishedReason,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
    ToolChoice,
    ToolResultState,
    Usage,
)

from . import metrics
from .agent_base import END, AgentBase, ReplyError
from .chunk_events import ChunkConverter
from .models.retry import Failure, call_with_fallback
from .reply_grammar import blame_of

YIELD_EVERY_CHUNKS = 16  # fairness under concurrency costs ~3% CPU on a 1,000-delta reply (bench)
# The result of a tool call in a model output that was cut (finish reason length / content_filter).
_CUT_CALL = (
    "<system-reminder>Not run: the model's output was cut ({reason}) before this call was complete, "
    "so its arguments may be incomplete.</system-reminder>"
)


# What a model's response may hold (types.proto ChatResponse): what the assistant's turn is made of.
_RESPONSE_BLOCKS = (TextBlock, ToolCallBlock, ThinkingBlock, DataBlock)


class Reasoning(AgentBase):
    async def _reasoning_impl(self, tool_choice: ToolChoice | None = None) -> AsyncIterator[Any]:
        state = self.state
        reply_id = state.reply_id
        messages, tools = await self.prepare_model_input(tool_choice)
        completed: ChatResponse | None = None
        converter = ChunkConverter(reply_id)
        # What the converter saw streamed is the response to save if the stream ends without one. It
        # does when cut while it awaits the model (its partial as the last chunk), but not when the
        # interrupt came while this generator was suspended between items (a slow client or
        # on_reply middleware), nor through every on_model_call middleware.
        began = time.monotonic()
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
                async with closing(result) as chunks:
                    count = 0
                    while (chunk := await self._interruptible(anext(chunks, END))) is not END:
                        if type(chunk) is not ChatResponse:  # None included: the end is END
                            self.check_yield("on_model_call", "the model call", chunk)
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
                completed = converter.so_far(FinishedReason.INTERRUPTED, began)
            if not started:
                yield ModelCallStartEvent(reply_id=reply_id, model_name=used, metadata=self._call_metadata(used))
        except Exception as exc:
            if not started:  # nothing reached the client: the reply fails as before
                raise
            # Failed mid-stream: close what is open, end the call, keep what the user saw (below).
            failure = exc
            attempt = 1 + sum(f["model"] == used for f in self._model_failures)
            metrics.model_attempt_failed(Failure(used, exc, attempt, None))  # the reply's error follows
            partial = getattr(exc, "partial", None)  # a ModelError's (a remote one's may be any JSON)
            completed = partial if isinstance(partial, ChatResponse) else converter.so_far(FinishedReason.ERROR, began)
            completed.finished_reason = FinishedReason.ERROR
        for event in converter.close_all():
            yield event
        if completed is None:
            layers = self.layers["on_model_call"]
            if not layers:
                raise ReplyError(f"model {used!r} returned an empty streaming response")
            # A middleware's stream may not be the model's at all: blame who can end it so.
            who = blame_of(layers, "on_model_call")
            raise ReplyError(f"the response stream of the call to model {used!r} had no last chunk (is_last) ({who})")
        self._check_response(completed, used)
        usage = completed.usage
        # An interrupted or failed reply stops at the end event, so its partial content is saved before it
        # (docs/behaviour.md#interruption).
        partial = completed.finished_reason in (FinishedReason.INTERRUPTED, FinishedReason.ERROR)
        saved = self._save_to_context(completed) if partial and completed.content else None
        if failure is not None and saved is not None:
            saved.metadata["incomplete"] = {"model": used, "error": f"{type(failure).__name__}: {failure}"}
        metadata = self._call_metadata(used)
        metadata.update({k: v for k, v in completed.metadata.items() if k == "request_id"})
        request_id = getattr(failure, "request_id", "")  # a ModelError's
        if request_id:
            metadata["request_id"] = request_id
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

    def _check_response(self, response: ChatResponse, used: str) -> None:
        """Before the response is saved as the assistant's turn: only blocks a model produces. A
        model client cannot break this; an on_model_call middleware can (in-process or remote), and a
        tool result in it would enter the session with no call of its own (a context real providers
        refuse from then on)."""
        for block in response.content:
            if not isinstance(block, _RESPONSE_BLOCKS):
                who = blame_of(self.layers["on_model_call"], "on_model_call")
                raise ReplyError(
                    f"the response of model {used!r} holds a {block.type} block, which a model response "
                    f"cannot ({who}): only text, tool_call, thinking and data blocks"
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
                self,
                current_model=self.models.get(model_id).ref,  # a snapshot: no layer can change the shared model
                messages=messages,
                tools=tools,
                tool_choice=tool_choice,
                parameters=None,  # every key of the hook is present (hooks.py), as a remote layer gets them
            )
            return result, (self._models_used[-1] if self._models_used else model_id)

        (result, used), _ = await call_with_fallback(
            self.models.candidates(self.model.id),
            attempt,
            lambda f: self._model_failures.append(metrics.model_attempt_failed(f)),
            f"session={self.state.session_id} reply={self.state.reply_id or '-'}",  # as the reply's own line
        )
        return result, used

    def _model_override(self, kwargs: dict[str, Any], received: dict[str, Any]) -> dict[str, Any]:
        """A current_model a layer replaced (an id, a ModelRef, a model) reaches the layers inside
        it as the registered model's snapshot, the override's parameters included: what the layer
        first called gets, in process and out alike (a remote layer's override arrives here too)."""
        model = kwargs.get("current_model")
        if model is not None and model is not received.get("current_model"):
            kwargs["current_model"] = self.models.snapshot(model)
        return kwargs

    async def _model_call_impl(
        self,
        current_model: Any,
        messages: list[Msg],
        tools: list[dict],
        tool_choice: ToolChoice | None,
        parameters: dict[str, Any] | None = None,
    ) -> Any:
        model, parameters = self.models.for_call(current_model, parameters)
        self._models_used.append(model.id)
        return await model(messages, tools, tool_choice, parameters)
