"""Fixtures shared by the test modules."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from clients.launch import ServerProcess
from tests.host_util import Procs, processes
from tests.model_servers import ScriptedServer


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    """A local model wire server (OpenAI- and DashScope-style), stopped after the test."""
    with ScriptedServer() as s:
        yield s


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One host process with the embedded defaults for a test module (each test uses sessions of
    its own); a module that needs another configuration defines its own ``host``."""
    logs = tmp_path_factory.mktemp("host")
    with processes(logs) as procs:
        yield procs.host(logs / "sessions.db")


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    """Processes a test starts (logs in its tmp_path), every one stopped when it ends."""
    with processes(tmp_path) as p:
        yield p
