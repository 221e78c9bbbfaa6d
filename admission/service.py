"""A replica's service time as a plane in a request's prompt and output tokens (sans-IO).

Why two terms, not one line in their sum: under continuous batching a prompt is prefilled
in a few large steps while every output token costs one whole step of the batch, so an
output token costs tens to hundreds of times a prompt token. A line in
``prompt + output`` cannot tell a long prompt with a short answer from the opposite;
on seed 001's workload (prompts 1,400-4,000 tokens, outputs 40-200) its residuals spread
about twice as wide as the plane's (kvgate demo logs: sd 0.19 s against 0.12 s, worst
0.9-1.1 s against 0.4-0.55 s), and the queue's deadline, which takes this model's upper
estimate, either waited too little or let a request start that could not finish in time.

Least squares over the last `size` completions, both slopes kept non-negative (a
negative slope is a fit to noise: the better of the one-term fits replaces it). A
prediction adds the ``quantile`` of the residuals, so it is an upper estimate rather than
a typical one. Each sample carries the load it was served under (requests the replica
runs at once: `Replica.serving_load`); a prediction for a higher load scales up in
proportion (the share each request gets shrinks as the batch grows), never down. The
fit is refreshed lazily, at most once per added sample. Time to first token is the same model fed no output tokens.
"""

from __future__ import annotations

import math
from collections import deque
from typing import NamedTuple


class Plane(NamedTuple):
    """``seconds = base + per_prompt * prompt + per_output * output`` (margin included)."""

    base: float
    per_prompt: float
    per_output: float

    def at(self, prompt: float, output: float) -> float:
        return max(0.0, self.base + self.per_prompt * prompt + self.per_output * output)


class ServiceModel:
    """Service seconds against (prompt, output) tokens, fitted to recent completions."""

    __slots__ = ("_prompts", "_outputs", "_ys", "_loads", "_quantile", "_fit")

    def __init__(self, size: int = 64, quantile: float = 1.0) -> None:
        self._prompts: deque[float] = deque(maxlen=size)
        self._outputs: deque[float] = deque(maxlen=size)
        self._ys: deque[float] = deque(maxlen=size)
        self._loads: deque[float] = deque(maxlen=size)
        self._quantile = quantile
        self._fit: tuple[Plane, float] | None = None

    def __len__(self) -> int:
        return len(self._ys)

    def add(self, prompt: float, output: float, seconds: float, load: float = 1.0) -> None:
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
        if self._fit is None:
            self._fit = self._refit()
        plane, fitted_load = self._fit
        scale = max(1.0, load / fitted_load)
        return Plane(plane.base * scale, plane.per_prompt * scale, plane.per_output * scale)

    def _refit(self) -> tuple[Plane, float]:
        ps, os_, ys = self._prompts, self._outputs, self._ys
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
        return Plane(base + margin, a, b), sum(self._loads) / n
