"""Cheap "was it edited in place?" checks for values the SDK hands to a middleware's code.

A value decoded from the host and handed out (an intercepted item, a kwarg the code read) may be
edited in place before it goes back, and an edit must reach the host as it would in-process. The
general check encodes the value again; for the usual small values a snapshot of their fields says
the same far cheaper: an immutable value cannot be edited, and a dataclass whose fields are all
scalars (or empty dicts / lists) is unchanged when its fields still equal the snapshot.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import typing
from collections.abc import Callable
from typing import Any

_PLAIN = frozenset((str, int, float, bool, type(None)))
IMMUTABLE: Any = ()  # the snapshot of a value that cannot be edited in place

# Per data class: a getter of all its fields' values (one tuple), and the positions of the fields
# whose declared type is not a plain scalar or an enum. Only those are looked at one by one: the
# values are the codec's, so a field declared ``str`` holds a str, which no edit changes in place.
_Plan = tuple[Callable[[Any], tuple[Any, ...]], tuple[int, ...]]
_plans: dict[type, _Plan | None] = {}


def _plan(cls: type) -> _Plan | None:
    if not dataclasses.is_dataclass(cls):
        return None
    names = [f.name for f in dataclasses.fields(cls)]
    if not names:
        return None
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError):  # unresolvable annotations: every field is looked at
        hints = {}

    def fixed(declared: Any) -> bool:
        return declared in _PLAIN or (isinstance(declared, type) and issubclass(declared, enum.Enum))

    getter = operator.attrgetter(*names) if len(names) > 1 else (lambda item, name=names[0]: (getattr(item, name),))
    return getter, tuple(i for i, name in enumerate(names) if not fixed(hints.get(name)))


def scalar_fields(item: Any) -> tuple[Any, ...] | None:
    """A snapshot of a dataclass item's fields when each is a scalar or an empty dict / list (an
    event's usual ``metadata``): an in-place edit of the author then shows in ``same_fields``.
    None for anything else (then the item is compared encoded)."""
    cls = type(item)
    plan = _plans[cls] if cls in _plans else _plans.setdefault(cls, _plan(cls))
    if plan is None:
        return None
    get, loose = plan
    values = get(item)
    for i in loose:
        value = values[i]
        kind = type(value)
        if kind in _PLAIN or isinstance(value, enum.Enum) or ((kind is dict or kind is list) and not value):
            continue
        return None
    return values


def same_fields(item: Any, fields: tuple[Any, ...]) -> bool:
    """``item`` (the very object ``scalar_fields`` took ``fields`` of) was not edited: its fields
    still equal the snapshot, those not declared scalar with their types too (True is not 1 in a
    JSON value), and an empty dict or list it held is still empty (an edit in place leaves the
    same object, which equals itself)."""
    get, loose = _plans[type(item)]  # type: ignore[misc]  # set by scalar_fields
    values = get(item)
    if values != fields:
        return False
    for i in loose:
        value = values[i]
        if type(value) is not type(fields[i]) or ((type(value) is dict or type(value) is list) and value):
            return False
    return True


def snapshot(value: Any) -> tuple[Any, ...] | None:
    """``IMMUTABLE``, the fields of a flat dataclass, or None (no cheap check: compare encoded)."""
    if type(value) in _PLAIN or isinstance(value, enum.Enum):
        return IMMUTABLE
    return scalar_fields(value)


def unchanged(value: Any, snap: tuple[Any, ...]) -> bool:
    """``value`` (the very object snapshotted) was not edited in place since."""
    return snap is IMMUTABLE or same_fields(value, snap)
