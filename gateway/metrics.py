"""Prometheus metrics, one CollectorRegistry per app (so several gateways can live in one
process, as in tests and the demo).

Counters and histograms are updated on the request path through pre-bound label
children (a dict lookup instead of prometheus_client's label resolution per call).
Gauges that mirror the admission ledger (queue depth, capacity, reserved, running) are
not updated per request at all: a custom collector reads them from the admission report
when Prometheus scrapes, so the hot path pays nothing for them and they are never stale.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from admission.learned.patience import QUANTILE, PatienceReading
from admission.learned.retry_budget import BudgetReading
from admission.types import ReplicaUsage
from routing.types import ReplicaState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
CEILINGS = ("kv_capacity", "running_cap", "latency", "deadlines", "not_ready", "ejected", "none")
_WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
# estimated / actual prompt tokens: 1 is a perfect count, 2 reserves twice what is used.
_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0)


class _LedgerCollector(Collector):
    """Reads queue and replica gauges from the admission report at scrape time."""

    def __init__(
        self,
        usage: Callable[[], list[ReplicaUsage]],
        queue_depths: Callable[[], dict[str, int]],
        topup_failures: Callable[[], int],
    ) -> None:
        self._usage = usage
        self._queue_depths = queue_depths
        self._topup_failures = topup_failures

    def collect(self) -> Iterable[Metric]:
        depth = GaugeMetricFamily(
            "kvgate_queue_depth", "Requests waiting for admission", labels=["model"]
        )
        for model, n in sorted(self._queue_depths().items()):
            depth.add_metric([model], n)
        cap = GaugeMetricFamily(
            "kvgate_replica_capacity_tokens",
            "Effective KV capacity kvgate admits against, in tokens",
            labels=["replica"],
        )
        reserved = GaugeMetricFamily(
            "kvgate_replica_reserved_tokens",
            "KV tokens reserved by admitted requests",
            labels=["replica"],
        )
        running = GaugeMetricFamily(
            "kvgate_replica_running",
            "Requests kvgate has admitted and not yet released",
            labels=["replica"],
        )
        ready = GaugeMetricFamily(
            "kvgate_replica_ready", "1 if the replica is ready", labels=["replica"]
        )
        ejected = GaugeMetricFamily(
            "kvgate_replica_ejected",
            "1 while outlier detection keeps the replica out of service",
            labels=["replica"],
        )
        limit = GaugeMetricFamily(
            "kvgate_replica_limit",
            "Requests kvgate lets run on the replica at once: the learned limit within any "
            "configured or engine-reported cap",
            labels=["replica"],
        )
        binding = GaugeMetricFamily(
            "kvgate_replica_binding_ceiling",
            "1 for the ceiling that keeps the replica from taking more work now "
            "(kv_capacity, running_cap, latency, not_ready, ejected, none)",
            labels=["replica", "ceiling"],
        )
        for u in self._usage():
            cap.add_metric([u.name], u.effective_capacity_tokens)
            reserved.add_metric([u.name], u.reserved_tokens)
            running.add_metric([u.name], u.running)
            ready.add_metric([u.name], 1 if u.ready else 0)
            ejected.add_metric([u.name], 1 if u.ejected else 0)
            allowed = u.limit if u.limit is not None else u.max_running
            if allowed is not None:
                limit.add_metric([u.name], allowed)
            for ceiling in CEILINGS:
                binding.add_metric([u.name, ceiling], 1 if u.binding_ceiling == ceiling else 0)
        topup = CounterMetricFamily(
            "kvgate_reservation_topup_failures",
            "Streams that outgrew their KV reservation while the replica had no room "
            "(the stream went on; the engine's own scheduler absorbed the excess)",
        )
        topup.add_metric([], self._topup_failures())
        return [depth, cap, reserved, running, ready, ejected, limit, binding, topup]


# The label values of a _CountsCollector's counts: a tuple of str as long as its labels.
_LabelValues = TypeVar("_LabelValues", bound=tuple[str, ...])


class _CountsCollector(Collector, Generic[_LabelValues]):
    """One counter family read from a callable at scrape time: label values -> count."""

    def __init__(
        self,
        name: str,
        doc: str,
        labels: list[str],
        counts: Callable[[], dict[_LabelValues, int]],
    ) -> None:
        self._name, self._doc, self._labels, self._counts = name, doc, labels, counts

    def collect(self) -> Iterable[Metric]:
        fam = CounterMetricFamily(self._name, self._doc, labels=self._labels)
        for values, n in sorted(self._counts().items()):
            fam.add_metric(list(values), n)
        return [fam]


# Engines whose adapters read a KV usage gauge (llama.cpp's server no longer exports one:
# a 0 there would be a claim, not a measurement).
_KV_USAGE_ENGINES = frozenset({"vllm", "sglang"})


class _EngineCollector(Collector):
    """Reads each replica's own load signals, as its engine last reported them in a
    discovery round, at scrape time: what the dashboard sets beside kvgate's ledger (the
    engine's KV usage against what kvgate reserved) and what the preemption alert reads,
    without scraping every engine (an engine behind kvgate may not be reachable by
    Prometheus at all). Names stay engine-neutral: the adapters map each engine's own."""

    def __init__(self, states: Callable[[], Iterable[ReplicaState]]) -> None:
        self._states = states

    def collect(self) -> Iterable[Metric]:
        usage = GaugeMetricFamily(
            "kvgate_replica_engine_kv_usage_ratio",
            "The engine's own KV-cache usage (0-1) at its last discovery round",
            labels=["replica"],
        )
        running = GaugeMetricFamily(
            "kvgate_replica_engine_running",
            "Requests the engine reported running at its last discovery round",
            labels=["replica"],
        )
        waiting = GaugeMetricFamily(
            "kvgate_replica_engine_waiting",
            "Requests waiting inside the engine at its last discovery round",
            labels=["replica"],
        )
        preempt = CounterMetricFamily(
            "kvgate_replica_engine_preemptions",
            "The engine's own preemption counter (vLLM recomputes, SGLang retracts): "
            "a replica past its cliff",
            labels=["replica"],
        )
        for st in self._states():
            if st.running_seen_at is None or st.engine == "openai":  # no engine view yet
                continue
            if st.engine in _KV_USAGE_ENGINES:
                usage.add_metric([st.name], st.kv_usage)
            running.add_metric([st.name], st.engine_running)
            waiting.add_metric([st.name], st.engine_waiting)
            preempt.add_metric([st.name], st.preemptions_total)
        return [usage, running, waiting, preempt]


