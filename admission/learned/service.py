"""A replica's service time as a plane in a request's prompt and output tokens (sans-IO).

Why two terms, not one line in their sum: under continuous batching a prompt is prefilled
in a few large steps while every output token costs one whole step of the batch, so an
output token costs tens to hundreds of times a prompt token. A line in
``prompt + output`` cannot tell a long prompt with a short answer from the opposite;
on seed 001's workload its residuals spread wider than the plane's (measured:
docs/benchmarks-matrix.md, Other judges), and the queue's deadline, which takes this
model's upper estimate, either waited too little or let a request start that could not
finish in time.

Least squares over the last `size` completions, both slopes kept non-negative (a
negative slope is a fit to noise: the better of the one-term fits replaces it). A
prediction adds the largest residual, so it is an upper estimate rather than a typical
one. Each sample carries the load it was served under (requests the replica runs at
once: `Replica.serving_load`); a prediction for a higher load scales up in proportion
(the share each request gets shrinks as the batch grows), never down. The fit is
refreshed lazily, at most once per added sample (the gateway's hot path pays one per
completion): the plane's sums slide with the window, kept exact in integers (tokens,
and seconds in nanoseconds), so a refit reads them in constant time and a column that
stops varying sums to exactly zero; one pass over the samples then takes the residuals
and the elasticity's sums together. Time to first token is the same model fed no
output tokens.
"""

from __future__ import annotations

import math
from collections import deque
from typing import NamedTuple

_NS = 1_000_000_000  # seconds are summed in integer nanoseconds: exact sums that slide


class Plane(NamedTuple):
    """``seconds = base + per_prompt * prompt + per_output * output`` (margin included)."""

    base: float
    per_prompt: float
    per_output: float

    def at(self, prompt: float, output: float) -> float:
        return max(0.0, self.base + self.per_prompt * prompt + self.per_output * output)


class ServiceModel:
    """Service seconds against (prompt, output) tokens, fitted to recent completions."""

    __slots__ = (
        "_prompts",
        "_outputs",
        "_ys",
        "_loads",
        "_ran",
        "_sums",
        "_fit",
        "_margin",
        "_mean_ran",
        "_elasticity",
    )

    def __init__(self, size: int = 64) -> None:
        self._prompts: deque[int] = deque(maxlen=size)
        self._outputs: deque[int] = deque(maxlen=size)
        self._ys: deque[float] = deque(maxlen=size)
        self._loads: deque[float] = deque(maxlen=size)
        self._ran: deque[float] = deque(maxlen=size)  # requests running beside it, mean
        # Over the window, in integers: p, o, y (ns), pp, oo, po, py, oy, yy.
        self._sums = [0] * 9
        self._fit: tuple[Plane, float] | None = None
        self._margin = 0.0
        self._mean_ran = 1.0  # the mean of `_ran`, as of the fit
        self._elasticity = 1.0  # in proportion until the samples' loads tell

    def __len__(self) -> int:
        return len(self._ys)

    def add(
        self,
        prompt: float,
        output: float,
        seconds: float,
        load: float = 1.0,
        ran: float | None = None,
    ) -> None:
        """One completion: served at `load` (what predictions scale by), beside `ran`
        requests on average while it ran (what the elasticity is fitted to; `load` if
        not given)."""
        ps, os_, ys = self._prompts, self._outputs, self._ys
        if len(ys) == ys.maxlen:  # the oldest leaves the window, and its terms the sums
            self._slide(ps[0], os_[0], round(ys[0] * _NS), -1)
        p, o = round(prompt), round(output)
        self._slide(p, o, round(seconds * _NS), 1)
        ps.append(p)
        os_.append(o)
        ys.append(seconds)
        self._loads.append(max(1.0, load))
        self._ran.append(max(1.0, load if ran is None else ran))
        self._fit = None

    def _slide(self, p: int, o: int, y: int, sign: int) -> None:
        s = self._sums
        s[0] += sign * p
        s[1] += sign * o
        s[2] += sign * y
        s[3] += sign * p * p
        s[4] += sign * o * o
        s[5] += sign * p * o
        s[6] += sign * p * y
        s[7] += sign * o * y
        s[8] += sign * y * y

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
        plane, fitted_load = self._fit or self._refit()
        scale = max(1.0, load / fitted_load)
        return Plane(plane.base * scale, plane.per_prompt * scale, plane.per_output * scale)

    def alone(self, prompt: float, output: float) -> float:
        """A typical service of such a request with nothing beside it: the fitted plane
        less its margin, less what the load adds by the elasticity (an upper estimate,
        so this is a low one: an aim it widens is never too wide); 0 without samples."""
        if not self._ys:
            return 0.0
        (base, a, b), _ = self._fit or self._refit()
        typical = max(0.0, base - self._margin + a * prompt + b * output)
        return typical * (1.0 - self._elasticity * (1.0 - 1.0 / self._mean_ran))

    def elasticity(self) -> float:
        """How service grows with the load, as the share of a proportional growth: 1 where
        twice the load takes twice as long (past a replica's knee), 0 where it takes no
        longer (a replica below it, or one whose step barely grows with the batch: the
        real vLLM at seed 001's size). Fitted to the samples' spread in load (their
        relative service against the plane's against their relative load); 1 until the
        samples were served at loads at least a tenth apart, and the last such fit while
        they are not (a limit that holds still is no evidence against it)."""
        if self._fit is None and self._ys:
            self._refit()
        return self._elasticity

    def _refit(self) -> tuple[Plane, float]:
        ps, os_, ys = self._prompts, self._outputs, self._ys
        n = len(ys)
        sp, so, sy, sqp, sqo, spo_, spy_, soy_, sqy = self._sums
        mp, mo, my = sp / n, so / n, sy / n / _NS
        # The centred sums, n * sum((u - mean u)(v - mean v)) = n * sum(uv) - sum(u) sum(v),
        # exact in integers before the one division that makes each a float.
        spp = (n * sqp - sp * sp) / n
        soo = (n * sqo - so * so) / n
        spo = (n * spo_ - sp * so) / n
        spy = (n * spy_ - sp * sy) / n / _NS
        soy = (n * soy_ - so * sy) / n / _NS
        syy = (n * sqy - sy * sy) / n / _NS / _NS

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
        # The second pass: the largest residual (the margin), and the elasticity's sums:
        # x, the load it ran beside relative to the mean; e, its service relative to
        # the plane's typical one, where that is positive.
        mean_ran = self._mean_ran = sum(self._ran) / n
        worst = -math.inf
        used = 0
        sxx = sxe = see = 0.0
        for p, o, y, ran in zip(ps, os_, ys, self._ran, strict=True):
            typical = base + a * p + b * o
            if y - typical > worst:
                worst = y - typical
            if typical > 0:
                x = ran / mean_ran - 1.0
                e = y / typical - 1.0
                used += 1
                sxx += x * x
                sxe += x * e
                see += e * e
        margin = max(0.0, worst)
        self._margin = margin
        if used >= 3 and sxx >= 0.01 * used:  # else loads within about a tenth of each other
            k = sxe / sxx
            # Its upper estimate (two standard errors): a noisy fit never understates
            # growth. The residuals' squares, sum (e - k x)^2, are see - k sxe.
            spread = max(0.0, see - k * sxe) / (used - 2)
            self._elasticity = min(1.0, max(0.0, k + 2.0 * math.sqrt(spread / sxx)))
        self._fit = (Plane(base + margin, a, b), sum(self._loads) / n)
        return self._fit
