"""A middleware whose tools have a side effect a test can count: each run appends a line to a file.

Served in its own process (``python -m agentmw.sdk tests.durable_mw:SideEffects --arg path=...``),
so the tools run outside the host: a host killed with -9 while one runs cannot take the record
with it. ``note`` runs at once, ``confirmed_note`` needs the user's confirmation, ``slow_note``
writes its line and then takes ``seconds`` to finish.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from agentmw.middleware import MiddlewareBase
from agentmw.tools import tool


class SideEffects(MiddlewareBase):
    def __init__(self, path: str) -> None:
        self.path = Path(path)

    async def get_middleware_key(self) -> str:
        return "fx"

    def _append(self, text: str) -> None:
        with self.path.open("a") as f:
            f.write(text + "\n")

    async def list_tools(self) -> list[Any]:
        @tool(description="Write a note.")
        def note(text: str) -> str:
            self._append(text)
            return f"noted {text}"

        @tool(description="Write a note; the user confirms it first.", needs_confirmation=True)
        def confirmed_note(text: str) -> str:
            self._append(text)
            return f"noted {text}"

        @tool(description="Write a note, then take a while to finish.")
        async def slow_note(text: str, seconds: float) -> str:
            self._append(text)
            await asyncio.sleep(seconds)
            return f"noted {text} slowly"

        return [note, confirmed_note, slow_note]


class HeldActing(SideEffects):
    """SideEffects with an on_acting hook that holds a call whose ``text`` starts with "held" for
    ``hold`` seconds before calling the tool, and appends "acting <text>" to ``marks`` on entry (so
    a test can pause the host while the hook holds a call whose start the host has recorded)."""

    def __init__(self, path: str, marks: str, hold: float) -> None:
        super().__init__(path)
        self.marks, self.hold = Path(marks), hold

    async def on_acting(self, agent: Any, input_kwargs: Any, next_handler: Any) -> Any:
        text = str(json.loads(input_kwargs["tool_call"].input or "{}").get("text", ""))
        with self.marks.open("a") as f:
            f.write(f"acting {text}\n")
        if text.startswith("held"):
            await asyncio.sleep(self.hold)
        async for item in next_handler():
            yield item


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []
