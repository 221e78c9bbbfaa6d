"""The admission queue's order: priority classes, weighted fair sharing across tenants
in tokens, earliest deadline first within a tenant (sans-IO).

Policy
    1. Priority classes: every entry of a higher ``priority`` comes before any entry of a
       lower one (the tenant's allowed range bounds what a client may ask for).
    2. Within a class, tenants share by weight, measured in tokens, as the Virtual Token
       Counter (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024):
       each tenant has a counter advanced by the tokens it is served divided by its
       weight (charged its estimate, prompt + expected output, when admitted; corrected
       to the engine's usage when it ends), and the backlogged tenant with the smallest
       counter goes next. A tenant that becomes backlogged is lifted to the smallest
       counter among the backlogged (or to where the last backlog ended), so idle time
       banks no credit: a trickle is served at once, a flood gets what is left, and no
       tenant can starve another by sending more.
    3. Within a tenant, earliest deadline first, where a recognised retry counts from its
       first attempt (deadline less the time since its first arrival: it keeps its place,
       `admission.retries`), and the client's last retry goes before its first attempts.
       Ties go by first arrival, then submission order.

    `visit` yields the entries in that order for the controller's strict-order-per-replica
    scan; the counters move as entries are admitted during the scan, so the order is
    recomputed after every admission. A tenant at its concurrency cap is passed over
    (its entries wait without blocking anyone). Iterating the queue gives the same order
    projected without admissions (for expiry and wait estimates).

Cost
    Insert and remove are a bisect in the tenant's own lane; `visit` keeps a heap of the
    class's tenants (O(log tenants) per step); the earliest deadline is a lazy heap.
    Only a newly backlogged tenant's lift and the wait projection are O(tenants).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from admission.types import AdmissionRequest


class _QEntry(Protocol):
    """What the queue reads of an entry (admission.settling.Entry)."""

    key: tuple[int, int, float, float, int]
    raw: int
    deadline: float
    queued: bool

    @property
    def req(self) -> AdmissionRequest: ...


# The queue's entries: admission.settling's Entry (FairQueue[Entry]).
_E = TypeVar("_E", bound=_QEntry)


@dataclass(slots=True)
class _Lane(Generic[_E]):
    """One tenant's entries in one priority class, by key."""

    entries: list[_E]
    keys: list[tuple[int, int, float, float, int]]
    tokens: int = 0
    model_tokens: dict[str, int] | None = None
    model_count: dict[str, int] | None = None

    def add_model(self, model: str, raw: int, sign: int) -> None:
        if self.model_tokens is None or self.model_count is None:
            self.model_tokens, self.model_count = {}, {}
        self.model_tokens[model] = self.model_tokens.get(model, 0) + sign * raw
        self.model_count[model] = self.model_count.get(model, 0) + sign


@dataclass(slots=True)
class _Served:
    tenant: str
    charged: int
    running_at_admit: int


