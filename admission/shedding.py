"""Shedding: which requests may not wait, and the Retry-After they are told.

The wait for a request is estimated as its deficit (tokens, and running slots, that must
free before it fits, counting the queue ahead of it for the same model) divided by the
drain rate of the model's replicas (`admission.learned.drain.DrainMeter`). A request is shed at
submit (503) when the queue is full or the estimated wait exceeds the time to its
deadline, so it is never held only to time out later; 429 when its tenant's own queue is
full. With fewer than ``MIN_DRAIN_SAMPLES`` releases observed there is no evidence to
shed on: the request is queued (its deadline still bounds the wait) and Retry-After is
``COLD_RETRY_AFTER_S`` (at most half the client's budget when it has one).
The delay is clamped to [floor, max_retry_after_s] (by default 60 s), the floor being
``min_retry_after_s`` (1 s) or, if shorter, the time between two releases on the model's
replicas or half the client's budget (`Shedding.clamp`).

A full queue sheds the newcomer whatever its priority, unless its tenant holds less than
its weighted share of the model's queue slots: then the last entry of the tenant most
over its share gives way (shed 503 with Retry-After), so a flood cannot crowd a trickle
out of the queue. `Queued.position` counts the entries of the same model expected to be
served before it (0 = head): higher classes, its own tenant's earlier entries, and what
the other tenants' counters let through before its turn.

Expiry (`expire`, run by the controller's `advance`) sheds entries past their deadline
(``queue_timeout``) or whose re-estimated wait no longer meets it (``deadline``); each is
told its own wait behind every entry before it, kept or shed in the same pass. A client's
last retry, which a shed fails for sure, is shed on no estimate, and at its deadline it
is first given one chance to run over the learned limit (`Replica.allowed_for`).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from admission.binding import binding_ceiling
from admission.config import AdmissionConfig
from admission.fit import round_up
from admission.ledger import Ledger
from admission.retries import ReturningBacklog
from admission.settling import COLD_QUEUE_SHARE, Entry, Settling
from admission.types import AdmissionRequest, Queued, Shed

_LEAST_RETRY_S = 0.01  # the floor's floor: a retry sooner than this is a busy loop
# Releases seen on a model's replicas before their drain rate is believed: the first few
# are single requests' hold times, not a rate.
MIN_DRAIN_SAMPLES = 4
# The Retry-After (and estimated wait) while no release was seen: there is no rate to
# estimate from; a client that stated its timeout, or whose patience was learned, is
# told at most half of that instead.
COLD_RETRY_AFTER_S = 5.0
# The least a model's queue holds when `queue_max_per_model` is unset: the bound before
# it followed the replicas, kept so that a model with a few replicas queues as before.
QUEUE_FLOOR = 256
# A Retry-After's floor is at most this share of its client's budget: a client is never
# told to wait longer than a retry could still use.
_FLOOR_SHARE = 0.5
# A request shed on an estimate is told to be back with this share of its tolerance
# still ahead: estimates are noisy, and one back to find the wait just over its
# tolerance is shed once more.
_BACK_WITH = 0.5
# A shed request's tokens stay in the returning backlog past its jittered Retry-After by
# this share of it (at least `min_retry_after_s`): the clients' own delays.
_RETURN_SLACK = 0.25


@dataclass(slots=True, frozen=True)
class WaitContext:
    """What a wait estimate needs about a model's ready replicas, computed once per call."""

    tokens_per_s: float
    requests_per_s: float
    block_sizes: frozenset[int]
    free_sum: int
    free_max: int
    free_slots: int | None  # None when some replica has no running cap


