"""``kvgate_model_desired_replicas{model}``: the scaling signal (admission/scaling.py) as
the gauge an autoscaler reads through Prometheus (deploy/k8s/components/autoscaling).

Computed at scrape time from admission's report. With several gateway processes, each
sees its share of the demand and of the replicas' limits: read ``max`` over them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from admission.report import AdmissionReport


class DesiredReplicas(Collector):
    def __init__(self, report: AdmissionReport) -> None:
        self._report = report

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily(
            "kvgate_model_desired_replicas",
            "Replicas the model needs for the demand kvgate sees (arrival rate x service "
            "time / the concurrency one replica's learned limit allows), 0 without demand",
            labels=["model"],
        )
        now = asyncio.get_running_loop().time()
        for model, n in sorted(self._report.desired_replicas(now).items()):
            g.add_metric([model], n)
        yield g
