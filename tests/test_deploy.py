"""The deployment files against what the repository builds: the Kubernetes manifests in deploy/k8s
(parsed with PyYAML) name images the Dockerfile builds at the package's version, run commands that
exist (console scripts, modules, middleware classes), and agree on ports, probes, Services, the
session volume and the host configuration (loaded by the host's own config loader), and every
host's termination grace covers its drain. The several hosts of deploy/k8s/multi-host share one
PostgreSQL: their DSN comes from a Secret that names the in-cluster database's Service, user and
password.

No cluster and no Docker here: this checks the files are consistent, not that a cluster runs them.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import re
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from agent_host.cli import parse_args
from agent_host.config import HostConfig, load_config
from agent_host.service.host import Host
from agent_host.store.postgres import is_dsn
from agentmw.middleware import MiddlewareBase
from clients import admin
from clients.launch import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
SCRIPTS = PYPROJECT["project"]["scripts"]


def dockerfile_stages() -> dict[str, dict[str, Any]]:
    """Per stage (FROM ... AS name): its image title label, EXPOSEd ports, ENTRYPOINT and CMD."""
    stages: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] = {}
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        word, _, rest = line.strip().partition(" ")
        if word == "FROM":
            base, name = re.fullmatch(r"(\S+) AS (\S+)", rest).groups()  # type: ignore[union-attr]
            inherited = stages.get(base, {})
            current = stages[name] = {"title": None, "ports": set(inherited.get("ports", ())), "entrypoint": None}
            current.update({k: inherited[k] for k in ("entrypoint", "cmd") if k in inherited})
        elif word == "LABEL" and (m := re.search(r'org\.opencontainers\.image\.title="([^"]+)"', rest)):
            current["title"] = m.group(1)
        elif word == "EXPOSE":
            current["ports"] |= {int(p) for p in rest.split()}
        elif word in ("ENTRYPOINT", "CMD"):
            current[word.lower()] = json.loads(rest)
    return stages


def manifests(*parts: str) -> list[dict[str, Any]]:
    docs = []
    for path in sorted(ROOT.joinpath("deploy", "k8s", *parts).glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


STAGES = dockerfile_stages()
IMAGES = {s["title"]: s for s in STAGES.values() if s["title"]}
# deploy/k8s: one host on SQLite with the middleware; multi-host/: several hosts and PostgreSQL,
# applied with the same namespace and middleware (their names do not clash with the single host's).
DOCS = manifests() + manifests("multi-host")
WORKLOADS = [d for d in DOCS if d["kind"] in ("Deployment", "StatefulSet")]
SERVICES = {(d["metadata"]["namespace"], d["metadata"]["name"]): d for d in DOCS if d["kind"] == "Service"}
NAMES = [(d["kind"], d["metadata"]["namespace"], d["metadata"]["name"]) for d in DOCS if d["kind"] != "Namespace"]
THIRD_PARTY = {"postgres"}  # images not built here (the in-cluster database of multi-host/postgres.yaml)
ALL_CONTAINERS = [(w, c) for w in WORKLOADS for c in w["spec"]["template"]["spec"]["containers"]]
CONTAINERS = [(w, c) for w, c in ALL_CONTAINERS if c["image"].partition(":")[0] not in THIRD_PARTY]


def workload(name: str) -> dict[str, Any]:
    (found,) = [w for w in WORKLOADS if w["metadata"]["name"] == name]
    return found


def named(kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def host_config(host: dict[str, Any], tmp_path: Path, env: dict[str, str] | None = None) -> HostConfig:
    """The host workload's host.yaml (its ConfigMap, where --config points), loaded by the host's
    own loader with ``env``: every key known and valid."""
    (container,) = host["spec"]["template"]["spec"]["containers"]
    config_path = PurePosixPath(container["args"][container["args"].index("--config") + 1])
    mount = next(m for m in container["volumeMounts"] if PurePosixPath(m["mountPath"]) == config_path.parent)
    volume = next(v for v in host["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    config_map = named("ConfigMap", volume["configMap"]["name"])
    path = tmp_path / config_path.name
    path.write_text(config_map["data"][config_path.name])
    return load_config(path, env=env or {})


def secret_value(namespace: str, ref: dict[str, str]) -> str:
    secret = named("Secret", ref["name"])
    assert secret["metadata"]["namespace"] == namespace
    return secret["stringData"][ref["key"]]


def test_names_are_unique() -> None:
    assert len(NAMES) == len(set(NAMES)), "the single-host and multi-host files must not clash"


def test_manifests_found() -> None:
    assert {"host", "middleware"} <= set(STAGES)
    assert {"agentmw-host", "agentmw-middleware"} == set(IMAGES)
    assert any(w["kind"] == "StatefulSet" for w in WORKLOADS) and any(w["kind"] == "Deployment" for w in WORKLOADS)


@pytest.mark.parametrize(("workload", "container"), CONTAINERS, ids=[w["metadata"]["name"] for w, _ in CONTAINERS])
def test_container_runs_what_the_image_has(workload: dict[str, Any], container: dict[str, Any]) -> None:
    name, _, tag = container["image"].partition(":")
    assert name in IMAGES, f"{container['image']}: no Dockerfile stage labels that image (have {sorted(IMAGES)})"
    assert tag == VERSION, f"{container['image']}: the package is version {VERSION}"
    stage = IMAGES[name]
    command, args = container["command"], container.get("args", [])
    assert command == stage["entrypoint"], "the manifest's command differs from the image's ENTRYPOINT"
    if command[0] in SCRIPTS:  # a console script of the package
        assert command[0] == "agent-host"
        parse_args(args)  # its flags are the CLI's
    else:
        assert command[:2] == ["python", "-m"], command
        assert importlib.util.find_spec(command[2]) is not None, f"no module {command[2]}"
        module, _, cls = args[0].partition(":")
        target = getattr(importlib.import_module(module), cls)
        assert issubclass(target, MiddlewareBase)
    ports = {p["containerPort"] for p in container["ports"]}
    assert ports <= stage["ports"], f"container ports {ports} not EXPOSEd by the image ({stage['ports']})"
    if "--address" in args:
        assert int(args[args.index("--address") + 1].rsplit(":", 1)[1]) in ports
    by_name = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("readinessProbe", "livenessProbe"):
        spec = container[probe]
        if "exec" in spec:  # the host's liveness: test_host_liveness_fails_only_when_it_does_not_answer
            continue
        check = spec.get("grpc") or spec.get("tcpSocket")
        assert check is not None and by_name.get(check["port"], check["port"]) in ports, f"{probe} port"
    assert "grpc" in container["readinessProbe"], "readiness is grpc.health.v1 (native gRPC probe)"


def test_installs_from_built_wheels_stay_offline() -> None:
    """An install from a directory of built wheels says --no-index, as the Dockerfile's do: with
    --find-links alone pip still asks the package index (docs/deploy.md said so, and an offline or
    air-gapped install failed, or quietly took another agentmw from the index). (test_packaging.py
    installs its wheel files by path, not these commands: by name, pip would take the project's own
    agentmw, which its venvs see, as already installed.)"""
    texts = {p.relative_to(ROOT): p.read_text() for p in (ROOT / "Dockerfile", ROOT / "README.md")}
    texts.update({p.relative_to(ROOT): p.read_text() for p in (ROOT / "docs").glob("*.md")})
    commands = [
        (str(name), cmd)
        for name, text in texts.items()
        for cmd in re.findall(r"pip install[^\n&#;]*", text.replace("\\\n", " "))
        if "--find-links" in cmd
    ]
    assert {name for name, _ in commands} >= {"Dockerfile", "docs/deploy.md", "docs/packaging.md"}, commands
    assert [c for c in commands if "--no-index" not in c[1]] == []


def test_images_default_commands_parse() -> None:
    parse_args(STAGES["host"]["cmd"])
    module, _, cls = STAGES["middleware"]["cmd"][0].partition(":")
    assert issubclass(getattr(importlib.import_module(module), cls), MiddlewareBase)


def test_every_middleware_is_behind_a_headless_service_with_grpc_probes() -> None:
    middleware = [(w, c) for w, c in CONTAINERS if c["command"][:3] == ["python", "-m", "agentmw.sdk"]]
    assert middleware
    for workload, container in middleware:
        assert workload["kind"] == "Deployment"
        labels = workload["spec"]["template"]["metadata"]["labels"]
        services = [s for s in SERVICES.values() if s["spec"]["selector"].items() <= labels.items()]
        assert len(services) == 1, f"{workload['metadata']['name']}: {len(services)} Services select it"
        assert services[0]["spec"].get("clusterIP") == "None", "headless, so the host sees every pod (round-robin)"
        assert "grpc" in container["livenessProbe"] and "grpc" in container["readinessProbe"]


def test_service_ports_reach_container_ports() -> None:
    for service in SERVICES.values():
        pods = [
            (w, c)
            for w, c in ALL_CONTAINERS
            if service["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert pods, f"Service {service['metadata']['name']} selects nothing"
        for port in service["spec"]["ports"]:
            for _w, c in pods:
                named = {p["name"]: p["containerPort"] for p in c["ports"]}
                target = port.get("targetPort", port["port"])
                assert target in named or target in named.values(), f"{service['metadata']['name']}: {target}"


def test_host_configuration_loads_and_agrees(tmp_path: Path) -> None:
    host = workload("agentmw-host")
    assert host["kind"] == "StatefulSet" and host["spec"]["replicas"] == 1, "one host per SQLite file"
    (container,) = host["spec"]["template"]["spec"]["containers"]
    config = host_config(host, tmp_path)
    check_middleware(config)

    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert int(config.listen.rsplit(":", 1)[1]) == ports["grpc"]
    assert config.listen.startswith("0.0.0.0:"), "reachable from other pods"
    assert config.metrics_port == ports["metrics"]
    sessions = next(m for m in container["volumeMounts"] if m["name"] == "sessions")
    assert PurePosixPath(config.db).parent == PurePosixPath(sessions["mountPath"])
    assert [t["metadata"]["name"] for t in host["spec"]["volumeClaimTemplates"]] == ["sessions"]


def check_middleware(config: HostConfig) -> None:
    """Each configured middleware address is a Service's DNS name, at one of its ports."""
    assert config.middleware
    for mw in config.middleware:
        m = re.fullmatch(r"dns:///([\w-]+)\.([\w-]+)\.svc\.cluster\.local:(\d+)", mw.address)
        assert m, f"{mw.name}: {mw.address} is not a Service's DNS name"
        service = SERVICES.get((m.group(2), m.group(1)))
        assert service is not None, f"{mw.name}: no Service {m.group(1)} in namespace {m.group(2)}"
        assert int(m.group(3)) in {p["port"] for p in service["spec"]["ports"]}


