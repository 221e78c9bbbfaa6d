"""Per-model candidate state kept incrementally, so one decision costs what it scores,
not what the fleet holds.

Policy and reason. A decision (admit + route) used to walk every replica of the model
several times (the fit checks, the predicted service, a fresh candidate list, every
scorer on every replica): linear in replicas, about 500 us at 64. Routing only ever
chooses among a few good replicas, so admission keeps, per model:

- `HeadroomIndex`: the model's replicas in two orders kept current on every reserve,
  release, top-up and view refresh: by free fraction of the KV pool (what `kv_headroom`
  scores) and by free share of the running limit (what `running_headroom` scores).
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
  of each replica's line coefficients (an upper bound of the old per-replica maximum,
  exact when one replica dominates), refreshed only for replicas whose fit or load
  changed since the last decision.

Nothing here decides anything: it is bookkeeping of the ledger's own numbers.
"""

from __future__ import annotations

import bisect
import math
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
        """Set `name`'s keys (higher is better in both)."""
        new = (-free_fraction, -run_headroom)
        old = self._keys.get(name)
        if old == new:
            return
        if old is not None:
            self._drop(name, old)
        self._keys[name] = new
        bisect.insort(self._by_free, (new[0], name))
        bisect.insort(self._by_run, (new[1], name))

    def remove(self, name: str) -> None:
        old = self._keys.pop(name, None)
        if old is not None:
            self._drop(name, old)

    def _drop(self, name: str, old: tuple[float, float]) -> None:
        for lst, key in ((self._by_free, old[0]), (self._by_run, old[1])):
            i = bisect.bisect_left(lst, (key, name))
            if i < len(lst) and lst[i][1] == name:
                del lst[i]

    def by_free(self) -> Iterator[tuple[float, str]]:
        """(-free fraction, name), most free first."""
        return iter(self._by_free)

    def by_run(self) -> Iterator[tuple[float, str]]:
        """(-running headroom, name), most headroom first."""
        return iter(self._by_run)


class PredictMax:
    """The largest ``max(0, base + slope * tokens) * scale`` over a model's replicas, as
    ``max(0, max(base * scale) + max(slope * scale) * tokens)``: each maximum kept by
    replica, recomputed over all of them only when the replica holding it goes down."""

    __slots__ = ("_base", "_slope", "_max_base", "_max_slope")

    def __init__(self) -> None:
        self._base: dict[str, float] = {}
        self._slope: dict[str, float] = {}
        self._max_base = -math.inf
        self._max_slope = -math.inf

    def set(self, name: str, base: float, slope: float) -> None:
        old_base = self._base.get(name)
        old_slope = self._slope.get(name)
        self._base[name] = base
        self._slope[name] = slope
        if base >= self._max_base:
            self._max_base = base
        elif old_base is not None and old_base >= self._max_base:
            self._max_base = max(self._base.values())
        if slope >= self._max_slope:
            self._max_slope = slope
        elif old_slope is not None and old_slope >= self._max_slope:
            self._max_slope = max(self._slope.values())

    def remove(self, name: str) -> None:
        if self._base.pop(name, None) is not None:
            self._slope.pop(name, None)
            self._max_base = max(self._base.values(), default=-math.inf)
            self._max_slope = max(self._slope.values(), default=-math.inf)

    def predict(self, tokens: float) -> float:
        if not self._base:
            return 0.0
        return max(0.0, self._max_base + self._max_slope * tokens)
