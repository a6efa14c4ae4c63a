"""serve(): Describe, health, reflection, and a graceful stop on SIGTERM, on a real process."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from agent_host.remote.client import CHANNEL_OPTIONS
from agentmw.transport import SERVER_OPTIONS
from agentmw.v1 import events_pb2, hooks_pb2, hooks_pb2_grpc
from clients.launch import ServerProcess, middleware_server


async def test_describe_health_reflection_and_sigterm() -> None:
    server = middleware_server("tests.conformance_mw:Budget", token_budget=3)
    proc = ServerProcess([*server.argv, "--reflection"], name="Budget").start()  # reflection is opt-in
    try:
        async with grpc.aio.insecure_channel(proc.address) as channel:
            desc = await hooks_pb2_grpc.DescribeStub(channel).Describe(hooks_pb2.DescribeRequest())
            assert desc.key == "Budget" and desc.protocol_version == "v1"
            hooks = {h.hook: h for h in desc.hooks}
            assert set(hooks) == {hooks_pb2.HOOK_ON_REPLY, hooks_pb2.HOOK_ON_REASONING}
            reply = hooks[hooks_pb2.HOOK_ON_REPLY]
            assert reply.default_mode == hooks_pb2.SUBSCRIPTION_MODE_BYPASS
            assert {s.item_type for s in reply.subscriptions} == {
                events_pb2.ITEM_TYPE_REPLY_START,
                events_pb2.ITEM_TYPE_MODEL_CALL_END,
            }
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "agentmw.v1.OnReply", "agentmw.v1.Describe"):
                answer = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
            stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo()
            await stream.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            listed = await stream.read()
            await stream.done_writing()
            names = {s.name for s in listed.list_services_response.service}
            assert {"agentmw.v1.OnReply", "agentmw.v1.OnReasoning", "agentmw.v1.Describe"} <= names
            assert "agentmw.v1.OnActing" not in names  # unimplemented hooks are not even served
        assert proc.stop() == 0  # SIGTERM: a graceful stop (a SIGKILL after 10 s would give -9)
    finally:
        proc.stop()


def test_the_host_pings_no_more_often_than_default_grpc_servers_allow() -> None:
    """A default gRPC server (C-core, Go, Java) counts a ping less than 5 minutes after the previous
    one, with no data between, as a strike and sends GOAWAY too_many_pings after two. Pinging every
    30 s, the host lost its quiet connections to such servers after ~90 s, and with them any
    invocation in flight (an on_reply waiting out a long tool call): agentmw/transport.py. Waiting
    that long has no place here, so this guards the numbers; our own servers accept what it sends."""
    host = dict(CHANNEL_OPTIONS)["grpc.keepalive_time_ms"]
    assert host > 5 * 60 * 1000
    ours = dict(SERVER_OPTIONS)
    assert ours["grpc.http2.min_ping_interval_without_data_ms"] <= host and ours["grpc.keepalive_permit_without_calls"]
