"""References that stand in for live objects on the wire."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, kw_only=True)
class ModelRef:
    """A model in the host's registry, referred to by ``id`` (never carries a secret)."""

    id: str
    provider: str = ""
    model_name: str = ""
    base_url: str = ""
    stream: bool = True
    context_size: int = 0
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True, kw_only=True)
class ContextConfig:
    trigger_ratio: float = 0.8
    reserve_ratio: float = 0.1
    context_buffer_ratio: float = 0.2
    tool_result_limit: int = 50000
    compression_fallback_to_truncation: bool = True
