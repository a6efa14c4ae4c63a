"""The packages as users install them: wheels built from a clean copy of the sources, installed in
fresh virtual environments. The host's (``agentmw``, with the core ``agentmw-sdk`` it depends on)
runs ``agent-host`` and serves a reply; the SDK's (``agentmw-sdk``) alone, beside nothing but its
declared dependencies, serves a middleware that a real host's reply goes through.

How (and what is not real): the sources are copied without anything generated (as a fresh clone
has them: no agentmw/v1 stubs), and ``pip wheel --no-deps`` builds them with build isolation, as
``pip install .`` does. The new venv gets the wheel itself with ``--no-deps``; its *dependencies*
come from the project venv through a ``.pth`` line naming that venv's site-packages (installing
them from the local pip cache takes minutes; this takes seconds). So this test proves that the wheel
carries everything of ours (stubs, packages, console scripts) and that the installed code runs
without the source tree; it does not prove the dependency pins resolve (``make install`` and
``pip check`` do). The editable install of the project venv cannot leak in: a ``.pth`` file
is only read in a site directory, not in a directory another ``.pth`` adds, and every command
runs from a scratch directory.

The SDK's venv sees less: its ``.pth`` names a directory holding only the installed files of the
distributions its wheel's Requires-Dist reach (followed transitively through the project venv's
metadata), linked from the project venv; so the host, its model clients and the repository cannot
be imported there, and ``pip check`` in it proves the declared closure complete.
"""

from __future__ import annotations

import email
import importlib.metadata
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from clients.launch import ROOT, ServerProcess

pytestmark = pytest.mark.timeout(240)


def run(argv: list[str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, (
        f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done


def clean_copy(dest: Path) -> Path:
    """The files git knows of (tracked, or new and not ignored), as they are in the work tree."""
    listed = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], ROOT).stdout
    for name in filter(None, listed.split("\0")):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    assert not (dest / "agentmw" / "v1").exists(), "the copy must not hold generated stubs"
    return dest


# What the core imports, and nothing of the host's (dashscope, openai, asyncpg, prometheus-client, ...).
SDK_REQUIRES = {
    "grpcio",
    "grpcio-health-checking",
    "grpcio-reflection",
    "protobuf",
    "jsonschema",
    "referencing",
    "opentelemetry-api",
}


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Both distributions' wheels, built by one ``pip wheel`` (the root is the host's, sdk/ the core's)."""
    work = tmp_path_factory.mktemp("wheels")
    src = clean_copy(work / "src")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(work), str(src), str(src / "sdk")], work)
    (host,) = work.glob("agentmw-*.whl")
    (sdk,) = work.glob("agentmw_sdk-*.whl")
    return {"host": host, "sdk": sdk}


def new_venv(where: Path, deps_dir: str, *wheels: Path) -> Path:
    """A venv holding ``wheels`` (without their dependencies) that imports those from ``deps_dir``."""
    run([sys.executable, "-m", "venv", "--without-pip", str(where)], where.parent)
    python = where / "bin" / "python"
    site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], where.parent)
    Path(site.stdout.strip(), "agentmw_test_deps.pth").write_text(deps_dir + "\n")
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", *map(str, wheels)], where)
    return where


@pytest.fixture(scope="module")
def venv(wheels: dict[str, Path]) -> Path:
    return new_venv(wheels["host"].parent / "venv", sysconfig.get_paths()["purelib"], wheels["host"], wheels["sdk"])


def requires(metadata: importlib.metadata.PackageMetadata | email.message.Message) -> list[str]:
    """The distributions a distribution needs (no extras), from its Requires-Dist."""
    out = []
    for line in metadata.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.append(req.name)
    return out


