"""The sans-IO admission controller: a per-replica KV ledger, a bounded deadline-aware
queue, and the admit / queue / shed / refuse verdicts.

The controller never reads a clock, sleeps or does IO: every method takes `now`, and the
gateway shell acts on what it returns. The shell keeps `ReplicaState` current from the
engine adapters and passes it to `upsert_replica`; it calls `submit` per request, and
`release` (always, in a ``finally``) when the request ends, whatever the outcome.

Ledger
    Each admitted request holds a reservation on one replica, rounded up to that replica's
    block size ``bs``, sized by what the engine does when its pool is over-admitted
    (``ReplicaState.preempts``, set by its adapter):

    - an engine that preempts (vLLM recomputes, SGLang retracts) turns an under-estimate
      into a slowdown, not a failure: the reservation is ``prompt + expected_output``
      (a learned quantile of the model's outputs within ``max_tokens``), topped up as a
      stream outgrows it, and the learned running limit watches the preemptions;
    - an engine that does not preempt (llama.cpp) fails every running request when its
      pool overruns: the reservation is what the request may use, ``prompt + max_tokens``
      within its slot's context (``max_model_len``), or that whole context when the client
      set no ``max_tokens``. A request larger than the effective pool takes all of it: it
      runs alone, which such an engine survives. Such an engine serves a request whose
      ``max_tokens`` runs past the context (it stops at the context's end), so only a
      prompt that leaves no room to generate is refused there.

    Shared prefixes: on an engine that keeps one copy of a prompt prefix its running
    requests share (``ReplicaState.shares_prefix``: vLLM's prefix caching, SGLang's radix
    cache), a reservation pins its prompt's block hash chain there and holds its need
    less the prefix blocks already pinned and computed, which are counted once however
    many pin them (admission/prefixshare.py states the bounds that keep this at or above
    what the engine holds). A request admitted while another still computes the same
    prefix pays for its whole prompt, as the engine computes its own copy.

    The sum of reservations on a replica never exceeds its effective pool
    ``floor(capacity * (1 - headroom))`` because of an admission or a top-up (invariant
    3); it can exceed it only when the pool itself shrinks, and then nothing more is
    admitted there until enough is released. A pool of private slots (llama.cpp per-slot
    KV, ``ReplicaState.private_slots``) cannot be overrun and keeps no headroom. The number
    of reservations never exceeds the replica's running cap.

Abandoned requests
    A non-stream request kvgate stops waiting for (its client left, or the upstream timed
    out) may still be generating: llama-server notices a gone client only after a quiet
    second, and on a busy server not at all. `abandon` keeps its reservation *held* until
    a discovery round that began after the abandonment shows the engine running no more
    requests than kvgate's live ones (``ReplicaState.engine_running``), or until
    ``abandoned_hold_s`` has passed (`expire`); then it is released as by `release`.

Queue order and head-of-line policy
    Entries are served by priority class (higher first); within a class, tenants share by
    weight in tokens (a virtual token counter: the backlogged tenant that has been served
    the fewest tokens per unit of weight goes next), and within a tenant by earliest
    deadline, where a recognised retry counts from its first attempt
    (`AdmissionRequest.arrival`: see `admission.retries`) and a client's last retry goes
    before its first attempts; `admission.fairqueue` states the order and the reasons.
    One tenant's flood therefore cannot delay another tenant's trickle beyond its fair
    share, and nobody takes the place of another tenant's retry. A tenant at its
    ``max_concurrent`` is passed over (its entries wait without blocking anyone); one at
    its ``max_queued`` is answered 429. The policy on that order is *strict order per
    replica*: an entry that cannot be admitted blocks every
    replica it could ever run on, and a later entry may only be admitted to a replica no
    earlier entry is waiting for. A large request at the head is therefore never starved
    by a stream of small ones that keep taking the space it waits for, and requests of
    another model on disjoint replicas are not held up by it. Small requests do not
    backfill past a large head on the same replicas: without trustworthy run-time
    estimates, any backfill could delay the head. A full queue sheds the newcomer
    whatever its priority, unless its tenant holds less than its weighted share of the
    model's queue slots: then the last entry of the tenant most over its share gives way
    (shed 503 with Retry-After), so a flood cannot crowd a trickle out of the queue. An
    entry waiting for its tenant's ITL target holds the replicas that would meet it at a
    lighter load (see `_settle`).
    `Queued.position` counts the entries of the same model expected to be served before
    it (0 = head): higher classes, its own tenant's earlier entries, and what the other
    tenants' counters let through before its turn.

    Where an admitted request goes is routing's decision (the `Router` handed in: the
    gateway builds it from the config's profiles, `routing.scheduler`); admission tells it
    when it places a request and when it frees it (the ``placed`` / ``released`` hooks).
    Routing is handed a shortlist, not every replica: the few with the most headroom in
    per-model orders kept on every reserve and release, plus the ones routing names
    (admission/candidates.py), so a decision costs the same at 4 and 256 replicas. When
    routing's warmest replica for a prompt is full and it chose a colder free one, the
    request waits for the warm one if that is expected to give its first token sooner
    (`_wait_for_warm`).
    An entry routing rejects on every replica that fits it (a filter keeps none) waits
    without blocking those replicas for the entries behind it: it waits for routing's
    say, not for capacity, and it is retried on every settle until its deadline.

Shedding and Retry-After
    The wait for a request is estimated as its deficit (tokens, and running slots, that
    must free before it fits, counting the queue ahead of it for the same model) divided
    by the drain rate of the model's replicas (`admission.drain.DrainMeter`). A request is
    shed at submit (503) when the queue is full or the estimated wait exceeds the time to
    its deadline, so it is never held only to time out later. With fewer than
    ``min_drain_samples`` releases observed there is no evidence to shed on: the request
    is queued (its deadline still bounds the wait) and Retry-After is the documented
    ``cold_retry_after_s``. The delay is clamped to [min_retry_after_s, max_retry_after_s]
    (by default [1, 60] s).

Expiry
    `expire(now)` sheds entries past their deadline (reason ``queue_timeout``) or whose
    re-estimated wait no longer meets it (``deadline``). Removing them may unblock
    entries behind; those admissions are returned by the next `release`,
    `upsert_replica`, `remove_replica` or `pump` (the shell's ``finally: release(id)``
    of the shed request delivers them at once).

Refusals (never queued)
    404 ``model_not_found`` when no known replica serves the model; 400
    ``context_length_exceeded`` when, on every replica whose limits are known, prompt +
    max_tokens exceeds ``max_model_len`` (an engine that does not preempt: the prompt
    leaves no room to generate) or the KV need exceeds the effective pool.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Protocol

from admission.candidates import HeadroomIndex, PredictMax
from admission.config import AdmissionConfig
from admission.drain import DrainMeter
from admission.estimate import ServiceModel
from admission.fairqueue import FairQueue
from admission.itl import ItlModel
from admission.limit import LatencyTargets, LimitSettings, RunningLimit, latency_ratio
from admission.prefixshare import SharedPrefixes
from admission.retries import ReturningBacklog
from admission.types import (
    AdmissionRequest,
    Admit,
    Completion,
    Queued,
    Refuse,
    ReplicaUsage,
    Shed,
    Verdict,
)
from routing.types import Candidate, ReplicaState, Router, RouteRequest

_POOL_MEMORY_S = 300.0  # how long a pool measured smaller than configured is kept


def round_up(tokens: int, block_size: int) -> int:
    """`tokens` rounded up to a whole number of `block_size` blocks."""
    bs = max(1, block_size)
    return -(-max(0, tokens) // bs) * bs


@dataclass(slots=True)
class _Replica:
    name: str
    drain: DrainMeter
    present: bool = True  # False after remove_replica (kept while reservations remain)
    ready: bool = False
    ejected: bool = False  # outlier ejection (set_ejected): out of service, ready or not
    models: frozenset[str] = frozenset()
    capacity: int | None = None
    block_size: int = 16
    max_model_len: int | None = None
    cap: int | None = None  # running-request cap from config or engine (an upper bound)
    limit: RunningLimit | None = None  # the learned running limit (None: not learning)
    labels: dict[str, str] = field(default_factory=dict)
    preempts: bool = True  # see the module docstring, Ledger
    private_slots: bool = False
    # The prompt prefixes its reservations pin (module docstring, Ledger); None when the
    # engine does not share them. `reserved` includes their tokens.
    prefixes: SharedPrefixes | None = None
    sharing: bool = False  # its engine shares prefixes now (new requests get the credit)
    reserved: int = 0
    running: int = 0  # reservations, held ones included
    held: int = 0  # abandoned reservations waiting for the engine to stop
    judged_at: float | None = None  # `running_seen_at` of the view held ones were judged by
    effective: int = 0
    signals_at: float = -1.0  # `updated_at` of the engine view last fed to the limit
    # The pool as the engine's KV usage shows it, when smaller than the configured one:
    # (bound in tokens, rounds in a row below, time last confirmed).
    measured_pool: int | None = None
    below_rounds: int = 0
    measured_at: float = 0.0
    # Service (and time to first token) against tokens, for the deadline of a queued request.
    service: ServiceModel = field(default_factory=ServiceModel)
    ttft: ServiceModel = field(default_factory=ServiceModel)
    # Mean inter-token gap of streams by the number running (admission.itl): the
    # `Candidate.predicted_itl_s` of a request with an ITL target (None: no evidence).
    itl: ItlModel | None = None
    # This process's lease of the replica when several gateways share it (`set_pool_share`):
    # KV tokens and running requests it may hold; None: the whole replica.
    share_tokens: int | None = None
    share_running: int | None = None
    # The routing view of this replica, refreshed in place (engine gauges at upsert,
    # ledger fields at each decision) instead of rebuilt per call.
    cand: Candidate = field(default_factory=lambda: Candidate("", 0, 0, 0, None))
    view_at: float = 0.0  # `updated_at` of the engine view in `cand`
    # The last `tokens_for` answer, by the request fields it reads (cleared by upsert,
    # which sets everything else it reads): one decision asks it several times.
    memo_key: tuple[int, int, int, bool] | None = None
    memo_tokens: int = 0
    # The last `_need` answer of a fit check (request id, time, tokens, shared blocks):
    # the admission that follows in the same decision reuses it.
    need_memo: tuple[str, float, int, int] | None = None
    # What the per-model views (`_View`) group and filter this replica by; a change
    # rebuilds them (`_replica_changed`).
    sig: tuple[object, ...] | None = None

    def shape(self) -> tuple[object, ...]:
        """What the fit checks (`can_ever_fit`, `tokens_for`) read besides the request."""
        return (
            self.capacity is None,
            self.effective,
            self.block_size,
            self.max_model_len,
            self.preempts,
            self.private_slots,
        )

    @property
    def allowed(self) -> int | None:
        """Requests that may run at once: the learned limit within the hard cap (and
        within this process's leased share of it)."""
        allowed = self.cap if self.limit is None else self.limit.allowed(self.cap)
        if self.share_running is not None:
            return self.share_running if allowed is None else min(allowed, self.share_running)
        return allowed

    @property
    def usable(self) -> bool:
        """May receive new requests: present, ready, not ejected and with a known pool."""
        return self.present and self.ready and not self.ejected and self.capacity is not None

    @property
    def free(self) -> int:
        if self.share_tokens is not None:  # this process's leased slice of the pool
            return min(self.effective, self.share_tokens) - self.reserved
        return self.effective - self.reserved

    def need(self, raw_tokens: int) -> int:
        return round_up(raw_tokens, self.block_size)

    def tokens_for(self, req: AdmissionRequest) -> int:
        """The reservation `req` would hold here (module docstring, Ledger)."""
        key = (req.prompt_tokens, req.expected_output, req.max_tokens, req.max_tokens_given)
        if key == self.memo_key:
            return self.memo_tokens
        tokens = self._tokens_for(req)
        self.memo_key = key
        self.memo_tokens = tokens
        return tokens

    def _tokens_for(self, req: AdmissionRequest) -> int:
        prompt = max(1, req.prompt_tokens)
        if self.preempts:
            return self.need(prompt + max(0, req.expected_output))
        most = prompt + max(1, req.max_tokens) if req.max_tokens_given else None
        if self.max_model_len is not None:
            most = self.max_model_len if most is None else min(most, self.max_model_len)
        if most is None:  # nothing bounds the output here: the best estimate there is
            most = prompt + max(0, req.expected_output)
        tokens = self.need(most)
        if self.capacity is not None and not self.private_slots:
            whole = self.effective // self.block_size * self.block_size
            if whole >= self.block_size:
                tokens = min(tokens, whole)  # alone in the pool it cannot overrun it
        return tokens

    def context_needed(self, req: AdmissionRequest) -> int:
        """What `req` needs of the replica's context: prompt + max_tokens, which vLLM and
        SGLang refuse when over it; llama.cpp refuses only a prompt that leaves no room
        to generate and stops the rest at the context's end (finish reason ``length``)."""
        if self.preempts:
            return req.prompt_tokens + req.max_tokens
        return req.prompt_tokens + 1

    def can_ever_fit(self, req: AdmissionRequest) -> bool:
        if self.max_model_len is not None and self.context_needed(req) > self.max_model_len:
            return False
        return self.capacity is None or self.tokens_for(req) <= self.effective


@dataclass(slots=True, frozen=True)
class _WaitContext:
    """What a wait estimate needs about a model's ready replicas, computed once per call."""

    tokens_per_s: float
    requests_per_s: float
    block_sizes: frozenset[int]
    free_sum: int
    free_max: int
    free_slots: int | None  # None when some replica has no running cap


@dataclass(slots=True)
class _Reservation:
    request_id: str
    replica: str
    model: str
    tokens: int  # its private part: the prefix blocks it pins are counted once, apart
    admitted_at: float
    pins: tuple[int, ...] = ()  # the prefix block hashes it pins on its replica
    covered: int = 0  # tokens of its need that those pinned blocks hold
    # Set by `abandon`: since when, until when at most, and what to learn on release.
    held_since: float | None = None
    held_until: float = math.inf
    completion: Completion | None = None


@dataclass(slots=True)
class _Entry:
    # (-priority, 0 if last retry else 1, deadline as of first arrival, arrival, sequence):
    # the order within its tenant's lane (admission.fairqueue orders across tenants).
    key: tuple[int, int, float, float, int]
    req: AdmissionRequest
    raw: int  # the largest reservation it would hold on a replica it can use
    deadline: float
    # True while routing rejects every replica that could take it now: it then waits
    # without blocking anyone (module docstring, Queue order).
    rejected: bool = False
    queued: bool = False  # in the queue (admission.fairqueue keeps it)


class TenantLimits(Protocol):
    """What the queue reads of a tenant (admission.tenants.TenantState has these)."""

    weight: float
    max_concurrent: int | None
    max_queued: int | None
    queue_timeout_s: float | None


@dataclass(slots=True, frozen=True)
class PoolDemand:
    """One replica as this process holds and wants it (`AdmissionController.pool_demand`)."""

    replica: str
    usable: bool
    effective: int  # the whole effective pool, before any share
    reserved: int
    running: int
    queued_tokens: int  # queued requests' needs for the models it serves
    queued: int
    running_limit: int | None  # the learned limit within the cap (None: unbounded)
    share_tokens: int | None
    share_running: int | None


# `_try_admit`'s answer when replicas fit but routing's filters rejected them all.
_REJECTED = object()

# Replicas shortlisted from each headroom order per decision (admission/candidates.py).
SHORTLIST_PER_ORDER = 4


@dataclass(slots=True)
class _View:
    """One model's replicas as a decision reads them, kept incrementally
    (admission/candidates.py): rebuilt only when a replica's shape, readiness or
    membership changes; its orders and predictions follow every reserve and release."""

    present: list[_Replica]
    known_shapes: list[_Replica]  # one present replica per shape, with a known limit
    usable_shapes: list[_Replica]  # one usable replica per shape
    order: HeadroomIndex
    ttft: PredictMax
    service: PredictMax
    dirty: set[str]  # replicas whose predicted lines are to be refreshed
    shares_prefix: bool  # some replica counts shared prefixes (admission.prefixshare)


class AdmissionController:
    """Admits requests to replicas whose KV pool fits them; queues or sheds the rest."""

    def __init__(
        self,
        config: AdmissionConfig,
        picker: Router,
        *,
        seed: int | None = None,
        tenants: Callable[[str], TenantLimits | None] | None = None,
    ) -> None:
        self.config = config
        # Where a request goes is routing's decision (routing.scheduler builds it from the
        # config's profiles, a test or bench hands one in); admission only calls it and its
        # hooks, and imports routing's types, never its policies.
        self._picker: Router = picker
        self._placed_hook = getattr(self._picker, "placed", None)
        self._released_hook = getattr(self._picker, "released", None)
        self._replicas: dict[str, _Replica] = {}
        self._by_model: dict[str, list[_Replica]] | None = None  # None: rebuild on use
        self._views: dict[str, _View] = {}  # model -> its view; cleared on a change
        self._views_of: object = None  # the `_by_model` index the views were built on
        self._hints_hook = getattr(self._picker, "hints", None)
        self._warm_hook = getattr(self._picker, "warm", None)
        # Expected-TTFT choices between a full warm replica and a free cold one
        # (`_wait_for_warm`), by outcome: exported beside routing's decisions.
        self.ttft_choices: dict[str, int] = {}
        self._reservations: dict[str, _Reservation] = {}
        self._held: dict[str, _Reservation] = {}  # abandoned, in order of abandonment
        # Tenant policies by name (weight, caps, queue timeout); None: all equal, no caps.
        self._tenant_of: Callable[[str], TenantLimits | None] = tenants or (lambda _t: None)
        self._queue = FairQueue(self._weight_of)  # the order: admission.fairqueue
        self._queued: dict[str, _Entry] = {}
        self._queue_per_model: dict[str, int] = {}
        self._queue_tokens: dict[str, int] = {}  # model -> sum of queued raw needs
        self._seq = 0
        self._pending: list[Admit] = []  # admitted by expire(); handed out by the next call
        self._returning = ReturningBacklog()  # shed requests expected back
        # Entries a full queue gave up for another tenant's newcomer (fair share of the
        # queue): handed out by `take_displaced` (the shell calls it after each submit),
        # else by the next `expire`, which `next_deadline` makes due at once.
        self._displaced: list[Shed] = []
        self._rng = random.Random(seed)  # Retry-After jitter
        self._now = 0.0
        self._limit_settings = LimitSettings(
            initial=config.initial_limit,
            window=config.limit_window,
            knee_efficiency=config.knee_efficiency,
            budget_fraction=config.latency_budget_fraction,
            probe_step=config.limit_probe_step,
            target_quantile=config.latency_target_quantile,
        )
        self._targets = {
            model: LatencyTargets(t.ttft_s, t.itl_s, t.e2e_s)
            for model, t in config.latency_targets.items()
        }
        # Reservations a stream outgrew while its replica had no room (exported by the shell).
        self.top_up_failures = 0

    @property
    def router(self) -> Router:
        """The routing policy admission asks where an admitted request goes."""
        return self._picker

    # ------------------------------------------------------------------ replicas
    def upsert_replica(
        self,
        state: ReplicaState,
        now: float,
        *,
        pinned_capacity: int | None = None,
        max_running: int | None = None,
    ) -> list[Admit]:
        """Add or refresh a replica from its adapter-maintained state.

        Capacity is `pinned_capacity` when given, else ``state.capacity_tokens``; the
        running cap is `max_running`, else the engine's ``state.max_running``, else
        ``default_max_running``. A replica that is not ready or whose capacity is unknown
        receives nothing. Returns requests admitted from the queue because capacity grew.
        """
        self._now = max(self._now, now)
        rep = self._replicas.get(state.name)
        if rep is None:
            rep = self._replicas[state.name] = _Replica(
                name=state.name, drain=DrainMeter(self.config.drain_window_s)
            )
            if self.config.learn_limit:
                rep.limit = RunningLimit(self._limit_settings, now)
        if not rep.present or rep.models != frozenset(state.models):
            self._by_model = None
        rep.present = True
        rep.memo_key = None
        rep.models = frozenset(state.models)
        rep.capacity = pinned_capacity if pinned_capacity is not None else state.capacity_tokens
        rep.ready = bool(state.ready) and rep.capacity is not None
        rep.block_size = max(1, state.block_size)
        rep.max_model_len = state.max_model_len
        if max_running is not None:
            rep.cap = max_running
        elif state.max_running is not None:
            rep.cap = state.max_running
        else:
            rep.cap = self.config.default_max_running
        rep.labels = dict(state.labels)
        c = rep.cand
        c.name = rep.name
        c.labels = rep.labels
        c.block_size = rep.block_size
        c.engine_running = state.engine_running
        c.engine_waiting = state.engine_waiting
        c.kv_usage = state.kv_usage
        c.preemptions_total = state.preemptions_total
        c.prefix_cache_queries_total = state.prefix_cache_queries_total
        c.prefix_cache_hits_total = state.prefix_cache_hits_total
        c.spec_draft_tokens_total = state.spec_draft_tokens_total
        c.spec_accepted_tokens_total = state.spec_accepted_tokens_total
        # Speculation: a configured `speculative` label wins over what the engine says.
        label = rep.labels.get("speculative", "").strip().lower()
        if label in ("true", "1", "yes", "on"):
            c.speculative = True
        elif label in ("false", "0", "no", "off"):
            c.speculative = False
        else:
            c.speculative = bool(state.speculative)
        c.spec_num_draft_tokens = state.spec_num_draft_tokens
        c.spec_drafts_total = state.spec_drafts_total
        c.spec_accept_length = state.spec_accept_length
        c.itl_sum_s = state.itl_sum_s
        c.itl_count = state.itl_count
        rep.view_at = state.updated_at
        rep.preempts = state.preempts
        rep.private_slots = state.private_slots
        rep.sharing = state.shares_prefix and self.config.share_prefix and not rep.private_slots
        if rep.sharing and rep.prefixes is None:
            rep.prefixes = SharedPrefixes()
        elif not rep.sharing and rep.prefixes is not None and not len(rep.prefixes):
            rep.prefixes = None  # pins left are released with their reservations
        fresh = state.updated_at != rep.signals_at
        if fresh and rep.capacity is not None:
            self._check_pool(rep, state.kv_usage, now)
        pool = rep.capacity
        if pool is not None and rep.measured_pool is not None:
            pool = min(pool, rep.measured_pool)
        if not pool:
            rep.effective = 0
        elif rep.private_slots:
            rep.effective = pool
        else:
            rep.effective = math.floor(pool * (1.0 - self.config.headroom))
        if rep.held:
            self._release_stopped(rep, state, now)
        if rep.limit is not None and fresh:
            rep.signals_at = state.updated_at
            rep.limit.engine_signals(
                preemptions_total=state.preemptions_total,
                waiting=state.engine_waiting,
                engine_running=state.engine_running,
                kv_usage=state.kv_usage,
                running=rep.running,
                now=now,
                cap=rep.cap,
            )
        self._replica_changed(rep)
        return self._flush(self._settle(now))

    def remove_replica(self, name: str, now: float) -> list[Admit]:
        """Forget a replica. Its reservations stay in the ledger until released; queued
        requests are kept for the remaining replicas."""
        self._now = max(self._now, now)
        rep = self._replicas.get(name)
        if rep is not None:
            rep.present = False
            rep.ready = False
            self._by_model = None
            if rep.running == 0:
                del self._replicas[name]
            self._replica_changed(rep)
        return self._flush(self._settle(now))

    def mark_unready(self, name: str, now: float) -> None:
        """Stop sending new requests to `name` (e.g. connection refused) until an upsert
        says it is ready again. Existing reservations stay until released."""
        self._now = max(self._now, now)
        rep = self._replicas.get(name)
        if rep is not None:
            rep.ready = False
            self._replica_changed(rep)

    def set_ejected(self, name: str, ejected: bool, now: float) -> list[Admit]:
        """Eject `name` (outlier detection: no new requests, whatever discovery says) or
        return it to service. Its reservations stay until released, as their requests
        end. Returns requests admitted from the queue because a replica returned."""
        self._now = max(self._now, now)
        rep = self._replicas.get(name)
        if rep is None or rep.ejected == ejected:
            return []
        rep.ejected = ejected
        self._replica_changed(rep)
        return self._flush(self._settle(now))

    # ------------------------------------------------------------------ requests
    def submit(self, req: AdmissionRequest, now: float) -> Verdict:
        """Decide one request: Admit now, Queue, Shed (503) or Refuse (400/404)."""
        self._now = max(self._now, now)
        rid = req.request_id
        if rid in self._reservations or rid in self._queued:
            raise ValueError(f"request id {rid!r} is already admitted or queued")
        if req.retry_key is not None:
            self._returning.discard(req.model, req.retry_key)  # it is back
        view = self._view(req.model)
        if not view.present:
            return Refuse(rid, 404, "model_not_found", f"The model `{req.model}` does not exist.")
        # One replica per shape answers for all of that shape (admission/candidates.py).
        if view.known_shapes and not any(r.can_ever_fit(req) for r in view.known_shapes):
            known = [
                r for r in view.present if r.capacity is not None or r.max_model_len is not None
            ]
            clamped = None if req.prompt_exact else self._clamp_estimate(req, known)
            if clamped is None:
                return self._refuse_too_long(req, known)
            req = clamped
        raw = 0
        for r in view.usable_shapes:
            if r.can_ever_fit(req):
                raw = max(raw, r.tokens_for(req))
        if not raw:
            return Shed(rid, "no_replica", self._clamp(None))

        if req.latency_budget is not None:
            # The client said how long it waits (its read timeout): queue only while the
            # predicted service (a stream: its first token) still fits after the wait.
            # The configured queue timeout is the default for clients that say nothing.
            # It may queue for the part of the budget the learned limit does not give to
            # service (1 - latency_budget_fraction), and less when its own predicted
            # service leaves less; a request predicted to need (nearly) all of it still
            # queues briefly: the prediction is an upper estimate, and shedding it
            # forever helps nobody.
            budget = req.latency_budget
            share = (1.0 - self.config.latency_budget_fraction) * budget
            slack = max(min(share, budget - self._predict(req, view)), 0.1 * budget)
            deadline = min(req.deadline, now + slack)
        else:
            policy = self._tenant_of(req.tenant)
            timeout = self.config.queue_timeout_s
            if policy is not None and policy.queue_timeout_s is not None:
                timeout = policy.queue_timeout_s  # the tenant's own replaces the default
            deadline = min(req.deadline, now + timeout)
        # Within its tenant: earliest deadline first, as of its first arrival (a retry
        # keeps its place); admission.fairqueue orders the tenants.
        edf = deadline - max(0.0, now - req.arrival) if math.isfinite(deadline) else math.inf
        entry = _Entry(
            (-req.priority, 0 if req.last_retry else 1, edf, req.arrival, self._seq),
            req,
            raw,
            deadline,
        )
        self._seq += 1
        if self._queue:
            # Queue it and scan in order: the fair order decides what comes before it,
            # and strict order per replica what it may pass.
            self._enqueue(entry)
            admits = self._settle(now)
            mine: Admit | None = None
            for a in admits:
                if a.request_id == rid:
                    mine = a
                else:
                    self._pending.append(a)
            if mine is not None:
                return mine
        else:
            if not self._capped(req.tenant):
                admit = self._try_admit(entry, set(), now)
                if isinstance(admit, Admit):
                    self._queue.admitted(req, self._replicas[admit.replica].running)
                    return admit
                entry.rejected = admit is _REJECTED
            self._enqueue(entry)

        model = req.model
        model_depth = self._queue_per_model.get(model, 0) - 1  # others of its model
        # Shed requests that will come back before this one count ahead of it (not ahead
        # of a last retry, which queues before them).
        back_tokens, back_count = (
            (0, 0) if req.last_retry else self._returning.ahead(model, req.arrival, now, req.tenant)
        )
        policy = self._tenant_of(req.tenant)
        if (
            policy is not None
            and policy.max_queued is not None
            and self._queue.queued_of(req.tenant) > policy.max_queued
        ):
            # The tenant's own queue is full: a 429 naming the limit it hit.
            capped = self._capped(req.tenant)
            self._dequeue(entry)
            wait = self._wait_for(
                self._wait_context(model, now),
                raw,
                self._queue_tokens.get(model, 0) + back_tokens,
                self._queue_per_model.get(model, 0) + back_count,
            )
            shed = self._shed(req, raw, "tenant_queue", wait, now, now)
            reason = "tenant_concurrency" if capped else "tenant_queue"
            return replace(shed, reason=reason, status=429)
        if model_depth >= self.config.queue_max_per_model:
            victim = self._queue.victim(entry, self.config.queue_max_per_model)
            if victim is not None:
                # The newcomer's tenant holds less than its weighted share of the queue:
                # the last entry of the tenant most over its share gives way.
                self._dequeue(victim)
                vwait = self._wait_for(
                    self._wait_context(model, now),
                    victim.raw,
                    self._queue_tokens.get(model, 0),
                    self._queue_per_model.get(model, 0),
                )
                self._displaced.append(
                    self._shed(victim.req, victim.raw, "queue_full", vwait, now, now)
                )
                model_depth -= 1
        if model_depth >= self.config.queue_max_per_model:
            self._dequeue(entry)
            wait = self._wait_for(
                self._wait_context(model, now),
                raw,
                self._queue_tokens.get(model, 0) + back_tokens,
                model_depth + back_count,
            )
            # No room to queue when it is back until the backlog ahead has drained.
            return self._shed(req, raw, "queue_full", wait, now, now)
        ahead_tokens, position = self._queue.ahead(entry)
        wait = self._wait_for(
            self._wait_context(model, now), raw, ahead_tokens + back_tokens, position + back_count
        )
        if deadline <= now or (wait is not None and now + wait > deadline):
            self._dequeue(entry)
            return self._shed(req, raw, "deadline", wait, deadline, now)
        estimated = wait if wait is not None else self.config.cold_retry_after_s
        return Queued(rid, position, estimated)

    def release(
        self, request_id: str, now: float, completion: Completion | None = None
    ) -> list[Admit]:
        """Free the request's reservation, or drop it from the queue; idempotent.

        `completion` is what the request measured about its replica (latency, usage); the
        learned running limit of that replica feeds on it. None (client disconnect,
        queue exit) teaches nothing.

        Returns the requests this admitted from the queue (plus any admitted by an
        earlier `expire` that were not handed out yet).
        """
        self._now = max(self._now, now)
        res = self._reservations.get(request_id)
        if res is not None:
            self._free(res, now, completion)
        else:
            entry = self._queued.get(request_id)
            if entry is not None:
                self._dequeue(entry)
        return self._flush(self._settle(now))

    def abandon(
        self, request_id: str, now: float, completion: Completion | None = None
    ) -> list[Admit]:
        """Hold the reservation of a request kvgate stopped waiting for while the engine
        may still be generating it (module docstring, Abandoned requests); `completion`
        is learned when it is released. Without a reservation (or with
        ``abandoned_hold_s`` 0) this is `release`. Idempotent."""
        self._now = max(self._now, now)
        res = self._reservations.get(request_id)
        hold = self.config.abandoned_hold_s
        if res is None or hold <= 0:
            return self.release(request_id, now, completion)
        if res.held_since is None:
            res.held_since = now
            res.held_until = now + hold
            res.completion = completion
            self._replicas[res.replica].held += 1
            self._held[request_id] = res
        return self._flush([])

    def held(self, replica: str | None = None) -> int:
        """Abandoned reservations still held (addition to the API)."""
        if replica is None:
            return len(self._held)
        rep = self._replicas.get(replica)
        return rep.held if rep is not None else 0

    def top_up(self, request_id: str, total_tokens: int, now: float) -> bool:
        """Grow a reservation to cover `total_tokens` (prompt + generated so far).

        Returns True when the reservation already covers it or was grown; False when the
        replica has no room (the stream continues regardless; counted in
        `top_up_failures`) or the request holds no reservation.
        """
        self._now = max(self._now, now)
        res = self._reservations.get(request_id)
        if res is None:
            return False
        rep = self._replicas[res.replica]
        target = rep.need(total_tokens)
        if target <= res.tokens + res.covered:
            return True
        extra = target - res.tokens - res.covered
        if not rep.present or extra > rep.free:
            self.top_up_failures += 1
            return False
        rep.reserved += extra
        res.tokens += extra
        self._touch(rep)
        return True

    def expire(self, now: float) -> list[Shed]:
        """Shed queued requests past their deadline (``queue_timeout``) or whose estimated
        wait can no longer meet it (``deadline``).

        Removing entries can unblock others; those admissions are handed out by the next
        `release` / `upsert_replica` / `remove_replica` / `pump` call.
        """
        self._now = max(self._now, now)
        shed: list[Shed] = self._displaced
        self._displaced = []
        ahead: dict[str, tuple[int, int]] = {}  # model -> (tokens, count) of kept entries
        contexts: dict[str, _WaitContext | None] = {}
        for entry in list(self._queue):
            model = entry.req.model
            tokens, count = ahead.get(model, (0, 0))
            if model not in contexts:
                contexts[model] = self._wait_context(model, now)
            wait = self._wait_for(contexts[model], entry.raw, tokens, count)
            if entry.deadline <= now:
                reason = "queue_timeout"
            elif wait is None or now + wait <= entry.deadline:
                ahead[model] = (tokens + entry.raw, count + 1)
                continue
            else:
                reason = "deadline"
            self._dequeue(entry)
            shed.append(self._shed(entry.req, entry.raw, reason, wait, entry.deadline, now))
        overdue = [r for r in self._held.values() if r.held_until <= now]
        for res in overdue:
            self._free(res, now, res.completion)
        if shed or overdue:
            self._pending.extend(self._settle(now))
        return shed

    def take_displaced(self) -> list[Shed]:
        """Queued requests a full queue shed for another tenant's newcomer since the last
        call (module docstring, Queue order); the caller answers them."""
        out, self._displaced = self._displaced, []
        return out

    def pump(self, now: float) -> list[Admit]:
        """Re-examine the queue and hand out any pending admissions (addition to the API)."""
        self._now = max(self._now, now)
        return self._flush(self._settle(now))

    def next_deadline(self) -> float | None:
        """The earliest deadline among queued requests and held reservations (when
        `expire` should next run)."""
        first = self._queue.next_deadline()
        if self._displaced:
            return self._now
        for res in self._held.values():  # in order of abandonment: the first ends first
            return res.held_until if first is None else min(first, res.held_until)
        return first

    # --------------------------------------------------------------- observation
    def replica_usage(self) -> list[ReplicaUsage]:
        blocked_by = self._binding_ceilings()
        out = []
        for rep in self._replicas.values():
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
                    limit=rep.allowed if rep.limit is not None else None,
                    limit_reason=rep.limit.reason if rep.limit is not None else "",
                    held=rep.held,
                    ejected=rep.ejected,
                )
            )
        return out

    def reserved_tokens(self, replica: str | None = None) -> int:
        if replica is not None:
            rep = self._replicas.get(replica)
            return rep.reserved if rep else 0
        return sum(r.reserved for r in self._replicas.values())

    def queue_depth(self, model: str | None = None) -> int:
        if model is not None:
            return self._queue_per_model.get(model, 0)
        return len(self._queue)

    def models(self) -> set[str]:
        out: set[str] = set()
        for rep in self._replicas.values():
            if rep.usable:
                out.update(rep.models)
        return out

    def retry_after(self, model: str, need_tokens: int, now: float) -> float:
        """Seconds until `need_tokens` could be admitted for `model` behind its whole
        backlog (its queue and the shed requests expected back), clamped to
        [min_retry_after_s, max_retry_after_s] (no jitter)."""
        back_tokens, back_count = self._returning.ahead(model, now, now)
        wait = self._wait_for(
            self._wait_context(model, now),
            need_tokens,
            self._queue_tokens.get(model, 0) + back_tokens,
            self._queue_per_model.get(model, 0) + back_count,
        )
        return self._clamp(wait)

    def returning(self) -> int:
        """Shed requests currently expected back (addition to the API)."""
        return len(self._returning)

    def drain_rate(self, model: str, now: float) -> tuple[float, float] | None:
        """(tokens/s, requests/s) released by `model`'s ready replicas, or None while
        fewer than ``min_drain_samples`` releases were seen (addition to the API)."""
        reps = [r for r in self._serving(model) if r.usable]
        if sum(r.drain.samples for r in reps) < self.config.min_drain_samples:
            return None
        tok = req = 0.0
        for rep in reps:
            t, q = rep.drain.rates(now)
            tok += t
            req += q
        return tok, req

    def reservation(self, request_id: str) -> Admit | None:
        """The current reservation of an admitted request (addition to the API)."""
        res = self._reservations.get(request_id)
        return Admit(res.request_id, res.replica, res.tokens + res.covered) if res else None

    def limit_of(self, replica: str) -> RunningLimit | None:
        """The learned running limit of `replica` (for tests, benches and the admin API)."""
        rep = self._replicas.get(replica)
        return rep.limit if rep is not None else None

    # ------------------------------------------------------------------ shared state
    def set_pool_share(
        self,
        replica: str,
        tokens: int | None,
        now: float,
        *,
        running: int | None = None,
        others_running: int = 0,
    ) -> list[Admit]:
        """Cap `replica`'s effective pool at the `tokens` this process leased (None: no
        cap) and its running limit at `running` (None: no cap), when several gateway
        processes share the replica (admission/state). `others_running` is what the
        other processes hold there, so the learned limit judges the replica's whole
        load. Reservations above a shrunk share stay until released; nothing more is
        admitted there meanwhile. Returns requests admitted because the share grew."""
        self._now = max(self._now, now)
        rep = self._replicas.get(replica)
        if rep is None:
            return self._flush([])
        rep.share_tokens = None if tokens is None else max(0, tokens)
        rep.share_running = None if running is None else max(0, running)
        if rep.limit is not None:
            rep.limit.others = max(0, others_running)
        self._replica_changed(rep)  # its free room and headroom moved: the orders follow
        return self._flush(self._settle(now))

    def pool_demand(self, replica: str) -> PoolDemand | None:
        """What this process holds and wants of `replica` (the lease loop's input)."""
        rep = self._replicas.get(replica)
        if rep is None:
            return None
        queued_tokens = queued = 0
        for model in rep.models:
            queued_tokens += self._queue_tokens.get(model, 0)
            queued += self._queue_per_model.get(model, 0)
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
            share_tokens=rep.share_tokens,
            share_running=rep.share_running,
        )

    def shares_prefix(self, model: str) -> bool:
        """Whether a replica of `model` counts prompt prefixes that running requests
        share once (its requests then carry their block hash chain)."""
        return self._view(model).shares_prefix

    def replica_names(self) -> list[str]:
        """Every replica the ledger knows (present, or gone with reservations left)."""
        return list(self._replicas)

    # ------------------------------------------------------------------ internals
    def _free(self, res: _Reservation, now: float, completion: Completion | None) -> None:
        """Return one reservation to its replica's pool (no queue settling)."""
        del self._reservations[res.request_id]
        rep = self._replicas[res.replica]
        if res.held_since is not None:
            del self._held[res.request_id]
            rep.held -= 1
        true_tokens = None
        if completion is not None and completion.completion_tokens is not None:
            true_tokens = (completion.prompt_tokens or 0) + completion.completion_tokens
        at_admit = self._queue.released(res.request_id, true_tokens)  # tenant accounting
        if completion is not None and completion.ok and completion.itl_s is not None:
            # The stream's load: the mean of the running counts at its start and end.
            load = (rep.running + (at_admit or rep.running)) / 2
            model = rep.itl
            if model is None:
                model = rep.itl = ItlModel(memory_s=self.config.itl_memory_s)
            model.add(load, completion.itl_s, now)
        freed = res.tokens
        if res.pins and rep.prefixes is not None:
            freed += rep.prefixes.unpin(res.pins)
        rep.reserved -= freed
        rep.running -= 1
        rep.drain.record(freed, now)
        rep.drain.set_busy(rep.running > 0, now)
        if completion is not None:
            self._learn(rep, res, completion, now)
        if rep.limit is not None:
            rep.limit.running_changed(rep.running, now)
        if self._released_hook is not None:
            self._released_hook(res.request_id, res.replica, now)
        if not rep.present and rep.running == 0:
            del self._replicas[rep.name]
            self._by_model = None
        else:
            self._touch(rep)

    def _release_stopped(self, rep: _Replica, state: ReplicaState, now: float) -> None:
        """Release the held reservations of `rep` that its engine has stopped working on.

        The engine had ``engine_running + engine_waiting`` requests when the round began;
        kvgate's live (not held) ones admitted before then account for some of them, so
        at most the rest are held requests still generating. The others have stopped: the
        oldest held reservations that the view can judge (abandoned before the round
        began) are released. Each view is used once. As kvgate never admits more than the
        running cap (llama.cpp: the slot count), held ones included, its live requests
        are not left waiting inside the engine; other clients of the engine only make
        the hold longer (up to ``abandoned_hold_s``).
        """
        seen = state.running_seen_at
        if seen is None or seen == rep.judged_at:
            return  # no gauge, or one already judged by
        rep.judged_at = seen
        # Only live requests admitted before the round began can be in its count (one
        # still on its way to the engine makes this hold a little less long).
        live = sum(
            1
            for r in self._reservations.values()
            if r.replica == rep.name and r.held_since is None and r.admitted_at < seen
        )
        has = state.engine_running + state.engine_waiting  # the engine's requests, all
        stopped = rep.held - max(0, has - live)
        if stopped <= 0:
            return
        judged = [
            r
            for r in self._held.values()
            if r.replica == rep.name and r.held_since is not None and r.held_since < seen
        ]
        for res in judged[:stopped]:
            self._free(res, now, res.completion)

    @staticmethod
    def _check_pool(rep: _Replica, kv_usage: float, now: float) -> None:
        """Hold the configured pool against the engine's own KV usage.

        The engine holds at most what kvgate reserved there, so its pool is at most
        ``reserved / usage``. When that bound stays below 90% of the configured pool for
        two discovery rounds, the pool is overstated (a wrong pin, or other clients on
        the engine) and the bound is used instead. Without fresh confirmation for
        ``_POOL_MEMORY_S`` the configured pool is trusted again.
        """
        assert rep.capacity is not None
        if kv_usage >= 0.5 and rep.reserved > 0:
            bound = int(rep.reserved / kv_usage)
            if bound < 0.9 * rep.capacity:
                rep.below_rounds += 1
                if rep.below_rounds >= 2:
                    known = rep.measured_pool
                    rep.measured_pool = bound if known is None else min(known, bound)
                    rep.measured_at = now
                return
        rep.below_rounds = 0
        if rep.measured_pool is not None and now - rep.measured_at > _POOL_MEMORY_S:
            rep.measured_pool = None

    def _learn(self, rep: _Replica, res: _Reservation, c: Completion, now: float) -> None:
        """Feed one completion to the replica's latency history and learned limit."""
        prompt = c.prompt_tokens or 0
        work = prompt + (c.completion_tokens or 0)
        load = rep.allowed or rep.running + 1
        if c.ok and c.service_s is not None and work > 0:
            rep.service.add(work, c.service_s, load)
        if c.ok and c.ttft_s is not None and prompt > 0:
            rep.ttft.add(prompt, c.ttft_s, load)
        if rep.limit is None:
            return
        targets = self._targets.get(res.model) or self._targets.get("*")
        ratio = latency_ratio(
            service_s=c.service_s,
            ttft_s=c.ttft_s,
            itl_s=c.itl_s,
            budget_s=c.latency_budget,
            budget_fraction=self.config.latency_budget_fraction,
            targets=targets,
            stream=c.ttft_s is not None,
        )
        rep.limit.completed(
            now,
            res.admitted_at,
            ok=c.ok,
            work_tokens=work or res.tokens + res.covered,
            ratio=ratio,
            cap=rep.cap,
        )

    def _predict(self, req: AdmissionRequest, view: _View) -> float:
        """Predicted service of `req` once admitted (a stream: time to first token), an
        upper bound of the largest of its replicas' upper estimates (`ServiceModel`), from
        per-model maxima refreshed only for replicas that changed (`PredictMax`); 0
        before any sample. An upper estimate, not a typical one: a request admitted at
        its deadline with a typical prediction would time out half the time."""
        if view.dirty:
            for name in view.dirty:
                rep = self._replicas.get(name)
                if rep is None or not rep.present:
                    view.ttft.remove(name)
                    view.service.remove(name)
                    continue
                load = rep.allowed or rep.running + 1
                for model, target in ((rep.ttft, view.ttft), (rep.service, view.service)):
                    line = model.line(load)
                    if line is None:
                        target.remove(name)
                    else:
                        target.set(name, line[0], line[1])
            view.dirty.clear()
        if req.stream:
            return view.ttft.predict(req.prompt_tokens)
        return view.service.predict(max(1, req.prompt_tokens) + max(0, req.expected_output))

    def _view(self, model: str) -> _View:
        """`model`'s view (admission/candidates.py), rebuilt when the replica index was."""
        index = self._by_model
        if index is None:
            self._serving(model)
            index = self._by_model
        if self._views_of is not index:
            self._views.clear()
            self._views_of = index
        view = self._views.get(model)
        if view is not None:
            return view
        present = [r for r in self._serving(model) if r.present]
        known: dict[tuple[object, ...], _Replica] = {}
        usable: dict[tuple[object, ...], _Replica] = {}
        for r in present:
            shape = r.shape()
            if r.capacity is not None or r.max_model_len is not None:
                known.setdefault(shape, r)
            if r.usable:
                usable.setdefault(shape, r)
        view = _View(
            present,
            list(known.values()),
            list(usable.values()),
            HeadroomIndex(),
            PredictMax(),
            PredictMax(),
            {r.name for r in present},
            any(r.sharing for r in present),
        )
        for r in present:
            self._order(view, r)
        self._views[model] = view
        return view

    @staticmethod
    def _order(view: _View, rep: _Replica) -> None:
        """Place `rep` in `view`'s headroom orders by the ledger now."""
        free = rep.free / rep.effective if rep.effective > 0 else 0.0
        allowed = rep.allowed
        if allowed is None:
            run = 1.0 / (1.0 + rep.running)
        else:
            run = max(0.0, 1.0 - rep.running / allowed) if allowed > 0 else 0.0
        view.order.update(rep.name, free, run)

    def _touch(self, rep: _Replica) -> None:
        """The ledger of `rep` changed (reserve, release, top-up, limit): follow it in
        the views of its models."""
        views = self._views
        for model in rep.models:
            view = views.get(model)
            if view is not None:
                self._order(view, rep)
                view.dirty.add(rep.name)

    def _replica_changed(self, rep: _Replica) -> None:
        """After a replica's view, readiness or presence may have changed: rebuild the
        model views when what they group it by did, else just follow its ledger. Any
        code that changes a replica's pool (`effective`), readiness or models calls it."""
        sig = (rep.present, rep.usable, rep.models, rep.shape(), rep.sharing)
        if sig != rep.sig:
            rep.sig = sig
            self._views.clear()
        else:
            self._touch(rep)

    def _serving(self, model: str) -> list[_Replica]:
        """Replicas that list `model` (present or not), from a per-model index rebuilt
        only when a replica's models or presence change."""
        index = self._by_model
        if index is None:
            index = {}
            for rep in self._replicas.values():
                for m in rep.models:
                    index.setdefault(m, []).append(rep)
            self._by_model = index
        return index.get(model, [])

    def _candidate_names(self, entry: _Entry) -> Iterable[str]:
        for rep in self._serving(entry.req.model):
            if rep.usable and rep.can_ever_fit(entry.req):
                yield rep.name

    def _try_admit(self, entry: _Entry, blocked: set[str], now: float) -> Admit | object | None:
        """Admit `entry` to a non-blocked replica that fits it now, chosen by routing.

        Routing scores a shortlist (admission/candidates.py): the first
        ``SHORTLIST_PER_ORDER`` fitting replicas by KV headroom and by running headroom,
        plus those routing names (`Router.hints`); only those candidates are refreshed.
        When routing rejects the whole shortlist and replicas outside it fit, it is asked
        again with all of them. None when nothing fits now; `_REJECTED` when replicas fit
        but routing rejected every one of them."""
        req = entry.req
        view = self._view(req.model)
        reps = self._replicas
        fit: dict[str, bool] = {}
        short: list[_Replica] = []
        complete = True  # every replica of the model was examined
        k = SHORTLIST_PER_ORDER
        for order in (view.order.by_free(), view.order.by_run()):
            got = 0
            for _, name in order:
                ok = fit.get(name)
                if ok is None:
                    rep = reps.get(name)
                    ok = rep is not None and name not in blocked and self._fits_now(rep, req, now)
                    fit[name] = ok
                    if ok:
                        short.append(rep)  # type: ignore[arg-type]
                if ok:
                    got += 1
                    if got >= k:
                        complete = False
                        break
            if complete:
                break  # the first order was walked to its end: nothing else fits
        route = RouteRequest(
            request_id=req.request_id,
            model=req.model,
            need_tokens=entry.raw,
            workload=req.workload,
            prefix_hashes=req.prefix_hashes,
            session=req.session,
            now=now,
            tenant=req.tenant,
            prompt_tokens=req.prompt_tokens,
            ttft_target_s=req.ttft_target_s,
            itl_target_s=req.itl_target_s,
        )
        hinted: list[str] = []
        if not complete and self._hints_hook is not None:
            hinted = self._hints_hook(route)
            for name in hinted:
                if name not in fit:
                    rep = reps.get(name)
                    ok = (
                        rep is not None
                        and req.model in rep.models
                        and name not in blocked
                        and self._fits_now(rep, req, now)
                    )
                    fit[name] = ok
                    if ok:
                        short.append(rep)  # type: ignore[arg-type]
        if not short:
            return None
        choice = self._picker.pick(route, [r.cand for r in short])
        if choice is None and not complete:
            rest = [
                r
                for r in view.present
                if r.name not in fit and r.name not in blocked and self._fits_now(r, req, now)
            ]
            for r in rest:
                fit[r.name] = True
            if rest:
                choice = self._picker.pick(route, [r.cand for r in short + rest])
        if choice is None:
            return _REJECTED
        rep = reps.get(choice.name)
        if rep is None or not fit.get(choice.name):
            raise ValueError(f"picker returned {choice.name!r}, which was not a candidate")
        if self._warm_hook is not None and req.prefix_hashes:
            # Only when a replica routing may prefer could not be a candidate (full).
            if complete:
                full = not all(fit.values())
            else:
                full = any(not fit.get(name, True) for name in hinted)
            if full and self._wait_for_warm(req, route, rep, fit, now):
                return _REJECTED  # waits for the warm replica without blocking anyone
        memo = rep.need_memo
        if memo is not None and memo[0] == req.request_id and memo[1] == now:
            tokens, shared = memo[2], memo[3]
        else:
            tokens, shared = self._need(rep, req, now)
        pins: tuple[int, ...] = ()
        private = tokens
        if (
            rep.sharing
            and rep.prefixes is not None
            and req.prefix_block_tokens > 0
            and req.prefix_hashes
        ):
            pins, added = rep.prefixes.pin(
                req.prefix_hashes,
                shared,
                req.prefix_block_tokens,
                now + self._settle_time(rep, req),
                tokens,
            )
            private = tokens - added
        rep.reserved += tokens
        rep.running += 1
        rep.drain.set_busy(True, now)
        if rep.limit is not None:
            rep.limit.running_changed(rep.running, now)
        full = rep.tokens_for(req)  # its whole need, the shared part included
        self._reservations[req.request_id] = _Reservation(
            req.request_id, rep.name, req.model, private, now, pins, full - private
        )
        self._touch(rep)
        if self._placed_hook is not None:
            self._placed_hook(route, rep.cand, now)
        return Admit(req.request_id, rep.name, full)

    def _wait_for_warm(
        self,
        req: AdmissionRequest,
        route: RouteRequest,
        chosen: _Replica,
        fit: dict[str, bool],
        now: float,
    ) -> bool:
        """Whether `req` should wait for the warm replica routing would rather use (it
        holds more of the prompt cached but is full now) instead of starting on `chosen`.

        Expected time to first token on the warm replica: its queue wait (its KV deficit
        for this request over its drain rate in tokens/s, and its running-slot deficit
        over its rate in requests/s) plus the prefill of the part it does not hold;
        against the prefill of what `chosen` does not hold, starting now. Prefill times
        are the replicas' own fitted TTFT lines (`ServiceModel`); without samples on
        either, or without a drain rate on the warm one, there is no basis to wait and
        the request starts now. Routing names the warm replicas (`Router.warm`); this is
        admission's when, not routing's where."""
        warm = self._warm_hook(route)  # type: ignore[misc]
        if not warm:
            return False
        name, cached = warm[0]
        if name == chosen.name or fit.get(name):
            return False  # the warm replica was a candidate: routing weighed it
        w = self._replicas.get(name)
        if w is None or not w.usable or req.model not in w.models or not w.can_ever_fit(req):
            return False
        here = next((t for n, t in warm if n == chosen.name), 0)
        if cached <= here or not len(w.ttft) or not len(chosen.ttft):
            return False
        tok_rate, req_rate = w.drain.rates(now)
        wait = 0.0
        deficit = self._need(w, req, now)[0] - w.free
        if deficit > 0:
            wait = deficit / tok_rate if tok_rate > 0 else math.inf
        allowed = w.allowed
        if allowed is not None and w.running >= allowed:
            slots = w.running - allowed + 1
            wait = max(wait, slots / req_rate if req_rate > 0 else math.inf)
        if not math.isfinite(wait):
            return False
        prompt = max(1, req.prompt_tokens)
        t_warm = wait + w.ttft.predict(max(1, prompt - cached), allowed or w.running + 1)
        t_cold = chosen.ttft.predict(max(1, prompt - here), chosen.allowed or chosen.running + 1)
        verdict = "expected_ttft_wait" if t_warm < t_cold else "expected_ttft_cold"
        self.ttft_choices[verdict] = self.ttft_choices.get(verdict, 0) + 1
        return t_warm < t_cold

    @staticmethod
    def _need(rep: _Replica, req: AdmissionRequest, now: float) -> tuple[int, int]:
        """What admitting `req` to `rep` now adds to its ledger, and how many leading
        prefix blocks it shares there with running requests (module docstring, Ledger):
        its reservation less the shared blocks, which are counted once already, less a
        margin for the partial blocks at the edge of the shared part."""
        tokens = rep.tokens_for(req)
        prefixes = rep.prefixes
        w = req.prefix_block_tokens
        if (
            prefixes is None
            or not rep.sharing
            or w <= 0
            or not req.prefix_hashes
            or not len(prefixes)
        ):
            return tokens, 0
        shared = prefixes.shareable(req.prefix_hashes, now)
        credit = prefixes.credit(shared, w, rep.block_size + w)
        if credit <= 0:
            return tokens, shared
        bs = rep.block_size
        return max(bs, tokens - credit // bs * bs), shared

    def _settle_time(self, rep: _Replica, req: AdmissionRequest) -> float:
        """How long after admission the prompt blocks of `req` on `rep` are taken to be
        computed (shareable): twice its predicted time to first token there (streams
        teach it), else twice the predicted service of its prompt alone (every completion
        teaches that: an upper bound of its prefill), or ``prefix_settle_s`` while neither
        is learned."""
        load = rep.allowed or rep.running + 1
        prompt = max(1, req.prompt_tokens)
        if len(rep.ttft):
            return 2.0 * rep.ttft.predict(prompt, load)
        if len(rep.service):
            return 2.0 * rep.service.predict(prompt, load)
        return self.config.prefix_settle_s

    @staticmethod
    def _fits_now(rep: _Replica, req: AdmissionRequest, now: float) -> bool:
        """`rep` can take `req` now; if so its candidate is refreshed in place (the
        ledger now, the engine view's age)."""
        if not rep.usable or not rep.can_ever_fit(req):
            return False
        allowed = rep.allowed
        if allowed is not None and rep.running >= allowed:
            return False
        free = rep.free
        need, shared = AdmissionController._need(rep, req, now)
        if need > free:
            return False
        rep.need_memo = (req.request_id, now, need, shared)
        c = rep.cand
        c.free_tokens = free
        c.effective_capacity = rep.effective
        c.running = rep.running
        c.max_running = allowed
        c.view_age_s = max(0.0, now - rep.view_at) if rep.view_at else 0.0
        itl = rep.itl
        c.predicted_itl_s = (
            itl.predict(rep.running + 1) if itl is not None and req.itl_target_s else None
        )
        return True

    def _settle(self, now: float) -> list[Admit]:
        """Admit queued entries in order until every usable replica is blocked.

        An entry routing rejected on every replica that fits it waits without blocking
        them: it waits for routing's say, not for their capacity. Except for an ITL
        target: an entry no replica meets now, but that a replica would meet with fewer
        running (its ITL model says so at one running), blocks those replicas like an
        entry waiting for room: their load must fall for it, and letting the entries
        behind it in, as a filter's rejection would, keeps the load up and starves it."""
        if not self._queue:
            return []
        usable = {r.name for r in self._replicas.values() if r.usable}
        blocked: set[str] = set()
        admitted: list[Admit] = []
        for entry in self._queue.visit(self._capped):
            if usable <= blocked:
                break
            admit = self._try_admit(entry, blocked, now)
            if isinstance(admit, Admit):
                self._dequeue(entry)
                self._queue.admitted(entry.req, self._replicas[admit.replica].running)
                admitted.append(admit)
            elif admit is _REJECTED:
                held = self._slo_holds(entry)
                entry.rejected = not held
                blocked.update(held)
            else:
                entry.rejected = False
                blocked.update(self._candidate_names(entry))
        return admitted

    def _slo_holds(self, entry: _Entry) -> set[str]:
        """Replicas a routing-rejected entry with an ITL target waits for: those that
        would meet the target with one request running (module docstring, _settle)."""
        target = entry.req.itl_target_s
        if not target:
            return set()
        out = set()
        for name in self._candidate_names(entry):
            alone = self.predicted_itl(name, 1)
            if alone is not None and alone <= target:
                out.add(name)
        return out

    def _flush(self, admits: list[Admit]) -> list[Admit]:
        if self._pending:
            admits = self._pending + admits
            self._pending = []
        return admits

    def _enqueue(self, entry: _Entry) -> None:
        self._queue.insert(entry)
        self._queued[entry.req.request_id] = entry
        model = entry.req.model
        self._queue_per_model[model] = self._queue_per_model.get(model, 0) + 1
        self._queue_tokens[model] = self._queue_tokens.get(model, 0) + entry.raw

    def _weight_of(self, tenant: str) -> float:
        policy = self._tenant_of(tenant)
        return policy.weight if policy is not None else 1.0

    def _capped(self, tenant: str) -> bool:
        """The tenant runs as many requests as it may (its entries wait, blocking nobody)."""
        policy = self._tenant_of(tenant)
        if policy is None or policy.max_concurrent is None:
            return False
        return self._queue.running.get(tenant, 0) >= policy.max_concurrent

    def set_tenants(self, tenants: Callable[[str], TenantLimits | None]) -> None:
        """Tenant policies by name (weight, max_concurrent, max_queued, queue_timeout_s)."""
        self._tenant_of = tenants

    def tenant_running(self, tenant: str) -> int:
        """Admitted, not yet released requests of `tenant`."""
        return self._queue.running.get(tenant, 0)

    def tenant_queued(self, tenant: str) -> int:
        """Queued requests of `tenant`."""
        return self._queue.queued_of(tenant)

    def predicted_itl(self, replica: str, running_after: int) -> float | None:
        """The replica's expected inter-token gap with `running_after` running (None:
        no evidence yet); admission.itl."""
        rep = self._replicas.get(replica)
        model = rep.itl if rep is not None else None
        return model.predict(running_after) if model is not None else None

    def _dequeue(self, entry: _Entry) -> None:
        self._queue.remove(entry)
        del self._queued[entry.req.request_id]
        model = entry.req.model
        left = self._queue_per_model[model] - 1
        if left:
            self._queue_per_model[model] = left
            self._queue_tokens[model] -= entry.raw
        else:
            del self._queue_per_model[model]
            del self._queue_tokens[model]

    def _wait_context(self, model: str, now: float) -> _WaitContext | None:
        """Drain rates and ready replicas of `model`; None without enough drain history."""
        rates = self.drain_rate(model, now)
        if rates is None:
            return None
        reps = [r for r in self._serving(model) if r.usable]
        if not reps:
            return None
        frees = [max(0, r.free) for r in reps]
        slots: int | None = None
        allowed = [r.allowed for r in reps]
        if all(a is not None for a in allowed):
            slots = sum(max(0, (a or 0) - r.running) for a, r in zip(allowed, reps, strict=True))
        return _WaitContext(
            rates[0],
            rates[1],
            frozenset(r.block_size for r in reps),
            sum(frees),
            max(frees),
            slots,
        )

    @staticmethod
    def _wait_for(
        ctx: _WaitContext | None, raw: int, ahead_tokens: int, ahead_count: int
    ) -> float | None:
        """Seconds until a request of `raw` tokens fits behind the queue ahead of it.

        Deficit in tokens: the queue ahead (same model) plus this request, minus what is
        free on the model's ready replicas (and at least what the roomiest replica lacks
        for this request alone). Deficit in running slots likewise when every replica is
        capped. Each deficit is divided by its drain rate; the larger wait wins. None
        when there is no drain history to estimate from.
        """
        if ctx is None:
            return None
        need = max(round_up(raw, bs) for bs in ctx.block_sizes)
        tok_deficit = max(0, ahead_tokens + need - ctx.free_sum, need - ctx.free_max)
        slot_deficit = 0
        if ctx.free_slots is not None:
            slot_deficit = max(0, ahead_count + 1 - ctx.free_slots)
        wait = 0.0
        if tok_deficit:
            rate = ctx.tokens_per_s
            wait = max(wait, tok_deficit / rate if rate > 0 else math.inf)
        if slot_deficit:
            rate = ctx.requests_per_s
            wait = max(wait, slot_deficit / rate if rate > 0 else math.inf)
        return wait

    def _shed(
        self,
        req: AdmissionRequest,
        raw: int,
        reason: str,
        wait: float | None,
        deadline: float,
        now: float,
    ) -> Shed:
        """Shed `req` with a Retry-After that brings it back when it can queue again.

        `wait` is the estimated time until it could be admitted behind the whole backlog
        (queue and returning sheds). It may queue for up to its deadline once back, so it
        is told to return after ``wait - (deadline - now) / 2`` (half the client's
        tolerance, when it stated one), jittered by a uniform factor in [1 - j, 1 + j], then clamped. Its
        own tokens join the returning backlog until it is back or overdue.
        """
        if wait is None:
            delay = self.config.cold_retry_after_s
        else:
            # Back with half its tolerance still ahead: estimates are noisy, and a request
            # that returns to find the wait just over its tolerance is shed once more.
            tolerance = deadline - now if math.isfinite(deadline) and deadline > now else 0.0
            delay = max(0.0, wait - 0.5 * tolerance)
        j = self.config.retry_jitter
        if j > 0:
            delay *= self._rng.uniform(1.0 - j, 1.0 + j)
        delay = self._clamp(delay)
        key = req.retry_key if req.retry_key is not None else req.request_id
        expires = now + delay * (1.0 + j) + max(self.config.min_retry_after_s, 0.25 * delay)
        self._returning.add(req.model, key, req.arrival, expires, raw, req.tenant)
        return Shed(req.request_id, reason, delay)

    def _clamp(self, wait: float | None) -> float:
        value = self.config.cold_retry_after_s if wait is None else wait
        return min(self.config.max_retry_after_s, max(self.config.min_retry_after_s, value))

    @staticmethod
    def _clamp_estimate(req: AdmissionRequest, known: list[_Replica]) -> AdmissionRequest | None:
        """An estimated prompt that looks too long for every replica, cut down to the
        largest request some replica can hold, so that it is forwarded and the engine,
        which counts exactly, decides (invariant 4: no 400 on a guess). None when even a
        one-token prompt cannot fit: the declared ``max_tokens`` alone is over every
        limit, which is exact."""
        best: tuple[AdmissionRequest, int] | None = None
        for rep in known:
            prompt = req.prompt_tokens
            if rep.max_model_len is not None:
                output = req.max_tokens if rep.preempts else 1
                prompt = min(prompt, rep.max_model_len - output)
            if rep.capacity is not None and rep.preempts:
                room = rep.effective // rep.block_size * rep.block_size
                prompt = min(prompt, room - req.expected_output)
            if prompt < 1:
                continue
            clamped = replace(req, prompt_tokens=prompt)
            if not rep.can_ever_fit(clamped):
                continue
            size = prompt + req.expected_output
            if best is None or size > best[1]:
                best = (clamped, size)
        return best[0] if best is not None else None

    def _refuse_too_long(self, req: AdmissionRequest, known: list[_Replica]) -> Refuse:
        raw = max(1, req.prompt_tokens) + max(0, req.expected_output)
        total = req.prompt_tokens + req.max_tokens
        limited = [r for r in known if r.max_model_len is not None]
        longest = max((r.max_model_len or 0 for r in limited), default=0)
        if limited and all(r.context_needed(req) > (r.max_model_len or 0) for r in limited):
            if all(not r.preempts for r in limited):
                message = (
                    f"This model's maximum context length is {longest} tokens. However, "
                    f"your prompt has {req.prompt_tokens} tokens, which leaves no room for "
                    "the completion. Please reduce the length of the prompt."
                )
            else:
                message = (
                    f"This model's maximum context length is {longest} tokens. However, "
                    f"you requested {total} tokens ({req.prompt_tokens} in the messages, "
                    f"{req.max_tokens} in the completion). Please reduce the length of "
                    "the messages or completion."
                )
        else:
            largest = max((r.effective for r in known if r.capacity is not None), default=0)
            message = (
                f"This request needs about {raw} tokens of KV cache ({req.prompt_tokens} "
                f"prompt + {req.expected_output} output), more than the largest replica "
                f"pool serving `{req.model}` admits ({largest} tokens)."
            )
        return Refuse(req.request_id, 400, "context_length_exceeded", message)

    def _binding_ceilings(self) -> dict[str, str]:
        """Which ceiling keeps each replica from taking more work right now."""
        out: dict[str, str] = {}
        head_for: dict[str, _Entry] = {}
        for entry in self._queue:
            for name in self._candidate_names(entry):
                head_for.setdefault(name, entry)
        for rep in self._replicas.values():
            if rep.ejected:
                out[rep.name] = "ejected"
            elif not rep.usable:
                out[rep.name] = "not_ready"
            elif (allowed := rep.allowed) is not None and rep.running >= allowed:
                learned = rep.cap is None or allowed < rep.cap
                out[rep.name] = "latency" if learned else "running_cap"
            elif (
                rep.name in head_for
                and self._need(rep, head_for[rep.name].req, self._now)[0] > rep.free
            ):
                out[rep.name] = "kv_capacity"
            elif rep.free < rep.block_size:
                out[rep.name] = "kv_capacity"
            else:
                out[rep.name] = "none"
        return out
