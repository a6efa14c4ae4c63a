"""The grammar of a reply as a client receives it, checked at the host on every item.

``Agent.reply_stream`` feeds every item the on_reply chain yields through one ``ReplyGrammar``,
so in-process and remote on_reply middleware are held to the same rules::

    reply := [ReplyStartEvent] item* (ReplyEndEvent CustomEvent* Msg | Msg)

* A new reply opens with exactly one ReplyStartEvent whose id is new (not the previous reply's,
  and the host's own once the core has made it); a resumed reply has none and keeps its id.
* Every event carrying a ``reply_id`` carries this reply's; a CustomEvent may carry none ("").
* Blocks are balanced: text, thinking and data blocks by ``block_id``, tool calls and tool
  results by ``tool_call_id`` (start once, deltas and end only while open). At ReplyEndEvent no
  block is open; at a parked reply's final Msg only the results of calls handed out for external
  execution are (they are closed when the result comes back).
* RequireUserConfirmEvent / RequireExternalExecutionEvent name only calls of this reply that are
  awaiting exactly that answer.
* At most one ReplyEndEvent; the final Msg is the last item. A reply without one (an on_reply
  middleware that finished without calling next) is incomplete.

Each check is a few dict/set operations: O(1) per item, whatever the reply's length.
"""

from __future__ import annotations

from typing import Any

from agentmw.data import (
    CustomEvent,
    DataBlockDeltaEvent,
    DataBlockEndEvent,
    DataBlockStartEvent,
    ExceedMaxItersEvent,
    HintBlockEvent,
    ModelCallEndEvent,
    ModelCallStartEvent,
    Msg,
    ReplyEndEvent,
    ReplyStartEvent,
    RequireExternalExecutionEvent,
    RequireUserConfirmEvent,
    TextBlockDeltaEvent,
    TextBlockEndEvent,
    TextBlockStartEvent,
    ThinkingBlockDeltaEvent,
    ThinkingBlockEndEvent,
    ThinkingBlockStartEvent,
    ToolCallDeltaEvent,
    ToolCallEndEvent,
    ToolCallStartEvent,
    ToolCallState,
    ToolResultDataDeltaEvent,
    ToolResultEndEvent,
    ToolResultStartEvent,
    ToolResultState,
    ToolResultTextDeltaEvent,
)
from agentmw.errors import ReplyGrammarError  # re-exported: the grammar raises it

# Block kinds: (name, end event factory). The index is the kind in _BLOCK_EVENTS.
_TEXT, _THINKING, _DATA, _TOOL_CALL, _TOOL_RESULT = range(5)
_KIND_NAMES = ("text block", "thinking block", "data block", "tool call", "tool result")
_START, _DELTA, _END = range(3)

# event class -> (block kind, attribute naming the block, operation): the hot path is one lookup.
_BLOCK_EVENTS: dict[type, tuple[int, str, int]] = {
    TextBlockStartEvent: (_TEXT, "block_id", _START),
    TextBlockDeltaEvent: (_TEXT, "block_id", _DELTA),
    TextBlockEndEvent: (_TEXT, "block_id", _END),
    ThinkingBlockStartEvent: (_THINKING, "block_id", _START),
    ThinkingBlockDeltaEvent: (_THINKING, "block_id", _DELTA),
    ThinkingBlockEndEvent: (_THINKING, "block_id", _END),
    DataBlockStartEvent: (_DATA, "block_id", _START),
    DataBlockDeltaEvent: (_DATA, "block_id", _DELTA),
    DataBlockEndEvent: (_DATA, "block_id", _END),
    ToolCallStartEvent: (_TOOL_CALL, "tool_call_id", _START),
    ToolCallDeltaEvent: (_TOOL_CALL, "tool_call_id", _DELTA),
    ToolCallEndEvent: (_TOOL_CALL, "tool_call_id", _END),
    ToolResultStartEvent: (_TOOL_RESULT, "tool_call_id", _START),
    ToolResultTextDeltaEvent: (_TOOL_RESULT, "tool_call_id", _DELTA),
    ToolResultDataDeltaEvent: (_TOOL_RESULT, "tool_call_id", _DELTA),
    ToolResultEndEvent: (_TOOL_RESULT, "tool_call_id", _END),
}
# Single events bound to the reply, with no block to balance.
_BOUND = (ModelCallStartEvent, ModelCallEndEvent, ExceedMaxItersEvent, HintBlockEvent)
# HITL requests -> the state the named calls must be in.
_REQUESTS = {RequireUserConfirmEvent: ToolCallState.ASKING, RequireExternalExecutionEvent: ToolCallState.SUBMITTED}


