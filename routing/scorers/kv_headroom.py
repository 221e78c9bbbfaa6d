"""The ``kv_headroom`` scorer: the free fraction of the replica's effective pool in the
ledger (free / effective), so a small replica half empty beats a large one nearly full.
The default profile's only scorer. The ledger is admission's own and always current."""

from __future__ import annotations

from collections.abc import Sequence

from routing.plugin import Scorer, no_params
from routing.types import Candidate, RouteRequest


class KVHeadroomScorer(Scorer):
    """Free fraction of the replica's effective pool in the ledger: free / effective."""

    name = "kv_headroom"

    def score(self, req: RouteRequest, candidate: Candidate) -> float:
        if candidate.effective_capacity <= 0:
            return 0.0
        return min(1.0, max(0.0, candidate.free_tokens / candidate.effective_capacity))

    def scores(self, req: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
        """`score` of each candidate, in one call (the default profile's whole scoring;
        the profile clamps to [0, 1] as `score` does)."""
        return [
            c.free_tokens / c.effective_capacity if c.effective_capacity > 0 else 0.0
            for c in candidates
        ]


factory = no_params(KVHeadroomScorer)
