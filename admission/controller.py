"""The sans-IO admission controller: a thin facade over the rooms of admission.

The controller never reads a clock, sleeps or does IO: every method takes `now`, and the
gateway shell acts on what it returns. The shell keeps `ReplicaState` current from the
engine adapters and passes it to `upsert_replica`; it calls `submit` per request, and
`release` (always, in a ``finally``) when the request ends, whatever the outcome.

Each concern lives in a module of its own, which states its rules:

- admission/replica.py: one replica's pool, ceilings and fit rules (reservation size);
- admission/ledger.py: reservations, shared prefixes, held (abandoned) reservations;
- admission/views.py: per-model views and headroom orders;
- admission/placement.py: the routing call, waiting for a warm replica;
- admission/settling.py: the queue, its order and head-of-line policy, settling;
- admission/shedding.py: shed verdicts, Retry-After, drain rate, expiry;
- admission/refusals.py: requests that can never fit (400, 404);
- admission/learning.py: what completions and engine gauges teach;
- admission/report.py: every read (`AdmissionController.report`).
"""

from __future__ import annotations

from collections.abc import Callable

from admission.config import AdmissionConfig
from admission.learning import Learning
from admission.ledger import Ledger, Reservation
from admission.limit import RunningLimit
from admission.placement import Placement
from admission.refusals import refuse_or_clamp, unknown_model
from admission.replica import round_up
from admission.report import AdmissionReport, PoolDemand
from admission.settling import Settling, TenantLimits
from admission.shedding import Shedding
from admission.types import (
    AdmissionRequest,
    Admit,
    Completion,
    ReplicaUsage,
    Shed,
    Verdict,
)
from routing.types import ReplicaState, Router