class ReplyGrammar:
    """The state machine of one reply stream.

    ``agent`` gives the session (``state``) and the calls awaiting an answer
    (``awaiting_calls()``); ``blame`` says who could have broken the grammar, for the error;
    ``resuming``: the stream answers a parked reply (no ReplyStartEvent, same id)."""

    def __init__(self, agent: Any, *, resuming: bool, blame: str) -> None:
        state = agent.state
        self.agent = agent
        self.blame = blame
        self.previous_reply_id: str = state.reply_id
        awaiting = agent.awaiting_calls()
        self.parked = resuming and bool(awaiting)  # it resumes a reply that is really parked
        self.expect_start = not resuming
        # None until the stream says which reply it is (its ReplyStartEvent).
        self.reply_id: str | None = None if self.expect_start else state.reply_id
        self.open: list[dict[str, None]] = [{} for _ in _KIND_NAMES]  # dicts: ordered sets
        self.started: list[set[str]] = [set() for _ in _KIND_NAMES]
        if resuming:  # results handed out for external execution were started by the parked stream
            for call in awaiting:
                if call.state == ToolCallState.SUBMITTED:
                    self.open[_TOOL_RESULT][call.id] = None
                    self.started[_TOOL_RESULT].add(call.id)
        self.external: set[str] = set(self.open[_TOOL_RESULT])
        self.ended = False  # a ReplyEndEvent was seen
        self.closing = False  # a ReplyEndEvent or the final Msg was seen: no more reply events
        self.final = False  # the final Msg was seen: nothing may follow
        self.count = 0
        # UserInterruptEvent with nothing parked: AgentScope answers with nothing at all
        # (docs/behaviour.md#interruption).
        self.may_be_empty = resuming and not awaiting

    def violation(self, what: str) -> ReplyGrammarError:
        return ReplyGrammarError(f"the reply broke the event grammar ({self.blame}): {what}")

    # -- the check of one item ---------------------------------------------------------------------

    def feed(self, item: Any) -> None:
        """Accept ``item`` as the next one of the reply, or raise ReplyGrammarError (changing nothing)."""
        rule = _BLOCK_EVENTS.get(type(item))
        if rule is None:
            self._other(item)
            self.count += 1  # block events need no count: ``started`` says whether there were any
            return
        if self.closing or item.reply_id != self.reply_id:
            raise self._misplaced(item)
        kind, attr, op = rule
        key = getattr(item, attr)
        open_ = self.open[kind]
        if op == _DELTA:
            if key not in open_:
                raise self._unbalanced(item, kind, key)
        elif op == _START:
            started = self.started[kind]
            if key in started:
                raise self.violation(f"{type(item).__name__}: {_KIND_NAMES[kind]} {key!r} was already started")
            started.add(key)
            open_[key] = None
        else:
            if key not in open_:
                raise self._unbalanced(item, kind, key)
            del open_[key]

    def accepts(self, item: Any) -> bool:
        """Feed ``item`` if it fits (for the host's own clean-up events after a violation)."""
        try:
            self.feed(item)
        except ReplyGrammarError:
            return False
        return True

    def _other(self, item: Any) -> None:
        kind = type(item)
        if self.final:
            raise self.violation(f"{kind.__name__} after the final Msg")
        if isinstance(item, CustomEvent):
            if item.reply_id and item.reply_id != self.reply_id:  # one of another reply
                raise self._misplaced_custom(item)
            return
        if isinstance(item, Msg):
            self._final_msg()
            return
        if kind is ReplyStartEvent:
            self._start(item)
            return
        if kind not in _REQUESTS and kind is not ReplyEndEvent and kind not in _BOUND:
            raise self.violation(f"a {kind.__name__} is not an item of a reply")
        if self.closing or item.reply_id != self.reply_id:
            raise self._misplaced(item)
        if kind is ReplyEndEvent:
            self._check_session(item)
            open_blocks = self._open_blocks(allowed=set())
            if open_blocks:
                raise self.violation(f"ReplyEndEvent with blocks still open: {open_blocks}")
            self.ended = self.closing = True
        elif kind in _REQUESTS:
            self._request(item, _REQUESTS[kind])

    def _start(self, item: ReplyStartEvent) -> None:
        if not self.expect_start:
            raise self.violation(f"a ReplyStartEvent ({item.reply_id!r}) in a resumed reply")
        if self.reply_id is not None:
            raise self.violation(f"a second ReplyStartEvent ({item.reply_id!r}; this reply is {self.reply_id!r})")
        current = self.agent.state.reply_id
        if not item.reply_id or item.reply_id == self.previous_reply_id:
            raise self.violation(f"the ReplyStartEvent carries the previous reply's id {item.reply_id!r}")
        if current != self.previous_reply_id and item.reply_id != current:
            raise self.violation(
                f"the ReplyStartEvent carries reply id {item.reply_id!r}, not this reply's {current!r}"
            )
        self._check_session(item)
        self.reply_id = item.reply_id

    def _check_session(self, item: ReplyStartEvent | ReplyEndEvent) -> None:
        session_id = self.agent.state.session_id
        if item.session_id and item.session_id != session_id:
            raise self.violation(f"{type(item).__name__} of session {item.session_id!r}, not {session_id!r}")

    def _request(self, item: Any, wanted: ToolCallState) -> None:
        awaiting = {c.id: c for c in self.agent.awaiting_calls()}
        ids = [c.id for c in item.tool_calls]
        bad = [i for i in ids if i not in awaiting or awaiting[i].state != wanted]
        if bad or not ids:
            raise self.violation(
                f"{type(item).__name__} for tool calls {bad or ids} that are not awaiting it ({wanted.value})"
            )
        if wanted == ToolCallState.SUBMITTED:
            self.external.update(ids)

    def _final_msg(self) -> None:
        if self.reply_id is None:
            raise self.violation("a final Msg before any ReplyStartEvent")
        if not self.ended:  # a parked reply: only results handed out for external execution stay open
            if not self.agent.awaiting_calls():
                raise self.violation("a final Msg without ReplyEndEvent, but the reply is not waiting on any call")
            open_blocks = self._open_blocks(allowed=self.external)
            if open_blocks:
                raise self.violation(f"the reply parked with blocks still open: {open_blocks}")
        self.closing = self.final = True

    def finish(self) -> None:
        """The stream ended: raise unless it was a whole reply."""
        if self.final or (self.may_be_empty and self.count == 0 and not any(self.started)):
            return
        missing = "a final Msg" if self.ended else "a ReplyEndEvent and a final Msg"
        raise self.violation(
            f"the reply ended without {missing} (an on_reply middleware finished without calling next?)"
        )

    # -- errors and clean-up -----------------------------------------------------------------------

    def _misplaced(self, item: Any) -> ReplyGrammarError:
        name = type(item).__name__
        if self.final:
            return self.violation(f"{name} after the final Msg")
        if self.ended:
            if isinstance(item, ReplyEndEvent):
                return self.violation("a second ReplyEndEvent")
            return self.violation(f"{name} after ReplyEndEvent")
        if self.reply_id is None:
            return self.violation(f"{name} before ReplyStartEvent")
        return self.violation(f"{name} of reply {item.reply_id!r} in reply {self.reply_id!r}")

    def _misplaced_custom(self, item: CustomEvent) -> ReplyGrammarError:
        if self.reply_id is None:
            return self.violation(f"CustomEvent of reply {item.reply_id!r} before ReplyStartEvent")
        return self.violation(f"CustomEvent of reply {item.reply_id!r} in reply {self.reply_id!r}")

    def _unbalanced(self, item: Any, kind: int, key: str) -> ReplyGrammarError:
        state = "has ended" if key in self.started[kind] else "was never started"
        return self.violation(f"{type(item).__name__}: {_KIND_NAMES[kind]} {key!r} {state}")

    def _open_blocks(self, allowed: set[str]) -> str:
        return ", ".join(
            f"{_KIND_NAMES[kind]} {key!r}"
            for kind, open_ in enumerate(self.open)
            for key in open_
            if not (kind == _TOOL_RESULT and key in allowed)
        )

    def retract(self) -> None:
        """Forget the ReplyEndEvent and final Msg seen: they were held back and will not be sent."""
        self.ended = self.closing = self.final = False

    def closing_events(self) -> list[Any]:
        """End events for every block still open (the reply failed in the middle of them), so the
        client's view stays balanced. Tool results end as ERROR."""
        rid = self.reply_id or ""
        out = [end_event(kind, rid, key) for kind, open_ in enumerate(self.open) for key in open_]
        for open_ in self.open:
            open_.clear()
        return out


