"""ReplyBudget (mw_servers/budget) with real processes: the budget server is started with its CLI
(``python -m mw_servers.budget``) and attached to an Agent; the offline model is scripted with a
"repeat" tool rule, so without a budget it would call ``probe`` every step until max_iters.

The step at which tools stop is never hard-coded: it is computed from the usage the model
reported in the reply's own ModelCallEndEvents, with the weights the server was given.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from agent_host.agent import STRUCTURED_OUTPUT_TOOL, Agent
from agent_host.models import OfflineRuleModel
from agent_host.remote import Policy, RemoteMiddleware
from agentmw.data import (
    ConfirmResult,
    CustomEvent,
    HintBlock,
    ModelCallEndEvent,
    ModelCallStartEvent,
    Msg,
    ReplyEndEvent,
    ReplyFinishedReason,
    RequireUserConfirmEvent,
    TextBlock,
    ToolCallStartEvent,
    ToolResultBlock,
    UserConfirmResultEvent,
    UserMsg,
)
from agentmw.tools import Toolkit, tool
from clients.launch import ROOT, ServerProcess, start_all
from mw_servers.budget import DEFAULT_HINT, DEFAULT_KEY, EXHAUSTED, ReplyBudget
from mw_servers.budget.__main__ import SettingError, settings

ASK = "keep probing db"
RULES = [{"pattern": r"keep probing (\w+)", "tool": "probe", "input": {"what": "{0}"}, "repeat": True}]
MAX_ITERS = 10
CROSS_AT = 3  # the budget is chosen (from measured usage) so that weights 1/1 cross at this step
OTHER_WEIGHTS = (0.5, 1.5)  # input, output (both not 1, so each weight is checked): the same budget lasts longer


@tool(description="Probe a system and report its state.")
def probe(what: str) -> str:
    return f"{what} looks fine"


@tool(name="probe", description="Probe a system and report its state.", needs_confirmation=True)
def probe_confirmed(what: str) -> str:
    return f"{what} looks fine"


def make_agent(middlewares: list[Any], probe_tool: Any = probe) -> Agent:
    model = OfflineRuleModel(rules=RULES)
    return Agent(model=model, toolkit=Toolkit([probe_tool]), middlewares=middlewares, max_iters=MAX_ITERS)


async def reply(agent: Agent, inputs: Any = ASK, **kw: Any) -> list[Any]:
    items = []
    async with asyncio.timeout(30):  # never a hung reply
        async for item in agent.reply_stream(UserMsg(inputs) if isinstance(inputs, str) else inputs, **kw):
            items.append(item)
    return items


# ---------------------------------------------------------------------------------------------
# The arithmetic.


def steps(items: list[Any]) -> list[tuple[ModelCallEndEvent, int]]:
    """Each model call's end event with the number of tool calls it made."""
    out, calls = [], 0
    for item in items:
        if isinstance(item, ModelCallStartEvent):
            calls = 0
        elif isinstance(item, ToolCallStartEvent):
            calls += 1
        elif isinstance(item, ModelCallEndEvent):
            out.append((item, calls))
    return out


def costs(items: list[Any], weights: tuple[float, float]) -> list[float]:
    w_in, w_out = weights
    return [w_in * end.input_tokens + w_out * end.output_tokens for end, _ in steps(items)]


def crossing(step_costs: list[float], budget: float) -> int:
    """How many model calls run before the budget is spent (0: it is spent before the first)."""
    used = 0.0
    for n, cost in enumerate(step_costs):
        if used >= budget:
            return n
        used += cost
    return len(step_costs)


def check_stopped(items: list[Any], budget: float, weights: tuple[float, float]) -> int:
    """The reply made tool calls in exactly the model calls before the crossing, then answered;
    one budget_exhausted event each restricted step, with the used amount the arithmetic gives."""
    made = steps(items)
    spent = costs(items, weights)
    k = crossing(spent, budget)
    assert [n > 0 for _, n in made] == [True] * k + [False], (k, [n for _, n in made])
    (event,) = exhausted(items)
    assert event.value["used"] == pytest.approx(sum(spent[:k]))
    assert event.value["budget"] == budget and event.value["tool_choice"] == "none"
    answer = "Done: probe returned db looks fine" if k else f"You said: {ASK}"  # no tool result: a plain answer
    assert isinstance(items[-1], Msg) and items[-1].text.startswith(answer)
    assert end_of(items).finished_reason == ReplyFinishedReason.COMPLETED
    return k


