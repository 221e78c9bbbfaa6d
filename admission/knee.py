"""A replica's goodput curve and its knee, fitted from the learned limit's windows (sans-IO).

Every busy window of `RunningLimit` (admission/limit.py) is a point of the replica's
throughput curve at the setting it ran: seconds, running-seconds and work tokens. The
curve of a batched server saturates, ``G(N) = Gmax * N / (N + K)`` (linear while the batch
amortises the weights, flat once compute or memory bandwidth binds), and its knee is where
one more running request buys less than ``efficiency`` of an average request's throughput:
``N = K * (1 / efficiency - 1)``. This is seed 001's ceiling sweep done live.
"""

from __future__ import annotations

POINT_MEMORY = 8  # windows a point above the limit stays in the fit


class GoodputCurve:
    """The points of one replica's goodput curve, pooled per setting, and their knee."""

    __slots__ = ("_points",)

    def __init__(self) -> None:
        # setting -> [seconds, running-seconds, work tokens, last window measured there]
        self._points: dict[int, list[float]] = {}

    def add(self, setting: int, *, span: float, area: float, work: float, window: int) -> None:
        """A busy window ran at `setting`. Windows at one setting pool their time and
        work, so the fit sees each setting's mean, not each window's noise."""
        acc = self._points.setdefault(setting, [0.0, 0.0, 0.0, 0.0])
        acc[0] += span
        acc[1] += area
        acc[2] += work
        acc[3] = window

    def knee(self, *, window: int, limit: int, efficiency: float) -> float | None:
        """Least-squares fit of 1/G = 1/Gmax + (K/Gmax) / N over the points; the knee
        N = K (1/efficiency - 1). None until the points span a 2x range of N.

        `window` is the count of windows closed so far and `limit` the current limit: a
        setting above the limit that no window measured in the last POINT_MEMORY leaves
        the fit, since the limit no longer reaches it to measure it again, and a knee
        fitted on an old transient there (the windows of a cold start's overshoot) would
        hold the limit under it for good. Settings at or below the limit stay."""
        recent = window - POINT_MEMORY
        pts = [
            (area / span, work / span, span)
            for n, (span, area, work, last) in self._points.items()
            if span > 0 and area > 0 and work > 0 and (n <= limit or last > recent)
        ]
        if len(pts) < 3:
            return None
        # Where goodput falls past a peak the replica thrashes (preemption, prefills
        # interleaved), a regime the curve does not model: fit up to the peak only, and
        # the knee is not past it. (Fitted on the falling points, the curve is flat or
        # falling and the knee would be the least setting measured, where the limit then
        # stays: measured at one setting only, it never sees more.)
        peak_n = max(pts, key=lambda p: p[1])[0]
        past = max(n for n, _, _ in pts) > peak_n
        if past:
            pts = [p for p in pts if p[0] <= peak_n]
            if len(pts) < 3:
                return None
        ns = [n for n, _, _ in pts]
        if max(ns) < 2.0 * min(ns):
            return None
        xs = [1.0 / n for n, _, _ in pts]
        ys = [1.0 / g for _, g, _ in pts]
        ws = [w for _, _, w in pts]
        total = sum(ws)
        mx = sum(w * x for w, x in zip(ws, xs, strict=True)) / total
        my = sum(w * y for w, y in zip(ws, ys, strict=True)) / total
        sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs, strict=True))
        if sxx <= 0:
            return None
        slope = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys, strict=True)) / sxx
        intercept = my - slope * mx
        if intercept <= 0:
            return None  # still rising linearly at the largest N seen: no knee yet
        if slope <= 0:
            return min(ns)  # flat (or falling) over the whole range: more buys nothing
        knee = (slope / intercept) * (1.0 / efficiency - 1.0)
        return min(knee, peak_n) if past else knee
