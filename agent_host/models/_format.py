"""Chat-completions wire shapes shared by the DashScope and OpenAI-compatible models.

Both providers speak the same message dialect (system / user / assistant with ``tool_calls`` /
role "tool" results), stream tool calls as fragments keyed by ``index``, and fail with an HTTP
status plus a provider message. This module holds the one copy of each conversion.
"""

from __future__ import annotations

import email.utils
import json
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from agentmw.data import (
    ChatResponse,
    ChatUsage,
    DataBlock,
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
    new_id,
)

from .base import ModelError

T = TypeVar("T")

# -- request side ------------------------------------------------------------------------------


def to_chat_messages(messages: list[Msg], *, image_parts: bool = False) -> list[dict[str, Any]]:
    """Our Msg list as chat messages.

    An assistant Msg holds a whole reply (text, tool calls, their results, more text), so it is
    split into assistant turns with ``tool_calls`` followed by one role "tool" message per result.
    Hint blocks become user messages; thinking blocks are dropped (providers do not take their
    own reasoning back as input). With ``image_parts``, image DataBlocks of user messages become
    OpenAI ``image_url`` content parts; otherwise data blocks appear as a short text placeholder.
    """
    out: list[dict[str, Any]] = []
    for msg in messages:
        if msg.role == Role.SYSTEM:
            out.append({"role": "system", "content": _text_of(msg.content)})
        elif msg.role == Role.USER:
            out.append({"role": "user", "content": _user_content(msg.content, image_parts)})
        else:
            out.extend(_assistant_messages(msg))
    return out


def _assistant_messages(msg: Msg) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None

    def flush() -> None:
        nonlocal turn
        if turn is not None:
            turn["content"] = _join(turn["content"])
            if turn["content"] or turn.get("tool_calls"):
                out.append(turn)
        turn = None

    for block in msg.content:
        if isinstance(block, (TextBlock, DataBlock, ToolCallBlock)):
            if turn is None:
                turn = {"role": "assistant", "content": []}  # text pieces, joined in flush()
            if isinstance(block, ToolCallBlock):
                turn.setdefault("tool_calls", []).append(
                    {
                        "id": block.id,
                        "type": "function",
                        "function": {"name": block.name, "arguments": block.input or "{}"},
                    }
                )
            else:
                turn["content"].append(_text_of([block]))
        elif isinstance(block, ToolResultBlock):
            flush()
            out.append(
                {"role": "tool", "tool_call_id": block.id, "name": block.name, "content": _text_of(block.output)}
            )
        elif isinstance(block, HintBlock):
            flush()
            out.append({"role": "user", "content": _text_of([block])})
        # ThinkingBlock: not sent back
    flush()
    return out


def _text_of(blocks: Any) -> str:
    if isinstance(blocks, str):
        return blocks
    parts = []
    for block in blocks:
        if isinstance(block, TextBlock):
            parts.append(block.text)
        elif isinstance(block, HintBlock):
            parts.append(_text_of(block.hint))
        elif isinstance(block, DataBlock):
            parts.append(f"[{block.source.media_type} {block.name or 'data'}]")
    return _join(parts)


def _join(parts: list[str]) -> str:
    """Text blocks of one message as one content string. AgentScope's formatters send them as
    separate text parts, which servers render one per line; joined with nothing, a partial answer
    and the note after it ("Hello worldThe reply failed: ...") would run together."""
    return "\n".join(part for part in parts if part)


def _user_content(blocks: list[Any], image_parts: bool) -> str | list[dict[str, Any]]:
    if not (image_parts and any(_is_image(b) for b in blocks)):
        return _text_of(blocks)
    parts: list[dict[str, Any]] = []
    for block in blocks:
        if _is_image(block):
            src = block.source
            url = getattr(src, "url", None) or f"data:{src.media_type};base64,{getattr(src, 'data', '')}"
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            text = _text_of([block])
            if text:
                parts.append({"type": "text", "text": text})
    return parts


def _is_image(block: Any) -> bool:
    return isinstance(block, DataBlock) and block.source.media_type.startswith("image/")


def to_tool_choice(choice: ToolChoice | None, tools: list[dict[str, Any]], *, required: bool = True) -> Any:
    """``tool_choice`` for the request, or None to leave it out (it is invalid without tools).

    ``required=False`` is for providers without a "required" mode: a single tool is then forced
    by name, several fall back to "auto".
    """
    if not tools or choice is None or choice.mode == "auto":
        return None
    if choice.mode == "none":
        return "none"
    names = [t["function"]["name"] for t in tools if "function" in t]
    if choice.mode == "required":
        if required:
            return "required"
        return _force(names[0]) if len(names) == 1 else "auto"
    return _force(choice.mode)  # a tool name