def exhausted(items: list[Any]) -> list[CustomEvent]:
    return [i for i in items if isinstance(i, CustomEvent) and i.name == EXHAUSTED]


def end_of(items: list[Any]) -> ReplyEndEvent:
    (end,) = [i for i in items if isinstance(i, ReplyEndEvent)]
    return end


def check_hint(agent: Agent, hint: str = DEFAULT_HINT) -> None:
    """The hint is in the reply's assistant message, after the last tool result, before the answer."""
    msg = agent.state.context[-1]
    kinds = [type(b) for b in msg.content]
    assert kinds[-2:] == [HintBlock, TextBlock], kinds
    assert ToolResultBlock not in kinds[kinds.index(HintBlock) :]
    assert msg.content[-2].hint == hint


# ---------------------------------------------------------------------------------------------
# Processes.


@pytest.fixture(scope="module")
def reference() -> list[Any]:
    """A reply with no budget (the repeat rule calls probe until max_iters): the usage per step."""
    return asyncio.run(reply(make_agent([])))


@pytest.fixture(scope="module")
def budget(reference: list[Any]) -> float:
    """The budget that weights 1/1 exhaust in step CROSS_AT (one more than the first CROSS_AT-1)."""
    return sum(costs(reference, (1.0, 1.0))[: CROSS_AT - 1]) + 1


def budget_server(budget: float, *flags: str, name: str = "budget") -> ServerProcess:
    argv = ["-m", "mw_servers.budget", "--address", "127.0.0.1:{port}", "--token-budget", str(budget), *flags]
    return ServerProcess(argv, name=name)


@pytest.fixture(scope="module")
def servers(budget: float) -> Iterator[dict[str, ServerProcess]]:
    """Started together (each start is mostly import time): the default budget, a replica of it,
    the other weights under another key, budget 0."""
    w_in, w_out = OTHER_WEIGHTS
    procs = {
        "one": budget_server(budget),
        "replica": budget_server(budget),
        "weighted": budget_server(
            budget, "--input-token-weight", str(w_in), "--output-token-weight", str(w_out), "--key", "weighted"
        ),
        "zero": budget_server(0),
    }
    start_all(procs.values())
    yield procs
    for proc in procs.values():
        proc.stop()


def reasoning_calls(remote: RemoteMiddleware) -> float:
    """The host's count of on_reasoning invocations of this middleware (its latency histogram)."""
    labels = {"middleware": remote.name, "hook": "on_reasoning"}
    return REGISTRY.get_sample_value("agentmw_hook_duration_seconds_count", labels) or 0.0


async def attach(address: str) -> RemoteMiddleware:
    return await RemoteMiddleware(address, policy=Policy(timeout=5, connect_timeout=5)).connect()


# ---------------------------------------------------------------------------------------------
# Tests.


async def test_repeat_rule_calls_the_tool_until_tools_are_withheld(reference: list[Any]) -> None:
    """The scripting the other tests rely on: with no budget, max_iters is what stops it."""
    made = steps(reference)
    assert [n for _, n in made] == [1] * MAX_ITERS + [0]


async def test_tools_stop_after_the_step_that_crosses_the_budget(
    servers: dict[str, ServerProcess], budget: float, reference: list[Any]
) -> None:
    """Weights 1/1 and other weights, each its own server: the stop moves as the arithmetic says."""
    stops = {}
    for name, weights in (("one", (1.0, 1.0)), ("weighted", OTHER_WEIGHTS)):
        remote = await attach(servers[name].address)
        agent = make_agent([remote])
        called = reasoning_calls(remote)
        items = await reply(agent)
        stops[name] = check_stopped(items, budget, weights)
        # on_reasoning declares only_when="exhausted": the host calls it only for restricted steps
        assert reasoning_calls(remote) - called == len(exhausted(items)) > 0
        check_hint(agent)
        slot = agent.state.middle_context[DEFAULT_KEY if name == "one" else "weighted"]
        assert slot["reply_id"] == end_of(items).reply_id
        assert slot["used"] == pytest.approx(sum(costs(items, weights)))
        assert slot["remaining"] == 0 and slot["budget"] == budget
        await remote.close()
    assert stops["one"] == CROSS_AT
    assert stops["weighted"] == crossing(costs(reference, OTHER_WEIGHTS), budget) > CROSS_AT


