"""The host's built-in demo tools, enabled by name in the configuration (``tools: [...]``).

They are deterministic and offline, and between them show every way a tool can run: a plain
read-only tool, a computation, one that needs the user's confirmation (docs/behaviour.md#hitl) and one
that the client executes (docs/behaviour.md#external-execution).
"""

from __future__ import annotations

import hashlib

from agentmw.tools import Tool, tool

_SKIES = ("sunny", "cloudy", "light rain", "windy", "clear", "foggy")


@tool(description="Current weather for a city.", is_read_only=True, is_concurrency_safe=True)
def get_weather(city: str) -> str:
    # Canned but stable: the same city always gets the same weather.
    digest = hashlib.sha256(city.strip().lower().encode()).digest()
    return f"{_SKIES[digest[0] % len(_SKIES)]}, {digest[1] % 30 + 2} °C in {city.strip()}"


@tool(description="Add two numbers.", is_read_only=True, is_concurrency_safe=True)
def add(a: float, b: float) -> str:
    total = a + b
    return str(int(total) if float(total).is_integer() else total)


@tool(description="Send an email. The user must confirm every email before it is sent.", needs_confirmation=True)
def send_email(to: str, body: str) -> str:
    return f"email to {to} sent ({len(body)} characters)"


@tool(
    description="Look up an order in the shop's system. Runs in the client, not in the host.",
    is_external_tool=True,
    is_read_only=True,
)
def lookup_order(order_id: str) -> str:
    raise RuntimeError("lookup_order is external: the client executes it")  # never called by the host


BUILTIN_TOOLS: dict[str, Tool] = {t.name: t for t in (get_weather, add, send_email, lookup_order)}

__all__ = ["BUILTIN_TOOLS"]
