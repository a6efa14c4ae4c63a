"""What the benchmark measures. Every function here runs in the host process (this one), against
middleware and echo servers running in other processes, and targets 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import grpc

from agent_host.agent import Agent
from agent_host.models.offline import OfflineRuleModel
from agent_host.remote import RemoteMiddleware
from agentmw.chain import Chain
from agentmw.data import (
    ChatResponse,
    PermissionBehavior,
    PermissionDecision,
    ReplyEndEvent,
    ReplyStartEvent,
    TextBlockDeltaEvent,
    TextBlockEndEvent,
    TextBlockStartEvent,
    ToolCallBlock,
    UserMsg,
)
from agentmw.middleware import MiddlewareBase
from agentmw.tools import Tool, Toolkit, tool
from agentmw.v1 import hooks_pb2

from .echo_server import SPIN, spin
from .harness import Batch, Sample, Series, interleave, process_cpu, timed_batch
from .instrument import Tally, counting, server_stats
from .peer import AgentScopePeer

WORDS = " ".join(f"w{i}" for i in range(1000))  # OfflineRuleModel streams it as 1,000 text deltas
ITEMS = 200  # items per intercepted stream (3)
OPS = 40  # hook invocations / bare exchanges per batch (1, 2)
BYPASS_N = 1000  # deltas of the reply whose items bypass the middleware (4)
CONCURRENT = 32  # concurrent replies (6)
BUDGET_TOKENS = 1e9  # the budget rows measure counting; a budget this size never cuts the reply short


@dataclass
class Env:
    """Connected clients of the server processes, and the servers' process ids."""

    echo: grpc.aio.Channel
    rm_call: RemoteMiddleware  # PassThroughCall
    rm_eager: RemoteMiddleware  # PassThroughCallEager
    rm_done: RemoteMiddleware  # PassThroughCallDone
    rm_icpt: RemoteMiddleware  # InterceptAll
    rm_icpt_ahead: RemoteMiddleware  # InterceptAllRunAhead
    rm_end: list[RemoteMiddleware]  # ReplyEndOnly, 4 clients (4 layers) of one server
    rm_real: list[RemoteMiddleware]  # Realistic, 4 clients (4 layers) of one server
    rm_budget: RemoteMiddleware  # mw_servers.budget with BUDGET_TOKENS (it counts, never acts)
    rm_floor: RemoteMiddleware  # the echo server's lock-step protobuf peer, attached as a middleware
    rm_floor_ahead: RemoteMiddleware  # the protobuf peer declaring run_ahead (bench.run ECHO_AHEAD)
    icpt: grpc.aio.Channel  # to the InterceptAll server, for the peer's host side
    icpt_ahead: grpc.aio.Channel  # to the InterceptAllRunAhead server, the same
    pids: dict[str, int]  # "echo", "echo-ahead" and the middleware class names


@tool(description="Does nothing; the bench's tool rounds call it.")
def noop(x: int = 0) -> str:
    return "ok"


def tool_round_script(rounds: int = 3) -> list[dict[str, Any]]:
    """``rounds`` model turns that each call ``noop``, then a final answer of 1,000 text deltas."""
    script: list[dict[str, Any]] = [{"tool_calls": [{"name": "noop", "input": {"x": i}}]} for i in range(rounds)]
    script.append({"text": WORDS})
    return script


class YieldingModel(OfflineRuleModel):
    """Fix prototype, bench-only: the offline model, but the chunk stream yields to the event loop
    every ``every`` chunks (what a fair host loop would do; see the report)."""

    def __init__(self, *, every: int = 16, **kw: Any) -> None:
        super().__init__(**kw)
        self.every = every

    async def _stream(self, turn: dict[str, Any], input_tokens: int) -> AsyncIterator[ChatResponse]:
        n = 0
        async for chunk in super()._stream(turn, input_tokens):
            n += 1
            if n % self.every == 0:
                await asyncio.sleep(0)
            yield chunk


