"""Scale out: several replicas of a middleware behind one address (an ``ipv4:`` list), balanced
round-robin by the host's channel. Middleware hold no state, so any replica serves any call."""

from __future__ import annotations

import asyncio

from agent_host.agent import Agent
from agent_host.models import OfflineRuleModel
from agent_host.remote import Policy, RemoteMiddleware
from agentmw.data import CustomEvent, ReplyEndEvent, ReplyFinishedReason, UserMsg
from clients.launch import middleware_server, start_all


def served_by(items: list) -> int | None:
    return next((i.value["pid"] for i in items if isinstance(i, CustomEvent) and i.name == "served_by"), None)


async def test_replicas_share_the_load_and_cover_for_each_other() -> None:
    replicas = start_all([middleware_server("tests.conformance_mw:Replica") for _ in range(2)])
    try:
        address = "ipv4:" + ",".join(r.address for r in replicas)

        async def one(remote: RemoteMiddleware, text: str) -> list:
            agent = Agent(model=OfflineRuleModel(reply_template="ok", delay=0.02), middlewares=[remote])
            async with asyncio.timeout(30):
                return [item async for item in agent.reply_stream(UserMsg(text))]

        # Concurrent replies open several streams, which the channel spreads over the replicas it
        # has connected to. A fresh channel may not have reached both yet: a few bounded tries.
        for _attempt in range(5):
            remote = await RemoteMiddleware(address, policy=Policy(timeout=5)).connect()
            await asyncio.sleep(0.2)
            replies = await asyncio.gather(*(one(remote, f"hello {i}") for i in range(8)))
            if {served_by(items) for items in replies} == {r.pid for r in replicas}:
                break
            await remote.close()
        assert {served_by(items) for items in replies} == {r.pid for r in replicas}

        replicas[0].kill()
        ends = []
        for i in range(4):
            items = await one(remote, f"after {i}")
            ends.append(next(e for e in items if isinstance(e, ReplyEndEvent)).finished_reason)
            if ends[-1] == ReplyFinishedReason.COMPLETED:
                assert served_by(items) == replicas[1].pid
        # Only the first reply may fail: it can race the host noticing the death (a stream it
        # takes may not have ended yet). That failure drops every idle stream, and by then the
        # channel knows the replica is gone: every later reply goes to the live one.
        # (Reusing a stream that has already ended is tested in test_guards.py.)
        assert ends[1:] == [ReplyFinishedReason.COMPLETED] * 3, ends
        await remote.close()
    finally:
        for r in replicas:
            r.stop()
