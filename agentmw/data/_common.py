"""Id and timestamp factories shared by every data class (pluggable, as in AgentScope)."""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import datetime

# 32 random hex digits, like uuid4().hex but a quarter of its cost (ids are minted per event).
_id_factory: Callable[[], str] = lambda: os.urandom(16).hex()  # noqa: E731
_time_factory: Callable[[], str] = lambda: datetime.now().isoformat()  # noqa: E731


def new_id() -> str:
    return _id_factory()


def now() -> str:
    return _time_factory()


def set_id_factory(factory: Callable[[], str]) -> None:
    global _id_factory
    _id_factory = factory


def set_time_factory(factory: Callable[[], str]) -> None:
    global _time_factory
    _time_factory = factory
