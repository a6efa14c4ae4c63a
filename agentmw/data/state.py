"""AgentState: everything the host persists per session. Middleware change it only through Mutations."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ._common import new_id
from .blocks import ContentBlock, PermissionRule, ToolCallBlock, ToolResultBlock
from .enums import Role
from .messages import Msg


@dataclass(slots=True, kw_only=True)
class ReplyContext:
    # A fresh state has an id already, as in AgentScope: every reply id is a real one.
    reply_id: str = field(default_factory=new_id)
    cur_iter: int = 0
    structured_schema: dict[str, Any] | None = None
    structured_output: dict[str, Any] | None = None
    # A model id a middleware chose for this reply (``set_model``); kept while the reply is parked,
    # cleared when it ends.
    model_id: str | None = None
    # A max_iters a middleware set for this reply (``agent.max_iters = n``); None = the agent's own.
    # Taken as is, as AgentScope does: 0 asks for the final answer at once (docs/behaviour.md).
    max_iters: int | None = None
    # The ids of the user messages the reply was started with, as its caller gave them (before any
    # on_reply middleware passed them on, maybe as new messages): a retry is known by them.
    input_ids: list[str] = field(default_factory=list)

    @property
    def structured_output_pending(self) -> bool:
        """A structured output is required and not generated yet (a remote view has the same name)."""
        return self.structured_schema is not None and self.structured_output is None


def checked_max_iters(value: int) -> int:
    """``agent.max_iters = value``, in-process and in a remote view alike: any count of iterations,
    0 included (AgentScope takes it as is: the forced final answer comes at once)."""
    if value < 0:
        raise ValueError(f"max_iters must be 0 or more, not {value}")
    return value


class _ReplyIds(Protocol):
    """What ReplyFields reads of a reply context: the host's ReplyContext, or an SDK view's own."""

    reply_id: str
    cur_iter: int


class ReplyFields:
    """``reply_id`` and ``cur_iter`` read through ``reply_context``, as on AgentScope's AgentState.
    Shared by the host's state and a remote middleware's view of it; ``_cur_iter_changed`` says
    what a write means where (a version bump here, a mutation there)."""

    __slots__ = ()
    reply_context: _ReplyIds

    @property
    def reply_id(self) -> str:
        return self.reply_context.reply_id

    @property
    def cur_iter(self) -> int:
        return self.reply_context.cur_iter

    @cur_iter.setter
    def cur_iter(self, value: int) -> None:
        self.reply_context.cur_iter = value
        self._cur_iter_changed(value)

    def _cur_iter_changed(self, value: int) -> None:
        raise NotImplementedError


MAX_DROPPED_IDS = 1024  # dropped user messages remembered per session (a retry of an older one is implausible)


@dataclass(slots=True, kw_only=True)
class AgentState(ReplyFields):
    session_id: str = field(default_factory=new_id)
    summary: str = ""
    context: list[Msg] = field(default_factory=list)
    reply_context: ReplyContext = field(default_factory=ReplyContext)
    middle_context: dict[str, Any] = field(default_factory=dict)
    permission_rules: list[PermissionRule] = field(default_factory=list)
    # block id -> key of the middleware that added it (only its adder may remove it)
    block_owners: dict[str, str] = field(default_factory=dict)
    # Bumped on every change a middleware could observe; remote layers resend their view when it moves.
    version: int = 0
    # Ids of user messages the session took that are not in its context (the latest MAX_DROPPED_IDS):
    # dropped by compression, or passed on under another id by an on_reply middleware.
    dropped_user_ids: list[str] = field(default_factory=list)
    # Whom the session belongs to (the authenticated user who created it; "" without authentication).
    owner: str = ""

    def _cur_iter_changed(self, value: int) -> None:
        self.version += 1

    def reply_message(self, name: str) -> Msg | None:
        """The tail message if it is this reply's assistant message."""
        return reply_message(self.context, self.reply_id, name)

    def append_message(self, msg: Msg) -> None:
        """Append a message to the context, checked (``check_message``). The one way a middleware
        adds a message, in-process and remote alike."""
        self.check_message(msg)
        self.context.append(msg)
        self.version += 1

    def check_message(self, msg: Msg) -> None:
        """ValueError unless ``msg`` may be appended: the role rules (``Msg.check_role``), and not
        after tool calls that await their results (a confirmation, an external result, a tool
        running): the reply finds its calls in its message at the tail, and a model takes a tool
        call only with its result right after it."""
        msg.check_role()
        tail = self.context[-1] if self.context else None
        if tail is not None and tail.role == Role.ASSISTANT:
            results = {b.id for b in tail.content if isinstance(b, ToolResultBlock)}
            waiting = [b.id for b in tail.content if isinstance(b, ToolCallBlock) and b.id not in results]
            if waiting:
                raise ValueError(f"a message cannot follow tool calls that await their results ({', '.join(waiting)})")

    def append_context(self, name: str, blocks: Sequence[ContentBlock]) -> Msg:
        """Append blocks to this reply's assistant message, creating it when the tail is not it."""
        msg = append_blocks(self.context, self.reply_id, name, blocks)
        self.version += 1
        return msg

    def append_to_last_assistant(self, name: str, blocks: list[ContentBlock]) -> Msg:
        """Append to the tail if it is an assistant message by ``name`` (any reply), else start this
        reply's message. (AgentScope's budget middleware uses this looser rule.)"""
        msg = append_blocks(self.context, self.reply_id, name, blocks, any_reply=True)
        self.version += 1
        return msg

    def remove_block(self, block_id: str) -> bool:
        if remove_block(self.context, block_id) is None:
            return False
        self.version += 1
        return True

    def remember_user_ids(self, ids: list[str]) -> None:
        """User message ids the session took that its context will not show (dropped_user_ids)."""
        if ids:
            self.dropped_user_ids = (self.dropped_user_ids + ids)[-MAX_DROPPED_IDS:]

    def drop_messages(self, n: int) -> None:
        """Remove the oldest ``n`` messages, as compression does (``check_drop``: ValueError), and
        forget the owners of their blocks. The one way compression and a remote middleware (the
        drop_messages mutation) shorten the context."""
        check_drop(n, len(self.context))
        self.remember_user_ids([m.id for m in self.context[:n] if m.role == Role.USER])
        # Their owners too when a later block has the same id (a middleware's came first: remove_block).
        gone = {b.id for m in self.context[:n] for b in m.content}
        self.context = self.context[n:]
        live = {b.id for m in self.context for b in m.content} - gone
        self.block_owners = {k: v for k, v in self.block_owners.items() if k in live}
        self.version += 1


