"""Fixtures shared by the test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.model_servers import ScriptedServer


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    """A local model wire server (OpenAI- and DashScope-style), stopped after the test."""
    with ScriptedServer() as s:
        yield s
