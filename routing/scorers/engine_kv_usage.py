"""The ``engine_kv_usage`` scorer: 1 - the engine's own KV usage gauge.

The gauge is up to one discovery interval old (a stale view lowers the whole score, in
`routing.scheduler.Profile`) and never read as room: fitting is the ledger's call."""

from __future__ import annotations

from routing.plugin import Scorer, no_params
from routing.types import Candidate, RouteRequest


class EngineKVUsageScorer(Scorer):
    """The engine's own KV usage gauge: 1 - usage."""

    name = "engine_kv_usage"

    def score(self, req: RouteRequest, candidate: Candidate) -> float:
        return min(1.0, max(0.0, 1.0 - candidate.engine.kv_usage))


factory = no_params(EngineKVUsageScorer)