async def test_two_budgets_with_their_own_keys_stack(servers: dict[str, ServerProcess], budget: float) -> None:
    """The tighter one stops the tools; each counts in its own slot with its own weights."""
    remotes = [await attach(servers[name].address) for name in ("weighted", "one")]
    agent = make_agent(remotes)
    items = await reply(agent)
    assert check_stopped(items, budget, (1.0, 1.0)) == CROSS_AT
    slots = agent.state.middle_context
    assert slots[DEFAULT_KEY]["used"] == pytest.approx(sum(costs(items, (1.0, 1.0))))
    assert slots["weighted"]["used"] == pytest.approx(sum(costs(items, OTHER_WEIGHTS)))
    # Only the tighter one acted (the other still had budget left when tools stopped).
    assert {e.value["key"] for e in exhausted(items)} == {DEFAULT_KEY}
    for remote in remotes:
        await remote.close()


def normalized(value: Any) -> Any:
    """Items and messages without what differs between two runs (ids, times)."""
    if dataclasses.is_dataclass(value):
        return {"kind": type(value).__name__, **normalized(dataclasses.asdict(value))}
    if isinstance(value, dict):
        drop = {"id", "created_at", "finished_at", "reply_id", "session_id", "block_id"}
        return {k: normalized(v) for k, v in value.items() if k not in drop}
    if isinstance(value, list):
        return [normalized(v) for v in value]
    return value


def run_record(agent: Agent, items: list[Any]) -> Any:
    return normalized({"items": items, "context": agent.state.context, "slots": agent.state.middle_context})


SCHEMA = {"type": "object", "properties": {"status": {"type": "string"}}, "required": ["status"]}


@pytest.mark.parametrize("schema", [None, SCHEMA], ids=["plain", "structured_output"])
async def test_in_process_and_remote_give_the_same_reply(
    servers: dict[str, ServerProcess], budget: float, schema: dict | None
) -> None:
    """Conformance: the same class in-process and as a server yields the same events and context."""
    local = make_agent([ReplyBudget(token_budget=budget)])
    local_items = await reply(local, structured_schema=schema)
    remote = await attach(servers["one"].address)
    agent = make_agent([remote])
    items = await reply(agent, structured_schema=schema)
    assert len(exhausted(local_items)) == 1
    assert run_record(agent, items) == run_record(local, local_items)
    await remote.close()


async def test_two_replicas_answer_as_one_and_a_new_reply_starts_from_zero(
    servers: dict[str, ServerProcess], budget: float
) -> None:
    single = await attach(servers["one"].address)
    both = await attach(f"ipv4:{servers['one'].address},{servers['replica'].address}")
    await asyncio.sleep(0.2)  # let the channel connect to both replicas (it balances round-robin)
    runs = []
    for remote in (single, both):
        agent = make_agent([remote])
        first = await reply(agent)
        second = await reply(agent)  # the context is longer now, so it costs more per step
        assert check_stopped(second, budget, (1.0, 1.0)) < CROSS_AT  # counted from zero, not from 1st
        assert agent.state.middle_context[DEFAULT_KEY]["reply_id"] == end_of(second).reply_id
        runs.append(run_record(agent, first + second))
    assert runs[0] == runs[1]
    await single.close()
    await both.close()


async def test_a_budget_used_up_exactly_is_spent(reference: list[Any]) -> None:
    """Used equal to the budget is spent (used >= budget, as AgentScope's): the step after the one
    that reached it exactly gets no tools, from the server as from the class in-process (remote,
    the host skips on_reasoning while the slot's "exhausted" flag is off: the flag must say so)."""
    exact = sum(costs(reference, (1.0, 1.0))[:2])
    assert exact == int(exact) > 0  # whole token counts: the sum is reached exactly, not crossed
    items = await reply(make_agent([ReplyBudget(token_budget=exact)]))
    assert check_stopped(items, exact, (1.0, 1.0)) == 2
    server = budget_server(exact).start()
    try:
        remote = await attach(server.address)
        items = await reply(make_agent([remote]))
        assert check_stopped(items, exact, (1.0, 1.0)) == 2
        await remote.close()
    finally:
        server.stop()