# The changes of a context that the host's state and a remote middleware's view of it (which
# shows its own changes at once, as in-process) both make: one rule for both.


def reply_message(context: Sequence[Msg], reply_id: str, name: str, *, any_reply: bool = False) -> Msg | None:
    """The tail message if it is reply ``reply_id``'s assistant message by ``name`` (``any_reply``:
    any assistant message by ``name``)."""
    tail = context[-1] if context else None
    if tail and tail.role == Role.ASSISTANT and tail.name == name and (any_reply or tail.id == reply_id):
        return tail
    return None


def append_blocks(
    context: list[Msg], reply_id: str, name: str, blocks: Sequence[ContentBlock], *, any_reply: bool = False
) -> Msg:
    """Append blocks to the tail when it is ``reply_message``, else to a new message of this reply;
    returns that message."""
    tail = reply_message(context, reply_id, name, any_reply=any_reply)
    if tail is None:
        tail = Msg(name=name, content=[], role=Role.ASSISTANT, id=reply_id)
        context.append(tail)
    tail.content.extend(blocks)
    return tail


def check_drop(n: int, length: int) -> None:
    """Dropping the oldest ``n`` of ``length`` messages keeps the newest one (compression never
    drops this reply's message) and drops at least one."""
    if n < 1:
        raise ValueError(f"cannot drop {n} messages")
    if n >= length:
        raise ValueError(f"cannot drop the oldest {n} of {length} messages: the newest message stays")


def remove_block(context: Sequence[Msg], block_id: str) -> Msg | None:
    """Remove the block ``block_id``; returns the message that held it, None if none did. Ids are
    unique, but for one case: a middleware may add a block under an id the host has not used yet
    and the host then does (a user's message it was handed in on_reply's kwargs, before the reply
    stores it). The middleware's own came first, so the earliest is removed: never the host's."""
    for msg in context:
        for i, block in enumerate(msg.content):
            if block.id == block_id:
                del msg.content[i]
                return msg
    return None
