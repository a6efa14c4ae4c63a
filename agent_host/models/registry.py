"""ModelRegistry: models by id, each with optional retries and fallback ids (docs/behaviour.md#reasoning)."""

from __future__ import annotations

import copy
import inspect
import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agentmw.data import ErrorType, ModelRef
from agentmw.errors import ModelError, UnknownModelError  # re-exported: the registry raises it
from agentmw.security import read_secret

from .base import ChatModel
from .retry import RetryPolicy

# What the parameters of one call (on_model_call's, a middleware's) may not set, in the request or
# in its extra_body: the model (choosing one takes set_model), the input (the call's own kwargs),
# and the transport: endpoint, headers, query, credentials, timeouts. Both SDKs would take them
# (openai's create() keywords, dashscope's call arguments), redirecting a request or its key.
RESERVED_PARAMETERS = frozenset(
    {
        "model", "messages", "input", "tools", "tool_choice", "stream", "stream_options",
        "extra_headers", "extra_query", "headers", "timeout", "max_retries", "api_key", "base_url",
        "url", "http_client", "workspace", "extra_url_parameters", "session", "task", "api_protocol",
        "customized_model_id",
    }
)  # fmt: skip


def check_call_parameters(parameters: Mapping[str, Any], configured: Mapping[str, Any]) -> None:
    """Refuse (ModelError, invalid_request, not retried) what a call's parameters set, or change
    from the model's configuration, among RESERVED_PARAMETERS: the operator's own configured
    ones (host.yaml ``parameters``) pass unchanged."""

    def changed(given: Mapping[str, Any], have: Any) -> set[str]:
        have = have if isinstance(have, Mapping) else {}
        return {k for k in given.keys() & RESERVED_PARAMETERS if k not in have or have[k] != given[k]}

    bad = sorted(changed(parameters, configured))
    body = parameters.get("extra_body")
    if isinstance(body, Mapping):
        bad += sorted(f"extra_body.{k}" for k in changed(body, configured.get("extra_body")))
    if bad:
        raise ModelError(
            f"a call's parameters may not set {', '.join(bad)}: the model, its input and the transport "
            "are the host's (choose a model with set_model)",
            error_type=ErrorType.INVALID_REQUEST,
            retryable=False,
        )


@dataclass
class ModelEntry:
    model: ChatModel
    max_retries: int = 0
    fallback: list[str] = field(default_factory=list)
    retry: RetryPolicy = field(default_factory=RetryPolicy)


def _offline() -> type[ChatModel]:
    from .offline import OfflineRuleModel

    return OfflineRuleModel


def _dashscope() -> type[ChatModel]:
    from .dashscope import DashScopeChatModel  # imports the dashscope SDK only when used

    return DashScopeChatModel


def _openai() -> type[ChatModel]:
    from .openai_compat import OpenAICompatibleModel

    return OpenAICompatibleModel


# provider name -> its model class, imported when asked for: a host that only uses the offline
# model never imports a provider SDK.
PROVIDERS: dict[str, Callable[[], type[ChatModel]]] = {
    "offline": _offline,
    "dashscope": _dashscope,
    "openai": _openai,
}


def _settings(model_cls: type[ChatModel]) -> dict[str, Any]:
    """The keyword settings a model class takes, its bases' included (a ``**kw`` passes them on),
    each with its type hint."""
    settings: dict[str, Any] = {}
    for cls in model_cls.__mro__:
        init = cls.__dict__.get("__init__")
        if init is None:
            continue
        hints = typing.get_type_hints(init)
        params = inspect.signature(init).parameters.values()
        for p in params:
            if p.kind is p.KEYWORD_ONLY and p.name != "id" and p.name not in settings:
                settings[p.name] = hints.get(p.name, Any)
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return settings


# A model with an ``api_key`` setting may name its key instead, as security.users name tokens:
# read once, at start, through the same read_secret.
_KEY_SOURCES = ("api_key_env", "api_key_file")

_POSITIVE = {"timeout", "context_size"}  # numbers that must be > 0 (every other one: >= 0)


