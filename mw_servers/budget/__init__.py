"""ReplyBudget: a token budget per reply; once it is spent, the agent must wrap up without tools.

After AgentScope's ReplyBudgetControlMiddleware (see docs/budget.md). Two hooks:

- ``on_reply`` counts. A ``ReplyStartEvent`` resets the slot to the new reply; every
  ``ModelCallEndEvent`` adds ``input_token_weight * input_tokens + output_token_weight *
  output_tokens``. Both are intercepted (lock-step), so the count is in the slot before the next
  step starts; every other item bypasses the middleware.
- ``on_reasoning`` enforces. Once ``used >= token_budget`` (the slot's ``exhausted``), each reasoning step gets a hint
  (appended to the agent's last assistant message, or a new one for this reply) and
  ``tool_choice`` "none"; while a structured output is still owed, only the structured-output
  tool stays allowed instead. A ``CustomEvent("budget_exhausted")`` tells the client.

All state is in the session: ``agent.state.middle_context[key]`` holds ``{"reply_id", "used",
"budget", "remaining", "exhausted"}``, written by ``on_reply`` only (``on_reasoning`` just reads it). The
process keeps nothing between calls, so it can be restarted or replicated freely, and the same
class works in-process
(``Agent(middlewares=[ReplyBudget(token_budget=...)])``) and as a server
(``python -m mw_servers.budget --token-budget N``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import AsyncIterator
from typing import Any

from agent_host.agent import STRUCTURED_OUTPUT_TOOL
from agentmw.data import CustomEvent, HintBlock, ModelCallEndEvent, ReplyStartEvent, ToolChoice
from agentmw.hooks import check_middleware_key
from agentmw.sdk import MiddlewareBase, ReasoningKwargs, ReplyKwargs, Subscription, subscribe

DEFAULT_KEY = "ReplyBudget"
DEFAULT_HINT = (
    "<system-reminder>The token budget of this reply is used up. Do not call any more tools: give "
    "your final answer now, based on what you have.</system-reminder>"
)
STRUCTURED_HINT = (
    "<system-reminder>The token budget of this reply is used up. Call {tool} now to give the "
    "required structured output; no other tool is available.</system-reminder>"
)
HINT_SOURCE = '{"label": "System", "sublabel": "Reply Budget"}'
EXHAUSTED = "budget_exhausted"  # the CustomEvent's name


NUMBERS = ("token_budget", "input_token_weight", "output_token_weight")


def check_setting(name: str, value: Any) -> Any:
    """``value`` if ReplyBudget takes it as its setting ``name``, else a ValueError saying what it
    must be, without the name: the constructor names the argument, the server where it came from."""
    if name in NUMBERS:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise ValueError(f"must be a finite number >= 0, got {value!r}")
    elif not isinstance(value, str):  # hint_message (sent in a HintBlock), key
        raise ValueError(f"must be a string, got {type(value).__name__} {value!r}")
    elif name == "key":
        try:
            check_middleware_key(value)  # the host's rule: refused here, not at every attach
        except ValueError as exc:
            raise ValueError(f"must be a middleware key a host takes: {exc}") from None
    return value


def _number(value: float) -> float | int:
    """Whole numbers as ints, so the slot reads {"used": 120} rather than 120.0."""
    return int(value) if float(value).is_integer() else value


class ReplyBudget(MiddlewareBase):
    subscriptions = {
        # Only these two: the count must be in the slot before the next step starts (INTERCEPT).
        # It calls next first thing (eager_next), nothing after a yield waits for the consumer
        # (run_ahead), nothing follows the inner pipeline's end (done_with_inner): a round trip
        # less at the start, per counted item and at the end.
        "on_reply": subscribe(
            intercept=[ReplyStartEvent, ModelCallEndEvent], eager_next=True, run_ahead=True, done_with_inner=True
        ),
        # Acts before calling next; no item of the step concerns it, nothing comes after it; and
        # it passes through until the slot says the budget is spent (see subscription()).
        "on_reasoning": subscribe(done_with_inner=True, only_when="exhausted"),
    }

    def __init__(
        self,
        token_budget: float,
        input_token_weight: float = 1.0,
        output_token_weight: float = 1.0,
        hint_message: str = DEFAULT_HINT,
        key: str = DEFAULT_KEY,
    ) -> None:
        for name, value in (
            ("token_budget", token_budget),
            ("input_token_weight", input_token_weight),
            ("output_token_weight", output_token_weight),
            ("hint_message", hint_message),
            ("key", key),
        ):
            try:
                check_setting(name, value)
            except ValueError as exc:
                raise ValueError(f"{name} {exc}") from None
        self.token_budget = _number(token_budget)
        self.input_token_weight = float(input_token_weight)
        self.output_token_weight = float(output_token_weight)
        self.hint_message = hint_message
        self.key = key

    async def get_middleware_key(self) -> str:
        return self.key

    def subscription(self, hook: str) -> Subscription:
        # only_when promises a pass-through while the flag is off. A budget of 0 restricts even a
        # step that finds no slot of this reply (attached while the reply was paused): always called.
        sub = super().subscription(hook)
        return dataclasses.replace(sub, only_when="") if hook == "on_reasoning" and not self.token_budget else sub

    def _slot(self, reply_id: str, used: float = 0) -> dict[str, Any]:
        return {
            "reply_id": reply_id,
            "used": _number(used),
            "budget": self.token_budget,
            "remaining": _number(max(self.token_budget - used, 0)),
            "exhausted": used >= self.token_budget,  # on_reasoning's only_when: it acts from then on
        }

    def _current(self, agent: Any, reply_id: str) -> dict[str, Any]:
        """This reply's slot; a slot of another reply (or none) counts as a fresh one."""
        slot = agent.state.middle_context.get(self.key)
        return slot if isinstance(slot, dict) and slot.get("reply_id") == reply_id else self._slot(reply_id)

    async def on_reply(self, agent: Any, input_kwargs: ReplyKwargs, next_handler: Any) -> AsyncIterator[Any]:
        async for item in next_handler():
            if isinstance(item, ReplyStartEvent):
                agent.state.middle_context[self.key] = self._slot(item.reply_id)
            elif isinstance(item, ModelCallEndEvent):
                slot = self._current(agent, item.reply_id)
                cost = self.input_token_weight * item.input_tokens + self.output_token_weight * item.output_tokens
                agent.state.middle_context[self.key] = self._slot(item.reply_id, slot["used"] + cost)
            yield item

    async def on_reasoning(self, agent: Any, input_kwargs: ReasoningKwargs, next_handler: Any) -> AsyncIterator[Any]:
        state = agent.state
        slot = self._current(agent, state.reply_id)
        if slot["used"] < self.token_budget:  # not exhausted: the pass-through only_when promises
            async for item in next_handler():
                yield item
            return
        tool_choice = input_kwargs.get("tool_choice")
        if state.reply_context.structured_output_pending:
            # Only the structured-output tool; forced only if the loop already forced it (some
            # thinking-mode providers reject a forced tool).
            forced = tool_choice is not None and tool_choice.mode == STRUCTURED_OUTPUT_TOOL
            tool_choice = ToolChoice(mode=STRUCTURED_OUTPUT_TOOL if forced else "auto", tools=[STRUCTURED_OUTPUT_TOOL])
            hint = STRUCTURED_HINT.format(tool=STRUCTURED_OUTPUT_TOOL)
        else:
            tool_choice = ToolChoice(mode="none")
            hint = self.hint_message
        state.append_to_last_assistant(agent.name, [HintBlock(hint=hint, source=HINT_SOURCE)])
        # The slot is on_reply's alone: with one writer no hook can overwrite the other's count.
        yield CustomEvent(
            name=EXHAUSTED,
            value={
                "key": self.key,
                "reply_id": state.reply_id,
                "used": slot["used"],
                "budget": self.token_budget,
                "tool_choice": tool_choice.mode,
            },
        )
        async for item in next_handler(tool_choice=tool_choice):
            yield item


__all__ = ["DEFAULT_HINT", "DEFAULT_KEY", "EXHAUSTED", "NUMBERS", "ReplyBudget", "check_setting"]
