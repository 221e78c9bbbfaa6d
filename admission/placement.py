"""Placement: where an admitted request goes, and whether it waits for a warm replica.

Where an admitted request goes is routing's decision (the `Router` handed in: the gateway
builds it from the config's profiles, `routing.scheduler`); admission tells it when it
places a request and when it frees it (the ``placed`` / ``released`` hooks). Routing is
handed a shortlist, not every replica: the few with the most headroom in per-model
orders that follow every reserve and release, plus the ones routing names
(admission/candidates.py), so a decision costs the same at 4 and 256 replicas. When
routing's warmest replica for a prompt is full and it chose a colder free one, the
request waits for the warm one if that is expected to give its first token sooner
(`_wait_for_warm`). A request's `avoid` set (the replicas that failed it) is blocked
for that request alone, wherever it is placed from.
"""

from __future__ import annotations

import math
from typing import Protocol

from admission.ledger import Ledger
from admission.replica import Replica
from admission.types import AdmissionRequest, Admit
from admission.views import ModelView
from routing.types import Router

# `Placement.place`'s answer when replicas fit but routing's filters rejected them all.
REJECTED = object()

# Replicas shortlisted from each headroom order per decision (admission/candidates.py).
SHORTLIST_PER_ORDER = 4


class Placeable(Protocol):
    """What placement reads of a queue entry (admission.settling.Entry)."""

    req: AdmissionRequest
    raw: int
    entered: float