def _expected(key: str, hint: Any, value: Any) -> str | None:
    """What ``value`` should have been, if it does not fit the setting ``key`` of type ``hint``;
    None when it fits. YAML gives any type anywhere: a wrong one would be taken (``stream:
    "false"`` is true) or fail at every call."""
    if key == "base_url" and isinstance(value, str) and value and not value.startswith(("http://", "https://")):
        return "a URL starting with http:// or https://"
    want, fits = _describe(hint), _fits(value, hint)
    if any(h in (int, float) for h in (hint, *typing.get_args(hint))):  # a number: never negative
        want += " > 0" if key in _POSITIVE else " >= 0"
        if fits and isinstance(value, int | float):
            fits = value > 0 if key in _POSITIVE else value >= 0
    return None if fits else want


def _fits(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arg) for arg in args)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if (origin or hint) is dict:
        key_type, value_type = args or (Any, Any)
        return isinstance(value, Mapping) and all(_fits(k, key_type) and _fits(v, value_type) for k, v in value.items())
    if (origin or hint) is list:
        item_type = args[0] if args else Any
        return isinstance(value, list) and all(_fits(v, item_type) for v in value)
    return isinstance(value, hint) if isinstance(hint, type) else True


def _describe(hint: Any) -> str:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return _describe(args[0])
    names = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}
    if hint in names:
        return names[hint]
    origin = typing.get_origin(hint) or hint
    if origin is dict:
        return "a mapping" + (" of strings" if typing.get_args(hint)[1:] == (str,) else "")
    if origin is list:
        return "a list" + (" of strings" if typing.get_args(hint) == (str,) else "")
    return str(hint)


def _read_api_key(model_id: str, spec: dict[str, Any]) -> None:
    """``api_key_env`` / ``api_key_file`` of a model's settings, read into its ``api_key``."""
    given = [k for k in ("api_key", *_KEY_SOURCES) if spec.get(k)]
    if len(given) > 1:
        raise ValueError(f"model {model_id!r}: give one of api_key, api_key_env, api_key_file, not {', '.join(given)}")
    env, file = spec.pop("api_key_env", ""), spec.pop("api_key_file", "")
    if env or file:
        spec["api_key"] = read_secret(env=env, file=file, where=f"model {model_id!r}: api_key")


def _check(model_id: str, key: str, value: Any, hint: Any) -> None:
    expected = _expected(key, hint, value)
    if expected is not None:
        raise ValueError(f"model {model_id!r}: {key}: expected {expected}, got {value!r}")


