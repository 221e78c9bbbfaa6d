"""The dashboard's PromQL and the metric families it reads, for the deploy tests."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvgate.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yaml"
_METRIC = re.compile(r"\bkvgate_[a-z0-9_]+\b")
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


@dataclass(frozen=True)
class Target:
    panel: str
    ref: str
    expr: str  # as in the dashboard, Grafana's variables included

    def promql(self, rate_interval: str = "1m") -> str:
        """The expression as Grafana sends it to Prometheus."""
        return self.expr.replace("$__rate_interval", rate_interval)

    @property
    def families(self) -> set[str]:
        return {family(m) for m in _METRIC.findall(self.expr)}


def family(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def targets() -> list[Target]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            out.append(Target(panel["title"], t["refId"], t["expr"]))
    return out


def declared_families() -> set[str]:
    """Metric families kvgate's own code declares (string literals in its packages)."""
    found: set[str] = set()
    for pkg in ("gateway", "admission", "routing"):
        for path in (ROOT / pkg).rglob("*.py"):
            for lit in re.findall(r"\"(kvgate_[a-z0-9_]+)\"", path.read_text()):
                found.add(family(lit))
    return found
