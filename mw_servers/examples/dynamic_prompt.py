"""DynamicContextMiddleware: live context appended to the system prompt.

Adds the current date and time and this middleware's slot value (``agent.state.middle_context[key]``)
as a "Session:" line. The slot is empty on a session's first prompt: the middleware then records
when it first saw the session (``{"session_started": "<ISO time>"}``); a value put there another
way (e.g. the user's locale or plan, by another hook of this middleware) is shown as it is. The
host calls a remote ``on_system_prompt`` at most once per ReAct iteration for the same prompt and
slot, so the clock is read once per iteration, except in a session's first: recording the slot
changes it, so the host asks again with the new slot and the clock is read twice.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime
from typing import Any

from agentmw.sdk import MiddlewareBase, serve


class DynamicContextMiddleware(MiddlewareBase):
    def __init__(self, heading: str = "Current Context", key: str = "DynamicContextMiddleware") -> None:
        self.heading = heading
        self.key = key

    async def get_middleware_key(self) -> str:
        return self.key

    async def on_system_prompt(self, agent: Any, prompt: str) -> str:
        now = datetime.now().astimezone().isoformat(timespec="seconds")
        slot = agent.state.middle_context.get(self.key)
        if slot is None:  # the session's first prompt
            slot = agent.state.middle_context[self.key] = {"session_started": now}
        session = slot if isinstance(slot, str) else json.dumps(slot, ensure_ascii=False)
        return f"{prompt}\n\n## {self.heading}\nTime: {now}\nSession: {session}"


if __name__ == "__main__":
    serve(DynamicContextMiddleware(), sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50073")
