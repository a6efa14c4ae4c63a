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
from collections.abc import Callable
from typing import Any

_PLAIN = frozenset((str, int, float, bool, type(None)))
_getters: dict[type, Callable[[Any], tuple[Any, ...]]] = {}
IMMUTABLE: Any = ()  # the snapshot of a value that cannot be edited in place


def scalar_fields(item: Any) -> tuple[Any, ...] | None:
    """A snapshot of a dataclass item's fields when each is a scalar or an empty dict / list (an
    event's usual ``metadata``): an in-place edit of the author then shows in ``same_fields``.
    None for anything else (then the item is compared encoded)."""
    get = _getters.get(type(item))
    if get is None:
        names = tuple(f.name for f in dataclasses.fields(item)) if dataclasses.is_dataclass(item) else ()
        get = _getters[type(item)] = operator.attrgetter(*names) if len(names) > 1 else lambda _: ()
    values = get(item)
    if not values:
        return None
    snapshot = list(values)
    for i, value in enumerate(values):
        kind = type(value)
        if kind in _PLAIN or isinstance(value, enum.Enum):
            continue
        if (kind is dict or kind is list) and not value:
            snapshot[i] = kind()  # a fresh empty one: an edit of the item's own shows as a difference
            continue
        return None
    return tuple(snapshot)


def same_fields(item: Any, fields: tuple[Any, ...]) -> bool:
    """``item``'s fields still equal the snapshot, types included (True is not 1 on the wire)."""
    values = _getters[type(item)](item)
    return values == fields and all(map(operator.is_, map(type, values), map(type, fields)))


def snapshot(value: Any) -> tuple[Any, ...] | None:
    """``IMMUTABLE``, the fields of a flat dataclass, or None (no cheap check: compare encoded)."""
    if type(value) in _PLAIN or isinstance(value, enum.Enum):
        return IMMUTABLE
    return scalar_fields(value)


def unchanged(value: Any, snap: tuple[Any, ...]) -> bool:
    """``value`` (the very object snapshotted) was not edited in place since."""
    return snap is IMMUTABLE or same_fields(value, snap)
