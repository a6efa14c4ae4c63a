"""Runtime-state injection: tell the model the current time, as AgentScope's default
``inject_runtime_state`` does (docs/behaviour.md#runtime-state).

Before each reasoning step the agent asks ``RuntimeState.hint``: when the context records no time
yet (the session's first reply, or the hint was compressed away) or the recorded one is older than
``time_interval`` hours, it answers a HintBlock with the time and the timezone, which the agent
appends to the reply's message (so it persists, and the model can tell how time passes) and
announces with a HintBlockEvent. The text and format are AgentScope's. Only the time dimension is
implemented: AgentScope also injects plan tasks, context length and repeated tool errors.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, tzinfo
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from agentmw.data import HintBlock, Msg, Role, TextBlock

TEMPLATE = (
    "<system-reminder>Treat the following as the ground truth at this point of the conversation. "
    "Anything stated earlier is outdated, and a later reminder, if any, supersedes this one:\n"
    "{runtime_state}\n</system-reminder>"
)
SOURCE = '{"label": "System", "sublabel": "Runtime State"}'

_TIME = re.compile(r"<current-time>(.*?)</current-time>")
_ZONE = re.compile(r"<timezone>(.*?)</timezone>")


def _utc_now() -> datetime:
    return datetime.now(UTC)


def resolve_timezone(name: str) -> tzinfo:
    """A timezone database name ("UTC", "Asia/Shanghai"); ValueError when unknown."""
    if name.upper() == "UTC":
        return UTC
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown timezone {name!r}") from None


@dataclass(slots=True, kw_only=True)
class RuntimeState:
    """What to inject and when. ``clock`` returns an aware datetime (tests pass a fixed one)."""

    timezone: str = "UTC"
    time_format: str = "%Y-%m-%dT%H:%M:%S"
    time_interval: float = 0.5  # hours: a recorded time older than this is injected again
    template: str = TEMPLATE
    source: str = SOURCE
    emit_hint_event: bool = True
    clock: Callable[[], datetime] = field(default=_utc_now)

    def __post_init__(self) -> None:
        resolve_timezone(self.timezone)  # fail at configuration, not in a reply
        if "{runtime_state}" not in self.template:
            raise ValueError("the runtime-state template must contain '{runtime_state}'")

    def hint(self, context: list[Msg]) -> HintBlock | None:
        """The hint to append before the next reasoning step, or None when the context is current."""
        now = self.clock().astimezone(resolve_timezone(self.timezone))
        recorded = self._recorded_time(context)
        if recorded is not None and 0 <= (now - recorded).total_seconds() / 3600 <= self.time_interval:
            return None  # (a recorded time in the future, e.g. the clock went back: injected again)
        fields = {"current-time": now.strftime(self.time_format), "timezone": self.timezone}
        state = "\n".join(f"<{k}>{v}</{k}>" for k, v in fields.items())
        return HintBlock(hint=self.template.replace("{runtime_state}", state), source=self.source)

    def _recorded_time(self, context: list[Msg]) -> datetime | None:
        """The time of the newest injected hint that records one (None: none, or unreadable)."""
        for msg in reversed(context):
            if msg.role != Role.ASSISTANT:
                continue
            for block in reversed(msg.content):
                if block.type != "hint" or block.source != self.source:
                    continue
                text = (
                    block.hint
                    if isinstance(block.hint, str)
                    else "".join(b.text for b in block.hint if isinstance(b, TextBlock))
                )
                match = _TIME.search(text)
                if match is None:
                    continue
                try:
                    when = datetime.strptime(match.group(1).strip(), self.time_format)
                except ValueError:  # e.g. the format changed: inject again
                    return None
                if when.tzinfo is None:  # wall-clock time of the timezone recorded beside it
                    zone = _ZONE.search(text)
                    try:
                        when = when.replace(tzinfo=resolve_timezone(zone.group(1).strip() if zone else self.timezone))
                    except ValueError:
                        return None
                return when
        return None


__all__ = ["SOURCE", "TEMPLATE", "RuntimeState", "resolve_timezone"]
