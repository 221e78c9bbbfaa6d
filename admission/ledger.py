"""The ledger: reservations held against each replica's pool.

Each admitted request holds one reservation on one replica, sized by admission/replica.py.
The sum of reservations on a replica never exceeds its effective pool because of an
admission or a top-up (invariant 3); it can exceed it only when the pool itself shrinks,
and then nothing more is admitted there until enough is released. The number of
reservations never exceeds the replica's running limit.

Shared prefixes
    On an engine that keeps one copy of a prompt prefix its running requests share
    (``ReplicaState.shares_prefix``: vLLM's prefix caching, SGLang's radix cache), a
    reservation pins its prompt's block hash chain there and holds its need less the
    prefix blocks already pinned and computed, which are counted once however many pin
    them (admission/prefixshare.py states the bounds that keep this at or above what the
    engine holds). A request admitted while another still computes the same prefix pays
    for its whole prompt, as the engine computes its own copy.

Abandoned requests
    A non-stream request kvgate stops waiting for (its client left, or the upstream timed
    out) may still be generating: llama-server notices a gone client only after a quiet
    second, and on a busy server not at all. Its reservation is *held* (`hold`) until a
    discovery round that began after the abandonment shows the engine running no more
    requests than kvgate's live ones (`stopped`), or until ``abandoned_hold_s`` has passed
    (`overdue`); then it is released as any other. On an engine that preempts, where
    admitting past a ghost costs a preemption and not an error, a hold also ends at twice
    the replica's upper estimate of the request's service from its admission
    (`Replica.service`: the slowest of its recent completions of that size), by when an
    engine that went on generating has finished it. Without that, on an engine with no
    running gauge, clients that time out together held their slots for the whole
    ``abandoned_hold_s`` and the next clients queued behind requests long finished.
    llama.cpp, which fails requests past its pool, keeps the whole hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from admission.config import AdmissionConfig
from admission.fit import can_ever_fit
from admission.learned.drain import DRAIN_WINDOW_S, DrainMeter
from admission.learned.limit import RunningLimit
from admission.replica import Replica
from admission.room import deadline_room
from admission.types import AdmissionRequest, Admit, Completion
from admission.views import ModelViews
from routing.types import ReplicaState

# How long after its admission a prompt's blocks are taken to be computed (shareable)
# while neither the replica's time to first token nor its service is learned: its first
# completion teaches the second.
PREFIX_SETTLE_S = 2.0
# Twice the replica's upper estimate, where a time must surely have passed: a prompt's
# blocks taken as computed, an abandoned request's engine work taken as ended.
_UPPER = 2.0


@dataclass(slots=True)
class Reservation:
    request_id: str
    replica: str
    model: str
    tokens: int  # its private part: the prefix blocks it pins are counted once, apart
    admitted_at: float
    pins: tuple[int, ...] = ()  # the prefix block hashes it pins on its replica
    covered: int = 0  # tokens of its need that those pinned blocks hold
    budget: float | None = None  # the latency budget it was admitted under (Admit's)
    budget_whole: bool = False  # a stream's budget bounds its whole response
    prompt_tokens: int = 0  # its prompt and reserved output, for its predicted service
    output_tokens: int = 0
    # When its client gives up on it (its attempt's arrival + a budget that bounds the
    # whole response): growing the limit must not slow it past this.
    due: float = math.inf
    # Since its first attempt's arrival (a Retry-After slept is queueing too) until admitted.
    waited: float = 0.0
    # (tenant, stream) of a client that stated nothing, admitted before its population's
    # patience was learned: scored against that patience once it is (AdmissionController).
    unbudgeted: tuple[str, bool] | None = None
    # Set by `hold`: since when, until when at most, and what to learn on release.
    held_since: float | None = None
    held_until: float = math.inf
    completion: Completion | None = None


class Ledger:
    """Replicas by name, the reservations on them, and the abandoned ones held."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self.replicas: dict[str, Replica] = {}
        self.views = ModelViews(self.replicas)
        self.reservations: dict[str, Reservation] = {}
        self.held: dict[str, Reservation] = {}  # abandoned, in order of abandonment
        # The live reservations whose client's deadline bounds them, by replica: what its
        # deadline room is computed from (admission/room.py).
        self.bounded: dict[str, dict[str, Reservation]] = {}
        # Reservations a stream outgrew while its replica had no room (exported by the shell).
        self.top_up_failures = 0
        self.latest = 0.0  # the latest `now` a call passed (reads judge by it)

    # ------------------------------------------------------------------ replicas
    def add_replica(self, name: str, limit: RunningLimit | None) -> Replica:
        rep = self.replicas[name] = Replica(
            name=name, drain=DrainMeter(DRAIN_WINDOW_S), limit=limit
        )
        return rep

    def forget_if_gone(self, rep: Replica) -> None:
        """Drop a removed replica once its last reservation is released; else follow
        its ledger in the views."""
        if not rep.present and rep.running == 0:
            del self.replicas[rep.name]
            self.views.membership_changed()
        else:
            self.views.touch(rep)

    # ------------------------------------------------------------------ fit
    @staticmethod
    def need(rep: Replica, req: AdmissionRequest, now: float) -> tuple[int, int]:
        """What admitting `req` to `rep` now adds to its ledger, and how many leading
        prefix blocks it shares there with running requests (module docstring, Shared
        prefixes): its reservation less the shared blocks, which are counted once
        already, less a margin for the partial blocks at the edge of the shared part."""
        return Ledger.less_shared(rep, req, rep.tokens_for(req), now)

    @staticmethod
    def less_shared(
        rep: Replica, req: AdmissionRequest, tokens: int, now: float
    ) -> tuple[int, int]:
        """`need` for a reservation of `tokens` already computed (`Replica.tokens_for`)."""
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

    def fits_now(self, rep: Replica, req: AdmissionRequest, now: float) -> bool:
        """`rep` can take `req` now; if so its candidate is refreshed in place (the
        ledger now, the engine view's age). On every candidate of every decision: the
        reservation is computed once (`tokens_for`'s memo), for the fit and the need."""
        if not rep.usable:
            return False
        tokens = rep.tokens_for(req)
        if not can_ever_fit(rep.fit, req.prompt_tokens, req.max_tokens, tokens):
            return False
        allowed = rep.allowed_for(req.over_limit)
        running = rep.running
        if allowed is not None and running >= allowed:
            return False
        if not req.over_limit and running + rep.others_running + 1 > (
            self.room(rep, now) if rep.room_stale else rep.room  # `room`, without a call
        ):
            # One more would slow a running request past its deadline, by an upper
            # estimate: a last retry out of time to start, which fails for sure if shed,
            # is taken all the same (as past the learned limit, `allowed_for`). The room
            # counts the whole replica's load (`Replica.whole_running`, summed here
            # without the property's call: every candidate of every decision).
            return False
        free = rep.free
        need, shared = Ledger.less_shared(rep, req, tokens, now)
        if need > free:
            return False
        rep.need_memo = (req.request_id, now, need, shared)
        c = rep.cand
        c.free_tokens = free
        c.effective_capacity = rep.effective
        c.running = running
        c.max_running = allowed
        view_at = rep.view_at
        c.view_age_s = (now - view_at if now > view_at else 0.0) if view_at else 0.0
        itl = rep.itl
        c.predicted_itl_s = (
            itl.predict(running + 1) if itl is not None and req.itl_target_s else None
        )
        return True

    def settle_time(self, rep: Replica, req: AdmissionRequest) -> float:
        """How long after admission the prompt blocks of `req` on `rep` are taken to be
        computed (shareable): twice its predicted time to first token there (streams
        teach it), else twice the predicted service of its prompt alone (every completion
        teaches that: an upper bound of its prefill), or ``PREFIX_SETTLE_S`` while neither
        is learned."""
        load = rep.allowed or rep.running + 1
        prompt = max(1, req.prompt_tokens)
        if len(rep.ttft):
            return _UPPER * rep.ttft.predict(prompt, load=load)
        if len(rep.service):
            return _UPPER * rep.service.predict(prompt, load=load)
        return PREFIX_SETTLE_S

    # ------------------------------------------------------------------ reserve / free
    def reserve(
        self, rep: Replica, req: AdmissionRequest, now: float, entered: float | None = None
    ) -> Admit:
        """Reserve `req` on `rep`, which `fits_now` just accepted."""
        memo = rep.need_memo
        if memo is not None and memo[0] == req.request_id and memo[1] == now:
            tokens, shared = memo[2], memo[3]
        else:
            tokens, shared = self.need(rep, req, now)
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
                now + self.settle_time(rep, req),
                tokens,
            )
            private = tokens - added
        rep.reserved += tokens
        rep.running += 1
        rep.drain.set_busy(True, now)
        if rep.limit is not None:
            rep.limit.running_changed(rep.running, now)
        full = rep.tokens_for(req)  # its whole need, the shared part included
        since = now if entered is None else entered
        first = req.arrival if req.arrival < since else since  # not min(): a call per decision
        res = self.reservations[req.request_id] = Reservation(
            req.request_id,
            rep.name,
            req.model,
            private,
            now,
            pins,
            full - private,
            budget=req.latency_budget,
            budget_whole=req.budget_whole,
            prompt_tokens=max(1, req.prompt_tokens),
            output_tokens=max(0, req.expected_output),
            due=_due(req, since),
            waited=now - first,
        )
        if req.latency_budget is None and req.deadline == math.inf:
            res.unbudgeted = (req.tenant, req.stream)
        if res.due != math.inf:
            self.bounded.setdefault(rep.name, {})[req.request_id] = res
        self.views.touch(rep)  # and the room: the load it serves at moved
        return Admit(req.request_id, rep.name, full, req.latency_budget)

    def free(self, res: Reservation, now: float) -> Replica:
        """Return one reservation's tokens and slot to its replica (the caller learns
        from it, then calls `forget_if_gone`)."""
        del self.reservations[res.request_id]
        rep = self.replicas[res.replica]
        if res.held_since is not None:
            del self.held[res.request_id]
            rep.held -= 1
        freed = res.tokens
        if res.pins and rep.prefixes is not None:
            freed += rep.prefixes.unpin(res.pins)
        rep.reserved -= freed
        rep.running -= 1
        self._unbound(res)
        # The room is recomputed at its next use, after the caller has also refit the
        # replica's service from this completion.
        rep.room_stale = True
        rep.drain.record(freed, now, now - res.admitted_at)
        rep.drain.set_busy(rep.running > 0, now)
        return rep

    def top_up(self, request_id: str, total_tokens: int) -> bool:
        """Grow a reservation to cover `total_tokens` (prompt + generated so far); False
        when the replica has no room (counted) or the request holds no reservation."""
        res = self.reservations.get(request_id)
        if res is None:
            return False
        rep = self.replicas[res.replica]
        target = rep.need(total_tokens)
        if rep.private_slots and rep.max_model_len:
            # A private slot holds at most its own context (llama.cpp stops the slot
            # there): a stream the relay counts past it takes no more than its slot.
            target = min(target, rep.need(rep.max_model_len))
        if target <= res.tokens + res.covered:
            return True
        extra = target - res.tokens - res.covered
        if not rep.present or extra > rep.free:
            self.top_up_failures += 1
            return False
        rep.reserved += extra
        res.tokens += extra
        self.views.touch(rep)
        return True

    def room(self, rep: Replica, now: float) -> float:
        """The most requests `rep` may run without slowing a running one past its
        client's deadline (admission/room.py): admission holds it to that. Recomputed
        only after a reservation there came or went, its service was refit, or its view
        was refreshed (a discovery round)."""
        if rep.room_stale:
            rep.room = self._room(rep, now)
            rep.room_stale = False
        return rep.room

    def peek_room(self, rep: Replica, now: float) -> float:
        """`room` read without keeping it: a reading (the report, a metrics scrape) leaves
        the next decision to work it out at its own time, as it would have unread."""
        return self._room(rep, now) if rep.room_stale else rep.room

    def _room(self, rep: Replica, now: float) -> float:
        bounded = self.bounded.get(rep.name)
        if not bounded:
            return math.inf
        return deadline_room(rep.service, rep.serving_load, bounded.values(), now)

    def _unbound(self, res: Reservation) -> None:
        bounded = self.bounded.get(res.replica)
        if bounded is not None and bounded.pop(res.request_id, None) is not None and not bounded:
            del self.bounded[res.replica]

    # ------------------------------------------------------------------ holds
    def hold(self, res: Reservation, now: float, completion: Completion | None) -> None:
        """Keep an abandoned request's reservation (module docstring); idempotent."""
        if res.held_since is None:
            res.held_since = now
            rep = self.replicas[res.replica]
            res.held_until = now + self.config.abandoned_hold_s
            # Where over-admitting costs a preemption, not an error (module docstring).
            if rep.preempts:
                load = rep.serving_load
                served_by = rep.service.predict(res.prompt_tokens, res.output_tokens, load)
                if served_by > 0:  # 0: no completion seen yet, nothing to bound it by
                    res.held_until = min(res.held_until, res.admitted_at + _UPPER * served_by)
            res.completion = completion
            rep.held += 1
            self.held[res.request_id] = res
            self._unbound(res)  # its client has gone: no deadline left to keep
            rep.room_stale = True

    def overdue(self, now: float) -> list[Reservation]:
        """Held reservations whose ``abandoned_hold_s`` has passed."""
        return [r for r in self.held.values() if r.held_until <= now]

    def stopped(self, rep: Replica, state: ReplicaState) -> list[Reservation]:
        """The held reservations of `rep` that its engine has stopped working on.

        The engine had ``engine_running + engine_waiting`` requests when the round began;
        kvgate's live (not held) ones admitted before then account for some of them, so
        at most the rest are held requests still generating. The others have stopped: the
        oldest held reservations that the view can judge (abandoned before the round
        began). Each view is used once. As kvgate never admits more than the running cap
        (llama.cpp: the slot count), held ones included, its live requests are not left
        waiting inside the engine; other clients of the engine only make the hold longer
        (up to ``abandoned_hold_s``).
        """
        seen = state.running_seen_at
        if seen is None or seen == rep.judged_at:
            return []  # no gauge, or one already judged by
        rep.judged_at = seen
        # Only live requests admitted before the round began can be in its count (one
        # still on its way to the engine makes this hold a little less long).
        live = sum(
            1
            for r in self.reservations.values()
            if r.replica == rep.name and r.held_since is None and r.admitted_at < seen
        )
        has = state.engine_running + state.engine_waiting  # the engine's requests, all
        stopped = rep.held - max(0, has - live)
        if stopped <= 0:
            return []
        judged = [
            r
            for r in self.held.values()
            if r.replica == rep.name and r.held_since is not None and r.held_since < seen
        ]
        return judged[:stopped]


def _due(req: AdmissionRequest, entered: float) -> float:
    """When the client of `req` gives up on it, if its budget bounds the whole response."""
    budget = req.latency_budget
    if budget is None or (req.stream and not req.budget_whole):
        return math.inf
    return entered + budget
