"""The shared-state metrics (gateway/state/sharing.py's lease loop), read at scrape time."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from admission.report import AdmissionReport

if TYPE_CHECKING:
    from gateway.state.sharing import StateSync


class StateCollector(Collector):
    """The shared-state metrics, read at scrape time."""

    def __init__(self, backend_name: str, sync: StateSync | None, report: AdmissionReport) -> None:
        self._name = backend_name
        self._sync = sync
        self._report = report

    def collect(self) -> Iterable[Metric]:
        s = self._sync
        up = GaugeMetricFamily(
            "kvgate_state_backend_up",
            "1 while the shared-state backend answers (memory: always)",
            labels=["backend"],
        )
        up.add_metric([self._name], 1 if s is None or s.up else 0)
        errors = CounterMetricFamily(
            "kvgate_state_backend_errors",
            "Round trips to the shared-state backend that failed",
            labels=["backend"],
        )
        errors.add_metric([self._name], s.errors if s is not None else 0)
        procs = GaugeMetricFamily(
            "kvgate_state_processes", "Gateway processes sharing the state, as last seen"
        )
        procs.add_metric([], s.processes if s is not None else 1)
        share = GaugeMetricFamily(
            "kvgate_replica_pool_share_tokens",
            "The slice of the replica's effective KV pool this process leased",
            labels=["replica"],
        )
        for name in self._report.replica_names():  # memory: the whole pool
            d = self._report.pool_demand(name)
            if d is not None:
                value = d.share_tokens if d.share_tokens is not None else d.effective
                share.add_metric([name], value)
        return [up, errors, procs, share]
