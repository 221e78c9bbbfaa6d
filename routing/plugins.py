"""Built-in load plugins: filters, load scorers and the max-score picker.

Registered by name in `routing.registry`; profiles name them in YAML. Scorers map a
candidate to [0, 1] (higher is better). Those reading the engine's own gauges see a view
up to one discovery interval old; the profile lowers the whole score of a replica whose
view is staler than that (`routing.scheduler.Profile`), and nothing here reads a gauge as
room: whether a request fits is the ledger's call, made before routing runs.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from routing.registry import PluginEnv, params_of, register
from routing.types import Candidate, RouteRequest

# Scores closer than this are treated as equal (floating-point noise must not defeat the
# random tie-break).
TIE_EPSILON = 1e-9


# ------------------------------------------------------------------ filters
class LabelFilter:
    """Keeps replicas whose labels carry every ``key: value`` in params."""

    name = "label"

    def __init__(self, wanted: Mapping[str, str]) -> None:
        self.wanted = dict(wanted)

    def filter(self, req: RouteRequest, candidates: Sequence[Candidate]) -> list[Candidate]:
        w = self.wanted.items()
        return [c for c in candidates if all(c.labels.get(k) == v for k, v in w)]


@register("filter", "label")
def _label(params: Mapping[str, Any], env: PluginEnv) -> LabelFilter:
    for key, value in params.items():
        if not isinstance(value, str):
            raise ValueError(f"label {key!r} must be a string, not {type(value).__name__}")
    return LabelFilter(params)


# ------------------------------------------------------------------ scorers
class KVHeadroomScorer:
    """Free fraction of the replica's effective pool in the ledger: free / effective."""

    name = "kv_headroom"

    def score(self, req: RouteRequest, candidate: Candidate) -> float:
        if candidate.effective_capacity <= 0:
            return 0.0
        return min(1.0, max(0.0, candidate.free_tokens / candidate.effective_capacity))


class RunningHeadroomScorer:
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


class EngineQueueScorer:
    """The engine's own waiting queue (other clients, preempted requests): 1 / (1 + waiting)."""

    name = "engine_queue"

    def score(self, req: RouteRequest, candidate: Candidate) -> float:
        return 1.0 / (1.0 + max(0, candidate.engine_waiting))


class EngineKVUsageScorer:
    """The engine's own KV usage gauge: 1 - usage."""

    name = "engine_kv_usage"

    def score(self, req: RouteRequest, candidate: Candidate) -> float:
        return min(1.0, max(0.0, 1.0 - candidate.kv_usage))


def _no_params(cls: type) -> Any:
    def factory(params: Mapping[str, Any], env: PluginEnv) -> Any:
        params_of(params, {})
        return cls()

    return factory


for _cls in (KVHeadroomScorer, RunningHeadroomScorer, EngineQueueScorer, EngineKVUsageScorer):
    register("scorer", _cls.name)(_no_params(_cls))


# ------------------------------------------------------------------ pickers
class MaxScorePicker:
    """The highest score; ties (within TIE_EPSILON) broken by a seeded RNG, so a burst of
    identical requests spreads over equal replicas and a test with a seed is reproducible."""

    name = "max_score"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, req: RouteRequest, scored: Sequence[tuple[float, Candidate]]) -> Candidate:
        best = max(s for s, _ in scored)
        tied = [c for s, c in scored if s >= best - TIE_EPSILON]
        if len(tied) == 1:
            return tied[0]
        return tied[self._rng.randrange(len(tied))]


@register("picker", "max_score")
def _max_score(params: Mapping[str, Any], env: PluginEnv) -> MaxScorePicker:
    params_of(params, {"seed": int})
    seed = params.get("seed", env.seed)
    return MaxScorePicker(seed)
