"""Inter-token latency against batch size, per replica, learned online (sans-IO).

A decode step serves every running request at once, so a request's inter-token gap
grows with the number running beside it: memory-bound decode reads the weights once per
step plus every running request's KV, ``itl(n) ~ a + b n``. Seed 000 makes the point
that this ceiling (the per-user decode rate) is set by a different resource from TTFT.

`ItlModel` keeps the last `window` streams' (mean running during the stream, mean
inter-token gap) and fits that line by least squares, slope and intercept kept
non-negative. With too little spread in the running counts to fit a slope it takes the
conservative reading that the gap grows in proportion to the batch past what was seen
(``itl(n) = mean * max(1, n / mean_running)``). `predict(running_after)` is the expected
gap once a request is added; None before `min_samples` streams (no evidence: routing
then keeps the replica). The fit is cached and redone only after a new sample.
"""

from __future__ import annotations

from collections import deque


class ItlModel:
    __slots__ = ("_samples", "_min", "_fit")

    def __init__(self, window: int = 64, min_samples: int = 4) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)
        self._min = min_samples
        self._fit: tuple[float, float, float, float] | None = None  # a, b, mean n, mean itl

    def __len__(self) -> int:
        return len(self._samples)

    def add(self, running: float, itl_s: float) -> None:
        if itl_s <= 0 or running <= 0:
            return
        self._samples.append((running, itl_s))
        self._fit = None

    def _refit(self) -> tuple[float, float, float, float]:
        xs = [s[0] for s in self._samples]
        ys = [s[1] for s in self._samples]
        n = len(xs)
        mx = sum(xs) / n
        my = sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        if sxx < 0.25 * n:  # running counts too alike (spread < 0.5): no slope to read
            return (-1.0, 0.0, mx, my)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
        b = max(0.0, b)
        a = max(0.0, my - b * mx)
        return (a, b, mx, my)

    def predict(self, running_after: float) -> float | None:
        """Expected mean inter-token gap with `running_after` requests running."""
        if len(self._samples) < self._min:
            return None
        if self._fit is None:
            self._fit = self._refit()
        a, b, mx, my = self._fit
        if a < 0:  # no slope fitted
            return my * max(1.0, running_after / mx)
        return a + b * running_after