def test_several_hosts_share_one_postgresql_from_a_secret(tmp_path: Path) -> None:
    hosts = workload("agentmw-hosts")
    assert hosts["kind"] == "Deployment" and hosts["spec"]["replicas"] > 1
    namespace = hosts["metadata"]["namespace"]
    spec = hosts["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert not any(v.get("persistentVolumeClaim") for v in spec.get("volumes", [])), "stateless pods"
    assert "volumeClaimTemplates" not in hosts["spec"]

    # The DSN: only from a Secret, through the host's AGENTMW_DB (never in the ConfigMap).
    (db,) = [e for e in container["env"] if e["name"] == "AGENTMW_DB"]
    assert set(db) == {"name", "valueFrom"}, "AGENTMW_DB comes from a Secret, not a literal"
    dsn = secret_value(namespace, db["valueFrom"]["secretKeyRef"])
    assert is_dsn(dsn)
    assert not is_dsn(host_config(hosts, tmp_path).db), "no DSN (with its password) in the ConfigMap"
    config = host_config(hosts, tmp_path, env={"AGENTMW_DB": dsn})
    assert config.db == dsn, "the Secret's DSN is the store"
    check_middleware(config)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert int(config.listen.rsplit(":", 1)[1]) == ports["grpc"] and config.listen.startswith("0.0.0.0:")

    # The DSN reaches the in-cluster database of postgres.yaml with its user, password and database.
    url = urlsplit(dsn)
    m = re.fullmatch(r"([\w-]+)\.([\w-]+)\.svc\.cluster\.local", url.hostname or "")
    assert m and m.group(2) == namespace, f"{url.hostname}: not a Service of namespace {namespace}"
    service = SERVICES[namespace, m.group(1)]
    assert url.port in {p["port"] for p in service["spec"]["ports"]}
    postgres = next(w for w, _ in ALL_CONTAINERS if service["spec"]["selector"].items() <= _labels(w).items())
    assert postgres["kind"] == "StatefulSet" and postgres["spec"]["replicas"] == 1
    (pg,) = postgres["spec"]["template"]["spec"]["containers"]
    assert pg["image"].partition(":")[0] in THIRD_PARTY
    env = {e["name"]: e.get("value") or secret_value(namespace, e["valueFrom"]["secretKeyRef"]) for e in pg["env"]}
    assert (url.username, url.password, url.path.lstrip("/")) == (
        env["POSTGRES_USER"],
        env["POSTGRES_PASSWORD"],
        env["POSTGRES_DB"],
    ), "change the password in both Secrets together"
    assert any(p["containerPort"] == 5432 for p in pg["ports"]) and "readinessProbe" in pg
    mounts = {m["mountPath"]: m["name"] for m in pg["volumeMounts"]}
    assert PurePosixPath(env["PGDATA"]).parent.as_posix() in mounts, "the data directory is on the volume"
    assert {t["metadata"]["name"] for t in postgres["spec"]["volumeClaimTemplates"]} == set(mounts.values())


HOSTS = [w for w, c in CONTAINERS if c["command"] == ["agent-host"]]


@pytest.mark.parametrize("host", HOSTS, ids=[w["metadata"]["name"] for w in HOSTS])
def test_host_pods_drain_within_their_termination_grace(host: dict[str, Any], tmp_path: Path) -> None:
    """Every host's readiness is grpc.health.v1 (store, middleware, draining); Kubernetes' SIGKILL
    comes no sooner than the preStop pause (if any), the configured drain_grace and Host.close's
    wait plus the store's close. Before, the single host's grace (30 s) equalled its drain_grace
    (the default, 30 s): the kubelet killed it mid-drain, and no reply in flight was saved."""
    spec = host["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert "grpc" in container["readinessProbe"]
    pause = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", ["sleep", "0"])
    assert pause[0] == "sleep"
    config = host_config(host, tmp_path)
    close = inspect.signature(Host.close).parameters["timeout"].default
    assert spec["terminationGracePeriodSeconds"] >= float(pause[1]) + config.drain_grace + close + 5


@pytest.mark.parametrize("host", HOSTS, ids=[w["metadata"]["name"] for w in HOSTS])
def test_host_liveness_fails_only_when_it_does_not_answer(host: dict[str, Any]) -> None:
    """Liveness is `agentmw alive` on the host's gRPC port: any health answer, NOT_SERVING too (a
    middleware or database outage, a drain: readiness's business, not a reason to restart). It was
    a tcpSocket probe, which a frozen host passes (its kernel accepts the connection; the health
    check times out); a grpc probe would fail, and restart the host, on NOT_SERVING.
    tests/test_admin_cli.py runs the command against a NOT_SERVING and a frozen host."""
    (container,) = host["spec"]["template"]["spec"]["containers"]
    grpc_port = {p["name"]: p["containerPort"] for p in container["ports"]}["grpc"]
    liveness = container["livenessProbe"]
    command = liveness["exec"]["command"]
    assert command[0] in SCRIPTS and SCRIPTS[command[0]] == "clients.admin:main", command
    args = admin.parse_args(command[1:])
    assert args.command == "alive" and args.host == f"127.0.0.1:{grpc_port}", command
    assert args.timeout < liveness["timeoutSeconds"], "the kubelet would kill the check before it answers"
    assert container["readinessProbe"]["grpc"]["port"] in (grpc_port, "grpc")


def test_several_hosts_roll_one_at_a_time() -> None:
    """A host leaving the Service's endpoints before its SIGTERM (preStop), no fewer hosts than
    asked during a rolling deploy, and node drains take one host at a time."""
    hosts = workload("agentmw-hosts")
    (container,) = hosts["spec"]["template"]["spec"]["containers"]
    assert container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    assert hosts["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    budget = next(d for d in DOCS if d["kind"] == "PodDisruptionBudget")
    assert budget["spec"]["selector"]["matchLabels"].items() <= _labels(hosts).items()


def _labels(w: dict[str, Any]) -> dict[str, str]:
    return w["spec"]["template"]["metadata"]["labels"]


def docker_ignores(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves ``path`` out of the build context under .dockerignore ``patterns``
    (moby's patternmatcher: a pattern is rooted at the context, ``*`` stays within one path element,
    ``**`` spans any number, and a directory that matches takes everything under it)."""
    parts = path.split("/")
    for pattern in patterns:
        regex = ""
        for piece in re.split(r"(\*\*/?|\*|\?)", pattern.strip("/")):
            if piece.startswith("**"):
                regex += "(.*/)?" if piece.endswith("/") else ".*"
            else:
                regex += {"*": "[^/]*", "?": "[^/]"}.get(piece, re.escape(piece))
        if any(re.fullmatch(regex, "/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            return True
    return False


def test_the_docker_build_context_leaves_out_what_builds_and_runs_make_here() -> None:
    """.dockerignore leaves out every .gitignore entry, the venvs and trees that the Makefile makes
    (its `clean` target's list) and the tools' caches; the build stage's ``COPY . .`` sent ~2.9 GB
    (.venv-mem0, .venv-agentscope-full, .bench-versus: it listed only .venv and .venv-agentscope)."""
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [p.strip() for p in lines if p.strip() and not p.lstrip().startswith("#")]
    assert not [p for p in patterns if p.startswith("!")], "exceptions: extend docker_ignores first"
    made = [
        line.strip().strip("/").replace("*", "x")
        for line in (ROOT / ".gitignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    makefile = (ROOT / "Makefile").read_text()
    variables = dict(re.findall(r"^(\w+)\s*:=\s*(\S+)", makefile, re.M))
    (clean,) = re.findall(r"^clean:\n\trm -rf ([^\n]+)", makefile, re.M)
    made += [re.sub(r"\$\((\w+)\)", lambda m: variables[m.group(1)], word) for word in clean.split()]
    assert {".venv", ".venv-agentscope", ".venv-agentscope-full", ".venv-mem0", ".bench-versus"} <= set(made)
    # Nested ones, and the caches that carry their own .gitignore (mypy's).
    made += ["agentmw/__pycache__", "mw_servers/examples/node/node_modules", "sdk/build", ".mypy_cache"]
    assert [p for p in made if not docker_ignores(f"{p}/some/file", patterns)] == []
    # What the build stage builds from stays in.
    needed = [
        "pyproject.toml",
        "sdk/setup.py",
        "agentmw/__init__.py",
        "agent_host/cli.py",
        "mw_servers/examples/timing.py",
    ]
    assert [p for p in needed if docker_ignores(p, patterns)] == []