class PacedModel(OfflineRuleModel):
    """The offline model on a network model's clock: each call's first chunk is due ``ttft`` after
    the call, each next one ``token`` later. Chunks wait for their due time, not for a fixed sleep
    after the consumer took the last one: like chunks arriving on a socket, time the host spends per
    chunk overlaps the wait (as bench/agentscope_four.py's model does)."""

    def __init__(self, *, ttft: float, token: float, **kw: Any) -> None:
        super().__init__(**kw)
        self.ttft, self.token = ttft, token

    async def _stream(self, turn: dict[str, Any], input_tokens: int) -> AsyncIterator[ChatResponse]:
        loop = asyncio.get_running_loop()
        due = loop.time() + self.ttft
        async for chunk in super()._stream(turn, input_tokens):
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            due += self.token
            yield chunk


def make_agent(
    middlewares: Sequence[Any] = (),
    script: list[dict[str, Any]] | None = None,
    *,
    yielding: bool = False,
    pace: tuple[float, float] | None = None,
) -> Agent:
    """``pace``: (time to first token, seconds per chunk) of a PacedModel; else instant."""
    script = script if script is not None else []
    if pace is not None:
        model: OfflineRuleModel = PacedModel(script=script, ttft=pace[0], token=pace[1])
    else:
        model = (YieldingModel if yielding else OfflineRuleModel)(script=script)
    return Agent(model=model, toolkit=Toolkit([noop]), middlewares=list(middlewares))


def reply_events(agent: Agent, n: int) -> list[Any]:
    """The events of a text-only reply with ``n`` deltas, as the on_reply core would yield them."""
    sid, rid = agent.state.session_id, "bench-reply"
    events: list[Any] = [ReplyStartEvent(session_id=sid, reply_id=rid, name=agent.name)]
    events.append(TextBlockStartEvent(reply_id=rid, block_id="b"))
    events += [TextBlockDeltaEvent(reply_id=rid, block_id="b", delta=f"w{i} ") for i in range(n)]
    events.append(TextBlockEndEvent(reply_id=rid, block_id="b"))
    events.append(ReplyEndEvent(session_id=sid, reply_id=rid))
    return events


def reply_chain(layers: Sequence[Any], events: list[Any]) -> Chain:
    """An on_reply chain whose core replays ``events``: isolates the middleware layers' cost."""

    async def core(inputs: Any = None, structured_schema: Any = None) -> AsyncIterator[Any]:
        for event in events:
            yield event

    return Chain("on_reply", layers, core)


async def drain(chain: Chain, agent: Agent) -> int:
    n = 0
    async for _ in chain(agent, inputs=None, structured_schema=None):
        n += 1
    return n


class InProcessPassThrough(MiddlewareBase):
    """The in-process equivalent of a pass-through on_reply layer (same chain mechanism)."""

    async def on_reply(self, agent: Any, input_kwargs: dict[str, Any], next_handler: Any) -> AsyncIterator[Any]:
        async for item in next_handler():
            yield item


# -- 1 + 2 + 3: bare gRPC baselines, one remote hook invocation, one intercepted item ------------------


@dataclass
class Protocol:
    """Round trips and sizes, counted on the host (one pass, not timed)."""

    hook: Tally  # one on_check_permission invocation
    item: Tally  # an InterceptAll on_reply over ITEMS items, per item (streams, begin and end excluded)
    server_calls: dict[str, int]
    item_ahead: Tally  # the same for InterceptAllRunAhead

    @property
    def round_trips(self) -> int:
        """Round trips per intercepted item (a middleware message is each one's answer)."""
        return max(self.item.reads, 1)

    @property
    def round_trips_ahead(self) -> int:
        return max(self.item_ahead.reads, 1)


async def count_protocol(env: Env) -> Protocol:
    agent = make_agent()
    perm = permission_chain(env.rm_call)
    await server_stats(env.rm_call)
    with counting(env.rm_call) as tallies:
        await perm(agent)
    hook = tallies["on_check_permission"]
    calls = (await server_stats(env.rm_call))["calls"]
    return Protocol(hook, await per_item(env.rm_icpt), calls, await per_item(env.rm_icpt_ahead))


