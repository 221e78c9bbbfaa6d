"""The scaling signal: how many replicas a model needs for the demand kvgate sees.

Little's law, per model: the requests that must run at once to serve the demand are
the arrival rate times the time one takes to serve (L = lambda * W), and one replica
runs as many as its learned running limit allows, within its hard cap and within as
many of the model's mean KV need as its pool holds. So

    desired = ceil(arrival rate * mean service time / mean concurrency per replica)

The arrival rate counts every request offered to the model, admitted, queued or shed,
so demand that kvgate turns away still asks for replicas; the service time is measured
from admission to release (queueing excluded: a queue is what more replicas remove).
Both are sums over a sliding window of ``window_s`` in one-second buckets, and the
concurrency per replica is read from the ready replicas now (or, with none ready, as
last seen). It is a signal, not a controller: the autoscaler that reads it
(`kvgate_model_desired_replicas`, a KEDA ScaledObject or an HPA) owns the stabilisation
and the bounds. Sans-IO: time comes in as `now`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Bucket:
    second: int
    arrivals: int = 0
    served: int = 0
    service_s: float = 0.0
    tokens: int = 0


@dataclass(slots=True)
class _ModelDemand:
    buckets: deque[_Bucket] = field(default_factory=deque)
    first_seen: float = math.inf
    per_replica: float | None = None  # concurrency of one replica, as last seen
    service_s: float | None = None  # mean service time, as last measured


# The demand's sliding window: long enough to hold a service time's worth of arrivals,
# short next to an autoscaler's own stabilisation (minutes).
SCALING_WINDOW_S = 30.0


class ScalingSignal:
    def __init__(self, window_s: float = SCALING_WINDOW_S) -> None:
        self.window_s = window_s
        self._models: dict[str, _ModelDemand] = {}

    def _bucket(self, model: str, now: float) -> _Bucket:
        d = self._models.get(model)
        if d is None:
            d = self._models[model] = _ModelDemand(first_seen=now)
        buckets = d.buckets
        second = math.floor(now)
        if buckets:
            last = buckets[-1]
            if last.second == second:
                return last  # on every request: trimmed when a second opens, and on reading
        last = _Bucket(second)
        buckets.append(last)
        self._trim(d, now)
        return last

    def _trim(self, d: _ModelDemand, now: float) -> None:
        oldest = math.floor(now - self.window_s)
        while d.buckets and d.buckets[0].second < oldest:
            d.buckets.popleft()

    def arrived(self, model: str, now: float) -> None:
        """A request for `model` was offered (whatever its verdict)."""
        self._bucket(model, now).arrivals += 1

    def served(self, model: str, seconds: float, tokens: int, now: float) -> None:
        """A request of `model` held a replica `seconds` (admission to release) and
        `tokens` of its pool."""
        b = self._bucket(model, now)
        b.served += 1
        b.service_s += max(0.0, seconds)
        b.tokens += max(0, tokens)

    def models(self) -> list[str]:
        return list(self._models)

    def desired(self, model: str, now: float, replicas: list[tuple[int | None, int]]) -> int | None:
        """Replicas `model` needs now; `replicas` is (running slots allowed or None,
        effective pool tokens) of each of its ready replicas. None before any demand."""
        d = self._models.get(model)
        if d is None:
            return None
        self._trim(d, now)
        arrivals = sum(b.arrivals for b in d.buckets)
        served = sum(b.served for b in d.buckets)
        if served:
            d.service_s = sum(b.service_s for b in d.buckets) / served
        tokens = sum(b.tokens for b in d.buckets) / served if served else None
        slots = [_slots(allowed, pool, tokens) for allowed, pool in replicas]
        known = [s for s in slots if s is not None and s > 0]
        if known:
            d.per_replica = sum(known) / len(known)
        if arrivals == 0:
            return 0
        if d.per_replica is None or d.service_s is None:
            return len(replicas) or None  # no evidence yet: what there is
        span = min(self.window_s, max(1.0, now - d.first_seen))
        rate = arrivals / span
        return max(1, math.ceil(rate * d.service_s / d.per_replica - 1e-9))


def _slots(allowed: int | None, pool: int, tokens: float | None) -> float | None:
    """Requests one replica runs at once: its allowance, within what its pool holds of
    the model's mean need (the KV ceiling binds first on a small pool)."""
    held = pool / tokens if tokens else None
    if allowed is None:
        return held
    return float(allowed) if held is None else min(float(allowed), held)