class _RetryBudgetCollector(Collector):
    """How many unserved attempts clients that do not say which retry they send give up
    after (admission/learned/retry_budget.py), per tenant, read at scrape time."""

    def __init__(self, readings: Callable[[], Iterable[BudgetReading]]) -> None:
        self._readings = readings

    def collect(self) -> Iterable[Metric]:
        budget = GaugeMetricFamily(
            "kvgate_client_retry_budget",
            "Unserved attempts (shed, or left before an answer) after which clients that do "
            "not say which retry they send give up; absent where they show none (their "
            "last attempt queues as an SDK's last retry)",
            labels=["tenant"],
        )
        seen = GaugeMetricFamily(
            "kvgate_client_retry_outcomes",
            "Recent unserved attempts of such clients by what became of them",
            labels=["tenant", "outcome"],
        )
        for r in self._readings():
            if r.attempts is not None:
                budget.add_metric([r.tenant], r.attempts)
            seen.add_metric([r.tenant, "came_back"], r.came_back)
            seen.add_metric([r.tenant, "gave_up"], r.gave_up)
        return [budget, seen]


class _PatienceCollector(Collector):
    """The learned patience of clients that state no timeout (admission/learned/patience.py),
    per tenant, model and stream, read from the admission report at scrape time."""

    def __init__(self, readings: Callable[[], Iterable[PatienceReading]]) -> None:
        self._readings = readings

    def collect(self) -> Iterable[Metric]:
        labels = ["tenant", "model", "stream"]
        patience = GaugeMetricFamily(
            "kvgate_client_patience_seconds",
            "How long clients that state no timeout wait (the Kaplan-Meier quantile of "
            "when they leave); absent until learned",
            labels=[*labels, "quantile"],
        )
        seen = CounterMetricFamily(
            "kvgate_client_patience_observations",
            "Ended requests of clients that state no timeout, by whether the client left "
            "(a disconnect) or stayed to the end",
            labels=[*labels, "kind"],
        )
        for r in self._readings():
            key = [r.tenant, r.model, "true" if r.stream else "false"]
            if r.patience_s is not None:
                patience.add_metric([*key, str(QUANTILE)], r.patience_s)
            seen.add_metric([*key, "left"], r.left)
            seen.add_metric([*key, "stayed"], r.observed - r.left)
        return [patience, seen]


class _WorkerLabelled:
    """The registry as one worker of ``kvgate serve --workers N`` exposes it: every sample
    with a ``worker`` label. The workers share one port, so each scrape reaches one of
    them; without the label their counters would interleave in one series (each switch
    read as a reset). With it each worker's series stays monotonic and ``sum without
    (worker)`` adds them up."""

    def __init__(self, registry: CollectorRegistry, worker: str) -> None:
        self._registry = registry
        self._worker = worker

    def collect(self) -> Iterable[Metric]:
        for family in self._registry.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [
                s._replace(labels={**s.labels, "worker": self._worker}) for s in family.samples
            ]
            yield out


