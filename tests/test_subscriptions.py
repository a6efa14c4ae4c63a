"""Only what a middleware asked for crosses the wire: unimplemented hooks and unsubscribed items
cost no RPC and no message."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from agent_host.agent import Agent
from agent_host.models import OfflineRuleModel
from agent_host.remote import RemoteMiddleware
from agentmw.data import ChatResponse, ReplyEndEvent, TextBlockDeltaEvent, TextBlockEndEvent, UserMsg
from agentmw.subscriptions import SubscriptionTable, subscribe
from agentmw.tools import Toolkit
from agentmw.v1 import events_pb2, hooks_pb2
from clients.launch import middleware_server, start_all

from .harness import add


@pytest.fixture(scope="module")
def gate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The file GatedObserver waits for (created by the test once its client has every delta)."""
    return tmp_path_factory.mktemp("gate") / "open"


@pytest.fixture(scope="module")
def servers(gate: Path):
    procs = {
        name: middleware_server(f"tests.conformance_mw:{name}")
        for name in ("EndOnlyCounter", "ObserveCounter", "PromptTag")
    }
    procs["GatedObserver"] = middleware_server("tests.guard_mw:GatedObserver", gate=str(gate))
    start_all(list(procs.values()))
    yield {name: p.address for name, p in procs.items()}
    for p in procs.values():
        p.stop()


def count_rpcs(remote: RemoteMiddleware) -> dict[str, int]:
    """Hook invocations sent to the middleware, per hook (each takes a stream once)."""
    counts = {hook: 0 for hook in remote.stubs}
    take = remote.take_stream

    def counted(hook: str):
        counts[hook] += 1
        return take(hook)

    remote.take_stream = counted
    return counts


async def test_unsubscribed_items_bypass_the_middleware(servers: dict[str, str]) -> None:
    remote = await RemoteMiddleware(servers["EndOnlyCounter"]).connect()
    counts = count_rpcs(remote)
    agent = Agent(model=OfflineRuleModel(reply_template="word " * 200), toolkit=Toolkit([add]), middlewares=[remote])
    items = [i async for i in agent.reply_stream(UserMsg("hi"))]
    assert sum(isinstance(i, TextBlockDeltaEvent) for i in items) == 200
    # The middleware saw 2 of the reply's items; the other 200+ passed by without a message.
    assert agent.state.middle_context["EndOnlyCounter"] == ["ReplyEndEvent", "Msg"]
    # on_reply is its only hook: one stream for the whole reply, no RPC for any other hook.
    assert counts == {**{h: 0 for h in counts}, "on_reply": 1}
    await remote.close()


async def test_observed_items_are_all_seen(servers: dict[str, str]) -> None:
    remote = await RemoteMiddleware(servers["ObserveCounter"]).connect()
    agent = Agent(model=OfflineRuleModel(reply_template="word " * 300), middlewares=[remote])
    items = [i async for i in agent.reply_stream(UserMsg("hi"))]
    seen = agent.state.middle_context["ObserveCounter"]
    assert sum(seen.values()) == len(items) and seen["TextBlockDeltaEvent"] == 300
    await remote.close()


async def test_observed_items_are_not_held_by_a_slow_observer(servers: dict[str, str], gate: Path) -> None:
    """The observer does not go on from the first delta until the client has them all: that can
    only happen if the host forwards observed items without waiting for the middleware (with
    INTERCEPT it would wait, and the observer's gate would stay shut)."""
    remote = await RemoteMiddleware(servers["GatedObserver"]).connect()
    agent = Agent(model=OfflineRuleModel(reply_template="one two three four five"), middlewares=[remote])
    items = []
    async with asyncio.timeout(30):
        async for item in agent.reply_stream(UserMsg("hi")):
            items.append(item)
            if isinstance(item, TextBlockEndEvent):  # every delta is here
                gate.touch()
    assert [i.delta for i in items if isinstance(i, TextBlockDeltaEvent)] == ["one ", "two ", "three ", "four ", "five"]
    assert agent.state.middle_context["GatedObserver"] == {"gate_opened": True, "seen": 5}
    await remote.close()


