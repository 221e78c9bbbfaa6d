"""Outlier ejection on the upstream side: the detector's timers and its subscribers.

`admission.health.OutlierDetector` decides (sans-IO) when consecutive failures eject a
replica and for how long; `OutlierEjection` feeds it the request path's observations,
owns the timer that ends each ejection, and publishes every change, the ejection and
its end, to each subscriber in the order they subscribed, as Envoy's outlier detector
tells its listeners. Admission is one subscriber (it stops placing requests on an
ejected replica), the metrics and log are another (`report_ejections`); the detector
knows neither. A subscriber that raises is logged and the others still hear the change.

Only the failures that say the replica is unwell count (`OUTLIER_FAILURES`): a refused
connection, no first byte in time, and a 5xx answer once the request path has judged it
the replica's (gateway/upstream/failover.py: another replica then served the same request; a
request that fails everywhere is the request's fault, invariant 8 (docs/principles.md)). Any other
answer resets the count.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from admission.health import OutlierDetector
from gateway.config import OutlierConfig
from gateway.metrics import GatewayMetrics

# The request path's logger, as before these lines left gateway/pipeline.py: log
# filters that select it keep working.
log = logging.getLogger("kvgate.pipeline")

# Upstream failures (raised before any byte reached the client) that count towards
# outlier ejection; failover reports a 5xx answer only once it is judged the replica's.
OUTLIER_FAILURES = frozenset({"connect", "status_5xx", "timeout"})


@dataclass(frozen=True, slots=True)
class EjectionChange:
    """A replica was ejected (until `until`) or returned to service, at loop time `at`."""

    replica: str
    ejected: bool
    at: float
    until: float | None = None


Subscriber = Callable[[EjectionChange], None]


class OutlierEjection:
    """The asyncio shell of an `OutlierDetector` (None: ejection disabled)."""

    def __init__(self, detector: OutlierDetector | None) -> None:
        self.detector = detector
        self._loop = asyncio.get_running_loop()
        self._subscribers: list[Subscriber] = []
        self._timers: dict[str, asyncio.TimerHandle] = {}

    @classmethod
    def from_config(cls, config: OutlierConfig, replicas: list[str]) -> OutlierEjection:
        if not config.enabled:
            return cls(None)
        detector = OutlierDetector(
            consecutive_failures=config.consecutive_failures,
            base_ejection_s=config.base_ejection_s,
            max_ejection_s=config.max_ejection_s,
            max_ejection_percent=config.max_ejection_percent,
        )
        for name in replicas:
            detector.add(name)
        return cls(detector)

    def subscribe(self, subscriber: Subscriber) -> None:
        self._subscribers.append(subscriber)

    def success(self, replica: str) -> None:
        """`replica` answered: its run of failures is over."""
        if self.detector is not None:
            self.detector.success(replica)

    def failure(self, replica: str, kind: str) -> None:
        """`replica` failed a request before its first byte, in the way `kind` names."""
        if self.detector is None or kind not in OUTLIER_FAILURES:
            return
        now = self._loop.time()
        until = self.detector.failure(replica, now)
        if until is None:
            return
        # The timer first: whatever a subscriber does, the ejection ends.
        self._timers[replica] = self._loop.call_at(until, self._end, replica, until)
        self._publish(EjectionChange(replica, True, now, until))

    def close(self) -> None:
        for h in self._timers.values():
            h.cancel()
        self._timers.clear()

    def _end(self, replica: str, until: float) -> None:
        self._timers.pop(replica, None)
        assert self.detector is not None
        # Never before `until`: the loop may run a timer a hair early.
        now = max(self._loop.time(), until)
        for name in self.detector.expire(now):
            self._publish(EjectionChange(name, False, now))

    def _publish(self, change: EjectionChange) -> None:
        for subscriber in self._subscribers:
            try:
                subscriber(change)
            except Exception:  # one subscriber's bug must not keep the change from the rest
                log.exception("ejection subscriber %r failed on %s", subscriber, change)


def report_ejections(metrics: GatewayMetrics) -> Subscriber:
    """The subscriber that counts ejections and logs every change."""

    def report(change: EjectionChange) -> None:
        replica = change.replica
        if not change.ejected:
            log.info(
                "replica %s returns from ejection", replica, extra={"fields": {"replica": replica}}
            )
            return
        metrics.ejections.labels(replica).inc()
        seconds = (change.until or change.at) - change.at
        log.warning(
            "replica %s ejected for %.1f s after consecutive failures",
            replica,
            seconds,
            extra={"fields": {"replica": replica, "ejected_s": round(seconds, 3)}},
        )

    return report
