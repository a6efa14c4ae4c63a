"""ModelRegistry: models by id, each with optional retries and fallback ids (docs/behaviour.md#reasoning)."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentmw.data import ModelRef
from agentmw.errors import UnknownModelError  # re-exported: the registry raises it

from .base import ChatModel
from .retry import RetryPolicy


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


def _settings(model_cls: type[ChatModel]) -> list[str]:
    """The keyword settings a model class takes, its bases' included (a ``**kw`` passes them on)."""
    names: list[str] = []
    for cls in model_cls.__mro__:
        init = cls.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        names += [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.name != "id" and p.name not in names]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return names


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
        return resolved, parameters

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelRegistry:
        """``{"default": id, "models": {id: {"provider": ..., "max_retries": n, "fallback": [...],
        "retry": {"initial_delay": s, "max_delay": s, "deadline": s}, ...}}}``

        The remaining keys of a model go to its constructor: ``model_name``, ``base_url``, ``api_key``,
        ``parameters`` (sent with every request, e.g. ``temperature``), ``stream``, ``timeout``, ...
        The provider defaults to "offline"."""
        registry = cls(default=config.get("default"))
        for model_id, spec in (config.get("models") or {}).items():
            spec = dict(spec)
            provider = spec.pop("provider", "offline")
            if provider not in PROVIDERS:
                raise ValueError(f"model {model_id!r}: unknown provider {provider!r} (known: {sorted(PROVIDERS)})")
            retries = int(spec.pop("max_retries", 0))
            fallback = list(spec.pop("fallback", []) or [])
            try:
                retry = RetryPolicy.from_config(spec.pop("retry", None))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"model {model_id!r}: {exc}") from None
            model_cls = PROVIDERS[provider]()
            known = _settings(model_cls)
            unknown = sorted(set(spec) - set(known))
            if unknown:  # else a TypeError naming the constructor, not the setting
                raise ValueError(
                    f"model {model_id!r}: unknown key {unknown[0]!r} for provider {provider!r} "
                    f"(known: provider, max_retries, fallback, retry, {', '.join(known)})"
                )
            registry.add(model_cls(id=model_id, **spec), max_retries=retries, fallback=fallback, retry=retry)
        for model_id, entry in registry.entries.items():
            for fb in entry.fallback:
                if fb not in registry.entries:
                    raise ValueError(f"model {model_id!r}: fallback {fb!r} is not a registered model id")
        return registry
