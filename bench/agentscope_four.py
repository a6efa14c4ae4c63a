"""The four-servers bench's AgentScope side: AgentScope 2.0.11 with its own TracingMiddleware,
ReplyBudgetControlMiddleware, Mem0Middleware and TTSMiddleware in-process (bench/four_servers.py).

Runs in .venv-agentscope-full (agentscope==2.0.11 with mem0ai and the same embedder stack as
.venv-mem0), from /tmp, never importing agent_host. Driven over a pipe: one JSON command per stdin
line (``{"op": "hello"}``, ``{"op": "batch", "n", "ttft", "token"}``), one JSON answer per line.

The configuration mirrors the agentmw side: spans to ``--otlp`` over OTLP/gRPC with a batch
processor; a budget of 1e9 weighted tokens (it counts, never acts); Mem0Middleware in static
control mode with awaited writes, on an ``AsyncMemory`` built from the very configuration of
mw_servers/mem0/backend.py (loaded from that file) and writing raw (``infer=False``, as our server
does; AgentScope's middleware would ask mem0's LLM to extract facts); TTSMiddleware with
DashScopeTTSModel (streamed) against the local DashScope stand-in (DASHSCOPE_HTTP_BASE_URL).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Run as a script, this directory comes first on sys.path, where bench/mem0.py and bench/tracing.py
# would shadow the real mem0 package: drop it before anything imports mem0.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

import argparse  # noqa: E402
import asyncio  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import AsyncGenerator  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Any  # noqa: E402

QUESTION = "What is my favourite colour?"  # as bench/four_servers.py
SEED = ["My favourite colour is teal.", "I live in Lisbon.", "I am allergic to peanuts.", "My cat is called Miso."]
BUDGET_TOKENS = 1e9


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def stack(args: argparse.Namespace) -> list[Any]:
    """AgentScope's four middlewares, outermost first (tracing, budget, mem0, TTS)."""
    backend = _load("agentmw_mem0_backend", HERE.parent / "mw_servers" / "mem0" / "backend.py")
    store = Path(args.store)
    store.mkdir(parents=True, exist_ok=True)
    backend.prepare_environment(store)  # before mem0 is imported
    config = backend.with_bundled_model(backend.load_config(None, store)[0])

    from agentscope.credential import DashScopeCredential
    from agentscope.middleware import (
        Mem0Middleware,
        ReplyBudgetControlMiddleware,
        TracingMiddleware,
        TTSMiddleware,
    )
    from agentscope.tts import DashScopeTTSModel
    from mem0 import AsyncMemory
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: "agentscope-bench"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=args.otlp)))
    trace.set_tracer_provider(provider)

    class RawWrites(AsyncMemory):
        """Writes as our server does (``infer=False``): no LLM extraction."""

        async def add(self, messages: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("infer", False)
            return await super().add(messages, **kwargs)

    tts = DashScopeTTSModel(credential=DashScopeCredential(api_key="bench-unused"), stream=True)
    return [
        TracingMiddleware(),
        ReplyBudgetControlMiddleware(token_budget=BUDGET_TOKENS),
        Mem0Middleware(
            user_id="default", agent_id="assistant", client=RawWrites.from_config(config), mode="static_control"
        ),  # our Agent is "assistant"; our server scopes by agent name
        TTSMiddleware(tts),
    ]


def paced_model(peer: ModuleType, script: list[dict[str, Any]], ttft: float, token: float) -> Any:
    class Paced(peer.ScriptedModel):  # type: ignore[name-defined,misc]
        """The peer's scripted model on a network model's clock, as the host's paced model: each
        call's first chunk is due ``ttft`` after the call, each next one ``token`` later."""

        async def _stream(self, turn: dict[str, Any]) -> AsyncGenerator[Any, None]:
            loop = asyncio.get_running_loop()
            due = loop.time() + ttft
            sent = 0
            async for chunk in super()._stream(turn):
                sent += 1
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                elif sent % 64 == 0:  # as OfflineRuleModel: hand the loop back now and then
                    await asyncio.sleep(0)
                due += token
                yield chunk

    return Paced(script)


class Host:
    def __init__(self, peer: ModuleType, middlewares: list[Any]) -> None:
        self.peer, self.middlewares = peer, middlewares

    async def reply(self, t0: float, pace: tuple[float, float], question: str = QUESTION) -> tuple[float, float, int]:
        """(time to first text, reply end, audio deltas) from ``t0``."""
        from agentscope.agent import Agent
        from agentscope.event import DataBlockDeltaEvent, TextBlockDeltaEvent
        from agentscope.message import UserMsg
        from agentscope.permission import PermissionBehavior, PermissionDecision
        from agentscope.tool import FunctionTool, Toolkit

        script = self.peer.tool_round_script() if question == QUESTION else [{"text": "Noted."}]
        allow = PermissionDecision(behavior=PermissionBehavior.ALLOW, message="bench")
        agent = Agent(
            name="assistant",
            system_prompt="You are a helpful assistant.",
            model=paced_model(self.peer, script, *pace),
            toolkit=Toolkit(tools=[FunctionTool(self.peer.noop, permission=allow)]),
            middlewares=self.middlewares,
        )
        first, audio = math.nan, 0
        async for event in agent.reply_stream(UserMsg(name="user", content=question)):
            if isinstance(event, TextBlockDeltaEvent) and first != first:
                first = time.perf_counter() - t0
            elif isinstance(event, DataBlockDeltaEvent):
                audio += 1
        return first, time.perf_counter() - t0, audio

    async def batch(self, n: int, pace: tuple[float, float]) -> dict[str, float]:
        cpu0, t0 = time.process_time(), time.perf_counter()
        results = await asyncio.gather(*(self.reply(t0, pace) for _ in range(n)))
        return {
            "cpu": (time.process_time() - cpu0) / n,
            "first": statistics.median(r[0] for r in results),
            "wall": statistics.median(r[1] for r in results),
            "audio": statistics.median(r[2] for r in results),
        }


async def serve(args: argparse.Namespace) -> None:
    peer = _load("agentscope_peer", HERE / "agentscope_peer.py")  # ScriptedModel, noop, the script
    host = Host(peer, await stack(args))
    for fact in SEED:
        await host.reply(time.perf_counter(), (0.0, 0.0), question=fact)
    await host.batch(1, (0.0, 0.0))  # warm up imports and caches
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        command = json.loads(line)
        try:
            if command["op"] == "hello":
                import agentscope

                answer: dict[str, Any] = {"version": f"AgentScope {agentscope.__version__}"}
            else:
                answer = await host.batch(command["n"], (command["ttft"], command["token"]))
        except Exception as exc:  # reported to the driver, which drops this variant
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--otlp", required=True)
    parser.add_argument("--tts-url", required=True)
    parser.add_argument("--store", required=True)
    asyncio.run(serve(parser.parse_args()))