async def test_system_prompt_is_called_once_per_iteration(servers: dict[str, str]) -> None:
    remote = await RemoteMiddleware(servers["PromptTag"]).connect()
    counts = count_rpcs(remote)
    model = OfflineRuleModel(script=[{"tool_calls": [{"name": "add", "input": {"a": 1, "b": 2}}]}, {"text": "3"}])
    agent = Agent(model=model, toolkit=Toolkit([add]), middlewares=[remote])
    [i async for i in agent.reply_stream(UserMsg("hi"))]
    # Two iterations; the prompt is built twice per iteration (compression check + model input).
    assert counts["on_system_prompt"] == 2
    assert sum(counts.values()) == 2
    await remote.close()


async def test_a_cacheable_system_prompt_is_asked_once_until_the_server_is_described_again() -> None:
    """PromptNote declares on_system_prompt cacheable: one call serves every step of three replies.
    Restarted with another note on the same port, it is described again and asked again."""
    first = middleware_server("tests.conformance_mw:PromptNote", note="one").start()
    second = middleware_server("tests.conformance_mw:PromptNote", note="two")
    try:
        remote = await RemoteMiddleware(first.address).connect()
        counts = count_rpcs(remote)
        agent = Agent(model=OfflineRuleModel(reply_template="{system}"), middlewares=[remote])

        async def system_prompt() -> str:
            return [i async for i in agent.reply_stream(UserMsg("hi"))][-1].text

        for _ in range(3):  # each reply builds the prompt twice (compression check, model input)
            assert (await system_prompt()).endswith(" +one")
        assert counts["on_system_prompt"] == 1
        first.stop()
        second.port = first.port
        second.start()
        assert (await system_prompt()).endswith(" +two")
        assert counts["on_system_prompt"] == 2
        await remote.close()
    finally:
        first.stop()
        second.stop()


async def test_a_cacheable_system_prompt_is_reused_only_for_the_same_slot() -> None:
    """Cacheable means: the answer depends on the input prompt and the middleware's own slot alone
    (hooks.proto, HookDescription.cacheable). Another slot value is another answer, asked for."""
    server = middleware_server("tests.conformance_mw:PromptBySlot").start()
    try:
        remote = await RemoteMiddleware(server.address).connect()
        counts = count_rpcs(remote)
        agent = Agent(model=OfflineRuleModel(reply_template="{system}"), middlewares=[remote])

        async def system_prompt(who: str) -> str:
            agent.state.middle_context["by_slot"] = {"who": who}  # as the embedding application may
            return [i async for i in agent.reply_stream(UserMsg("hi"))][-1].text

        assert (await system_prompt("ann")).endswith(" +ann")
        assert (await system_prompt("bob")).endswith(" +bob")
        assert (await system_prompt("ann")).endswith(" +ann")
        assert counts["on_system_prompt"] == 2  # ann's answer was kept
        await remote.close()
    finally:
        server.stop()


def test_only_when_skips_unless_its_slot_member_is_exactly_true() -> None:
    """The host's reading of HookDescription.only_when: anything but a JSON true keeps the hook idle;
    a name longer than a slot member's is refused at Describe."""
    table = SubscriptionTable(hooks_pb2.HookDescription(only_when="armed"))
    for slot in (None, "armed", ["armed"], {}, {"armed": False}, {"armed": 1}, {"armed": "true"}, {"other": True}):
        assert table.skips(slot), slot
    assert not table.skips({"armed": True, "n": 3})
    assert not SubscriptionTable(hooks_pb2.HookDescription()).skips(None)  # not declared: always called
    with pytest.raises(ValueError, match="only_when names a slot member of 257 characters"):
        SubscriptionTable(hooks_pb2.HookDescription(only_when="x" * 257))


