"""The sans-IO admission controller: a thin facade over the rooms of admission.

The controller never reads a clock, sleeps or does IO: every method takes `now`, and the
gateway shell acts on what it returns. The shell keeps `ReplicaState` current from the
engine adapters and passes it to `upsert_replica`; it calls `submit` per request, and
when the request ends, whatever the outcome, tells `attempt_ended` what its client did
and `request_ended` (always, in a ``finally``) to give its admission back.

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

One output channel, as h11's `Connection`: every call that changes state returns its
verdict and every event it caused. `submit` returns a `Decision` (its verdict, and the
`Events` it settled for other requests: entries admitted in the same scan, an entry a
full queue gave up for it); `request_ended` (`release`, `abandon`), `attempt_ended`,
`upsert_replica`, `remove_replica`, `mark_unready`, `set_ejected`, `set_pool_share`,
`adopt_limit` and `advance` return the `Events` they caused. `advance(now)` is time
acting: expiries (deadlines passed, waits that no longer meet them, holds overdue) and
the settling they and time allow; `next_deadline()` says when it is next due. Nothing
is kept to hand out later.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

from admission.config import AdmissionConfig
from admission.learned.patience import Budget, ClientEnd, ClientPatience
from admission.learning import Learning
from admission.lease import PoolShare
from admission.ledger import Ledger, Reservation
from admission.placement import Placement
from admission.refusals import refuse_or_clamp, unknown_model
from admission.report import AdmissionReport
from admission.retries import RETRY_MEMORY_ENTRIES, RetryIdentity, RetryMemory
from admission.scaling import ScalingSignal
from admission.settling import Settling, TenantLimits
from admission.shedding import Shedding
from admission.types import (
    AdmissionRequest,
    Admit,
    AttemptEnd,
    Completion,
    Decision,
    Events,
    RequestEnd,
    Shed,
    Verdict,
)
from routing.types import ReplicaState, Router

__all__ = ["AdmissionController", "TenantLimits"]


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
        self._queue = Settling(config, self._ledger, self._placement, tenants, self._predict)
        self._shedding = Shedding(config, self._ledger, self._queue, seed)
        self._learning = Learning(config)
        self._patience = ClientPatience()
        # Requests left unserved and their clients' retries (admission/retries.py).
        self._retries = RetryMemory(config.retry_memory_s, RETRY_MEMORY_ENTRIES)
        self._scaling = ScalingSignal()  # the demand the scaling signal reads
        self._report = AdmissionReport(
            self._ledger,
            self._queue,
            self._shedding,
            self._placement,
            self._patience,
            self._scaling,
            self._retries,
        )

    @property
    def report(self) -> AdmissionReport:
        """Every read, for the shell, metrics, benches and tests."""
        return self._report

    @property
    def router(self) -> Router:
        """The routing policy admission asks where an admitted request goes."""
        return self._placement.router

    def reconfigure(self, config: AdmissionConfig, router: Router | None, now: float) -> Events:
        """Take reloaded settings for decisions from now on (a replica's learned limit
        keeps what it learned, and new replicas' limits start from the new settings);
        `router` replaces the routing policy. Returns the queued requests they admit."""
        self._saw(now)
        self.config = self._ledger.config = self._queue.config = config
        self._shedding.config = config
        self._learning = Learning(config)  # its derived settings; it keeps no other state
        self._retries.ttl_s = config.retry_memory_s
        if router is not None:
            self._placement.set_router(router)
        return self._settle(now)

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
    ) -> Events:
        """Add or refresh a replica from its adapter-maintained state.

        Capacity is `pinned_capacity` when given, else ``state.capacity_tokens``; the
        running cap is `max_running`, else the engine's ``state.max_running``, else
        ``default_max_running``. A replica that is not ready or whose capacity is unknown
        receives nothing. Returns the queued requests admitted because capacity grew.
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
        return self._settle(now)

    def remove_replica(self, name: str, now: float) -> Events:
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
        return self._settle(now)

    def mark_unready(self, name: str, now: float) -> Events:
        """Stop sending new requests to `name` (e.g. connection refused) until an upsert
        says it is ready again. Existing reservations stay until released. Less room
        admits nobody: its events are none, and are returned as every change's are."""
        self._saw(now)
        rep = self._ledger.replicas.get(name)
        if rep is not None:
            rep.ready = False
            self._views.replica_changed(rep)
        return []

    def set_ejected(self, name: str, ejected: bool, now: float) -> Events:
        """Eject `name` (outlier detection: no new requests, whatever discovery says) or
        return it to service. Its reservations stay until released, as their requests
        end. Returns requests admitted from the queue because a replica returned."""
        self._saw(now)
        rep = self._ledger.replicas.get(name)
        if rep is None or rep.ejected == ejected:
            return []
        rep.ejected = ejected
        self._views.replica_changed(rep)
        return self._settle(now)

    def set_pool_share(
        self,
        replica: str,
        tokens: int | None,
        now: float,
        *,
        running: int | None = None,
        others_running: int = 0,
        others_tokens: int = 0,
    ) -> Events:
        """One replica's share (`set_pool_shares`)."""
        share = PoolShare(replica, tokens, running, others_running, others_tokens)
        return self.set_pool_shares([share], now)

    def set_pool_shares(self, shares: Sequence[PoolShare], now: float) -> Events:
        """Cap each replica's effective pool at the `tokens` this process leased (None: no
        cap) and its running limit at `running` (None: no cap), when several gateway
        processes share the replicas (gateway/state). `others_running` and `others_tokens`
        are what the other processes hold there, so the learned limit judges the
        replica's whole load and the pool check its whole KV. Reservations above a shrunk
        share stay until released; nothing more is admitted there meanwhile. The queue
        settles once, after all of them (a renewal's shares arrive together: settling
        after each placed the queue once per replica). Returns requests admitted because
        a share grew."""
        self._saw(now)
        for share in shares:
            rep = self._ledger.replicas.get(share.replica)
            if rep is None:
                continue
            rep.share_tokens = None if share.tokens is None else max(0, share.tokens)
            rep.share_running = None if share.running is None else max(0, share.running)
            rep.others_reserved = max(0, share.others_tokens)
            rep.others_running = max(0, share.others_running)
            if rep.limit is not None:
                rep.limit.others = max(0, share.others_running)
            self._views.replica_changed(rep)  # its free room and headroom moved
        return self._settle(now)

    def adopt_limit(self, replica: str, value: float, reason: str, now: float) -> Events:
        """Take the learned running limit another gateway process published for
        `replica` (shared state); returns the queued requests a larger limit admits."""
        self._saw(now)
        rep = self._ledger.replicas.get(replica)
        if rep is None or rep.limit is None:
            return []
        rep.limit.adopt(value, now, reason)
        self._views.touch(rep)  # its running headroom moved: the orders follow
        return self._settle(now)

    # ------------------------------------------------------------------ requests
    # ------------------------------------------------------------------ clients' retries
    def arrived(
        self, req: AdmissionRequest, identity: RetryIdentity, now: float, count_stated: bool
    ) -> None:
        """A client's attempt, before its `submit`: known as the retry of a request left
        unserved, it keeps that one's first arrival (its place in line), and what its
        population's retries and told waits taught applies to it (admission/retries.py).
        `count_stated`: its client says which attempt it sends."""
        self._retries.arrived(req, identity, now, count_stated)

    def answered(self, req: AdmissionRequest, verdict: Verdict, now: float) -> None:
        """The verdict a client's attempt got (at once, or once queued): admitted, its
        retry is a newcomer again; shed, it is remembered as left unserved."""
        if isinstance(verdict, Admit):
            self._retries.admitted(req)
        elif isinstance(verdict, Shed) and verdict.reason != "shutdown":
            self._retries.unserved(req, now, verdict.retry_after, verdict.budget)

    def attempt_ended(self, end: AttemptEnd, now: float) -> Events:
        """A client's attempt ended (`AttemptEnd`): routing corrects its prefix index by
        the prompt its engine held cached; a client that left before an answer began is
        remembered as unserved, and one that left or stayed votes on its population's
        clock (admission/learned/toldwait.py); what it shows of its clients' patience is
        learned (`client_ended`). Returns what that patience sheds and admits."""
        req = end.req
        if end.cached_tokens is not None:
            self.router.prompt_cached(req.request_id, end.cached_tokens, end.chars_per_token, now)
        if end.unanswered:
            self._retries.unserved(req, now)
        if end.left is not None:
            self._retries.ended(req, end.arrival, end.left, now)
        if end.patience is None:
            return []
        return self.client_ended(req.tenant, req.model, req.stream, end.patience, now)

    def submit(self, req: AdmissionRequest, now: float) -> Decision:
        """Decide one request: Admit now, Queue, Shed (503/429) or Refuse (400/404); with
        the events the decision caused for queued requests."""
        self._saw(now)
        rid = req.request_id
        queue = self._queue
        if rid in self._ledger.reservations or rid in queue.queued:
            raise ValueError(f"request id {rid!r} is already admitted or queued")
        if not req.avoid:  # a failover's second submit is the same demand
            self._scaling.arrived(req.model, now)
        if req.retry_key is not None:
            self._shedding.returning.discard(req.model, req.retry_key)  # it is back
        view = self._views.view(req.model)
        if not view.present:
            if any(r.present and not r.models for r in self._ledger.replicas.values()):
                # A replica has not told its models yet (never answered a probe): the
                # model may be its; "not found" would not be retried.
                return Decision(Shed(rid, "models_unknown", self._shedding.clamp(None)))
            return Decision(unknown_model(req))
        # One replica per shape answers for all of that shape (admission/candidates.py).
        if view.known_shapes and not any(r.can_ever_fit(req) for r in view.known_shapes):
            answer = refuse_or_clamp(req, view.present)
            if not isinstance(answer, AdmissionRequest):
                return Decision(answer)
            req = answer
        if req.latency_budget is None and req.deadline == math.inf:
            # Its client said nothing: the patience learned from its population's clients
            # is its budget, as a stated timeout would be (admission/learned/patience.py).
            learned = self._patience.budget(req.tenant, req.model, req.stream)
            if learned is not None:
                req = replace(
                    req,
                    latency_budget=learned.seconds,
                    budget_learned=True,
                    budget_whole=learned.whole,
                )
        raw = 0
        shapes = view.usable_shapes
        if req.avoid:
            # One replica per shape may be one it avoids: every other usable one counts.
            shapes = [r for r in view.present if r.usable and r.name not in req.avoid]
        for r in shapes:
            if r.can_ever_fit(req):
                raw = max(raw, r.tokens_for(req))
        if not raw:
            # Down is not full: none of the model's replicas ready, or none that fits.
            reason = "no_replica" if any(r.usable for r in view.present) else "no_replica_ready"
            return Decision(Shed(rid, reason, self._shedding.clamp(None)))
        predicted = self._views.predict(req, view) if req.latency_budget is not None else 0.0
        entry = queue.entry(req, raw, predicted, now)
        events: Events = []
        if queue:
            # Queue it and scan in order: the fair order decides what comes before it,
            # and strict order per replica what it may pass.
            queue.enqueue(entry)
            mine: Admit | Shed | None = None  # admitted, or shed with no time left to start
            for a in self._settle(now):
                if a.request_id == rid:
                    mine = a
                else:
                    events.append(a)
            if mine is not None:
                return Decision(mine, events)
        else:
            admit = queue.admit_alone(entry, now)
            if admit is not None:
                return Decision(admit)
            queue.enqueue(entry)
        verdict, displaced = self._shedding.judge(entry, now)
        events.extend(displaced)
        return Decision(verdict, events)

    def request_ended(self, end: RequestEnd, now: float) -> Events:
        """A request's admission given back (`RequestEnd`): `abandon`ed where its engine
        may still be generating it, else `release`d."""
        if end.abandoned:
            return self.abandon(end.request_id, now, end.completion)
        return self.release(end.request_id, now, end.completion)

    def release(self, request_id: str, now: float, completion: Completion | None = None) -> Events:
        """Free the request's reservation, or drop it from the queue; idempotent.

        `completion` is what the request measured about its replica (latency, usage); the
        learned running limit of that replica feeds on it. None (client disconnect,
        queue exit) teaches nothing.

        Returns the queued requests this admitted, and those it shed: with the first
        service seen, entries queued cold may no longer have time for it.
        """
        self._saw(now)
        res = self._ledger.reservations.get(request_id)
        events: Events = []
        if res is not None:
            self._free(res, now, completion)
            if completion is not None and self._queue.cold:
                # The first service seen: entries queued cold are judged by it before
                # any of them starts (admission/settling.py, `rejudge_cold`).
                self._queue.rejudge_cold(self._predict)
                events.extend(self._shedding.expire(now))
        else:
            entry = self._queue.queued.get(request_id)
            if entry is not None:
                self._queue.dequeue(entry)
        events.extend(self._settle(now))
        return events

    def abandon(self, request_id: str, now: float, completion: Completion | None = None) -> Events:
        """Hold the reservation of a request kvgate stopped waiting for while the engine
        may still be generating it (admission/ledger.py, Abandoned requests);
        `completion` is learned when it is released. Without a reservation (or with
        ``abandoned_hold_s`` 0) this is `release`. Idempotent."""
        self._saw(now)
        res = self._ledger.reservations.get(request_id)
        if res is None or self.config.abandoned_hold_s <= 0:
            return self.release(request_id, now, completion)
        self._ledger.hold(res, now, completion)
        if res.held_until <= now:  # the engine would have served it by now
            return self.release(request_id, now, completion)
        return []

    def client_ended(
        self, tenant: str, model: str, stream: bool, end: ClientEnd, now: float
    ) -> Events:
        """A request whose client stated no timeout ended: its client left (disconnected
        while queued or running) or stayed to the end, `end` says when and, for a
        stream, where. Teaches that population's patience (admission/learned/patience.py).

        Returns the queued requests this shed, and those that then fit: where the
        patience was learned, or learned shorter, the population's queued requests that
        stated nothing are judged by it (admission/settling.py, `rejudge_unstated`)."""
        self._saw(now)
        patience = self._patience
        if not self._queue:  # nobody waits to be judged again
            patience.observe(tenant, model, stream, end, now)
            return []
        before = patience.budget(tenant, model, stream)
        patience.observe(tenant, model, stream, end, now)
        return self._patience_moved((tenant, model, stream), before, now)

    def adopt_patience(
        self, tenant: str, model: str, stream: bool, budget: Budget | None, now: float
    ) -> Events:
        """Take the patience another gateway process learned of a population (shared
        state; None: none usable). Used where this process learned none itself; as
        with `client_ended`, the population's queued requests that stated nothing are
        judged by a shorter one."""
        self._saw(now)
        before = self._patience.budget(tenant, model, stream)
        self._patience.adopt(tenant, model, stream, budget)
        return self._patience_moved((tenant, model, stream), before, now) if self._queue else []

    def _patience_moved(
        self, population: tuple[str, str, bool], before: Budget | None, now: float
    ) -> Events:
        """The queued requests a population's new, shorter patience sheds, and those that
        then fit."""
        after = self._patience.budget(*population)
        if after is None or (before is not None and after.seconds >= before.seconds):
            return []
        self._queue.rejudge_unstated(population, after, self._predict)
        events: Events = list(self._shedding.expire(now))
        if events:
            events.extend(self._settle(now))
        return events

    def top_up(self, request_id: str, total_tokens: int, now: float) -> bool:
        """Grow a reservation to cover `total_tokens` (prompt + generated so far).

        Returns True when the reservation already covers it or was grown; False when the
        replica has no room (the stream continues regardless; counted in
        `top_up_failures`) or the request holds no reservation.
        """
        self._saw(now)
        return self._ledger.top_up(request_id, total_tokens)

    def advance(self, now: float) -> Events:
        """Let time act: shed queued requests past their deadline (``queue_timeout``) or
        whose estimated wait can no longer meet it (``deadline``), release holds past
        ``abandoned_hold_s``, then admit what that and the time now allow (prefixes
        computed, routing's say retried). Returns the sheds, then the admissions."""
        self._saw(now)
        events: Events = []
        events.extend(self._shedding.expire(now))
        for res in self._ledger.overdue(now):
            self._free(res, now, res.completion)
        events.extend(self._settle(now))
        return events

    def next_deadline(self) -> float | None:
        """The earliest deadline among queued requests and held reservations (when
        `advance` should next run)."""
        first = self._queue.queue.next_deadline()
        held = self._ledger.held
        if held:  # each hold ends by its own request's service: not in order of abandonment
            ends = min(res.held_until for res in held.values())
            return ends if first is None else min(first, ends)
        return first

    def set_tenants(self, tenants: Callable[[str], TenantLimits | None]) -> None:
        """Tenant policies by name (weight, max_concurrent, max_queued, queue_timeout_s)."""
        self._queue.set_tenants(tenants)

    # ------------------------------------------------------------------ internals
    def _settle(self, now: float) -> Events:
        """Admit what the queue's order allows now; entries it found with no time left to
        start (`Settling._late`) are shed first."""
        admitted = self._queue.settle(now)
        if not self._queue.overdue:
            return admitted
        self._queue.overdue = False
        return [*self._shedding.expire(now), *admitted]

    def _predict(self, req: AdmissionRequest) -> float:
        """The queue's service prediction for `req` on its model's replicas now."""
        return self._views.predict(req, self._views.view(req.model))

    def _free(self, res: Reservation, now: float, completion: Completion | None) -> None:
        """Return one reservation to its replica's pool and learn from it (no settling)."""
        rep = self._ledger.replicas[res.replica]
        true_tokens = None
        if completion is not None and completion.completion_tokens is not None:
            true_tokens = (completion.prompt_tokens or 0) + completion.completion_tokens
        at_admit = self._queue.queue.released(res.request_id, true_tokens)  # tenant accounting
        self._learning.stream_gap(rep, completion, at_admit, now)
        self._ledger.free(res, now)
        self._scaling.served(res.model, now - res.admitted_at, res.tokens + res.covered, now)
        if res.unbudgeted is not None and completion is not None:
            # Admitted before its clients' patience was learned: scored against it now,
            # or the limit grows on completions it cannot judge while they time out.
            tenant, stream = res.unbudgeted
            learned = self._patience.budget(tenant, res.model, stream)
            if learned is not None:
                res.budget, res.budget_whole = learned.seconds, learned.whole
        self._learning.released(rep, res, completion, now, at_admit)
        self._placement.released(res.request_id, res.replica, now)
        self._ledger.forget_if_gone(rep)
