"""Session store: the whole AgentState of each session, persisted (SQLite by default).

A state is stored as its ``agentmw.v1.AgentState`` proto bytes, produced by the one codec, so
there is no second serializer to keep in step with the data model. A few summary columns
(title, message count, parked) are kept beside it for listing without decoding every state.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from agentmw.v1 import types_pb2

from .codec import codec
from .data import Role
from .data.state import AgentState

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session_id    TEXT PRIMARY KEY,
    state         BLOB NOT NULL,
    created_at    TEXT NOT NULL,
    updated_at    TEXT NOT NULL,
    title         TEXT NOT NULL DEFAULT '',
    message_count INTEGER NOT NULL DEFAULT 0,
    parked        INTEGER NOT NULL DEFAULT 0
)
"""


@dataclass(slots=True)
class SessionRecord:
    session_id: str
    created_at: str
    updated_at: str
    title: str
    message_count: int
    parked: bool


def encode_state(state: AgentState) -> bytes:
    return codec.encode(state).SerializeToString()


def decode_state(data: bytes) -> AgentState:
    return codec.decode(types_pb2.AgentState.FromString(data))


class SessionStore:
    """SQLite-backed; ``path`` may be ``":memory:"``. Methods are async and run the (short) SQLite
    calls in a worker thread so a save never stalls other sessions' streams."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).expanduser().parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, timeout=10.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(_SCHEMA)
        self._db.commit()

    # -- sync core (one lock: the connection is shared by worker threads) ------------------------

    def _load(self, session_id: str) -> AgentState | None:
        with self._lock:
            row = self._db.execute("SELECT state FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
        return decode_state(row[0]) if row else None

    def _save(self, state: AgentState, parked: bool) -> None:
        data = encode_state(state)
        now = datetime.now(UTC).isoformat(timespec="seconds")
        first_user = next((m for m in state.context if m.role == Role.USER and m.text), None)
        title = first_user.text[:80] if first_user else ""
        with self._lock:
            self._db.execute(
                "INSERT INTO sessions (session_id, state, created_at, updated_at, title, message_count, parked) "
                "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(session_id) DO UPDATE SET state = excluded.state, "
                "updated_at = excluded.updated_at, title = excluded.title, "
                "message_count = excluded.message_count, parked = excluded.parked",
                (state.session_id, data, now, now, title, len(state.context), int(parked)),
            )
            self._db.commit()

    def _list(self, limit: int) -> list[SessionRecord]:
        sql = "SELECT session_id, created_at, updated_at, title, message_count, parked FROM sessions "
        sql += "ORDER BY updated_at DESC, rowid DESC"
        with self._lock:
            rows = self._db.execute(sql + (f" LIMIT {int(limit)}" if limit > 0 else "")).fetchall()
        return [SessionRecord(r[0], r[1], r[2], r[3], r[4], bool(r[5])) for r in rows]

    def _record(self, session_id: str) -> SessionRecord | None:
        with self._lock:
            r = self._db.execute(
                "SELECT session_id, created_at, updated_at, title, message_count, parked FROM sessions "
                "WHERE session_id = ?",
                (session_id,),
            ).fetchone()
        return SessionRecord(r[0], r[1], r[2], r[3], r[4], bool(r[5])) if r else None

    def _delete(self, session_id: str) -> bool:
        with self._lock:
            cur = self._db.execute("DELETE FROM sessions WHERE session_id = ?", (session_id,))
            self._db.commit()
        return cur.rowcount > 0

    # -- async API ---------------------------------------------------------------------------------

    async def load(self, session_id: str) -> AgentState | None:
        return await asyncio.to_thread(self._load, session_id)

    async def save(self, state: AgentState, *, parked: bool = False) -> None:
        """``parked``: the session waits for a confirmation / external result (for listings)."""
        await asyncio.to_thread(self._save, state, parked)

    async def list(self, limit: int = 0) -> list[SessionRecord]:
        return await asyncio.to_thread(self._list, limit)

    async def record(self, session_id: str) -> SessionRecord | None:
        return await asyncio.to_thread(self._record, session_id)

    async def delete(self, session_id: str) -> bool:
        return await asyncio.to_thread(self._delete, session_id)

    def close(self) -> None:
        with self._lock:
            self._db.close()


__all__ = ["SessionRecord", "SessionStore", "decode_state", "encode_state"]