def test_an_item_kind_subscribed_twice_is_refused_where_it_is_declared() -> None:
    """One mode per kind: the SDK refuses a second at declaration (before, the last list won, and
    ChatResponse with "chat_response_final" sent the final chunk's mode twice)."""
    with pytest.raises(ValueError, match="ReplyEndEvent is subscribed twice"):
        subscribe(intercept=[ReplyEndEvent], observe=[ReplyEndEvent])
    twice = "ChatResponse is subscribed twice (it is also 'chat_response_final')"
    with pytest.raises(ValueError, match=re.escape(twice)):
        subscribe(observe=[ChatResponse], intercept=["chat_response_final"])


@pytest.mark.parametrize(
    ("description", "error"),
    [
        (dict(hook=hooks_pb2.HOOK_ON_SYSTEM_PROMPT, detached=True), "on_system_prompt cannot be detached"),
        (dict(hook=hooks_pb2.HOOK_ON_SYSTEM_PROMPT, done_with_inner=True), "cannot be done_with_inner"),
        (dict(hook=hooks_pb2.HOOK_ON_REPLY, cacheable=True), "on_reply cannot be cacheable"),
        (
            dict(hook=hooks_pb2.HOOK_ON_REPLY, done_with_inner=True, default_mode=hooks_pb2.SUBSCRIPTION_MODE_OBSERVE),
            "done_with_inner cannot go with observed items",
        ),
        (
            dict(
                hook=hooks_pb2.HOOK_ON_REPLY,
                subscriptions=[
                    hooks_pb2.ItemSubscription(item_type=item, mode=mode)
                    for item, mode in (
                        (events_pb2.ITEM_TYPE_REPLY_END, hooks_pb2.SUBSCRIPTION_MODE_INTERCEPT),
                        (events_pb2.ITEM_TYPE_REPLY_END, hooks_pb2.SUBSCRIPTION_MODE_BYPASS),
                    )
                ],
            ),
            "item type ITEM_TYPE_REPLY_END is subscribed twice",
        ),
    ],
)
def test_a_declaration_that_cannot_work_at_its_hook_is_refused(description: dict, error: str) -> None:
    """The host reads every HookDescription through SubscriptionTable: what cannot work is refused
    there, and Describe fails with that message."""
    with pytest.raises(ValueError, match=error):
        SubscriptionTable(hooks_pb2.HookDescription(**description))
    assert SubscriptionTable(hooks_pb2.HookDescription(hook=hooks_pb2.HOOK_ON_SYSTEM_PROMPT, cacheable=True)).cacheable


def test_a_malformed_declaration_is_said_where_the_class_is_defined() -> None:
    """``subscriptions`` that is not hook names mapped to subscribe(...) is a TypeError where the
    class is defined (in-process as served); a method named like a misspelt hook is warned of.
    Before, a list in place of subscribe(...) was accepted in-process and crashed serve() with a
    20-line AttributeError, and ``on_replay`` was served, silently never called."""
    import warnings

    from agentmw.middleware import MiddlewareBase

    with pytest.raises(TypeError, match=r"Listed.subscriptions\['on_reply'\]: expected subscribe\(...\), got list"):

        class Listed(MiddlewareBase):
            subscriptions = {"on_reply": [ReplyEndEvent]}  # type: ignore[dict-item]

    with pytest.raises(TypeError, match=r"Misnamed.subscriptions: 'on_replay' is not a hook position \(on_reply, "):

        class Misnamed(MiddlewareBase):
            subscriptions = {"on_replay": subscribe()}

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")

        class Typo(MiddlewareBase):
            async def on_replay(self, agent, input_kwargs, next_handler):  # type: ignore[no-untyped-def]
                yield None

            def on_error(self) -> None:  # a method of its own, no hook's near-namesake: no warning
                pass

    assert [str(w.message) for w in said] == [
        f"{__name__}.test_a_malformed_declaration_is_said_where_the_class_is_defined.<locals>.Typo.on_replay "
        "is not a hook position, so it is never called: on_reply?"
    ]
