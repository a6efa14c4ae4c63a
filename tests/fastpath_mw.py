"""A middleware for tests/test_fast_path.py: intercepts every on_reply item and yields it back,
editing some in place first (the SDK must then send the edit, not forward the held item)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from agentmw.data import Msg, TextBlock, TextBlockDeltaEvent
from agentmw.middleware import MiddlewareBase


class EditSomeInPlace(MiddlewareBase):
    """Upper-cases deltas whose text starts with "edit" (a scalar field, edited in place), appends
    a block to the final message's content in place (a nested field), and yields everything else
    untouched."""

    async def on_reply(self, agent: Any, input_kwargs: dict[str, Any], next_handler: Any) -> AsyncIterator[Any]:
        async for item in next_handler():
            if isinstance(item, TextBlockDeltaEvent) and item.delta.startswith("edit"):
                item.delta = item.delta.upper()
            elif isinstance(item, Msg):
                item.content.append(TextBlock(text="added in place"))
            yield item
