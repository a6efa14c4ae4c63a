"""The SQLite session store on its own: incremental writes keep every kind of change (in-place
growth of the reply's message, removed blocks, compression's rewrite, the state outside the
context), and a database of the earlier one-blob-per-session layout is migrated."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from agent_host.store import ReplyStatus, SessionStore, SqliteStore, open_store
from agent_host.store.journal import RowJournal
from agentmw.codec import CodecError, codec
from agentmw.data import (
    AssistantMsg,
    PermissionRule,
    TextBlock,
    ToolCallBlock,
    ToolCallState,
    ToolResultBlock,
    UserMsg,
)
from agentmw.data.state import AgentState


async def stored(store: SqliteStore, state: AgentState) -> None:
    """What the database holds (read back, not the store's cache) is ``state``."""
    loaded = await store.load(state.session_id)
    assert loaded is not None
    assert codec.encode(loaded[0]) == codec.encode(state)


async def test_every_kind_of_change_is_written(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.db")
    journal = store.create("s")
    state = journal.state
    for i in range(6):
        state.context.append(UserMsg(f"question {i}"))
        state.context.append(AssistantMsg([TextBlock(text=f"answer {i}"), TextBlock(text="aside", id=f"aside{i}")]))
    await journal.begin_reply()
    await stored(store, state)

    # The reply's message grows in place; a call changes state; the rest of the state changes.
    tail = state.context[-1]
    call = ToolCallBlock(id="c1", name="add", input="{}")
    tail.content.append(call)
    await journal.record_tool_started("c1")
    call.state = ToolCallState.ALLOWED  # in place: the message keeps its blocks
    await journal.record_step()
    await stored(store, state)
    call.state = ToolCallState.FINISHED
    tail.content.append(ToolResultBlock(id="c1", name="add", output="3"))
    state.middle_context["mw"] = {"seen": [1, 2]}
    state.reply_context.cur_iter = 2
    state.permission_rules.append(PermissionRule(tool_name="add", behavior="allow", source="user"))
    await journal.record_tool_result("c1")
    await stored(store, state)

    # A block removed from an old message; then compression rewrites the context.
    assert state.remove_block("aside1")
    await journal.record_step()
    await stored(store, state)
    state.context = state.context[7:]
    state.summary = "earlier: questions 0-3"
    await journal.end_reply()
    await stored(store, state)
    store.close()

    again = SqliteStore(tmp_path / "s.db")
    reopened = await again.open("s")
    assert reopened is not None and reopened.status == ReplyStatus.IDLE and not reopened.in_doubt
    assert codec.encode(reopened.state) == codec.encode(state)
    again.close()


async def test_a_state_that_cannot_be_stored_is_not_kept_in_memory_either(tmp_path: Path) -> None:
    """A change that does not encode (an object the codec refuses, in the context) fails the write
    and the store forgets the session as held: the next open reads what is stored. Before, only a
    failed write did that; a failed encoding kept the changed state cached, and every later reply
    of the session worked from a state the database never had (until the host restarted)."""
    store = SqliteStore(tmp_path / "s.db")
    journal = store.create("s")
    journal.state.context.append(UserMsg("question"))
    await journal.begin_reply()
    journal.state.context.append(AssistantMsg([TextBlock(text="ok"), None]))  # type: ignore[list-item]
    with pytest.raises(CodecError, match="NoneType is not one of"):
        await journal.record_step()
    reopened = await store.open("s")
    assert reopened is not None and reopened is not journal
    assert [m.text for m in reopened.state.context] == ["question"]
    store.close()


async def keeps_its_title(store: SessionStore, journal: RowJournal) -> None:
    """Two turns, then compression drops the first: the listed title stays the first user message's."""
    state = journal.state
    state.context.append(UserMsg("Plan my trip to Lisbon"))
    await journal.begin_reply()
    state.context.append(AssistantMsg("Sure."))
    await journal.end_reply()
    state.context += [UserMsg("fourth"), AssistantMsg("ok")]
    await journal.begin_reply()
    state.context = state.context[2:]  # compression: the first turn is in the summary now
    state.summary = "the user plans a trip"
    await journal.end_reply()
    assert [r.title for r in await store.list()] == ["Plan my trip to Lisbon"]


async def test_the_title_stays_the_first_user_message_after_compression(tmp_path: Path) -> None:
    """host.proto: the title is "the beginning of the first user message". Before, each write took
    it from the context, so it changed once compression dropped that message."""
    store = SqliteStore(tmp_path / "s.db")
    await keeps_its_title(store, store.create("s"))
    store.close()


async def test_a_one_blob_database_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    state = AgentState(session_id="old", context=[UserMsg("hello"), AssistantMsg("hi")], middle_context={"k": 1})
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TABLE sessions (session_id TEXT PRIMARY KEY, state BLOB NOT NULL, created_at TEXT NOT NULL, "
        "updated_at TEXT NOT NULL, title TEXT NOT NULL DEFAULT '', message_count INTEGER NOT NULL DEFAULT 0, "
        "parked INTEGER NOT NULL DEFAULT 0)"
    )
    db.execute(
        "INSERT INTO sessions VALUES ('old', ?, ?, ?, 'hello', 2, 1)",
        (codec.encode(state).SerializeToString(), "2025-01-01T00:00:00+00:00", "2025-01-01T00:00:00+00:00"),
    )
    db.commit()
    db.close()

    store = SqliteStore(path)
    [record] = await store.list()
    assert (record.session_id, record.title, record.parked, record.created_at) == (
        "old",
        "hello",
        True,
        "2025-01-01T00:00:00+00:00",
    )
    await stored(store, state)
    store.close()


async def test_a_dsn_of_another_database_is_refused_saying_what_is_known() -> None:
    """``mysql://...`` was taken for a SQLite path: "no directory mysql:"."""
    with pytest.raises(OSError, match=r"^mysql:// is not a store the host knows: give a postgresql:// DSN"):
        await open_store("mysql://user@db.example/sessions")
