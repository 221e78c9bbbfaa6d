"""Prometheus artefacts checked with Prometheus's own tool (`promtool`, from Debian's
`prometheus` package; scripts/test.sh installs it): the alert rules pass their unit
tests, the compose stack's Prometheus config is valid, and every PromQL expression of
the Grafana dashboard parses and reads only metric families that kvgate declares."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.panels import ALERTS, DASHBOARD, ROOT, declared_families, family, targets

# Deployment checks run external tools and subprocesses: left out of the fast subset.
pytestmark = pytest.mark.slow

PROM = ROOT / "deploy" / "prometheus"


def promtool(*args: str, cwd: Path = PROM) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.fail("promtool not found: apt-get install prometheus (scripts/test.sh does)")
    return subprocess.run(
        [exe, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def test_alert_rules_pass_their_unit_tests() -> None:
    r = promtool("check", "rules", "alerts.yaml")
    assert r.returncode == 0, r.stdout + r.stderr
    r = promtool("test", "rules", "alerts.test.yaml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_every_alert_has_a_unit_test_that_fires_it() -> None:
    rules = yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]
    names = {r["alert"] for r in rules}
    assert names == {
        "KvgateReplicaPreempting",
        "KvgateSloAttainmentLow",
        "KvgateShedRateHigh",
        "KvgateReplicaEjected",
        "KvgateRedisUnreachable",
    }
    tests = yaml.safe_load((PROM / "alerts.test.yaml").read_text())["tests"]
    fired = {
        case["alertname"]
        for t in tests
        for case in t.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    quiet = {
        case["alertname"]
        for t in tests
        for case in t.get("alert_rule_test", [])
        if not case.get("exp_alerts")
    }
    assert fired == names
    assert quiet == names  # and each is shown quiet on healthy series too


def test_compose_prometheus_config_is_valid() -> None:
    r = promtool("check", "config", "prometheus.yml")
    assert r.returncode == 0, r.stdout + r.stderr


def test_dashboard_promql_parses(tmp_path: Path) -> None:
    # promtool parses every expression of a rule file: one recording rule per panel query.
    ts = targets()
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:q{i}", "expr": t.promql()} for i, t in enumerate(ts)
                ],
            }
        ]
    }
    (tmp_path / "dash.rules.yaml").write_text(yaml.safe_dump(rules))
    r = promtool("check", "rules", "dash.rules.yaml", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(ts)} rules found" in r.stdout


def test_dashboard_has_the_panels_the_issue_lists() -> None:
    dash = json.loads(DASHBOARD.read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    used = set().union(*(t.families for t in targets()))
    wanted = {
        "kvgate_replica_capacity_tokens",  # per-replica pool: capacity
        "kvgate_replica_reserved_tokens",  # reserved
        "kvgate_replica_engine_kv_usage_ratio",  # the engine's own usage
        "kvgate_replica_limit",  # the learned limit
        "kvgate_replica_binding_ceiling",  # the binding ceiling
        "kvgate_queue_depth",
        "kvgate_queue_wait_seconds",
        "kvgate_shed",  # sheds by reason
        "kvgate_ttft_seconds",
        "kvgate_itl_seconds",
        "kvgate_tenant_slo_met",  # per-tenant SLO attainment
        "kvgate_upstream_errors",
        "kvgate_replica_ejections",
        "kvgate_replica_ejected",
    }
    assert wanted <= used
    for p in panels:
        assert p["targets"], p["title"]
        assert p["datasource"]["uid"] == "${datasource}"


def test_dashboard_and_alerts_read_declared_metrics_only() -> None:
    # A typo in a panel's metric name would show an empty panel forever.
    declared = declared_families()
    used = set().union(*(t.families for t in targets()))
    used |= {family(m) for m in re.findall(r"\bkvgate_[a-z0-9_]+\b", ALERTS.read_text())}
    assert used - declared == set()