class Placement:
    """Asks routing for a replica among those that fit, and reserves it there."""

    def __init__(self, router: Router, ledger: Ledger) -> None:
        # Where a request goes is routing's decision (routing.scheduler builds it from the
        # config's profiles, a test or bench hands one in); admission only calls it and its
        # hooks, and imports routing's types, never its policies.
        self._ledger = ledger
        self.set_router(router)
        # Expected-TTFT choices between a full warm replica and a free cold one
        # (`_wait_for_warm`), by outcome: exported beside routing's decisions.
        self.ttft_choices: dict[str, int] = {}

    def set_router(self, router: Router) -> None:
        """Route with `router` from now on (a reloaded config). Requests the old one
        placed end without telling it: routing's memory of them starts afresh."""
        self.router = router

    def released(self, request_id: str, replica: str, now: float) -> None:
        """Tell routing a request it placed has ended."""
        self.router.released(request_id, replica, now)

    def candidate_names(self, req: AdmissionRequest) -> set[str]:
        """Usable replicas `req` could ever run on (none that it avoids): the replicas of
        each shape it fits, as the view groups them (a fit is a shape's, so a queue
        entry that fits nowhere now costs a look per shape, not per replica)."""
        view = self._ledger.views.view(req.model)
        names: set[str] = set()
        for rep, group in zip(view.usable_shapes, view.usable_names, strict=True):
            if rep.can_ever_fit(req):
                names.update(group)
        if req.avoid:
            names -= req.avoid
        return names

    def place(self, entry: Placeable, blocked: set[str], now: float) -> Admit | object | None:
        """Admit `entry` to a non-blocked replica that fits it now, chosen by routing.

        Routing scores a shortlist (admission/candidates.py): the first
        ``SHORTLIST_PER_ORDER`` fitting replicas by KV headroom and by running headroom,
        plus those routing names (`Router.hints`); only those candidates are refreshed.
        The KV order is walked only while a replica's free share of the largest pool
        could hold the request's smallest reservation (`_least_need`): where every
        slice is full the decision looks at none, not at every replica.
        When routing rejects the whole shortlist and replicas outside it fit, it is asked
        again with all of them. None when nothing fits now; `REJECTED` when replicas fit
        but routing rejected every one of them. Replicas in ``req.avoid`` are blocked
        for this request (a copy of `blocked`: only a retry pays for it)."""
        req = entry.req
        if req.avoid:
            blocked = blocked | req.avoid
        ledger = self._ledger
        fits_now = ledger.fits_now
        view = ledger.views.view(req.model)
        reps = ledger.replicas
        fit: dict[str, bool] = {}
        short: list[Replica] = []
        complete = True  # every replica of the model was examined, or shown not to fit
        pruned = False  # some were shown not to fit without being examined
        least = 0  # `_least_need`, taken at the first replica of the KV order that does not fit
        largest = view.largest_pool
        k = SHORTLIST_PER_ORDER
        orders = ledger.views.orders(view)
        for order, by_free in ((orders.by_free(), True), (orders.by_run(), False)):
            got = 0
            for key, name in order:
                if by_free and least and -key * largest + 1 < least:
                    # Most free first: none from here on has the tokens it needs (its free
                    # fraction of the largest pool is less), so none is examined.
                    pruned = True
                    break
                ok = fit.get(name)
                if ok is None:
                    rep = reps.get(name)
                    ok = rep is not None and name not in blocked and fits_now(rep, req, now)
                    fit[name] = ok
                    if ok and rep is not None:  # ok implies the second: for the type checker
                        short.append(rep)
                if ok:
                    got += 1
                    if got >= k:
                        complete = False
                        break
                elif by_free and not least:
                    least = _least_need(view, req)  # only once a replica falls short
            if complete:
                break  # the first order was walked to its end: nothing else fits
        # Routing reads the request itself (it is a RouteRequest), set for this decision.
        req.need_tokens = entry.raw
        req.now = now
        hinted: list[str] = []
        if not complete:
            hinted = self.router.hints(req)
            for name in hinted:
                if name not in fit:
                    rep = reps.get(name)
                    ok = (
                        rep is not None
                        and req.model in rep.models
                        and name not in blocked
                        and fits_now(rep, req, now)
                    )
                    fit[name] = ok
                    if ok and rep is not None:  # as above
                        short.append(rep)
        if not short:
            return None
        choice = self.router.pick(req, [r.cand for r in short])
        if choice is None and not complete:
            rest = [
                r
                for r in view.present
                if r.name not in fit and r.name not in blocked and fits_now(r, req, now)
            ]
            for r in rest:
                fit[r.name] = True
            if rest:
                choice = self.router.pick(req, [r.cand for r in short + rest])
        if choice is None:
            return REJECTED
        rep = reps.get(choice.name)
        if rep is None or not fit.get(choice.name):
            raise ValueError(f"picker returned {choice.name!r}, which was not a candidate")
        if req.prefix_hashes:
            # Only when a replica routing may prefer could not be a candidate (full).
            if complete:
                full = pruned or not all(fit.values())
            else:
                full = any(not fit.get(name, True) for name in hinted)
            if full and self._wait_for_warm(req, rep, fit, now):
                return REJECTED  # waits for the warm replica without blocking anyone
        admit = ledger.reserve(rep, req, now, entry.entered)
        self.router.placed(req, rep.cand, now)
        return admit

    def _wait_for_warm(
        self,
        req: AdmissionRequest,
        chosen: Replica,
        fit: dict[str, bool],
        now: float,
    ) -> bool:
        """Whether `req` should wait for the warm replica routing would rather use (it
        holds more of the prompt cached but is full now) instead of starting on `chosen`.

        Expected time to first token on the warm replica: its queue wait (its KV deficit
        for this request over its drain rate in tokens/s, and its running-slot deficit
        over its rate in requests/s) plus the prefill of the part it does not hold;
        against the prefill of what `chosen` does not hold, starting now. Prefill times
        are the replicas' own fitted TTFT models (`admission.learned.service`); without samples on
        either, or without a drain rate on the warm one, there is no basis to wait and
        the request starts now. Routing names the warm replicas (`Router.warm`); this is
        admission's when, not routing's where."""
        warm = self.router.warm(req)
        if not warm:
            return False
        name, cached = warm[0]
        if name == chosen.name or fit.get(name):
            return False  # the warm replica was a candidate: routing weighed it
        if name in req.avoid:
            return False  # it failed this request: never worth waiting for
        w = self._ledger.replicas.get(name)
        if w is None or not w.usable or req.model not in w.models or not w.can_ever_fit(req):
            return False
        here = next((t for n, t in warm if n == chosen.name), 0)
        if cached <= here or not len(w.ttft) or not len(chosen.ttft):
            return False
        tok_rate, req_rate = w.drain.rates(now)
        wait = 0.0
        deficit = Ledger.need(w, req, now)[0] - w.free
        if deficit > 0:
            wait = deficit / tok_rate if tok_rate > 0 else math.inf
        allowed = w.allowed
        if allowed is not None and w.running >= allowed:
            slots = w.running - allowed + 1
            wait = max(wait, slots / req_rate if req_rate > 0 else math.inf)
        if not math.isfinite(wait):
            return False
        prompt = max(1, req.prompt_tokens)
        t_warm = wait + w.ttft.predict(max(1, prompt - cached), load=w.serving_load)
        t_cold = chosen.ttft.predict(max(1, prompt - here), load=chosen.serving_load)
        verdict = "expected_ttft_wait" if t_warm < t_cold else "expected_ttft_cold"
        self.ttft_choices[verdict] = self.ttft_choices.get(verdict, 0) + 1
        return t_warm < t_cold


def _least_need(view: ModelView, req: AdmissionRequest) -> int:
    """A lower bound of what admitting `req` adds to any replica of `view`'s ledger: its
    smallest reservation over their shapes, or one token where a prefix shared with
    running requests may count against it (`Ledger.less_shared`)."""
    if view.shares_prefix and req.prefix_hashes and req.prefix_block_tokens > 0:
        return 1
    return max(1, min((r.tokens_for(req) for r in view.usable_shapes), default=1))
