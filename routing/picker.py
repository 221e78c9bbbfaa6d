"""Replica choice as filter -> score -> pick (the shape of the Kubernetes inference
gateway's endpoint picker).

Admission hands the picker only replicas that can take the request *now* (ready, serve
the model, KV need fits, below the running cap); a picker must return one of them or
None. Filters may drop more (e.g. "only speculative replicas for coding"); scorers each
map a candidate to [0, 1] and are combined as a weighted sum; ties are broken by a seeded
RNG so that a burst of identical requests spreads over equal replicas instead of landing
on the first one in the list, while a test with a fixed seed stays reproducible.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from routing.plugins import KVHeadroomScorer
from routing.types import Candidate, RouteRequest

Filter = Callable[[RouteRequest, Candidate], bool]

# Scores closer than this are treated as equal (floating-point noise must not defeat the
# random tie-break).
TIE_EPSILON = 1e-9


@runtime_checkable
class Picker(Protocol):
    def pick(self, req: RouteRequest, candidates: Sequence[Candidate]) -> Candidate | None: ...


class Scorer(Protocol):
    """Maps a candidate to [0, 1]; higher is better."""

    name: str

    def score(self, req: RouteRequest, candidate: Candidate) -> float: ...


# The most-headroom scorer is the `kv_headroom` plugin of the routing profiles.
HeadroomScorer = KVHeadroomScorer


class ScoringPicker:
    """Generic filter -> weighted score -> random tie-break picker."""

    def __init__(
        self,
        scorers: Sequence[tuple[Scorer, float]],
        filters: Sequence[Filter] = (),
        *,
        seed: int | None = None,
    ) -> None:
        for scorer, weight in scorers:
            if weight < 0:
                raise ValueError(f"scorer {scorer.name!r} has negative weight {weight}")
        self._scorers = tuple(scorers)
        self._filters = tuple(filters)
        self._rng = random.Random(seed)

    def score(self, req: RouteRequest, candidate: Candidate) -> float:
        """Weighted sum of the scorers (each clamped to [0, 1])."""
        total = 0.0
        for scorer, weight in self._scorers:
            total += weight * min(1.0, max(0.0, scorer.score(req, candidate)))
        return total

    def pick(self, req: RouteRequest, candidates: Sequence[Candidate]) -> Candidate | None:
        kept = [c for c in candidates if all(f(req, c) for f in self._filters)]
        if not kept:
            return None
        scored = [(self.score(req, c), c) for c in kept]
        best = max(s for s, _ in scored)
        tied = [c for s, c in scored if s >= best - TIE_EPSILON]
        if len(tied) == 1:
            return tied[0]
        return tied[self._rng.randrange(len(tied))]


class MostHeadroomPicker(ScoringPicker):
    """The default: the replica with the largest free fraction of its effective KV pool."""

    def __init__(self, *, seed: int | None = None) -> None:
        super().__init__([(HeadroomScorer(), 1.0)], seed=seed)
