"""The compose stack (deploy/compose): the file passes Compose's own schema validation
(Debian's docker-compose, `config`, offline: no engine needed), its pieces agree with
each other (service names and ports in Prometheus's targets and kvgate's replicas,
Grafana's datasource uid and dashboard path), and kvgate's config in it is valid."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.panels import DASHBOARD, ROOT

# Deployment checks run external tools and subprocesses: left out of the fast subset.
pytestmark = pytest.mark.slow

COMPOSE = ROOT / "deploy" / "compose"


def compose_config(path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail(
            "docker-compose not found: apt-get install docker-compose (scripts/test.sh does)"
        )
    return subprocess.run(
        [exe, "-f", str(path), "config"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), **env},
        check=False,
    )


def test_compose_file_is_valid_and_needs_an_admin_token() -> None:
    r = compose_config(COMPOSE / "compose.yaml", {"KVGATE_ADMIN_TOKEN": "t0ken"})
    assert r.returncode == 0, r.stderr
    resolved = yaml.safe_load(r.stdout)
    assert set(resolved["services"]) == {
        "kvgate",
        "redis",
        "replica-a",
        "replica-b",
        "prometheus",
        "grafana",
    }
    kv = resolved["services"]["kvgate"]
    assert kv["command"][-2:] == ["--workers", "2"]
    assert kv["environment"]["KVGATE_ADMIN_TOKEN"] == "t0ken"
    assert kv["environment"]["KVGATE_REDIS_URL"].startswith("redis://redis:")
    r = compose_config(COMPOSE / "compose.yaml", {})
    assert r.returncode != 0
    assert "KVGATE_ADMIN_TOKEN" in r.stderr


def test_the_validator_rejects_what_compose_would(tmp_path: Path) -> None:
    # The check above means something: a misspelt key fails Compose's schema.
    doc = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
    doc["services"]["kvgate"]["enviroment"] = {"A": "1"}
    bad = tmp_path / "compose.yaml"
    bad.write_text(yaml.safe_dump(doc))
    r = compose_config(bad, {"KVGATE_ADMIN_TOKEN": "x"})
    assert r.returncode != 0
    assert "enviroment" in r.stderr


def test_the_pieces_agree() -> None:
    compose = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
    services = compose["services"]
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = {
        job["job_name"]: t
        for job in prom["scrape_configs"]
        for sc in job["static_configs"]
        for t in [sc["targets"]]
    }
    assert targets["kvgate"] == ["kvgate:8080"]
    assert sorted(targets["enginesim"]) == ["replica-a:8000", "replica-b:8000"]
    for t in targets["enginesim"]:
        assert t.split(":")[0] in services
    kvcfg = yaml.safe_load((COMPOSE / "kvgate.yaml").read_text())
    assert [r["url"] for r in kvcfg["replicas"]] == [
        "http://replica-a:8000",
        "http://replica-b:8000",
    ]
    ds = yaml.safe_load(
        (COMPOSE / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text()
    )["datasources"][0]
    dash = json.loads(DASHBOARD.read_text())
    var = next(v for v in dash["templating"]["list"] if v["name"] == "datasource")
    assert var["current"]["value"] == ds["uid"]
    assert ds["url"] == "http://prometheus:9090"
    provider = yaml.safe_load(
        (COMPOSE / "grafana" / "provisioning" / "dashboards" / "kvgate.yaml").read_text()
    )["providers"][0]
    mounts = [v.split(":") for v in services["grafana"]["volumes"]]
    assert ["../grafana", provider["options"]["path"], "ro"] in mounts
    for svc in ("kvgate", "replica-a"):
        build = services[svc]["build"]
        assert (COMPOSE / build["context"] / build["dockerfile"]).is_file()


def test_the_compose_kvgate_config_is_valid() -> None:
    env = {
        "PATH": os.environ["PATH"],
        "KVGATE_REDIS_URL": "redis://redis:6379/0",
        "KVGATE_ADMIN_TOKEN": "x",
    }
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "serve",
            "--config",
            "deploy/compose/kvgate.yaml",
            "--check",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert "config OK (2 replicas)" in r.stdout