def end_event(kind: int, reply_id: str, key: str) -> Any:
    """The event that ends block ``key`` of ``kind`` (one left open: a tool result ends as ERROR)."""
    if kind == _TOOL_RESULT:
        return ToolResultEndEvent(reply_id=reply_id, tool_call_id=key, state=ToolResultState.ERROR)
    if kind == _TOOL_CALL:
        return ToolCallEndEvent(reply_id=reply_id, tool_call_id=key)
    end = (TextBlockEndEvent, ThinkingBlockEndEvent, DataBlockEndEvent)[kind]
    return end(reply_id=reply_id, block_id=key)


class OpenedBlocks:
    """The blocks a stream of items started and has not ended yet (a middleware's own emits): what
    must be closed if it stops half-way and the reply goes on without it."""

    __slots__ = ("inner", "open")

    def __init__(self) -> None:
        self.open: dict[tuple[int, str], str] = {}  # (kind, key) -> reply id, in start order
        self.inner: set[tuple[int, str]] = set()  # blocks the inner pipeline started (handed over)

    def handed(self, item: Any) -> None:
        """``item`` came from the inner pipeline: a block it starts is the inner pipeline's, which
        goes on with it (a middleware that passes it on as an emit of its own does not own it)."""
        rule = _BLOCK_EVENTS.get(type(item))
        if rule is not None and rule[2] == _START:
            self.inner.add((rule[0], getattr(item, rule[1])))

    def see(self, item: Any) -> None:
        """``item`` is the middleware's own emit."""
        rule = _BLOCK_EVENTS.get(type(item))
        if rule is None or rule[2] == _DELTA:
            return
        kind, attr, op = rule
        key = (kind, getattr(item, attr))
        if op != _START:
            self.open.pop(key, None)
        elif key not in self.inner:
            self.open[key] = item.reply_id

    def closing_events(self) -> list[Any]:
        """End events for the blocks still open, the latest first; then none is."""
        out = [end_event(kind, rid, key) for (kind, key), rid in reversed(self.open.items())]
        self.open.clear()
        return out


def blame_of(layers: list[Any], hook: str = "on_reply") -> str:
    """Who can put items into a hook's stream: its layers (or the agent alone)."""
    names = [getattr(layer, "name", None) or type(layer).__name__ for layer in layers]
    if not names:
        return f"no {hook} middleware: the agent itself"
    if len(names) == 1:
        return f"{hook} middleware {names[0]!r}"
    return f"one of the {hook} middleware " + ", ".join(repr(n) for n in names)


__all__ = ["OpenedBlocks", "ReplyGrammar", "ReplyGrammarError", "blame_of", "end_event"]
