"""The one codec: every data class survives a trip through its proto unchanged."""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import json
from typing import Any

import pytest

from agentmw import data as d
from agentmw.codec import CodecError, codec
from agentmw.hooks import HOOKS
from agentmw.v1 import hooks_pb2
from agentmw.wire import decode_kwargs, encode_error, encode_kwargs

CALL = d.ToolCallBlock(
    id="c1",
    name="add",
    input='{"a": 1}',
    suggested_rules=[d.PermissionRule(tool_name="add", behavior=d.PermissionBehavior.ALLOW)],
)
RESULT = d.ToolResultBlock(
    id="c1",
    name="add",
    output=[d.TextBlock(text="2")],
    state=d.ToolResultState.SUCCESS,
    metadata={"n": 1, "nested": {"x": [1, 2.5, None, True]}},
)
MSG = d.Msg(
    name="assistant",
    role=d.Role.ASSISTANT,
    content=[
        d.TextBlock(text="hi"),
        d.ThinkingBlock(thinking="hmm", extras={"signature": "abc"}),
        d.DataBlock(source=d.Base64Source(data="AAAA", media_type="audio/wav"), name="a.wav"),
        d.DataBlock(source=d.URLSource(url="https://example.invalid/x.png", media_type="image/png")),
        d.HintBlock(hint="plain hint", source='{"label": "System"}'),
        d.HintBlock(hint=[d.TextBlock(text="rich hint")]),
        CALL,
        RESULT,
        d.ToolResultBlock(id="c2", name="x", output="text output", state=d.ToolResultState.ERROR),
    ],
    usage=d.Usage(input_tokens=3, output_tokens=4),
    finished_reason=d.ReplyFinishedReason.COMPLETED,
    structured_output={"answer": 42},
    error=d.ErrorInfo(type=d.ErrorType.RATE_LIMIT, message="slow down"),
)


def sample(cls: type) -> object:
    """An instance of an event class with every required field filled in."""
    values = {
        "session_id": "s",
        "reply_id": "r",
        "name": "n",
        "block_id": "b",
        "delta": "δ",
        "media_type": "audio/wav",
        "tool_call_id": "c1",
        "tool_call_name": "add",
        "hint": [d.TextBlock(text="h")],
        "tool_calls": [CALL],
        "confirm_results": [d.ConfirmResult(confirmed=True, tool_call=CALL, rules=[])],
        "execution_results": [RESULT],
        "model_name": "m",
        "value": {"k": [1, "2"]},
        "data": "QUJD",
    }
    fields = {f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values}
    return cls(**fields)


@pytest.mark.parametrize("cls", d.EVENT_CLASSES, ids=lambda c: c.__name__)
def test_every_event_round_trips_as_an_item(cls: type) -> None:
    event = sample(cls)
    assert codec.decode_item(codec.encode_item(event)) == event


@pytest.mark.parametrize(
    "obj",
    [
        MSG,
        d.ChatResponse(
            content=[d.TextBlock(text="x"), CALL], is_last=False, usage=d.ChatUsage(input_tokens=1, time=0.25)
        ),
        d.ToolChunk(content=[d.TextBlock(text="x")], metadata={"mcp_progress": {"p": 1}}),
        d.ToolResponse(content=[d.TextBlock(text="x")], state=d.ToolResultState.DENIED, id="c1"),
    ],
    ids=["msg", "chat_response", "tool_chunk", "tool_response"],
)
def test_items_round_trip(obj: object) -> None:
    assert codec.decode_item(codec.encode_item(obj)) == obj


def test_unset_optional_fields_decode_to_python_defaults() -> None:
    call = codec.decode(codec.encode(d.ToolCallBlock(id="x", name="y")))
    assert call.state == d.ToolCallState.PENDING and call.finished_at is None


def test_every_dataclass_matches_its_proto_field_for_field() -> None:
    for cls, proto in codec.proto_by_py.items():
        py = {f.name for f in dataclasses.fields(cls)} - {"type"}
        wire = set()
        for f in proto.DESCRIPTOR.fields:
            oneof = f.containing_oneof
            wire.add(oneof.name if oneof is not None and not oneof.name.startswith("_") else f.name)
        wire -= {f"{name}_json" for name in wire}  # a Struct's ordered JSON text travels with it
        assert py - {"type"} <= wire | {"type"} and wire <= py | {"type"}, cls.__name__


