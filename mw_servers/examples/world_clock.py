"""WorldClockMiddleware: a middleware that contributes a tool, and nothing else.

``list_tools()`` returns the tools; the host registers each as ``<middleware name>__<tool>`` (here
``clock__time_in`` when attached as "clock") and calls it in this process, after
on_check_permission and through on_acting like any other tool. A tool is a typed function: its
signature and docstring become the JSON schema the model sees.

    .venv/bin/python -m agentmw.sdk mw_servers.examples.world_clock:WorldClockMiddleware --address 127.0.0.1:50076
    .venv/bin/agentmw middleware attach 127.0.0.1:50076 --name clock
    .venv/bin/agent-chat -m "use clock__time_in timezone=Asia/Tokyo"
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from agentmw.sdk import MiddlewareBase, serve, tool


@tool(description="The current date and time in an IANA time zone, e.g. Europe/Paris.")
def time_in(timezone: str) -> str:
    try:
        zone = ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {timezone!r} (an IANA name such as Europe/Paris)") from None
    return datetime.now(UTC).astimezone(zone).strftime(f"%Y-%m-%d %H:%M ({timezone}, UTC%z)")


class WorldClockMiddleware(MiddlewareBase):
    async def get_middleware_key(self) -> str:
        return "world_clock"

    async def list_tools(self) -> list[Any]:
        return [time_in]


if __name__ == "__main__":
    serve(WorldClockMiddleware(), sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50076")
