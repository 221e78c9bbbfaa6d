"""The Kubernetes manifests (deploy/k8s, kustomize): rendered with kustomize itself
(`kubectl kustomize`), every object validated offline and strictly (unknown fields
rejected) against the Kubernetes JSON schemas (kubernetes-validate) and the ServiceMonitor
against a schema generated from the prometheus-operator CRD models; then the wiring a
user relies on: probes, a preStop that lets SIGTERM drain within the grace period,
non-root, resources, the Secret and ConfigMap the pods read, selectors that match, and
Redis as a component that can be left out."""

from __future__ import annotations

import base64
import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from cloudcoil.models.prometheus_operator import v1 as promop

from tests.deploy.panels import ROOT

# Deployment checks run external tools and subprocesses: left out of the fast subset.
pytestmark = pytest.mark.slow

K8S = ROOT / "deploy" / "k8s"
KUBE_VERSION = "1.30.0"  # the oldest Kubernetes the manifests promise to work on


def render(tree: Path) -> list[dict[str, Any]]:
    exe = shutil.which("kubectl")
    if exe is None:
        pytest.fail("kubectl (with kustomize) not found")
    r = subprocess.run(
        [exe, "kustomize", str(tree)], capture_output=True, text=True, timeout=60, check=False
    )
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of deploy/k8s with the Secret's env file made from its example."""
    dst = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, dst)
    example = (dst / "secrets" / "kvgate.env.example").read_text()
    filled = example.replace("KVGATE_ADMIN_TOKEN=", "KVGATE_ADMIN_TOKEN=test-admin-token")
    (dst / "secrets" / "kvgate.env").write_text(filled)
    return dst


@pytest.fixture(scope="module")
def objects(tree: Path) -> list[dict[str, Any]]:
    return render(tree)


