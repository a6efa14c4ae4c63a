"""One chain mechanism for every hook position, in-process and remote layers alike.

A layer is anything with the hook's method, ``hook(agent=, input_kwargs=, next_handler=)`` for
onions and ``hook(agent, prompt)`` for the transformer: an in-process ``MiddlewareBase`` or a
``RemoteMiddleware`` proxy. The first layer is outermost. ``next_handler(**overrides)`` merges
the overrides over the kwargs dict the layer received (as it is at call time, so in-place edits
count) and runs the rest of the chain anew each time it is called. Every layer and the core get
every parameter of the hook: one not passed, or deleted from ``input_kwargs``, is None (cleared),
as a remote layer gets it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from .hooks import HOOKS, HookSpec, Kind, check_next_kwargs, check_result


class Layer(Protocol):
    """What a chain calls on a layer, one method per hook position (hooks.py): ``MiddlewareBase``
    (middleware.py, its hooks typed per position) and ``RemoteMiddleware`` (remote/client.py) both
    are one. A stream hook returns an async iterator: usually an async generator, but any will do
    (whoever stops reading one early closes it with ``close``, which needs no ``aclose``)."""

    def implements(self, hook: str) -> bool: ...  # whether it takes part in this hook position

    def on_reply(self, agent: Any, input_kwargs: Any, next_handler: Any) -> Any: ...

    def on_reasoning(self, agent: Any, input_kwargs: Any, next_handler: Any) -> Any: ...

    def on_acting(self, agent: Any, input_kwargs: Any, next_handler: Any) -> Any: ...

    def on_check_permission(self, agent: Any, input_kwargs: Any, next_handler: Any) -> Any: ...

    def on_model_call(self, agent: Any, input_kwargs: Any, next_handler: Any) -> Any: ...

    def on_compress_context(self, agent: Any, input_kwargs: Any, next_handler: Any) -> Any: ...

    def on_system_prompt(self, agent: Any, prompt: str) -> Any: ...

    async def list_tools(self) -> list[Any]: ...


class Chain:
    def __init__(
        self,
        hook: str,
        layers: Sequence[Layer],
        core: Callable[..., Any],
        adapt: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]] | None = None,
    ) -> None:
        self.spec: HookSpec = HOOKS[hook]
        self.layers = list(layers)
        self.core = core
        self.unset: dict[str, Any] = dict.fromkeys(sorted(self.spec.params))  # every parameter, None
        # ``adapt(kwargs, received)``: what a layer's next_handler passes inward, given what that
        # layer received: the agent's own form of a changed kwarg (on_model_call's current_model).
        self.adapt = adapt

    def __call__(self, agent: Any, **params: Any) -> Any:
        """Run the chain: returns what the outermost layer returns (generator, awaitable)."""
        if not self.layers:  # no middleware: the core, with no wrapping at all
            return self.core(**params)
        return self._run(agent, 0, params)

    def _run(self, agent: Any, index: int, params: dict[str, Any]) -> Any:
        if len(params) < len(self.unset):  # one not passed or deleted: None (a length check per call)
            params = {**self.unset, **params}
        if index == len(self.layers):
            return self.core(**params)
        input_kwargs = dict(params)
        spec = self.spec

        def next_handler(**overrides: Any) -> Any:
            check_next_kwargs(spec, overrides, input_kwargs)
            inner = {**input_kwargs, **overrides}
            return self._run(agent, index + 1, inner if self.adapt is None else self.adapt(inner, params))

        method = getattr(self.layers[index], spec.name)
        result = method(agent=agent, input_kwargs=input_kwargs, next_handler=next_handler)
        return _checked(spec, result) if spec.kind is Kind.CALL else result


async def _checked(spec: HookSpec, result: Any) -> Any:
    return check_result(spec, await result)


async def transform(hook: str, layers: Sequence[Layer], agent: Any, value: Any) -> Any:
    """The transformer pipeline (on_system_prompt): each layer gets the previous one's output."""
    spec = HOOKS[hook]
    for layer in layers:
        value = check_result(spec, await getattr(layer, hook)(agent, value))
    return value


async def prepend(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """``first`` (unless None), then the rest: a stream whose first item was fetched early, as
    on_model_call's ``next_handler()`` does so that call-time errors raise at the call."""
    try:
        if first is not None:
            yield first
        async for item in rest:
            yield item
    finally:
        await close(rest)


async def close(stream: Any) -> None:
    """Close a layer's stream left half-read. A layer's hook is usually an async generator, but
    may return any async iterator (``return Wrapped(next_handler())``), which has no aclose."""
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


class closing:  # named as contextlib.aclosing, whose place it takes
    """``contextlib.aclosing`` for any layer's stream (see ``close``). A class, not an
    asynccontextmanager generator: it wraps every chain call of every reply."""

    __slots__ = ("stream",)

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    async def __aenter__(self) -> Any:
        return self.stream

    async def __aexit__(self, *exc: object) -> None:
        await close(self.stream)
