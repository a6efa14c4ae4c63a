"""Security (docs/security.md), on real processes with certificates made here (tests/certs.py):
mutual TLS on the host and on middleware servers, token / certificate authentication with user
and admin roles, session owners, middleware keys and permissions, the attach allow-list, limits,
and secrets kept out of the log and the store."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent_host.config import load_config
from agent_host.security import TlsFiles, client_channel
from agentmw.codec import codec
from agentmw.data import Msg, ReplyEndEvent
from agentmw.errors import ConfigError
from agentmw.sdk.server import TLS_SETTINGS
from agentmw.security import tls_hint, token_digest
from agentmw.v1 import hooks_pb2, hooks_pb2_grpc, host_pb2
from clients.chat import UserMsg
from clients.host_client import HostClient
from clients.launch import ROOT, ServerProcess
from tests.certs import Authority, Pki, pki
from tests.host_util import kill_all, run_cli, run_cli_aside, stub
from tests.model_servers import ScriptedServer, openai_chunk, openai_stream

TOKENS = {"alice": "alice-token-7f3a9c", "bob": "bob-token-2d8e41", "ops": "ops-token-91bc55"}
MW_TOKEN = "middleware-token-5ae0d2"
API_KEY = "sk-test-apikey-c0ffee1234"
RECORDER = "tests.host_util:RecorderMiddleware"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return pki(tmp_path_factory.mktemp("pki"))


class Procs:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[ServerProcess] = []

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> ServerProcess:
        proc = ServerProcess(argv, name=name, env=env, log_dir=self.log_dir, startup=20, new_session=True)
        self.procs.append(proc)
        return proc.start()

    def middleware(self, target: str, name: str, env: dict[str, str] | None = None, *args: str) -> ServerProcess:
        return self.start(name, ["-m", "agentmw.sdk", target, "--address", "127.0.0.1:0", *args], env)

    def host(self, tmp: Path, config: str, env: dict[str, str] | None = None, name: str = "host") -> ServerProcess:
        path = tmp / f"{name}.yaml"
        path.write_text(config)
        argv = ["-m", "agent_host", "--config", str(path), "--listen", "127.0.0.1:0", "--db", str(tmp / f"{name}.db")]
        return self.start(name, [*argv, "--log-level", "debug"], env)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        kill_all(p.procs)


def mtls_config(c: Pki, users: str = "") -> str:
    """host.yaml of a host that serves mTLS (clients show a certificate of the CA), with ``users``
    (YAML lines under ``security.users``)."""
    config = f"security:\n  tls: {{cert: {c.server.cert}, key: {c.server.key}, client_ca: {c.ca}}}\n"
    return config + (f"  users:\n{users}" if users else "")


def host_tls(c: Pki, client: str | None = None, *, rogue: bool = False) -> TlsFiles:
    pair = c.rogue if rogue else c.clients[client] if client else None
    return TlsFiles(ca=c.ca, cert=pair.cert if pair else "", key=pair.key if pair else "")


async def call(channel: grpc.aio.Channel, method: str, request: Any, timeout: float = 8) -> Any:
    return await getattr(stub(channel), method)(request, timeout=timeout)


async def code_of(
    channel: grpc.aio.Channel, method: str, request: Any, timeout: float = 8
) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call(channel, method, request, timeout)
    return err.value.code(), err.value.details() or ""


async def reply(channel: grpc.aio.Channel, text: str, session_id: str = "") -> tuple[str, list[Any]]:
    """One reply; the session id (the host's, for a new one) and the items."""
    start = host_pb2.StartReply(session_id=session_id)
    codec.encode(UserMsg(text), start.message)
    items, sid = [], session_id
    async for event in stub(channel).Reply(iter([host_pb2.ReplyRequest(start=start)]), timeout=20):
        sid = event.session_id
        items += [codec.decode_item(i) for i in event.items]
    return sid, items


# ---------------------------------------------------------------------------------------------


async def test_replies_per_owner_limits_each_users_replies_at_once(procs: Procs, tmp_path: Path) -> None:
    """limits.replies_per_owner on one host (SQLite): a user's second reply while her first runs
    is refused (RESOURCE_EXHAUSTED, saying the limit); another user's goes on; once her first has
    ended she may reply again."""
    config = """
models:
  default: slow
  models:
    slow: {provider: offline, delay: 0.05, reply_template: "one two three four five six seven eight nine ten"}
security:
  users:
    - {name: alice, role: user, token_env: ALICE_TOKEN}
    - {name: bob, role: user, token_env: BOB_TOKEN}
limits: {replies_per_owner: 1}
"""
    env = {f"{n.upper()}_TOKEN": t for n, t in TOKENS.items()}
    host = procs.host(tmp_path, config, env)
    alice, bob = (client_channel(host.address, token=TOKENS[n]) for n in ("alice", "bob"))
    try:
        first = asyncio.ensure_future(reply(alice, "a long one"))
        async with asyncio.timeout(10):  # her first reply is under way (it holds her one place)
            while not (await call(alice, "ListSessions", host_pb2.ListSessionsRequest())).sessions:
                await asyncio.sleep(0.02)
        with pytest.raises(grpc.aio.AioRpcError) as second:
            await reply(alice, "and another")
        assert second.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "at most 1 replies at once per user" in (second.value.details() or "")
        _, items = await reply(bob, "mine runs")  # another user's replies count apart
        assert isinstance(items[-1], Msg)
        _, items = await first
        assert isinstance(items[-1], Msg)
        _, items = await reply(alice, "now again")  # her first has ended
        assert isinstance(items[-1], Msg)
    finally:
        await alice.close()
        await bob.close()


async def test_sessions_per_owner_holds_for_first_replies_sent_at_once(procs: Procs, tmp_path: Path) -> None:
    """limits.sessions_per_owner: 2, and a user sends 10 new-session replies at once: 2 run, 8 are
    refused (RESOURCE_EXHAUSTED). Before, each was counted against the stored sessions only, and a
    new session is stored at its first write: 8 went through."""
    config = """
models:
  default: slow
  models:
    slow: {provider: offline, delay: 0.02, reply_template: "one two three"}
security:
  users:
    - {name: alice, role: user, token_env: ALICE_TOKEN}
limits: {sessions_per_owner: 2, replies_per_owner: 100}
"""
    host = procs.host(tmp_path, config, {"ALICE_TOKEN": TOKENS["alice"]})
    alice = client_channel(host.address, token=TOKENS["alice"])
    try:

        async def one(i: int) -> str:
            try:
                await reply(alice, f"hello {i}")
                return "ok"
            except grpc.aio.AioRpcError as exc:
                return exc.code().name

        outcomes = await asyncio.gather(*(one(i) for i in range(10)))
        assert sorted(outcomes) == ["RESOURCE_EXHAUSTED"] * 8 + ["ok"] * 2, outcomes
        owned = await call(alice, "ListSessions", host_pb2.ListSessionsRequest())
        assert len(owned.sessions) == 2
    finally:
        await alice.close()


async def test_mtls_host_refuses_plaintext_and_foreign_certificates(certs: Pki, procs: Procs, tmp_path: Path) -> None:
    users = "    - {name: ops, role: admin, cert_cn: ops}\n    - {name: alice, role: user, cert_cn: alice}\n"
    host = procs.host(tmp_path, mtls_config(certs, users))
    listing = host_pb2.ListSessionsRequest()
    async with client_channel(host.address, host_tls(certs, "ops")) as ops:
        await call(ops, "ListMiddleware", host_pb2.ListMiddlewareRequest())  # the admin's certificate
    async with client_channel(host.address, host_tls(certs, "alice")) as alice:
        await call(alice, "ListSessions", listing)  # a user may list (her own) sessions ...
        code, _ = await code_of(alice, "ListMiddleware", host_pb2.ListMiddlewareRequest())
        assert code == grpc.StatusCode.PERMISSION_DENIED  # ... but not what only an admin may
    refused = [
        client_channel(host.address, host_tls(certs)),  # TLS, no client certificate
        client_channel(host.address, host_tls(certs, rogue=True)),  # "ops", signed by another CA
        grpc.aio.insecure_channel(host.address),  # plaintext
    ]
    for channel in refused:
        async with channel:
            code, details = await code_of(channel, "ListSessions", listing)
            assert code == grpc.StatusCode.UNAVAILABLE, details  # the handshake fails: nothing is served


async def test_middleware_server_accepts_only_its_host(certs: Pki, procs: Procs, tmp_path: Path) -> None:
    served = {
        "AGENTMW_MW_TLS_CERT": certs.server.cert,
        "AGENTMW_MW_TLS_KEY": certs.server.key,
        "AGENTMW_MW_TLS_CLIENT_CA": certs.ca,
        "AGENTMW_MW_TOKEN": MW_TOKEN,
    }
    recorder = procs.middleware(RECORDER, "recorder", served)
    describe = hooks_pb2.DescribeRequest(protocol_version="v1")
    token = (("authorization", f"Bearer {MW_TOKEN}"),)

    async def describe_with(channel: grpc.aio.Channel, metadata: Any = ()) -> grpc.StatusCode:
        async with channel:
            try:
                await hooks_pb2_grpc.DescribeStub(channel).Describe(describe, timeout=8, metadata=metadata)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

    assert await describe_with(client_channel(recorder.address, host_tls(certs, "host")), token) == grpc.StatusCode.OK
    assert await describe_with(grpc.aio.insecure_channel(recorder.address), token) == grpc.StatusCode.UNAVAILABLE
    rogue = client_channel(recorder.address, host_tls(certs, rogue=True))
    assert await describe_with(rogue, token) == grpc.StatusCode.UNAVAILABLE
    no_token = client_channel(recorder.address, host_tls(certs, "host"))
    assert await describe_with(no_token) == grpc.StatusCode.UNAUTHENTICATED
    wrong = (("authorization", "Bearer not-the-token"),)
    assert await describe_with(client_channel(recorder.address, host_tls(certs, "host")), wrong) == (
        grpc.StatusCode.UNAUTHENTICATED
    )

    # The host with its certificate and the token: the recorder is attached and takes part.
    host_side = f"""
middleware: [{{name: rec, address: "{recorder.address}", key: recorder}}]
security:
  middleware_tls: {{ca: {certs.ca}, cert: {certs.clients["host"].cert}, key: {certs.clients["host"].key}}}
"""
    env = {"AGENTMW_MIDDLEWARE_TOKEN": MW_TOKEN}
    host = procs.host(tmp_path, host_side, env)
    async with grpc.aio.insecure_channel(host.address) as channel:
        sid, items = await reply(channel, "hello")
        assert isinstance(items[-1], Msg)
        session = await call(channel, "GetSession", host_pb2.GetSessionRequest(session_id=sid))
        assert json.loads(session.middle_context_json)["recorder"]["starts"] == 1
    # Without the token the same host cannot use it (and says so at startup).
    (tmp_path / "bad.yaml").write_text(host_side)
    out = run_cli("agent_host", "--config", str(tmp_path / "bad.yaml"), "--listen", "127.0.0.1:0", "--db", ":memory:")
    assert out.returncode == 1 and "UNAUTHENTICATED" in out.stderr, out.stderr


BAD_CALLS = 60  # a refused stream call came back INTERNAL now and then (grpc/grpc#36066)
BIG = "x" * 1_000_000  # a first request still being written when a refusal comes (a late write lost it)


async def test_a_refused_stream_call_is_always_unauthenticated(procs: Procs, tmp_path: Path) -> None:
    """A Reply (as agent-chat sends it) with a wrong token, and a hook call to a middleware server
    with a wrong token, are refused UNAUTHENTICATED every time: one after another, and all at once
    on one channel. Before, the server aborted the stream before reading the client's first
    request, and grpc-python's client then reported its own failed write (INTERNAL "Internal error
    from Core") in place of the status now and then; a large first request (still being written
    when the refusal came) made that the usual outcome."""
    users = "security:\n  users:\n    - {name: alice, role: user, token_env: ALICE_TOKEN}\n"
    host = procs.host(tmp_path, users, {"ALICE_TOKEN": TOKENS["alice"]})
    recorder = procs.middleware(RECORDER, "recorder", {"AGENTMW_MW_TOKEN": MW_TOKEN})

    async def bad_reply(client: HostClient | None) -> str:
        async with contextlib.AsyncExitStack() as stack:
            client = client or await stack.enter_async_context(HostClient(host.address, None, "wrong-token"))
            try:
                async for _ in client.reply("", UserMsg(BIG)):
                    pass
            except grpc.aio.AioRpcError as exc:
                return f"{exc.code().name}: {exc.details()}"
        return "OK"

    async def bad_hook_call(channel: grpc.aio.Channel) -> str:
        run = channel.stream_stream(
            "/agentmw.v1.OnReply/Run",
            request_serializer=hooks_pb2.HostMessage.SerializeToString,
            response_deserializer=hooks_pb2.MiddlewareMessage.FromString,
        )
        wrong = (("authorization", "Bearer not-the-token"),)
        first = hooks_pb2.HostMessage(inner_error=hooks_pb2.InnerError(message=BIG))  # any message will do
        try:
            async for _ in run(iter([first]), metadata=wrong, timeout=8):
                pass
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
        return "OK"

    replies = [await bad_reply(None) for _ in range(BAD_CALLS)]
    async with HostClient(host.address, None, "wrong-token") as shared:
        replies += await asyncio.gather(*(bad_reply(shared) for _ in range(BAD_CALLS)))
    assert set(replies) == {"UNAUTHENTICATED: a valid token or certificate is required"}, replies
    # Said in the host's log, for the operator: the call and the peer, never the token (before: nothing).
    await asyncio.to_thread(host.wait_for_line, "refused /agentmw.v1.AgentHost/Reply from ipv4:")
    refusals = [x for x in host.tail(200).splitlines() if "refused /agentmw.v1.AgentHost/Reply from ipv4:" in x]
    assert refusals and all("no valid token or certificate" in x and "wrong-token" not in x for x in refusals)
    async with grpc.aio.insecure_channel(recorder.address) as channel:
        hooks = [await bad_hook_call(channel) for _ in range(BAD_CALLS)]
        hooks += await asyncio.gather(*(bad_hook_call(channel) for _ in range(BAD_CALLS)))
    assert set(hooks) == {"UNAUTHENTICATED: this middleware server accepts only its host"}, hooks


def test_an_expired_server_certificate_is_named_as_such(procs: Procs, tmp_path: Path) -> None:
    """A host whose certificate has expired: the client's error says so. Before, every failed
    verification read "not signed by the CA trusted here", sending the operator to the wrong file."""
    ca = Authority(tmp_path, "test-ca")
    expired = ca.issue("server", server=True, expired=True)
    host = procs.host(tmp_path, f"security:\n  tls: {{cert: {expired.cert}, key: {expired.key}}}\n")
    done = run_cli("clients.admin", "--host", host.address, "--tls-ca", ca.pem, "status", timeout=30)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"agentmw: cannot reach the host at {host.address} "
        "(UNAVAILABLE; the TLS handshake failed: the server's certificate has expired)"
    ), done.stderr


