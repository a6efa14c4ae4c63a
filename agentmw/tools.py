"""Tools and the toolkit: lookup, JSON repair-parse, JSON-schema validation, execution as chunks."""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import typing
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import jsonschema
import referencing
import referencing.exceptions
import referencing.jsonschema

from .codec import CodecError, check_json_depth
from .data import (
    TextBlock,
    ToolCallBlock,
    ToolChunk,
    ToolDescriptor,
    ToolResponse,
    ToolResultState,
)

ToolOutput = str | ToolResponse | ToolChunk | AsyncIterator[ToolChunk | ToolResponse]

INTERRUPTED_TOOL_TEXT = "<system-reminder>The tool call has been interrupted by the user.</system-reminder>"
# A function name as the strictest model API (OpenAI) takes it; a middleware's tools are registered
# as "<middleware>__<tool>", so its name is held to the same characters.
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# Tools in one model request, as the strictest model API (OpenAI's chat API) takes them: more, and
# every model call is refused by the provider.
MAX_MODEL_TOOLS = 128


class ToolInputError(ValueError):
    """The model's input for a tool does not parse or does not fit the tool's schema."""


def schema_validator(schema: dict[str, Any]) -> Any:
    """A validator of the JSON schema ``schema`` that resolves ``$ref`` only within it; ValueError
    says what is wrong with the schema. jsonschema's default registry fetches any other reference,
    URL or file, with a blocking read on the event loop at every validation, and what it read
    would reach the tool result: a schema from another process must not make the host read
    anything. A reference that cannot be resolved is refused here, not when a model calls the tool."""
    try:
        cls = jsonschema.validators.validator_for(schema)
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(f"not a valid JSON schema: {exc.message}") from None
    except TypeError:  # e.g. an unhashable "$schema"
        raise ValueError("not a valid JSON schema") from None
    dialect = schema.get("$schema", "") if isinstance(schema, dict) else ""  # a schema may be a bool
    spec = referencing.jsonschema.specification_with(str(dialect), default=referencing.jsonschema.DRAFT202012)
    resolver = _LOCAL_ONLY.resolver_with_root(spec.create_resource(schema))
    for ref in _refs(schema):
        if not ref.startswith("#"):
            raise ValueError(f"$ref {ref!r} is not within the schema (only '#...' references are resolved)")
        try:
            resolver.lookup(ref)
        except referencing.exceptions.Unresolvable:
            raise ValueError(f"$ref {ref!r} points to nothing in the schema") from None
    return cls(schema, registry=_LOCAL_ONLY)


_LOCAL_ONLY: referencing.Registry[Any] = referencing.Registry()  # no resources, and no retrieval


_DATA_KEYWORDS = frozenset({"const", "default", "enum", "examples"})  # their values are instances, not schemas


def _refs(value: Any) -> Iterator[str]:
    """Every ``$ref`` string in a schema."""
    if isinstance(value, dict):
        ref = value.get("$ref")
        if isinstance(ref, str):
            yield ref
        for key, item in value.items():
            if key not in _DATA_KEYWORDS:
                yield from _refs(item)
    elif isinstance(value, list):
        for item in value:
            yield from _refs(item)


class Tool:
    """A tool the agent can call. Subclass and implement ``call``, or use ``FunctionTool``."""

    def __init__(self, descriptor: ToolDescriptor) -> None:
        self.descriptor = descriptor
        self._validator: Any = None

    # The descriptor's fields read as the tool's own, as on AgentScope's ToolBase.
    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["descriptor"], name)

    async def call(self, tool_input: dict[str, Any], state: Any = None) -> ToolOutput:
        raise NotImplementedError

    def validate(self, tool_call: ToolCallBlock) -> dict[str, Any]:
        tool_input = parse_input(tool_call.input)
        if self._validator is None:  # building it checks the schema itself: do that once
            try:
                self._validator = schema_validator(self.descriptor.input_schema)
            except ValueError as exc:
                raise ToolInputError(f"tool {self.name!r} has an invalid input schema: {exc}") from None
        try:
            self._validator.validate(tool_input)
        except jsonschema.ValidationError as exc:
            raise ToolInputError(f"invalid input for tool {self.name!r}: {exc.message}") from None
        except referencing.exceptions.Unresolvable as exc:  # schema_validator resolved each; a relative base may not
            what = f"an input schema with a $ref that points to nothing: {exc}"
            raise ToolInputError(f"tool {self.name!r} has {what}") from None
        except RecursionError:  # references that lead back to themselves without end (checked only here)
            raise ToolInputError(f"tool {self.name!r} has an input schema whose $refs loop without end") from None
        return tool_input


