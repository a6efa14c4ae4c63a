"""A reply interrupted mid-stream, traced by TracingMiddleware in-process and by the tracing server
at ``argv[2]``, both exporting to the OTLP receiver at ``argv[1]``; prints the two session ids.
Its own process: the in-process tracer's provider is global (tests/test_tracing.py runs it)."""

from __future__ import annotations

import asyncio
import sys
import uuid

from agent_host import tracing
from agent_host.agent import Agent
from agent_host.models import OfflineRuleModel
from agent_host.remote import RemoteMiddleware
from agentmw.data import TextBlockDeltaEvent, UserMsg
from agentmw.data.state import AgentState
from mw_servers.tracing import TracingMiddleware


async def interrupted_reply(layer: object, session: str) -> None:
    model = OfflineRuleModel(script=[{"text": " ".join(f"w{i}" for i in range(30)), "delay": 0.01}])
    agent = Agent(model=model, middlewares=[layer], state=AgentState(session_id=session))
    deltas = 0
    async for item in agent.reply_stream(UserMsg("tell me a story")):
        deltas += isinstance(item, TextBlockDeltaEvent)
        if deltas == 3:
            agent.interrupt()


async def main(endpoint: str, server: str) -> None:
    provider = tracing.configure("tracing-cut", endpoint=endpoint)
    assert provider is not None
    local, remote = uuid.uuid4().hex, uuid.uuid4().hex
    await interrupted_reply(TracingMiddleware(), local)
    middleware = await RemoteMiddleware(server).connect()
    await interrupted_reply(middleware, remote)
    while middleware.background:  # the copies still on their way to the tracing server
        await asyncio.gather(*middleware.background, return_exceptions=True)
    await middleware.close()
    provider.force_flush()
    print(local, remote)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
