"""The peer to beat: AgentScope 2.0.11 in-process, for the same replies as the main bench.

Runs in its own virtual environment (it never imports agent_host). ``bench.run`` starts it with
``--serve`` and sends one JSON command per line, between its own variants, so that the peer's runs
are interleaved with the host's on a noisy machine:

* ``{"op": "reply", "variant": "none" | "mw" | "mw4"}``: a reply of 3 tool rounds and 1,000 text
  deltas (scripted model, no network) with no middleware, one in-process pass-through middleware on
  on_reply, on_reasoning, on_model_call and on_acting, or four of them; answers host CPU seconds,
  time to first text delta and time to the end;
* ``{"op": "concurrent"}``: 32 concurrent 1,000-delta replies, instant model; host CPU per reply,
  median time to first text, median reply end;
* ``{"op": "layer"}``: seconds per event per in-process pass-through on_reply layer.

Without ``--serve`` it prints a summary of medians, for running it by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from agentscope.agent import Agent
from agentscope.credential import CredentialBase
from agentscope.event import TextBlockDeltaEvent
from agentscope.formatter import OpenAIChatFormatter
from agentscope.message import TextBlock, ToolCallBlock, UserMsg
from agentscope.middleware import MiddlewareBase
from agentscope.model import ChatModelBase, ChatResponse
from agentscope.permission import PermissionBehavior, PermissionDecision
from agentscope.tool import FunctionTool, Toolkit
from pydantic import BaseModel

WORDS = " ".join(f"w{i}" for i in range(1000))


def tool_round_script(rounds: int = 3) -> list[dict[str, Any]]:
    script: list[dict[str, Any]] = [{"tool_calls": [{"name": "noop", "input": {"x": i}}]} for i in range(rounds)]
    script.append({"text": WORDS})
    return script


class ScriptedModel(ChatModelBase):
    """Streams scripted turns word by word, like the host's OfflineRuleModel (no network)."""

    class Parameters(BaseModel):
        pass

    def __init__(self, script: list[dict[str, Any]]) -> None:
        super().__init__(credential=CredentialBase(), model="scripted", parameters=self.Parameters(), max_retries=0)
        self.formatter = OpenAIChatFormatter()  # consulted for supported media types; never formats here
        self.script = list(script)
        self.calls = 0

    async def _call_api(
        self, model_name: str, messages: list, tools: Any = None, tool_choice: Any = None, **kwargs: Any
    ) -> AsyncGenerator[ChatResponse, None]:
        self.calls += 1
        return self._stream(self.script.pop(0))

    async def _stream(self, turn: dict[str, Any]) -> AsyncGenerator[ChatResponse, None]:
        if turn.get("text"):
            block_id = f"text-{self.calls}"
            for piece in turn["text"].split(" "):
                yield ChatResponse(content=[TextBlock(id=block_id, text=piece + " ")], is_last=False)
        for i, call in enumerate(turn.get("tool_calls", [])):
            raw = json.dumps(call["input"])
            half = len(raw) // 2
            call_id = f"call_{self.calls}_{i}"
            yield ChatResponse(content=[ToolCallBlock(id=call_id, name=call["name"], input=raw[:half])], is_last=False)
            yield ChatResponse(content=[ToolCallBlock(id=call_id, name=call["name"], input=raw[half:])], is_last=False)


class PassThrough(MiddlewareBase):
    async def on_reply(self, agent: Any, input_kwargs: dict, next_handler: Callable[..., Any]) -> AsyncGenerator:
        async for item in next_handler():
            yield item

    async def on_reasoning(self, agent: Any, input_kwargs: dict, next_handler: Callable[..., Any]) -> AsyncGenerator:
        async for item in next_handler():
            yield item

    async def on_acting(self, agent: Any, input_kwargs: dict, next_handler: Callable[..., Any]) -> AsyncGenerator:
        async for item in next_handler():
            yield item

    async def on_model_call(self, agent: Any, input_kwargs: dict, next_handler: Callable[..., Any]) -> Any:
        return await next_handler()


class ReplyOnly(MiddlewareBase):
    async def on_reply(self, agent: Any, input_kwargs: dict, next_handler: Callable[..., Any]) -> AsyncGenerator:
        async for item in next_handler():
            yield item


