"""Retry memory: a request kvgate did not serve that comes back keeps its place in line
(sans-IO).

Clients that honour Retry-After (the openai SDKs, batch clients) send the same request
again, and so do clients whose own timeout ran out while it waited. Without memory each
attempt queues as a newcomer, so under sustained overload the order in which requests are
served is a lottery among whoever retries at the right moment: in seed 001's workload
through kvgate at client concurrency 128, one request was shed and retried for 24
simulated minutes while later arrivals got in. With memory, the retry is admitted as of
its first arrival: the queue is ordered by that arrival, so the oldest waiting work goes
first and shed-and-retry approximates one FIFO queue that lives partly in the clients.
The memory also counts each request's unserved attempts (shed, or its client left before
an answer began) and sees whether it came back, which teaches how many attempts clients
that do not say make (admission/learned/retry_budget.py), how long a told wait they come back
after and whose clock their timeout is (admission/learned/toldwait.py).

A retry is known by what its client says (`identify`): an ``Idempotency-Key`` names
the request whatever its body; the openai and anthropic SDKs say which attempt this is
(``x-stainless-retry-count``), so a count of 0 is a first attempt, never another
request's retry, and a count above 0 is the retry of the same (tenant, model, body).
A client that says neither is taken to retry only where the evidence says so: an
identical request that comes back within the time it was told after a shed
(``2 x Retry-After`` and a grace: `remember`'s `said`), or within the grace after it left
before an answer (a client retrying its own timeout). Identical bodies are otherwise
different requests (a load tool, k samples of one prompt, a batch with repeated prompts),
and a client that says nothing and leaves teaches the retry budget nothing, back or not:
a load tool closing its connections at the end of a run is not a crowd of clients that
gave up.

The memory maps a retry's key to its first attempt's arrival time. It is kept per
tenant: a retry is looked up only among its own tenant's entries, and the queue orders
by first arrival only within a tenant (admission.fairqueue), so nobody inherits another
tenant's place. Entries a client said expire `ttl_s` after they were last left unserved;
each tenant's memory holds at most `max_entries` (its oldest dropped first): one
tenant's flood of sheds cannot push another tenant's retries out of memory, and the
whole stays bounded by the number of tenants (which come from configured keys).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Hashable
from typing import NamedTuple

from admission.learned.retry_budget import RetryBudget
from admission.learned.toldwait import ToldWaits
from admission.types import AdmissionRequest

# An attempt not back by `_BACK_FACTOR` times its Retry-After plus `_GRACE_S` is a client
# that gave up: clients round, back off and jitter.
_BACK_FACTOR = 2.0
_GRACE_S = 5.0
# Most unserved requests one tenant's memory holds (its oldest dropped first): memory
# stays bounded under a flood of sheds.
RETRY_MEMORY_ENTRIES = 100_000


class RetryIdentity(NamedTuple):
    """How a request's retries are recognised (module docstring)."""

    key: int  # its retries' key in the memory
    said: bool  # its client says which attempt it is (a retry count, an idempotency key)
    first: bool  # its client says it is a first attempt: nobody's retry


def identify(
    tenant: str,
    model: str,
    body: bytes,
    retry_count: int | None = None,
    idempotency_key: str | None = None,
) -> RetryIdentity:
    """The retry identity of a request from what its client says (module docstring)."""
    if idempotency_key:
        return RetryIdentity(hash((tenant, "idempotency-key", idempotency_key)), True, False)
    key = hash((tenant, model, body))
    if retry_count is not None:
        return RetryIdentity(key, True, retry_count == 0)
    return RetryIdentity(key, False, False)


class Recall(NamedTuple):
    """A recognised retry: its first attempt's arrival and its unserved attempts."""

    arrival: float
    unserved: int


class _Left(NamedTuple):
    """A request left unserved, as the memory keeps it until it is back or forgotten."""

    first: float  # its first attempt's arrival
    expires: float
    unserved: int  # its attempts left unserved so far
    back_by: float  # a client that honours its Retry-After is back by then
    back: bool | None  # came back since; False while awaited; None: it teaches nothing
    told: float  # the Retry-After it was told (0: its client left on its own)
    budget: float | None  # its client's time as it was judged (stated or learned)


