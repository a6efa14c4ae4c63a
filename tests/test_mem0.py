"""The mem0 server (mw_servers/mem0): long-term memory across sessions, with real processes.

The server runs with the mem0 venv's python (``make mem0``; skipped without it): the offline
default (bundled all-MiniLM-L6-v2, Qdrant on disk), one server and one host for the module. Where
``unshare --net`` works that server has no network at all (last test); the replicas test runs
its own two servers on loopback, with a Chroma server between them.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import yaml

from agentmw.data import CustomEvent, HintBlock, ReplyFinishedReason, UserMsg
from agentmw.v1 import hooks_pb2, hooks_pb2_grpc, host_pb2
from clients.chat import HostClient, Turn, converse
from clients.launch import ROOT, ServerProcess, start_all
from mw_servers.mem0 import HEADER, INTRO, MAX_HINT_CHARS
from tests.host_util import Procs, get_session, processes

MEM0_PY = ROOT / ".venv-mem0" / "bin" / "python"

pytestmark = [
    pytest.mark.timeout(300),  # the module's first test also waits for the embedding model to load
    pytest.mark.skipif(not MEM0_PY.exists(), reason="the mem0 venv is missing: run `make mem0`"),
]

# The offline model answers a question about a favourite thing with the hints it was given.
RECALL = {"pattern": r"what(?:'s| is) my favou?rite (\w+)", "text": "Your favourite {0}, from memory:\n{hints}"}


def host_config(tmp: Path) -> Path:
    from agent_host.config import DEFAULT_MODELS

    models = copy.deepcopy(DEFAULT_MODELS)
    models["models"]["offline"]["rules"].append(RECALL)
    path = tmp / "host.yaml"
    path.write_text(yaml.safe_dump({"models": models}))
    return path


def mem0_server(
    procs: Procs, name: str, *args: str, address: str = "127.0.0.1:{port}", isolated: bool = False
) -> ServerProcess:
    """A mem0 server process, not started yet (stopped with ``procs``); ``isolated``: in a network
    namespace of its own (``unshare --net``, which execs the server: same pid)."""
    argv = ["-m", "mw_servers.mem0", "--address", address, *args]
    proc = ServerProcess(
        ["--net", str(MEM0_PY), *argv] if isolated else argv,
        name=name,
        log_dir=procs.log_dir,
        startup=180,  # the embedding model loads first (seconds; more on a busy machine)
        new_session=True,
        executable="unshare" if isolated else str(MEM0_PY),
    )
    procs.procs.append(proc)
    return proc


def unshare_works() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(["unshare", "--net", "true"]).returncode == 0


@dataclass
class Stack:
    procs: Procs
    mem0: ServerProcess
    host: ServerProcess
    isolated: bool  # the mem0 server has no network at all
    address: str  # the mem0 server's, as the host reaches it


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The server runs with no network where ``unshare --net`` works (as root): in a network
    namespace of its own, listening on a Unix socket (which the host reaches through the file
    system); elsewhere on loopback."""
    tmp = tmp_path_factory.mktemp("mem0")
    isolated = unshare_works()
    with processes(tmp) as procs:
        store = ["--store", str(tmp / "store")]
        if isolated:
            socket_path = tmp / "mem0.sock"
            mem0 = mem0_server(procs, "mem0", *store, address=f"unix:{socket_path}", isolated=True).start()
            address = f"unix:{socket_path}"
        else:
            mem0 = mem0_server(procs, "mem0", *store).start()
            address = mem0.address
        config = str(host_config(tmp))
        host = procs.host(tmp / "sessions.db", "--config", config, "--middleware", f"mem0={address}")
        yield Stack(procs, mem0, host, isolated, address)


async def say(address: str, text: str, user: str, session: str = "") -> Turn:
    """One user turn (a new session unless ``session``), which must complete."""
    async with HostClient(address) as client:
        turn = await converse(client, session, UserMsg(text, metadata={"user_id": user}))
    assert turn.end is not None and turn.end.finished_reason == ReplyFinishedReason.COMPLETED, turn.items[-3:]
    return turn


async def memory_hints(address: str, session: str) -> list[str]:
    """The memory hints the middleware put into a session's context."""
    _, state, _ = await get_session(address, session)
    return [b.hint for m in state.context if m.name == "memory" for b in m.content if isinstance(b, HintBlock)]


