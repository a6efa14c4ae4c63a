"""A middleware in another language: the Node.js example (mw_servers/examples/node), written from
the .proto files alone, attached to the Python host like any other remote middleware.

It tags the system prompt, injects CustomEvent "node_hello" right after ReplyStartEvent, and counts
the session's replies in its own slot. Skipped when node or npm is not installed.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_host.agent import Agent
from agent_host.models import OfflineRuleModel
from agent_host.remote import Policy, RemoteMiddleware
from agentmw.data import (
    ConfirmResult,
    CustomEvent,
    Msg,
    ReplyEndEvent,
    ReplyFinishedReason,
    ReplyStartEvent,
    RequireUserConfirmEvent,
    TextBlockDeltaEvent,
    ToolResultEndEvent,
    UserConfirmResultEvent,
    UserMsg,
)
from agentmw.middleware import MiddlewareBase
from agentmw.tools import Toolkit, tool
from clients.launch import ROOT, ServerProcess

NODE_DIR = ROOT / "mw_servers" / "examples" / "node"
TAG = "\n[tagged by node]"

pytestmark = pytest.mark.skipif(
    shutil.which("node") is None or shutil.which("npm") is None,
    reason="node and npm are needed for the Node.js example middleware (not found on PATH)",
)


def ensure_node_modules() -> None:
    """`npm ci` once, if the dependencies are not installed yet (`make install` normally does it)."""
    if (NODE_DIR / "node_modules").is_dir():
        return
    try:
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund"],
            cwd=NODE_DIR,
            check=True,
            capture_output=True,
            text=True,
            timeout=300,
        )
    except subprocess.CalledProcessError as e:
        pytest.fail(f"npm ci failed in {NODE_DIR}:\n{e.stdout}\n{e.stderr}")
    except subprocess.TimeoutExpired:
        pytest.fail(f"npm ci timed out in {NODE_DIR}")


@pytest.fixture(scope="module")
def node_server() -> Iterator[ServerProcess]:
    ensure_node_modules()
    proc = ServerProcess(
        [str(NODE_DIR / "server.js"), "--address", "127.0.0.1:{port}"],
        name="NodeTagger",
        executable="node",
    )
    proc.start()
    yield proc
    proc.stop()


async def connect(address: str) -> RemoteMiddleware:
    return await RemoteMiddleware(address, policy=Policy(timeout=10)).connect()


async def reply(agent: Agent, inputs: str | UserConfirmResultEvent) -> list[Any]:
    async with asyncio.timeout(30):
        return [item async for item in agent.reply_stream(UserMsg(inputs) if isinstance(inputs, str) else inputs)]


def check_reply(items: list[Any]) -> str:
    """No failure, node_hello right after ReplyStartEvent; returns the final text."""
    bypassed = [i for i in items if isinstance(i, CustomEvent) and i.name == "middleware_bypassed"]
    assert not bypassed, bypassed
    (end,) = [i for i in items if isinstance(i, ReplyEndEvent)]
    assert end.finished_reason == ReplyFinishedReason.COMPLETED, end.error
    starts = [n for n, i in enumerate(items) if isinstance(i, ReplyStartEvent)]
    assert len(starts) == 1
    hello = items[starts[0] + 1]
    assert isinstance(hello, CustomEvent) and hello.name == "node_hello", hello
    assert hello.value == {"lang": "node"}
    assert isinstance(items[-1], Msg)
    return items[-1].text


async def test_node_middleware_two_replies(node_server: ServerProcess) -> None:
    remote = await connect(node_server.address)
    assert remote.key == "NodeTagger"
    agent = Agent(model=OfflineRuleModel(reply_template="{system}"), middlewares=[remote])
    deltas = 0
    try:
        for n in (1, 2):  # the second reply reuses the hook streams (STREAMS ARE REUSED)
            items = await reply(agent, f"hello {n}")
            text = check_reply(items)
            assert text.endswith(TAG), text
            deltas += sum(isinstance(i, TextBlockDeltaEvent) for i in items)
            assert agent.state.middle_context["NodeTagger"] == {"replies": n, "deltas": deltas}
        assert remote.bypasses == 0
    finally:
        await remote.close()
    assert node_server.running and not node_server.died


class PyWatcher(MiddlewareBase):
    """In-process Python middleware, outside the Node one: marks the prompt and sees node_hello."""

    def __init__(self) -> None:
        self.customs: list[str] = []

    async def on_system_prompt(self, agent: Any, prompt: str) -> str:
        return "[py] " + prompt  # a prefix, so the Node tag stays last whatever the order

    async def on_reply(self, agent: Any, input_kwargs: dict[str, Any], next_handler: Any) -> AsyncIterator[Any]:
        async for item in next_handler():
            if isinstance(item, CustomEvent):
                self.customs.append(item.name)
            yield item


async def test_node_and_python_middleware_mixed(node_server: ServerProcess) -> None:
    remote = await connect(node_server.address)
    py = PyWatcher()
    agent = Agent(model=OfflineRuleModel(reply_template="{system}"), middlewares=[py, remote])
    try:
        for n in (1, 2):
            text = check_reply(await reply(agent, f"hi {n}"))
            assert text.startswith("[py] ") and text.endswith(TAG), text
            assert agent.state.middle_context["NodeTagger"]["replies"] == n
        assert py.customs == ["node_hello", "node_hello"]  # the outer Python layer saw Node's event
        assert remote.bypasses == 0
    finally:
        await remote.close()


@tool(description="Send an email.", needs_confirmation=True)
def send_email(to: str, body: str) -> str:
    return f"sent to {to}: {body}"


async def test_parked_reply_counts_once(node_server: ServerProcess) -> None:
    """A reply parked for a confirmation and resumed is one reply: the resuming on_reply call has
    no ReplyStartEvent, so NodeTagger neither says hello nor counts again."""
    remote = await connect(node_server.address)
    agent = Agent(model=OfflineRuleModel(), toolkit=Toolkit([send_email]), middlewares=[remote])
    try:
        parked = await reply(agent, 'call send_email {"to": "bob", "body": "hi"}')
        ask = next(i for i in parked if isinstance(i, RequireUserConfirmEvent))
        assert [i.name for i in parked if isinstance(i, CustomEvent)] == ["node_hello"]
        answer = ConfirmResult(confirmed=True, tool_call=ask.tool_calls[0])
        resumed = await reply(agent, UserConfirmResultEvent(reply_id=ask.reply_id, confirm_results=[answer]))
        (end,) = [i for i in resumed if isinstance(i, ReplyEndEvent)]
        assert end.finished_reason == ReplyFinishedReason.COMPLETED, end.error
        assert not any(isinstance(i, CustomEvent) for i in resumed)
        assert agent.state.middle_context["NodeTagger"]["replies"] == 1
        assert remote.bypasses == 0
    finally:
        await remote.close()


async def test_node_refills_credits_as_its_last_observed_item_uses_the_grant(node_server: ServerProcess) -> None:
    """NodeTagger pulls for more credits when an observed delta uses up its grant. With exactly 32
    (and 64) deltas that refill reaches the host after inner_done: harmless (hooks.proto, pull)."""
    remote = await connect(node_server.address)
    try:
        for words in (32, 64, 40):
            template = " ".join(f"w{i}" for i in range(words))
            agent = Agent(model=OfflineRuleModel(reply_template=template), middlewares=[remote])
            items = await reply(agent, "hello")
            assert check_reply(items).split() == template.split()
            assert agent.state.middle_context["NodeTagger"] == {"replies": 1, "deltas": words}
        assert remote.bypasses == 0
    finally:
        await remote.close()


@tool(description="Add two numbers.")
def add(a: int, b: int) -> str:
    return str(a + b)


class PromptSeen(MiddlewareBase):
    """In-process, after NodeTagger: notes the system prompt each reasoning step ends up with."""

    def __init__(self) -> None:
        self.prompts: list[str] = []

    async def on_system_prompt(self, agent: Any, prompt: str) -> str:
        self.prompts.append(prompt)
        return prompt


async def test_node_declares_its_prompt_cacheable_and_is_asked_once(tmp_path: Path) -> None:
    """NodeTagger's new prompt is the input plus a fixed tag: declared ``cacheable`` (hooks.proto,
    HookDescription), it is asked once for a reply of two reasoning steps (a tool round), where an
    undeclared prompt is asked at every step; the tag is in the answer. Its slot changes from one
    reply to the next, and the host asks again then (the answer may depend on the slot).
    NodeTagger's AGENTMW_DEBUG log counts the begins it received; an in-process layer after it sees
    the tagged prompt every time the agent asks (at both steps)."""
    ensure_node_modules()
    proc = ServerProcess(
        [str(NODE_DIR / "server.js"), "--address", "127.0.0.1:{port}"],
        name="NodeTagger-debug",
        executable="node",
        env={"AGENTMW_DEBUG": "1"},
        log_dir=tmp_path,
    ).start()
    try:
        remote = await connect(proc.address)
        assert remote.tables["on_system_prompt"].cacheable
        seen = PromptSeen()
        agent = Agent(model=OfflineRuleModel(), toolkit=Toolkit([add]), middlewares=[remote, seen])
        try:
            items = await reply(agent, "call add a=1 b=2")
            assert sum(isinstance(i, ToolResultEndEvent) for i in items) == 1
            assert check_reply(items) == "Done: add returned 3."
            assert len(seen.prompts) >= 2 and all(p.endswith(TAG) for p in seen.prompts), seen.prompts
        finally:
            await remote.close()
    finally:
        proc.stop()
    assert proc.log_path is not None
    log = proc.log_path.read_text().splitlines()
    begins = [line for line in log if line.startswith("[on_system_prompt ") and ' <- {"begin"' in line]
    assert len(begins) == 1, begins