async def test_budget_zero_allows_no_tool_round(servers: dict[str, ServerProcess]) -> None:
    remote = await attach(servers["zero"].address)
    agent = make_agent([remote])
    items = await reply(agent)
    assert check_stopped(items, 0, (1.0, 1.0)) == 0
    assert len(steps(items)) == 1
    check_hint(agent)
    await remote.close()


async def test_structured_output_owed_allows_only_its_tool(servers: dict[str, ServerProcess], budget: float) -> None:
    remote = await attach(servers["one"].address)
    agent = make_agent([remote])
    items = await reply(agent, structured_schema=SCHEMA)
    k = crossing(costs(items, (1.0, 1.0)), budget)
    tools_named = [i.tool_call_name for i in items if isinstance(i, ToolCallStartEvent)]
    # probe in the steps before the crossing, then only the structured-output tool
    assert k >= 1 and tools_named == ["probe"] * k + [STRUCTURED_OUTPUT_TOOL]
    assert len(steps(items)) == k + 1
    (event,) = exhausted(items)
    assert event.value["tool_choice"] == "auto"
    hints = [b.hint for b in agent.state.context[-1].content if isinstance(b, HintBlock)]
    assert any(STRUCTURED_OUTPUT_TOOL in h for h in hints)
    assert end_of(items).finished_reason == ReplyFinishedReason.COMPLETED
    assert items[-1].structured_output is not None
    await remote.close()


async def test_count_survives_pauses_and_a_killed_budget_server(budget: float) -> None:
    """Every probe needs a confirmation, so the reply parks after each tool call. During the second
    pause (between two reasoning steps) the budget server is SIGKILLed and restarted: the count
    goes on from the host's slot, so the tools stop exactly where the whole reply's usage says."""
    proc = budget_server(budget, name="budget-killed").start()
    try:
        remote = await attach(proc.address)
        agent = make_agent([remote], probe_confirmed)
        items = segment = await reply(agent)
        pauses = 0
        while ask := next((i for i in segment if isinstance(i, RequireUserConfirmEvent)), None):
            pauses += 1
            assert pauses <= MAX_ITERS
            if pauses == 2:
                proc.kill()
                proc.restart()  # the same port
                assert await remote.wait_ready(5)
            answer = ConfirmResult(confirmed=True, tool_call=ask.tool_calls[0])
            segment = await reply(agent, UserConfirmResultEvent(reply_id=ask.reply_id, confirm_results=[answer]))
            items = items + segment
        assert pauses == check_stopped(items, budget, (1.0, 1.0)) == CROSS_AT
        check_hint(agent)
        assert agent.state.middle_context[DEFAULT_KEY]["used"] == pytest.approx(sum(costs(items, (1.0, 1.0))))
        await remote.close()
    finally:
        proc.stop()


# ---------------------------------------------------------------------------------------------
# The command line.


