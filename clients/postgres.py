"""A throwaway PostgreSQL cluster on a loopback port, for the tests and the bench (many hosts on one
session store): ``initdb`` into a temporary directory, ``pg_ctl start``, and at the end stop it and
remove everything. Run as the ``postgres`` user when started as root (the server refuses root).

``pg_bin()`` finds the server binaries ($AGENTMW_PG_BIN, /usr/lib/postgresql/*/bin, or PATH);
callers skip what needs a cluster when it returns None.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

ABSENT = "PostgreSQL server binaries (initdb, pg_ctl) not found: apt-get install postgresql"


def pg_bin() -> Path | None:
    candidates: list[str | Path] = [
        os.environ.get("AGENTMW_PG_BIN", ""),
        *sorted(Path("/usr/lib/postgresql").glob("*/bin")),
    ]
    for candidate in candidates:
        if candidate and (Path(candidate) / "initdb").exists() and (Path(candidate) / "pg_ctl").exists():
            return Path(candidate)
    found = shutil.which("initdb")
    return Path(found).parent if found and shutil.which("pg_ctl") else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def throwaway_cluster(bindir: Path) -> Iterator[str]:
    """A running cluster (no fsync: nothing of it is kept); yields the DSN of its ``postgres``
    database. Raises RuntimeError saying why it cannot start."""
    root = Path(tempfile.mkdtemp(prefix="agentmw-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:  # the server refuses to run as root
        user = pwd.getpwnam("postgres")
        os.chown(root, user.pw_uid, user.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    data, port = root / "data", _free_port()

    def run(*argv: str) -> None:
        subprocess.run([*as_user, *argv], check=True, capture_output=True, timeout=60)

    try:
        run(str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync")
        options = f"-c listen_addresses=127.0.0.1 -p {port} -k {root} -c fsync=off -c max_connections=200"
        run(str(bindir / "pg_ctl"), "-D", str(data), "-l", str(root / "server.log"), "-o", options, "-w", "start")
    except subprocess.CalledProcessError as exc:
        shutil.rmtree(root, ignore_errors=True)
        raise RuntimeError(f"cannot start PostgreSQL: {exc.stderr.decode(errors='replace')}") from None
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            run(str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


async def create_database(dsn: str, name: str) -> str:
    """A new, empty database on the cluster of ``dsn``; its DSN."""
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f"CREATE DATABASE {name}")
    finally:
        await conn.close()
    return dsn.rsplit("/", 1)[0] + "/" + name


__all__ = ["ABSENT", "create_database", "pg_bin", "throwaway_cluster"]