class GatewayMetrics:
    """The gateway's metric families and cached label children."""

    def __init__(
        self,
        usage: Callable[[], list[ReplicaUsage]],
        queue_depths: Callable[[], dict[str, int]],
        topup_failures: Callable[[], int],
        worker: str | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        # Set by `kvgate serve --workers N` in each worker process (its index).
        worker = os.environ.get("KVGATE_WORKER") if worker is None else worker
        self._exposed: CollectorRegistry | _WorkerLabelled = (
            _WorkerLabelled(self.registry, worker) if worker else self.registry
        )
        r = self.registry
        self.requests = Counter(
            "kvgate_requests", "Requests by model and outcome", ["model", "outcome"], registry=r
        )
        self.endpoint_requests = Counter(
            "kvgate_endpoint_requests",
            "Requests by endpoint (chat, completion, responses, messages) and outcome",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.shed = Counter("kvgate_shed", "Requests shed by reason", ["reason"], registry=r)
        self.upstream_errors = Counter(
            "kvgate_upstream_errors",
            "Upstream failures by replica and kind (connect, timeout, status_5xx, dropped, "
            "stream_error)",
            ["replica", "kind"],
            registry=r,
        )
        self.retries = Counter(
            "kvgate_upstream_retries",
            "Requests re-admitted to another replica after a failure before any byte reached "
            "the client, by the replica that failed and the failure kind",
            ["replica", "kind"],
            registry=r,
        )
        self.ejections = Counter(
            "kvgate_replica_ejections",
            "Outlier ejections by replica (consecutive 5xx, refused connections, timeouts "
            "before the first byte)",
            ["replica"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "kvgate_queue_wait_seconds",
            "Time from arrival to admission of admitted requests",
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "kvgate_ttft_seconds",
            "Time from arrival to the first streamed event sent to the client",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "kvgate_itl_seconds",
            "Mean inter-token latency of each streamed response",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.prompt_estimate_ratio = Histogram(
            "kvgate_prompt_estimate_ratio",
            "Prompt tokens kvgate reserved for / the engine's usage.prompt_tokens, by whether "
            "kvgate's count was exact",
            ["exact"],
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self._ratio_children = {
            True: self.prompt_estimate_ratio.labels("true"),
            False: self.prompt_estimate_ratio.labels("false"),
        }
        self.estimate_margin = Gauge(
            "kvgate_estimate_margin",
            "Share an estimated reservation keeps beyond its size, learned from what the "
            "model's estimates missed (admission/learned/margin.py)",
            ["model"],
            registry=r,
        )
        self.prompt_counts = Counter(
            "kvgate_prompt_counts",
            "Prompts counted before admission (near a limit, or long where no count covers "
            "them), by how: replica (its tokenize endpoint answered), cache (counted "
            "before, by a replica or the engine's usage), prefix (a counted prefix and an "
            "estimated tail), failed (error or timeout: went on with the estimate), "
            "unavailable (no replica can count it)",
            ["how"],
            registry=r,
        )
        r.register(_LedgerCollector(usage, queue_depths, topup_failures))
        # Per tenant (label values: configured tenant names, "default", else "other").
        self._tenant_names: frozenset[str] = frozenset({"default"})
        self.tenant_requests = Counter(
            "kvgate_tenant_requests",
            "Requests by tenant and outcome",
            ["tenant", "outcome"],
            registry=r,
        )
        self.tenant_tokens_total = Counter(
            "kvgate_tenant_tokens",
            "Tokens the engines reported by tenant and kind (prompt, completion)",
            ["tenant", "kind"],
            registry=r,
        )
        self.tenant_queue_wait_seconds = Histogram(
            "kvgate_tenant_queue_wait_seconds",
            "Time from arrival to admission of admitted requests, by tenant",
            ["tenant"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.tenant_slo_total = Counter(
            "kvgate_tenant_slo",
            "Requests judged against a tenant's latency target (ttft, itl, e2e)",
            ["tenant", "target"],
            registry=r,
        )
        self.tenant_slo_met = Counter(
            "kvgate_tenant_slo_met",
            "Requests that met a tenant's latency target (ttft, itl, e2e)",
            ["tenant", "target"],
            registry=r,
        )
        self.tenant_rate_limited_total = Counter(
            "kvgate_tenant_rate_limited",
            "Requests answered 429 by tenant and the limit hit (requests, tokens, "
            "concurrency, queue)",
            ["tenant", "limit"],
            registry=r,
        )
        # Workload classes (routing.classify.WORKLOADS: a bounded label) and routing.
        self.workload_requests = Counter(
            "kvgate_workload_requests",
            "Requests by workload class (coding, agentic, chat) and outcome",
            ["workload", "outcome"],
            registry=r,
        )
        self.workload_ttft = Histogram(
            "kvgate_workload_ttft_seconds",
            "Time to the first streamed event, by workload class",
            ["workload"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._children: dict[tuple[object, ...], Any] = {}  # `_child`

    def count_workload(self, workload: str, outcome: str) -> None:
        self._child(self.workload_requests, workload, outcome).inc()

    def observe_workload_ttft(self, workload: str, seconds: float) -> None:
        self._child(self.workload_ttft, workload).observe(seconds)

    def watch_routing(self, decisions: Callable[[], dict[str, int]]) -> None:
        """Export the router's decisions by reason (read at scrape time)."""
        self.registry.register(
            _CountsCollector(
                "kvgate_routing_decisions",
                "Routing decisions by reason (routing.scheduler: the plugin that decided it, "
                "e.g. prefix_warm, session, speculation, spill, expected_ttft_cold; score: "
                "the load terms alone; rejected: every candidate filtered out)",
                ["reason"],
                lambda: {(reason,): n for reason, n in decisions().items()},
            )
        )

    def watch_route_decisions(self, decisions: Callable[[], dict[tuple[str, str], int]]) -> None:
        """Export the router's decisions by (workload, scoring) (read at scrape time):
        which scoring placed each workload class (routing.scheduler)."""
        self.registry.register(
            _CountsCollector(
                "kvgate_route_decisions",
                "Routing decisions by workload class and the scoring of the profile that "
                "placed them (scorer names joined by '+', e.g. prefix_load+session_affinity, "
                "speculation+running_headroom+kv_headroom, kv_headroom)",
                ["workload", "scorer"],
                decisions,
            )
        )

    def watch_engines(self, states: Callable[[], Iterable[ReplicaState]]) -> None:
        """Export the engines' own load signals (`_EngineCollector`) from `states`."""
        self.registry.register(_EngineCollector(states))

    def watch_patience(self, readings: Callable[[], Iterable[PatienceReading]]) -> None:
        """Export the learned client patience (`_PatienceCollector`) from `readings`."""
        self.registry.register(_PatienceCollector(readings))

    def watch_retry_budget(self, readings: Callable[[], Iterable[BudgetReading]]) -> None:
        """Export the learned retry budget (`_RetryBudgetCollector`) from `readings`."""
        self.registry.register(_RetryBudgetCollector(readings))

    def count_request(self, model: str, outcome: str, endpoint: str = "chat") -> None:
        # The pipeline passes "_unknown" for models no replica serves, so clients cannot
        # create unbounded label cardinality.
        self._child(self.requests, model, outcome).inc()
        self._child(self.endpoint_requests, endpoint, outcome).inc()

    # ------------------------------------------------------------------ tenants
    def set_tenant_names(self, names: Iterable[str]) -> None:
        """The tenant label values allowed (bounded cardinality); others count as other."""
        self._tenant_names = frozenset(names) | {"default"}

    def _tenant(self, tenant: str) -> str:
        return tenant if tenant in self._tenant_names else "other"

    def _child(self, family: Any, *values: str) -> Any:
        """`family.labels(*values)`, kept: ``labels()`` validates and locks on every
        call, a cost per request. Values are bounded (tenants: `_tenant`), so is this."""
        key = (id(family), *values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = family.labels(*values)
        return child

    def tenant_request(self, tenant: str, outcome: str) -> None:
        self._child(self.tenant_requests, self._tenant(tenant), outcome).inc()

    def tenant_tokens(self, tenant: str, kind: str, n: int) -> None:
        if n > 0:
            self._child(self.tenant_tokens_total, self._tenant(tenant), kind).inc(n)

    def tenant_queue_wait(self, tenant: str, seconds: float) -> None:
        self._child(self.tenant_queue_wait_seconds, self._tenant(tenant)).observe(seconds)

    def tenant_slo(self, tenant: str, target: str, met: bool) -> None:
        t = self._tenant(tenant)
        self._child(self.tenant_slo_total, t, target).inc()
        if met:
            self._child(self.tenant_slo_met, t, target).inc()

    def tenant_rate_limited(self, tenant: str, limit: str) -> None:
        self._child(self.tenant_rate_limited_total, self._tenant(tenant), limit).inc()

    def observe_prompt_estimate(self, estimated: int, actual: int, exact: bool) -> None:
        """How far the prompt count admission used was from what the engine counted."""
        if estimated > 0 and actual > 0:
            self._ratio_children[exact].observe(estimated / actual)

    def set_estimate_margin(self, model: str, margin: float) -> None:
        self._child(self.estimate_margin, model).set(margin)

    def count_prompt_count(self, how: str) -> None:
        self._child(self.prompt_counts, how).inc()

    def render(self) -> bytes:
        return generate_latest(self._exposed)
