"""Session store: every session's state, persisted step by step as its replies progress.

``SessionStore`` / ``Journal`` (base.py) are the interface; ``SqliteStore`` (sqlite.py) is the
embedded implementation. ``open_store`` picks the backend for the configured ``db``.
"""

from __future__ import annotations

from pathlib import Path

from .base import Journal, ReplyStatus, SessionRecord, SessionStore, StoreLockedError
from .sqlite import SqliteJournal, SqliteStore


def open_store(db: str | Path) -> SessionStore:
    """The store for ``db``: a SQLite file path, or ":memory:". Raises StoreLockedError when another
    host holds it, OSError / sqlite3.Error when it cannot be opened."""
    return SqliteStore(db)


__all__ = [
    "Journal",
    "ReplyStatus",
    "SessionRecord",
    "SessionStore",
    "SqliteJournal",
    "SqliteStore",
    "StoreLockedError",
    "open_store",
]
