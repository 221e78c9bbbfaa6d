"""The ``engine_queue`` scorer: the engine's own waiting queue (other clients, preempted
requests), 1 / (1 + waiting).

The gauge is up to one discovery interval old; the profile lowers the whole score of a
replica whose view is staler (`routing.scheduler.Profile`). It is never read as room:
whether a request fits is the ledger's call, made before routing runs."""

from __future__ import annotations

from routing.plugin import Scorer, no_params
from routing.types import Candidate, RouteRequest


class EngineQueueScorer(Scorer):
    """The engine's own waiting queue (other clients, preempted requests): 1 / (1 + waiting)."""

    name = "engine_queue"

    def score(self, req: RouteRequest, candidate: Candidate) -> float:
        return 1.0 / (1.0 + max(0, candidate.engine.engine_waiting))


factory = no_params(EngineQueueScorer)
