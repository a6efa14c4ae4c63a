"""The deployment files against what the repository builds: the Kubernetes manifests in deploy/k8s
(parsed with PyYAML) name images the Dockerfile builds at the package's version, run commands that
exist (console scripts, modules, middleware classes), and agree on ports, probes, Services, the
session volume and the host configuration (loaded by the host's own config loader).

No cluster and no Docker here: this checks the files are consistent, not that a cluster runs them.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from agent_host.cli import parse_args
from agent_host.config import load_config
from agentmw.middleware import MiddlewareBase
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


def manifests() -> list[dict[str, Any]]:
    docs = []
    for path in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


STAGES = dockerfile_stages()
IMAGES = {s["title"]: s for s in STAGES.values() if s["title"]}
DOCS = manifests()
WORKLOADS = [d for d in DOCS if d["kind"] in ("Deployment", "StatefulSet")]
SERVICES = {(d["metadata"]["namespace"], d["metadata"]["name"]): d for d in DOCS if d["kind"] == "Service"}
CONTAINERS = [(w, c) for w in WORKLOADS for c in w["spec"]["template"]["spec"]["containers"]]


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
        check = spec.get("grpc") or spec.get("tcpSocket")
        assert check is not None and by_name.get(check["port"], check["port"]) in ports, f"{probe} port"
    assert "grpc" in container["readinessProbe"], "readiness is grpc.health.v1 (native gRPC probe)"


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
            for w, c in CONTAINERS
            if service["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert pods, f"Service {service['metadata']['name']} selects nothing"
        for port in service["spec"]["ports"]:
            for _w, c in pods:
                named = {p["name"]: p["containerPort"] for p in c["ports"]}
                target = port.get("targetPort", port["port"])
                assert target in named or target in named.values(), f"{service['metadata']['name']}: {target}"


def test_host_configuration_loads_and_agrees(tmp_path: Path) -> None:
    (host,) = [w for w in WORKLOADS if w["kind"] == "StatefulSet"]
    (container,) = host["spec"]["template"]["spec"]["containers"]
    config_path = PurePosixPath(container["args"][container["args"].index("--config") + 1])
    mount = next(m for m in container["volumeMounts"] if PurePosixPath(m["mountPath"]) == config_path.parent)
    volume = next(v for v in host["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    (config_map,) = [
        d for d in DOCS if d["kind"] == "ConfigMap" and d["metadata"]["name"] == volume["configMap"]["name"]
    ]
    path = tmp_path / config_path.name
    path.write_text(config_map["data"][config_path.name])
    config = load_config(path, env={})  # the host's own loader: every key known and valid

    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert int(config.listen.rsplit(":", 1)[1]) == ports["grpc"]
    assert config.listen.startswith("0.0.0.0:"), "reachable from other pods"
    assert config.metrics_port == ports["metrics"]
    sessions = next(m for m in container["volumeMounts"] if m["name"] == "sessions")
    assert PurePosixPath(config.db).parent == PurePosixPath(sessions["mountPath"])
    assert [t["metadata"]["name"] for t in host["spec"]["volumeClaimTemplates"]] == ["sessions"]
    assert config.middleware
    for mw in config.middleware:
        m = re.fullmatch(r"dns:///([\w-]+)\.([\w-]+)\.svc\.cluster\.local:(\d+)", mw.address)
        assert m, f"{mw.name}: {mw.address} is not a Service's DNS name"
        service = SERVICES.get((m.group(2), m.group(1)))
        assert service is not None, f"{mw.name}: no Service {m.group(1)} in namespace {m.group(2)}"
        assert int(m.group(3)) in {p["port"] for p in service["spec"]["ports"]}
