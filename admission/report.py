"""The report: every read of the admission core, and nothing that changes it.

Metrics, the admin endpoints, the shared-state loop, benches and tests read the ledger,
the queue and what was learned through this one object (`AdmissionController.report`);
every change goes through the controller's calls, which return what they caused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from admission.fit import FitLimits
from admission.learned.limit import RunningLimit
from admission.learned.patience import Budget, ClientPatience, PatienceReading
from admission.learned.retry_budget import BudgetReading
from admission.learned.service import Plane
from admission.learned.toldwait import ToldWaitReading
from admission.ledger import Ledger
from admission.placement import Placement
from admission.replica import Replica
from admission.retries import RetryMemory
from admission.scaling import ScalingSignal
from admission.settling import Entry, Settling
from admission.shedding import Shedding
from admission.types import Admit, ReplicaUsage


@dataclass(slots=True, frozen=True)
class PoolDemand:
    """One replica as this process holds and wants it (`AdmissionReport.pool_demand`)."""

    replica: str
    usable: bool
    effective: int  # the whole effective pool, before any share
    reserved: int
    running: int
    queued_tokens: int  # queued requests' needs for the models it serves
    queued: int
    running_limit: int | None  # the learned limit within the cap (None: unbounded)
    running_cap: int | None  # the hard cap, configured or the engine's (None: none)
    share_tokens: int | None
    share_running: int | None
    models: tuple[str, ...] = ()


class AdmissionReport:
    """Read-only view of one controller's ledger, queue, shedding and learning."""

    def __init__(
        self,
        ledger: Ledger,
        queue: Settling,
        shedding: Shedding,
        placement: Placement,
        patience: ClientPatience | None = None,
        scaling: ScalingSignal | None = None,
        retries: RetryMemory | None = None,
    ) -> None:
        self._ledger = ledger
        self._retries = retries
        self._patience = patience if patience is not None else ClientPatience()
        self._queue = queue
        self._shedding = shedding
        self._placement = placement
        self._scaling = scaling if scaling is not None else ScalingSignal()

    # ------------------------------------------------------------------ clients' retries
    def retry_budget_readings(self) -> list[BudgetReading]:
        """How many attempts clients that do not say which they send were seen to make
        (admission/learned/retry_budget.py), per tenant."""
        return [] if self._retries is None else self._retries.budget.readings()

    def told_wait_readings(self) -> list[ToldWaitReading]:
        """How clients take the waits they are told (admission/learned/toldwait.py), per
        tenant and whether they say their attempt."""
        return [] if self._retries is None else self._retries.told.readings()

    # ------------------------------------------------------------------ scaling
    def desired_replicas(self, now: float) -> dict[str, int]:
        """Per model with demand seen, the replicas it needs (admission/scaling.py)."""
        out: dict[str, int] = {}
        views = self._ledger.views
        for model in self._scaling.models():
            ready = [(r.allowed, r.effective) for r in views.serving(model) if r.usable]
            n = self._scaling.desired(model, now, ready)
            if n is not None:
                out[model] = n
        return out

    # ------------------------------------------------------------------ ledger
    @property
    def top_up_failures(self) -> int:
        """Reservations a stream outgrew while its replica had no room."""
        return self._ledger.top_up_failures

    @property
    def ttft_choices(self) -> Mapping[str, int]:
        """Expected-TTFT choices between a full warm replica and a free cold one, by
        outcome (a live, read-only mapping)."""
        return MappingProxyType(self._placement.ttft_choices)

    def replica_names(self) -> list[str]:
        """Every replica the ledger knows (present, or gone with reservations left)."""
        return list(self._ledger.replicas)

    def reserved_tokens(self, replica: str | None = None) -> int:
        reps = self._ledger.replicas
        if replica is not None:
            rep = reps.get(replica)
            return rep.reserved if rep else 0
        return sum(r.reserved for r in reps.values())

    def running(self, replica: str) -> int:
        """Requests this process runs on `replica` now (0 for a replica it does not know):
        `replica_usage`'s count, without the ceilings it works out for every replica."""
        rep = self._ledger.replicas.get(replica)
        return rep.running if rep is not None else 0

    def limit_allowed(self, replica: str) -> int | None:
        """What the learned running limit lets this process run on `replica` (None
        without a learned limit): `replica_usage`'s ``limit``, read alone."""
        rep = self._ledger.replicas.get(replica)
        return _learned_allowed(rep) if rep is not None else None

    def held(self, replica: str | None = None) -> int:
        """Abandoned reservations still held."""
        if replica is None:
            return len(self._ledger.held)
        rep = self._ledger.replicas.get(replica)
        return rep.held if rep is not None else 0

    def reservation(self, request_id: str) -> Admit | None:
        """The current reservation of an admitted request."""
        res = self._ledger.reservations.get(request_id)
        if res is None:
            return None
        return Admit(res.request_id, res.replica, res.tokens + res.covered, res.budget)

    # ------------------------------------------------------------------ clients
    def patience(self, tenant: str, model: str, stream: bool = False) -> float | None:
        """The learned patience of a population of clients that state no timeout
        (seconds), or None while the configured default applies."""
        return self._patience.estimate(tenant, model, stream)

    def patience_readings(self) -> list[PatienceReading]:
        """Every population's learned patience and what it was learned from."""
        return self._patience.readings()

    def learned_patience(self) -> dict[tuple[str, str, bool], Budget | None]:
        """What this process learned itself of each population it saw (None: nothing
        yet, or dropped), the fleet's budgets left out: what it has to share."""
        p = self._patience
        return {key: p.learned(*key) for key in p.populations()}

    def models(self) -> set[str]:
        out: set[str] = set()
        for rep in self._ledger.replicas.values():
            if rep.usable:
                out.update(rep.models)
        return out

    def shares_prefix(self, model: str) -> bool:
        """Whether a replica of `model` counts prompt prefixes that running requests
        share once (its requests then carry their block hash chain)."""
        return self._ledger.views.view(model).shares_prefix

    def limit_of(self, replica: str) -> RunningLimit | None:
        """The learned running limit of `replica` (to read; `adopt_limit` changes it)."""
        rep = self._ledger.replicas.get(replica)
        return rep.limit if rep is not None else None

    def predicted_itl(self, replica: str, running_after: int) -> float | None:
        """The replica's expected inter-token gap with `running_after` running (None:
        no evidence yet); admission.learned.itl."""
        rep = self._ledger.replicas.get(replica)
        return rep.predicted_itl(running_after) if rep is not None else None

    def pool_demand(self, replica: str) -> PoolDemand | None:
        """What this process holds and wants of `replica` (the lease loop's input)."""
        rep = self._ledger.replicas.get(replica)
        if rep is None:
            return None
        queued_tokens = queued = 0
        for model in rep.models:
            queued_tokens += self._queue.tokens.get(model, 0)
            queued += self._queue.per_model.get(model, 0)
        limit = None
        if rep.limit is not None:
            limit = rep.limit.allowed(rep.cap)
        elif rep.cap is not None:
            limit = rep.cap
        return PoolDemand(
            replica=rep.name,
            usable=rep.usable,
            effective=rep.effective,
            reserved=rep.reserved,
            running=rep.running,
            queued_tokens=queued_tokens,
            queued=queued,
            running_limit=limit,
            running_cap=rep.cap,
            share_tokens=rep.share_tokens,
            share_running=rep.share_running,
            models=tuple(sorted(rep.models)),
        )

    def fit_limits(self, model: str) -> tuple[FitLimits, ...]:
        """What each replica serving `model` can ever hold, for the prompt counter's
        "could this be refused?" (`admission.fit`; replicas with no known limit left out)."""
        return tuple(
            rep.fit
            for rep in self._ledger.replicas.values()
            if rep.present
            and model in rep.models
            and (rep.capacity is not None or rep.max_model_len is not None)
        )

    def replica_usage(self) -> list[ReplicaUsage]:
        blocked_by = self._binding_ceilings()
        out = []
        for rep in self._ledger.replicas.values():
            out.append(
                ReplicaUsage(
                    name=rep.name,
                    ready=rep.usable,
                    capacity_tokens=rep.capacity or 0,
                    effective_capacity_tokens=rep.effective,
                    reserved_tokens=rep.reserved,
                    running=rep.running,
                    max_running=rep.cap,
                    binding_ceiling=blocked_by.get(rep.name, "none"),
                    models=sorted(rep.models),
                    limit=_learned_allowed(rep),
                    limit_reason=rep.limit.reason if rep.limit is not None else "",
                    held=rep.held,
                    ejected=rep.ejected,
                    service_plane=_plane(rep),
                    service_samples=len(rep.service),
                    service_elasticity=rep.service.elasticity() if len(rep.service) else None,
                )
            )
        return out

    def _binding_ceilings(self) -> dict[str, str]:
        """Which ceiling keeps each replica from taking more work right now."""
        out: dict[str, str] = {}
        head_for: dict[str, Entry] = {}
        for entry in self._queue:
            for name in self._placement.candidate_names(entry.req):
                head_for.setdefault(name, entry)
        for rep in self._ledger.replicas.values():
            if rep.ejected:
                out[rep.name] = "ejected"
            elif not rep.usable:
                out[rep.name] = "not_ready"
            elif (allowed := rep.allowed) is not None and rep.running >= allowed:
                learned = rep.cap is None or allowed < rep.cap
                out[rep.name] = "latency" if learned else "running_cap"
            elif rep.whole_running + 1 > self._ledger.peek_room(rep, self._ledger.latest):
                out[rep.name] = "deadlines"  # admission/room.py
            elif (
                rep.name in head_for
                and Ledger.need(rep, head_for[rep.name].req, self._ledger.latest)[0] > rep.free
            ):
                out[rep.name] = "kv_capacity"
            elif rep.free < rep.block_size:
                out[rep.name] = "kv_capacity"
            else:
                out[rep.name] = "none"
        return out

    # ------------------------------------------------------------------ queue
    def queued_needs(self, model: str) -> list[tuple[int, float]]:
        """Each request queued for `model`: what it needs, in tokens, and its deadline."""
        if model not in self._queue.per_model:
            return []
        return [(e.raw, e.deadline) for e in self._queue.queued.values() if e.req.model == model]

    def queue_depth(self, model: str | None = None) -> int:
        if model is not None:
            return self._queue.per_model.get(model, 0)
        return len(self._queue.queue)

    def tenant_running(self, tenant: str) -> int:
        """Admitted, not yet released requests of `tenant`."""
        return self._queue.queue.running.get(tenant, 0)

    def tenant_queued(self, tenant: str) -> int:
        """Queued requests of `tenant`."""
        return self._queue.queue.queued_of(tenant)

    # ------------------------------------------------------------------ shedding
    def retry_after(self, model: str, need_tokens: int, now: float) -> float:
        """Seconds until `need_tokens` could be admitted for `model` behind its whole
        backlog, clamped to [min_retry_after_s, max_retry_after_s] (no jitter)."""
        return self._shedding.retry_after(model, need_tokens, now)

    def returning(self) -> int:
        """Shed requests currently expected back."""
        return len(self._shedding.returning)

    def drain_rate(self, model: str, now: float) -> tuple[float, float] | None:
        """(tokens/s, requests/s) released by `model`'s ready replicas, or None while
        fewer than ``MIN_DRAIN_SAMPLES`` (admission/shedding.py) releases were seen."""
        return self._shedding.drain_rate(model, now)


def _learned_allowed(rep: Replica) -> int | None:
    """What the learned running limit lets this process run on `rep`; None without one."""
    return rep.allowed if rep.limit is not None else None


def _plane(rep: Replica) -> Plane | None:
    """`rep`'s service plane at the load it runs (what the queue's deadlines read)."""
    return rep.service.plane(rep.serving_load)