def _force(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


# -- response side -----------------------------------------------------------------------------


_SURROGATE = re.compile("[\ud800-\udfff]")
_HIGH = ("\ud800", "\udbff")  # a surrogate pair's first half


def mend_utf16(text: str) -> str:
    """``text`` with UTF-16 surrogate halves joined into their character and a lone half replaced
    by U+FFFD, as an ``errors="replace"`` decode does. JSON ``\\uXXXX`` escapes decode half by half,
    and a str holding a lone half cannot be encoded as UTF-8: every later encoding of the session
    (the reply's events, the stored state) would fail."""
    if _SURROGATE.search(text) is None:
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


class Utf16Joiner:
    """``mend_utf16`` over streamed pieces, per stream (``key``): a high half that ends a piece is
    held until the next piece of its stream, since a gateway that cuts UTF-16 strings sends the
    pair's second half in the next event."""

    def __init__(self) -> None:
        self.held: dict[Any, str] = {}

    def __call__(self, key: Any, piece: str) -> str:
        text = self.held.pop(key, "") + piece
        if text and _HIGH[0] <= text[-1] <= _HIGH[1]:
            text, self.held[key] = text[:-1], text[-1]
        return mend_utf16(text)

    def rest(self, key: Any) -> str:
        """What the stream still holds when it ends: a half whose partner never came, as U+FFFD."""
        return "\ufffd" if self.held.pop(key, "") else ""


class DeltaBlocks:
    """The blocks of one streamed response, from each event's reasoning, text and tool-call
    fragments (both providers send these three), every piece mended (``Utf16Joiner``)."""

    def __init__(self, taken: set[str] | None = None) -> None:
        self.text_id, self.thinking_id = new_id(), new_id()
        self.calls = ToolCallMerger(taken)
        self._mend = Utf16Joiner()

    def add(self, reasoning: Any, text: Any, tool_calls: list[dict[str, Any]] | None) -> list[Any]:
        blocks: list[Any] = []
        thinking = self._mend(self.thinking_id, reasoning or "")
        if thinking:
            blocks.append(ThinkingBlock(id=self.thinking_id, thinking=thinking))
        text = self._mend(self.text_id, text or "")
        if text:
            blocks.append(TextBlock(id=self.text_id, text=text))
        return blocks + self.calls.add(tool_calls)

    def finish(self) -> list[Any]:
        """The last blocks once the stream ended: halves still held, calls still unannounced."""
        blocks: list[Any] = []
        if thinking := self._mend.rest(self.thinking_id):
            blocks.append(ThinkingBlock(id=self.thinking_id, thinking=thinking))
        if text := self._mend.rest(self.text_id):
            blocks.append(TextBlock(id=self.text_id, text=text))
        return blocks + self.calls.finish()


@dataclass
class _Call:
    id: str
    name: str = ""
    waiting: list[str] = field(default_factory=list)  # argument pieces that arrived before the name
    announced: bool = False


class ToolCallMerger:
    """Merges streamed tool-call fragments by ``index`` into ToolCallBlock deltas.

    Only the first fragment of a call carries its id and name; later ones carry only more
    argument text. Every delta of one call gets the same id (the provider's, or a generated one),
    and none is emitted before the name is known, so consumers see the name on the first one.

    ``taken`` holds the ids already in the conversation: some servers number calls per response
    (``call_0`` on every turn), and a repeated id would make the later call look answered. Such a
    call gets a fresh id; ``renamed`` maps it back to the provider's (the transcript sent back
    uses the fresh one consistently, which every server accepts).
    """

    def __init__(self, taken: set[str] | None = None) -> None:
        self.calls: dict[int, _Call] = {}
        self.last: int | None = None
        self.taken = set(taken or ())
        self.renamed: dict[str, str] = {}  # our id -> the provider's
        self._mend = Utf16Joiner()  # per call index

    def _new_call(self, provider_id: str) -> _Call:
        call_id = provider_id or f"call_{new_id()}"
        if call_id in self.taken:
            call_id = f"call_{new_id()}"
            self.renamed[call_id] = provider_id
        self.taken.add(call_id)
        return _Call(id=call_id)

    def add(self, fragments: list[dict[str, Any]] | None) -> list[ToolCallBlock]:
        out: list[ToolCallBlock] = []
        for fragment in fragments or []:
            index = self._index(fragment)
            call = self.calls.get(index)
            if call is None:
                call = self.calls[index] = self._new_call(mend_utf16(fragment.get("id") or ""))
            self.last = index
            function = fragment.get("function") or {}
            call.name = call.name or mend_utf16(function.get("name") or "")
            args = function.get("arguments") or ""
            if not isinstance(args, str):  # some servers send the arguments as an object
                args = json.dumps(args, ensure_ascii=False)
            args = self._mend(index, args)
            if not call.name:
                call.waiting.append(args)
                continue
            args, call.waiting = "".join(call.waiting) + args, []
            if args or not call.announced:
                call.announced = True
                out.append(ToolCallBlock(id=call.id, name=call.name, input=args))
        return out

    def _index(self, fragment: dict[str, Any]) -> int:
        index = fragment.get("index")
        if isinstance(index, int):
            return index
        # No index (some local servers): a known id continues its call, an id or a name starts
        # a new one, and a bare fragment continues the last call.
        frag_id = mend_utf16(fragment.get("id") or "")
        for i, call in self.calls.items():
            if frag_id and frag_id in (call.id, self.renamed.get(call.id)):
                return i
        if frag_id or (fragment.get("function") or {}).get("name") or self.last is None:
            return len(self.calls)
        return self.last

    def finish(self) -> list[ToolCallBlock]:
        """Calls whose name never arrived, so the failure is visible instead of silently lost."""
        out = []
        for index, call in self.calls.items():
            rest = self._mend.rest(index)  # a half held at the end: the call's last piece
            if not call.announced or rest:
                out.append(ToolCallBlock(id=call.id, name=call.name, input="".join(call.waiting) + rest))
            call.announced = True
        return out


def history_call_ids(messages: list[Msg]) -> set[str]:
    """The ids of the tool calls already in the conversation (see ``ToolCallMerger.taken``)."""
    return {b.id for m in messages for b in m.content if isinstance(b, ToolCallBlock)}


# -- finish reasons ------------------------------------------------------------------------------

# A provider's finish_reason -> ours. "stop" / "tool_calls" / "function_call" are COMPLETED.
_FINISH = {
    "length": FinishedReason.LENGTH,
    "max_tokens": FinishedReason.LENGTH,
    "content_filter": FinishedReason.CONTENT_FILTER,
    "sensitive": FinishedReason.CONTENT_FILTER,
}


def finish_reason(reason: str | None) -> FinishedReason:
    return _FINISH.get(reason or "", FinishedReason.COMPLETED)


def usage_of(input_tokens: Any, output_tokens: Any, cached: Any = 0, reasoning: Any = 0) -> ChatUsage:
    reasoning = int(reasoning or 0)
    return ChatUsage(
        input_tokens=int(input_tokens or 0),
        output_tokens=int(output_tokens or 0),
        cache_input_tokens=int(cached or 0),
        reasoning_tokens=reasoning,
        metadata={"reasoning_tokens": reasoning} if reasoning else {},
    )


# -- errors --------------------------------------------------------------------------------------

# Status -> (error type, retryable). Other 4xx are invalid requests; 5xx are retryable upstream errors.
_STATUS: dict[int, tuple[ErrorType, bool]] = {
    400: (ErrorType.INVALID_REQUEST, False),
    401: (ErrorType.AUTHENTICATION, False),
    403: (ErrorType.PERMISSION, False),
    404: (ErrorType.INVALID_REQUEST, False),
    408: (ErrorType.UPSTREAM, True),
    409: (ErrorType.UPSTREAM, True),
    429: (ErrorType.RATE_LIMIT, True),
}

# Provider error codes that say more than the status (DashScope labels an error frame inside a 200
# stream "400" whatever it is). Matched by prefix, first match wins: the order matters.
_CODES: list[tuple[str, ErrorType, bool]] = [
    # quota exhausted: retrying cannot help until someone pays or raises the quota
    ("insufficient_quota", ErrorType.RATE_LIMIT, False),
    ("throttling.allocationquota", ErrorType.RATE_LIMIT, False),
    ("arrearage", ErrorType.RATE_LIMIT, False),
    ("throttling", ErrorType.RATE_LIMIT, True),
    ("rate_limit", ErrorType.RATE_LIMIT, True),
    ("internalerror", ErrorType.UPSTREAM, True),
    ("internal_error", ErrorType.UPSTREAM, True),
    ("serviceunavailable", ErrorType.UPSTREAM, True),
    ("systemerror", ErrorType.UPSTREAM, True),
    ("requesttimeout", ErrorType.UPSTREAM, True),
    ("invalidapikey", ErrorType.AUTHENTICATION, False),
    ("invalid_api_key", ErrorType.AUTHENTICATION, False),
    ("accessdenied", ErrorType.PERMISSION, False),
]


def classify(status: int, code: str = "") -> tuple[ErrorType, bool]:
    """(error type, retryable) of a failure: by the provider's code when it is a known one, else
    by the HTTP status (other 4xx: invalid request; 5xx, and an error sent in a 200 answer or
    stream: retryable upstream error)."""
    lowered = code.lower()
    for prefix, kind, retryable in _CODES:
        if lowered.startswith(prefix):
            return kind, retryable
    if 400 <= status < 500:
        return _STATUS.get(status) or (ErrorType.INVALID_REQUEST, False)
    return _STATUS.get(status) or (ErrorType.UPSTREAM, True)


_TITLE = re.compile(r"<title[^>]*>(.*?)</title>", re.I | re.S)
_TAG = re.compile(r"<[^>]+>|&nbsp;")
SUMMARY_CHARS = 300


def summarize(text: str) -> str:
    """An error body short enough for a message: an HTML page (a gateway's 502 page) by its title,
    else its text without tags; whitespace collapsed, at most SUMMARY_CHARS characters."""
    text = mend_utf16(text).strip()  # an error message is stored in the session too
    if text[:200].lower().lstrip().startswith(("<!doctype", "<html")) or "</" in text[:500]:
        title = _TITLE.search(text)
        body = title.group(1) if title else _TAG.sub(" ", re.sub(r"(?is)<(script|style).*?</\1>", " ", text))
        text = f"HTML page: {body}"
    text = " ".join(text.split())
    return text if len(text) <= SUMMARY_CHARS else text[: SUMMARY_CHARS - 1] + "…"


def parse_retry_after(headers: Mapping[str, str] | None) -> float | None:
    """Seconds a server asked to wait: ``retry-after-ms`` (OpenAI), else ``Retry-After`` as seconds
    or an HTTP date."""
    if not headers:
        return None
    for name, divisor in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            return max(0.0, float(value) / divisor)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value:
        try:
            return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
        except (TypeError, ValueError):
            return None
    return None


def http_error(
    provider: str,
    model: str,
    status: int,
    message: str,
    code: str = "",
    *,
    request_id: str = "",
    retry_after: float | None = None,
) -> ModelError:
    """A failed call as ModelError, keeping the provider's own message (summarized) in the text."""
    kind, retryable = classify(status, code)
    label = f"HTTP {status}" + (f" {code}" if code else "")
    return ModelError(
        f"{provider} model {model!r}: {label}: {summarize(message) or 'no message'}",
        error_type=kind,
        retryable=retryable,
        status=status,
        code=code,
        request_id=request_id,
        retry_after=retry_after,
    )


def connection_error(provider: str, model: str, exc: BaseException, request_id: str = "") -> ModelError:
    what = str(exc) or type(exc).__name__
    return ModelError(
        f"{provider} model {model!r}: connection failed: {what}",
        error_type=ErrorType.CONNECTION,
        retryable=True,
        request_id=request_id,
    )


def protocol_error(provider: str, model: str, what: str, request_id: str = "") -> ModelError:
    """The server answered 200 but not with a complete reply (a truncated stream, an HTML page,
    an empty body): an upstream fault, worth another attempt."""
    return ModelError(
        f"{provider} model {model!r}: bad response: {what}",
        error_type=ErrorType.UPSTREAM,
        retryable=True,
        code="bad_response",
        request_id=request_id,
    )


async def primed(stream: AsyncGenerator[ChatResponse, None]) -> AsyncIterator[ChatResponse]:
    """Pull items now up to the first with content, so errors before the user sees anything raise
    from ``_open`` (where the host's retry and fallback see them), and return a stream of those
    items and the rest. An item without content (a DashScope event with only usage) does not start
    the answer: a failure after it is as retryable as one before it."""
    head: list[ChatResponse] = []
    async for item in stream:
        head.append(item)
        if item.content:
            break
    return _chain(head, stream)


async def _chain(head: list[T], rest: AsyncGenerator[T, None]) -> AsyncIterator[T]:
    try:
        for item in head:
            yield item
        async for item in rest:
            yield item
    finally:
        await rest.aclose()
