"""The ``running_headroom`` scorer: the free share of the replica's running cap.

The cap is the configured or engine one (or this process's share of it), always
current; without one, fewer running scores higher. The load term to
pair with a preference scorer (``prefix_cache``, ``speculation``): it keeps a warm
replica from being driven to its limit while a cold one idles."""

from __future__ import annotations

from routing.plugin import Scorer, no_params
from routing.types import Candidate, RouteRequest


class RunningHeadroomScorer(Scorer):
    """Free share of the replica's running cap: 1 - running /
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
