"""Inter-token latency against batch size, per replica, learned online (sans-IO).

A decode step serves every running request at once, so a request's inter-token gap
grows with the number running beside it: memory-bound decode reads the weights once per
step plus every running request's KV, ``itl(n) ~ a + b n`` (prefill chunks interleaved
with decode add to it, more with more requests starting). Seed 000 makes the point that
this ceiling (the per-user decode rate) is set by a different resource from TTFT.

`ItlModel` keeps, per running count (rounded: the mean during the stream), the last
`per_load` streams' mean gaps. Evidence is kept per count so that a long busy spell at
one load does not push out what was seen at a lighter one: that is what says whether
draining a replica would bring the gap within a target. `predict(running_after)` is the
expected gap once a request is added: the measured mean at that count when it has at
least two streams (the operating point is measured, not modelled: interleaved prefills
make the curve far from a line), else interpolated between the nearest counts measured
on either side, else extrapolated on the line fitted through the per-count means (each
count weighted equally; slope and intercept non-negative), and with only one count seen,
the conservative reading that the gap grows in proportion to the batch past it
(``itl(n) = mean * max(1, n / count)``). None before `min_samples` streams (no evidence:
routing then keeps the replica). The summary is cached and redone only after a sample.

Evidence older than `memory_s` is dropped (on the next sample). Without that, a replica
held at a light load to meet a target never sees a heavier one again, and a pessimistic
reading of the heavy loads (taken while long prefills were interleaved, say) would keep
it under-used for good; once the old evidence goes, the fit extrapolates from what is
current, a heavier load is tried, and measured.
"""

from __future__ import annotations

import bisect
from collections import deque


class ItlModel:
    __slots__ = (
        "_by_load",
        "_per_load",
        "_max_loads",
        "_min",
        "_n",
        "_fit",
        "_memory",
        "_keys",
        "_means",
    )

    def __init__(
        self,
        per_load: int = 16,
        min_samples: int = 4,
        max_loads: int = 512,
        memory_s: float = float("inf"),
    ) -> None:
        self._by_load: dict[int, deque[tuple[float, float]]] = {}  # load -> (time, gap)
        self._memory = memory_s
        self._per_load = per_load
        self._max_loads = max_loads
        self._min = min_samples
        self._n = 0
        self._fit: tuple[float, float, float, float] | None = None  # a, b, mean n, mean itl
        self._keys: list[int] = []  # measured counts (at least two streams), sorted
        self._means: list[float] = []

    def __len__(self) -> int:
        return self._n

    def add(self, running: float, itl_s: float, now: float = 0.0) -> None:
        if itl_s <= 0 or running <= 0:
            return
        self._forget(now - self._memory)
        load = max(1, round(running))
        window = self._by_load.get(load)
        if window is None:
            if len(self._by_load) >= self._max_loads:
                return  # bounded: a load count this high is not a place to learn
            window = self._by_load[load] = deque(maxlen=self._per_load)
        if len(window) < self._per_load:
            self._n += 1
        window.append((now, itl_s))
        self._fit = None

    def _forget(self, before: float) -> None:
        gone = []
        for load, window in self._by_load.items():
            while window and window[0][0] < before:
                window.popleft()
                self._n -= 1
            if not window:
                gone.append(load)
        for load in gone:
            del self._by_load[load]
        if gone:
            self._fit = None

    def _refit(self) -> tuple[float, float, float, float]:
        keys = sorted(k for k, w in self._by_load.items() if len(w) >= 2)
        self._keys = keys
        self._means = [sum(g for _, g in self._by_load[k]) / len(self._by_load[k]) for k in keys]
        xs = list(self._by_load)
        ys = [sum(g for _, g in w) / len(w) for w in self._by_load.values()]
        k = len(xs)
        mx = sum(xs) / k
        my = sum(ys) / k
        if k < 2:
            return (-1.0, 0.0, mx, my)
        sxx = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
        b = max(0.0, b)
        a = max(0.0, my - b * mx)
        return (a, b, mx, my)

    def predict(self, running_after: float) -> float | None:
        """Expected mean inter-token gap with `running_after` requests running."""
        if self._n < self._min:
            return None
        if self._fit is None:
            self._fit = self._refit()
        keys = self._keys
        if keys:
            n = max(1, round(running_after))
            i = bisect.bisect_left(keys, n)
            if i < len(keys) and keys[i] == n:
                return self._means[i]
            if 0 < i < len(keys):
                lo, hi = keys[i - 1], keys[i]
                f = (n - lo) / (hi - lo)
                return self._means[i - 1] + f * (self._means[i] - self._means[i - 1])
        a, b, mx, my = self._fit
        if a < 0:  # one load count seen: no slope to read
            return my * max(1.0, running_after / mx)
        return a + b * running_after
