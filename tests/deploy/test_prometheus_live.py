"""Real parts: Debian's Prometheus scrapes a running `kvgate serve` (two tenants with SLO
targets, shared state on the suite's Redis) in front of enginesim replicas under a short
load (one replica failing for half of it), and every Grafana panel's PromQL, evaluated
through Prometheus's HTTP API as Grafana would, returns data."""

from __future__ import annotations

import pytest

from tests.deploy.live import run

# Prometheus, kvgate and three replicas as processes, under a load of seconds.
pytestmark = pytest.mark.slow


async def test_every_dashboard_panel_returns_data_from_a_real_run() -> None:
    summary = await run(load_s=15.0)
    load = summary["load"]
    assert load["ok"] > 100
    assert load["shed"] > 0  # the short queue timeout made kvgate shed (a panel shows it)
    results = summary["results"]
    assert not [r.line() for r in results if r.pending]  # every family is kvgate's own
    empty = [r.line() for r in results if r.points == 0]
    assert empty == [], "\n".join(summary["panels"])
    # Both tenants' SLO attainment is on the dashboard.
    slo = next(r for r in results if r.target.panel.startswith("SLO attainment"))
    assert slo.series >= 2, slo.line()
    # Prometheus loaded and evaluated every alert rule against the live series.
    rules = summary["rules"]
    assert set(rules) >= {
        "KvgateReplicaPreempting",
        "KvgateSloAttainmentLow",
        "KvgateShedRateHigh",
        "KvgateReplicaEjected",
        "KvgateRedisUnreachable",
    }
    assert set(rules.values()) == {"ok"}, rules
    # The failing replica was ejected: the ejection alert's expression matched the live
    # series and Prometheus held it pending (its `for` is longer than the run).
    assert "pending" in summary["alerts_seen"].get("KvgateReplicaEjected", []), summary[
        "alerts_seen"
    ]