class FairQueue(Generic[_E]):
    """Entries by priority class, then VTC across tenants, then EDF within a tenant."""

    def __init__(self, weight_of: Callable[[str], float] | None = None) -> None:
        self._weight_of = weight_of or (lambda _t: 1.0)
        self._classes: dict[int, dict[str, _Lane[_E]]] = {}
        self._prios: list[int] = []  # sorted, highest first
        self._counter: dict[str, float] = {}
        self._backlog: dict[str, int] = {}  # tenant -> entries queued (all classes)
        self._floor = 0.0  # counter level where the last backlog ended
        self._n = 0
        self._deadlines: list[tuple[float, int, _E]] = []
        self._dseq = 0
        self._served: dict[str, _Served] = {}  # request id -> what it was charged
        self.running: dict[str, int] = {}  # tenant -> admitted, not yet released

    # ------------------------------------------------------------------ size
    def __len__(self) -> int:
        return self._n

    def __bool__(self) -> bool:
        return self._n > 0

    def queued_of(self, tenant: str) -> int:
        return self._backlog.get(tenant, 0)

    def counter(self, tenant: str) -> float:
        return self._counter.get(tenant, 0.0)

    def weight(self, tenant: str) -> float:
        w = self._weight_of(tenant)
        return w if w > 0 else 1.0

    # ------------------------------------------------------------------ insert / remove
    def insert(self, entry: _E) -> None:
        req = entry.req
        tenant = req.tenant
        if not self._backlog.get(tenant):
            self._lift(tenant)
        prio = req.priority
        lanes = self._classes.get(prio)
        if lanes is None:
            lanes = self._classes[prio] = {}
            bisect.insort(self._prios, -prio)
        lane = lanes.get(tenant)
        if lane is None:
            lane = lanes[tenant] = _Lane([], [])
        i = bisect.bisect_left(lane.keys, entry.key)
        lane.keys.insert(i, entry.key)
        lane.entries.insert(i, entry)
        lane.tokens += entry.raw
        lane.add_model(req.model, entry.raw, 1)
        self._backlog[tenant] = self._backlog.get(tenant, 0) + 1
        self._n += 1
        entry.queued = True
        self._dseq += 1
        heapq.heappush(self._deadlines, (entry.deadline, self._dseq, entry))

    def tighten(self, entry: _E, deadline: float) -> None:
        """Bring a queued entry's deadline forward (its place in its lane stays: that is
        the order of first arrival's deadline, which a later judgement does not move)."""
        if deadline < entry.deadline:
            entry.deadline = deadline
            self._dseq += 1
            heapq.heappush(self._deadlines, (deadline, self._dseq, entry))

    def remove(self, entry: _E) -> None:
        req = entry.req
        tenant = req.tenant
        prio = req.priority
        lanes = self._classes[prio]
        lane = lanes[tenant]
        i = bisect.bisect_left(lane.keys, entry.key)
        del lane.keys[i]
        del lane.entries[i]
        lane.tokens -= entry.raw
        lane.add_model(req.model, entry.raw, -1)
        if not lane.entries:
            del lanes[tenant]
            if not lanes:
                del self._classes[prio]
                self._prios.remove(-prio)
        left = self._backlog[tenant] - 1
        if left:
            self._backlog[tenant] = left
        else:
            del self._backlog[tenant]
            self._floor = max(self._floor, self._counter.get(tenant, 0.0))
        self._n -= 1
        entry.queued = False

    def _lift(self, tenant: str) -> None:
        """A tenant becomes backlogged: no credit for the time it was idle."""
        if self._backlog:
            level = min(self._counter.get(t, 0.0) for t in self._backlog)
        else:
            level = self._floor
        if self._counter.get(tenant, 0.0) < level:
            self._counter[tenant] = level

    # ------------------------------------------------------------------ service
    def admitted(self, req: AdmissionRequest, running_after: int) -> None:
        """`req` got a reservation: charge its tenant's counter its estimate."""
        tenant = req.tenant
        cost = max(1, req.prompt_tokens) + max(0, req.expected_output)
        self._counter[tenant] = self._counter.get(tenant, 0.0) + cost / self.weight(tenant)
        self._served[req.request_id] = _Served(tenant, cost, running_after)
        self.running[tenant] = self.running.get(tenant, 0) + 1

    def released(self, request_id: str, true_tokens: int | None) -> int | None:
        """`request_id`'s reservation ended; correct its charge to `true_tokens` when
        known. Returns the running count it was admitted at (None if unknown)."""
        s = self._served.pop(request_id, None)
        if s is None:
            return None
        left = self.running.get(s.tenant, 0) - 1
        if left > 0:
            self.running[s.tenant] = left
        else:
            self.running.pop(s.tenant, None)
        if true_tokens is not None and true_tokens > 0:
            delta = (true_tokens - s.charged) / self.weight(s.tenant)
            self._counter[s.tenant] = self._counter.get(s.tenant, 0.0) + delta
        return s.running_at_admit

    # ------------------------------------------------------------------ order
    def visit(self, passed_over: Callable[[str], bool]) -> Iterator[_E]:
        """Entries in service order for one scan; the caller may admit (remove) the entry
        it was given before asking for the next, and the order follows the counters.
        Tenants for which `passed_over` is true (at their concurrency cap) are skipped."""
        for neg in list(self._prios):
            lanes = self._classes.get(-neg)
            if not lanes:
                continue
            # Ties of the counter go to the earlier head (deadline, then first arrival).
            heap = [(self._counter.get(t, 0.0), lane.keys[0], t) for t, lane in lanes.items()]
            heapq.heapify(heap)
            pos = dict.fromkeys(lanes, 0)
            while heap:
                _, _, tenant = heap[0]
                lane = lanes.get(tenant)
                i = pos[tenant]
                if lane is None or i >= len(lane.entries) or passed_over(tenant):
                    heapq.heappop(heap)
                    continue
                entry = lane.entries[i]
                yield entry
                if entry.queued:  # not admitted: the next of this tenant may be tried
                    pos[tenant] = i + 1
                    i += 1
                if i < len(lane.entries):
                    item = (self._counter.get(tenant, 0.0), lane.keys[i], tenant)
                    heapq.heapreplace(heap, item)
                else:
                    heapq.heappop(heap)

    def __iter__(self) -> Iterator[_E]:
        """The order projected without admissions: per class, each tenant's entries at
        the counter they would reach (counter + tokens before them / weight)."""
        for neg in list(self._prios):
            lanes = self._classes.get(-neg)
            if not lanes:
                continue
            snapshot = {t: list(lane.entries) for t, lane in lanes.items()}
            heap = [(self._counter.get(t, 0.0), e[0].key, t, 0) for t, e in snapshot.items()]
            heapq.heapify(heap)
            while heap:
                c, _, t, i = heapq.heappop(heap)
                entries = snapshot[t]
                entry = entries[i]
                yield entry
                if i + 1 < len(entries):
                    nxt = entries[i + 1]
                    heapq.heappush(heap, (c + entry.raw / self.weight(t), nxt.key, t, i + 1))

    def next_deadline(self) -> float | None:
        heap = self._deadlines
        while heap and not heap[0][2].queued:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def victim(self, entry: _E, limit: int) -> _E | None:
        """When the queue of `entry`'s model is full (`limit` entries): the entry that
        should give way to it, or None (the newcomer is shed). A tenant holding fewer
        than its weighted share of the model's queue slots takes the last slot of the
        tenant most over its share (in classes no higher than its own), so a flood
        cannot crowd a trickle out of the queue."""
        req = entry.req
        model = req.model
        counts: dict[str, int] = {}
        for neg in self._prios:
            for t, lane in self._classes[-neg].items():
                n = (lane.model_count or {}).get(model, 0)
                if n > 0:
                    counts[t] = counts.get(t, 0) + n
        mine = counts.pop(req.tenant, 0) - (1 if entry.queued else 0)  # not itself
        if not counts:
            return None
        total_w = sum(self.weight(t) for t in counts) + self.weight(req.tenant)
        if mine + 1 > limit * self.weight(req.tenant) / total_w:
            return None
        over = max(counts, key=lambda t: counts[t] / self.weight(t))
        if counts[over] / self.weight(over) <= (mine + 1) / self.weight(req.tenant):
            return None
        for neg in reversed(self._prios):  # lowest class first
            if -neg > req.priority:
                break
            over_lane = self._classes[-neg].get(over)
            if over_lane is None:
                continue
            for e in reversed(over_lane.entries):
                if e.req.model == model:
                    return e
        return None

    # ------------------------------------------------------------------ estimates
    def ahead(self, entry: _E) -> tuple[int, int]:
        """(tokens, entries) of `entry`'s model expected to be served before it: every
        higher class, its own tenant's entries before it, and of each other tenant in
        its class what the counters let through before its turn."""
        req = entry.req
        model = req.model
        tenant = req.tenant
        tokens = count = 0
        own_tokens_all = 0
        for neg in self._prios:
            lanes = self._classes[-neg]
            if -neg > req.priority:
                for lane in lanes.values():
                    if lane.model_tokens is not None and lane.model_count is not None:
                        tokens += lane.model_tokens.get(model, 0)
                        count += lane.model_count.get(model, 0)
                continue
            if -neg < req.priority:
                break
            own = lanes.get(tenant)
            if own is not None:
                i = bisect.bisect_left(own.keys, entry.key)
                mine = 1 if entry.queued else 0  # `entry` itself, when it is in the lane
                if i + mine == len(own.entries):  # behind all its own: the common case
                    own_tokens_all = own.tokens - mine * entry.raw
                    if own.model_tokens is not None and own.model_count is not None:
                        tokens += own.model_tokens.get(model, 0) - mine * entry.raw
                        count += own.model_count.get(model, 0) - mine
                else:
                    for e in own.entries[:i]:
                        own_tokens_all += e.raw
                        if e.req.model == model:
                            tokens += e.raw
                            count += 1
            turn = self._counter.get(tenant, 0.0)
            if not self._backlog.get(tenant):  # it would be lifted on insert
                level = (
                    min(self._counter.get(t, 0.0) for t in self._backlog)
                    if self._backlog
                    else self._floor
                )
                turn = max(turn, level)
            turn += own_tokens_all / self.weight(tenant)
            for t, lane in lanes.items():
                if t == tenant or not lane.tokens or lane.model_tokens is None:
                    continue
                mt = lane.model_tokens.get(model, 0)
                if mt <= 0:
                    continue
                room = (turn - self._counter.get(t, 0.0)) * self.weight(t)
                through = min(lane.tokens, max(0.0, room))
                share = through / lane.tokens
                tokens += math.ceil(mt * share)
                count += math.ceil((lane.model_count or {}).get(model, 0) * share)
        return tokens, count
