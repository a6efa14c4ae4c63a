"""Subscriptions: which items a middleware sees at a hook, and how (intercept / observe / bypass).

Authors declare them with ``subscribe(...)``; the SDK sends them in Describe; the host turns them
into a ``SubscriptionTable`` whose ``mode_of(item)`` is one dict lookup on the item's class.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from agentmw.v1 import events_pb2, hooks_pb2

from .codec import codec
from .data import ChatResponse
from .hooks import HOOKS_BY_NUMBER, Kind

CHAT_DELTA = "chat_response_delta"
CHAT_FINAL = "chat_response_final"


class Mode(IntEnum):
    INTERCEPT = hooks_pb2.SUBSCRIPTION_MODE_INTERCEPT
    OBSERVE = hooks_pb2.SUBSCRIPTION_MODE_OBSERVE
    BYPASS = hooks_pb2.SUBSCRIPTION_MODE_BYPASS


@dataclass(frozen=True)
class Subscription:
    """Item kinds are data classes (ReplyEndEvent, Msg, ToolChunk, ChatResponse, ...) or the
    strings "chat_response_delta" / "chat_response_final"; kinds not listed get ``default``."""

    default: Mode = Mode.INTERCEPT
    modes: dict[Any, Mode] = field(default_factory=dict)
    wants_context: bool = False
    # Calls next first thing, unchanged: the host starts the inner pipeline without waiting.
    eager_next: bool = False
    # Only watches: never waited for, its emits and state changes are ignored (implies eager_next).
    detached: bool = False
    # Remote SDK only: the hook's code after a ``yield`` may run before the consumer asks for the
    # next item (it has no effect that must wait for it), so the SDK does not suspend at each yield.
    run_ahead: bool = False
    # Does nothing once its inner pipeline ended normally (no emit, change or next; a value hook's
    # result is the inner one's): the host does not wait for its finish. No observed items.
    done_with_inner: bool = False
    # Has work to do only while this member of its slot is true; a pure pass-through otherwise, so
    # the host does not call it then (served remotely; in-process it is always called).
    only_when: str = ""
    # on_system_prompt: the answer depends on the input prompt and the slot alone, so the host may
    # reuse it across iterations, replies and sessions (served remotely; in-process no effect).
    cacheable: bool = False


def subscribe(
    *,
    intercept: Iterable[Any] = (),
    observe: Iterable[Any] = (),
    default: Mode = Mode.BYPASS,
    wants_context: bool = False,
    eager_next: bool = False,
    detached: bool = False,
    run_ahead: bool = False,
    done_with_inner: bool = False,
    only_when: str = "",
    cacheable: bool = False,
) -> Subscription:
    """Declare what a hook sees. ``eager_next``: the hook calls ``next_handler()`` first thing with
    no overrides (saves a round trip). ``detached``: the hook only watches (a tracer): the host
    never waits for it and ignores what it emits or changes. ``run_ahead`` (served remotely): the
    code after each ``yield`` may run before the consumer asks for the next item, as it did before
    the SDK suspended at yields; saves one round trip per emitted item (no effect in-process).
    ``done_with_inner``: the hook does nothing after its inner pipeline ends normally (no yield,
    no state change, no next_handler(); a value hook returns the inner result): the host ends the
    call with the inner pipeline, one round trip less (not with observed items; the SDK raises in
    the hook's code if it breaks the promise). ``only_when``: the name of a member of this
    middleware's slot (a dict) that it sets to True while the hook has work to do; whenever it is
    not True the hook is a pure pass-through (next_handler() once, unchanged; every item
    forwarded; no state change), and the host, served remotely, runs the inner pipeline without
    calling it (no effect in-process). ``cacheable`` (on_system_prompt only): the new prompt
    depends on the input prompt and this middleware's slot alone, so the host, served remotely,
    reuses an answer for the same two instead of calling again at every reasoning step."""
    intercept, observe = list(intercept), list(observe)
    kinds = [*intercept, *observe]
    _check_once((t, getattr(kind, "__name__", repr(kind))) for kind in kinds for t in _item_types(kind))
    modes = {kind: Mode.INTERCEPT for kind in intercept}
    modes.update({kind: Mode.OBSERVE for kind in observe})
    _check_done_with_inner(done_with_inner, [default, *modes.values()])
    return Subscription(
        default=default,
        modes=modes,
        wants_context=wants_context,
        eager_next=eager_next or detached,
        detached=detached,
        run_ahead=run_ahead,
        done_with_inner=done_with_inner,
        only_when=only_when,
        cacheable=cacheable,
    )


def _check_once(listed: Iterable[tuple[int, str]]) -> None:
    """One mode per item kind: ``listed`` is each subscription's (item type, name). One rule for
    the author's declaration (subscribe) and the host's reading of it (Describe)."""
    seen: dict[int, str] = {}
    for item_type, name in listed:
        if item_type in seen:
            also = f" (it is also {seen[item_type]})" if seen[item_type] != name else ""
            raise ValueError(f"{name} is subscribed twice{also}")
        seen[item_type] = name


def _check_done_with_inner(done_with_inner: bool, modes: Iterable[Mode]) -> None:
    """One rule for the author's declaration (subscribe) and the host's reading of it (Describe)."""
    if done_with_inner and Mode.OBSERVE in modes:
        raise ValueError("done_with_inner cannot go with observed items (their changes may arrive after inner_done)")


def _item_types(kind: Any) -> list[int]:
    if kind is ChatResponse:
        return [events_pb2.ITEM_TYPE_CHAT_RESPONSE_DELTA, events_pb2.ITEM_TYPE_CHAT_RESPONSE_FINAL]
    if kind in (CHAT_DELTA, CHAT_FINAL):
        return [events_pb2.ItemType.Value("ITEM_TYPE_" + kind.upper())]
    name = codec.item_field_by_py.get(kind)
    if name is None:
        raise ValueError(f"{kind!r} is not an item kind (an event class, Msg, ToolChunk, ToolResponse, ChatResponse)")
    return [events_pb2.ItemType.Value("ITEM_TYPE_" + name.upper())]


def to_proto(hook_number: int, sub: Subscription) -> hooks_pb2.HookDescription:
    # protoc's .pyi types enum fields as the enum class only; protobuf takes the int.
    desc = hooks_pb2.HookDescription(
        hook=hook_number,  # type: ignore[arg-type]
        default_mode=int(sub.default),  # type: ignore[arg-type]
        wants_context=sub.wants_context,
        eager_next=sub.eager_next or sub.detached,
        detached=sub.detached,
        done_with_inner=sub.done_with_inner,
        only_when=sub.only_when,
        cacheable=sub.cacheable,
        # The SDK reads an Interrupted message whenever it comes (HookSession.fetch, HostReader).
        interrupt_notice=not sub.detached and HOOKS_BY_NUMBER[hook_number].kind is not Kind.TRANSFORM,
    )
    for kind, mode in sub.modes.items():
        for item_type in _item_types(kind):
            desc.subscriptions.add(item_type=item_type, mode=int(mode))
    return desc


_CLASS_BY_ITEM_TYPE = {
    events_pb2.ItemType.Value("ITEM_TYPE_" + name.upper()): cls
    for cls, name in codec.item_field_by_py.items()
    if cls is not ChatResponse
}


def _type_name(item_type: int) -> str:
    return events_pb2.ItemType.Name(item_type) if item_type in events_pb2.ItemType.values() else str(item_type)


MAX_FLAG_NAME = 256  # only_when: a slot member's name, not a document


class SubscriptionTable:
    """The host's view of one middleware's subscription at one hook; a description that cannot
    work is refused here (ValueError, a protocol violation at Describe)."""

    __slots__ = (
        "by_class",
        "cacheable",
        "chat_delta",
        "chat_final",
        "default",
        "detached",
        "done_with_inner",
        "eager_next",
        "interrupt_notice",
        "only_when",
        "wants_context",
    )

    def __init__(self, desc: hooks_pb2.HookDescription) -> None:
        self.default = Mode(desc.default_mode or Mode.INTERCEPT)
        self.wants_context = desc.wants_context
        self.detached = desc.detached
        self.eager_next = desc.eager_next or desc.detached
        self.by_class: dict[type, Mode] = {}
        self.chat_delta = self.chat_final = self.default
        _check_once((sub.item_type, f"item type {_type_name(sub.item_type)}") for sub in desc.subscriptions)
        for sub in desc.subscriptions:
            mode = Mode(sub.mode or Mode.INTERCEPT)
            if sub.item_type == events_pb2.ITEM_TYPE_CHAT_RESPONSE_DELTA:
                self.chat_delta = mode
            elif sub.item_type == events_pb2.ITEM_TYPE_CHAT_RESPONSE_FINAL:
                self.chat_final = mode
            elif sub.item_type in _CLASS_BY_ITEM_TYPE:
                self.by_class[_CLASS_BY_ITEM_TYPE[sub.item_type]] = mode
            else:
                raise ValueError(f"unknown item type {sub.item_type} in a subscription")
        self.done_with_inner = desc.done_with_inner
        modes = [self.default, self.chat_delta, self.chat_final, *self.by_class.values()]
        _check_done_with_inner(self.done_with_inner, modes)
        spec = HOOKS_BY_NUMBER.get(desc.hook)
        if spec is not None and spec.kind is Kind.TRANSFORM and (desc.detached or desc.done_with_inner):
            raise ValueError(
                f"{spec.name} cannot be {'detached' if desc.detached else 'done_with_inner'} (it returns a prompt)"
            )
        if spec is not None and spec.kind is not Kind.TRANSFORM and desc.cacheable:
            raise ValueError(f"{spec.name} cannot be cacheable (only on_system_prompt)")
        if len(desc.only_when) > MAX_FLAG_NAME:
            raise ValueError(
                f"only_when names a slot member of {len(desc.only_when)} characters (at most {MAX_FLAG_NAME})"
            )
        self.only_when = desc.only_when
        self.cacheable = desc.cacheable
        self.interrupt_notice = desc.interrupt_notice and not desc.detached

    def skips(self, slot: Any) -> bool:
        """Declared ``only_when`` and that member of the middleware's ``slot`` is not True: the hook
        would pass everything through, so it need not be called."""
        return bool(self.only_when) and not (isinstance(slot, dict) and slot.get(self.only_when) is True)

    def mode_of(self, item: Any) -> Mode:
        cls = type(item)
        if cls is ChatResponse:
            return self.chat_final if item.is_last else self.chat_delta
        return self.by_class.get(cls, self.default)
