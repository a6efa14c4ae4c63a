"""The one codec between the data model (agentmw.data) and the protos (agentmw.v1).

Table-driven: a proto message and a Python class correspond when they share a name, and their
fields correspond by name. Each message type is compiled once into a plan of per-field
converters chosen from the proto descriptor, and the plan into straight-line code (``_generate``:
the codec runs for every streamed item and every Begin, and a loop over the plan cost a fifth
more):

* a message with a single ``oneof`` and nothing else (ContentBlock, Item) is a *union*: the
  member is chosen by the Python value's class;
* a message with a single repeated field (BlockList, MsgList, ...) is a *list wrapper*;
* a ``oneof`` named like a Python attribute (HintBlock.hint, DataBlock.source, ...) holds a
  union-typed value; the member is chosen by the value's type;
* Struct / Value are JSON; enums map ``TOOL_CALL_STATE_PENDING`` <-> ``ToolCallState.PENDING``;
* an unset field (presence, or enum 0) decodes to the Python default.

Records that are dicts in Python (the hooks' input kwargs) use the same plans.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import keyword
import re
from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING, Any

from google.protobuf import struct_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from agentmw.v1 import events_pb2, hooks_pb2, types_pb2

if TYPE_CHECKING:  # a message's DESCRIPTOR is the C (upb) one at run time
    from google._upb._message import Descriptor as UpbDescriptor

from . import data as d
from .errors import clipped

_PROTO_MODULES = (types_pb2, events_pb2, hooks_pb2)
_ENUMS: tuple[type[Enum], ...] = (
    d.Role,
    d.ToolCallState,
    d.ToolResultState,
    d.ReplyFinishedReason,
    d.FinishedReason,
    d.ErrorType,
    d.PermissionBehavior,
)
_DATACLASSES: tuple[type, ...] = (
    d.TextBlock,
    d.ThinkingBlock,
    d.Base64Source,
    d.URLSource,
    d.DataBlock,
    d.HintBlock,
    d.PermissionRule,
    d.ToolCallBlock,
    d.ToolResultBlock,
    d.Usage,
    d.ErrorInfo,
    d.Msg,
    d.ChatUsage,
    d.ChatResponse,
    d.ToolChoice,
    d.ToolDescriptor,
    d.ToolChunk,
    d.ToolResponse,
    d.PermissionDecision,
    d.ModelRef,
    d.ContextConfig,
    d.ConfirmResult,
    *d.EVENT_CLASSES,
    d.ReplyContext,
    d.AgentState,
)

_STRUCT = struct_pb2.Struct.DESCRIPTOR.full_name
_VALUE = struct_pb2.Value.DESCRIPTOR.full_name


class CodecError(ValueError):
    """A value does not fit the wire contract (or a received message does not fit the model)."""


# ---------------------------------------------------------------------------------------------
# JSON <-> Struct / Value (ints stay ints when integral: JSON does not tell them apart).


def json_to_value(value: Any, out: struct_pb2.Value) -> None:
    if value is None:
        out.null_value = struct_pb2.NULL_VALUE
    elif isinstance(value, bool):
        out.bool_value = value
    elif isinstance(value, (int, float)):
        out.number_value = value
    elif isinstance(value, str):
        out.string_value = value
    elif isinstance(value, dict):
        out.struct_value.SetInParent()  # so that {} is a value, not an unset field
        out.struct_value.update(value)
    elif isinstance(value, (list, tuple)):
        out.list_value.SetInParent()
        out.list_value.extend(value)
    elif isinstance(value, Enum):
        out.string_value = value.value
    else:
        raise CodecError(f"not JSON: {type(value).__name__}")


# Levels of objects and lists a JSON value may nest. Protobuf parsers refuse a message nested past
# 100 levels and a JSON object level takes three (Struct, its map entry, Value): a value that
# another process sends must leave room for the messages it is sent on in (a slot in a Begin's
# context, a message's metadata in a reply event), or whoever gets it next cannot parse it.
MAX_JSON_DEPTH = 24


def value_to_json(value: struct_pb2.Value, depth: int = 0) -> Any:
    """``depth``: the containers around ``value`` (CodecError past MAX_JSON_DEPTH)."""
    kind = value.WhichOneof("kind")
    if kind == "number_value":
        n = value.number_value
        return int(n) if n.is_integer() and abs(n) < 2**53 else n
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "struct_value":
        return struct_to_dict(value.struct_value, depth)
    if kind == "list_value":
        _check_depth(depth)
        return [value_to_json(v, depth + 1) for v in value.list_value.values]
    return None


def struct_to_dict(struct: struct_pb2.Struct, depth: int = 0) -> dict[str, Any]:
    if depth == 0 and _MEMO_MIN_BYTES <= struct.ByteSize() <= _MEMO_MAX_BYTES:
        return json.loads(_json_of_struct(struct.SerializeToString()))  # a fresh dict every call
    _check_depth(depth)
    return {k: value_to_json(v, depth + 1) for k, v in struct.fields.items()}


def check_json_depth(value: Any, depth: int = 0) -> None:
    """CodecError when ``value`` (decoded JSON) nests deeper than MAX_JSON_DEPTH."""
    if isinstance(value, dict | list):
        _check_depth(depth)
        for item in value.values() if isinstance(value, dict) else value:
            check_json_depth(item, depth + 1)


def _check_depth(depth: int) -> None:
    if depth >= MAX_JSON_DEPTH:
        raise CodecError(f"a JSON value nested deeper than {MAX_JSON_DEPTH} levels of objects and lists")


def dict_to_struct(value: dict[str, Any], out: struct_pb2.Struct) -> None:
    if len(value) > 8 or not _SCALARS.issuperset(map(type, value.values())):
        try:
            text = json.dumps(value, default=_json_default)
        except (ValueError, TypeError, RecursionError):
            text = ""  # not JSON: the plain path below says why
        if _MEMO_MIN_BYTES <= len(text) <= _MEMO_MAX_BYTES:
            out.MergeFromString(_struct_of_json(text))
            return
    try:
        out.update(value)
    except (ValueError, TypeError):  # non-JSON leaves (an enum, a dataclass): once through JSON
        out.update(json.loads(json.dumps(value, default=_json_default)))


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Enum):
        return obj.value
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    raise CodecError(f"not JSON: {type(obj).__name__}")


# Struct.update and reading a Struct's fields are protobuf's own Python recursion (~15 µs each way
# for one tool's JSON schema on this machine), and the same nested values cross on every Begin:
# the toolkit's schemas on every model call, for every middleware. So the codec keeps a small
# memo keyed by exact content — the value's JSON text when encoding, the Struct's bytes when
# decoding — and an edited dict is simply a new key. Small and flat values skip it: making the
# key costs more than the plain path (bench/optimizations.py measures both).
_MEMO_MIN_BYTES, _MEMO_MAX_BYTES = 64, 16 * 1024
_SCALARS = frozenset((str, int, float, bool, type(None)))


@functools.lru_cache(maxsize=256)
def _struct_of_json(text: str) -> bytes:
    out = struct_pb2.Struct()
    out.update(json.loads(text))
    return out.SerializeToString()


@functools.lru_cache(maxsize=256)
def _json_of_struct(data: bytes) -> str:
    struct = struct_pb2.Struct.FromString(data)
    _check_depth(0)
    return json.dumps({k: value_to_json(v, 1) for k, v in struct.fields.items()})


# ---------------------------------------------------------------------------------------------
# Plans.


def _upper_snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper()


class _EnumMap:
    def __init__(self, py: type[Enum], descriptor: Any) -> None:
        prefix = _upper_snake(descriptor.name) + "_"
        self.to_number = {m: descriptor.values_by_name[prefix + m.name].number for m in py}
        self.to_py = {n: m for m, n in self.to_number.items()}


Encoder = Callable[[Message, Any], object]  # its result is unused
Decoder = Callable[[Message, dict[str, Any]], None]
# A message's plan: (field name, encoder) and (field name, decoder) per field, in order. None: a
# scalar field, set with setattr (read with getattr) inline, no call per field: the codec runs for
# every item and every hook's kwargs, and most fields are plain strings and numbers.
Plan = tuple[list[tuple[str, Encoder | None]], list[tuple[str, Decoder | None]]]


# A plan run as generated straight-line code: (encode an object's attributes, encode a dict's
# keys, decode into a dict). Same steps as looping over the plan, without the loop's per-field
# lookups and branches; the codec runs for every item and every Begin.
_Functions = tuple[Callable[[Message, Any], None], Callable[[Message, Any], None], Callable[[Message], dict[str, Any]]]


def _generate(
    name: str, plan: Plan, cls: type | None, inline: dict[Callable[..., Any], tuple[str, Callable[..., Any]]]
) -> _Functions:
    """The plan of message ``name`` as three functions (see ``_Functions``), written out field by
    field: scalars set and read inline, a field converter's steps in place (``inline``: what
    ``_field_converters`` made them of), any other converter called. ``cls``: the data class whose
    objects are encoded (its fields are read as attributes; anything else with getattr)."""
    attrs = {f.name for f in dataclasses.fields(cls)} if cls is not None and dataclasses.is_dataclass(cls) else set()
    env: dict[str, Any] = {}
    by_attr: list[str] = []
    by_key: list[str] = []
    decode: list[str] = []

    def ident(field: str) -> bool:  # usable as ``x.field`` in the generated source
        return field.isidentifier() and not keyword.iskeyword(field)

    for i, (field, encoder) in enumerate(plan[0]):
        read = f"obj.{field}" if field in attrs and ident(field) else f"getattr(obj, {field!r}, None)"
        if encoder is None:
            store = f"out.{field} = v" if ident(field) else f"setattr(out, {field!r}, v)"
        elif encoder in inline:
            env[f"s{i}"] = inline[encoder][1]
            store = f"s{i}(out, {field!r}, v)"
        else:
            env[f"e{i}"] = encoder
            store = f"e{i}(out, v)"
        by_attr += [f"    v = {read}", "    if v is not None:", f"        {store}"]
        by_key += [f"    v = get({field!r})", "    if v is not None:", f"        {store}"]
    for i, (field, decoder) in enumerate(plan[1]):
        kind, get = inline.get(decoder, ("call", None)) if decoder is not None else ("scalar", None)
        if get is not None:
            env[f"g{i}"] = get
        value = f"msg.{field}" if ident(field) else f"getattr(msg, {field!r})"
        if kind == "scalar":
            decode.append(f"    f[{field!r}] = {value}")
        elif kind in ("repeated", "plain"):
            decode.append(f"    f[{field!r}] = g{i}({value})")
        elif kind == "enum":
            decode += [f"    n = {value}", "    if n:", f"        f[{field!r}] = g{i}(n)"]
        elif kind == "present":
            decode += [f"    if msg.HasField({field!r}):", f"        f[{field!r}] = g{i}({value})"]
        else:
            env[f"d{i}"] = decoder
            decode.append(f"    d{i}(msg, f)")
    source = "\n".join(
        [
            "def encode_attrs(out, obj):",
            *(by_attr or ["    pass"]),
            "def encode_keys(out, obj):",
            "    get = obj.get",
            *by_key,
            "def decode(msg):",
            "    f = {}",
            *decode,
            "    return f",
        ]
    )
    exec(compile(source, f"<agentmw.codec {name}>", "exec"), env)  # our own source, from the descriptor
    return env["encode_attrs"], env["encode_keys"], env["decode"]


class Codec:
    """Converts data-model objects to proto messages and back. Use the module-level ``codec``."""

    def __init__(self) -> None:
        self.py_by_proto: dict[str, type] = {}
        self.proto_by_py: dict[type, type[Message]] = {}
        for cls in _DATACLASSES:
            proto = self._find_proto(cls.__name__)
            self.py_by_proto[proto.DESCRIPTOR.full_name] = cls
            self.proto_by_py[cls] = proto
        self.enums: dict[str, _EnumMap] = {}
        for py_enum in _ENUMS:
            desc = types_pb2.DESCRIPTOR.enum_types_by_name[py_enum.__name__]
            self.enums[desc.full_name] = _EnumMap(py_enum, desc)
        self._plans: dict[str, Plan] = {}
        self._plans_by_class: dict[type, Plan] = {}  # the same plans, by message class (one lookup)
        self._fns_by_class: dict[type, _Functions] = {}  # each plan as straight-line functions (_generate)
        self._inline: dict[Callable[..., Any], tuple[str, Callable[..., Any]]] = {}  # see _field_converters
        self._cls_by_class: dict[type, type | None] = {}  # message class -> data class
        # A union's value without a dict around it (None when unset), and as a list's element (unset: an error).
        self._oneof_values: dict[Callable[..., Any], tuple[Callable[[Message], Any], Callable[[Message], Any]]] = {}
        # The Item union, by Python class; chat responses and messages included.
        self.item_field_by_py: dict[type, str] = {}
        for f in events_pb2.Item.DESCRIPTOR.fields:
            self.item_field_by_py[self.py_by_proto[f.message_type.full_name]] = f.name
        self.block_field_by_py: dict[type, str] = {
            self.py_by_proto[f.message_type.full_name]: f.name for f in types_pb2.ContentBlock.DESCRIPTOR.fields
        }

    @staticmethod
    def _find_proto(name: str) -> type[Message]:
        for module in _PROTO_MODULES:
            if hasattr(module, name):
                return getattr(module, name)
        raise CodecError(f"no proto message for data class {name}")

    # -- public API -------------------------------------------------------------------------

    def encode(self, obj: Any, out: Message | None = None) -> Message:
        """A data-model object (dataclass) as its proto message."""
        if out is None:
            out = self.proto_by_py[type(obj)]()
        self._encode_into(out, obj, getattr)
        return out

    def decode(self, msg: Message) -> Any:
        """A proto message as its data-model object."""
        cls = self._data_class(msg)
        if cls is None:
            raise CodecError(f"{msg.DESCRIPTOR.full_name} has no data class")
        kwargs = self._decode_fields(msg)
        try:
            return cls(**kwargs)
        except TypeError as exc:  # said in the proto's terms, without Python's constructor wording
            text = re.sub(r"^\w+\.__init__\(\) ", "", str(exc))
            missing = r"missing \d+ required (?:keyword-only |positional )?arguments?:"
            text = re.sub(missing, "missing required field", text)
            raise CodecError(f"{msg.DESCRIPTOR.name}: {text}") from exc

    def encode_record(self, values: dict[str, Any], out: Message) -> Message:
        """A dict of kwargs into a record message (fields named like the keys); None = unset."""
        self._encode_into(out, values, _dict_get)
        return out

    def decode_record(self, msg: Message) -> dict[str, Any]:
        """A record message as a dict; unset fields are left out."""
        return self._decode_fields(msg)

    def decode_record_field(self, msg: Message, name: str) -> Any:
        """One field (or oneof) of a record message, as ``decode_record`` would give it; None when unset."""
        plan = self._plans_by_class.get(type(msg)) or self._plan_of(msg)
        for field, decoder in plan[1]:
            if field == name:
                if decoder is None:
                    return getattr(msg, name)
                out: dict[str, Any] = {}
                try:
                    decoder(msg, out)
                except KeyError as exc:
                    raise _unknown_enum(msg, exc) from None
                return out.get(name)
        raise CodecError(f"{msg.DESCRIPTOR.name} has no field {name!r}")

    def encode_item(self, obj: Any, out: events_pb2.Item | None = None) -> events_pb2.Item:
        out = out if out is not None else events_pb2.Item()
        name = self.item_field_by_py.get(type(obj))
        if name is None:
            raise CodecError(f"{type(obj).__name__} cannot flow through a hook")
        self._encode_into(getattr(out, name), obj, getattr)
        return out

    def decode_item(self, msg: events_pb2.Item) -> Any:
        name = msg.WhichOneof("item")
        if name is None:
            raise CodecError("empty Item")
        return self.decode(getattr(msg, name))

    # -- plans ------------------------------------------------------------------------------

    def _encode_into(self, out: Message, obj: Any, get: Callable[[Any, str, Any], Any]) -> None:
        fns = self._fns_by_class.get(type(out)) or self._fns_of(out)
        if get is getattr:
            try:
                fns[0](out, obj)
            except AttributeError:  # an object without every field of its class: anew, field by field
                if isinstance(obj, _NOT_OBJECTS):  # no duck type: its fields would all read as unset
                    text = clipped(repr(obj), 80)
                    raise CodecError(f"expected a {out.DESCRIPTOR.name}, got {type(obj).__name__} {text}") from None
                out.Clear()  # (``out`` is always a fresh message: nothing of the caller's is lost)
                self._encode_fields(out, obj, get)
        else:
            fns[1](out, obj)

    def _encode_fields(self, out: Message, obj: Any, get: Callable[[Any, str, Any], Any]) -> None:
        plan = self._plans_by_class.get(type(out)) or self._plan_of(out)
        for name, encoder in plan[0]:
            value = get(obj, name, None)
            if value is not None:
                if encoder is None:
                    setattr(out, name, value)
                else:
                    encoder(out, value)

    def _decode_fields(self, msg: Message) -> dict[str, Any]:
        fns = self._fns_by_class.get(type(msg)) or self._fns_of(msg)
        try:
            return fns[2](msg)
        except KeyError as exc:
            raise _unknown_enum(msg, exc) from None

    def _fns_of(self, msg: Message) -> _Functions:
        plan = self._plans_by_class.get(type(msg)) or self._plan_of(msg)
        fns = self._fns_by_class[type(msg)] = _generate(msg.DESCRIPTOR.name, plan, self._data_class(msg), self._inline)
        return fns

    def _data_class(self, msg: Message) -> type | None:
        """The data class of a message (None for a record), found by message class: one lookup."""
        try:
            return self._cls_by_class[type(msg)]
        except KeyError:
            cls = self._cls_by_class[type(msg)] = self.py_by_proto.get(msg.DESCRIPTOR.full_name)
            return cls

    def _plan_of(self, msg: Message) -> Plan:
        plan = self._plans_by_class[type(msg)] = self._plan(msg.DESCRIPTOR)
        return plan

    def _plan(self, desc: Descriptor | UpbDescriptor) -> Plan:
        plan = self._plans.get(desc.full_name)
        if plan is None:
            plan = self._plans[desc.full_name] = self._compile(desc)
        return plan

    def _compile(self, desc: Descriptor | UpbDescriptor) -> Plan:
        encoders: list[tuple[str, Encoder | None]] = []
        decoders: list[tuple[str, Decoder | None]] = []
        done_oneofs: set[str] = set()
        for field in desc.fields:
            oneof = field.containing_oneof
            if oneof is not None and not oneof.name.startswith("_"):  # a real (non-optional) oneof
                if oneof.name in done_oneofs:
                    continue
                done_oneofs.add(oneof.name)
                one_enc, one_dec = self._oneof_converters(oneof)
                encoders.append((oneof.name, one_enc))
                decoders.append((oneof.name, one_dec))
                continue
            if _ordered_text_of(desc, field) is not None:
                continue  # carried with its Struct (see _ordered_struct_converters)
            ordered = _ordered_text_of(desc, field, of_struct=True)
            enc: Encoder | None
            dec: Decoder | None
            if ordered is not None:
                enc, dec = self._ordered_struct_converters(field.name, ordered)
            elif _scalar(field):  # set inline; read inline too unless unset must read as absent
                enc, dec = None, self._field_converters(field)[1] if field.has_presence else None
            else:
                enc, dec = self._field_converters(field)
            encoders.append((field.name, enc))
            decoders.append((field.name, dec))
        return encoders, decoders

    @staticmethod
    def _ordered_struct_converters(name: str, text_name: str) -> tuple[Encoder, Decoder]:
        """A Struct with a ``<name>_json`` sibling: the JSON text keeps the key order (a Struct's
        map does not). Decoding takes the text only when it holds the same JSON as the Struct, so
        a writer that sets only the Struct, or edits it and forwards stale text, is read by it."""

        def encode(out: Message, value: Any) -> None:
            dict_to_struct(value, getattr(out, name))
            setattr(out, text_name, json.dumps(value, separators=(",", ":"), default=_json_default))

        def decode(msg: Message, kwargs: dict[str, Any]) -> None:
            if not msg.HasField(name):
                return
            value = struct_to_dict(getattr(msg, name))
            text = getattr(msg, text_name)
            if text:
                try:
                    ordered = json.loads(text)
                except ValueError:
                    ordered = None
                if ordered == value:
                    value = ordered
            kwargs[name] = value

        return encode, decode

    def _oneof_converters(self, oneof: Any) -> tuple[Encoder, Decoder]:
        members = {f.name: self._value_converters(f) for f in oneof.fields}
        by_kind: dict[Any, str] = {}
        for f in oneof.fields:
            if f.type == FieldDescriptor.TYPE_STRING:
                by_kind[str] = f.name
            elif f.type == FieldDescriptor.TYPE_MESSAGE:
                py = self.py_by_proto.get(f.message_type.full_name)
                by_kind[py if py is not None else list] = f.name
        oname = oneof.name

        def encode(out: Message, value: Any) -> None:
            kind = str if isinstance(value, str) else list if isinstance(value, list) else type(value)
            member = by_kind.get(kind)
            if member is None:
                raise CodecError(f"{oname}: {type(value).__name__} is not one of {sorted(members)}")
            members[member][0](out, member, value)

        getters = {member: converters[1] for member, converters in members.items()}

        def value(msg: Message) -> Any:
            member = msg.WhichOneof(oname)
            return None if member is None else getters[member](getattr(msg, member))

        def element(msg: Message) -> Any:  # one of a list, which has no "unset" to decode to
            member = msg.WhichOneof(oname)
            if member is None:
                raise CodecError(f"an empty {msg.DESCRIPTOR.name} in a list (none of {sorted(members)} set)")
            return getters[member](getattr(msg, member))

        def decode(msg: Message, kwargs: dict[str, Any]) -> None:
            member = msg.WhichOneof(oname)
            if member is not None:
                kwargs[oname] = getters[member](getattr(msg, member))

        self._oneof_values[decode] = (value, element)
        return encode, decode

    def _field_converters(self, field: FieldDescriptor) -> tuple[Encoder, Decoder]:
        name = field.name
        set_value, get_value = self._value_converters(field)
        if field.is_repeated:
            kind = "repeated"
        elif field.type == FieldDescriptor.TYPE_ENUM:
            kind = "enum"
        elif field.has_presence:
            kind = "present"
        else:
            kind = "plain"

        def encode(out: Message, value: Any) -> None:
            set_value(out, name, value)

        def decode(msg: Message, kwargs: dict[str, Any]) -> None:
            value = getattr(msg, name)
            if (kind == "enum" and not value) or (kind == "present" and not msg.HasField(name)):
                return
            kwargs[name] = get_value(value)

        # _generate writes these steps out in place instead of calling them.
        self._inline[encode] = ("set", set_value)
        self._inline[decode] = (kind, get_value)
        return encode, decode

    def _value_converters(
        self, field: FieldDescriptor
    ) -> tuple[Callable[[Message, str, Any], object], Callable[[Any], Any]]:  # (set, get); set's result unused
        """(set(out, field_name, python_value), get(proto_field_value) -> python_value)."""
        repeated = field.is_repeated
        if field.type == FieldDescriptor.TYPE_ENUM:
            emap = self.enums[field.enum_type.full_name]

            def set_enum(out: Message, name: str, value: Any) -> None:
                try:
                    setattr(out, name, emap.to_number[value])
                except KeyError:
                    raise CodecError(f"{name}: {value!r} is not a {field.enum_type.name}") from None

            return set_enum, emap.to_py.__getitem__
        if field.type != FieldDescriptor.TYPE_MESSAGE:
            if repeated:
                return (lambda out, name, value: getattr(out, name).extend(value)), list
            return setattr, _identity
        full = field.message_type.full_name
        if full == _STRUCT:
            if repeated:

                def set_structs(out: Message, name: str, value: Any) -> None:
                    for v in value:
                        dict_to_struct(v, getattr(out, name).add())

                return set_structs, lambda seq: [struct_to_dict(s) for s in seq]

            def set_struct(out: Message, name: str, value: Any) -> None:
                if value or type(value) is not dict:  # an event's usual metadata, {}, sets nothing
                    dict_to_struct(value, getattr(out, name))

            return set_struct, struct_to_dict
        if full == _VALUE:
            return (lambda out, name, value: json_to_value(value, getattr(out, name))), value_to_json
        msg_desc = field.message_type
        if full not in self.py_by_proto and _is_list_wrapper(msg_desc):
            inner = msg_desc.fields[0]
            set_inner, get_inner = self._value_converters(inner)
            inner_name = inner.name
            return (
                lambda out, name, value: set_inner(getattr(out, name), inner_name, value),
                lambda wrapper: get_inner(getattr(wrapper, inner_name)),
            )
        if full not in self.py_by_proto and _is_union(msg_desc):
            union_enc, union_dec = self._plan(msg_desc)[0][0][1], self._plan(msg_desc)[1][0][1]
            assert union_enc is not None and union_dec is not None
            get_union, get_element = self._oneof_values[union_dec]

            if repeated:
                return (
                    lambda out, name, value: [union_enc(getattr(out, name).add(), v) for v in value],
                    lambda seq: [get_element(m) for m in seq],
                )
            return (lambda out, name, value: union_enc(getattr(out, name), value)), get_union
        if full in self.py_by_proto:
            if repeated:
                return (
                    lambda out, name, value: [self.encode(v, getattr(out, name).add()) for v in value],
                    lambda seq: [self.decode(m) for m in seq],
                )
            return (lambda out, name, value: self.encode(value, getattr(out, name))), self.decode
        # A record message without a data class (e.g. hook kwargs): a dict.
        if repeated:
            return (
                lambda out, name, value: [self.encode_record(v, getattr(out, name).add()) for v in value],
                lambda seq: [self.decode_record(m) for m in seq],
            )
        return (lambda out, name, value: self.encode_record(value, getattr(out, name))), self.decode_record


# Values that are never a data class's stand-in (a dict with its keys is not one either: in-process
# its attributes are missing as well).
_NOT_OBJECTS = (str, bytes, int, float, dict, list, tuple, set, frozenset)


def _unknown_enum(msg: Message, exc: KeyError) -> CodecError:
    """A decoder's KeyError: the enum maps' lookup of a number this version does not know."""
    return CodecError(f"{msg.DESCRIPTOR.name}: unknown enum number {exc.args[0]!r}")


def _identity(value: Any) -> Any:
    return value


def _scalar(field: FieldDescriptor) -> bool:
    """A singular string, bytes, number or bool: set with setattr as it is (None: left unset)."""
    return not field.is_repeated and field.type not in (FieldDescriptor.TYPE_ENUM, FieldDescriptor.TYPE_MESSAGE)


def _dict_get(obj: dict[str, Any], name: str, default: Any) -> Any:
    return obj.get(name, default)


def _ordered_text_of(
    desc: Descriptor | UpbDescriptor, field: FieldDescriptor, *, of_struct: bool = False
) -> str | None:
    """``of_struct``: the name of the ordered JSON text kept beside this Struct field, if any.
    Otherwise: the Struct field this string field is the ordered text of, if it is one."""
    if of_struct:
        text = desc.fields_by_name.get(f"{field.name}_json")
        is_struct = field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.full_name == _STRUCT
        ok = is_struct and not field.is_repeated and text is not None and text.type == FieldDescriptor.TYPE_STRING
        return text.name if ok else None
    if field.type != FieldDescriptor.TYPE_STRING or not field.name.endswith("_json"):
        return None
    struct = desc.fields_by_name.get(field.name[: -len("_json")])
    return struct.name if struct is not None and _ordered_text_of(desc, struct, of_struct=True) else None


def _is_list_wrapper(desc: Descriptor) -> bool:
    return len(desc.fields) == 1 and desc.fields[0].is_repeated


def _is_union(desc: Descriptor) -> bool:
    return len(desc.oneofs) == 1 and len(desc.oneofs[0].fields) == len(desc.fields)


codec = Codec()