__all__ = ["AdmissionController", "PoolDemand", "TenantLimits", "round_up"]


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
        self._ledger = Ledger(config)
        self._views = self._ledger.views
        self._placement = Placement(picker, self._ledger)
        self._queue = Settling(config, self._ledger, self._placement, tenants)
        self._shedding = Shedding(config, self._views, self._queue, seed)
        self._learning = Learning(config)
        self.report = AdmissionReport(self._ledger, self._queue, self._shedding, self._placement)
        self._pending: list[Admit] = []  # admitted by expire(); handed out by the next call
        # Entries a full queue gave up for another tenant's newcomer (fair share of the
        # queue): handed out by `take_displaced` (the shell calls it after each submit),
        # else by the next `expire`, which `next_deadline` makes due at once.
        self._displaced: list[Shed] = []

    @property
    def router(self) -> Router:
        """The routing policy admission asks where an admitted request goes."""
        return self._placement.router

    def _saw(self, now: float) -> None:
        ledger = self._ledger
        if now > ledger.latest:
            ledger.latest = now

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
        self._saw(now)
        ledger = self._ledger
        rep = ledger.replicas.get(state.name)
        if rep is None:
            rep = ledger.add_replica(state.name, self._learning.new_limit(now))
        if not rep.present or rep.models != frozenset(state.models):
            self._views.membership_changed()
        fresh = rep.refresh(
            state, self.config, now, pinned_capacity=pinned_capacity, max_running=max_running
        )
        if rep.held:
            for res in ledger.stopped(rep, state):
                self._free(res, now, res.completion)
        self._learning.engine_view(rep, state, fresh, now)
        self._views.replica_changed(rep)
        return self._flush(self._queue.settle(now))

    def remove_replica(self, name: str, now: float) -> list[Admit]:
        """Forget a replica. Its reservations stay in the ledger until released; queued
        requests are kept for the remaining replicas."""
        self._saw(now)
        rep = self._ledger.replicas.get(name)
        if rep is not None:
            rep.present = False
            rep.ready = False
            self._views.membership_changed()
            if rep.running == 0:
                del self._ledger.replicas[name]
            self._views.replica_changed(rep)
        return self._flush(self._queue.settle(now))

    def mark_unready(self, name: str, now: float) -> None:
        """Stop sending new requests to `name` (e.g. connection refused) until an upsert
        says it is ready again. Existing reservations stay until released."""
        self._saw(now)
        rep = self._ledger.replicas.get(name)
        if rep is not None:
            rep.ready = False
            self._views.replica_changed(rep)

    def set_ejected(self, name: str, ejected: bool, now: float) -> list[Admit]:
        """Eject `name` (outlier detection: no new requests, whatever discovery says) or
        return it to service. Its reservations stay until released, as their requests
        end. Returns requests admitted from the queue because a replica returned."""
        self._saw(now)
        rep = self._ledger.replicas.get(name)
        if rep is None or rep.ejected == ejected:
            return []
        rep.ejected = ejected
        self._views.replica_changed(rep)
        return self._flush(self._queue.settle(now))

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
        self._saw(now)
        rep = self._ledger.replicas.get(replica)
        if rep is None:
            return self._flush([])
        rep.share_tokens = None if tokens is None else max(0, tokens)
        rep.share_running = None if running is None else max(0, running)
        if rep.limit is not None:
            rep.limit.others = max(0, others_running)
        self._views.replica_changed(rep)  # its free room and headroom moved: orders follow
        return self._flush(self._queue.settle(now))

    # ------------------------------------------------------------------ requests
    def submit(self, req: AdmissionRequest, now: float) -> Verdict:
        """Decide one request: Admit now, Queue, Shed (503) or Refuse (400/404)."""
        self._saw(now)
        rid = req.request_id
        queue = self._queue
        if rid in self._ledger.reservations or rid in queue.queued:
            raise ValueError(f"request id {rid!r} is already admitted or queued")
        if req.retry_key is not None:
            self._shedding.returning.discard(req.model, req.retry_key)  # it is back
        view = self._views.view(req.model)
        if not view.present:
            return unknown_model(req)
        # One replica per shape answers for all of that shape (admission/candidates.py).
        if view.known_shapes and not any(r.can_ever_fit(req) for r in view.known_shapes):
            answer = refuse_or_clamp(req, view.present)
            if not isinstance(answer, AdmissionRequest):
                return answer
            req = answer
        raw = 0
        for r in view.usable_shapes:
            if r.can_ever_fit(req):
                raw = max(raw, r.tokens_for(req))
        if not raw:
            return Shed(rid, "no_replica", self._shedding.clamp(None))
        predicted = self._views.predict(req, view) if req.latency_budget is not None else 0.0
        entry = queue.entry(req, raw, predicted, now)
        if queue:
            # Queue it and scan in order: the fair order decides what comes before it,
            # and strict order per replica what it may pass.
            queue.enqueue(entry)
            mine: Admit | None = None
            for a in queue.settle(now):
                if a.request_id == rid:
                    mine = a
                else:
                    self._pending.append(a)
            if mine is not None:
                return mine
        else:
            admit = queue.admit_alone(entry, now)
            if admit is not None:
                return admit
            queue.enqueue(entry)
        verdict, displaced = self._shedding.judge(entry, now)
        self._displaced.extend(displaced)
        return verdict

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
        self._saw(now)
        res = self._ledger.reservations.get(request_id)
        if res is not None:
            self._free(res, now, completion)
        else:
            entry = self._queue.queued.get(request_id)
            if entry is not None:
                self._queue.dequeue(entry)
        return self._flush(self._queue.settle(now))

    def abandon(
        self, request_id: str, now: float, completion: Completion | None = None
    ) -> list[Admit]:
        """Hold the reservation of a request kvgate stopped waiting for while the engine
        may still be generating it (admission/ledger.py, Abandoned requests);
        `completion` is learned when it is released. Without a reservation (or with
        ``abandoned_hold_s`` 0) this is `release`. Idempotent."""
        self._saw(now)
        res = self._ledger.reservations.get(request_id)
        if res is None or self.config.abandoned_hold_s <= 0:
            return self.release(request_id, now, completion)
        self._ledger.hold(res, now, completion)
        return self._flush([])

    def top_up(self, request_id: str, total_tokens: int, now: float) -> bool:
        """Grow a reservation to cover `total_tokens` (prompt + generated so far).

        Returns True when the reservation already covers it or was grown; False when the
        replica has no room (the stream continues regardless; counted in
        `top_up_failures`) or the request holds no reservation.
        """
        self._saw(now)
        return self._ledger.top_up(request_id, total_tokens)

    def expire(self, now: float) -> list[Shed]:
        """Shed queued requests past their deadline (``queue_timeout``) or whose estimated
        wait can no longer meet it (``deadline``).

        Removing entries can unblock others; those admissions are handed out by the next
        `release` / `upsert_replica` / `remove_replica` / `pump` call.
        """
        self._saw(now)
        shed: list[Shed] = self._displaced
        self._displaced = []
        shed.extend(self._shedding.expire(now))
        overdue = self._ledger.overdue(now)
        for res in overdue:
            self._free(res, now, res.completion)
        if shed or overdue:
            self._pending.extend(self._queue.settle(now))
        return shed

    def take_displaced(self) -> list[Shed]:
        """Queued requests a full queue shed for another tenant's newcomer since the last
        call (admission/shedding.py); the caller answers them."""
        out, self._displaced = self._displaced, []
        return out

    def pump(self, now: float) -> list[Admit]:
        """Re-examine the queue and hand out any pending admissions (addition to the API)."""
        self._saw(now)
        return self._flush(self._queue.settle(now))

    def next_deadline(self) -> float | None:
        """The earliest deadline among queued requests and held reservations (when
        `expire` should next run)."""
        first = self._queue.queue.next_deadline()
        if self._displaced:
            return self._ledger.latest
        for res in self._ledger.held.values():  # in order of abandonment: first ends first
            return res.held_until if first is None else min(first, res.held_until)
        return first

    def set_tenants(self, tenants: Callable[[str], TenantLimits | None]) -> None:
        """Tenant policies by name (weight, max_concurrent, max_queued, queue_timeout_s)."""
        self._queue.set_tenants(tenants)

    # ------------------------------------------------------------------ reads (old API)
    @property
    def top_up_failures(self) -> int:
        return self._ledger.top_up_failures

    @top_up_failures.setter
    def top_up_failures(self, value: int) -> None:
        self._ledger.top_up_failures = value

    @property
    def ttft_choices(self) -> dict[str, int]:
        return self._placement.ttft_choices

    def replica_usage(self) -> list[ReplicaUsage]:
        return self.report.replica_usage()

    def reserved_tokens(self, replica: str | None = None) -> int:
        return self.report.reserved_tokens(replica)

    def queue_depth(self, model: str | None = None) -> int:
        return self.report.queue_depth(model)

    def models(self) -> set[str]:
        return self.report.models()

    def retry_after(self, model: str, need_tokens: int, now: float) -> float:
        return self.report.retry_after(model, need_tokens, now)

    def returning(self) -> int:
        return self.report.returning()

    def drain_rate(self, model: str, now: float) -> tuple[float, float] | None:
        return self.report.drain_rate(model, now)

    def reservation(self, request_id: str) -> Admit | None:
        return self.report.reservation(request_id)

    def limit_of(self, replica: str) -> RunningLimit | None:
        return self.report.limit_of(replica)

    def pool_demand(self, replica: str) -> PoolDemand | None:
        return self.report.pool_demand(replica)

    def shares_prefix(self, model: str) -> bool:
        return self.report.shares_prefix(model)

    def replica_names(self) -> list[str]:
        return self.report.replica_names()

    def held(self, replica: str | None = None) -> int:
        return self.report.held(replica)

    def tenant_running(self, tenant: str) -> int:
        return self.report.tenant_running(tenant)

    def tenant_queued(self, tenant: str) -> int:
        return self.report.tenant_queued(tenant)

    def predicted_itl(self, replica: str, running_after: int) -> float | None:
        return self.report.predicted_itl(replica, running_after)

    # ------------------------------------------------------------------ internals
    def _free(self, res: Reservation, now: float, completion: Completion | None) -> None:
        """Return one reservation to its replica's pool and learn from it (no settling)."""
        rep = self._ledger.replicas[res.replica]
        true_tokens = None
        if completion is not None and completion.completion_tokens is not None:
            true_tokens = (completion.prompt_tokens or 0) + completion.completion_tokens
        at_admit = self._queue.queue.released(res.request_id, true_tokens)  # tenant accounting
        self._learning.stream_gap(rep, completion, at_admit, now)
        self._ledger.free(res, now)
        self._learning.released(rep, res, completion, now)
        self._placement.released(res.request_id, res.replica, now)
        self._ledger.forget_if_gone(rep)

    def _flush(self, admits: list[Admit]) -> list[Admit]:
        if self._pending:
            admits = self._pending + admits
            self._pending = []
        return admits
