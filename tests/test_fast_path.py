"""The per-item fast path and the event loop choice, on real processes.

* An intercepted item the middleware yields back unchanged is forwarded (forward_seq): the host
  hands on the very object its inner pipeline produced. One edited in place, in a scalar field or
  a nested one, arrives edited (the SDK checks unchanged items without re-encoding them).
* A hook that never uses its ``input_kwargs`` pays no decoding and its next_handler() no
  comparison; every way of using them decodes and marks them first (KwargsDict), so an edit made
  through any of them is still found (the conformance suite runs one through ``{**input_kwargs}``).
* ``--loop uvloop`` runs the host and a middleware server on uvloop (each says so in its
  listening line) and a reply goes through both; an unknown loop is a configuration error.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from agent_host.agent import Agent
from agent_host.models.offline import OfflineRuleModel
from agent_host.remote import RemoteMiddleware
from agentmw.chain import Chain
from agentmw.data import (
    AssistantMsg,
    Msg,
    ReplyEndEvent,
    ReplyStartEvent,
    TextBlockDeltaEvent,
    TextBlockEndEvent,
    TextBlockStartEvent,
)
from clients.launch import middleware_server
from tests.host_util import chat, processes, run_cli


def _events(sid: str) -> list[Any]:
    rid = "r1"
    deltas = [TextBlockDeltaEvent(reply_id=rid, block_id="b", delta=d) for d in ("keep ", "edit me ", "keep too")]
    return [
        ReplyStartEvent(session_id=sid, reply_id=rid, name="assistant"),
        TextBlockStartEvent(reply_id=rid, block_id="b"),
        *deltas,
        TextBlockEndEvent(reply_id=rid, block_id="b"),
        ReplyEndEvent(session_id=sid, reply_id=rid),
        AssistantMsg("keep too"),
    ]


async def test_unchanged_items_are_forwarded_and_in_place_edits_are_sent() -> None:
    server = middleware_server("tests.fastpath_mw:EditSomeInPlace").start()
    rm = await RemoteMiddleware(server.address).connect()
    try:
        agent = Agent(model=OfflineRuleModel(script=[]))
        events = _events(agent.state.session_id)

        async def core(inputs: Any = None, structured_schema: Any = None) -> AsyncIterator[Any]:
            for event in events:
                yield event

        out = [item async for item in Chain("on_reply", [rm], core)(agent, inputs=None, structured_schema=None)]
        assert len(out) == len(events)
        for sent, got in zip(events, out, strict=True):
            edited = isinstance(sent, Msg) or (isinstance(sent, TextBlockDeltaEvent) and sent.delta.startswith("edit"))
            # Forwarded unchanged: the host's own object, not a decoded copy; edited: a new one.
            assert (got is sent) is not edited, (sent, got)
        assert [e.delta for e in out if isinstance(e, TextBlockDeltaEvent)] == ["keep ", "EDIT ME ", "keep too"]
        final = out[-1]
        assert isinstance(final, Msg) and [b.text for b in final.content] == ["keep too", "added in place"]
    finally:
        await rm.close()
        server.stop()


def test_host_and_middleware_server_run_on_uvloop(tmp_path: Path) -> None:
    with processes(tmp_path) as procs:
        argv = ["-m", "agentmw.sdk", "tests.host_util:RecorderMiddleware", "--address", "127.0.0.1:0"]
        rec = procs.start("recorder", [*argv, "--loop", "uvloop"])
        host = procs.host(tmp_path / "s.db", "--loop", "uvloop", "--middleware", f"rec={rec.address}")
        assert "(event loop: uvloop)" in rec.tail(20) and "(event loop: uvloop)" in host.tail(20)
        said = chat(host.address, "--message", "hello")
        assert said.returncode == 0, said.stdout + said.stderr
    bad = run_cli("agent_host", "--loop", "tokio", "--db", str(tmp_path / "t.db"))
    assert bad.returncode == 2 and "loop" in bad.stderr and "'tokio' is not one of asyncio, uvloop, auto" in bad.stderr


def test_every_way_of_using_input_kwargs_decodes_and_marks_them() -> None:
    import copy
    import json
    import pickle

    from agentmw.sdk.view import NOT_DECODED, KwargsDict

    def fresh() -> KwargsDict:
        return KwargsDict.lazy(["k"], lambda key: {"nested": 1})

    def match(d: dict) -> object:
        match d:
            case {"k": value}:
                return value
        return None

    uses = {
        "d[k]": lambda d: d["k"],
        "get": lambda d: d.get("k"),
        "{**d}": lambda d: {**d},
        "dict(d)": dict,
        "f(**d)": lambda d: (lambda **kw: kw)(**d),
        "format(**d)": lambda d: "{k}".format(**d),
        "list(d)": list,
        "items": lambda d: list(d.items()),
        "values": lambda d: list(d.values()),
        "json.dumps": json.dumps,
        "repr": repr,
        "d == x": lambda d: d == {"k": {"nested": 1}},
        "copy.copy": copy.copy,
        "copy.deepcopy": copy.deepcopy,
        "pickle": lambda d: pickle.loads(pickle.dumps(d)),
        "d | {}": lambda d: d | {},
        "{} | d": lambda d: {} | d,
        "match": match,
        "pop": lambda d: d.pop("k"),
        "d[k] = v": lambda d: d.__setitem__("k", 2),
        "update": lambda d: d.update(k=2),
    }
    for name, use in uses.items():
        d = fresh()
        assert not d.touched
        result = use(d)
        assert d.touched, name
        assert NOT_DECODED not in dict.values(d), name  # decoded before the first use
        assert "not decoded" not in repr(result), name
    d = fresh()
    assert "k" in d and len(d) == 1 and not d.touched  # no value handed out, nothing decoded
    assert d.get("absent") is None and not d.touched  # nor by asking for a key that is not there
    decoded: list[str] = []
    d = KwargsDict.lazy(["a", "b"], lambda key: decoded.append(key) or key.upper())
    assert d["a"] == "A" and d.get("a") == "A" and decoded == ["a"] and d.used == {"a"}  # one key at a time
    assert dict.__getitem__(d, "b") is NOT_DECODED
    assert list(d.values()) == ["A", "B"] and decoded == ["a", "b"] and d.used is None  # bulk: all of them


def test_a_used_kwarg_is_cleared_by_its_snapshot_only_when_unedited() -> None:
    """KwargsDict.edited: an immutable value or a flat dataclass whose fields are as decoded is
    cleared without encoding; any in-place edit (a scalar, an enum, an empty list appended to),
    a new value under the key, or a value with no cheap snapshot must be compared."""
    from agentmw.data import PermissionBehavior, PermissionRule, ToolCallBlock, ToolCallState
    from agentmw.sdk.view import KwargsDict

    def decoded(key: str) -> object:
        if key == "call":
            return ToolCallBlock(id="c1", name="add", input='{"a": 1}')
        return {"text": "x", "nested": {"deep": 1}} if key == "nested" else "plain"

    rule = PermissionRule(tool_name="add", behavior=PermissionBehavior.ALLOW)
    edits = {
        "nothing": lambda d: None,
        "scalar": lambda d: setattr(d["call"], "input", "{}"),
        "enum": lambda d: setattr(d["call"], "state", ToolCallState.FINISHED),
        "list": lambda d: d["call"].suggested_rules.append(rule),
        "replaced": lambda d: dict.__setitem__(d, "call", ToolCallBlock(id="c1", name="add", input='{"a": 1}')),
    }
    for name, edit in edits.items():
        d = KwargsDict.lazy(["call", "text", "nested"], decoded)
        assert d["call"].name == "add" and d["text"] == "plain" and d["nested"]["text"] == "x"
        edit(d)
        assert d.edited("call") == (name != "nothing"), name
        assert not d.edited("text")  # a str cannot be edited in place
        assert d.edited("nested")  # a dict with values: no snapshot, compared encoded
