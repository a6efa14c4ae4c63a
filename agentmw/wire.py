"""Hook kwargs and results on the wire, shared by the host's remote client and the SDK."""

from __future__ import annotations

import ast
import builtins
import contextlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

from agentmw.v1 import hooks_pb2

from .codec import CodecError, codec
from .data import (
    ChatResponse,
    ErrorType,
    ModelRef,
    Msg,
    PermissionDecision,
    ToolChunk,
    ToolResponse,
    ToolResultState,
)
from .errors import ConfigError, ModelError, ReplyGrammarError, UnknownModelError, exception_error_type
from .hooks import HookSpec
from .tools import Tool, ToolInputError

_ERROR_TYPES = codec.enums["agentmw.v1.ErrorType"]  # ErrorType <-> its proto enum number

# Credits for observed items per pull, and what an eager_next start grants (hooks.proto).
DEFAULT_CREDITS = 32

# What a middleware may emit at each hook position: what the agent takes from that position
# (a reply and a reasoning step yield events and their final Msg, acting a tool's chunks and
# response, a model call chat responses). Anything else is a protocol violation.
_EVENTS = frozenset(cls for cls in codec.item_field_by_py if cls not in (Msg, ToolChunk, ToolResponse, ChatResponse))
EMITTABLE: dict[str, frozenset[type]] = {
    "on_reply": _EVENTS | {Msg},
    "on_reasoning": _EVENTS | {Msg},
    "on_acting": frozenset({ToolChunk, ToolResponse}),
    "on_model_call": frozenset({ChatResponse}),
}


def tool_item_problem(item: Any) -> str | None:
    """Why a tool chunk or response from another process cannot be used as it is (None: it can).
    The host makes a CustomEvent of ``metadata.mcp_progress`` with the call's ids added, so it must
    be an object; a response is the call's final result, so its state is a final one."""
    if isinstance(item, ToolChunk):
        progress = item.metadata.get("mcp_progress")
        if progress is not None and not isinstance(progress, dict):
            return f"a tool chunk whose metadata.mcp_progress is a {type(progress).__name__}, not an object"
    elif isinstance(item, ToolResponse) and item.state is ToolResultState.RUNNING:
        return "a tool_response in state RUNNING (it is the final result: SUCCESS, ERROR, INTERRUPTED or DENIED)"
    return None


def to_wire(value: Any) -> Any:
    """Live objects become references: a model its ModelRef, a tool its descriptor. A model is
    recognised by its ``ref`` (the host's ChatModel, which the core does not import)."""
    if isinstance(value, Tool):  # first: a Tool answers an unknown attribute by raising in its __getattr__
        return value.descriptor
    ref = getattr(value, "ref", None)  # once: a model's ref is a fresh snapshot each time
    if isinstance(ref, ModelRef):
        return ref
    return value


def encode_kwargs(spec: HookSpec, kwargs: dict[str, Any], out: hooks_pb2.Kwargs) -> hooks_pb2.Kwargs:
    record = getattr(out, spec.name)
    record.SetInParent()
    codec.encode_record({k: to_wire(v) for k, v in kwargs.items()}, record)
    return out


def decode_kwargs(spec: HookSpec, msg: hooks_pb2.Kwargs, *, complete: bool) -> dict[str, Any]:
    """``complete``: every parameter present (None when unset), as in Begin; else only those set."""
    which = msg.WhichOneof("hook")
    if which is None and not complete:
        return {}
    if which != spec.name:
        raise CodecError(f"kwargs are for {which}, expected {spec.name}")
    values = codec.decode_record(getattr(msg, which))
    if complete:
        return {p: values.get(p) for p in spec.params}
    return values


def decode_kwarg(spec: HookSpec, msg: hooks_pb2.Kwargs, name: str) -> Any:
    """One of a Begin's kwargs (None when unset), decoded alone."""
    which = msg.WhichOneof("hook")
    if which != spec.name:
        raise CodecError(f"kwargs are for {which}, expected {spec.name}")
    return codec.decode_record_field(getattr(msg, which), name)


def encode_result(value: Any, out: hooks_pb2.HookResult) -> hooks_pb2.HookResult:
    if isinstance(value, PermissionDecision):
        codec.encode(value, out.permission_decision)
    elif isinstance(value, ChatResponse):  # on_model_call returned one response, not a stream
        codec.encode(value, out.chat_response)
    elif isinstance(value, str):
        out.prompt = value
    elif value is not None:
        raise CodecError(f"a hook cannot return {type(value).__name__} over the wire")
    return out


