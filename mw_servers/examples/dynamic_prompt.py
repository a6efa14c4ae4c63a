"""DynamicContextMiddleware: live context appended to the system prompt.

Adds the current date and time and, when the session has one, this middleware's slot value
(``agent.state.middle_context[key]``, e.g. the user's locale or plan, set by a client or by
another hook of this middleware). The host calls a remote ``on_system_prompt`` at most once per
ReAct iteration, so the clock is read once per iteration.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime
from typing import Any

from mw_servers.sdk import MiddlewareBase, serve


class DynamicContextMiddleware(MiddlewareBase):
    def __init__(self, heading: str = "Current Context", key: str = "DynamicContextMiddleware") -> None:
        self.heading = heading
        self.key = key

    async def get_middleware_key(self) -> str:
        return self.key

    async def on_system_prompt(self, agent: Any, prompt: str) -> str:
        lines = [f"Time: {datetime.now().astimezone().isoformat(timespec='seconds')}"]
        slot = agent.state.middle_context.get(self.key)
        if slot is not None:
            lines.append(f"Session: {slot if isinstance(slot, str) else json.dumps(slot, ensure_ascii=False)}")
        return f"{prompt}\n\n## {self.heading}\n" + "\n".join(lines)


if __name__ == "__main__":
    serve(DynamicContextMiddleware(), sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50073")
