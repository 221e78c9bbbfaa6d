"""The ``max_score`` picker: the highest score, ties broken by a seeded RNG, so a burst of
identical requests spreads over equal replicas instead of landing on the first one in
the list, while a test with a seed stays reproducible."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from operator import itemgetter
from typing import Any

from routing.plugin import Picker, PluginEnv, params_of
from routing.types import Candidate, RouteRequest

# Scores closer than this are treated as equal (floating-point noise must not defeat the
# random tie-break).
TIE_EPSILON = 1e-9


class MaxScorePicker(Picker):
    """The highest score; ties (within TIE_EPSILON) broken by a seeded RNG."""

    name = "max_score"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, req: RouteRequest, scored: Sequence[tuple[float, Candidate]]) -> Candidate:
        floor = max(map(itemgetter(0), scored)) - TIE_EPSILON
        tied = [c for s, c in scored if s >= floor]
        if len(tied) == 1:
            return tied[0]
        return tied[self._rng.randrange(len(tied))]


def factory(params: Mapping[str, Any], env: PluginEnv) -> MaxScorePicker:
    """``seed`` in params wins over the gateway's (``PluginEnv.seed``)."""
    params_of(params, {"seed": int})
    seed = params.get("seed", env.seed)
    return MaxScorePicker(seed)
