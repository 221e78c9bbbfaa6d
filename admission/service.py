"""A replica's service time as a plane in a request's prompt and output tokens (sans-IO).

Why two terms, not one line in their sum: under continuous batching a prompt is prefilled
in a few large steps while every output token costs one whole step of the batch, so an
output token costs tens to hundreds of times a prompt token. A line in
``prompt + output`` cannot tell a long prompt with a short answer from the opposite;
on seed 001's workload (prompts 1,400-4,000 tokens, outputs 40-200) its residuals spread
about twice as wide as the plane's (kvgate demo logs: sd 0.19 s against 0.12 s, worst
0.9-1.1 s against 0.4-0.55 s), and the queue's deadline, which takes this model's upper
estimate, either waited too little or let a request start that could not finish in time.

Each sample carries the load it was served at (the time-weighted mean of what ran beside
it, itself included: `Replica.tick`). Service grows with the load by a share ``k`` of a proportional growth,
the *elasticity* (1 past a replica's knee, 0 where the batch step hardly grows), fitted
to the samples' relative service against their relative load (its upper estimate: two
standard errors above). Every sample is brought to the samples' mean load by that share
before the plane is fitted, so a plane fitted to a load that moves (admission bounds the
load by the pool and the deadlines, not by a count) is not widened by it; a prediction at
a load ``L`` is the plane times ``1 + k (L / mean - 1)``.

Least squares over the last `size` completions, both slopes kept non-negative (a
negative slope is a fit to noise: the better of the one-term fits replaces it). A
prediction adds the ``quantile`` of the residuals (the largest), so it is an upper
estimate rather than a typical one. (Taken in proportion instead, the largest ratio to the
plane started fewer of the demo's longest answers late but held the SDK's clients at 0.94x
what the replica serves in time; its 95th percentile lost requests on the real vLLM's
regime at a timeout under a second: tests/admission/test_in_time.py, test_retry_after.py.) The fit is refreshed lazily, at most once per added sample. Time to first
token is the same model fed no output tokens.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple


class Plane(NamedTuple):
    """``seconds = base + per_prompt * prompt + per_output * output`` (margin included)."""

    base: float
    per_prompt: float
    per_output: float

    def at(self, prompt: float, output: float) -> float:
        return max(0.0, self.base + self.per_prompt * prompt + self.per_output * output)


class ServiceModel:
    """Service seconds against (prompt, output) tokens and load, fitted to recent
    completions."""

    __slots__ = ("_prompts", "_outputs", "_ys", "_loads", "_quantile", "_fit", "_elasticity")

    def __init__(self, size: int = 64, quantile: float = 1.0) -> None:
        self._prompts: deque[float] = deque(maxlen=size)
        self._outputs: deque[float] = deque(maxlen=size)
        self._ys: deque[float] = deque(maxlen=size)
        self._loads: deque[float] = deque(maxlen=size)
        self._quantile = quantile
        self._fit: tuple[Plane, float] | None = None  # at the samples' mean load
        self._elasticity = 1.0  # in proportion until the samples' loads tell

    def __len__(self) -> int:
        return len(self._ys)

    def add(self, prompt: float, output: float, seconds: float, load: float = 1.0) -> None:
        """One completion, served at `load` (requests running beside it, itself included)."""
        self._prompts.append(prompt)
        self._outputs.append(output)
        self._ys.append(seconds)
        self._loads.append(max(1.0, load))
        self._fit = None

    def predict(self, prompt: float, output: float = 0.0, load: float = 1.0) -> float:
        """Upper estimate of the service of a request of `prompt` and `output` tokens at
        `load`; 0 without samples."""
        plane = self.plane(load)
        return 0.0 if plane is None else plane.at(prompt, output)

    def plane(self, load: float = 1.0) -> Plane | None:
        """The upper-estimate plane at `load` (``predict`` is its value); None without
        samples."""
        if not self._ys:
            return None
        plane, mean = self._fitted()
        scale = max(0.0, 1.0 + self._elasticity * (load / mean - 1.0))
        return Plane(plane.base * scale, plane.per_prompt * scale, plane.per_output * scale)

    def elasticity(self) -> float:
        """How service grows with the load, as the share of a proportional growth: 1 where
        twice the load takes twice as long (past a replica's knee), 0 where it takes no
        longer (a replica below it, or one whose step barely grows with the batch: the
        real vLLM at seed 001's size). 1 until the samples were served at loads at least
        a tenth apart, and the last such fit while they are not (a load that holds still
        is no evidence against it)."""
        if self._ys:
            self._fitted()
        return self._elasticity

    def _fitted(self) -> tuple[Plane, float]:
        if self._fit is None:
            mean = sum(self._loads) / len(self._loads)
            raw, margin = self._refit(self._ys)  # as served, load ignored: the baseline
            k = self._fit_elasticity(raw._replace(base=raw.base - margin), mean)
            if k is not None:
                self._elasticity = k
            k = self._elasticity
            at_mean = [
                y / max(1e-9, 1.0 + k * (load / mean - 1.0))
                for y, load in zip(self._ys, self._loads, strict=True)
            ]
            plane, _ = self._refit(at_mean)
            self._fit = (plane, mean)
        return self._fit

    def _fit_elasticity(self, typical_plane: Plane, mean: float) -> float | None:
        base, a, b = typical_plane
        xs: list[float] = []
        es: list[float] = []
        for p, o, y, load in zip(self._prompts, self._outputs, self._ys, self._loads, strict=True):
            typical = base + a * p + b * o
            if typical > 0:
                xs.append(load / mean - 1.0)
                es.append(y / typical - 1.0)
        n = len(xs)
        sxx = sum(x * x for x in xs)
        if n < 3 or sxx < 0.01 * n:  # loads within about a tenth of each other
            return None
        k = sum(x * e for x, e in zip(xs, es, strict=True)) / sxx
        # Its upper estimate (two standard errors): a noisy fit never understates growth.
        spread = sum((e - k * x) ** 2 for x, e in zip(xs, es, strict=True)) / (n - 2)
        return min(1.0, max(0.0, k + 2.0 * math.sqrt(spread / sxx)))

    def _refit(self, ys: Sequence[float]) -> tuple[Plane, float]:
        """Least squares of `ys` in the samples' prompt and output tokens: the plane with
        the ``quantile`` of its residuals added to its base, and that margin."""
        ps, os_ = self._prompts, self._outputs
        n = len(ys)
        mp, mo, my = sum(ps) / n, sum(os_) / n, sum(ys) / n
        spp = soo = spo = spy = soy = syy = 0.0
        for p, o, y in zip(ps, os_, ys, strict=True):
            dp, do, dy = p - mp, o - mo, y - my
            spp += dp * dp
            soo += do * do
            spo += dp * do
            spy += dp * dy
            soy += do * dy
            syy += dy * dy

        def sse(a: float, b: float) -> float:
            return syy - 2 * a * spy - 2 * b * soy + a * a * spp + 2 * a * b * spo + b * b * soo

        # The one-term fits (a slope clamped at 0 when the data say it falls), then the
        # plane when its system is well posed and both its slopes are non-negative.
        options = [(0.0, 0.0)]
        if spp > 0:
            options.append((max(0.0, spy / spp), 0.0))
        if soo > 0:
            options.append((0.0, max(0.0, soy / soo)))
        det = spp * soo - spo * spo
        if spp > 0 and soo > 0 and det > 1e-9 * spp * soo:
            a = (spy * soo - soy * spo) / det
            b = (soy * spp - spy * spo) / det
            if a >= 0 and b >= 0:
                options.append((a, b))
        a, b = min(options, key=lambda ab: sse(*ab))
        base = my - a * mp - b * mo
        residuals = sorted(y - (base + a * p + b * o) for p, o, y in zip(ps, os_, ys, strict=True))
        idx = min(n - 1, max(0, math.ceil(self._quantile * n) - 1))
        margin = max(0.0, residuals[idx])
        return Plane(base + margin, a, b), margin
