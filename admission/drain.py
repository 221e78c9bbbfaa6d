"""Drain-rate meter: how fast a replica gives reservations back (sans-IO).

Retry-After and the "can this deadline still be met" test both divide a token (or
request-slot) deficit by a drain rate. The rate is a continuous-time EWMA: every release
adds its tokens to an accumulator that decays as ``exp(-t / tau)``; the rate is the
accumulator divided by ``tau``. Two choices keep it honest:

* Time only runs while the replica is *busy* (holds reservations). An idle replica drains
  nothing because it has nothing to drain; counting idle seconds would make the first
  burst after a quiet period look hopeless and shed it.
* Bias correction: during the first ``tau`` busy seconds the accumulator has not filled,
  so the rate is divided by the elapsed busy time ``tau * (1 - exp(-T / tau))`` instead of
  ``tau`` (the same correction Adam applies to its moment estimates).
"""

from __future__ import annotations

import math


class DrainMeter:
    """Tokens and requests released per busy second, as an exponentially weighted rate."""

    __slots__ = (
        "_tau",
        "_busy",
        "_busy_clock",
        "_last",
        "_clock_at_acc",
        "_tokens",
        "_reqs",
        "samples",
    )

    def __init__(self, tau: float) -> None:
        self._tau = tau
        self._busy = False
        self._busy_clock = 0.0  # busy seconds seen so far
        self._last: float | None = None  # wall time `now` of the last update
        self._clock_at_acc = 0.0  # busy clock at which the accumulators were last decayed
        self._tokens = 0.0
        self._reqs = 0.0
        self.samples = 0

    def _clock(self, now: float) -> float:
        if self._busy and self._last is not None and now > self._last:
            return self._busy_clock + (now - self._last)
        return self._busy_clock

    def _advance(self, now: float) -> None:
        self._busy_clock = self._clock(now)
        if self._last is None or now > self._last:
            self._last = now

    def set_busy(self, busy: bool, now: float) -> None:
        """Record whether the replica holds reservations from `now` on."""
        self._advance(now)
        self._busy = busy

    def record(self, tokens: int, now: float) -> None:
        """A reservation of `tokens` was released at `now`."""
        self._advance(now)
        decay = math.exp(-(self._busy_clock - self._clock_at_acc) / self._tau)
        self._tokens = self._tokens * decay + tokens
        self._reqs = self._reqs * decay + 1.0
        self._clock_at_acc = self._busy_clock
        self.samples += 1

    def rates(self, now: float) -> tuple[float, float]:
        """(tokens per second, requests per second) as of `now`; (0, 0) before any busy time."""
        clock = self._clock(now)
        if clock <= 0.0:
            return 0.0, 0.0
        decay = math.exp(-(clock - self._clock_at_acc) / self._tau)
        window = self._tau * (1.0 - math.exp(-clock / self._tau))
        return self._tokens * decay / window, self._reqs * decay / window