def _strict(schema: Any) -> Any:
    """A CRD's structural schema prunes unknown fields, and the API server's strict
    field validation rejects them: close every object that lists its properties."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        pattern = out.get("pattern")
        if isinstance(pattern, str) and "(?i)" in pattern[1:]:
            # Go's RE2 takes an inline flag anywhere; Python's re only at the start.
            out["pattern"] = "(?i)" + pattern.replace("(?i)", "")
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


CRD_SCHEMAS = {
    kind: _strict(getattr(promop, kind).model_json_schema(by_alias=True))
    for kind in ("ServiceMonitor", "PrometheusRule")
}


def validate(obj: dict[str, Any]) -> None:
    if obj["apiVersion"].startswith("monitoring.coreos.com/"):
        assert obj["apiVersion"] == "monitoring.coreos.com/v1"
        jsonschema.validate(obj, CRD_SCHEMAS[obj["kind"]])
    else:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def by_kind(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, (kind, name, [o["metadata"]["name"] for o in found])
    return found[0]


def test_every_object_is_valid_against_its_schema(objects: list[dict[str, Any]]) -> None:
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == sorted(
        [
            "Namespace",
            "ConfigMap",
            "Secret",
            "Service",
            "Service",
            "Deployment",
            "Deployment",
            "PodDisruptionBudget",
            "ServiceMonitor",
            "PrometheusRule",
            "NetworkPolicy",
        ]
    )
    for obj in objects:
        validate(obj)
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "kvgate"


def test_the_validators_reject_bad_manifests(objects: list[dict[str, Any]]) -> None:
    # The check above means something: a misspelt field and a wrong type both fail.
    dep = copy.deepcopy(by_kind(objects, "Deployment", "kvgate"))
    dep["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = dep["spec"]["template"][
        "spec"
    ]["containers"][0].pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(dep)
    svc = copy.deepcopy(by_kind(objects, "Service", "kvgate"))
    svc["spec"]["ports"][0]["port"] = "eighty"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(svc)
    sm = copy.deepcopy(by_kind(objects, "ServiceMonitor"))
    sm["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        validate(sm)
    del sm["spec"]["endpoints"][0]["intervall"]
    del sm["spec"]["selector"]
    with pytest.raises(jsonschema.ValidationError):
        validate(sm)
    rule = copy.deepcopy(by_kind(objects, "PrometheusRule"))
    rule["spec"]["groups"][0]["rules"][0]["fo"] = rule["spec"]["groups"][0]["rules"][0].pop("for")
    with pytest.raises(jsonschema.ValidationError):
        validate(rule)


def test_the_gateway_deployment(objects: list[dict[str, Any]]) -> None:
    dep = by_kind(objects, "Deployment", "kvgate")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # One process per pod (scaled by replicas): each pod's /metrics is the whole of it.
    assert "--workers" not in c["args"]
    assert dep["spec"]["replicas"] >= 2
    assert {"name": "http", "containerPort": 8080, "protocol": "TCP"} in c["ports"]
    # SIGTERM drains: the preStop wait plus kvgate's drain fit in the grace period.
    assert c["lifecycle"]["preStop"]["exec"]["command"][:2] == ["python3", "-c"]
    wait = float(c["lifecycle"]["preStop"]["exec"]["command"][2].split("sleep(")[1].rstrip(")"))
    cm = by_kind(objects, "ConfigMap")
    config = yaml.safe_load(cm["data"]["kvgate.yaml"])
    drain = config["shutdown"]["drain_grace_s"]
    assert wait + drain < pod["terminationGracePeriodSeconds"]
    # Non-root, no privilege, read-only root, resources set.
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert set(c["resources"]["requests"]) == {"cpu", "memory"}
    assert "memory" in c["resources"]["limits"]
    # The ConfigMap and Secret it reads are the generated ones (hash-suffixed names).
    secret = by_kind(objects, "Secret")
    assert c["envFrom"] == [{"secretRef": {"name": secret["metadata"]["name"]}}]
    assert set(secret["data"]) >= {"KVGATE_ADMIN_TOKEN", "KVGATE_API_KEYS"}
    vol = next(v for v in pod["volumes"] if v["name"] == "config")
    assert vol["configMap"]["name"] == cm["metadata"]["name"]
    assert {"mountPath": "/etc/kvgate", "name": "config", "readOnly": True} in c["volumeMounts"]
    # The image's entrypoint is kvgate; the config path is the mounted one.
    assert c["args"][:3] == ["serve", "--config", "/etc/kvgate/kvgate.yaml"]
    assert c["image"] == "kvgate:0.1.0"


def test_selectors_and_ports_match(objects: list[dict[str, Any]]) -> None:
    dep = by_kind(objects, "Deployment", "kvgate")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    svc = by_kind(objects, "Service", "kvgate")
    assert svc["spec"]["selector"].items() <= labels.items()
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    pdb = by_kind(objects, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["minAvailable"] < dep["spec"]["replicas"]  # a drain can proceed
    sm = by_kind(objects, "ServiceMonitor")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"


def test_the_prometheus_rule_is_the_tested_alerts_file(objects: list[dict[str, Any]]) -> None:
    rule = by_kind(objects, "PrometheusRule")
    tested = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yaml").read_text())
    assert rule["spec"] == tested
    assert rule["metadata"]["labels"]["app.kubernetes.io/name"] == "kvgate"


def test_redis_is_a_component(objects: list[dict[str, Any]], tree: Path) -> None:
    dep = by_kind(objects, "Deployment", "kvgate")
    env = {
        e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    redis_svc = by_kind(objects, "Service", "kvgate-redis")
    port = redis_svc["spec"]["ports"][0]["port"]
    assert env["KVGATE_REDIS_URL"] == f"redis://kvgate-redis:{port}/0"
    redis = by_kind(objects, "Deployment", "kvgate-redis")
    assert redis["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert redis_svc["spec"]["selector"].items() <= (
        redis["spec"]["template"]["metadata"]["labels"].items()
    )
    # Without the component: no Redis objects, no Redis URL (a managed Redis goes in the
    # Secret), everything still valid.
    kust = yaml.safe_load((tree / "kustomization.yaml").read_text())
    kust.pop("components")
    alt = tree.parent / "no-redis"
    shutil.copytree(tree, alt)
    (alt / "kustomization.yaml").write_text(yaml.safe_dump(kust))
    plain = render(alt)
    assert not [o for o in plain if "redis" in o["metadata"]["name"]]
    dep = by_kind(plain, "Deployment", "kvgate")
    names = {e["name"] for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "KVGATE_REDIS_URL" not in names
    for obj in plain:
        validate(obj)


def test_the_secret_env_file_is_never_committed() -> None:
    r = subprocess.run(
        ["git", "check-ignore", "-q", "deploy/k8s/secrets/kvgate.env"], cwd=ROOT, check=False
    )
    assert r.returncode == 0  # git ignores it
    r = subprocess.run(
        ["git", "ls-files", "deploy/k8s/secrets"], cwd=ROOT, capture_output=True, text=True
    )
    assert r.stdout.split() == [
        "deploy/k8s/secrets/.gitignore",
        "deploy/k8s/secrets/kvgate.env.example",
    ]


def test_the_configmap_is_a_valid_kvgate_config(
    objects: list[dict[str, Any]], tmp_path: Path
) -> None:
    # kvgate's own loader, with the environment the pod gets (Secret plus env).
    cm = by_kind(objects, "ConfigMap")
    (tmp_path / "kvgate.yaml").write_text(cm["data"]["kvgate.yaml"])
    dep = by_kind(objects, "Deployment", "kvgate")
    env = {e["name"]: e["value"] for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    secret = by_kind(objects, "Secret")
    env.update({k: base64.b64decode(v).decode() for k, v in secret["data"].items()})
    r = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(tmp_path / "kvgate.yaml")]
        + ["--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": os.environ["PATH"], **env},
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert "config OK (0 replicas, 1 DNS groups)" in r.stdout


def test_engines_from_a_headless_service_and_scaled_on_the_signal() -> None:
    # The group in the ConfigMap names the example headless Service, at its port.
    group = yaml.safe_load((K8S / "base" / "kvgate.yaml").read_text())["replica_groups"][0]
    (svc,) = yaml.safe_load_all((K8S / "examples" / "vllm-headless-service.yaml").read_text())
    validate(svc)
    assert svc["spec"]["clusterIP"] == "None"
    ns = svc["metadata"]["namespace"]
    assert group["host"] == f"{svc['metadata']['name']}.{ns}.svc.cluster.local"
    assert group["port"] == svc["spec"]["ports"][0]["port"]
    # KEDA scales that Deployment on the gauge, as the HPA's replicas = its value.
    (scaled,) = yaml.safe_load_all((K8S / "examples" / "vllm-scaledobject.yaml").read_text())
    assert scaled["kind"] == "ScaledObject" and scaled["metadata"]["namespace"] == ns
    spec = scaled["spec"]
    assert spec["scaleTargetRef"]["name"] == svc["spec"]["selector"]["app.kubernetes.io/name"]
    (trigger,) = spec["triggers"]
    query = trigger["metadata"]["query"]
    assert trigger["type"] == "prometheus" and query.startswith("max(kvgate_model_desired_replicas")
    assert trigger["metadata"]["metricType"] == "AverageValue"
    assert trigger["metadata"]["threshold"] == "1"
