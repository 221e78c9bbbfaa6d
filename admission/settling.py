"""The queue and its settling: what waits, in what order, and what may go now.

Queue order
    Entries are served by priority class (higher first); within a class, tenants share by
    weight in tokens (a virtual token counter: the backlogged tenant that has been served
    the fewest tokens per unit of weight goes next), and within a tenant by earliest
    deadline, where a recognised retry counts from its first attempt
    (`AdmissionRequest.arrival`: see `admission.retries`) and a client's last retry goes
    before its first attempts; `admission.fairqueue` states the order and the reasons.
    One tenant's flood therefore cannot delay another tenant's trickle beyond its fair
    share, and nobody takes the place of another tenant's retry. A tenant at its
    ``max_concurrent`` is passed over (its entries wait without blocking anyone).

Head-of-line policy: strict order per replica
    An entry that cannot be admitted blocks every replica it could ever run on, and a
    later entry may only be admitted to a replica no earlier entry is waiting for. A large
    request at the head is therefore never starved by a stream of small ones that keep
    taking the space it waits for, and requests of another model on disjoint replicas are
    not held up by it. Small requests do not backfill past a large head on the same
    replicas: EASY backfilling (a later entry starts within the room the head will have
    once the requests predicted to end first are done) was measured on the real vLLM and
    shed more than it gained there (scripts/REAL_ENGINE_NOTES.md): every entry behind the
    head waits against a deadline of its own, and passing it spends that.
    An entry routing rejects on every replica that fits it (a filter keeps none) waits
    without blocking those replicas for the entries behind it: it waits for routing's
    say, not for capacity, and it is retried on every settle until its deadline. An
    entry waiting for its tenant's ITL target holds the replicas that would meet it at a
    lighter load (`settle`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Protocol

from admission.config import AdmissionConfig
from admission.fairqueue import FairQueue
from admission.learned.patience import Budget
from admission.ledger import Ledger
from admission.placement import REJECTED, Placement
from admission.types import AdmissionRequest, Admit, Events


@dataclass(slots=True)
class Entry:
    # (-priority, 0 if last retry else 1, deadline as of first arrival, arrival, sequence):
    # the order within its tenant's lane (admission.fairqueue orders across tenants).
    key: tuple[int, int, float, float, int]
    req: AdmissionRequest
    raw: int  # the largest reservation it would hold on a replica it can use
    deadline: float
    entered: float  # when this attempt entered (a cold or learned budget counts from it)
    # True while routing rejects every replica that could take it now: it then waits
    # without blocking anyone (module docstring, Head-of-line policy).
    rejected: bool = False
    queued: bool = False  # in the queue (admission.fairqueue keeps it)
    # Queued with a stated budget before any service was seen (half of it for the queue):
    # its deadline is judged again once service is known (`Settling.rejudge_cold`).
    cold: bool = False


# Completions of a model after which its predicted service is trusted to shed a queued
# request that no longer has time to start (`Settling._late`). Before, the prediction is
# a guess from the first few requests at a load still climbing, and shedding on it cost
# the openai SDK's clients attempts they needed: at 32 in the real vLLM's regime (virtual
# time, 24 seeds) 25 more of 3,600 requests failed after three sheds in the first seconds.
_SERVICE_KNOWN = 16
# The share of a budget a request may queue for before any service was seen (half: as
# much for the queue as for its service), and the least it may queue for once predicted.
COLD_QUEUE_SHARE = 0.5
_LEAST_QUEUE_SHARE = 0.1


def queue_slack(budget: float, predicted: float) -> float:
    """How long a request with a latency `budget` may queue: what its predicted service
    leaves, at least a tenth (the prediction is an upper estimate); half of it before any
    service was seen (`predicted` 0)."""
    if predicted <= 0:
        return COLD_QUEUE_SHARE * budget
    return max(budget - predicted, _LEAST_QUEUE_SHARE * budget)


class TenantLimits(Protocol):
    """What the queue reads of a tenant (admission.tenants.TenantState has these)."""

    weight: float
    max_concurrent: int | None
    max_queued: int | None
    queue_timeout_s: float | None


class Settling:
    """The fair queue of entries waiting for room, with per-model counts, and the scan
    that admits them in order."""

    def __init__(
        self,
        config: AdmissionConfig,
        ledger: Ledger,
        placement: Placement,
        tenants: Callable[[str], TenantLimits | None] | None = None,
        predict: Callable[[AdmissionRequest], float] | None = None,
    ) -> None:
        self.config = config
        # The service prediction of a request on its model's replicas now (0: none yet).
        self._predict = predict or (lambda _req: 0.0)
        # Set by `settle` when it passed an entry that no longer has time to start (its
        # deadline is now): the caller sheds it (Shedding.expire).
        self.overdue = False
        self._ledger = ledger
        self._placement = placement
        # Tenant policies by name (weight, caps, queue timeout); None: all equal, no caps.
        self.tenant_of: Callable[[str], TenantLimits | None] = tenants or (lambda _t: None)
        self.queue: FairQueue[Entry] = FairQueue(self._weight_of)  # the order: admission.fairqueue
        self.queued: dict[str, Entry] = {}
        self.cold: dict[str, Entry] = {}  # queued entries with `cold` set
        self.per_model: dict[str, int] = {}
        self.tokens: dict[str, int] = {}  # model -> sum of queued raw needs
        self._seq = 0

    def __bool__(self) -> bool:
        return bool(self.queue)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.queue)

    # ------------------------------------------------------------------ tenants
    def set_tenants(self, tenants: Callable[[str], TenantLimits | None]) -> None:
        self.tenant_of = tenants

    def _weight_of(self, tenant: str) -> float:
        policy = self.tenant_of(tenant)
        return policy.weight if policy is not None else 1.0

    def capped(self, tenant: str) -> bool:
        """The tenant runs as many requests as it may (its entries wait, blocking nobody)."""
        policy = self.tenant_of(tenant)
        if policy is None or policy.max_concurrent is None:
            return False
        return self.queue.running.get(tenant, 0) >= policy.max_concurrent

    # ------------------------------------------------------------------ entries
    def entry(self, req: AdmissionRequest, raw: int, predicted: float, now: float) -> Entry:
        """The queue entry of `req`, with the deadline it may wait until.

        A client that said how long it waits (its read timeout), or whose patience was
        learned, queues only while the predicted service (`predicted`, an upper estimate
        at the load the replica runs; a stream: its first token) still fits after the
        wait: the queue takes what service leaves, not a fixed share, since in a closed
        loop the clients' time is set by throughput and the learned limit keeps service
        itself inside the budget. Before any service was seen it may queue for half its
        budget. A request predicted to need (nearly) all of it still queues briefly
        (a tenth): the prediction is an upper estimate, and shedding it forever helps
        nobody. A client that says nothing, whose patience is not learned yet, has no
        deadline unless one is configured (the tenant's queue timeout first): it waits
        until it starts or leaves, and its leaving teaches its population's patience."""
        start = req.arrival if req.budget_from_first else now
        if req.latency_budget is not None:
            deadline = min(req.deadline, start + queue_slack(req.latency_budget, predicted))
        else:
            policy = self.tenant_of(req.tenant)
            timeout = self.config.queue_timeout_s
            if policy is not None and policy.queue_timeout_s is not None:
                timeout = policy.queue_timeout_s  # the tenant's own replaces the default
            deadline = req.deadline if timeout is None else min(req.deadline, now + timeout)
        # Within its tenant: earliest deadline first, as of its first arrival (a retry
        # keeps its place); admission.fairqueue orders the tenants.
        edf = deadline - max(0.0, start - req.arrival) if math.isfinite(deadline) else math.inf
        entry = Entry(
            (-req.priority, 0 if req.last_retry else 1, edf, req.arrival, self._seq),
            req,
            raw,
            deadline,
            now,
            cold=req.latency_budget is not None and predicted <= 0,
        )
        self._seq += 1
        return entry

    def rejudge_cold(self, predict: Callable[[AdmissionRequest], float]) -> None:
        """Entries queued before any service was seen were given half their budget; once
        the model's service is predicted, each gets the deadline `entry` would give it
        now (from when it entered), if sooner: the first wave of a cold start otherwise
        starts requests late in their budget that the now-known service cannot finish
        in it."""
        for entry in list(self.cold.values()):
            predicted = predict(entry.req)
            if predicted <= 0:
                continue
            del self.cold[entry.req.request_id]
            entry.cold = False
            budget = entry.req.latency_budget
            assert budget is not None
            start = entry.req.arrival if entry.req.budget_from_first else entry.entered
            self.queue.tighten(entry, start + queue_slack(budget, predicted))

    def rejudge_unstated(
        self,
        population: tuple[str, str, bool],
        budget: Budget,
        predict: Callable[[AdmissionRequest], float],
    ) -> None:
        """The patience of a population (tenant, model, stream) was learned, or learned
        shorter: its queued entries that stated nothing take it as their budget, and the
        deadline `entry` would give them now, counted from when they entered. Else the
        wave that taught it waits on under the default queue timeout, and each of its
        clients leaves at the patience just learned instead of being shed with a
        Retry-After while it still could come back in time."""
        for entry in self.queued.values():
            req = entry.req
            if (req.tenant, req.model, req.stream) != population:
                continue
            if not req.budget_learned and (
                req.latency_budget is not None or math.isfinite(req.deadline)
            ):
                continue  # its client stated its timeout or a deadline: believed first
            if req.latency_budget is not None and req.latency_budget <= budget.seconds:
                continue
            req = entry.req = replace(
                req, latency_budget=budget.seconds, budget_learned=True, budget_whole=budget.whole
            )
            slack = queue_slack(budget.seconds, predict(req))
            self.queue.tighten(entry, entry.entered + slack)

    def enqueue(self, entry: Entry) -> None:
        self.queue.insert(entry)
        self.queued[entry.req.request_id] = entry
        if entry.cold:
            self.cold[entry.req.request_id] = entry
        model = entry.req.model
        self.per_model[model] = self.per_model.get(model, 0) + 1
        self.tokens[model] = self.tokens.get(model, 0) + entry.raw

    def dequeue(self, entry: Entry) -> None:
        self.queue.remove(entry)
        del self.queued[entry.req.request_id]
        self.cold.pop(entry.req.request_id, None)
        model = entry.req.model
        left = self.per_model[model] - 1
        if left:
            self.per_model[model] = left
            self.tokens[model] -= entry.raw
        else:
            del self.per_model[model]
            del self.tokens[model]

    def admit_alone(self, entry: Entry, now: float) -> Admit | None:
        """With nothing queued: admit `entry` at once if its tenant may run more and a
        replica takes it (else None, and `entry.rejected` says whether routing refused)."""
        if self.capped(entry.req.tenant):
            return None
        admit = self._placement.place(entry, set(), now)
        if isinstance(admit, Admit):
            self.queue.admitted(entry.req, self._ledger.replicas[admit.replica].running)
            return admit
        entry.rejected = admit is REJECTED
        return None

    # ------------------------------------------------------------------ settling
    def settle(self, now: float) -> Events:
        """Admit queued entries in order until every usable replica is blocked; returns
        the admissions (as the `Events` of the call that settled).

        An entry routing rejected on every replica that fits it waits without blocking
        them: it waits for routing's say, not for their capacity. Except for an ITL
        target: an entry no replica meets now, but that a replica would meet with fewer
        running (its ITL model says so at one running), blocks those replicas like an
        entry waiting for room: their load must fall for it, and letting the entries
        behind it in, as a filter's rejection would, keeps the load up and starves it."""
        if not self.queue:
            return []
        replicas = self._ledger.replicas
        usable = {r.name for r in replicas.values() if r.usable}
        blocked: set[str] = set()
        admitted: Events = []
        for entry in self.queue.visit(self.capped):
            if usable <= blocked:
                break
            if self._late(entry, now):
                continue
            admit = self._placement.place(entry, blocked, now)
            if isinstance(admit, Admit):
                self.dequeue(entry)
                self.queue.admitted(entry.req, replicas[admit.replica].running)
                admitted.append(admit)
            elif admit is REJECTED:
                held = self._slo_holds(entry)
                entry.rejected = not held
                blocked.update(held)
            else:
                entry.rejected = False
                blocked.update(self._placement.candidate_names(entry.req))
        return admitted

    def _late(self, entry: Entry, now: float) -> bool:
        """Whether `entry` has, by the service predicted now, no time left to start: its
        deadline is tightened to what `entry` would give it now (counted from when it
        entered), and it is passed over for a shed with a Retry-After that gives its
        client a whole budget again. Its deadline was set by the prediction when it
        entered; while it waited, the load may have grown (a probe, a limit raised) and
        service with it, and starting it then loses it to its client's timeout (the demo
        lost 1 of 738 so in a third of its runs). Only once the model's service is known
        (`_SERVICE_KNOWN`)."""
        req = entry.req
        if req.latency_budget is None:
            return False
        if not self._service_known(req.model):
            return False
        predicted = self._predict(req)
        if predicted <= 0:
            return False
        deadline = entry.entered + queue_slack(req.latency_budget, predicted)
        if deadline >= entry.deadline:
            return False
        self.queue.tighten(entry, deadline)
        if deadline > now:
            return False
        self.overdue = True
        return True

    def _service_known(self, model: str) -> bool:
        """Whether `model`'s replicas have completed `_SERVICE_KNOWN` requests between
        them (the samples its prediction is fitted to). On the settle path: stops at the
        first replica that has them all, so a warm model costs one look, not a pass over
        its replicas."""
        seen = 0
        for rep in self._ledger.views.serving(model):
            seen += len(rep.service)
            if seen >= _SERVICE_KNOWN:
                return True
        return False

    def _slo_holds(self, entry: Entry) -> set[str]:
        """Replicas a routing-rejected entry with an ITL target waits for: those that
        would meet the target with one request running (`settle`)."""
        target = entry.req.itl_target_s
        if not target:
            return set()
        out = set()
        replicas = self._ledger.replicas
        for name in self._placement.candidate_names(entry.req):
            alone = replicas[name].predicted_itl(1)
            if alone is not None and alone <= target:
                out.add(name)
        return out
