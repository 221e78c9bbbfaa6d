"""The ``prefix_load`` scorer: the prompt's cached prefix traded against the work each
replica has waiting, in one cost (Dynamo's KV router's shape), the agentic default.

    cost = prefill_weight x (prefill pending there + this prompt's uncached tokens)
           + tokens the replica holds reserved (its decode load)
    score = 1 / (1 + cost / the replica's effective pool)

The cached part is what the prefix index expects the replica to hold (routing.prefix,
as the ``prefix_cache`` scorer keeps it; routing.kvindex where the engine publishes its
KV events). Prefill pending is routing.prefill: uncached prompt tokens placed there and
not yet through their first token. So a warm replica wins while the prefill it saves
outweighs the queue it has; cold first turns spread over the replicas that are not
already prefilling, instead of piling onto the one with the most headroom.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from routing.plugin import FirstTokenHook, PluginEnv, ReleaseHook, params_of
from routing.prefill import PendingPrefill
from routing.scorers.prefix_cache import PrefixCacheScorer
from routing.types import Candidate, RouteRequest


class PrefixLoadScorer(PrefixCacheScorer, FirstTokenHook, ReleaseHook):
    """Cached prefix against prefill and decode load, as one cost (module docstring)."""

    name = "prefix_load"

    def __init__(
        self,
        block_chars: int,
        chars_per_token: float,
        max_blocks_per_replica: int,
        prefill_weight: float,
        env: PluginEnv | None = None,
    ) -> None:
        super().__init__(block_chars, chars_per_token, max_blocks_per_replica, env)
        self.prefill_weight = prefill_weight
        self.pending = PendingPrefill()

    def cost(self, req: RouteRequest, candidate: Candidate) -> float:
        """Tokens of work ahead of this request's first token there, plus the decode
        load (module docstring)."""
        prompt = max(0, req.prompt_tokens)
        uncached = max(0, prompt - self.cached_tokens(req, candidate))
        prefill = self.pending.tokens(candidate.name) + uncached
        held = max(0, candidate.effective_capacity - candidate.free_tokens)
        return self.prefill_weight * prefill + held

    def score(self, req: RouteRequest, candidate: Candidate) -> float:
        pool = max(1, candidate.effective_capacity)
        return 1.0 / (1.0 + self.cost(req, candidate) / pool)

    def placed(self, req: RouteRequest, candidate: Candidate, now: float) -> None:
        uncached = max(0, req.prompt_tokens - self.cached_tokens(req, candidate))
        super().placed(req, candidate, now)
        self.pending.add(req.request_id, candidate.name, uncached)

    def first_token(self, request_id: str, now: float) -> None:
        self.pending.done(request_id)

    def released(self, request_id: str, replica: str, now: float) -> None:
        self.pending.done(request_id)


def factory(params: Mapping[str, Any], env: PluginEnv) -> PrefixLoadScorer:
    params_of(
        params,
        {
            "chars_per_token": (int, float),
            "max_blocks_per_replica": int,
            "prefill_weight": (int, float),
        },
    )
    cpt = float(params.get("chars_per_token", 4.0))
    most = int(params.get("max_blocks_per_replica", 1_000_000))
    weight = float(params.get("prefill_weight", 1.0))
    if cpt <= 0 or most <= 0 or weight < 0:
        raise ValueError(
            "chars_per_token and max_blocks_per_replica must be positive, prefill_weight >= 0"
        )
    return PrefixLoadScorer(env.block_chars, cpt, most, weight, env)