def test_a_stream_that_broke_after_it_began_is_not_blamed_on_tls() -> None:
    """ "Stream removed (Socket closed)": the call had its stream, so the connection had come up and
    TLS is no suspect (agent-chat said so for a host killed before the client read its first event,
    under load). A connection refused with "Socket closed" alone still gets the hint."""
    hint = partial(tls_hint, tls=False, use_tls="--tls-ca", client_cert="--tls-cert")
    assert hint("Stream removed (Socket closed)") == ""
    refused = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Socket closed"
    assert hint(refused) == "TLS may be the cause: does the server require TLS (--tls-ca)?"


def test_a_tls_mismatch_is_named_as_a_possible_cause(certs: Pki, procs: Procs, tmp_path: Path) -> None:
    """A plaintext client of a TLS host, a TLS client without the certificate an mTLS host wants,
    a TLS client of a plaintext host, and a plaintext host attaching a TLS middleware server: each
    error says TLS may be the cause and where to set it up. Before, the first two and the last said
    only "Socket closed" (agentmw not even that), read as "the server is down"."""
    secured = procs.host(tmp_path, mtls_config(certs))
    plain = procs.start("plain", ["-m", "agent_host", "--listen", "127.0.0.1:0", "--db", ":memory:"])
    served = {"AGENTMW_MW_TLS_CERT": certs.server.cert, "AGENTMW_MW_TLS_KEY": certs.server.key}
    recorder = procs.middleware(RECORDER, "recorder", served)
    needs_tls = "TLS may be the cause: does the server require TLS (--tls-ca)?"
    needs_cert = "TLS may be the cause: does the server require a client certificate it trusts (--tls-cert, --tls-key)?"

    # The five commands run at once (each a process of its own; a failed handshake takes seconds,
    # the failed attach is answered after the host's anti-scan delay), then are checked in turn.
    attaching = run_cli_aside(
        "clients.admin", "--host", plain.address, "middleware", "attach", recorder.address, timeout=60
    )
    runs = [
        run_cli_aside(*argv, timeout=30)
        for argv in (
            ("clients.chat", "--host", secured.address, "-m", "hi"),
            ("clients.chat", "--host", secured.address, "--tls-ca", certs.ca, "-m", "hi"),
            ("clients.admin", "--host", secured.address, "status"),
            ("clients.chat", "--host", plain.address, "--tls-ca", certs.ca, "-m", "hi"),
        )
    ]

    def last_line(run: Future[subprocess.CompletedProcess[str]]) -> str:
        done = run.result()
        assert done.returncode == 1, done.stdout + done.stderr
        return done.stderr.strip().splitlines()[-1]

    plaintext, no_cert, status, to_plain = map(last_line, runs)
    assert plaintext.endswith(f"Socket closed ({needs_tls})"), plaintext
    assert no_cert.endswith(f"Socket closed ({needs_cert})"), no_cert
    assert status == f"agentmw: cannot reach the host at {secured.address} (UNAVAILABLE; {needs_tls})"
    assert to_plain.endswith("(the TLS handshake failed: the server may not use TLS)"), to_plain

    attach = attaching.result()
    assert attach.returncode == 1, attach.stdout + attach.stderr
    line = plain.wait_for_line(f"cannot connect to {recorder.address}")
    assert line.endswith("Socket closed (TLS may be the cause: does the server require TLS (security.middleware_tls)?)")


