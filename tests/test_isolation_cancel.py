"""A client's cancel stops a reply whose middleware would keep it going forever.

An interrupted reply still flows out through every on_reply middleware (its end is theirs to see),
so a middleware that keeps emitting could keep it, and the host, busy until the output limit. The
host gives an interrupted reply a grace period to wind down, then cuts it off: the middleware's
stream is cancelled, the client's call ends with a clear error, and the session keeps a closed
reply. Real processes: a host, and tests/evil_mw.py flooding on_reply for one session.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent_host.service.host import INTERRUPT_GRACE
from agentmw.data import CustomEvent, ReplyEndEvent, ReplyFinishedReason, Role, UserMsg
from clients.chat import HostClient

from .host_util import get_session, processes

pytestmark = pytest.mark.timeout(90)


async def test_a_cancelled_reply_is_cut_off_when_a_middleware_keeps_it_going(tmp_path: Path) -> None:
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "flooded.json").write_text(json.dumps({"flood": {}}))
    with processes(tmp_path) as procs:
        evil = procs.start("evil", ["-m", "tests.evil_mw", "--scripts", str(scripts), "--address", "127.0.0.1:0"])
        host = procs.host(tmp_path / "s.db", "--middleware", f"evil={evil.address}")
        async with HostClient(host.address) as client:
            call = client.reply("flooded", UserMsg("hi"))
            flood, after_cancel, error = 0, 0, None
            loop = asyncio.get_running_loop()
            cancelled_at = ended_at = 0.0
            try:
                async with asyncio.timeout(INTERRUPT_GRACE * 6):
                    async for item in call:
                        if isinstance(item, CustomEvent):
                            flood += 1
                            after_cancel += bool(cancelled_at)
                        if flood == 50 and not cancelled_at:
                            call.cancel()  # CancelReply: the client still reads
                            cancelled_at = loop.time()
            except grpc.aio.AioRpcError as exc:
                error = exc
            ended_at = loop.time()
            assert cancelled_at, "the middleware never flooded"
            assert error is not None and error.code() == grpc.StatusCode.ABORTED, error
            assert "did not end within" in error.details() and "cut off" in error.details()
            # Cut off after the grace period, not at the output limit (100,000 items).
            assert ended_at - cancelled_at < INTERRUPT_GRACE * 4
            assert (scripts / "flooded.cancelled").exists() or await _appears(scripts / "flooded.cancelled")

            # The session is consistent and not busy: its reply is closed, and a new one runs.
            info, state, _ = await get_session(host.address, "flooded")
            assert not info.replying and not info.summary.parked
            assert [m.role for m in state.context] == [Role.USER, Role.ASSISTANT]
            assert state.context[-1].finished_reason == ReplyFinishedReason.INTERRUPTED
            (scripts / "flooded.json").unlink()
            items: list[Any] = [i async for i in client.reply("flooded", UserMsg("again"))]
            end = next(i for i in items if isinstance(i, ReplyEndEvent))
            assert end.finished_reason == ReplyFinishedReason.COMPLETED
            assert evil.running and host.running


async def _appears(path: Path, timeout: float = 5.0) -> bool:
    async with asyncio.timeout(timeout):
        while not path.exists():
            await asyncio.sleep(0.02)
    return True
