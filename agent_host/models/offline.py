"""OfflineRuleModel: a deterministic chat model that needs no network and no key.

It is the embedded default of the demo and the tests. Per call it takes, in order:

0. a summary, when the agent asks to compress its context;
1. the next scripted turn, if a script is set (``{"text", "thinking", "tool_calls": [{"name",
   "input"}], "error": {"type", "message", "retryable"}, "delay", "finish"}``; ``finish``: the
   call's FinishedReason, e.g. "length" for an answer cut at the token limit);
2. tool calls by rule, while the user's turn has no tool results yet: the user names a known tool
   ("call get_weather city=Paris", "use add {"a": 1, "b": 2}"), or tool rules of ``rules`` match
   (``{"pattern", "tool", "input"}``, one call per matching rule whose tool is offered); a tool
   rule with ``"repeat": true`` calls again after every result, for as long as the agent offers
   the tool (``tool_choice`` "none" or the max_iters limit stops it);
3. the structured-output tool, when the agent owes one: its input filled from the user's words
   and the tool results (numbers from the first number, names from the first capitalized word);
4. an answer that reports the tool results of the current user turn, once there are any;
5. else the first matching text or error rule of ``rules``: ``{"pattern", "text"}`` answers with
   that template, ``{"pattern", "error": {"type", "message", "retryable"}}`` fails the call with
   a ``ModelError`` (as a scripted error does; ``type`` defaults to "upstream");
6. otherwise a text answer from ``reply_template`` (default ``"You said: {text}"``).

Rule patterns are case-insensitive regexes searched in the latest user message. Templates (tool
inputs, ``text`` rules) take the regex groups as ``{0}``, ``{1}``, ... and ``{name}``; text
templates (``text`` rules, ``reply_template``) also take ``{text}``, the user message,
``{system}``, the system prompt, ``{hints}``, the hint blocks that follow the user message
(e.g. a memory middleware's recalled facts), one per line, and ``{parameters}``, the call's request
parameters as JSON (sorted keys: what a provider's request would carry). A rule needs exactly one of ``tool``,
``text``, ``error``.

Text streams word by word; tool-call input streams in two fragments; usage is counted as
input ≈ UTF-8 bytes / 4 of the prompt and output = streamed words.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

from agentmw.data import (
    ChatResponse,
    ChatUsage,
    ErrorType,
    FinishedReason,
    HintBlock,
    Msg,
    Role,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
    ToolChoice,
    ToolResultBlock,
    block_text,
    new_id,
)

from .base import ChatModel, ModelError

STRUCTURED = "GenerateStructuredOutput"  # the agent's structured-output tool (agent_host.agent)
_WORD = re.compile(r"\S+\s*|\s+")
YIELD_EVERY = 64  # chunks streamed between two returns to the event loop when there is no delay
_KV = re.compile(r"(\w+)=(\"[^\"]*\"|'[^']*'|\S+)")


class OfflineRuleModel(ChatModel):
    provider = "offline"

    def __init__(
        self,
        *,
        id: str = "offline",
        script: list[dict[str, Any]] | None = None,
        rules: list[dict[str, Any]] | None = None,
        reply_template: str = "You said: {text}",
        delay: float = 0.0,
        **kw: Any,
    ) -> None:
        super().__init__(id=id, model_name=kw.pop("model_name", "offline-rule-model"), **kw)
        self.script = list(script or [])
        self.rules = [_rule(i, r) for i, r in enumerate(rules or [])]
        self.reply_template = reply_template
        self.delay = delay
        self.calls = 0

    async def _open(
        self,
        messages: list[Msg],
        tools: list[dict[str, Any]],
        tool_choice: ToolChoice | None,
        parameters: dict[str, Any] | None = None,
    ) -> AsyncIterator[ChatResponse]:
        self.calls += 1
        if messages and "<compress-context>" in messages[-1].text:  # the agent asks for a summary
            turn: dict[str, Any] = {"text": self._summary(messages[:-1])}
        elif self.script:
            turn = self.script.pop(0)
        else:
            turn = self._by_rule(messages, tools, tool_choice, parameters or {})
        if "error" in turn:
            err = turn["error"]
            kind = ErrorType(err.get("type", "upstream"))
            raise ModelError(
                err.get("message", f"scripted {kind.value} error"),
                error_type=kind,
                retryable=err.get("retryable", kind in (ErrorType.RATE_LIMIT, ErrorType.UPSTREAM)),
            )
        return self._stream(turn, self.count_tokens(messages))

    def _by_rule(
        self,
        messages: list[Msg],
        tools: list[dict[str, Any]],
        tool_choice: ToolChoice | None,
        parameters: dict[str, Any],
    ) -> dict:
        user_idx = max((i for i, m in enumerate(messages) if m.role == Role.USER and m.text), default=-1)
        user_text = messages[user_idx].text if user_idx >= 0 else ""
        results = [b for m in messages[user_idx + 1 :] for b in m.content if isinstance(b, ToolResultBlock)]
        names = {t["function"]["name"] for t in tools if "function" in t}
        if tool_choice is not None and tool_choice.tools is not None:
            names &= set(tool_choice.tools)
        may_call = bool(names) and (tool_choice is None or tool_choice.mode != "none")
        if may_call and not results:
            calls = self._named_calls(user_text, names) or self._rule_calls(user_text, names)
            if calls:
                return {"tool_calls": calls}
        if may_call and results and (calls := self._rule_calls(user_text, names, repeating=True)):
            return {"tool_calls": calls}  # "repeat" rules go on calling until tools are withheld
        structured = next((t["function"] for t in tools if t.get("function", {}).get("name") == STRUCTURED), None)
        if structured is not None and may_call and STRUCTURED in names:  # a structured output is owed
            facts = " ".join([user_text, *(block_text(r.output) for r in results)])
            return {"tool_calls": [{"name": STRUCTURED, "input": _fill(structured.get("parameters", {}), facts, "")}]}
        if results:
            lines = [f"{r.name} returned {block_text(r.output).strip()}" for r in results]
            return {"text": "Done: " + "; ".join(lines) + "."}
        system = messages[0].text if messages and messages[0].role == Role.SYSTEM else ""
        hints = "\n".join(
            block_text(b.hint) for m in messages[user_idx + 1 :] for b in m.content if isinstance(b, HintBlock)
        )
        fields = {
            "text": user_text,
            "system": system,
            "hints": hints,
            "parameters": json.dumps(parameters, sort_keys=True),
        }
        for rule in self.rules:
            if "tool" in rule or not (match := rule["regex"].search(user_text)):
                continue
            if "error" in rule:
                return {"error": rule["error"]}
            groups = [g or "" for g in match.groups()]
            named = {k: v or "" for k, v in match.groupdict().items()}
            return {"text": rule["text"].format(*groups, **{**fields, **named})}
        return {"text": self.reply_template.format(**fields)}

    @staticmethod
    def _summary(messages: list[Msg]) -> str:
        said = [m.text.strip() for m in messages if m.role == Role.USER and m.text.strip()]
        return f"Summary of {len(messages)} earlier messages. The user said: " + " / ".join(said)

    @staticmethod
    def _named_calls(text: str, names: set[str]) -> list[dict[str, Any]]:
        calls = []
        for match in re.finditer(r"\b(?:call|use|run)\s+([\w.-]+)(.*?)(?=\b(?:and then|then)\b|$)", text, re.I | re.S):
            name, rest = match.group(1), match.group(2)
            if name not in names:
                continue
            brace = re.search(r"\{.*\}", rest, re.S)
            if brace:
                try:
                    args = json.loads(brace.group(0))
                except json.JSONDecodeError:
                    args = {"raw": brace.group(0)}
            else:
                args = {k: _scalar(v) for k, v in _KV.findall(rest)}
            calls.append({"name": name, "input": args})
        return calls

    def _rule_calls(self, text: str, names: set[str], repeating: bool = False) -> list[dict[str, Any]]:
        calls = []
        for rule in self.rules:
            if "tool" not in rule or (repeating and not rule.get("repeat")):
                continue
            match = rule["regex"].search(text)
            if match and rule["tool"] in names:
                args = {
                    k: v.format(*match.groups(), **match.groupdict()) if isinstance(v, str) else v
                    for k, v in rule.get("input", {}).items()
                }
                calls.append({"name": rule["tool"], "input": args})
        return calls

    async def _stream(self, turn: dict[str, Any], input_tokens: int) -> AsyncIterator[ChatResponse]:
        delay = turn.get("delay", self.delay)
        words = 0
        sent = 0  # chunks so far: without a delay, hand the event loop back every YIELD_EVERY of them

        async def pause() -> None:
            nonlocal sent
            sent += 1
            if delay:
                await asyncio.sleep(delay)
            elif sent % YIELD_EVERY == 0:  # a long text (a big summary) must not freeze the host
                await asyncio.sleep(0)

        if turn.get("thinking"):
            block_id = new_id()
            for piece in _pieces(turn["thinking"]):
                await pause()
                yield ChatResponse(content=[ThinkingBlock(id=block_id, thinking=piece)], is_last=False)
        if turn.get("text"):
            block_id = new_id()
            for piece in _pieces(turn["text"]):
                await pause()
                words += 1
                yield ChatResponse(content=[TextBlock(id=block_id, text=piece)], is_last=False)
        for i, call in enumerate(turn.get("tool_calls", [])):
            raw = call["input"] if isinstance(call["input"], str) else json.dumps(call["input"])
            call_id = call.get("id") or f"call_{self.calls}_{i}"
            half = len(raw) // 2
            for j, part in enumerate((raw[:half], raw[half:])):
                await pause()
                name = call["name"] if j == 0 else ""
                yield ChatResponse(content=[ToolCallBlock(id=call_id, name=name, input=part)], is_last=False)
            words += 1
        usage = ChatUsage(input_tokens=input_tokens, output_tokens=words)
        finish = FinishedReason(turn.get("finish") or FinishedReason.COMPLETED)
        yield ChatResponse(content=[], is_last=False, usage=usage, finished_reason=finish)


def _rule(index: int, rule: dict[str, Any]) -> dict[str, Any]:
    """A configured rule, checked, with its compiled ``regex``; a malformed one is a ValueError."""
    kinds = [k for k in ("tool", "text", "error") if k in rule]
    if "pattern" not in rule or len(kinds) != 1:
        raise ValueError(f"rules[{index}]: expected a 'pattern' and exactly one of 'tool', 'text', 'error'")
    if "error" in rule:
        if not isinstance(rule["error"], dict):
            raise ValueError(f"rules[{index}].error: expected a mapping {{type, message, retryable}}")
        try:
            ErrorType(rule["error"].get("type", "upstream"))
        except ValueError:
            known = ", ".join(t.value for t in ErrorType)
            raise ValueError(f"rules[{index}].error.type: unknown {rule['error']['type']!r} (known: {known})") from None
    try:
        regex = re.compile(rule["pattern"], re.I)
    except re.error as exc:
        raise ValueError(f"rules[{index}].pattern: {exc}") from None
    return dict(rule, regex=regex)


def _fill(schema: dict[str, Any], text: str, key: str) -> Any:
    """A value for ``schema`` taken from ``text``: the first number for numbers, the first
    capitalized word for a string named like a name, the text itself for other strings."""
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        return {k: _fill(sub, text, k) for k, sub in (schema.get("properties") or {}).items()}
    if kind in ("integer", "number"):
        number = re.search(r"-?\d+(?:\.\d+)?", text)
        value = float(number.group(0)) if number else float(len(text.split()))
        return int(value) if kind == "integer" else value
    if kind == "boolean":
        return True
    if kind == "array":
        return [_fill(schema.get("items") or {"type": "string"}, word, key) for word in text.split()[:3]]
    if "name" in key.lower():
        return next((w for w in re.findall(r"[A-Z][\w'-]*", text)), text.split()[0] if text.split() else "")
    return text.strip()


def _pieces(text: str) -> Iterator[str]:
    """Word by word, found lazily (a 0.5 MB text is 80k words: no list of them all up front)."""
    if not text:
        yield text
    for match in _WORD.finditer(text):
        yield match.group(0)


def _scalar(text: str) -> Any:
    text = text.strip("\"'")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
