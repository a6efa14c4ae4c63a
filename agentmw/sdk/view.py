"""The ``agent`` a remote middleware receives: a view of host state whose changes become Mutations.

It offers the same names as the host's Agent, so middleware code runs unchanged in either place:
``agent.name``, ``agent.state.session_id / owner / reply_id / cur_iter``, ``agent.state.middle_context``
(this middleware's own slot only), ``agent.state.context`` and ``agent.state.summary`` (readable
when the hook subscribed with ``wants_context``; ``append`` and ``summary = text`` always work),
``agent.state.append_context(name, blocks)``, ``agent.state.append_to_last_assistant(name,
blocks)``, ``agent.state.remove_block(id)``, ``agent.set_model(id)``, ``agent.max_iters = n``. The
view shows these changes at once, as the host will make them (as in-process), and keeps them over
host state taken before the host read them (``HookContext.applied``); ``agent.model`` after
``set_model`` has the id alone until the host's next state.

Edits of ``agent.state.context`` that the view carries to the host: ``context.append(msg)`` /
``extend`` (append_message), blocks appended in place to the content of the last message when it
is an assistant message by this agent (append_blocks_to_tail, as AgentScope's budget middleware
does; checked whenever the SDK sends a message, so before the next ``yield``, ``next_handler`` or
return), and, as compression does, dropping the oldest messages: ``del context[:n]`` or
``agent.state.context = context[n:]`` (drop_messages; the newest message always stays). Any other
edit (changing, removing or inserting messages or blocks, another replacement) raises
``ContextEditError`` in the middleware's code: use the methods above instead.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from itertools import zip_longest
from typing import TYPE_CHECKING, Any

from agentmw.codec import codec, json_to_value, value_to_json
from agentmw.data import ContentBlock, ModelRef, Msg, Role
from agentmw.data.state import ReplyFields, append_blocks, check_drop, checked_max_iters, remove_block
from agentmw.errors import UnknownModelError
from agentmw.v1 import hooks_pb2

from .snapshot import snapshot, unchanged

if TYPE_CHECKING:
    from .session import HookSession


# The slot's canonical text (what json.dumps(value, sort_keys=True) gives), by one encoder made
# once: json.dumps builds a new encoder per call when given sort_keys, and a dict or list slot is
# compared this way at every message the SDK sends (twice per intercepted item).
_canonical = json.JSONEncoder(sort_keys=True).encode
EDITABLE = (dict, list)  # a slot value of these may be edited through a reference kept by the author


class SlotDict(dict):
    """``middle_context`` seen from a middleware: its own key only; reads mark it for a sync."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key
        self.touched = False
        self.synced = "null"
        self.pending_message = 0  # the message that carries our latest set_slot (0: none pending)

    def load(self, value: Any, applied: int) -> None:
        """Take the host's value, unless it predates our latest set_slot (the host had not read the
        message carrying it: ``applied``, hooks.proto HookContext.applied); then ours stands. Once
        the host has it, the host's value is the truth, whoever else wrote the slot meanwhile."""
        if applied < self.pending_message:
            return
        self.pending_message = 0
        text = "null" if value is None else _canonical(value)
        dict.clear(self)
        if value is not None:
            dict.__setitem__(self, self.key, value)
        self.synced = text
        self.touched = False

    def _check(self, key: str) -> None:
        if key != self.key:
            raise KeyError(f"a middleware can only use its own slot middle_context[{self.key!r}], not {key!r}")
        self.touched = True

    def __getitem__(self, key: str) -> Any:
        self._check(key)
        return dict.__getitem__(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        self._check(key)
        return dict.get(self, key, default)

    def __setitem__(self, key: str, value: Any) -> None:
        self._check(key)
        dict.__setitem__(self, key, value)

    def __delitem__(self, key: str) -> None:
        self._check(key)
        dict.__delitem__(self, key)

    def setdefault(self, key: str, default: Any = None) -> Any:
        self._check(key)
        return dict.setdefault(self, key, default)

    def pop(self, key: str, *default: Any) -> Any:
        self._check(key)
        return dict.pop(self, key, *default)

    def changed(self) -> tuple[bool, Any]:
        """(changed since the last sync, current value); resets the mark. A dict or list value is
        always compared: the author may keep a reference to it and edit it later."""
        value = dict.get(self, self.key)
        if not self.touched and not isinstance(value, EDITABLE):
            return False, None
        self.touched = False
        text = _canonical(value)
        if text == self.synced:
            return False, None
        self.synced = text
        return True, value


class KwargsDict(dict):
    """The ``input_kwargs`` a hook's code receives: a dict whose values are decoded from the Begin
    when first used, one key at a time, and that notes which were used (``used``, ``touched``). A
    hook that never looks at its kwargs (a pass-through, a check on agent state only) pays no
    decoding, and its bare ``next_handler()`` no comparison for in-place edits; one that reads a
    key or two pays for those (HookSession.changed_kwargs). A value handed out may be edited later,
    so what is used stays used.

    ``d[key]`` and ``d.get(key)`` use that key; every other dict method that hands out keys or
    values, compares, prints or changes the dict uses them all (``used`` becomes None); ``{**d}``,
    ``dict(d)``, ``f(**d)``, ``json.dumps(d)``, ``copy`` and ``pickle`` go through them
    (tests/test_fast_path.py checks each). Keys not decoded yet hold ``NOT_DECODED``."""

    used: set[str] | None = None  # the keys handed out one by one; None: all of them
    _decode: Any = None  # key -> its value, for keys not decoded yet
    _snapshots: dict[str, tuple[Any, tuple[Any, ...]]] | None = None  # key -> (value as decoded, snapshot)

    @property
    def touched(self) -> bool:
        """Some value was handed out (or the dict changed)."""
        return self.used is None or bool(self.used)

    @classmethod
    def lazy(cls, keys: Any, decode: Any) -> KwargsDict:
        kwargs = cls()
        dict.update(kwargs, dict.fromkeys(keys, NOT_DECODED))
        kwargs._decode, kwargs.used = decode, set()
        return kwargs

    def use(self) -> None:
        """Decode every key and mark them all used: what the bulk and writing methods do first."""
        self.used = None
        if self._decode is not None:
            decode, self._decode = self._decode, None
            for key, value in dict.items(self):
                if value is NOT_DECODED:
                    dict.__setitem__(self, key, decode(key))

    def use_key(self, key: Any) -> None:
        if not dict.__contains__(self, key):  # no such kwarg: nothing handed out
            return
        if self.used is not None:
            self.used.add(key)
        if self._decode is not None and dict.get(self, key) is NOT_DECODED:
            value = self._decode(key)
            dict.__setitem__(self, key, value)
            snap = snapshot(value)
            if snap is not None:
                if self._snapshots is None:
                    self._snapshots = {}
                self._snapshots[key] = (value, snap)

    def edited(self, key: str) -> bool:
        """Whether ``key``'s value may differ from the Begin's: False only when it is still the
        very value decoded and a snapshot shows no in-place edit (else: compare it encoded)."""
        snaps = self._snapshots
        entry = snaps.get(key) if snaps is not None else None
        if entry is None:
            return True
        value = dict.get(self, key)
        return value is not entry[0] or not unchanged(value, entry[1])

    def __getitem__(self, key: Any) -> Any:
        self.use_key(key)
        return dict.__getitem__(self, key)

    def get(self, key: Any, default: Any = None) -> Any:
        self.use_key(key)
        return dict.get(self, key, default)


class _NotDecoded:
    def __repr__(self) -> str:
        return "<not decoded: read input_kwargs through its dict methods>"


NOT_DECODED: Any = _NotDecoded()


def _using(name: str) -> Any:
    base = getattr(dict, name)

    def method(self: KwargsDict, *args: Any, **kwargs: Any) -> Any:
        self.use()
        return base(self, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method


for _name in (
    "__iter__", "__reversed__", "keys", "values", "items", "copy", "pop", "popitem", "setdefault", "update",
    "__setitem__", "__delitem__", "clear", "__or__", "__ror__", "__ior__", "__eq__", "__ne__", "__repr__",
    "__reduce_ex__",
):  # fmt: skip
    setattr(KwargsDict, _name, _using(_name))


class ContextEditError(RuntimeError):
    """An in-place edit of ``agent.state.context`` that a remote middleware cannot carry to the host."""


SUPPORTED_EDITS = (
    "a remote middleware carries only context.append(msg) / extend(msgs), blocks appended to the "
    "last message when it is this agent's assistant message, and dropping the oldest messages "
    "(del context[:n], context = context[n:]); use agent.state.append_context, "
    "append_to_last_assistant or remove_block for other changes"
)


class ContextView(list):
    """``agent.state.context``; appending a message becomes an ``append_message`` mutation, and
    blocks appended in place to this agent's last assistant message ``append_blocks_to_tail``
    (``sync``). ``shown`` holds pristine copies of what the host sent, to tell edits apart."""

    def __init__(self, session: HookSession) -> None:
        super().__init__()
        self.session = session
        self.visible = False
        self.shown: list[Msg] = []

    def load(self, messages: Any) -> None:
        list.clear(self)
        list.extend(self, (codec.decode(m) for m in messages))
        self.shown = [codec.decode(m) for m in messages]  # a second decode: copies never shared
        self.visible = True

    def append(self, msg: Msg) -> None:
        self.sync()
        super().append(msg)
        mutation = hooks_pb2.Mutation()
        codec.encode(msg, mutation.append_message)
        self.shown.append(codec.decode(mutation.append_message))
        self.session.view.change(mutation)

    def extend(self, msgs: Any) -> None:
        for msg in msgs:
            self.append(msg)

    def sync(self) -> None:
        """Carry in-place edits made since the last sync to the host, or raise ContextEditError."""
        if not self.visible or list.__eq__(self, self.shown):
            return
        last = len(self.shown) - 1
        for i, (now, shown) in enumerate(zip_longest(list.__iter__(self), self.shown)):
            if now == shown:
                continue
            if now is None or shown is None:
                raise ContextEditError(f"agent.state.context changed length in place: {SUPPORTED_EDITS}")
            n = len(shown.content)
            appended_to_tail = (
                i == last
                and shown.role == Role.ASSISTANT
                and shown.name == self.session.view.name
                and now.content[:n] == shown.content
                and len(now.content) > n
                and dataclasses.replace(now, content=[]) == dataclasses.replace(shown, content=[])
            )
            if not appended_to_tail:
                raise ContextEditError(f"agent.state.context[{i}] was edited in place: {SUPPORTED_EDITS}")
            mutation = hooks_pb2.Mutation()
            _blocks(now.content[n:], mutation.append_blocks_to_tail)
            self.session.actions.append(hooks_pb2.Action(mutate=mutation))
            self.session.view.note_change()
            self.shown[i] = codec.decode(codec.encode(now))

    def drop(self, n: int) -> None:
        """Remove the oldest ``n`` messages (``drop_messages``, by the host's rule: check_drop), shown
        at once; 0 changes nothing."""
        self._require()
        if n == 0:
            return
        try:
            check_drop(n, list.__len__(self))
        except ValueError as exc:
            raise ContextEditError(f"agent.state.context: {exc}; {SUPPORTED_EDITS}") from None
        self.session.view.change(hooks_pb2.Mutation(drop_messages=n))  # carries earlier edits first
        list.__delitem__(self, slice(0, n))
        del self.shown[:n]

    def replace(self, messages: Any) -> None:
        """``agent.state.context = messages``: carried when they are its newest messages (a suffix,
        as compression keeps), dropping the others; any other replacement raises ContextEditError."""
        self._require()
        messages = list(messages)
        n = list.__len__(self) - len(messages)
        if n < 0 or list.__getitem__(self, slice(n, None)) != messages:
            raise ContextEditError(
                f"agent.state.context replaced by messages that are not its newest ones: {SUPPORTED_EDITS}"
            )
        self.drop(n)

    def __delitem__(self, index: Any) -> None:
        """``del context[:n]`` (or ``del context[0]``) drops the oldest messages; any other deletion
        raises ContextEditError."""
        self._require()
        span = range(list.__len__(self))[index]  # IndexError as a list gives
        if isinstance(span, int):
            span = range(span, span + 1)
        if span and (min(span), max(span)) != (0, len(span) - 1):
            raise ContextEditError(
                f"del agent.state.context[{index!r}] is not a drop of the oldest messages: {SUPPORTED_EDITS}"
            )
        self.drop(len(span))

    def mirror(self, change: Callable[[list[Msg]], Msg | None]) -> None:
        """Show a change this middleware just sent (append_context, ...) at once, as the host will
        make it, by the same rule (agentmw.data.state). ``shown`` takes a copy of the message it
        changed, so that ``sync`` sees no in-place edit to carry."""
        if not self.visible:
            return
        messages = list(list.__iter__(self))  # a plain list: ContextView.append would send it again
        msg = change(messages)
        list.__setitem__(self, slice(None), messages)
        if msg is not None:
            i = next(i for i in range(len(messages) - 1, -1, -1) if messages[i] is msg)
            copied = codec.decode(codec.encode(msg))
            if i == len(self.shown):
                self.shown.append(copied)
            else:
                self.shown[i] = copied

    def _require(self, what: str = "agent.state.context") -> None:
        if not self.visible:
            raise RuntimeError(f"{what} is not sent to this hook: subscribe with wants_context=True")

    def __getitem__(self, index: Any) -> Any:
        self._require()
        return super().__getitem__(index)

    def __iter__(self) -> Any:
        self._require()
        return super().__iter__()

    def __len__(self) -> int:
        self._require()
        return super().__len__()


class ReplyContextView:
    def __init__(self) -> None:
        self.reply_id = ""
        self.cur_iter = 0
        self.structured_output_pending = False


class StateView(ReplyFields):
    reply_context: ReplyContextView  # its own, not the host's ReplyContext

    def __init__(self, session: HookSession, key: str) -> None:
        self._session = session
        self.session_id = ""
        self.owner = ""  # whom the session belongs to (authenticated hosts), as agent.state.owner
        self._summary = ""
        self.reply_context = ReplyContextView()
        self.middle_context = SlotDict(key)
        self._context = ContextView(session)

    def _cur_iter_changed(self, value: int) -> None:
        self._session.view.change(hooks_pb2.Mutation(set_cur_iter=value))

    @property
    def context(self) -> ContextView:
        return self._context

    @context.setter
    def context(self, messages: list[Msg]) -> None:
        if messages is not self._context:
            self._context.replace(messages)

    @property
    def summary(self) -> str:
        """The compression summary: the host sends it with the context (``wants_context``)."""
        self._context._require("agent.state.summary")
        return self._summary

    @summary.setter
    def summary(self, text: str) -> None:
        self._session.view.change(hooks_pb2.Mutation(set_summary=text))
        self._summary = text

    def load(self, ctx: hooks_pb2.HookContext) -> None:
        """Take the host's context and summary, when it sent them."""
        if ctx.HasField("context"):
            self._context.load(ctx.context.messages)
            self._summary = ctx.summary

    # Each change is sent, and shown at once when the context is (the host applies it to the
    # agent's name, whatever ``name`` says: the mutation does not carry one).

    def append_context(self, name: str, blocks: list[ContentBlock]) -> None:
        mutation = hooks_pb2.Mutation()
        _blocks(blocks, mutation.append_blocks)
        view = self._session.view
        view.change(mutation)
        self.context.mirror(lambda context: append_blocks(context, self.reply_id, view.name, blocks))

    def append_to_last_assistant(self, name: str, blocks: list[ContentBlock]) -> None:
        mutation = hooks_pb2.Mutation()
        _blocks(blocks, mutation.append_blocks_to_tail)
        view = self._session.view
        view.change(mutation)
        self.context.mirror(lambda context: append_blocks(context, self.reply_id, view.name, blocks, any_reply=True))

    def remove_block(self, block_id: str) -> None:
        self._session.view.change(hooks_pb2.Mutation(remove_block=block_id))
        self.context.mirror(lambda context: remove_block(context, block_id))


def _blocks(blocks: list[ContentBlock], out: Any) -> None:
    for block in blocks:
        wrapper = out.blocks.add()
        codec.encode(block, getattr(wrapper, codec.block_field_by_py[type(block)]))


class _Ended:
    """The session of a view whose hook invocation has ended (``AgentView.close``)."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError("this agent view's hook invocation has ended: a change made through it reaches no host")


_ENDED: Any = _Ended()


class AgentView:
    def __init__(self, session: HookSession, key: str) -> None:
        self._session = session
        self.name = ""
        self.description = ""
        self._max_iters = 0
        self._model: ModelRef | None = None
        self._model_msg: Any = None  # the host's ModelRef, decoded on first use of ``model``
        self._model_ids: tuple[str, ...] = ()  # what set_model accepts (empty: not told, not checked)
        # The message that carries our latest change of the state below (0: none in flight): host
        # state taken before the host read it is older than what the view shows (``refresh``).
        self._pending = 0
        self.state = StateView(session, key)
        # The host's W3C trace context for this call ("traceparent", ...), empty when it does not trace.
        self.trace_context: dict[str, str] = {}
        # The reply was interrupted (as the host's Agent.interrupted): set by the host's Interrupted
        # message the moment it arrives, or by a context; it never turns back within a call.
        self.interrupted = False

    @property
    def max_iters(self) -> int:
        return self._max_iters

    @max_iters.setter
    def max_iters(self, value: int) -> None:
        self.change(hooks_pb2.Mutation(set_max_iters=checked_max_iters(value)))  # raises here, as in-process
        self._max_iters = value

    @property
    def model(self) -> ModelRef | None:
        """The agent's current model: as the host last sent it, or the one ``set_model`` chose."""
        if self._model_msg is not None:
            self._model, self._model_msg = codec.decode(self._model_msg), None
        return self._model

    def set_model(self, model_id: str) -> None:
        """Use a registered model for the rest of this reply (an unknown id raises
        UnknownModelError, as in-process). ``model`` is it at once: its id alone (the view does not
        know the host's models' other fields) until the host next sends its state."""
        if self._model_ids and model_id not in self._model_ids:
            raise UnknownModelError(model_id, list(self._model_ids))
        self.change(hooks_pb2.Mutation(set_model=model_id))
        model = self.model
        if model is None or model.id != model_id:
            self._model = ModelRef(id=model_id)

    def change(self, mutation: hooks_pb2.Mutation) -> None:
        """Send a change of the agent's state (the view shows it itself)."""
        self._session.mutate(mutation)
        self.note_change()

    def note_change(self) -> None:
        self._pending = self._session.sent + 1  # the next message written carries it

    def close(self) -> None:
        """The invocation ended: the view lets go of its session (no reference cycle is left), and a
        change made through a view kept past the end raises instead of going nowhere."""
        self._session = self.state._session = self.state.context.session = _ENDED

    def refresh(self, ctx: hooks_pb2.HookContext) -> None:
        """Take in the host's state as sent with Begin / an item / inner_done."""
        self.name, self.description = ctx.agent_name, ctx.agent_description
        if ctx.trace_context:
            self.trace_context = dict(ctx.trace_context)
        state = self.state
        state.session_id, state.owner = ctx.session_id, ctx.session_owner
        state.reply_context.reply_id = ctx.reply_id
        state.reply_context.structured_output_pending = ctx.structured_output_pending
        self.interrupted = self.interrupted or ctx.interrupted
        if ctx.model_ids:
            self._model_ids = tuple(ctx.model_ids)
        self._session.sync_state()  # local changes first: they must not be overwritten by older host state
        state.middle_context.load(value_to_json(ctx.slot) if ctx.HasField("slot") else None, ctx.applied)
        if ctx.applied < self._pending:  # the host took this state before reading our latest change
            return  # what the view shows stands (the host sends its state again once it changed)
        self._pending = 0
        self._max_iters = ctx.max_iters
        if ctx.HasField("model"):
            self._model_msg = ctx.model
        state.reply_context.cur_iter = ctx.cur_iter
        state.load(ctx)


__all__ = ["AgentView", "ContextEditError", "KwargsDict", "json_to_value"]
