"""Sans-IO replica health: discovery hysteresis and outlier ejection (as Envoy does).

Neither class reads a clock or does IO; the gateway shell feeds them observations and
acts on what they return (it owns the timers).

`ProbeHysteresis`
    A replica's readiness as discovery reports it to admission. One failed or slow probe
    round must not take a replica out of service (on a single replica that is a 503
    exactly when the engine is busiest): a ready replica becomes unready only after
    ``fail_threshold`` consecutive failed rounds, and an unready one returns after
    ``success_threshold`` consecutive good rounds. The first round decides at once, so a
    gateway is truthful from its first request.

`OutlierDetector`
    Passive health from the request path: ``consecutive_failures`` upstream failures in a
    row (5xx, refused connection, timeout before the first byte) eject a replica for
    ``base_ejection_s``, doubled on each repeat ejection and capped at ``max_ejection_s``;
    the multiplier is forgotten after ``max_ejection_s`` without an ejection. A replica is
    ejected only while the share of ejected replicas stays within
    ``max_ejection_percent`` (so one replica of one, or two of two at 50%, are never
    ejected: failing fast with 503 is no better than trying). Any answer that is not such
    a failure (a completion, a 4xx) resets the count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class ProbeHysteresis:
    """Consecutive-round hysteresis of one replica's readiness."""

    __slots__ = ("fail_threshold", "success_threshold", "ready", "_fails", "_oks")

    def __init__(self, fail_threshold: int, success_threshold: int) -> None:
        self.fail_threshold = max(1, fail_threshold)
        self.success_threshold = max(1, success_threshold)
        self.ready: bool | None = None  # None until the first round
        self._fails = 0
        self._oks = 0

    def observe(self, ok: bool) -> bool:
        """Feed one probe round's verdict; returns the readiness to report."""
        if self.ready is None:
            self.ready = ok
            return ok
        if ok:
            self._fails = 0
            self._oks += 1
            if not self.ready and self._oks >= self.success_threshold:
                self.ready = True
        else:
            self._oks = 0
            self._fails += 1
            if self.ready and self._fails >= self.fail_threshold:
                self.ready = False
        return self.ready

    def force_down(self) -> None:
        """The request path saw the replica down (refused connection): it returns only
        after ``success_threshold`` good rounds."""
        if self.ready is not None:
            self.ready = False
            self._oks = 0


@dataclass(slots=True)
class _Outlier:
    failures: int = 0
    ejected_until: float | None = None
    ejections: int = 0  # total, for metrics
    multiplier: int = 0  # ejections in the current run (doubling)
    last_ejected_at: float = -math.inf


class OutlierDetector:
    """Consecutive-failure ejection with doubling, capped, bounded by a percentage. Its
    settings are the gateway's ``outlier`` section's, which holds their defaults."""

    def __init__(
        self,
        *,
        consecutive_failures: int,
        base_ejection_s: float,
        max_ejection_s: float,
        max_ejection_percent: float,
    ) -> None:
        self.consecutive_failures = max(1, consecutive_failures)
        self.base_ejection_s = base_ejection_s
        self.max_ejection_s = max(base_ejection_s, max_ejection_s)
        self.max_ejection_percent = max_ejection_percent
        self._hosts: dict[str, _Outlier] = {}

    def _host(self, name: str) -> _Outlier:
        h = self._hosts.get(name)
        if h is None:
            h = self._hosts[name] = _Outlier()
        return h

    def add(self, name: str) -> None:
        self._host(name)

    def success(self, name: str) -> None:
        h = self._hosts.get(name)
        if h is not None:
            h.failures = 0

    def failure(self, name: str, now: float) -> float | None:
        """One upstream failure of `name`; returns the end of a new ejection, else None."""
        h = self._host(name)
        if h.ejected_until is not None:
            return None  # already out (a request admitted before the ejection ended)
        h.failures += 1
        if h.failures < self.consecutive_failures:
            return None
        ejected = sum(1 for x in self._hosts.values() if x.ejected_until is not None)
        allowed = math.floor(len(self._hosts) * self.max_ejection_percent / 100.0)
        if ejected + 1 > allowed:
            return None  # too few would remain; the count stays at the threshold
        if now - h.last_ejected_at >= self.max_ejection_s + self._duration(h.multiplier):
            h.multiplier = 0
        h.multiplier += 1
        h.failures = 0
        h.ejections += 1
        h.last_ejected_at = now
        h.ejected_until = now + self._duration(h.multiplier)
        return h.ejected_until

    def _duration(self, multiplier: int) -> float:
        if multiplier <= 0:
            return 0.0
        return min(self.max_ejection_s, self.base_ejection_s * 2 ** (multiplier - 1))

    def expire(self, now: float) -> list[str]:
        """Replicas whose ejection has ended by `now` (they return to service)."""
        out = []
        for name, h in self._hosts.items():
            if h.ejected_until is not None and h.ejected_until <= now:
                h.ejected_until = None
                h.failures = 0
                out.append(name)
        return out

    def ejected_until(self, name: str) -> float | None:
        h = self._hosts.get(name)
        return h.ejected_until if h is not None else None

    def ejections(self, name: str) -> int:
        h = self._hosts.get(name)
        return h.ejections if h is not None else 0