def errors(turn: Turn) -> list[dict[str, Any]]:
    return [i.value for i in turn.items if isinstance(i, CustomEvent) and i.name == "mem0_error"]


# ---------------------------------------------------------------------------------------------


async def test_a_fact_told_in_one_session_is_recalled_in_the_next(stack: Stack) -> None:
    told = await say(stack.host.address, "My favourite colour is teal.", "alice")
    assert not errors(told)
    asked = await say(stack.host.address, "What is my favourite colour?", "alice")
    assert asked.session_id != told.session_id
    hints = await memory_hints(stack.host.address, asked.session_id)
    assert len(hints) == 1, hints
    header, intro, *memories = hints[0].splitlines()  # what the model reads: a heading, a line, one per memory
    assert (header, intro) == (HEADER, INTRO) and "- My favourite colour is teal." in memories, hints[0]
    assert all(line.startswith("- ") for line in memories), hints[0]
    assert "My favourite colour is teal." in asked.final.text  # the model's answer uses the hint
    # Memory is the user's own: another user is told nothing of it.
    other = await say(stack.host.address, "What is my favourite colour?", "bob")
    assert "teal" not in other.final.text and await memory_hints(stack.host.address, other.session_id) == []


async def test_long_memories_are_clipped_in_the_hint_and_a_spaced_name_is_a_user_id(stack: Stack) -> None:
    """Three 900 KB messages are remembered; the next reply's hint holds each clipped, within its
    bound. Before, the hint took them whole and every later reply of the user failed: a change of
    2.7 MB, past the host's 2 MiB per item. A user named "Ada Lovelace" (mem0 refuses spaces in an
    id: two mem0_error per reply, nothing remembered) is the user Ada_Lovelace; a blank message is
    not searched for (mem0 refused the blank query with an error)."""
    for word in ("alpha", "beta", "gamma"):
        await say(stack.host.address, f"{word} " * 150_000, "longwinded")
    asked = await say(stack.host.address, "alpha?", "longwinded")
    (hint,) = await memory_hints(stack.host.address, asked.session_id)
    assert len(hint) <= MAX_HINT_CHARS and hint.count("- ") >= 3, len(hint)
    async with HostClient(stack.host.address) as client:
        told = await converse(client, "", UserMsg("My cat is called Miso.", name="Ada Lovelace"))
        blank = await converse(client, "", UserMsg("   ", name="Ada Lovelace"))
        asked_cat = await converse(client, "", UserMsg("What is my cat called?", name="Ada Lovelace"))
    assert not errors(told) and not errors(blank) and not errors(asked_cat), (errors(told), errors(blank))
    assert "- My cat is called Miso." in (await memory_hints(stack.host.address, asked_cat.session_id))[0]


async def test_with_authentication_a_user_reaches_only_their_own_memories(stack: Stack, tmp_path: Path) -> None:
    """On a host with authentication a session's memories are its owner's (agent.state.owner):
    another user reaches them neither by naming the owner in a message (metadata user_id) nor by
    plain messages. Before, plain messages of every user shared the --user-id memory, and a
    message could name any user."""
    from agent_host.config import DEFAULT_MODELS

    models = copy.deepcopy(DEFAULT_MODELS)
    models["models"]["offline"]["rules"].append(RECALL)
    users = [{"name": n, "role": "user", "token_env": f"{n.upper()}_TOKEN"} for n in ("alice", "bob")]
    config = tmp_path / "auth.yaml"
    config.write_text(yaml.safe_dump({"models": models, "security": {"users": users}}))
    tokens = {"ALICE_TOKEN": "alice-token-1234", "BOB_TOKEN": "bob-token-5678"}
    argv = ["-m", "agent_host", "--listen", "127.0.0.1:0", "--db", str(tmp_path / "s.db"), "--config", str(config)]
    host = stack.procs.start("auth-host", [*argv, "--middleware", f"mem0={stack.address}"], env=tokens)

    async def say_as(token: str, text: str, **metadata: str) -> str:
        async with HostClient(host.address, token=token) as client:
            turn = await converse(client, "", UserMsg(text, metadata=metadata))
        assert turn.end is not None and turn.end.finished_reason == ReplyFinishedReason.COMPLETED, turn.items[-3:]
        assert not errors(turn)
        return turn.final.text

    await say_as(tokens["BOB_TOKEN"], "My favourite parrot is Kiwi.")
    await say_as(tokens["BOB_TOKEN"], "My favourite boat is Nautilus.", user_id="bob")
    assert "Kiwi" in await say_as(tokens["BOB_TOKEN"], "What is my favourite parrot?")  # his own, recalled
    for question in ("What is my favourite parrot?", "What is my favourite boat?"):
        for claimed in ({}, {"user_id": "bob"}):
            answer = await say_as(tokens["ALICE_TOKEN"], question, **claimed)
            assert "Kiwi" not in answer and "Nautilus" not in answer, (question, claimed, answer)
    # The memory tools act for the session's owner too, also where the session has no mem0 slot
    # (a reply resumed after the server was attached): as the host calls them, with the owner in
    # the context. Before, such a call searched the shared --user-id memory, for every user.
    async with grpc.aio.insecure_channel(stack.address) as channel:
        tools = hooks_pb2_grpc.ToolSourceStub(channel)

        async def search_as(owner: str) -> str:
            request = hooks_pb2.CallToolRequest(context=hooks_pb2.HookContext(session_owner=owner))
            request.tool_call.id, request.tool_call.name = "call-1", "search_memory"
            request.tool_input.update({"keywords": ["favourite parrot"]})
            return str([item async for item in tools.CallTool(request, timeout=60)])

        assert "Kiwi" in await search_as("bob")
        assert "Kiwi" not in await search_as("alice")