def test_hook_kwargs_round_trip() -> None:
    spec = HOOKS["on_model_call"]
    kwargs = {
        "current_model": d.ModelRef(id="main", provider="offline"),
        "messages": [MSG],
        "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
        "tool_choice": d.ToolChoice(mode="required", tools=["add"]),
        "parameters": {"temperature": 0.2, "max_tokens": 64},
    }
    out = decode_kwargs(spec, encode_kwargs(spec, kwargs, hooks_pb2.Kwargs()), complete=True)
    assert out == kwargs
    reply = HOOKS["on_reply"]
    resume = d.UserConfirmResultEvent(reply_id="r", confirm_results=[d.ConfirmResult(confirmed=False, tool_call=CALL)])
    for inputs in (MSG, [MSG, MSG], resume, None):
        got = decode_kwargs(reply, encode_kwargs(reply, {"inputs": inputs}, hooks_pb2.Kwargs()), complete=True)
        assert got == {"inputs": inputs, "structured_schema": None}


def test_generated_code_matches_the_plan_and_reads_objects_without_every_field() -> None:
    """The codec runs each plan as generated code (codec._generate): its bytes equal the plan's
    field-by-field loop for every data class; an object lacking some field of its class (duck
    typing) is encoded anew by the loop, missing fields unset, nothing of the first try left."""
    samples = [MSG, CALL, d.ToolResultBlock(id="c1", name="add", output=[d.TextBlock(text="3")], metadata={"k": 1})]
    samples += [d.ModelRef(id="m", parameters={"t": 0.5}), d.ChatResponse(content=[MSG.content[0]], is_last=True)]
    for obj in samples:
        proto = codec.proto_by_py[type(obj)]
        fast, slow = codec.encode(obj), proto()
        codec._encode_fields(slow, obj, getattr)
        assert fast.SerializeToString(deterministic=True) == slow.SerializeToString(deterministic=True), obj
    from types import SimpleNamespace

    partial = SimpleNamespace(text="duck", id="d1")  # no created_at, no type
    out = codec.encode(partial, codec.proto_by_py[d.TextBlock]())
    assert out.text == "duck" and out.id == "d1" and not out.created_at


@pytest.mark.parametrize("value", ["none", {"mode": "none"}, ["none"], 3])
def test_a_plain_value_where_a_data_class_goes_is_an_error_not_an_empty_message(value: Any) -> None:
    """A str or a dict has none of ToolChoice's attributes: it was encoded as an empty ToolChoice
    (mode ''), so ``next_handler(tool_choice="none")`` silently let the model call tools remotely,
    where in-process it fails (AttributeError)."""
    with pytest.raises(CodecError) as raised:
        codec.encode(d.ModelRef(id="m", parameters={}))  # (a data class itself still encodes)
        codec.encode(value, codec.proto_by_py[d.ToolChoice]())
    assert str(raised.value) == f"expected a ToolChoice, got {type(value).__name__} {value!r}"
    reasoning = HOOKS["on_reasoning"]
    with pytest.raises(CodecError, match="expected a ToolChoice, got str 'none'"):
        encode_kwargs(reasoning, {"tool_choice": "none"}, hooks_pb2.Kwargs())


def test_values_that_do_not_fit_are_clear_errors() -> None:
    with pytest.raises(CodecError, match="cannot flow through a hook"):
        codec.encode_item(object())
    with pytest.raises(CodecError, match="hint"):
        codec.encode(d.HintBlock(hint=42))  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [{}, [], {"a": {}}, {"a": []}, 0, "", False, None, [1, "x", {"k": None}]])
def test_empty_and_falsy_json_values_survive(value: object) -> None:
    from google.protobuf import struct_pb2

    from agentmw.codec import json_to_value, value_to_json

    out = struct_pb2.Value()
    json_to_value(value, out)
    assert value_to_json(struct_pb2.Value.FromString(out.SerializeToString())) == value


# -- the Struct memo: same bytes as protobuf's own Struct.update, fresh dicts, edits seen -------

_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14, "default": 3.5},
    },
    "required": ["city"],
}


