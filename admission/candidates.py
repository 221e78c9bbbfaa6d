"""Per-model candidate state kept incrementally, so one decision costs what it scores,
not what the fleet holds.

Policy and reason. A decision (admit + route) used to walk every replica of the model
several times (the fit checks, the predicted service, a fresh candidate list, every
scorer on every replica): linear in replicas, about 500 us at 64. Routing only ever
chooses among a few good replicas, so admission keeps, per model:

- `HeadroomIndex`: the model's replicas in two orders that follow every reserve,
  release, top-up and view refresh (a replica they touched is placed again when the next
  decision reads the orders: admission/views.py): by free fraction of the KV pool (what
  `kv_headroom` scores) and by free share of the running limit (what `running_headroom`
  scores).
  A decision shortlists the first ``per_order`` replicas of each order that fit the
  request now, plus the replicas routing names itself (`Router.hints`: warm prefix,
  session, speculating). A replica outside the shortlist can win only on a term
  routing would have named it for, so the choice matches a full scan; when routing's
  filters reject the whole shortlist, admission falls back to every fitting replica
  (a filter's verdict stays exact).
- shapes: the replicas grouped by what the fit checks read (pool, block size, context,
  preemption): whether a request can ever fit, and its reservation, are computed once
  per shape, not once per replica.
- `PredictMax`: the largest predicted service over the model's replicas, as the maxima
  of each replica's plane coefficients (an upper bound of the old per-replica maximum,
  exact when one replica dominates), refreshed only for replicas whose fit or load
  changed since the last decision.

Nothing here decides anything: it is bookkeeping of the ledger's own numbers.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Iterator


class HeadroomIndex:
    """Replica names ordered by KV free fraction and by running-limit headroom (best
    first), each updated in O(log n) search plus a memmove on a change."""

    __slots__ = ("_by_free", "_by_run", "_keys")

    def __init__(self) -> None:
        self._by_free: list[tuple[float, str]] = []
        self._by_run: list[tuple[float, str]] = []
        self._keys: dict[str, tuple[float, float]] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def update(self, name: str, free_fraction: float, run_headroom: float) -> None:
        """Set `name`'s keys (higher is better in both); an order whose key is unchanged
        is left as it is."""
        free, run = -free_fraction, -run_headroom
        keys = self._keys
        old = keys.get(name)
        keys[name] = (free, run)
        if old is None:
            insort(self._by_free, (free, name))
            insort(self._by_run, (run, name))
            return
        old_free, old_run = old
        if old_free != free:
            _move(self._by_free, (old_free, name), (free, name))
        if old_run != run:
            _move(self._by_run, (old_run, name), (run, name))

    def remove(self, name: str) -> None:
        old = self._keys.pop(name, None)
        if old is not None:
            _take(self._by_free, (old[0], name))
            _take(self._by_run, (old[1], name))

    def by_free(self) -> Iterator[tuple[float, str]]:
        """(-free fraction, name), most free first."""
        return iter(self._by_free)

    def by_run(self) -> Iterator[tuple[float, str]]:
        """(-running headroom, name), most headroom first."""
        return iter(self._by_run)


def _take(order: list[tuple[float, str]], item: tuple[float, str]) -> None:
    i = bisect_left(order, item)
    if i < len(order) and order[i] == item:
        del order[i]


def _move(order: list[tuple[float, str]], old: tuple[float, str], new: tuple[float, str]) -> None:
    i = bisect_left(order, old)  # `_take`, inline: on every replica a decision re-places
    if i < len(order) and order[i] == old:
        del order[i]
    insort(order, new)


class KeyedMax:
    """Values by replica name and their maximum, recomputed over all of them only when
    the replica holding it lowers its value or goes."""

    __slots__ = ("_values", "top")

    def __init__(self) -> None:
        self._values: dict[str, float] = {}
        self.top = -math.inf

    def __bool__(self) -> bool:
        return bool(self._values)

    def set(self, name: str, value: float) -> None:
        old = self._values.get(name)
        self._values[name] = value
        if value >= self.top:
            self.top = value
        elif old is not None and old >= self.top:
            self.top = max(self._values.values())

    def remove(self, name: str) -> None:
        if self._values.pop(name, None) is not None:
            self.top = max(self._values.values(), default=-math.inf)


class PredictMax:
    """The largest predicted service ``max(0, base + a * prompt + b * output)`` over a
    model's replicas (their `admission.learned.service.Plane` at their load), bounded as
    ``max(0, max(base) + max(a) * prompt + max(b) * output)``: each maximum kept by
    replica (`KeyedMax`)."""

    __slots__ = ("_base", "_per_prompt", "_per_output")

    def __init__(self) -> None:
        self._base = KeyedMax()
        self._per_prompt = KeyedMax()
        self._per_output = KeyedMax()

    def set(self, name: str, base: float, per_prompt: float, per_output: float) -> None:
        self._base.set(name, base)
        self._per_prompt.set(name, per_prompt)
        self._per_output.set(name, per_output)

    def remove(self, name: str) -> None:
        self._base.remove(name)
        self._per_prompt.remove(name)
        self._per_output.remove(name)

    def predict(self, prompt: float, output: float = 0.0) -> float:
        if not self._base:
            return 0.0
        return max(
            0.0,
            self._base.top + self._per_prompt.top * prompt + self._per_output.top * output,
        )
