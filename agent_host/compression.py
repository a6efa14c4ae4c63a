"""Context compression (docs/behaviour.md#compression): old messages summarized by the model, or
truncated, once the context nears the model's window."""

from __future__ import annotations

from typing import Any

from agentmw.data import (
    HintBlock,
    SystemMsg,
    ToolChoice,
    UserMsg,
    block_text,
)

from .agent_base import AgentBase, ReplyError

COMPRESSION_PROMPT = (
    "<compress-context>Summarize the conversation above for your future self: the task, the current "
    "state, important discoveries, next steps. Reply with the summary only.</compress-context>"
)


class Compression(AgentBase):
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
        self.state.drop_messages(split)  # bumps the version