def wait_for(
    ctx: WaitContext | None, raw: int, ahead_tokens: int, ahead_count: int
) -> float | None:
    """Seconds until a request of `raw` tokens fits behind the queue ahead of it.

    Deficit in tokens: the queue ahead (same model) plus this request, minus what is free
    on the model's ready replicas (and at least what the roomiest replica lacks for this
    request alone). Deficit in running slots likewise when every replica is capped. Each
    deficit is divided by its drain rate; the larger wait wins. None when there is no
    drain history to estimate from.
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


class Shedding:
    """Shed verdicts with their Retry-After, and the backlog of shed requests expected back."""

    def __init__(
        self, config: AdmissionConfig, ledger: Ledger, queue: Settling, seed: int | None
    ) -> None:
        self.config = config
        self._ledger = ledger
        self._views = ledger.views
        self._queue = queue
        self.returning = ReturningBacklog()  # shed requests expected back
        self._rng = random.Random(seed)  # Retry-After jitter

    # ------------------------------------------------------------------ estimates
    def drain_rate(self, model: str, now: float) -> tuple[float, float] | None:
        """(tokens/s, requests/s) released by `model`'s ready replicas, or None while
        fewer than ``MIN_DRAIN_SAMPLES`` releases were seen."""
        reps = [r for r in self._views.serving(model) if r.usable]
        if sum(r.drain.samples for r in reps) < MIN_DRAIN_SAMPLES:
            return None
        tok = req = 0.0
        for rep in reps:
            # A slice of a shared pool grows into what the whole pool releases, not only
            # into what this process's own requests free: judged by its own alone, a
            # process the balancer just turned traffic to told a request to come back
            # after 13 s that another process started within 2 (bench/fleet_vt.py).
            t, q = rep.drain.rates(now, rep.running, rep.reserved, rep.others_reserved)
            tok += t
            req += q
        return tok, req

    def wait_context(self, model: str, now: float) -> WaitContext | None:
        """Drain rates and ready replicas of `model`; None without enough drain history."""
        rates = self.drain_rate(model, now)
        if rates is None:
            return None
        reps = [r for r in self._views.serving(model) if r.usable]
        if not reps:
            return None
        # A slice of a shared pool or running limit (gateway/state) grows at the next
        # renewal into the room the whole has beyond what every process holds or runs
        # there: judging a wait by the slice alone shed requests, for deadlines they
        # would have met, that the fleet had room for (bench/fleet_vt.py, 20 gateways).
        frees = [max(0, r.free, r.room_beyond_slice) for r in reps]
        slots: int | None = None
        allowed = [r.allowed for r in reps]
        if all(a is not None for a in allowed):
            slots = sum(
                max(0, (a or 0) - r.running, r.slots_beyond_slice)
                for a, r in zip(allowed, reps, strict=True)
            )
        return WaitContext(
            rates[0],
            rates[1],
            frozenset(r.block_size for r in reps),
            sum(frees),
            max(frees),
            slots,
        )

    def queue_bound(self, model: str) -> int:
        """The most requests of `model` its queue holds with `queue_max_per_model` unset:
        as many as its replicas run at once, and at least `QUEUE_FLOOR`.

        The bound is a memory guard; deadlines decide who waits (a request that cannot
        start in time is shed on its estimate, not on the queue's length). A fixed bound
        refused requests that had time to wait in front of many replicas: a dead
        gateway's slices, held until their TTL, stood a thousand replicas' worth of
        arrivals in the survivors' queues, and clients' last retries were refused by a
        full queue while their deadlines allowed (bench/fleet_vt.py). A replica runs at
        once its running limit (learned, within its cap; the whole replica's, not this
        process's slice: the slice grows as others' shrink), or fewer where its pool
        binds first, at the mean reservation of what this process runs on the model."""
        reps = self._views.serving(model)
        running = sum(r.running for r in reps)
        reserved = sum(r.reserved for r in reps)
        total = 0
        for r in reps:
            if not r.usable:
                continue
            bounds = []
            whole = r.cap if r.limit is None else r.limit.allowed(r.cap)
            if whole is not None:
                bounds.append(whole)
            if running > 0 and reserved > 0:
                bounds.append(r.effective * running // reserved)
            total += min(bounds) if bounds else 0
        return max(QUEUE_FLOOR, total)

    def _backlog_wait(
        self, model: str, raw: int, now: float, tokens: int, count: int
    ) -> float | None:
        """The wait of `raw` tokens behind the model's whole queue plus what is given."""
        q = self._queue
        return wait_for(
            self.wait_context(model, now),
            raw,
            q.tokens.get(model, 0) + tokens,
            q.per_model.get(model, 0) + count,
        )

    def retry_after(self, model: str, need_tokens: int, now: float) -> float:
        """Seconds until `need_tokens` could be admitted for `model` behind its whole
        backlog (its queue and the shed requests expected back), clamped as `clamp`
        says (no jitter)."""
        back_tokens, back_count = self.returning.ahead(model, now, now)
        wait = self._backlog_wait(model, need_tokens, now, back_tokens, back_count)
        return self.clamp(wait, model, now)

    def clamp(
        self,
        wait: float | None,
        model: str | None = None,
        now: float = 0.0,
        budget: float | None = None,
    ) -> float:
        """`wait` (None: the cold default) within [floor, max_retry_after_s]. The floor is
        ``min_retry_after_s``, lowered to the time between two releases of `model`'s
        replicas and to half the client's own `budget`, when shorter: a replica that
        frees a slot every 50 ms is not waited out twenty times over, nor is a client
        whose whole timeout is 0.87 s (the real vLLM's) told to wait longer than it."""
        value = COLD_RETRY_AFTER_S if wait is None else wait
        floor = self.config.min_retry_after_s
        rates = self.drain_rate(model, now) if model is not None else None
        if rates is not None and rates[1] > 0:
            floor = min(floor, 1.0 / rates[1])
        if budget is not None and budget > 0:
            floor = min(floor, _FLOOR_SHARE * budget)
        floor = max(_LEAST_RETRY_S, floor)
        return min(self.config.max_retry_after_s, max(floor, value))

    # ------------------------------------------------------------------ verdicts
    def shed(
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
        tolerance, when it stated one), jittered by a uniform factor in [1 - j, 1 + j],
        then clamped. Its own tokens join the returning backlog until it is back or
        overdue.
        """
        delay = self._told(req, wait, deadline, now)
        j = self.config.retry_jitter
        if j > 0:
            delay *= self._rng.uniform(1.0 - j, 1.0 + j)
        delay = self.clamp(delay, req.model, now, req.latency_budget)
        key = req.retry_key if req.retry_key is not None else req.request_id
        expires = (
            now + delay * (1.0 + j) + max(self.config.min_retry_after_s, _RETURN_SLACK * delay)
        )
        self.returning.add(req.model, key, req.arrival, expires, raw, req.tenant)
        binds = binding_ceiling(
            self._views.serving(req.model),
            raw,
            self._queue.capped(req.tenant),
            lambda r: self._ledger.peek_room(r, now),
        )
        return Shed(req.request_id, reason, delay, binds=binds, budget=req.latency_budget)

    def _told(
        self, req: AdmissionRequest, wait: float | None, deadline: float, now: float
    ) -> float:
        """The Retry-After `shed` tells `req` before its jitter and clamp."""
        if wait is None:
            # Nothing drained yet to estimate from: a client that stated its budget (or
            # whose patience was learned) is told half of it, the share it could queue
            # for, not a constant: 5 s is six of its attempts for a client whose whole
            # timeout is 0.87 s (the real vLLM), and a tenth of one for a 45 s timeout.
            delay = COLD_RETRY_AFTER_S
            if req.latency_budget is not None and req.latency_budget > 0:
                delay = min(delay, COLD_QUEUE_SHARE * req.latency_budget)
            return delay
        tolerance = deadline - now if math.isfinite(deadline) and deadline > now else 0.0
        return max(0.0, wait - _BACK_WITH * tolerance)

    def comes_back(self, req: AdmissionRequest, wait: float, deadline: float, now: float) -> bool:
        """Whether `req`, shed now on its estimated `wait`, would be told a Retry-After its
        clients were seen to come back after (admission/learned/toldwait.py). One that would not
        is kept queued until its deadline, as a fixed proxy's queue would hold it: a
        client whose timeout counts the wait it is told (or that gives up on a long one)
        is lost by the shed."""
        if req.latency_budget is None:
            return True  # no budget known (none stated or learned): nothing to keep it in
        told = self.clamp(self._told(req, wait, deadline, now), req.model, now, req.latency_budget)
        return told <= req.returns_after_s

    def judge(self, entry: Entry, now: float) -> tuple[Queued | Shed, list[Shed]]:
        """Whether a just-queued `entry` that could not be admitted may wait: Queued, or
        Shed (and dequeued); with the entries it displaced from a full queue."""
        q = self._queue
        req, raw = entry.req, entry.raw
        model = req.model
        model_depth = q.per_model.get(model, 0) - 1  # others of its model
        # Shed requests that will come back before this one count ahead of it (not ahead
        # of a last retry, which queues before them).
        back_tokens, back_count = (
            (0, 0) if req.last_retry else self.returning.ahead(model, req.arrival, now, req.tenant)
        )
        policy = q.tenant_of(req.tenant)
        if (
            policy is not None
            and policy.max_queued is not None
            and q.queue.queued_of(req.tenant) > policy.max_queued
        ):
            # The tenant's own queue is full: a 429 naming the limit it hit.
            capped = q.capped(req.tenant)
            q.dequeue(entry)
            wait = self._backlog_wait(model, raw, now, back_tokens, back_count)
            shed = self.shed(req, raw, "tenant_queue", wait, now, now)
            reason = "tenant_concurrency" if capped else "tenant_queue"
            return replace(shed, reason=reason, status=429), []
        displaced: list[Shed] = []
        limit = self.config.queue_max_per_model
        if limit is None:
            # Walks the model's replicas: only where the floor is reached.
            limit = QUEUE_FLOOR if model_depth < QUEUE_FLOOR else self.queue_bound(model)
        if model_depth >= limit:
            victim = q.queue.victim(entry, limit)
            if victim is not None:
                # The newcomer's tenant holds less than its weighted share of the queue:
                # the last entry of the tenant most over its share gives way.
                q.dequeue(victim)
                vwait = self._backlog_wait(model, victim.raw, now, 0, 0)
                displaced.append(self.shed(victim.req, victim.raw, "queue_full", vwait, now, now))
                model_depth -= 1
        if model_depth >= limit:
            q.dequeue(entry)
            wait = wait_for(
                self.wait_context(model, now),
                raw,
                q.tokens.get(model, 0) + back_tokens,
                model_depth + back_count,
            )
            # No room to queue when it is back until the backlog ahead has drained.
            return self.shed(req, raw, "queue_full", wait, now, now), displaced
        ahead_tokens, position = q.queue.ahead(entry)
        wait = wait_for(
            self.wait_context(model, now), raw, ahead_tokens + back_tokens, position + back_count
        )
        deadline = entry.deadline
        # A client's last retry is never shed on an estimate: shed, it fails for sure;
        # queued at the head, it may still be served (it leaves at its deadline).
        late = (
            wait is not None
            and now + wait > deadline
            and not req.last_retry
            and self.comes_back(req, wait, deadline, now)
        )
        if deadline <= now or late:
            q.dequeue(entry)
            return self.shed(req, raw, "deadline", wait, deadline, now), displaced
        estimated = wait if wait is not None else COLD_RETRY_AFTER_S
        return Queued(req.request_id, position, estimated), displaced

    def expire(self, now: float) -> list[Shed]:
        """Shed queued entries past their deadline (``queue_timeout``) or whose estimated
        wait can no longer meet it (``deadline``), dequeued."""
        q = self._queue
        shed: list[Shed] = []
        ahead: dict[str, tuple[int, int]] = {}  # model -> (tokens, count) of kept entries
        contexts: dict[str, WaitContext | None] = {}
        for entry in list(q):
            model = entry.req.model
            tokens, count = ahead.get(model, (0, 0))
            if model not in contexts:
                contexts[model] = self.wait_context(model, now)
            wait = wait_for(contexts[model], entry.raw, tokens, count)
            # Kept or shed, it is ahead of the entries behind it: a shed one comes back
            # when told and keeps its place (admission/retries.py), so the entries shed
            # in one pass are each told their own wait, not the head's.
            ahead[model] = (tokens + entry.raw, count + 1)
            if entry.deadline <= now:
                if entry.req.last_retry and not entry.req.over_limit:
                    # Out of time to start, a last retry fails for sure if shed: it may
                    # run one over the learned limit at the settle that follows; if the
                    # pool does not hold it, the next pass sheds it.
                    entry.req.over_limit = True
                    continue
                reason = "queue_timeout"
            elif (
                wait is None
                or now + wait <= entry.deadline
                or entry.req.last_retry
                or not self.comes_back(entry.req, wait, entry.deadline, now)
            ):
                continue
            else:
                reason = "deadline"
            q.dequeue(entry)
            shed.append(self.shed(entry.req, entry.raw, reason, wait, entry.deadline, now))
        return shed
