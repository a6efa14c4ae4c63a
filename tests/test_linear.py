"""No quadratic work on the host, and no long stall of its event loop, whatever the message size.

Only relative timings: a run against a run of the same code in the same test.
"""

from __future__ import annotations

import asyncio
import statistics
import time

from agent_host.agent import Agent
from agent_host.models import OfflineRuleModel
from agentmw.data import ReplyEndEvent, ReplyFinishedReason, UserMsg


async def stream_time(words: int) -> float:
    """This thread's CPU seconds to stream and accumulate an echo of ``words`` words (the best of a
    few runs; CPU time, not wall time: the machine runs the other tests meanwhile)."""
    model = OfflineRuleModel(reply_template="{text}")
    text = ("w" * 39 + " ") * words  # long words: the quadratic copy shows at few chunks
    best = float("inf")
    for _ in range(5):
        started = time.thread_time()
        async for chunk in await model([UserMsg(text)]):
            if chunk.is_last:
                assert len(chunk.content[0].text) == len(text)
        best = min(best, time.thread_time() - started)
    return best


async def test_streaming_a_long_answer_is_linear() -> None:
    """8x the chunks take about 8x the time (quadratic accumulation took 64x; the line is 24x, far
    from both, since caches and allocation make a large run somewhat dearer per chunk)."""
    n = 5_000
    small, large = await stream_time(n), await stream_time(8 * n)
    assert large / small < 24, f"{n} words: {small:.3f}s, {8 * n}: {large:.3f}s of CPU"


async def test_a_large_message_does_not_stall_the_event_loop() -> None:
    """A ~0.5 MB message, then "hello" (whose context compression summarizes it): a ticker on
    the same loop never waits much longer than it typically does for the loop's own work. The wait
    is counted in this thread's CPU time: while the machine runs other processes (the tests in
    parallel), a wall-clock gap can be long with no stall of the loop at all."""
    gaps: list[float] = []  # wall time between ticks
    busy: list[float] = []  # this thread's CPU time between ticks: the loop's own work
    done = asyncio.Event()

    async def ticker() -> None:
        loop = asyncio.get_running_loop()
        while not done.is_set():
            before, cpu = loop.time(), time.thread_time()
            await asyncio.sleep(0.001)
            gaps.append(loop.time() - before)
            busy.append(time.thread_time() - cpu)

    agent = Agent(model=OfflineRuleModel())
    task = asyncio.create_task(ticker())
    try:
        async with asyncio.timeout(60):
            for text in ("w" * 19 + " ") * 25_000, "hello":  # 0.5 MB in 25k words
                ends = [i async for i in agent.reply_stream(UserMsg(text)) if isinstance(i, ReplyEndEvent)]
                assert [e.finished_reason for e in ends] == [ReplyFinishedReason.COMPLETED]
        assert agent.state.summary  # "hello" did compress the context
    finally:
        done.set()
        await task
    assert len(gaps) > 10, f"the loop ran the ticker {len(gaps)} times while 0.5 MB streamed: it stalled"
    typical = statistics.median(gaps)
    longest = max(busy)
    assert longest < 50 * typical, f"longest busy gap {longest:.3f}s, typical tick {typical:.4f}s, {len(gaps)} ticks"