async def test_the_model_calls_the_memory_tools_which_run_in_the_mem0_server(stack: Stack) -> None:
    async with HostClient(stack.host.address) as client:
        listed = await client.stub.ListMiddleware(host_pb2.ListMiddlewareRequest(), timeout=10)
    assert sorted(next(m for m in listed.middleware if m.name == "mem0").tools) == [
        "mem0__add_memory",
        "mem0__search_memory",
    ]
    fact = {"thinking": "a lasting fact about the user", "content": ["Carol's cat is called Miso."]}
    added = await say(stack.host.address, f"call mem0__add_memory {json.dumps(fact)}", "carol")
    assert "mem0__add_memory returned Remembered 1 item(s)" in added.final.text
    # A new session: the search runs in the server, scoped to the session's user.
    found = await say(stack.host.address, 'call mem0__search_memory {"keywords": ["cat name"]}', "carol")
    assert "- Carol's cat is called Miso." in found.final.text
    stranger = await say(stack.host.address, 'call mem0__search_memory {"keywords": ["cat name"]}', "dave")
    assert "(no relevant memories found)" in stranger.final.text


async def test_memories_outlive_a_crash_and_restart_of_the_mem0_server(stack: Stack) -> None:
    await say(stack.host.address, "My favourite city is Lisbon.", "erin")
    stack.mem0.kill()  # a crash: no chance to flush anything
    stack.mem0.start()  # same port, same store on disk
    async with HostClient(stack.host.address) as client:
        for _ in range(40):  # bounded: the host's channel reconnects after its backoff
            asked = await converse(client, "", UserMsg("What is my favourite city?", metadata={"user_id": "erin"}))
            if asked.end is not None and asked.end.finished_reason == ReplyFinishedReason.COMPLETED:
                break
            await asyncio.sleep(0.5)
    assert "My favourite city is Lisbon." in asked.final.text