async def per_item(rm: RemoteMiddleware) -> Tally:
    """An on_reply stream's traffic per intercepted item: ITEMS items minus none; ``first`` holds
    the host's first message of each kind (the floor peer sends the same)."""
    agent = make_agent()
    short, long = reply_events(agent, 0), reply_events(agent, ITEMS)
    with counting(rm) as t0:
        await drain(reply_chain([rm], short), agent)
    with counting(rm) as t1:
        await drain(reply_chain([rm], long), agent)
    a, b = t0["on_reply"], t1["on_reply"]
    return Tally(
        b.streams - a.streams,
        (b.writes - a.writes) // ITEMS,
        (b.reads - a.reads) // ITEMS,
        (b.bytes_out - a.bytes_out) // ITEMS,
        (b.bytes_in - a.bytes_in) // ITEMS,
        first=b.first,
    )


def permission_chain(rm: RemoteMiddleware) -> Callable[[Agent], Awaitable[Any]]:
    async def core(tool_call: ToolCallBlock, tool: Tool, tool_input: dict[str, Any]) -> PermissionDecision:
        return PermissionDecision(behavior=PermissionBehavior.ALLOW)

    chain = Chain("on_check_permission", [rm], core)
    call = ToolCallBlock(id="call_1", name="noop", input='{"x": 1}')

    async def run(agent: Agent) -> Any:
        decision = await chain(agent, tool_call=call, tool=noop, tool_input={"x": 1})
        assert decision.behavior == PermissionBehavior.ALLOW
        return decision

    return run


def compress_chain(rm: RemoteMiddleware) -> Callable[[Agent], Awaitable[Any]]:
    async def core(context_config: Any = None, instructions: Any = None) -> None:
        return None

    chain = Chain("on_compress_context", [rm], core)

    async def run(agent: Agent) -> Any:
        return await chain(agent, context_config=None, instructions=None)

    return run


