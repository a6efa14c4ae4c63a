"""The seven hook positions: one table that the chain, the remote client and the SDK all read."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from agentmw.data import PermissionDecision
from agentmw.v1 import hooks_pb2

# What Describe exchanges (hooks.proto): the host refuses a middleware that speaks another version.
PROTOCOL_VERSION = "v1"
MAX_KEY = 256  # characters of a middleware key: a slot's name, not a document


def check_middleware_key(key: object) -> str:
    """``key`` if a host takes it as a middleware's Describe key (the slot it names is kept in
    every session the middleware touches), else a ValueError: the host's check at attach, and the
    SDK's at start (so a bad key is refused once, not at every attach)."""
    if not isinstance(key, str):
        raise ValueError(f"a middleware key must be a string, got {type(key).__name__} {key!r}")
    if not key:
        raise ValueError("empty middleware key")
    if len(key) > MAX_KEY:
        raise ValueError(f"a middleware key of {len(key)} characters (at most {MAX_KEY})")
    return key


class Kind(Enum):
    STREAM = "stream"  # async generator of items (on_reply, on_reasoning, on_acting)
    CALL = "call"  # coroutine returning a value (on_check_permission, on_compress_context)
    MODEL = "model"  # coroutine returning a ChatResponse or a stream of them (on_model_call)
    TRANSFORM = "transform"  # pipeline over a value (on_system_prompt)


@dataclass(frozen=True, slots=True)
class HookSpec:
    name: str
    kind: Kind
    params: frozenset[str]
    service: str  # the gRPC service of this hook position
    number: int  # agentmw.v1.Hook
    has_items: bool  # STREAM and MODEL hooks carry items (a field, not a property: read per item)


def _spec(name: str, kind: Kind, *params: str) -> HookSpec:
    service = "".join(part.title() for part in name.split("_"))
    number = hooks_pb2.Hook.Value("HOOK_" + name.upper())
    return HookSpec(name, kind, frozenset(params), service, number, kind in (Kind.STREAM, Kind.MODEL))


HOOKS: dict[str, HookSpec] = {
    s.name: s
    for s in (
        _spec("on_reply", Kind.STREAM, "inputs", "structured_schema"),
        _spec("on_reasoning", Kind.STREAM, "tool_choice"),
        _spec("on_acting", Kind.STREAM, "tool_call"),
        _spec("on_check_permission", Kind.CALL, "tool_call", "tool", "tool_input"),
        _spec("on_model_call", Kind.MODEL, "current_model", "messages", "tools", "tool_choice", "parameters"),
        _spec("on_compress_context", Kind.CALL, "context_config", "instructions"),
        _spec("on_system_prompt", Kind.TRANSFORM, "prompt"),
    )
}
HOOKS_BY_NUMBER: dict[int, HookSpec] = {s.number: s for s in HOOKS.values()}


def check_next_kwargs(spec: HookSpec, overrides: Mapping[str, Any], input_kwargs: Iterable[str]) -> None:
    """A next_handler call passes on only what the hook takes: its overrides, and the keys of its
    ``input_kwargs`` as the layer left them (a key added in place would reach the inner layers, or
    fail the agent's own function with Python's TypeError, as in AgentScope). The chain checks
    each in-process layer's calls with it and the SDK its author's, alike."""
    params = spec.params  # issuperset first: no set made on the usual call, which passes
    if not params.issuperset(overrides):
        raise TypeError(f"{spec.name}: next_handler() got unexpected kwargs {sorted(overrides.keys() - params)}")
    if not params.issuperset(input_kwargs):
        added = sorted(set(input_kwargs) - params)
        raise TypeError(f"{spec.name}: input_kwargs has keys the hook does not take: {added}")


def check_result(spec: HookSpec, value: Any) -> Any:
    """What a layer of a value hook returned, as the layer around it gets it. The chain checks each
    in-process layer with it and the SDK its author's return before answering, so a wrong value
    fails alike in both places: a TypeError raised by that layer. (A remote layer that sends a
    wrong result without the SDK breaks the protocol instead: the host refuses it.)"""
    if spec.kind is Kind.TRANSFORM:
        if not isinstance(value, str):
            raise TypeError(f"on_system_prompt must return the prompt (a str), not {type(value).__name__}")
    elif spec.name == "on_check_permission":
        if not isinstance(value, PermissionDecision):
            raise TypeError(f"on_check_permission must return a PermissionDecision, not {type(value).__name__}")
    elif spec.name == "on_compress_context":
        return None  # AgentScope ignores what it returns (its work is done on the agent's state)
    return value
