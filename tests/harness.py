"""Run one conversation with a given middleware list and return comparable results.

A layer is ``(class name in tests.conformance_mw, kwargs, where)`` with ``where`` "local" (in the
host's process) or "remote" (served by ``serve()`` in its own process, started once per test
module and shared: middleware processes hold no state).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from agent_host.agent import Agent
from agent_host.models import ModelRegistry, OfflineRuleModel
from agent_host.models.retry import RetryPolicy
from agent_host.remote import Policy, RemoteMiddleware
from agentmw.data import Msg, UserMsg
from agentmw.tools import Toolkit, add_middleware_tools, tool
from clients.launch import ServerProcess, middleware_server, start_all

from . import conformance_mw


@tool(description="Add two integers.", is_concurrency_safe=True)
def add(a: int, b: int) -> str:
    return str(a + b)


@tool(description="The weather in a city.")
def get_weather(city: str) -> str:
    return f"sunny in {city}"


@dataclass
class Layer:
    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def ident(self) -> tuple[str, str]:
        return self.name, repr(sorted(self.kwargs.items()))


@dataclass
class Scenario:
    id: str
    layers: list[Layer]
    message: str = "hello there"
    earlier: list[str] = field(default_factory=list)  # user messages of whole replies before ``message``
    # ... and after it: how each ended is the state's "later" (the state is taken before them)
    later: list[str] = field(default_factory=list)
    models: dict[str, dict[str, Any]] = field(default_factory=lambda: {"main": {}})
    fallback: dict[str, list[str]] = field(default_factory=dict)
    max_iters: int = 10
    max_retries: int = 0  # per model, with FAST_RETRY's waits
    interrupt_at: str = ""  # the user interrupts ``message``'s reply at the first event of this class


FAST_RETRY = RetryPolicy(initial_delay=0.01, max_delay=0.01, deadline=5)


class Servers:
    """One server process per distinct (class, kwargs), started together, stopped at the end."""

    def __init__(self, scenarios: list[Scenario]) -> None:
        self.procs: dict[tuple[str, str], ServerProcess] = {}
        for scenario in scenarios:
            for layer in scenario.layers:
                if layer.ident not in self.procs:
                    self.procs[layer.ident] = middleware_server(f"tests.conformance_mw:{layer.name}", **layer.kwargs)
        start_all(list(self.procs.values()))

    def address(self, layer: Layer) -> str:
        return self.procs[layer.ident].address

    def stop(self) -> None:
        # Killed, all at once: no test looks at how they stop, and dozens of graceful stops (each
        # an interpreter's shutdown, on a machine with few cores) added up to seconds.
        for proc in self.procs.values():
            if proc.running:
                assert proc.popen is not None
                proc.popen.kill()
        for proc in self.procs.values():
            proc.kill()


async def run(scenario: Scenario, placement: list[str], servers: Servers | None) -> tuple[list[Any], dict[str, Any]]:
    """Run the scenario with each layer "local" or "remote"; returns (normalized events, state)."""
    registry = ModelRegistry(default="main")
    for model_id, spec in scenario.models.items():
        spec = copy.deepcopy(spec)
        registry.add(
            OfflineRuleModel(id=model_id, **spec),
            fallback=scenario.fallback.get(model_id, []),
            max_retries=scenario.max_retries,
            retry=FAST_RETRY,
        )
    toolkit = Toolkit([add, get_weather])
    layers: list[Any] = []
    remotes: list[RemoteMiddleware] = []
    for layer, where in zip(scenario.layers, placement, strict=True):
        if where == "local":
            layers.append(conformance_mw.make(layer.name, **layer.kwargs))
        else:
            assert servers is not None
            remote = await RemoteMiddleware(servers.address(layer), policy=Policy(timeout=10)).connect()
            remotes.append(remote)
            layers.append(remote)
    for mw in layers:
        await add_middleware_tools(toolkit, mw)
    agent = Agent(
        system_prompt="You are a test agent.",
        models=registry,
        model="main",
        toolkit=toolkit,
        middlewares=layers,
        max_iters=scenario.max_iters,
    )
    try:
        for text in scenario.earlier:
            async for _ in agent.reply_stream(UserMsg(text)):
                pass
        events = []
        async for item in agent.reply_stream(UserMsg(scenario.message)):
            events.append(item)
            if type(item).__name__ == scenario.interrupt_at and not agent.interrupted:
                agent.interrupt()
        state = normalize(
            {
                "context": agent.state.context,
                "middle_context": agent.state.middle_context,
                "cur_iter": agent.state.cur_iter,
                "summary": agent.state.summary,
            }
        )
        state["later"] = []
        for text in scenario.later:
            *_, end, final = [item async for item in agent.reply_stream(UserMsg(text))]
            state["later"].append([end.finished_reason.value, final.text])
    finally:
        for remote in remotes:
            await remote.close()
    return normalize(events), state


_HEX_ID = re.compile(r"^[0-9a-f]{32}$")
_VOLATILE = {"id", "created_at", "finished_at"}


def normalize(value: Any) -> Any:
    """Comparable form: dataclasses as dicts with their class name, generated ids renumbered in
    order of appearance, timestamps dropped, integral floats as ints (JSON does not tell them apart)."""
    ids: dict[str, str] = {}

    def walk(v: Any, key: str = "") -> Any:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            out = {"class": type(v).__name__}
            for f in dataclasses.fields(v):
                if f.name in _VOLATILE and f.name != "id":
                    continue
                out[f.name] = walk(getattr(v, f.name), f.name)
            return out
        if isinstance(v, dict):
            return {walk(k): walk(x, str(k)) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [walk(x) for x in v]
        if isinstance(v, Enum):
            return v.value
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, str) and _HEX_ID.match(v):
            return ids.setdefault(v, f"<id{len(ids)}>")
        return v

    return walk(value)


def kinds(events: list[Any]) -> list[str]:
    return [e["class"] for e in events]


def final_text(events: list[Any]) -> str:
    msg = events[-1]
    assert msg["class"] == "Msg", msg
    return "".join(b.get("text", "") for b in msg["content"] if b["class"] == "TextBlock")


__all__ = ["Layer", "Msg", "Scenario", "Servers", "final_text", "kinds", "normalize", "run"]