class ModelRegistry:
    def __init__(self, default: str | None = None) -> None:
        self.entries: dict[str, ModelEntry] = {}
        self.ids: list[str] = []  # sorted, as a middleware is told them (HookContext.model_ids)
        self.default = default

    def add(
        self,
        model: ChatModel,
        *,
        max_retries: int = 0,
        fallback: list[str] | None = None,
        retry: RetryPolicy | None = None,
    ) -> ChatModel:
        self.entries[model.id] = ModelEntry(model, max_retries, list(fallback or []), retry or RetryPolicy())
        self.ids = sorted(self.entries)
        if self.default is None:
            self.default = model.id
        return model

    def get(self, model_id: str) -> ChatModel:
        try:
            return self.entries[model_id].model
        except KeyError:
            raise UnknownModelError(model_id, self.ids) from None

    def entry(self, model_id: str) -> ModelEntry:
        self.get(model_id)
        return self.entries[model_id]

    def candidates(self, model_id: str) -> list[tuple[str, int, RetryPolicy]]:
        """The model and its fallbacks, each with its retry budget, in the order to try them."""
        ids = [model_id, *self.entry(model_id).fallback]
        return [(i, self.entry(i).max_retries, self.entry(i).retry) for i in ids]

    async def aclose(self) -> None:
        """Close every model's connections (the host calls it at shutdown)."""
        for entry in self.entries.values():
            close = getattr(entry.model, "aclose", None)
            if close is not None:
                await close()

    def resolve(self, model: ChatModel | str | Any) -> ChatModel:
        """A model object, or a registered id, or anything with an ``id`` (a ModelRef)."""
        if isinstance(model, ChatModel):
            return model
        return self.get(model if isinstance(model, str) else model.id)

    def snapshot(self, model: ChatModel | str | ModelRef) -> Any:
        """The ModelRef of the registered model ``model`` names (its id, a ModelRef, the model
        itself), with a ModelRef's ``parameters`` over the model's own. An id not registered, or a
        model object that is not the registered one (in-process), is returned as it is: the call
        uses or refuses it."""
        entry = self.entries.get(model if isinstance(model, str) else getattr(model, "id", ""))
        if entry is None or (isinstance(model, ChatModel) and model is not entry.model):
            return model
        ref = entry.model.ref
        if isinstance(model, ModelRef):
            ref.parameters.update(copy.deepcopy(model.parameters))
        return ref

    def for_call(
        self, model: ChatModel | str | ModelRef, parameters: dict[str, Any] | None
    ) -> tuple[ChatModel, dict[str, Any] | None]:
        """The model one call goes to (``resolve``) and the call's own request parameters: a
        ModelRef's ``parameters`` (on_model_call's ``current_model``, a snapshot a middleware may
        have edited) under the call's ``parameters``, both over the model's configured ones, for this
        call only. A key can be changed or added that way, not removed."""
        resolved = self.resolve(model)
        if isinstance(model, ModelRef) and model.parameters:
            parameters = {**model.parameters, **(parameters or {})}
        if parameters:
            check_call_parameters(parameters, resolved.parameters)
        return resolved, parameters

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelRegistry:
        """``{"default": id, "models": {id: {"provider": ..., "max_retries": n, "fallback": [...],
        "retry": {"initial_delay": s, "max_delay": s, "deadline": s}, ...}}}``

        The remaining keys of a model go to its constructor: ``model_name``, ``base_url``, ``api_key``
        (or ``api_key_env`` / ``api_key_file``, read here), ``parameters`` (sent with every request,
        e.g. ``temperature``), ``stream``, ``timeout``, ... Every value is checked against the
        constructor's type hints (``_expected``). Each model names its provider."""
        default = config.get("default")
        if default is not None and not isinstance(default, str):  # YAML reads `default: 1` as a number
            raise ValueError(f"default: expected a model id (a string), got {default!r}")
        registry = cls(default=default)
        for model_id, spec in (config.get("models") or {}).items():
            if not isinstance(model_id, str):  # ids are sorted and named in errors, and sent as strings
                raise ValueError(f"model id {model_id!r}: expected a string (quote it in YAML)")
            if not isinstance(spec, Mapping):
                raise ValueError(f"model {model_id!r}: expected a mapping of settings, got {spec!r}")
            spec = dict(spec)
            if "provider" not in spec:  # a network model's settings on the offline rule model answered for it
                raise ValueError(f"model {model_id!r}: no provider (one of: {', '.join(sorted(PROVIDERS))})")
            provider = spec.pop("provider")
            if not isinstance(provider, str) or provider not in PROVIDERS:
                raise ValueError(f"model {model_id!r}: unknown provider {provider!r} (known: {sorted(PROVIDERS)})")
            retries = spec.pop("max_retries", 0)
            _check(model_id, "max_retries", retries, int)
            fallback = spec.pop("fallback", None) or []
            _check(model_id, "fallback", fallback, list[str])
            if model_id in fallback:
                raise ValueError(f"model {model_id!r}: fallback: a model cannot fall back to itself")
            try:
                retry = RetryPolicy.from_config(spec.pop("retry", None))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"model {model_id!r}: {exc}") from None
            model_cls = PROVIDERS[provider]()
            known = _settings(model_cls)
            if "api_key" in known:
                known.update(dict.fromkeys(_KEY_SOURCES, str))
            unknown = sorted(set(spec) - set(known))
            if unknown:  # else a TypeError naming the constructor, not the setting
                raise ValueError(
                    f"model {model_id!r}: unknown key {unknown[0]!r} for provider {provider!r} "
                    f"(known: provider, max_retries, fallback, retry, {', '.join(known)})"
                )
            for key, value in spec.items():
                _check(model_id, key, value, known[key])
            _read_api_key(model_id, spec)
            registry.add(model_cls(id=model_id, **spec), max_retries=retries, fallback=fallback, retry=retry)
        for model_id, entry in registry.entries.items():
            for fb in entry.fallback:
                if fb not in registry.entries:
                    raise ValueError(f"model {model_id!r}: fallback {fb!r} is not a registered model id")
        return registry
