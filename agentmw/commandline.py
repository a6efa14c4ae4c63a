"""What our command lines share (agent-host, agent-chat, agentmw, agentmw-traces, the servers'
``python -m``): help texts from module docstrings, and argument types."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

Number = TypeVar("Number", int, float)


def description(doc: str | None) -> str:
    """A module docstring as an argparse description: without reStructuredText's double backticks,
    which --help would print as they are."""
    return (doc or "").replace("``", "")


def non_negative(kind: Callable[[str], Number], maximum: Number | None = None) -> Callable[[str], Number]:
    """An argparse ``type=``: a number of ``kind`` that is 0 or more (a usage error otherwise:
    a negative limit or wait would be taken as "none" or "all" without a word), and at most
    ``maximum`` if given (e.g. an int32 proto field, which refuses a larger one with a traceback)."""

    def parse(text: str) -> Number:
        value = kind(text)  # a ValueError: argparse's "invalid <kind> value"
        if not value >= 0:  # NaN too
            raise argparse.ArgumentTypeError(f"must be 0 or more, not {text}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be {maximum} or less, not {text}")
        return value

    parse.__name__ = getattr(kind, "__name__", "number")  # argparse names the type in its errors
    return parse


__all__ = ["description", "non_negative"]