def _nested(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {"leaf": "x" * 80}
    for _ in range(levels - 1):
        value = {"k": value}
    return value


@pytest.mark.parametrize(
    "value",
    [_SCHEMA, {f"k{i}": i for i in range(12)}, {"big": 2**60, "neg": -0.5, "list": [1, 2.5, None, True, "s"] * 9}],
)
def test_the_struct_memo_encodes_and_decodes_exactly_as_the_plain_path(value: dict[str, Any]) -> None:
    from google.protobuf import struct_pb2

    from agentmw.codec import dict_to_struct, struct_to_dict, value_to_json

    plain = struct_pb2.Struct()
    plain.update(value)
    for _ in range(2):  # the first call fills the memo, the second reads it
        out = struct_pb2.Struct()
        dict_to_struct(value, out)
        assert out == plain
        assert struct_to_dict(out) == {k: value_to_json(v, 1) for k, v in plain.fields.items()}


def test_the_struct_memo_sees_edits_in_place_and_hands_out_fresh_dicts() -> None:
    import copy

    from google.protobuf import struct_pb2

    from agentmw.codec import dict_to_struct, struct_to_dict

    schema = copy.deepcopy(_SCHEMA)
    first = struct_pb2.Struct()
    dict_to_struct(schema, first)
    schema["properties"]["city"]["description"] = "edited in place"  # the same dict object
    second = struct_pb2.Struct()
    dict_to_struct(schema, second)
    assert struct_to_dict(second)["properties"]["city"]["description"] == "edited in place"

    decoded = struct_to_dict(first)
    decoded["properties"]["city"]["description"] = "a caller's own edit"
    assert struct_to_dict(first)["properties"]["city"]["description"] == "City name"


def test_the_struct_memo_keeps_the_depth_limit_and_the_not_json_error() -> None:
    from google.protobuf import struct_pb2

    from agentmw.codec import MAX_JSON_DEPTH, CodecError, dict_to_struct, struct_to_dict

    deep = struct_pb2.Struct()
    deep.update(_nested(MAX_JSON_DEPTH + 2))
    for _ in range(2):
        with pytest.raises(CodecError, match="nested deeper"):
            struct_to_dict(deep)
    with pytest.raises(CodecError, match="not JSON: object"):
        dict_to_struct({"schema": _SCHEMA, "odd": object()}, struct_pb2.Struct())


# -- the id and timestamp factories every data class uses ---------------------------------------


def test_ids_are_32_hex_digits_and_unique_across_refills_and_threads() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from agentmw.data._common import _ID_BATCH

    n = 4 * _ID_BATCH + 7  # several refills of the batch, per thread
    with ThreadPoolExecutor(8) as pool:
        batches = list(pool.map(lambda _: [d.new_id() for _ in range(n)], range(8)))
    ids = [i for batch in batches for i in batch]
    assert len(set(ids)) == len(ids)  # a batch handed to two threads would repeat ids
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    assert len({i[:8] for i in ids}) > len(ids) // 2  # random, not a counter


def test_timestamps_are_what_datetime_now_astimezone_isoformat_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    """Local time with its UTC offset: a reader in another time zone (a tracing server) reads the
    same instant; without the offset it read the host's local time as its own (9 h off in Tokyo)."""
    import time
    from datetime import datetime

    from agentmw.data import _common

    # exact seconds, rounding to 1 µs, rounding up into the next second, the clock going back
    for t in (1_764_547_200.0, 1_764_547_200.25, 1_764_547_200.000001, 1_764_547_201.9999997, 1_764_547_199.5):
        monkeypatch.setattr(time, "time", lambda t=t: t)
        assert _common.now() == datetime.fromtimestamp(t).astimezone().isoformat(), t
    monkeypatch.undo()
    before = datetime.now().astimezone()
    stamp = datetime.fromisoformat(d.TextBlock(text="x").created_at)
    assert stamp.utcoffset() is not None
    assert before <= stamp <= datetime.now().astimezone()


# -- exceptions across the wire: rebuilt by name (agentmw.wire.rebuilt_error) -------------------------


def test_an_exceptions_class_level_values_cross_and_a_bad_error_type_is_internal() -> None:
    """A class-level ``status = 429`` (or ``retry_after``, which the host's retry waits) was
    missing remotely: only the instance's own attributes crossed. An ``error_type`` that is no
    ErrorType is ``internal`` in-process as remotely (in-process a failed reply's error had the
    bogus type, which its client's encoding then refused)."""
    from agent_host.agent import Agent
    from agent_host.models import OfflineRuleModel
    from agent_host.remote.errors import remote_error
    from agentmw.middleware import MiddlewareBase

    class Throttled(Exception):
        status, code, retry_after, error_type = 429, "slow_down", 2.5, "bogus"

        @property
        def detail(self) -> str:  # a property is not a value: not called, not sent
            raise AssertionError("read")

    exc = Throttled("later")
    exc.code = "mine"  # the instance's own wins
    encoded = encode_error(exc, hooks_pb2.Fail())
    rebuilt = remote_error(
        "mw", "on_reply", encoded.type, encoded.message, attributes=json.loads(encoded.attributes_json)
    )
    assert (rebuilt.status, rebuilt.code, rebuilt.retry_after) == (429, "mine", 2.5)
    assert encoded.error_type == 0  # unset: as if it had none

    class Raises(MiddlewareBase):
        async def on_reply(self, agent, input_kwargs, next_handler):
            raise exc
            yield

    async def reply() -> list[Any]:
        return [e async for e in Agent(model=OfflineRuleModel(), middlewares=[Raises()]).reply_stream(d.UserMsg("hi"))]

    end = next(e for e in asyncio.run(reply()) if isinstance(e, d.ReplyEndEvent))
    assert end.error is not None and end.error.type is d.ErrorType.INTERNAL
    codec.encode_item(end)  # a client can be sent it


def test_a_class_of_its_own_with_a_builtins_name_is_not_rebuilt_as_the_builtin() -> None:
    """A library's ``class ConnectionError(Exception)`` (requests has one) was rebuilt as the
    builtin ConnectionError, an OSError: ``except OSError`` caught it remotely, not in-process.
    Its bases, sent with it, say which it is; without bases (another language) the name decides."""
    from agent_host.remote.errors import remote_error

    class ConnectionError(Exception):  # a library's own, as requests has
        pass

    encoded = encode_error(ConnectionError("refused"), hooks_pb2.Fail())
    own = remote_error("mw", "on_reply", encoded.type, encoded.message, bases=list(encoded.bases))
    assert type(own).__name__ == "ConnectionError" and not isinstance(own, OSError) and str(own) == "refused"
    encoded = encode_error(builtins.ConnectionError("refused"), hooks_pb2.Fail())
    real = remote_error("mw", "on_reply", encoded.type, encoded.message, bases=list(encoded.bases))
    assert isinstance(real, builtins.ConnectionError) and isinstance(real, OSError)
    assert isinstance(remote_error("mw", "on_reply", "ConnectionError", "refused"), builtins.ConnectionError)


@pytest.mark.parametrize(
    ("type_name", "message", "is_a", "args"),
    [
        ("ValueError", "no budget left", ValueError, ("no budget left",)),
        ("KeyError", "'user_42'", KeyError, ("user_42",)),
        ("KeyError", "('a', 1)", KeyError, (("a", 1),)),
        ("UnknownModelError", "unknown model id 'x' (registered: a, b)", KeyError, None),  # its __str__ reads 2 args
        ("TimeoutError", "slow", TimeoutError, ("slow",)),
        ("UnicodeDecodeError", "'utf-8' codec can't decode byte 0xff", Exception, None),  # needs 5 args
        ("ExceptionGroup", "two failed (2 sub-exceptions)", Exception, None),  # needs 2
        ("MemoryError", "cache full", Exception, None),  # a __new__ of its own
        ("My Error", "odd name", Exception, ("odd name",)),
    ],
)
def test_an_exception_is_rebuilt_by_name_with_its_text(type_name: str, message: str, is_a: type, args: Any) -> None:
    """Host and SDK rebuild a middleware's (or the inner pipeline's) exception as its class when
    they can, its text always as the raising side's str() gave it. Before, UnknownModelError's
    __str__ raised IndexError on the rebuilt one (the host answered INTERNAL), and classes that need
    more than a message turned into an unrelated TypeError."""
    from agent_host.remote.errors import RemoteMiddlewareError, remote_error
    from agentmw.sdk.session import InnerPipelineError, inner_error

    host, sdk = remote_error("mw", "on_reply", type_name, message), inner_error(type_name, message)
    for exc, base in ((host, RemoteMiddlewareError), (sdk, InnerPipelineError)):
        assert isinstance(exc, base) and isinstance(exc, is_a) and type(exc).__name__ == type_name
        assert str(exc) == message
        if args is not None:
            assert exc.args == args