def noop(x: int = 0) -> str:
    """Does nothing.

    Args:
        x (`int`): ignored.
    """
    return "ok"


def make_agent(script: list[dict[str, Any]], middlewares: list[Any]) -> Agent:
    allow = PermissionDecision(behavior=PermissionBehavior.ALLOW, message="bench")
    toolkit = Toolkit(tools=[FunctionTool(noop, permission=allow)])
    return Agent(
        name="assistant",
        system_prompt="You are a helpful assistant.",
        model=ScriptedModel(script),
        toolkit=toolkit,
        middlewares=middlewares,
    )


async def one_reply(
    script: list[dict[str, Any]], middlewares: list[Any], t0: float | None = None
) -> tuple[float, float, float]:
    """(cpu, time to first text delta, time to end) of one reply."""
    agent = make_agent(script, middlewares)
    start = time.perf_counter() if t0 is None else t0
    cpu0 = time.process_time()
    first = float("nan")
    count = 0
    async for event in agent.reply_stream(UserMsg(name="user", content="hi")):
        count += 1
        if first != first and isinstance(event, TextBlockDeltaEvent):
            first = time.perf_counter() - start
    if count < 1000:
        raise RuntimeError(f"the reply produced only {count} events")
    return time.process_time() - cpu0, first, time.perf_counter() - start


async def layer_event_cost() -> float:
    """Seconds per event per pass-through on_reply layer (4 layers vs none, text-only reply)."""
    bare = await one_reply([{"text": WORDS}], [])
    layered = await one_reply([{"text": WORDS}], [ReplyOnly() for _ in range(4)])
    return (layered[2] - bare[2]) / (1000 * 4)


async def concurrent(n: int) -> tuple[float, float, float]:
    """(host CPU per reply, median time to first text, median reply end) of ``n`` concurrent replies."""
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one_reply([{"text": WORDS}], [], t0) for _ in range(n)))
    cpu = (time.process_time() - cpu0) / n
    return cpu, statistics.median(r[1] for r in results), statistics.median(r[2] for r in results)


MIDDLEWARE = {"none": 0, "mw": 1, "mw4": 4}


async def handle(command: dict[str, Any]) -> dict[str, Any]:
    op = command["op"]
    if op == "hello":
        import agentscope

        return {"version": agentscope.__version__}
    if op == "reply":
        middlewares = [PassThrough() for _ in range(MIDDLEWARE[command["variant"]])]
        cpu, first, wall = await one_reply(tool_round_script(), middlewares)
        return {"cpu": cpu, "first": first, "wall": wall}
    if op == "concurrent":
        cpu, first, wall = await concurrent(command.get("n", 32))
        return {"cpu": cpu, "first": first, "wall": wall}
    if op == "layer":
        return {"value": await layer_event_cost()}
    raise ValueError(f"unknown op {op!r}")


async def serve() -> None:
    """Answer one JSON command per stdin line with one JSON line, until stdin closes."""
    await one_reply(tool_round_script(), [PassThrough()])  # warm up imports and caches
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            return
        try:
            answer = await handle(json.loads(line))
        except Exception as exc:  # reported to the driver, which gives up on the peer
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


async def once(rounds: int) -> dict[str, Any]:
    """A standalone summary (medians), for running the peer by hand."""
    out: dict[str, Any] = {}
    for variant in MIDDLEWARE:
        runs = [await handle({"op": "reply", "variant": variant}) for _ in range(rounds)]
        out[f"reply_cpu_{variant}"] = statistics.median(r["cpu"] for r in runs)
        out[f"reply_first_{variant}"] = statistics.median(r["first"] for r in runs)
    out["layer_event"] = statistics.median([(await handle({"op": "layer"}))["value"] for _ in range(rounds)])
    conc = [await handle({"op": "concurrent"}) for _ in range(3)]
    out["concurrent_first"] = statistics.median(c["first"] for c in conc)
    out["concurrent_end"] = statistics.median(c["wall"] for c in conc)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--serve", action="store_true", help="answer JSON commands on stdin (used by bench.run)")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve())
    else:
        print(json.dumps(asyncio.run(once(args.rounds))))
