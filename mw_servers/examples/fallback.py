"""ModelFallbackMiddleware: when the model call fails, try it again on another registered model.

``current_model`` overrides are model ids of the host's registry, so ``fallback`` names one
("model-b"). The failure it sees is any error before the first chunk (HTTP errors, connection
errors, a missing key). The chunks themselves bypass it: it costs one round trip per model call.

Each switch is counted in the session's slot (``agent.state.middle_context[key]``):
``{"switches": n, "to": "<fallback id>", "last_error": "..."}``.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from agentmw.sdk import MiddlewareBase, ModelCallKwargs, serve, subscribe

log = logging.getLogger("agentmw.examples.fallback")


class ModelFallbackMiddleware(MiddlewareBase):
    subscriptions = {"on_model_call": subscribe()}

    def __init__(self, fallback: str, key: str = "ModelFallbackMiddleware") -> None:
        self.fallback = fallback
        self.key = key

    async def get_middleware_key(self) -> str:
        return self.key

    async def on_model_call(self, agent: Any, input_kwargs: ModelCallKwargs, next_handler: Any) -> Any:
        try:
            return await next_handler()
        except Exception as exc:
            log.warning("primary model failed (%s); switching to %r", exc, self.fallback)
            stats = agent.state.middle_context.get(self.key) or {}
            switches = stats.get("switches", 0) + 1
            agent.state.middle_context[self.key] = {"switches": switches, "to": self.fallback, "last_error": str(exc)}
            return await next_handler(current_model=self.fallback)


if __name__ == "__main__":
    serve(
        ModelFallbackMiddleware(sys.argv[2] if len(sys.argv) > 2 else "model-b"),
        sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50074",
    )
