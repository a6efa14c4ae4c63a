"""Load on loopback with replicas dying under it: a middleware's failure never fails a reply that
runs fail_open, and never leaves a session inconsistent.

A real host process, three replicas of a real middleware server behind one ``ipv4:`` address
(round-robin), 16 sessions replying concurrently, 300 replies in all (a third of them call a tool
the middleware contributes, so CallTool crosses the boundary too). One replica is SIGKILLed a third
of the way in and stays dead; another is SIGKILLed and restarted on its port two thirds of the way
in. Bounded: a fixed number of replies, each with its own deadline, and a deadline for the whole run.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest

from agentmw.data import CustomEvent, Msg, ReplyEndEvent, ReplyFinishedReason, Role, UserMsg
from agentmw.data.blocks import ToolCallBlock, ToolResultBlock
from clients.chat import HostClient
from clients.launch import ServerProcess

from .host_util import KEY, get_session, kinds, processes

pytestmark = pytest.mark.timeout(120)

SESSIONS = 16
REPLIES = 300
PER_REPLY_DEADLINE = 30.0


def host_config(address: str) -> str:
    return f"""
models:
  default: quick
  models:
    quick: {{provider: offline, delay: 0.001}}
middleware:
  - {{name: rec, address: "{address}", fail_open: true, timeout: 5}}
"""


async def test_replicas_die_under_load_and_no_reply_fails(tmp_path: Path) -> None:
    with processes(tmp_path) as procs:
        replicas: list[ServerProcess] = [
            procs.start(
                f"replica{i}",
                ["-m", "agentmw.sdk", "tests.host_util:RecorderMiddleware", "--address", "127.0.0.1:{port}"],
            )
            for i in range(3)
        ]
        address = "ipv4:" + ",".join(r.address for r in replicas)
        config = tmp_path / "host.yaml"
        config.write_text(host_config(address))
        host = procs.host(tmp_path / "sessions.db", "--config", str(config))

        counter = itertools.count()
        done = 0
        sent: dict[int, list[str]] = {w: [] for w in range(SESSIONS)}
        session_ids: dict[int, str] = {}
        outcomes: list[tuple[str, list[str]]] = []  # (finished reason, kinds) of each reply
        bypassed = 0
        chaos_done = asyncio.Event()

        async def worker(w: int, client: HostClient) -> None:
            nonlocal done, bypassed
            while (n := next(counter)) < REPLIES:
                text = f"call rec__shout text=s{w}r{n}" if n % 3 == 0 else f"hello s{w} r{n}"
                items: list[Any] = []
                async with asyncio.timeout(PER_REPLY_DEADLINE):
                    call = client.reply(session_ids.get(w, ""), UserMsg(text))
                    async for item in call:
                        items.append(item)
                session_ids[w] = call.session_id
                sent[w].append(text)
                ends = [i for i in items if isinstance(i, ReplyEndEvent)]
                reason = ends[0].finished_reason.value if len(ends) == 1 else f"{len(ends)} ends"
                if not isinstance(items[-1], Msg):
                    reason = "no final message"
                outcomes.append((reason, kinds(items)))
                bypassed += sum(1 for i in items if isinstance(i, CustomEvent) and i.name == "middleware_bypassed")
                done += 1

        async def chaos() -> None:
            while done < REPLIES // 3:
                await asyncio.sleep(0.01)
            replicas[0].kill()  # dead for the rest of the run
            while done < 2 * REPLIES // 3:
                await asyncio.sleep(0.01)
            replicas[1].kill()
            replicas[1].restart()  # back on the same port, the channel reconnects to it
            chaos_done.set()

        async with HostClient(host.address) as client:
            async with asyncio.timeout(90):
                chaos_task = asyncio.create_task(chaos())
                await asyncio.gather(*(worker(w, client) for w in range(SESSIONS)))
                await asyncio.wait_for(chaos_task, 10)
        assert chaos_done.is_set()

        assert len(outcomes) == REPLIES
        failed = [(reason, k) for reason, k in outcomes if reason != ReplyFinishedReason.COMPLETED.value]
        assert not failed, f"{len(failed)} of {REPLIES} replies did not complete, e.g. {failed[:3]}"

        # Every session holds exactly the turns it was sent, in order, each answered, each tool call
        # with its result; the middleware's slot counted no more replies than there were.
        for w, sid in session_ids.items():
            _info, state, middle = await get_session(host.address, sid)
            users = [m for m in state.context if m.role == Role.USER]
            assert [m.text for m in users] == sent[w], f"session {w}: stored turns differ from those sent"
            assert state.context[-1].role == Role.ASSISTANT
            calls = {b.id for m in state.context for b in m.content if isinstance(b, ToolCallBlock)}
            results = {b.id for m in state.context for b in m.content if isinstance(b, ToolResultBlock)}
            assert calls == results, f"session {w}: tool calls without results: {calls - results}"
            assert len(calls) == sum(1 for t in sent[w] if t.startswith("call "))
            slot = middle.get(KEY, {"starts": 0, "ends": []})
            assert slot["starts"] <= len(sent[w]) and len(slot["ends"]) <= len(sent[w])
        assert replicas[1].running
        assert bypassed < REPLIES // 4, f"{bypassed} bypasses: the surviving replicas should have served most replies"
