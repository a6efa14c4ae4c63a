"""The package as a user installs it: a wheel built from a clean copy of the sources, installed in a
fresh virtual environment, runs ``agent-host`` and serves a reply.

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
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

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


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("packaging")
    src = clean_copy(work / "src")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(work / "dist"), str(src)], work)
    (wheel,) = (work / "dist").glob("agentmw-*.whl")
    env = work / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(env)], work)
    python = env / "bin" / "python"
    site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], work).stdout.strip()
    Path(site, "agentmw_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)], work)
    return env


def test_wheel_installs_stubs_and_console_scripts(venv: Path, tmp_path: Path) -> None:
    probe = "import agent_host, agentmw.v1.host_pb2 as h, clients.admin; print(agent_host.__file__); print(h.__file__)"
    where = run([str(venv / "bin" / "python"), "-c", probe], tmp_path).stdout.split()
    assert all(Path(p).is_relative_to(venv) for p in where), f"imported from outside the new venv: {where}"
    for script in ("agent-host", "agent-chat", "agentmw", "agentmw-traces"):
        done = run([str(venv / "bin" / script), "--help"], tmp_path)
        assert done.stdout.startswith(f"usage: {script}"), done.stdout


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