class FunctionTool(Tool):
    """A Python function (sync or async, returning text, a ToolResponse or yielding chunks)."""

    def __init__(self, func: Callable[..., Any], descriptor: ToolDescriptor) -> None:
        super().__init__(descriptor)
        self.func = func

    async def call(self, tool_input: dict[str, Any], state: Any = None) -> ToolOutput:
        result = self.func(**tool_input)
        if inspect.isawaitable(result):
            result = await result
        return result


@typing.overload
def tool(name: Callable[..., Any]) -> FunctionTool: ...


@typing.overload
def tool(
    name: str | None = None, description: str = "", input_schema: dict[str, Any] | None = None, **flags: Any
) -> Callable[[Callable[..., Any]], FunctionTool]: ...


def tool(name: Any = None, description: str = "", input_schema: dict[str, Any] | None = None, **flags: Any) -> Any:
    """Decorator: ``@tool(description=..., input_schema={...})`` over a function, or bare ``@tool``
    (its name, docstring and signature say it all)."""
    if callable(name):  # bare @tool: the function itself
        return tool()(name)

    def wrap(func: Callable[..., Any]) -> FunctionTool:
        schema = input_schema or _schema_from_signature(func)
        desc = ToolDescriptor(
            name=name or func.__name__,
            description=description or (func.__doc__ or "").strip(),
            input_schema=schema,
            **flags,
        )
        return FunctionTool(func, desc)

    return wrap


def _schema_from_signature(func: Callable[..., Any]) -> dict[str, Any]:
    kinds = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}
    props: dict[str, Any] = {}
    required = []
    hints = typing.get_type_hints(func)  # resolves string annotations (from __future__ import annotations)
    for param in inspect.signature(func).parameters.values():
        ann = hints.get(param.name)
        props[param.name] = {"type": kinds[ann]} if ann in kinds else {}
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
    return {"type": "object", "properties": props, "required": required}


def parse_input(raw: str) -> dict[str, Any]:
    """Parse the model's raw input JSON, repairing the common truncations (missing braces)."""
    text = (raw or "").strip() or "{}"
    for candidate in (text, text + "}", text + '"}', text.rstrip(",") + "}"):
        try:
            value = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        if not isinstance(value, dict):
            raise ToolInputError(f"tool input must be a JSON object, got {type(value).__name__}")
        try:  # it goes to remote middleware in a Struct (on_check_permission's tool_input)
            check_json_depth(value)
        except CodecError as exc:
            raise ToolInputError(f"tool input: {exc}") from None
        return value
    raise ToolInputError(f"tool input is not valid JSON: {text[:200]!r}")


def error_response(message: str, call_id: str, state: ToolResultState = ToolResultState.ERROR) -> ToolResponse:
    return ToolResponse(content=[TextBlock(text=message)], state=state, id=call_id)


async def middleware_tools(middleware: Any, name: str | None = None) -> dict[str, Tool]:
    """The tools a middleware contributes (``list_tools``), by their registered name
    ``<name>__<tool>``. ``name`` defaults to the middleware key; the prefix keeps tools of
    different middleware apart and uses only characters every model API accepts in a function name."""
    prefix = name or await middleware.get_middleware_key()
    return registered_tools(await middleware.list_tools(), prefix)


