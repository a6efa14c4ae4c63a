"""A client's cancel stops a reply whose middleware would keep it going forever.

An interrupted reply still flows out through every on_reply middleware (its end is theirs to see),
so a middleware that keeps emitting could keep it, and the host, busy until the output limit. A
remote one that still sends items STOP_AFTER_INTERRUPT after the cancel is left behind (its
policy decides how the reply ends); a reply still not ended INTERRUPT_GRACE after the cancel is
cut off: the middleware's stream is cancelled, the client's call ends with a clear error, and the
session keeps a closed reply. Real processes: a host, and tests/evil_mw.py (flooding on_reply, or
silent) for one session.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent_host.remote.protocol import STOP_AFTER_INTERRUPT
from agent_host.service.host import INTERRUPT_GRACE
from agentmw.data import CustomEvent, ReplyEndEvent, ReplyFinishedReason, Role, UserMsg
from clients.chat import HostClient
from clients.launch import ServerProcess

from .host_util import get_session, processes

pytestmark = pytest.mark.timeout(90)


async def test_a_cancelled_reply_leaves_behind_a_middleware_that_keeps_emitting(tmp_path: Path) -> None:
    """It floods on_reply after the cancel: STOP_AFTER_INTERRUPT later the reply ends without it,
    well formed (fail_closed: the error names it), its stream cancelled. Before, it kept the reply
    going until the host cut the whole reply off (ABORTED, no end event)."""
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "flooded.json").write_text(json.dumps({"flood": {}}))
    with processes(tmp_path) as procs:
        evil = procs.start("evil", ["-m", "tests.evil_mw", "--scripts", str(scripts), "--address", "127.0.0.1:0"])
        host = procs.host(tmp_path / "s.db", "--middleware", f"evil={evil.address}")
        async with HostClient(host.address) as client:
            call = client.reply("flooded", UserMsg("hi"))
            flood, items = 0, []
            loop = asyncio.get_running_loop()
            cancelled_at = 0.0
            async with asyncio.timeout(INTERRUPT_GRACE * 6):
                async for item in call:
                    items.append(item)
                    if isinstance(item, CustomEvent):
                        flood += 1
                    if flood == 50 and not cancelled_at:
                        call.cancel()  # CancelReply: the client still reads
                        cancelled_at = loop.time()
            ended_at = loop.time()
            assert cancelled_at, "the middleware never flooded"
            assert ended_at - cancelled_at < STOP_AFTER_INTERRUPT + (INTERRUPT_GRACE - STOP_AFTER_INTERRUPT) / 2
            end = next(i for i in items if isinstance(i, ReplyEndEvent))
            assert end.finished_reason == ReplyFinishedReason.ERROR
            assert "middleware 'evil' failed in on_reply: it still sent items of its own" in end.error.message
            assert (scripts / "flooded.cancelled").exists() or await _appears(scripts / "flooded.cancelled")

            # The session is consistent and not busy: its reply is closed, and a new one runs.
            info, state, _ = await get_session(host.address, "flooded")
            assert not info.replying and not info.summary.parked
            assert [m.role for m in state.context] == [Role.USER, Role.ASSISTANT]
            assert state.context[-1].finished_reason == ReplyFinishedReason.ERROR
            (scripts / "flooded.json").unlink()
            items = [i async for i in client.reply("flooded", UserMsg("again"))]
            end = next(i for i in items if isinstance(i, ReplyEndEvent))
            assert end.finished_reason == ReplyFinishedReason.COMPLETED
            assert evil.running and host.running


@contextlib.contextmanager
def holding_host(tmp_path: Path, *args: str) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """A host, and its middleware (tests/evil_mw.py, timeout 60 s) that holds session "held"'s
    reply: it stops reading and never answers (while tmp_path/scripts/held.json exists)."""
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "held.json").write_text(json.dumps({"stop_reading": True}))
    with processes(tmp_path) as procs:
        evil = procs.start("evil", ["-m", "tests.evil_mw", "--scripts", str(scripts), "--address", "127.0.0.1:0"])
        config = tmp_path / "host.yaml"
        config.write_text(f"middleware:\n  - {{name: evil, address: {evil.address}, timeout: 60}}\n")
        yield procs.host(tmp_path / "s.db", "--config", str(config), *args), evil


async def test_a_cancelled_reply_is_cut_off_when_a_middleware_holds_it(tmp_path: Path) -> None:
    """It stops reading and never answers, with a timeout longer than the grace: the host cuts the
    interrupted reply off after INTERRUPT_GRACE (ABORTED, saying so; its stream cancelled) instead
    of waiting the middleware's timeout; the session keeps a closed reply and answers the next."""
    with holding_host(tmp_path) as (host, evil):
        async with HostClient(host.address) as client:
            call = client.reply("held", UserMsg("hi"))
            loop = asyncio.get_running_loop()
            cancelled_at, error = 0.0, None

            async def cancel() -> None:  # while the reply waits on the middleware (its on_reply begin)
                nonlocal cancelled_at
                await asyncio.sleep(0.5)
                call.cancel()
                cancelled_at = loop.time()

            canceller = asyncio.create_task(cancel())
            try:
                async with asyncio.timeout(INTERRUPT_GRACE * 6):
                    _ = [item async for item in call]
            except grpc.aio.AioRpcError as exc:
                error = exc
            await canceller
            assert error is not None and error.code() == grpc.StatusCode.ABORTED, error
            assert "did not end within" in error.details() and "cut off" in error.details()
            assert INTERRUPT_GRACE - 0.5 < loop.time() - cancelled_at < INTERRUPT_GRACE * 3

            info, _, _ = await get_session(host.address, "held")
            assert not info.replying and not info.summary.parked
            (tmp_path / "scripts" / "held.json").unlink()
            items: list[Any] = [i async for i in client.reply("held", UserMsg("again"))]
            end = next(i for i in items if isinstance(i, ReplyEndEvent))
            assert end.finished_reason == ReplyFinishedReason.COMPLETED
            assert evil.running and host.running


async def _appears(path: Path, timeout: float = 5.0) -> bool:
    async with asyncio.timeout(timeout):
        while not path.exists():
            await asyncio.sleep(0.02)
    return True


async def test_a_host_stop_cuts_off_a_held_reply_with_the_documented_end(tmp_path: Path) -> None:
    """SIGTERM (drain grace 0.5 s) while a middleware holds the reply and never answers: after the
    grace the reply is interrupted, cut off INTERRUPT_GRACE later, and its client gets the cut-off
    ABORTED, as on a cancel. Before, the server's own stop grace ran out at that very moment and
    the client got "UNAVAILABLE: Cancelling all calls" instead."""
    with holding_host(tmp_path, "--drain-grace", "0.5") as (host, _):
        async with HostClient(host.address) as client:
            call = client.reply("held", UserMsg("hi"))
            stop = asyncio.get_running_loop().call_later(0.5, host.popen.send_signal, signal.SIGTERM)  # type: ignore[union-attr]
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                async with asyncio.timeout(INTERRUPT_GRACE * 4):
                    _ = [item async for item in call]
            stop.cancel()
        assert ended.value.code() == grpc.StatusCode.ABORTED, ended.value.details()
        assert "cut off" in (ended.value.details() or "")
        assert host.popen.wait(INTERRUPT_GRACE * 3) == 0  # type: ignore[union-attr]
