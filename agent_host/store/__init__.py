"""Session store: every session's state, persisted step by step as its replies progress.

``SessionStore`` / ``Journal`` (base.py) are the interface; ``RowJournal`` (journal.py) the
incremental writes both backends share; ``SqliteStore`` (sqlite.py) the embedded store, one host
per file; ``PostgresStore`` (postgres.py) the shared one, many hosts with a lease per session.
``open_store`` picks the backend for the configured ``db``.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import asyncpg

from .base import (
    Hold,
    Journal,
    LeaseLostError,
    ReplyStatus,
    SessionBusyError,
    SessionRecord,
    SessionStore,
    StoreLockedError,
    TooManyRepliesError,
    TooManySessionsError,
    failure_text,
)
from .journal import RowJournal
from .postgres import PostgresStore, is_dsn
from .sqlite import SqliteJournal, SqliteStore

# What a store raises when it fails (unreachable, full, refusing): the host answers UNAVAILABLE
# with ``store_failure``'s text, not as for a host bug.
STORE_ERRORS: tuple[type[BaseException], ...] = (OSError, sqlite3.Error, asyncpg.PostgresError, asyncpg.InterfaceError)
_DOWN = (OSError, asyncpg.InterfaceError, asyncpg.PostgresConnectionError, asyncpg.OperatorInterventionError)


def store_failure(exc: BaseException) -> str:
    """What a client is told when the store failed with ``exc`` (one of STORE_ERRORS)."""
    return f"the session store {'is unreachable' if isinstance(exc, _DOWN) else 'failed'}: {failure_text(exc)}"


async def open_store(db: str | Path, *, lease: float = 10.0) -> SessionStore:
    """The store for ``db``: a ``postgresql://`` DSN (many hosts; ``lease``: seconds a host holds a
    session without renewing), else a SQLite file path or ":memory:". Raises StoreLockedError when
    another host holds the SQLite file, OSError / sqlite3.Error when the store cannot be opened."""
    if is_dsn(str(db)):
        return await PostgresStore.connect(str(db), lease=lease)
    scheme = str(db).partition("://")[0]
    if "://" in str(db) and scheme.isidentifier():  # mysql://..., sqlite://...: a DSN of no store of ours
        raise OSError(f"{scheme}:// is not a store the host knows: give a postgresql:// DSN or a SQLite file path")
    return SqliteStore(db)


__all__ = [
    "STORE_ERRORS",
    "Hold",
    "Journal",
    "LeaseLostError",
    "PostgresStore",
    "ReplyStatus",
    "RowJournal",
    "SessionBusyError",
    "SessionRecord",
    "SessionStore",
    "SqliteJournal",
    "SqliteStore",
    "StoreLockedError",
    "TooManyRepliesError",
    "TooManySessionsError",
    "open_store",
    "store_failure",
]
