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

A past rate lags a limit that grows: while slow start doubles what runs, the releases of
the last ``tau`` seconds are those of a half-empty replica, and a queue told its wait by
them is sent away for twice as long as it needs (seed 001's card, a burst of 64: the
queue came back to a replica that had idled). So the meter also keeps the mean time a
reservation was held, and `rates` is the larger of the past rate and what runs now would
release at that pace (Little's law: running / mean hold, reserved tokens / mean hold).
That pace is believed only as long as releases keep it: N running at a mean hold h
release one every h / N, so once the last release is older than that the hold is taken
as N x the time since it (a stalled replica's rate falls as its silence grows).
"""

from __future__ import annotations

import math

# The meters' time constant ``tau``, in busy seconds: many releases on a busy replica, so
# one release does not swing the rate, yet short enough to follow a replica that slows.
DRAIN_WINDOW_S = 20.0


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
        "_hold",
        "_released_at",
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
        self._hold: float | None = None  # mean seconds a reservation was held (EWMA)
        self._released_at = 0.0  # wall time of the last release
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

    def record(self, tokens: int, now: float, held_s: float | None = None) -> None:
        """A reservation of `tokens`, held for `held_s`, was released at `now`."""
        if held_s is not None and held_s > 0:
            h = self._hold
            self._hold = held_s if h is None else h + _HOLD_WEIGHT * (held_s - h)
        self._released_at = max(self._released_at, now)
        self._advance(now)
        decay = math.exp(-(self._busy_clock - self._clock_at_acc) / self._tau)
        self._tokens = self._tokens * decay + tokens
        self._reqs = self._reqs * decay + 1.0
        self._clock_at_acc = self._busy_clock
        self.samples += 1

    def rates(
        self, now: float, running: int = 0, reserved: int = 0, others_reserved: int = 0
    ) -> tuple[float, float]:
        """(tokens per second, requests per second) as of `now`: the past rate, or what
        `running` requests holding `reserved` tokens release at the mean hold time, if
        more; (0, 0) before any busy time. `others_reserved`: what other gateway
        processes hold of a shared pool, taken to turn over at the same mean hold (their
        requests are the same traffic behind one balancer): its releases are room for
        this process's queue too."""
        clock = self._clock(now)
        if clock <= 0.0:
            return 0.0, 0.0
        decay = math.exp(-(clock - self._clock_at_acc) / self._tau)
        # expm1: 1 - exp(-x) rounds to 0 for a busy clock of a few femtoseconds (two loop
        # times a float's last bit apart), and the rates divided by zero.
        window = -self._tau * math.expm1(-clock / self._tau)
        tokens, reqs = self._tokens * decay / window, self._reqs * decay / window
        if self._hold is not None and (running > 0 or others_reserved > 0):
            hold = max(self._hold, running * (now - self._released_at))
            tokens = max(tokens, (reserved + others_reserved) / hold)
            reqs = max(reqs, running / hold)
        return tokens, reqs


_HOLD_WEIGHT = 0.1  # of each release in the mean hold time
