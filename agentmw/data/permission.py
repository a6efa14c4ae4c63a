"""PermissionDecision: what ``on_check_permission`` returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .blocks import PermissionRule
from .enums import PermissionBehavior


@dataclass(slots=True, kw_only=True)
class PermissionDecision:
    behavior: PermissionBehavior
    message: str = ""
    decision_reason: str | None = None
    updated_input: dict[str, Any] | None = None
    suggested_rules: list[PermissionRule] = field(default_factory=list)
    bypass_immune: bool = False