def registered_tools(tools: list[Tool], prefix: str) -> dict[str, Tool]:
    """``tools`` of the middleware ``prefix``, by their registered name ``<prefix>__<tool>``."""
    named = {}
    for t in tools:
        t.descriptor.owner = prefix
        named[f"{prefix}__{t.name}"] = t
    return named


async def add_middleware_tools(toolkit: Toolkit, middleware: Any, name: str | None = None) -> list[str]:
    """Register a middleware's tools in ``toolkit`` (see ``middleware_tools``); their names."""
    tools = await middleware_tools(middleware, name)
    for full, t in tools.items():
        toolkit.register(t, name=full)
    return list(tools)


class Toolkit:
    def __init__(self, tools: list[Tool] | None = None) -> None:
        self.tools: dict[str, Tool] = {}
        for t in tools or []:
            self.register(t)

    def register(self, t: Tool, name: str | None = None) -> None:
        name = name or t.name
        if name in self.tools:
            raise ValueError(f"tool {name!r} is already registered")
        self.tools[name] = t

    def overlay(self, *tools: Tool) -> Toolkit:
        """This toolkit plus ``tools`` (shadowing same names), without changing this one."""
        combined = Toolkit()
        combined.tools = {**self.tools, **{t.name: t for t in tools}}
        return combined

    def unregister_owner(self, owner: str) -> None:
        for name in [n for n, t in self.tools.items() if t.descriptor.owner == owner]:
            del self.tools[name]

    def get(self, name: str) -> Tool | None:
        return self.tools.get(name)

    def schemas(self, only: list[str] | None = None) -> list[dict[str, Any]]:
        """OpenAI-style function schemas, optionally filtered by a whitelist."""
        return [
            {
                "type": "function",
                "function": {"name": name, "description": t.description, "parameters": t.input_schema},
            }
            for name, t in self.tools.items()
            if only is None or name in only
        ]

    async def call_tool(self, tool_call: ToolCallBlock, state: Any = None) -> AsyncIterator[ToolChunk | ToolResponse]:
        """Run a call: chunks, then always exactly one ToolResponse (errors and cancellation included)."""
        t = self.tools.get(tool_call.name)
        if t is None:
            yield error_response(f"Error: tool {tool_call.name!r} does not exist.", tool_call.id)
            return
        response = ToolResponse(id=tool_call.id)
        try:
            result = await t.call(t.validate(tool_call), state)
            if isinstance(result, str):
                response.content.append(TextBlock(text=result))
                yield ToolChunk(content=[TextBlock(text=result)], state=ToolResultState.SUCCESS, is_last=True)
            elif isinstance(result, ToolResponse):
                response = result
                response.id = tool_call.id
            elif isinstance(result, ToolChunk):
                response.append_chunk(result)
                yield result
            else:
                async for item in result:
                    if isinstance(item, ToolResponse):
                        response = item
                        response.id = tool_call.id
                        break
                    response.append_chunk(item)
                    yield item
        except ToolInputError as exc:
            yield error_response(str(exc), tool_call.id)
            return
        except asyncio.CancelledError:  # interrupted: an INTERRUPTED result, and the generator ends
            chunk = ToolChunk(content=[TextBlock(text=INTERRUPTED_TOOL_TEXT)], state=ToolResultState.INTERRUPTED)
            response.append_chunk(chunk)
            yield chunk
        except (GeneratorExit, KeyboardInterrupt, SystemExit):  # closed by the caller, or the process ends
            raise
        except BaseException as exc:
            # The tool's own failure (any exception of its code: a BaseException too, which would
            # otherwise escape the reply in process and end a middleware server's call unanswered):
            # its message streams as the result's text and is the stored result (after any text
            # already streamed), state ERROR, as in AgentScope.
            chunk = ToolChunk(content=[TextBlock(text=str(exc))], state=ToolResultState.ERROR)
            response.append_chunk(chunk)
            yield chunk
        yield response