class RetryMemory:
    """First-arrival times of requests recently left unserved, per tenant, bounded in time
    and size; and what became of each (back, or given up), from which `RetryBudget`
    learns how many attempts clients that say nothing make."""

    __slots__ = ("_tenants", "ttl_s", "_max", "_due", "_seq", "budget", "told")

    def __init__(self, ttl_s: float, max_entries: int) -> None:
        self._tenants: dict[str, OrderedDict[Hashable, _Left]] = {}
        self.ttl_s = ttl_s  # a reload sets it for the entries stored from then on
        self._max = max_entries
        self._due: list[tuple[float, int, str, Hashable, int]] = []  # (back by, seq, ...)
        self._seq = 0
        self.budget = RetryBudget()
        self.told = ToldWaits(max_entries)

    def __len__(self) -> int:
        return sum(len(e) for e in self._tenants.values())

    def tenant_len(self, tenant: str) -> int:
        return len(self._tenants.get(tenant, ()))

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0 and self._max > 0

    def recall(
        self, key: Hashable, now: float, tenant: str = "default", said: bool = True
    ) -> Recall | None:
        """`tenant`'s `key` if it was left unserved within `ttl_s`: it came back (its
        client says which attempt it sends, or not: `said`)."""
        self._settle(now)
        entries = self._tenants.get(tenant)
        got = entries.get(key) if entries is not None else None
        if got is None or entries is None:
            return None
        if got.expires <= now:
            del entries[key]
            return None
        if got.back is not True:  # its first return since it was left unserved
            # Back after its budget from its first attempt ran out: its clock is an
            # attempt's (admission/learned/toldwait.py).
            past = got.budget is not None and now - got.first > got.budget
            self.told.came_back(tenant, said, got.told, past)
            if got.back is False:  # awaited (None: it teaches the retry budget nothing)
                self.budget.outcome(tenant, got.unserved, came_back=True)
            entries[key] = got._replace(back=True)
        return Recall(got.first, got.unserved)

    def returns_after(self, tenant: str, said: bool) -> float:
        """How long `tenant`'s shed clients (that say which attempt they send, or not:
        `said`) were seen to come back after (admission/learned/toldwait.py). With the memory
        off nothing is seen, and every wait may be told: inf."""
        return self.told.returns_after(tenant, said) if self.enabled else math.inf

    def remember(
        self,
        key: Hashable,
        arrival: float,
        now: float,
        tenant: str = "default",
        retry_after: float = 0.0,
        said: bool = True,
        budget: float | None = None,
    ) -> None:
        """Record that `tenant`'s `key` (first seen at `arrival`) was left unserved at
        `now`: shed and told to come back in `retry_after` seconds, or its client left
        before an answer began (0: its own backoff). Unless its client `said` which
        attempt it sends, an identical request is its retry only until it was due back.
        `budget`: its client's time as kvgate judged it (stated or learned; None: none)."""
        if not self.enabled:
            return
        self._settle(now)
        entries = self._tenants.setdefault(tenant, OrderedDict())
        known = entries.pop(key, None)
        first = min(arrival, known.first) if known is not None else arrival
        unserved = known.unserved + 1 if known is not None else 1
        # A client that honours Retry-After is back by then; its own rounding (whole
        # seconds), backoff and jitter are what the grace allows for.
        back_by = now + _BACK_FACTOR * retry_after + _GRACE_S
        expires = now + self.ttl_s if said else min(now + self.ttl_s, back_by)
        # Awaited, what comes of it teaches the retry budget: unless a client that says
        # nothing left on its own (module docstring).
        awaited: bool | None = False if said or retry_after > 0 else None
        entries[key] = _Left(first, expires, unserved, back_by, awaited, retry_after, budget)
        self._seq += 1
        heapq.heappush(self._due, (back_by, self._seq, tenant, key, unserved))
        while entries:
            oldest_key, oldest = next(iter(entries.items()))
            if oldest.expires > now and len(entries) <= self._max:
                break
            del entries[oldest_key]

    # What clients' attempts do, from AdmissionController (arrived, answered,
    # left_unanswered, attempt_ended), which owns the memory.
    def arrived(
        self, req: AdmissionRequest, ident: RetryIdentity, now: float, count_stated: bool
    ) -> None:
        """Take `req` in: its retry identity and, where it is the retry of a request kvgate
        left unserved, its first arrival (its place in line) and, for a client that does
        not state which retry it sends, whether this is its last
        (admission/learned/retry_budget.py)."""
        req.retry_key, req.retry_said = ident.key, ident.said
        first = None if ident.first else self.recall(ident.key, now, req.tenant, ident.said)
        req.recalled = first is not None
        req.returns_after_s = self.returns_after(req.tenant, ident.said)
        req.budget_from_first = req.recalled and self.told.clock(req.tenant, ident.said) == "call"
        req.arrival = now if first is None else first.arrival
        if first is not None and not count_stated:
            req.last_retry = self.last_attempt(req.tenant, first.unserved)

    def ended(self, req: AdmissionRequest, attempt: float, left: bool, now: float) -> None:
        """`req`, whose attempt arrived at `attempt`, ended at `now`: its client `left`
        before an answer, or stayed to the end. A retry of a client that stated its
        timeout votes on its population's clock (admission/learned/toldwait.py)."""
        if req.recalled and req.latency_budget is not None and not req.budget_learned:
            self.told.retry_ended(
                req.tenant, req.retry_said, req.latency_budget, req.arrival, attempt, left, now
            )

    def admitted(self, req: AdmissionRequest) -> None:
        """`req` got in: a later identical request is a newcomer again."""
        if req.recalled and req.retry_key is not None:
            self.forget(req.retry_key, req.tenant)

    def unserved(
        self,
        req: AdmissionRequest,
        now: float,
        retry_after: float = 0.0,
        budget: float | None = None,
    ) -> None:
        """`req` was shed and told to come back in `retry_after` seconds, or its client
        left before an answer began (0). `budget`: the one the shed judged it by (a learned
        patience is not left on the request; its stated timeout when not given)."""
        if req.retry_key is not None:
            if budget is None:
                budget = req.latency_budget
            self.remember(
                req.retry_key, req.arrival, now, req.tenant, retry_after, req.retry_said, budget
            )

    def forget(self, key: Hashable, tenant: str = "default") -> None:
        """The request got in: later identical requests are newcomers again."""
        entries = self._tenants.get(tenant)
        if entries is not None:
            entries.pop(key, None)

    def last_attempt(self, tenant: str, unserved: int) -> bool:
        """Whether a retry after `unserved` unserved attempts is its client's last."""
        return self.budget.is_last(tenant, unserved)

    def _settle(self, now: float) -> None:
        """Attempts not back by their time: their clients gave up (forgotten ones, which
        got in or aged out, say nothing)."""
        due = self._due
        while due and due[0][0] <= now:
            _, _, tenant, key, unserved = heapq.heappop(due)
            entries = self._tenants.get(tenant)
            got = entries.get(key) if entries is not None else None
            if got is not None and got.unserved == unserved and got.back is False:
                self.budget.outcome(tenant, unserved, came_back=False)


