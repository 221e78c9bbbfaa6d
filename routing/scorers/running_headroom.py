"""The ``running_headroom`` scorer: the free share of the replica's running limit.

The limit is admission's learned one (within the cap), always current. The load term to
pair with a preference scorer (``prefix_cache``, ``speculation``): it keeps a warm
replica from being driven to its limit while a cold one idles."""

from __future__ import annotations

from routing.plugin import Scorer, no_params
from routing.types import Candidate, RouteRequest


class RunningHeadroomScorer(Scorer):
    """Free share of the replica's running limit (learned, within the cap): 1 - running /
    limit; without a limit, 1 / (1 + running). Keeps a warm replica from being driven to
    its limit while a cold one idles."""

    name = "running_headroom"

    def score(self, req: RouteRequest, candidate: Candidate) -> float:
        limit = candidate.max_running
        if limit is None:
            return 1.0 / (1.0 + candidate.running)
        if limit <= 0:
            return 0.0
        return max(0.0, 1.0 - candidate.running / limit)


factory = no_params(RunningHeadroomScorer)