def decode_result(msg: hooks_pb2.HookResult) -> Any:
    which = msg.WhichOneof("value")
    if which == "permission_decision":
        return codec.decode(msg.permission_decision)
    if which == "prompt":
        return msg.prompt
    if which == "chat_response":
        return codec.decode(msg.chat_response)
    return None


_Encoded = TypeVar("_Encoded", hooks_pb2.Fail, hooks_pb2.InnerError)


def encode_error(exc: BaseException, out: _Encoded) -> _Encoded:
    """An exception as Fail or InnerError: its class name, message, base class names, and the
    attributes whoever catches it may act on: ``retryable`` and ``error_type`` (each only when the
    exception has it) and its other public JSON attributes (a ModelError's ``retry_after``)."""
    # A rebuilt exception (rebuilt_error) goes on as it came: its class, bases and attributes
    # here are the receiving side's (which middleware raised it), not the raising side's.
    own = getattr(exc, "__dict__", {})
    out.type, out.message = own.get("_sent_type") or type(exc).__name__, str(exc)
    retryable = getattr(exc, "retryable", None)
    if retryable is not None:
        out.retryable = bool(retryable)
    error_type = exception_error_type(exc)
    if error_type is not None:
        out.error_type = _ERROR_TYPES.to_number[error_type]
    bases = own.get("_sent_bases")
    if bases is None:
        bases = [cls.__name__ for cls in type(exc).__mro__[1:] if cls not in (BaseException, object)]
    out.bases.extend(bases)
    sent = own.get("_sent_attributes")
    attributes = {}
    values = list(own.items())
    if sent is None:  # then its class's plain values (a class-level ``status = 429``), not descriptors
        values += [
            (name, value)
            for cls in type(exc).__mro__
            if cls.__module__ != "builtins"
            for name, value in vars(cls).items()
            if name not in own and not hasattr(value, "__get__")
        ]
    for name, value in values:
        if name not in attributes and (name in sent if sent is not None else _public(name)):
            with contextlib.suppress(ValueError, TypeError, RecursionError):  # not JSON (a partial response)
                json.dumps(value, allow_nan=False)
                attributes[name] = value
    if attributes:
        out.attributes_json = json.dumps(attributes, allow_nan=False)
    return out


def _public(name: str) -> bool:
    """An attribute ``attributes`` carries: not private, not one with a field of its own."""
    return name.isidentifier() and not name.startswith("_") and name not in ("retryable", "error_type")


# The classes an exception that crossed the wire is rebuilt as, by name: builtins and agentmw's own.
KNOWN_ERRORS: dict[str, type[BaseException]] = {
    name: obj
    for name, obj in vars(builtins).items()
    if isinstance(obj, type) and issubclass(obj, Exception) and not name.startswith("_")
}
KNOWN_ERRORS.update(
    {
        cls.__name__: cls
        for cls in (ModelError, UnknownModelError, CodecError, ConfigError, ToolInputError, ReplyGrammarError)
    }
)
# (base, name, known class) -> class. Bounded: the names come from the other process, any text.
_rebuilt: dict[tuple[type, str, type | None], type[Any]] = {}
_MAX_REBUILT = 1024
MAX_TYPE_NAME = 256  # characters of an exception class name (or base's) read from the other side
MAX_BASES = 16  # base class names of an exception read from the other side
MAX_ATTRIBUTES = 8192  # bytes of an exception's attributes read from the other side
_E = TypeVar("_E", bound=BaseException)