def link_closure(names: list[str], dest: Path) -> set[str]:
    """Link into ``dest`` the installed files (code and metadata) of ``names`` and of everything they
    require, as the project venv has them; returns the distributions' names."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        dist = importlib.metadata.distribution(todo.pop())
        name = dist.metadata["Name"].lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        todo += requires(dist.metadata)
        base = Path(dist.locate_file("")).resolve()
        for file in dist.files or []:
            path = Path(dist.locate_file(file)).resolve()
            if path.is_relative_to(base) and path.is_file():  # not the scripts in ../../bin
                (dest / path.relative_to(base)).parent.mkdir(parents=True, exist_ok=True)
                (dest / path.relative_to(base)).symlink_to(path)
    return seen


@pytest.fixture(scope="module")
def sdk_venv(wheels: dict[str, Path]) -> Path:
    """The SDK's wheel alone; its dependencies, and only those, from the project venv."""
    with zipfile.ZipFile(wheels["sdk"]) as wheel:
        (meta,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
        declared = requires(email.message_from_bytes(wheel.read(meta)))
    assert set(declared) == SDK_REQUIRES, f"agentmw-sdk must need only the core's dependencies: {declared}"
    deps = wheels["sdk"].parent / "sdk-deps"
    closure = link_closure(declared, deps)
    assert not closure & {"agentmw", "agentmw-sdk", "dashscope", "openai", "asyncpg", "prometheus-client", "pyyaml"}
    return new_venv(wheels["sdk"].parent / "sdk-venv", str(deps), wheels["sdk"])


def test_each_package_is_in_one_distribution(wheels: dict[str, Path]) -> None:
    """The core only in the SDK's wheel, the host's packages only in the host's: no module twice."""
    tops = {}
    for which, path in wheels.items():
        with zipfile.ZipFile(path) as wheel:
            tops[which] = {n.split("/")[0] for n in wheel.namelist() if ".dist-info/" not in n}
    assert tops == {"sdk": {"agentmw"}, "host": {"agent_host", "mw_servers", "clients"}}


def test_wheel_installs_stubs_and_console_scripts(venv: Path, tmp_path: Path) -> None:
    probe = "import agent_host, agentmw.v1.host_pb2 as h, clients.admin; print(agent_host.__file__); print(h.__file__)"
    where = run([str(venv / "bin" / "python"), "-c", probe], tmp_path).stdout.split()
    assert all(Path(p).is_relative_to(venv) for p in where), f"imported from outside the new venv: {where}"
    for script in ("agent-host", "agent-chat", "agentmw", "agentmw-traces"):
        done = run([str(venv / "bin" / script), "--help"], tmp_path)
        assert done.stdout.startswith(f"usage: {script}"), done.stdout
    # mw_servers.sdk: the alias of agentmw.sdk that the full install keeps (docs/packaging.md)
    alias = "import agentmw.sdk as sdk, mw_servers.sdk as alias; assert alias.serve is sdk.serve"
    run([str(venv / "bin" / "python"), "-c", alias], tmp_path)
    done = run([str(venv / "bin" / "python"), "-m", "mw_servers.sdk", "--help"], tmp_path)
    assert done.stdout.startswith("usage: python -m agentmw.sdk"), done.stdout


def test_installed_host_serves_a_reply(venv: Path, tmp_path: Path) -> None:
    host = ServerProcess(
        ["--listen", "127.0.0.1:0", "--db", str(tmp_path / "s.db")],
        executable=str(venv / "bin" / "agent-host"),
        name="installed-host",
        log_dir=tmp_path,
        startup=30,
    ).start()
    try:
        done = run([str(venv / "bin" / "agent-chat"), "--host", host.address, "-m", "hello"], tmp_path, timeout=30)
        assert done.stdout.strip() == "You said: hello"
        status = run([str(venv / "bin" / "agentmw"), "--host", host.address, "status"], tmp_path, timeout=30)
        assert status.stdout.startswith(f"host {host.address}: SERVING")
    finally:
        host.stop()


# Serves itself from the SDK's venv; refuses to start if the host could be imported beside it.
SDK_ONLY_MIDDLEWARE = """
import importlib.util
import sys

from agentmw.sdk import ChatResponse, MiddlewareBase, TextBlock, serve

for name in ("agent_host", "mw_servers", "clients", "dashscope", "openai", "yaml"):
    if importlib.util.find_spec(name) is not None:
        sys.exit(f"{name} is importable beside the SDK alone")


class Answer(MiddlewareBase):
    async def on_model_call(self, agent, input_kwargs, next_handler):
        return ChatResponse(content=[TextBlock(text="answered by a middleware on the SDK alone")])


serve(Answer(), sys.argv[1])
"""


def test_sdk_alone_serves_a_middleware_a_host_reply_goes_through(sdk_venv: Path, tmp_path: Path) -> None:
    python = str(sdk_venv / "bin" / "python")
    imports = run([python, "-c", "import agentmw.sdk, agentmw.v1.hooks_pb2_grpc as g; print(g.__file__)"], tmp_path)
    assert Path(imports.stdout.strip()).is_relative_to(sdk_venv), imports.stdout
    for name in ("agent_host", "mw_servers", "clients"):
        done = subprocess.run([python, "-c", f"import {name}"], cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode != 0 and "ModuleNotFoundError" in done.stderr, f"{name} importable: {done}"
    run([sys.executable, "-m", "pip", "--python", python, "check"], tmp_path)  # the declared closure is complete
    script = tmp_path / "answer_mw.py"
    script.write_text(textwrap.dedent(SDK_ONLY_MIDDLEWARE))
    # A script, not -m: its directory, not the repository (the launcher's cwd), is on sys.path.
    mw = ServerProcess(
        [str(script), "127.0.0.1:0"],
        executable=python,
        name="sdk-only-mw",
        env={"PYTHONPATH": ""},
        log_dir=tmp_path,
    ).start()
    host = None
    try:
        host = ServerProcess(
            ["-m", "agent_host", "--listen", "127.0.0.1:0", "--db", ":memory:", "--middleware", f"answer={mw.address}"],
            name="host",
            log_dir=tmp_path,
        ).start()
        done = run([sys.executable, "-m", "clients.chat", "--host", host.address, "-m", "hello"], tmp_path, timeout=30)
        assert done.stdout.strip() == "answered by a middleware on the SDK alone"
    finally:
        if host is not None:
            host.stop()
        mw.stop()