def test_interactive_agent_chat_reaches_a_tls_host(certs: Pki, procs: Procs, tmp_path: Path) -> None:
    """agent-chat without --message checks the host's health and lists /sessions over the TLS it
    was given. Before, both went plaintext: 'cannot reach the host' from a host that -m reached."""
    host = procs.host(tmp_path, mtls_config(certs))
    alice = certs.clients["alice"]
    argv = ["--host", host.address, "--tls-ca", certs.ca, "--tls-cert", alice.cert, "--tls-key", alice.key]
    done = subprocess.run(
        [sys.executable, "-m", "clients.chat", *argv],
        cwd=ROOT,
        input="hello\n/sessions\n/quit\n",
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"connected to {host.address}" in done.stdout and "You said: hello" in done.stdout, done.stdout
    assert "  * " in done.stdout, done.stdout  # /sessions lists the current one


def test_the_agentmw_cli_reaches_a_secured_host(certs: Pki, procs: Procs, tmp_path: Path) -> None:
    """agentmw takes agent-chat's TLS flags and token (--token-file or AGENTMW_TOKEN), before or
    after the command; without them a secured host is out of its reach. Before, it had neither and
    could only operate a plaintext host without users."""
    users = "    - {name: ops, role: admin, cert_cn: ops}\n    - {name: alice, role: user, token_env: ALICE_TOKEN}\n"
    host = procs.host(tmp_path, mtls_config(certs, users), {"ALICE_TOKEN": TOKENS["alice"]})
    ops, nobody = certs.clients["ops"], certs.clients["host"]  # "host" names no user: a token must
    mtls = ["--tls-ca", certs.ca, "--tls-cert", ops.cert, "--tls-key", ops.key]
    tls = ["--tls-ca", certs.ca, "--tls-cert", nobody.cert, "--tls-key", nobody.key]
    token_file = tmp_path / "alice.token"
    token_file.write_text(TOKENS["alice"] + "\n")

    def agentmw(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return run_cli("clients.admin", "--host", host.address, *args, env={"AGENTMW_TOKEN": "", **(env or {})})

    status = agentmw(*mtls, "status")  # the admin, by her certificate
    assert status.returncode == 0 and "SERVING" in status.stdout, status.stderr
    listed = agentmw("middleware", "list", *mtls)  # the flags after the command
    assert listed.returncode == 0 and "no middleware attached" in listed.stdout, listed.stderr
    mine = agentmw("sessions", "list", *tls, "--token-file", str(token_file))
    assert mine.returncode == 0 and "(no sessions)" in mine.stdout, mine.stderr
    by_env = agentmw(*tls, "middleware", "list", env={"AGENTMW_TOKEN": TOKENS["alice"]})
    assert by_env.returncode == 1 and "PERMISSION_DENIED" in by_env.stderr, by_env.stderr  # alice is no admin
    anonymous = agentmw(*tls, "sessions", "list")
    assert anonymous.returncode == 1 and "UNAUTHENTICATED" in anonymous.stderr, anonymous.stderr
    plaintext = agentmw("status")
    assert plaintext.returncode == 1 and "cannot reach the host" in plaintext.stderr, plaintext.stderr
    missing = agentmw("--tls-ca", str(tmp_path / "nope.pem"), "status")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr, missing.stderr
    assert missing.stderr.startswith("agentmw: ") and "nope.pem" in missing.stderr


async def test_users_own_their_sessions_and_admins_attach(procs: Procs, tmp_path: Path) -> None:
    """Tokens map to users; a user sees, reads, deletes and replies to her own sessions only, and
    another user's session answers exactly as a missing one; only an admin attaches. Limits hold.
    Neither the tokens nor the model's API key end up in the host's log or its database."""
    recorder = procs.middleware(RECORDER, "recorder")
    with ScriptedServer() as model:
        model.replies += [openai_stream([openai_chunk("Hello there.", finish="stop")]) for _ in range(6)]
        config = f"""
models:
  default: remote
  models:
    remote: {{provider: openai, model_name: m, base_url: "{model.url}/v1", max_retries: 0}}
security:
  users:
    - {{name: alice, role: user, token_env: ALICE_TOKEN}}
    - {{name: bob, role: user, token_env: BOB_TOKEN}}
    - {{name: ops, role: admin, token_env: OPS_TOKEN}}
limits: {{sessions_per_owner: 1, max_message_bytes: 65536}}
"""
        env = {f"{n.upper()}_TOKEN": t for n, t in TOKENS.items()} | {"OPENAI_API_KEY": API_KEY}
        host = procs.host(tmp_path, config, env)
        channels = {n: client_channel(host.address, token=t) for n, t in TOKENS.items()}
        alice, bob, ops = channels["alice"], channels["bob"], channels["ops"]
        try:
            sid, items = await reply(alice, "my secret plans")
            assert isinstance(items[-1], Msg) and "Hello there." in items[-1].text
            assert any(API_KEY in r.headers.get("authorization", "") for r in model.requests)  # the key was used

            # Unauthenticated or unknown callers get nothing.
            async with grpc.aio.insecure_channel(host.address) as anonymous:
                code, _ = await code_of(anonymous, "ListSessions", host_pb2.ListSessionsRequest())
                assert code == grpc.StatusCode.UNAUTHENTICATED
            async with client_channel(host.address, token="guessed") as guess:
                code, _ = await code_of(guess, "GetSession", host_pb2.GetSessionRequest(session_id=sid))
                assert code == grpc.StatusCode.UNAUTHENTICATED

            # bob: alice's session is invisible, and answers exactly as a missing one.
            listed = await call(bob, "ListSessions", host_pb2.ListSessionsRequest())
            assert [s.session_id for s in listed.sessions] == []
            missing = "0" * len(sid)
            for method, request in (
                ("GetSession", host_pb2.GetSessionRequest),
                ("DeleteSession", host_pb2.DeleteSessionRequest),
            ):
                theirs = await _outcome(bob, method, request(session_id=sid))
                nobody = await _outcome(bob, method, request(session_id=missing))
                assert theirs == tuple(str(x).replace(missing, sid) for x in nobody), (theirs, nobody)
            with pytest.raises(grpc.aio.AioRpcError) as theirs_reply:
                await reply(bob, "let me in", sid)
            with pytest.raises(grpc.aio.AioRpcError) as nobody_reply:
                await reply(bob, "let me in", missing)
            assert theirs_reply.value.code() == nobody_reply.value.code() == grpc.StatusCode.NOT_FOUND
            assert theirs_reply.value.details() == nobody_reply.value.details().replace(missing, sid)

            # alice still has her session; the admin sees it too.
            mine = await call(alice, "GetSession", host_pb2.GetSessionRequest(session_id=sid))
            assert mine.summary.title == "my secret plans"
            listed = await call(ops, "ListSessions", host_pb2.ListSessionsRequest())
            assert [s.session_id for s in listed.sessions] == [sid]

            # Only an admin attaches, detaches or lists middleware.
            attach = host_pb2.AttachMiddlewareRequest(address=recorder.address, name="rec")
            for user in (alice, bob):
                code, _ = await code_of(user, "AttachMiddleware", attach)
                assert code == grpc.StatusCode.PERMISSION_DENIED
                code, _ = await code_of(user, "DetachMiddleware", host_pb2.DetachMiddlewareRequest(name="rec"))
                assert code == grpc.StatusCode.PERMISSION_DENIED
            assert (await call(ops, "AttachMiddleware", attach)).key == "recorder"

            # Limits: one session per user here; messages up to 64 KiB.
            with pytest.raises(grpc.aio.AioRpcError) as second:
                await reply(alice, "another conversation")
            assert second.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(grpc.aio.AioRpcError) as big:
                await reply(bob, "x" * 100_000)
            assert big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

            # A user deletes her own session.
            assert (await call(alice, "DeleteSession", host_pb2.DeleteSessionRequest(session_id=sid))).deleted
        finally:
            for channel in channels.values():
                await channel.close()
    assert host.stop() == 0
    # Secrets: not in the host's log, not in the store (the database and its WAL).
    stored = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("host.db"))
    logged = (tmp_path / "host.log").read_bytes()
    for secret in [*TOKENS.values(), API_KEY]:
        assert secret.encode() not in stored, secret
        assert secret.encode() not in logged, secret


async def _outcome(channel: grpc.aio.Channel, method: str, request: Any) -> tuple[str, ...]:
    try:
        response = await call(channel, method, request)
    except grpc.aio.AioRpcError as exc:
        return (exc.code().name, exc.details() or "")
    return ("OK", str(response))


async def test_middleware_identity_and_permissions(procs: Procs, tmp_path: Path) -> None:
    """The host decides a middleware's key, hooks, context and mutations."""
    recorder = procs.middleware(RECORDER, "recorder")
    spy = procs.middleware(RECORDER, "spy")  # another server reporting the same key, "recorder"
    reader = procs.middleware("tests.security_mw:ContextReader", "reader")
    set_model = procs.start("raw", ["-m", "tests.raw_mw", "unknown_model", "--address", "127.0.0.1:0"])
    host = procs.host(
        tmp_path,
        f"""
middleware:
  - {{name: rec, address: "{recorder.address}", key: recorder}}
  - {{name: raw, address: "{set_model.address}", permissions: {{set_model: false}}}}
security:
  attach_permissions: {{context: false}}
""",
    )
    async with grpc.aio.insecure_channel(host.address) as channel:
        # A mutation the middleware may not make fails its hook (not the model lookup it asked for).
        sid, items = await reply(channel, "hello")
        end = next(i for i in items if isinstance(i, ReplyEndEvent))
        assert end.finished_reason.value == "error"
        assert "set_model is not allowed by its configuration" in items[-1].text, items[-1].text
        await call(channel, "DetachMiddleware", host_pb2.DetachMiddlewareRequest(name="raw"))
        sid, _ = await reply(channel, "hello again", sid)
        session = await call(channel, "GetSession", host_pb2.GetSessionRequest(session_id=sid))
        assert json.loads(session.middle_context_json)["recorder"]["starts"] >= 1

        # A middleware claiming the configured key of another never gets its slot, even while
        # the owner is detached.
        await call(channel, "DetachMiddleware", host_pb2.DetachMiddlewareRequest(name="rec"))
        code, details = await code_of(
            channel, "AttachMiddleware", host_pb2.AttachMiddlewareRequest(address=spy.address, name="spy")
        )
        assert code == grpc.StatusCode.ALREADY_EXISTS and "reserved" in details, details
        # The owner itself comes back under its configured key.
        info = await call(channel, "AttachMiddleware", host_pb2.AttachMiddlewareRequest(address=recorder.address))
        assert info.key == "recorder"

        # Attached middleware may not have the context here: one asking for it is refused, and
        # so never receives it. The refusal is answered only after the host's anti-scan delay
        # (5 s), but decided (and logged) at once: the test goes on once it is decided, and takes
        # the answer at the end. (Were it attached, the answer would come at once: OK.)
        refusal = "asks for the context (wants_context) in on_reply"
        attaching = asyncio.ensure_future(
            code_of(channel, "AttachMiddleware", host_pb2.AttachMiddlewareRequest(address=reader.address))
        )
        async with asyncio.timeout(10):
            while not attaching.done() and refusal not in host.tail(200):
                await asyncio.sleep(0.05)
        sid, _ = await reply(channel, "a third message", sid)
        session = await call(channel, "GetSession", host_pb2.GetSessionRequest(session_id=sid))
        assert "context_reader" not in json.loads(session.middle_context_json)

        # A configured key that Describe does not report refuses to start (here: the spy's is "recorder").
        (tmp_path / "claim.yaml").write_text(f'middleware: [{{name: b, address: "{spy.address}", key: budget}}]\n')
        claim = ["agent_host", "--config", str(tmp_path / "claim.yaml"), "--listen", "127.0.0.1:0", "--db", ":memory:"]
        out = await asyncio.to_thread(run_cli, *claim)
        assert out.returncode == 1 and "reports key 'recorder' (configured: 'budget')" in out.stderr, out.stderr
        # Control: with the context allowed, the same reader does receive it.
        (tmp_path / "ctx.yaml").write_text(f'middleware: [{{name: r, address: "{reader.address}"}}]\n')
        host2 = await asyncio.to_thread(procs.host, tmp_path, (tmp_path / "ctx.yaml").read_text(), name="host2")
        async with grpc.aio.insecure_channel(host2.address) as channel2:
            sid2, _ = await reply(channel2, "hello")
            session = await call(channel2, "GetSession", host_pb2.GetSessionRequest(session_id=sid2))
            assert json.loads(session.middle_context_json)["context_reader"]["messages_seen"] >= 1

        code, _ = await attaching  # the refusal's answer, held back until now
        assert code == grpc.StatusCode.UNAVAILABLE
    assert host.stop() == 0
    assert refusal in (tmp_path / "host.log").read_text()


@pytest.mark.parametrize(("mode", "op"), [("summary", "set_summary"), ("drop_all", "drop_messages")])
async def test_compressing_the_context_needs_mutate_context(mode: str, op: str) -> None:
    """Setting the summary and dropping old messages change the context as compression does: a
    middleware configured with mutate_context: false may not."""
    from agent_host.agent import Agent
    from agent_host.config import Permissions
    from agent_host.models import OfflineRuleModel
    from agent_host.remote import Policy, RemoteMiddleware
    from agent_host.remote.client import Access

    proc = ServerProcess(["-m", "tests.raw_mw", mode, "--address", "127.0.0.1:0"]).start()
    remote = RemoteMiddleware(
        proc.address, policy=Policy(timeout=5), access=Access(permissions=Permissions(mutate_context=False))
    )
    try:
        agent = Agent(model=OfflineRuleModel(), middlewares=[await remote.connect()])
        items = [item async for item in agent.reply_stream(UserMsg("hi"))]
        end = next(i for i in items if isinstance(i, ReplyEndEvent))
        assert end.finished_reason.value == "error" and end.error is not None
        assert f"{op} is not allowed by its configuration (mutate_context: false)" in end.error.message
        assert agent.state.summary == ""
    finally:
        await remote.close()
        proc.stop()


OVERRIDES = {
    "current_model": ("on_model_call", {"onModelCall": {"currentModel": {"id": "other"}}}, "set_model"),
    "inputs": (
        "on_reply",
        {"onReply": {"message": {"id": "m", "name": "user", "role": "ROLE_USER"}}},
        "mutate_context",
    ),
    "context_config": (
        "on_compress_context",
        {"onCompressContext": {"contextConfig": {"triggerRatio": 0}}},
        "mutate_context",
    ),
    # The model asks for add; the middleware runs get_weather instead, past the permission check
    # (and the user's confirmation, for a tool that needs one), its result stored as add's.
    "tool_call": (
        "on_acting",
        {"onActing": {"toolCall": {"id": "c", "name": "get_weather", "input": '{"city": "OTHER"}'}}},
        "mutate_context",
    ),
}


@pytest.mark.parametrize("kwarg", sorted(OVERRIDES))
async def test_an_override_in_call_next_needs_the_permission_its_change_needs(tmp_path: Path, kwarg: str) -> None:
    """Choosing the model, the reply's stored messages, how the context is compressed or which tool
    a call runs through a call_next override changes what set_model / append_message /
    drop_messages change: a middleware without that permission may not. Before, only the mutations
    were checked: an override chose another model, stored forged messages, compressed the whole
    context away, or ran another tool than the one the user confirmed."""
    from agent_host.agent import Agent
    from agent_host.config import Permissions
    from agent_host.models import ModelRegistry, OfflineRuleModel
    from agent_host.remote import Policy, RemoteMiddleware
    from agent_host.remote.client import Access
    from agentmw.tools import Toolkit

    from .harness import add, get_weather

    hook, overrides, needed = OVERRIDES[kwarg]
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    argv = ["-m", "tests.evil_mw", "--scripts", str(scripts), "--hooks", hook, "--address", "127.0.0.1:0"]
    proc = ServerProcess(argv).start()
    denied = Permissions(set_model=False, mutate_context=False)
    remote = RemoteMiddleware(proc.address, policy=Policy(timeout=5), access=Access(permissions=denied))
    try:
        models = ModelRegistry(default="main")
        models.add(OfflineRuleModel(id="main"))
        models.add(OfflineRuleModel(id="other", reply_template="OTHER: {text}"))
        toolkit = Toolkit([add, get_weather])
        agent = Agent(model="main", models=models, toolkit=toolkit, middlewares=[await remote.connect()])
        (scripts / f"{agent.state.session_id}.json").write_text(
            json.dumps({"messages": [{"callNext": {"overrides": overrides}}]})
        )
        items = [item async for item in agent.reply_stream(UserMsg("call add a=1 b=2"))]
        end = next(i for i in items if isinstance(i, ReplyEndEvent))
        assert end.finished_reason.value == "error" and end.error is not None
        assert f"overriding {kwarg} is not allowed by its configuration ({needed}: false)" in end.error.message
        assert not any("OTHER" in getattr(i, "delta", "") for i in items)
    finally:
        await remote.close()
        proc.stop()


async def test_editing_a_tool_call_without_changing_its_tool_or_input_needs_no_permission() -> None:
    """on_acting may pass the call on with other fields edited (here a timestamp): the same tool runs
    with the same input, so mutate_context is not needed (only another tool or input needs it)."""
    from agent_host.agent import Agent
    from agent_host.config import Permissions
    from agent_host.models import OfflineRuleModel
    from agent_host.remote import Policy, RemoteMiddleware
    from agent_host.remote.client import Access
    from agentmw.data import ToolResultEndEvent
    from agentmw.tools import Toolkit
    from clients.launch import middleware_server

    from .harness import add

    proc = middleware_server("tests.security_mw:ToolCallStamper").start()
    access = Access(permissions=Permissions(mutate_context=False))
    remote = RemoteMiddleware(proc.address, policy=Policy(timeout=5), access=access)
    try:
        agent = Agent(model=OfflineRuleModel(), toolkit=Toolkit([add]), middlewares=[await remote.connect()])
        items = [item async for item in agent.reply_stream(UserMsg("call add a=1 b=2"))]
        end = next(i for i in items if isinstance(i, ReplyEndEvent))
        assert end.finished_reason.value == "completed", end.error
        assert any(isinstance(i, ToolResultEndEvent) and i.state.value == "success" for i in items), items
    finally:
        await remote.close()
        proc.stop()


async def test_editing_the_parameters_of_the_current_model_needs_no_set_model() -> None:
    """An override of current_model that names the model it was given, with its parameters edited,
    changes what the ``parameters`` kwarg changes, which needs no permission: a middleware without
    set_model may (before, its edit was refused as a choice of model, and the reply failed)."""
    from agent_host.agent import Agent
    from agent_host.config import Permissions
    from agent_host.models import ModelRegistry, OfflineRuleModel
    from agent_host.remote import Policy, RemoteMiddleware
    from agent_host.remote.client import Access
    from clients.launch import middleware_server

    proc = middleware_server("tests.conformance_mw:ColdModel", how="in_place").start()
    access = Access(permissions=Permissions(set_model=False))
    remote = RemoteMiddleware(proc.address, policy=Policy(timeout=5), access=access)
    try:
        models = ModelRegistry(default="main")
        models.add(OfflineRuleModel(id="main", reply_template="{parameters}"))
        agent = Agent(model="main", models=models, middlewares=[await remote.connect()])
        items = [item async for item in agent.reply_stream(UserMsg("cold please"))]
        assert items[-1].text == '{"temperature": 0.1}', items[-1].text
    finally:
        await remote.close()
        proc.stop()


@pytest.mark.parametrize(
    ("target", "allowed"),
    [
        ("10.0.0.7:50061", True),
        ("ipv4:10.0.0.1:50061,10.0.0.2:50061", True),
        ("dns:///10.0.0.3:50061", True),
        ("10.0.0.1.localhost:50061", False),  # a name, not an address of 10.0.0.*: resolves anywhere
        ("10.0.0.1.attacker.example:50061", False),
        ("ipv4:10.0.0.1:50061,127.0.0.1:50061", False),  # every replica must be allowed
        ("dns://8.8.8.8/10.0.0.3:50061", False),  # another resolver: not named in the list
        ("10.0.0.7:50062", False),
        ("dns://8.8.8.8/mw.internal:50061", True),  # listed exactly below
        ("unix:/run/mw.sock", True),
    ],
)
def test_attach_allow_patterns_match_addresses_label_by_label(target: str, allowed: bool) -> None:
    """'10.0.0.*:50061' admits the addresses 10.0.0.N, not every target whose text starts so:
    fnmatch over the whole target let '10.0.0.1.localhost:50061' (127.0.0.1) be attached. A
    resolver or unix: target only when listed exactly."""
    from agent_host.security import address_allowed

    allow = ["10.0.0.*:50061", "dns://8.8.8.8/mw.internal:50061", "unix:/run/mw.sock"]
    assert address_allowed(target, allow) is allowed


def test_secrets_stay_out_of_messages_and_reprs() -> None:
    """A PostgreSQL password given as a DSN parameter was printed whole in the host's error when the
    store could not be opened (only user:password@ was masked); the middleware token was in
    repr(SecurityConfig)."""
    from agent_host.config import SecurityConfig
    from agent_host.store.postgres import redact

    dsn = "postgresql://agent@127.0.0.1:1/agentmw?sslmode=disable&password=Hunter2&sslpassword=Other3"
    assert redact(dsn) == "postgresql://agent@127.0.0.1:1/agentmw?sslmode=disable&password=***&sslpassword=***"
    assert redact("postgresql://agent:Hunter2@h/db") == "postgresql://agent:***@h/db"
    assert "Hunter2" not in repr(SecurityConfig(middleware_token="Hunter2"))
    host = run_cli("agent_host", "--listen", "127.0.0.1:0", "--db", dsn)
    assert host.returncode != 0 and "Hunter2" not in host.stderr + host.stdout, host.stderr


@pytest.fixture
def silent_port() -> Iterator[int]:
    """An open TCP port that accepts connections and never speaks (not a gRPC server)."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    held: list[socket.socket] = []

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        server.close()


def closed_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


async def test_attach_allow_list_gives_no_port_signal(procs: Procs, tmp_path: Path, silent_port: int) -> None:
    recorder = procs.middleware(RECORDER, "recorder")
    closed, other_closed = closed_port(), closed_port()
    allowed = [f"127.0.0.1:{closed}", f"127.0.0.1:{silent_port}"]
    host = procs.host(tmp_path, f"security: {{attach_allow: {json.dumps(allowed)}}}\n")
    async with grpc.aio.insecure_channel(host.address) as channel:

        async def attach(address: str) -> tuple[grpc.StatusCode, str]:
            request = host_pb2.AttachMiddlewareRequest(address=address)
            code, details = await code_of(channel, "AttachMiddleware", request, timeout=30)  # attaches queue
            return code, details.replace(address, "<address>")

        # Not on the list: refused before any connection, whatever is (or is not) listening there.
        outside = [recorder.address, f"127.0.0.1:{other_closed}", "10.255.255.1:50061"]
        refusals = {await attach(a) for a in outside}
        assert len(refusals) == 1 and next(iter(refusals))[0] == grpc.StatusCode.PERMISSION_DENIED, refusals
        # On the list: a closed port and an open one that is no middleware answer alike.
        failures = set(await asyncio.gather(*(attach(a) for a in allowed)))
        assert len(failures) == 1, failures
        code, details = next(iter(failures))
        assert code == grpc.StatusCode.UNAVAILABLE and "log" in details, details
        listed = await call(channel, "ListMiddleware", host_pb2.ListMiddlewareRequest())
        assert list(listed.middleware) == []


@pytest.mark.parametrize(
    ("second", "error"),
    [
        ("token_env: ALICE_TOKEN", "security.users[1]: 'bob' has the same token as 'alice'"),
        (f"token_sha256: '{token_digest(TOKENS['alice'])}'", "security.users[1]: 'bob' has the same token as 'alice'"),
        ("cert_cn: alice", "security.users[1].cert_cn: 'alice' is 'alice''s already"),
    ],
)
def test_two_users_with_one_token_or_certificate_are_a_configuration_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, second: str, error: str
) -> None:
    """A token (or certificate name) identifies one user: two users with the same one were accepted,
    and every call of the second ran as the first (its role, its sessions)."""
    path = tmp_path / "host.yaml"
    path.write_text(
        "security:\n  users:\n"
        "    - {name: alice, role: user, token_env: ALICE_TOKEN, cert_cn: alice}\n"
        f"    - {{name: bob, role: admin, {second}}}\n"
    )
    monkeypatch.setenv("ALICE_TOKEN", TOKENS["alice"])
    with pytest.raises(ConfigError) as raised:
        load_config(path, env={})
    assert error in str(raised.value), raised.value


def test_tls_files_that_cannot_be_used_are_a_configuration_error(certs: Pki, tmp_path: Path) -> None:
    """A certificate with another's key, a file that is not PEM, a missing file: the host said
    'cannot listen on 127.0.0.1:0 (address in use or not local)' (gRPC only fails to bind) and the
    SDK the same; now each is a configuration error naming the files and why, exit status 2 from
    both (the SDK exited 1, which a supervisor reads as "restart", not "fix the configuration")."""
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    alice = certs.clients["alice"]
    cases = [
        ((certs.server.cert, alice.key), "cannot be used (KEY_VALUES_MISMATCH)"),
        ((str(garbage), str(garbage)), "cannot be used (not PEM)"),
        ((str(tmp_path / "nonexist.pem"), alice.key), None),
    ]
    for (cert, key), why in cases:
        argv = ["--listen", "127.0.0.1:0", "--db", ":memory:", "--tls-cert", cert, "--tls-key", key]
        host = run_cli("agent_host", *argv)
        said = f"the TLS cert {cert} with its key {key} {why}" if why else f"cannot read the TLS cert {cert} ("
        assert host.returncode == 2, host.stderr
        where = "flag --tls-cert, flag --tls-key"  # where the files were given (it said "security.tls")
        assert host.stderr.strip().startswith(f"agent-host: configuration error: {where}: {said}"), host.stderr
        sdk = run_cli("agentmw.sdk", RECORDER, "--address", "127.0.0.1:0", "--tls-cert", cert, "--tls-key", key)
        assert sdk.returncode == 2 and "Traceback" not in sdk.stderr, sdk.stderr
        assert (
            sdk.stderr.strip()
            .splitlines()[-1]
            .startswith(f"agentmw middleware RecorderMiddleware: configuration error: {TLS_SETTINGS}: {said}")
        ), sdk.stderr
    bad_ca = run_cli("agent_host", "--listen", "127.0.0.1:0", "--db", ":memory:", "--tls-client-ca", str(garbage))
    assert bad_ca.returncode == 2 and f"the TLS CA {garbage} cannot be used" in bad_ca.stderr, bad_ca.stderr


def test_a_user_known_only_by_certificate_needs_a_client_ca(certs: Pki, tmp_path: Path) -> None:
    """Without security.tls.client_ca, or with require_client_cert: false, the host asks for no
    client certificate, so such a user's every call failed UNAUTHENTICATED, with no word at start
    (the second case was docs/security.md's own example); a token as well is enough."""
    path = tmp_path / "host.yaml"
    users = (
        f"  users:\n    - {{name: alice, role: user, token_sha256: {'ab' * 32}}}\n"
        "    - {name: ops, role: admin, cert_cn: ops}\n"
    )
    files = f"cert: {certs.server.cert}, key: {certs.server.key}, client_ca: {certs.ca}"
    tls = f"  tls: {{{files}, require_client_cert: false}}\n"
    for security in (users, tls + users):
        path.write_text("security:\n" + security)
        host = run_cli("agent_host", "--config", str(path), "--listen", "127.0.0.1:0", "--db", ":memory:")
        assert host.returncode == 2, host.stdout + host.stderr
        assert host.stderr.strip() == (
            f"agent-host: configuration error: {path}: security.users[1]: user 'ops' has only a cert_cn, which "
            "needs security.tls.client_ca (or --tls-client-ca / AGENTMW_TLS_CLIENT_CA) with require_client_cert: "
            "true to be checked"
        )
    path.write_text(f"security:\n  users:\n    - {{name: ops, role: admin, cert_cn: ops, token_sha256: {'ab' * 32}}}\n")
    assert load_config(path, env={}).security.users[0].cert_cn == "ops"


async def test_a_host_with_tls_everywhere_exits_on_sigterm_as_fast_as_a_plaintext_one(
    certs: Pki, procs: Procs, tmp_path: Path
) -> None:
    """A host serving TLS, with its middleware over mutual TLS, took some 2 s more to exit on
    SIGTERM than a plaintext one: its middleware channels, left in reference cycles, were only
    collected at the interpreter's exit, where gRPC's shutdown waited for the TLS one."""
    served = {
        "AGENTMW_MW_TLS_CERT": certs.server.cert,
        "AGENTMW_MW_TLS_KEY": certs.server.key,
        "AGENTMW_MW_TLS_CLIENT_CA": certs.ca,
    }
    client = certs.clients["host"]
    host_side = f"  middleware_tls: {{ca: {certs.ca}, cert: {client.cert}, key: {client.key}}}\n"
    exits = {}
    for tls in (False, True):
        recorder = procs.middleware(RECORDER, f"recorder-{tls}", served if tls else None)
        config = f"middleware: [{{name: rec, address: '{recorder.address}'}}]\n"
        host = procs.host(tmp_path, config + (mtls_config(certs) + host_side if tls else ""), name=f"host-{tls}")
        async with client_channel(host.address, host_tls(certs, "ops") if tls else None) as channel:
            await call(channel, "ListMiddleware", host_pb2.ListMiddlewareRequest())  # it serves: SIGTERM drains
        started = time.monotonic()
        assert host.stop(timeout=20) == 0, host.tail()
        exits[tls] = time.monotonic() - started
    assert exits[True] < exits[False] + 1.0, exits  # generous: the difference was 2 s


def test_relative_paths_in_host_yaml_are_relative_to_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file a host.yaml names (TLS files, token files, a model's api_key_file, the SQLite db)
    is found beside it when relative, whatever the working directory (they were looked up in the
    working directory: `agent-host --config /etc/agentmw/host.yaml` with `cert: server.pem` failed,
    'cannot read the TLS cert server.pem'); flags and variables stay relative to the working directory."""
    conf = tmp_path / "conf"
    files = pki(conf / "pki")
    (conf / "tokens").mkdir()
    for name in ("alice", "mw", "model"):
        (conf / "tokens" / name).write_text(f"{name}-secret\n")
    rel = {
        which: str(Path(path).relative_to(conf))
        for which, path in (
            ("ca", files.ca),
            ("cert", files.server.cert),
            ("key", files.server.key),
            ("host_cert", files.clients["host"].cert),
            ("host_key", files.clients["host"].key),
        )
    }
    (conf / "host.yaml").write_text(
        f"db: data/sessions.db\n"
        f"models: {{default: m, models: {{m: {{provider: openai, model_name: x, api_key_file: tokens/model}}}}}}\n"
        "security:\n"
        f"  tls: {{cert: {rel['cert']}, key: {rel['key']}, client_ca: {rel['ca']}}}\n"
        "  users: [{name: alice, role: user, token_file: tokens/alice}]\n"
        f"  middleware_tls: {{ca: {rel['ca']}, cert: {rel['host_cert']}, key: {rel['host_key']}, server_name: s}}\n"
        "  middleware_token_file: tokens/mw\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_config(Path("..", "conf", "host.yaml"), env={})  # a relative --config too
    sec = config.security
    assert (sec.tls.cert, sec.tls.key, sec.tls.ca) == (files.server.cert, files.server.key, files.ca)
    host = files.clients["host"]
    assert (sec.middleware_tls.ca, sec.middleware_tls.cert, sec.middleware_tls.key) == (files.ca, host.cert, host.key)
    assert sec.middleware_tls.server_name == "s"  # a name, not a file
    assert sec.users[0].token_sha256 == token_digest("alice-secret") and sec.middleware_token == "mw-secret"
    assert config.db == str(conf / "data" / "sessions.db")
    assert config.build_models().get("m").api_key == "model-secret"
    # A flag's or a variable's path is the user's in the working directory, as any command's.
    (elsewhere / "ca.pem").write_bytes(Path(files.ca).read_bytes())
    flagged = load_config(conf / "host.yaml", env={"AGENTMW_TLS_CLIENT_CA": "ca.pem"}, flags={"db": "here.db"})
    assert flagged.db == "here.db" and flagged.security.tls.ca == "ca.pem"
    # A DSN and ":memory:" are no paths.
    (conf / "host.yaml").write_text("db: ':memory:'\n")
    assert load_config(conf / "host.yaml", env={}).db == ":memory:"
    (conf / "host.yaml").write_text("store: {dsn: 'postgresql://u@db/agentmw'}\n")
    assert load_config(conf / "host.yaml", env={}).db == "postgresql://u@db/agentmw"


@pytest.mark.parametrize(
    ("how", "edit"),
    [
        ("in_place", {"extra_headers": {"Authorization": "Bearer theirs", "Host": "elsewhere.example"}}),
        ("in_place", {"extra_body": {"model": "gpt-expensive"}}),
        ("kwarg", {"model": "gpt-expensive"}),
        ("kwarg", {"extra_query": {"redirect": "1"}}),
    ],
)
async def test_a_calls_parameters_cannot_set_the_model_or_the_transport(how: str, edit: dict[str, Any]) -> None:
    """on_model_call's parameters (a middleware needs no permission for them) may tune the request
    (temperature, top_k, ...), not choose the model (set_model's) nor reach the transport (headers,
    query, endpoint): the call is refused (invalid_request, not retried) before any request, where
    the SDK sent them (a Host header or Authorization of the middleware's choosing, another model).
    The operator's configured parameters pass (the second reply)."""
    from agent_host.agent import Agent
    from agent_host.models import ModelRegistry
    from agent_host.models.openai_compat import OpenAICompatibleModel
    from agentmw.middleware import MiddlewareBase

    class Tamper(MiddlewareBase):
        async def on_model_call(self, agent: Any, input_kwargs: Any, next_handler: Any) -> Any:
            if how == "in_place":
                input_kwargs["current_model"].parameters.update(edit)
                return await next_handler()
            return await next_handler(parameters=edit)

    with ScriptedServer() as model:
        model.replies += [openai_stream([openai_chunk("hello")]) for _ in range(2)]
        configured = {"extra_headers": {"X-Team": "ops"}}  # the operator's: allowed
        models = ModelRegistry(default="m")
        models.add(
            OpenAICompatibleModel(
                id="m", model_name="cheap", base_url=f"{model.url}/v1", api_key="sk-host", parameters=configured
            ),
            max_retries=2,
        )
        items = [
            item async for item in Agent(model="m", models=models, middlewares=[Tamper()]).reply_stream(UserMsg("hi"))
        ]
        end = next(i for i in items if isinstance(i, ReplyEndEvent))
        assert end.error is not None and end.error.type == "invalid_request", end
        assert "a call's parameters may not set" in end.error.message
        assert model.requests == [], "no request went out, and none was retried"
        items = [item async for item in Agent(model="m", models=models).reply_stream(UserMsg("hi"))]
        assert isinstance(items[-1], Msg) and items[-1].text == "hello"
        assert model.requests[0].headers.get("x-team") == "ops"


def test_a_token_on_the_command_line_is_refused_without_being_repeated(tmp_path: Path) -> None:
    """`--token SECRET` (there is no such flag: a token is never an argument) is refused and the
    secret is not printed back; before, argparse took it for --token-file and said it could not
    read the file SECRET. A token file of two lines is one clear error, not INTERNAL 'Invalid
    metadata' from the first call."""
    secret = "ops-TOKEN-4242"
    # Misspelt too (--tok, --toke=): argparse quotes what it does not take ('unrecognized
    # arguments: --tok SECRET', or "invalid choice: 'SECRET'" where agentmw expects its command).
    spellings = (
        ["--token", secret],
        [f"--token={secret}"],
        ["--tok", secret],
        [f"--toke={secret}"],
        ["--tokne", secret],
        ["-Token", secret],
        ["--tokens", secret],
    )
    for module in ("clients.admin", "clients.chat"):
        for given in spellings:
            for where in ("first", "last"):
                args = [*given, "--host", "127.0.0.1:1"]
                if module == "clients.admin":
                    args = [*args, "status"] if where == "first" else ["status", *args]
                out = run_cli(module, *args)
                assert out.returncode == 2, (module, given, out.stderr)
                assert secret not in out.stdout + out.stderr, (module, args, out.stderr)
    two_lines = tmp_path / "token"
    two_lines.write_text("first\nsecond\n")
    out = run_cli("clients.admin", "--token-file", str(two_lines), "--host", "127.0.0.1:1", "status")
    assert out.returncode == 2 and "the token has characters a header cannot carry" in out.stderr, out.stderr