class ReturningBacklog:
    """Shed requests expected back, per model, so that what they will need counts ahead
    of later arrivals (sans-IO).

    A shed is not gone: a client that honours Retry-After returns, and the gateway queues
    it as of its first arrival (`RetryMemory`). Its tokens are therefore part of the true
    backlog ahead of every request that arrived after it, and a Retry-After computed from
    the queue alone sends a crowd back at once, to be shed again. Entries leave when the
    request comes back (`discard` by its key) or when it is overdue (`expires`: a client
    that gave up).

    Entries carry their tenant: under fair queueing a returning request is ahead only of
    later arrivals of its own tenant (another tenant's place in line is set by the fair
    order, not by arrival), so `ahead` can count one tenant's only.
    """

    __slots__ = ("_entries", "_totals", "_heap", "_seq")

    def __init__(self) -> None:
        # model -> key -> (first arrival, expiry, tokens, tenant)
        self._entries: dict[str, dict[Hashable, tuple[float, float, int, str]]] = {}
        # model -> [tokens, count]; (model, tenant) -> [tokens, count]
        self._totals: dict[Hashable, list[int]] = {}
        self._heap: list[tuple[float, int, str, Hashable]] = []
        self._seq = 0

    def add(
        self,
        model: str,
        key: Hashable,
        arrival: float,
        expires: float,
        tokens: int,
        tenant: str = "default",
    ) -> None:
        self.discard(model, key)
        self._entries.setdefault(model, {})[key] = (arrival, expires, tokens, tenant)
        for k in (model, (model, tenant)):
            tot = self._totals.setdefault(k, [0, 0])
            tot[0] += tokens
            tot[1] += 1
        self._seq += 1
        heapq.heappush(self._heap, (expires, self._seq, model, key))

    def discard(self, model: str, key: Hashable) -> None:
        got = self._entries.get(model, {}).pop(key, None)
        if got is not None:
            for k in (model, (model, got[3])):
                tot = self._totals[k]
                tot[0] -= got[2]
                tot[1] -= 1

    def ahead(
        self, model: str, arrival: float, now: float, tenant: str | None = None
    ) -> tuple[int, int]:
        """(tokens, requests) expected back for `model` that arrived before `arrival`
        (only `tenant`'s when given)."""
        self._expire(now)
        entries = self._entries.get(model)
        if not entries:
            return 0, 0
        if arrival >= now:  # a newcomer: everything returning is ahead of it
            tot = self._totals.get(model if tenant is None else (model, tenant))
            return (tot[0], tot[1]) if tot is not None else (0, 0)
        tokens = count = 0
        for first, _, need, who in entries.values():
            if first < arrival and (tenant is None or who == tenant):
                tokens += need
                count += 1
        return tokens, count

    def __len__(self) -> int:
        return sum(t[1] for k, t in self._totals.items() if not isinstance(k, tuple))

    def _expire(self, now: float) -> None:
        heap = self._heap
        while heap and heap[0][0] <= now:
            expires, _, model, key = heapq.heappop(heap)
            got = self._entries.get(model, {}).get(key)
            if got is not None and got[1] == expires:
                self.discard(model, key)
