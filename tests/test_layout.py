"""The code's layout: no import cycles among our modules.

A cycle (a imports b, which imports a) works only by the order modules happen to load in, and it
hides behind function-local imports: every import is counted here, wherever it is, except those
under ``if TYPE_CHECKING:`` (annotations only, never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

from clients.launch import ROOT

PACKAGES = ("agentmw", "agent_host", "clients", "mw_servers")
GENERATED = ROOT / "agentmw" / "v1"  # protoc's stubs


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, whether it is a package's __init__)."""
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path.is_relative_to(GENERATED):
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def _imports(name: str, path: Path, is_package: bool, modules: dict) -> set[str]:
    """Our modules that ``name`` imports when it runs (not under TYPE_CHECKING)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                targets = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = name.split(".")[: len(name.split(".")) - child.level + (1 if is_package else 0)]
                    module = ".".join(base + ([child.module] if child.module else []))
                else:
                    module = child.module or ""
                # ``from pkg import mod`` imports the module pkg.mod; ``from mod import name``, mod
                targets = [module] + [f"{module}.{alias.name}" for alias in child.names]
            else:
                visit(child)
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    found.add(target)

    visit(ast.parse(path.read_text()))
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                cycles.append(sorted([v, *component]))

    for v in graph:
        if v not in index:
            strong(v)
    return cycles


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, is_package, modules) for name, (path, is_package) in modules.items()}
    assert "agent_host.remote.protocol" in graph["agent_host.remote.client"]  # the walk sees imports
    assert _cycles(graph) == []


def test_the_mem0_backend_loads_alone() -> None:
    """bench/agentscope_four.py loads mw_servers/mem0/backend.py by itself in AgentScope's own
    environment, where agentmw is not installed: the module imports the standard library only
    (here: a Python without site-packages). An import of agentmw in it broke that bench row."""
    import subprocess
    import sys

    path = ROOT / "mw_servers" / "mem0" / "backend.py"
    code = (
        "import importlib.util, pathlib, sys; "
        f"spec = importlib.util.spec_from_file_location('backend', {str(path)!r}); "
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
        "print(module.default_config(pathlib.Path('/nonexistent'))['vector_store']['provider'])"
    )
    done = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "qdrant"