@pytest.mark.parametrize(
    ("args", "env", "config", "message"),
    [
        ([], {}, "", "--token-budget is required"),
        (["--token-budget", "-5"], {}, "", "--token-budget must be a finite number >= 0, got -5.0"),
        (["--token-budget", "lots"], {}, "", "--token-budget must be a number, got 'lots'"),
        ([], {"AGENTMW_BUDGET_TOKEN_BUDGET": "-1"}, "", "AGENTMW_BUDGET_TOKEN_BUDGET must be a finite number >= 0"),
        ([], {"AGENTMW_BUDGET_TOKEN_BUDGET": "abc"}, "", "AGENTMW_BUDGET_TOKEN_BUDGET must be a number, got 'abc'"),
        (["--token-budget", "1", "--key", ""], {}, "", "--key must be a middleware key a host takes: empty"),
        (["--token-budget", "1"], {"AGENTMW_BUDGET_KEY": ""}, "", "AGENTMW_BUDGET_KEY must be a middleware key"),
        (["--token-budget", "1", "--key", "k" * 300], {}, "", "--key must be a middleware key a host takes: a "),
        ([], {}, "token_budget: 1\nkey: 5\n", "key in --config {config} must be a string, got int 5"),
        ([], {}, "token_budget: 1\naddress: 5\n", "address in --config {config} must be HOST:PORT, got int 5"),
        ([], {}, "token_budget: 1\nhint_message: [1, 2]\n", "hint_message in --config {config} must be a string"),
        ([], {}, "token_budget: [1\n", "--config {config}:2:1: malformed YAML"),
        (["--token-budget", "1", "--address", "127.0.0.1:99999"], {}, "", "--address '127.0.0.1:99999' is not HOST"),
    ],
    ids=[
        "missing",
        "negative",
        "non_numeric",
        "negative_from_env",
        "non_numeric_from_env",
        "empty_key",
        "empty_key_from_env",
        "key_too_long",
        "key_not_a_string",
        "address_not_a_string",
        "hint_not_a_string",
        "malformed_config",
        "address_out_of_range",
    ],
)
def test_bad_budget_is_one_line_and_exit_2(
    args: list[str], env: dict[str, str], config: str, message: str, tmp_path: Path
) -> None:
    """Each setting is checked before serving, naming where it came from: a bad key, address or
    hint was a traceback (or served, and every attach or exhausted reply failed), a bad address
    exit status 1, a value from the environment named as its flag."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AGENTMW_BUDGET_")}
    path = tmp_path / "budget.yaml"
    if config:
        path.write_text(config)
        args = [*args, "--config", str(path)]
    if "address:" not in config and "--address" not in args:  # else the flag would win over the file's
        args = ["--address", "127.0.0.1:0", *args]
    proc = subprocess.run(
        [sys.executable, "-m", "mw_servers.budget", *args],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"python -m mw_servers.budget: error: {message.format(config=path)}"), line
    assert proc.stdout == ""


@pytest.mark.parametrize(
    ("setting", "says"),
    [
        ({"key": 5}, "key must be a string, got int 5"),
        ({"key": ""}, "key must be a middleware key a host takes: empty middleware key"),
        ({"hint_message": [1, 2]}, "hint_message must be a string"),
    ],
)
def test_the_class_refuses_what_the_server_refuses(setting: dict[str, Any], says: str) -> None:
    """In-process too (a hint that is not text failed each exhausted reply with a CodecError)."""
    with pytest.raises(ValueError, match=f"^{says}"):
        ReplyBudget(token_budget=1, **setting)


def test_a_config_file_named_by_the_environment_is_named_so_in_errors(tmp_path: Path) -> None:
    """Before, errors from AGENTMW_BUDGET_CONFIG's file blamed --config, a flag never given."""
    with pytest.raises(SettingError, match=re.escape("AGENTMW_BUDGET_CONFIG /nonexistent.yaml")):
        settings([], {"AGENTMW_BUDGET_CONFIG": "/nonexistent.yaml"})
    config = tmp_path / "budget.yaml"
    config.write_text("token_budget: lots\n")
    with pytest.raises(SettingError, match=re.escape(f"token_budget in AGENTMW_BUDGET_CONFIG {config} ")):
        settings([], {"AGENTMW_BUDGET_CONFIG": str(config)})


def test_flags_win_over_environment_over_config_file(tmp_path: Path) -> None:
    config = tmp_path / "budget.yaml"
    config.write_text("token_budget: 7\ninput_token_weight: 3\nkey: from-file\n")
    got = settings(["--config", str(config)], {})
    assert (got["token_budget"], got["input_token_weight"], got["key"]) == (7, 3, "from-file")
    env = {"AGENTMW_BUDGET_TOKEN_BUDGET": "8", "AGENTMW_BUDGET_KEY": "from-env"}
    got = settings(["--config", str(config)], env)
    assert (got["token_budget"], got["input_token_weight"], got["key"]) == (8, 3, "from-env")
    got = settings(["--config", str(config), "--token-budget", "0", "--key", "from-flag"], env)
    assert (got["token_budget"], got["key"]) == (0, "from-flag")