async def measure_calls(env: Env, protocol: Protocol, rounds: int) -> dict[str, Series]:
    """1a, 1b, 2 and 3 in one interleaved group."""
    exchange = env.echo.stream_stream("/bench.Echo/Exchange")
    ping_pong = env.echo.stream_stream("/bench.Echo/PingPong")
    hook = protocol.hook
    begin = b"b" * max(hook.bytes_out // max(hook.writes, 1), 1)  # a host message of the hook's mean size
    item = b"i" * max(protocol.item.bytes_out, 1)  # the size of an ItemDelivery
    agent = make_agent()
    perm, compress = permission_chain(env.rm_call), compress_chain(env.rm_call)
    perm_eager = permission_chain(env.rm_eager)
    perm_done = permission_chain(env.rm_done)
    none_chain = reply_chain([], reply_events(agent, ITEMS))
    icpt_chain = reply_chain([env.rm_icpt], reply_events(agent, ITEMS))
    ahead_chain = reply_chain([env.rm_icpt_ahead], reply_events(agent, ITEMS))
    host_half_chain = reply_chain([env.rm_floor], reply_events(agent, ITEMS))  # the real host, the peer's server
    host_half_ahead_chain = reply_chain([env.rm_floor_ahead], reply_events(agent, ITEMS))  # the same, run_ahead

    async def bare_exchange() -> None:
        call = exchange()
        await call.write(begin)
        await call.read()
        await call.done_writing()
        await call.code()

    async def bare_two() -> None:  # the floor of a Begin/CallNext + InnerDone/Finish invocation
        call = ping_pong()
        await call.write(begin)
        await call.read()
        await call.write(begin)
        await call.read()
        await call.done_writing()
        await call.code()

    echo_pid, call_pid = env.pids["echo"], env.pids["PassThroughCall"]

    async def pings() -> Sample:
        call = ping_pong()
        await call.write(item)
        await call.read()

        async def one() -> None:
            await call.write(item)
            await call.read()

        sample = await timed_batch(one, ITEMS, server_pid=echo_pid)
        await call.done_writing()
        await call.code()
        return sample

    paths = {name: (env.echo, f"/bench.Floor/{name}") for name in ("Lockstep", "RunAhead", "RunAheadSpun")}
    paths["SDK"] = (env.icpt, "/agentmw.v1.OnReply/Run")  # the peer's host side, the real SDK (InterceptAll)
    paths["SDKAhead"] = (env.icpt_ahead, "/agentmw.v1.OnReply/Run")  # the same, InterceptAllRunAhead
    floor = {
        name: channel.stream_stream(
            path,
            request_serializer=hooks_pb2.HostMessage.SerializeToString,
            response_deserializer=hooks_pb2.MiddlewareMessage.FromString,
        )
        for name, (channel, path) in paths.items()
    }
    floor_pids = dict.fromkeys(("Lockstep", "RunAhead", "RunAheadSpun"), echo_pid)
    floor_pids.update(SDK=env.pids["InterceptAll"], SDKAhead=env.pids["InterceptAllRunAhead"])
    reply_msgs, hook_msgs = protocol.item.first, protocol.hook.first

    async def floor_invocation(
        call: Any, invocation: int, templates: dict[str, Any], items: int, busy: float = 0.0
    ) -> None:
        """One invocation as the host sends it, built from the real host's messages (a new
        HostMessage each, nothing else): begin, ``items`` items (each answered by emit + suspend,
        then resume -> pull, or at once by emit + pull), inner_done -> finish. ``busy``: seconds of
        busy work before each item (the spun floor's host side)."""
        await call.write(hooks_pb2.HostMessage(invocation=invocation, begin=templates["begin"].begin))
        await call.read()
        item = reply_msgs["item.text_block_delta"].item
        for seq in range(1, items + 1):
            msg = hooks_pb2.HostMessage(invocation=invocation)
            delivery = msg.item
            delivery.seq, delivery.inner = seq, 1
            delivery.item.CopyFrom(item.item)
            if busy:
                spin(busy)
            await call.write(msg)
            answer = await call.read()
            if answer.HasField("suspend"):
                await call.write(hooks_pb2.HostMessage(invocation=invocation, resume=hooks_pb2.Resume()))
                await call.read()
        await call.write(hooks_pb2.HostMessage(invocation=invocation, inner_done=templates["inner_done"].inner_done))
        await call.read()

    async def floor_batch(name: str, templates: dict[str, Any], items: int, n: int, busy: float = 0.0) -> Sample:
        call = floor[name]()  # an open stream, as the host's idle ones
        await floor_invocation(call, 1, templates, items, busy)
        ids = iter(range(2, n + 2))
        invocation = lambda: floor_invocation(call, next(ids), templates, items, busy)  # noqa: E731
        sample = await timed_batch(invocation, n, server_pid=floor_pids[name])
        await call.done_writing()
        await call.code()
        return sample

    async def stream(chain: Chain, pid: int | None) -> Sample:
        # Untimed first, as floor_batch's first invocation: a server that idled while the other
        # variants ran wakes slowly on this machine, and only the floor had paid that before timing.
        await drain(chain, agent)
        return await timed_batch(lambda: drain(chain, agent), 1, server_pid=pid)

    variants: dict[str, Batch] = {
        "bare_exchange": lambda: timed_batch(bare_exchange, OPS, server_pid=echo_pid),
        "bare_two": lambda: timed_batch(bare_two, OPS, server_pid=echo_pid),
        "hook_permission": lambda: timed_batch(lambda: perm(agent), OPS, server_pid=call_pid),
        "hook_compress": lambda: timed_batch(lambda: compress(agent), OPS, server_pid=call_pid),
        "hook_permission_eager": lambda: timed_batch(
            lambda: perm_eager(agent), OPS, server_pid=env.pids["PassThroughCallEager"]
        ),
        "hook_permission_done": lambda: timed_batch(
            lambda: perm_done(agent), OPS, server_pid=env.pids["PassThroughCallDone"]
        ),
        "bare_pingpong": pings,
        "stream_none": lambda: stream(none_chain, None),
        "stream_intercept": lambda: stream(icpt_chain, env.pids["InterceptAll"]),
        "stream_intercept_ahead": lambda: stream(ahead_chain, env.pids["InterceptAllRunAhead"]),
        "floor_intercept": lambda: floor_batch("Lockstep", reply_msgs, ITEMS, 1),
        "floor_intercept_ahead": lambda: floor_batch("RunAhead", reply_msgs, ITEMS, 1),
        "floor_intercept_ahead_spun": lambda: floor_batch("RunAheadSpun", reply_msgs, ITEMS, 1, SPIN),
        "host_half": lambda: stream(host_half_chain, echo_pid),
        "sdk_half": lambda: floor_batch("SDK", reply_msgs, ITEMS, 1),
        "host_half_ahead": lambda: stream(host_half_ahead_chain, env.pids["echo-ahead"]),
        "sdk_half_ahead": lambda: floor_batch("SDKAhead", reply_msgs, ITEMS, 1),
        "floor_hook": lambda: floor_batch("Lockstep", hook_msgs, 0, OPS),
    }
    return await interleave(variants, rounds)


# -- 4: bypassed items and unimplemented hooks -----------------------------------------------------


IDLE = 0.2  # seconds: a paced model's time to first token, which every process waits out asleep


async def measure_idle_round_trip(env: Env, rounds: int) -> dict[str, Series]:
    """One round trip on an open stream (1b) right after another ("hot") and after ``IDLE`` seconds
    with nothing to do ("idle"), interleaved. A paced reply's intercepted items cross after such
    waits (mem0's ReplyStartEvent, budget's ModelCallEndEvent after each model call): how much a
    process that went to sleep costs to wake, which no in-process middleware pays."""
    ping_pong = env.echo.stream_stream("/bench.Echo/PingPong")
    call = ping_pong()
    item = b"i" * 100

    async def one() -> float:
        start = time.perf_counter()
        await call.write(item)
        await call.read()
        return time.perf_counter() - start

    async def hot() -> Sample:
        await one()
        return Sample(await one(), math.nan)

    async def idle() -> Sample:
        await asyncio.sleep(IDLE)
        return Sample(await one(), math.nan)

    try:
        return await interleave({"hot": hot, "idle": idle}, rounds)
    finally:
        await call.done_writing()
        await call.code()


async def measure_bypass(env: Env, rounds: int, peer: AgentScopePeer | None) -> dict[str, Series]:
    agent = make_agent()
    long, short = reply_events(agent, BYPASS_N), reply_events(agent, 0)
    inproc = [InProcessPassThrough() for _ in range(4)]
    chains = {
        "none_n": reply_chain([], long),
        "none_0": reply_chain([], short),
        "end1_n": reply_chain(env.rm_end[:1], long),
        "end1_0": reply_chain(env.rm_end[:1], short),
        "end4_n": reply_chain(env.rm_end, long),
        "end4_0": reply_chain(env.rm_end, short),
        "inproc4_n": reply_chain(inproc, long),
    }

    def batch(chain: Chain) -> Callable[[], Awaitable[Sample]]:
        return lambda: timed_batch(lambda: drain(chain, agent), 3)

    variants: dict[str, Batch] = {name: batch(chain) for name, chain in chains.items()}
    if peer is not None:  # seconds per event per in-process pass-through layer, in AgentScope
        variants["peer_layer"] = lambda: peer.sample({"op": "layer"})
    return await interleave(variants, rounds)


@dataclass
class Unimplemented:
    streams_by_hook: dict[str, int]  # host-side streams opened during a full reply, per hook
    server_calls: dict[str, int]  # hook invocations counted inside the middleware process
    server_items: dict[str, int]
    messages_per_reply: dict[int, int]  # deltas in the reply -> messages, both directions
    cost: dict[str, Series] = field(default_factory=dict)


async def measure_unimplemented(env: Env, rounds: int) -> Unimplemented:
    """ReplyEndOnly implements on_reply only: a full reply must open no stream for any other hook,
    and a chain of a hook it does not implement must cost the same as with no middleware."""
    rm = env.rm_end[0]
    await server_stats(rm)
    with counting(rm) as tallies:
        agent = make_agent([rm], tool_round_script())
        async for _ in agent.reply_stream(UserMsg("hi")):
            pass
    stats = await server_stats(rm)
    streams = {hook: t.streams for hook, t in tallies.items()}
    messages = {}
    base = make_agent()
    for n in (0, BYPASS_N):
        with counting(rm) as t:
            await drain(reply_chain([rm], reply_events(base, n)), base)
        messages[n] = t["on_reply"].writes + t["on_reply"].reads
    with_mw, without = make_agent([rm]), make_agent()
    call = ToolCallBlock(id="c", name="noop", input="{}")

    def hooks_of(agent: Agent) -> Callable[[], Awaitable[Sample]]:
        async def both() -> None:  # two hook positions ReplyEndOnly does not implement
            await agent.compress_context()
            await agent._permission_chain(agent, tool_call=call, tool=noop, tool_input={})

        return lambda: timed_batch(both, 2000)

    cost = await interleave({"attached": hooks_of(with_mw), "none": hooks_of(without)}, rounds)
    return Unimplemented(streams, stats["calls"], stats["items"], messages, cost)


# -- 5: whole replies ----------------------------------------------------------------------------------


async def one_reply(agent: Agent, t0: float | None = None) -> Sample:
    """A reply's host CPU (process_time), wall time to its end and to its first text delta."""
    start = time.perf_counter() if t0 is None else t0
    cpu0 = time.process_time()
    first = float("nan")
    n = 0
    async for item in agent.reply_stream(UserMsg("hi")):
        n += 1
        if first != first and isinstance(item, TextBlockDeltaEvent):
            first = time.perf_counter() - start
    if n < BYPASS_N:
        raise RuntimeError(f"the reply produced only {n} items")
    return Sample(time.perf_counter() - start, time.process_time() - cpu0, first)


@dataclass
class ReplyTraffic:
    streams: dict[str, int]
    messages: int
    server_calls: dict[str, int]
    server_items: dict[str, int]


async def count_reply(env: Env) -> ReplyTraffic:
    rm = env.rm_real[0]
    await server_stats(rm)
    with counting(rm) as tallies:
        await one_reply(make_agent([rm], tool_round_script()))
    stats = await server_stats(rm)
    streams = {hook: t.streams for hook, t in tallies.items() if t.streams}
    messages = sum(t.writes + t.reads for t in tallies.values())
    return ReplyTraffic(streams, messages, stats["calls"], stats["items"])


async def measure_replies(env: Env, rounds: int, peer: AgentScopePeer | None) -> dict[str, Series]:
    from mw_servers.budget import ReplyBudget

    async def run(middlewares: list[Any], yielding: bool = False, pid: int | None = env.pids["Realistic"]) -> Sample:
        agent = make_agent(middlewares, tool_round_script(), yielding=yielding)
        server0 = process_cpu(pid) if pid else 0.0
        sample = await one_reply(agent)
        return replace(sample, server_cpu=process_cpu(pid) - server0 if middlewares and pid else math.nan)

    variants: dict[str, Batch] = {
        "none": lambda: run([]),
        "remote": lambda: run(env.rm_real[:1]),
        "remote4": lambda: run(env.rm_real),
        "none_yielding": lambda: run([], True),
        "budget_remote": lambda: run([env.rm_budget], pid=env.pids["ReplyBudget"]),
        "budget_inproc": lambda: run([ReplyBudget(token_budget=BUDGET_TOKENS)], pid=None),
    }
    if peer is not None:
        for variant in ("none", "mw", "mw4"):
            variants[f"peer_{variant}"] = partial(peer.sample, {"op": "reply", "variant": variant})
    return await interleave(variants, rounds)


# -- 6: fairness under concurrency ----------------------------------------------------------------------


async def concurrent_replies(middlewares: list[Any], *, yielding: bool = False) -> Sample:
    """``CONCURRENT`` replies of 1,000 deltas at once; wall = median reply end, first = median
    time to first text delta (both from the common start), cpu = host CPU per reply."""
    agents = [make_agent(middlewares, [{"text": WORDS}], yielding=yielding) for _ in range(CONCURRENT)]
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    samples = await asyncio.gather(*(one_reply(agent, t0) for agent in agents))
    cpu = (time.process_time() - cpu0) / CONCURRENT
    return Sample(statistics.median(s.wall for s in samples), cpu, statistics.median(s.first for s in samples))


async def measure_fairness(env: Env, rounds: int, peer: AgentScopePeer | None) -> dict[str, Series]:
    variants: dict[str, Batch] = {
        "none": lambda: concurrent_replies([]),
        "remote": lambda: concurrent_replies(env.rm_real[:1]),
        "none_yielding": lambda: concurrent_replies([], yielding=True),
        "remote_yielding": lambda: concurrent_replies(env.rm_real[:1], yielding=True),
    }
    if peer is not None:
        variants["peer"] = partial(peer.sample, {"op": "concurrent", "n": CONCURRENT})
    return await interleave(variants, rounds)