# ---------------------------------------------------------------------------------------------
# Two replicas, one served store (Chroma's server; Qdrant local mode allows one process a path).


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def chroma(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    port = free_port()
    log = (tmp_path / "chroma.log").open("wb")
    argv = [str(MEM0_PY.parent / "chroma"), "run", "--path", str(tmp_path / "chroma"), "--host", "127.0.0.1"]
    proc = subprocess.Popen([*argv, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:  # bounded: ready once its heartbeat answers
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/v2/heartbeat", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "chroma.log").read_text()[-2000:]
            time.sleep(0.2)
        yield proc, port
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


async def test_two_replicas_share_a_served_store_and_report_its_failure(
    chroma: tuple[subprocess.Popen[bytes], int], tmp_path: Path
) -> None:
    proc, port = chroma
    config = tmp_path / "mem0.yaml"
    store = {"provider": "chroma", "config": {"host": "127.0.0.1", "port": port, "collection_name": "shared"}}
    config.write_text(yaml.safe_dump({"vector_store": store}))
    with processes(tmp_path) as procs:
        # Replicas 0 and 1 await their write-backs; 2 writes in the background (--write background).
        replicas = start_all(
            mem0_server(
                procs,
                f"mem0-{i}",
                "--config",
                str(config),
                "--store",
                str(tmp_path / f"r{i}"),
                *(["--write", "background"] if i == 2 else []),
            )
            for i in range(3)
        )
        hosts = [
            procs.host(
                tmp_path / f"h{i}.db", "--config", str(host_config(tmp_path)), "--middleware", f"mem0={r.address}"
            )
            for i, r in enumerate(replicas)
        ]
        await say(hosts[0].address, "My favourite tree is the oak.", "frank")  # written by replica 0
        asked = await say(hosts[1].address, "What is my favourite tree?", "frank")  # read by replica 1
        assert "My favourite tree is the oak." in asked.final.text

        # The store goes away: the reply still completes, and the client is told what failed.
        proc.terminate()
        proc.wait(10)
        failed = await say(hosts[1].address, "What is my favourite tree?", "frank")
        assert [e["operation"] for e in errors(failed)] == ["search", "add"]
        assert all(e["user_id"] == "frank" and e["error"] for e in errors(failed))
        for _ in range(100):  # its log line, read from the process's output by another thread (bounded)
            if "mem0 search failed" in "\n".join(replicas[1]._lines):
                break
            await asyncio.sleep(0.1)
        assert "mem0 search failed" in "\n".join(replicas[1]._lines)

        # Written in the background, the write-back fails after its reply has ended: the session's
        # next reply reports it (before its own failures), so the client still learns of it.
        first = await say(hosts[2].address, "What is my favourite tree?", "frank")
        assert [e["operation"] for e in errors(first)] == ["search"]
        for _ in range(200):  # until the background write has failed (bounded)
            if "mem0 add failed" in "\n".join(replicas[2]._lines):
                break
            await asyncio.sleep(0.05)
        later = await say(hosts[2].address, "Still there?", "frank", session=first.session_id)
        assert [e["operation"] for e in errors(later)] == ["add", "search"]
        assert all(e["user_id"] == "frank" and e["error"] for e in errors(later))


# ---------------------------------------------------------------------------------------------


def test_the_server_the_other_tests_use_has_no_network(stack: Stack) -> None:
    """Everything above ran against a server in a network namespace with no interface but a
    loopback that is down: nothing it loads or does can reach a network."""
    if not stack.isolated:
        pytest.skip("unshare --net is not permitted here: the server ran on loopback")
    pid = stack.mem0.pid
    assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
    interfaces = [line.split(":")[0].strip() for line in Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:]]
    assert interfaces == ["lo"]
    assert (
        "state DOWN"
        in subprocess.run(
            ["nsenter", "-t", str(pid), "-n", "ip", "link", "show", "lo"], capture_output=True, text=True
        ).stdout
    )


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--store", "{file}"], "--store '{file}' cannot be a directory: File exists"),
        (["--address", "127.0.0.1:99999"], "--address '127.0.0.1:99999' is not HOST:PORT"),
        (["--top-k", "0"], "configuration error: --top-k: top_k must be at least 1, got 0"),
        (["--user-id", " "], "configuration error: --user-id: user_id must name a user without spaces"),
        (["--user-id", "a b"], "configuration error: --user-id: user_id must name a user without spaces"),
        (["--address", "{busy}"], "mw_servers.mem0: cannot listen on {busy} (address already in use)"),
    ],
)
def test_bad_flags_are_one_line(flags: list[str], says: str, tmp_path: Path) -> None:
    """Each was a traceback (a file as --store), a port gRPC wraps, or accepted (--top-k 0; a blank
    --user-id, which mem0 then refused at every call of every reply); each is said before the
    model loads (--top-k was only once the model had loaded: "cannot start"; a port in use only
    once serve() bound it, after the model had loaded for seconds)."""
    file = tmp_path / "a-file"
    file.write_text("")
    with socket.socket() as taken:  # a port in use: said before the model loads, too
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = f"127.0.0.1:{taken.getsockname()[1]}"
        argv = [str(MEM0_PY), "-m", "mw_servers.mem0", "--store", str(tmp_path / "store"), "--address", "127.0.0.1:0"]
        argv += [f.replace("{file}", str(file)).replace("{busy}", busy) for f in flags]
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode in (1, 2), done.stdout + done.stderr
    said = says.replace("{file}", str(file)).replace("{busy}", busy)
    assert said in done.stderr.strip().splitlines()[-1], done.stderr
    assert "Traceback" not in done.stderr, done.stderr