def rebuilt_error(
    base: type[_E],
    type_name: str,
    message: str,
    init: Callable[[_E], None],
    *,
    bases: Sequence[str] = (),
    attributes: Mapping[str, Any] | None = None,
) -> _E:
    """The exception an encoded one (``encode_error``) is on this side: of a class named
    ``type_name``, a subclass of ``base`` and of the first class of ``type_name`` and its
    ``bases`` that is known here (a builtin, one of agentmw's) and takes a message alone, so that
    ``except ValueError`` or ``except ModelError`` catch it as in-process. ``init`` runs
    ``base``'s ``__init__`` on it; then ``attributes`` are set, but for those ``base`` sets. Its
    text is the message as the raising side's ``str()`` gave it, whatever the class's ``__str__``
    would make of its args; its ``args`` are that message (a KeyError's: its key, read back from
    the repr ``str(KeyError)`` is)."""
    known, sample = None, None
    for i, name in enumerate((type_name, *bases)):
        known = KNOWN_ERRORS.get(name)
        if known is not None and bases and not _lineage(known) <= set(bases[i:]):
            known = None  # a class of its own with a known one's name (a library's ConnectionError)
        if known is not None:
            try:  # a class that needs more than a message (UnicodeDecodeError, ExceptionGroup): next
                sample = known(message)
                break
            except Exception:
                known = None
    exc: _E | None = None
    if known is not None:
        try:
            exc = _instance(base, type_name, known)
        except TypeError:  # a layout or constructor it cannot share with ``base`` (MemoryError)
            exc = None
    if exc is None:
        sample, exc = None, _instance(base, type_name, None)
    if sample is not None:
        exc.__dict__.update(vars(sample))  # the class's own attributes (ModelError.error_type, ...)
    init(exc)
    # Then the raising side's, but for those ``base`` sets (which middleware raised it).
    attributes = attributes or {}
    own = exc.__dict__.keys() - (vars(sample).keys() if sample is not None else ())
    exc.__dict__.update((name, value) for name, value in attributes.items() if name not in own)
    arg: Any = message
    if isinstance(exc, KeyError):
        with contextlib.suppress(ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
            key = ast.literal_eval(message)
            if repr(key) == message:
                arg = key
    exc.args = (arg,)
    exc.__dict__.update(
        _sent_text=message, _sent_type=type_name, _sent_bases=list(bases), _sent_attributes=tuple(attributes)
    )
    return exc


def _lineage(cls: type[BaseException]) -> set[str]:
    """The names of a known class's bases, as ``encode_error`` sends an exception's."""
    return {c.__name__ for c in cls.__mro__[1:] if c not in (BaseException, object)}


def _instance(base: type[_E], type_name: str, known: type[BaseException] | None) -> _E:
    """An uninitialised instance of the class named ``type_name`` over ``base`` (and ``known``)."""
    cls = _rebuilt.get((base, type_name, known))
    if cls is None:
        name = type_name.replace("\0", "?") or "Exception"  # any other text may name a class
        body = {"__module__": base.__module__, "__str__": _as_sent}
        cls = type(name, (base, known) if known else (base,), body)
        if len(_rebuilt) < _MAX_REBUILT:
            _rebuilt[(base, type_name, known)] = cls
    return cast(_E, cast(Any, cls).__new__(cls))


def _as_sent(exc: BaseException) -> str:
    """A rebuilt exception's text: what the raising side's ``str()`` gave."""
    text = exc.__dict__.get("_sent_text")
    return text if isinstance(text, str) else Exception.__str__(exc)


def decode_error_attributes(error: hooks_pb2.Fail | hooks_pb2.InnerError) -> dict[str, Any]:
    """What ``error`` carried of its exception beyond its type and message (see ``encode_error``):
    ``retryable`` and ``error_type`` when it had them, its ``bases`` and other ``attributes``."""
    attributes: dict[str, Any] = {}
    if error.HasField("retryable"):
        attributes["retryable"] = error.retryable
    error_type = error_type_of(error)
    if error_type is not None:
        attributes["error_type"] = error_type
    attributes["bases"] = [name for name in error.bases[:MAX_BASES] if len(name) <= MAX_TYPE_NAME]
    others: Any = {}
    if error.attributes_json and len(error.attributes_json) <= MAX_ATTRIBUTES:
        with contextlib.suppress(ValueError, RecursionError):  # not JSON: as if none
            others = json.loads(error.attributes_json)
    if isinstance(others, dict):
        attributes["attributes"] = {name: value for name, value in others.items() if _public(name)}
    if isinstance(error, hooks_pb2.InnerError):  # what failed, and when (hooks.proto InnerError)
        extra = attributes.setdefault("attributes", {})
        if error.HasField("partial"):
            with contextlib.suppress(CodecError):  # unreadable: as if none
                extra["partial"] = codec.decode(error.partial)
        if error.created_at:
            extra["created_at"] = error.created_at
    return attributes


def error_type_of(msg: hooks_pb2.Fail | hooks_pb2.InnerError) -> ErrorType | None:
    """The ErrorType an encoded exception carried, None when it had none."""
    # A number this version does not know: as if none (it only refines how the error is reported).
    return cast(ErrorType | None, _ERROR_TYPES.to_py.get(msg.error_type))


def model_override(value: Any) -> ModelRef:
    """What a middleware may pass as ``current_model``: a registered id, a ModelRef, a model."""
    if isinstance(value, str):
        return ModelRef(id=value)
    return to_wire(value)
