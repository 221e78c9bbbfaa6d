"""The margin an estimated reservation keeps: what such estimates were seen to fall short.

A reservation that rests on an estimate (a prompt counted from its characters, an output
reserved at the learned quantile below its bound) can prove short once the engine says
what the request used; the pool absorbs the difference, and an engine that preempts
preempts when it cannot. Such a reservation is grown by ``1 / (1 - margin)``
(`admission.fit`), where the margin is learned per model from its recent estimated
requests: the tokens they used beyond what was reserved (mean plus one standard
deviation, per request) over the tokens reserved (mean). The estimates are conservative
quantiles already, so the margin is small where they hold; until ``MIN_SAMPLES``
completions, it is the configured ``headroom``. A reservation of known size (an exact
prompt, its whole ``max_tokens``) keeps none and teaches nothing here.
"""

from __future__ import annotations

import math
from collections import deque

MIN_SAMPLES = 16
MAX_MARGIN = 0.5  # beyond this the estimates are wrong, not short: reserve double at most


class EstimateMargin:
    """A window of (tokens short, tokens reserved) of estimated reservations, summed."""

    __slots__ = ("_window", "_short", "_short_sq", "_reserved")

    def __init__(self, size: int) -> None:
        self._window: deque[tuple[int, int]] = deque(maxlen=max(MIN_SAMPLES, size))
        self._short = 0.0
        self._short_sq = 0.0
        self._reserved = 0.0

    def observe(self, reserved: int, used: int) -> None:
        """One completed request that reserved `reserved` tokens (before any margin) and
        used `used` (prompt and completion, as the engine counted them)."""
        if reserved <= 0 or used < 0:
            return
        if len(self._window) == self._window.maxlen:
            old_short, old_reserved = self._window[0]
            self._short -= old_short
            self._short_sq -= old_short * old_short
            self._reserved -= old_reserved
        short = max(0, used - reserved)
        self._window.append((short, reserved))
        self._short += short
        self._short_sq += short * short
        self._reserved += reserved

    def margin(self, cold: float) -> float:
        """The share of an estimated reservation to keep beyond it (`cold` until
        MIN_SAMPLES completions were seen)."""
        n = len(self._window)
        if n < MIN_SAMPLES or self._reserved <= 0:
            return cold
        mean = self._short / n
        spread = math.sqrt(max(0.0, self._short_sq / n - mean * mean))
        return min(MAX_MARGIN, (mean + spread) / (self._reserved / n))
