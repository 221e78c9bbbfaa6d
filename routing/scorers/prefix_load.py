"""The ``prefix_load`` scorer: the prompt's cached prefix traded against the work each
replica has waiting, in one cost, the agentic default.

    cost  = (prefill pending there + this prompt's uncached tokens + 1)
            x (1 + decode_weight x tokens the replica holds reserved / its pool)
    score = 1 / (1 + cost / the replica's pool)

The first factor is the prefill that stands between the request and its first token
(Dynamo's ``active_prefill + new_prompt_blocks - overlap``); the second is how much
slower each step of it runs beside the replica's decode batch (a step reads every held
token's KV; a full pool about doubles it at ``decode_weight`` 1). The decode load
multiplies the prefill rather than adding to it, as a request's time to first token is
its prefill steps times their length: added, the held tokens of a few running agent
turns outweigh any prefix saved and the trade turns into plain load balancing. The
``+ 1`` breaks ties between replicas that hold the whole prompt by their load.

The cached part is what the prefix index expects the replica to hold (routing.prefix,
as the ``prefix_cache`` scorer keeps it; routing.kvindex where the engine publishes its
KV events). Prefill pending is routing.prefill: uncached prompt tokens placed there and
not yet through their first token. So a warm replica wins while the prefill it saves
outweighs the queue it has; cold first turns spread over the replicas that are not
already prefilling, instead of piling onto the one that holds the system prompt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from routing.plugin import PluginEnv, params_of
from routing.prefill import PendingPrefill
from routing.scorers.prefix_cache import PrefixCacheScorer
from routing.types import Candidate, RouteRequest


class PrefixLoadScorer(PrefixCacheScorer):
    """Cached prefix against prefill and decode load, as one cost (module docstring)."""

    name = "prefix_load"

    def __init__(
        self,
        block_chars: int,
        chars_per_token: float,
        max_blocks_per_replica: int,
        decode_weight: float,
        env: PluginEnv | None = None,
    ) -> None:
        super().__init__(block_chars, chars_per_token, max_blocks_per_replica, env)
        self.decode_weight = decode_weight
        self.pending = PendingPrefill()

    def cost(self, req: RouteRequest, candidate: Candidate) -> float:
        """Prefill tokens ahead of this request's first token there, slowed by the
        replica's decode load (module docstring)."""
        prompt = max(0, req.prompt_tokens)
        uncached = max(0, prompt - self.cached_tokens(req, candidate))
        prefill = self.pending.tokens(candidate.name) + uncached + 1
        pool = max(1, candidate.effective_capacity)
        held = max(0, pool - candidate.free_tokens)
        return prefill * (1.0 + self.decode_weight * held / pool)

    def score(self, req: RouteRequest, candidate: Candidate) -> float:
        pool = max(1, candidate.effective_capacity)
        return 1.0 / (1.0 + self.cost(req, candidate) / pool)

    def scores(self, req: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
        """`score` of each candidate (the same arithmetic, the request's terms once, in
        one pass over the matches: `_as_tokens` inline, since a call per candidate was a
        measurable share of a precise decision: docs/benchmarks-routing.md)."""
        # Conditionals, not max(): a builtin with keywords costs more than the arithmetic.
        raw = req.prompt_tokens  # `cached_tokens` is within it as given
        prompt = raw if raw > 0 else 0
        tbs = req.token_block_size
        bc, cpt, learned = self.block_chars, self.chars_per_token, self.feedback.chars_per_token
        pending = self.pending.by_replica().get
        weight = self.decode_weight
        out = []
        for c, (_, exact, blocks) in zip(
            candidates, self._matches.each(req, candidates), strict=True
        ):
            if not blocks:
                cached = 0
            else:
                cached = blocks * tbs if exact else int(blocks * bc / learned.get(c.name, cpt))
                if raw and raw < cached:
                    cached = raw
            prefill = pending(c.name, 0) + (prompt - cached if prompt > cached else 0) + 1
            pool = c.effective_capacity if c.effective_capacity > 1 else 1
            held = pool - c.free_tokens
            if held < 0:
                held = 0
            out.append(1.0 / (1.0 + prefill * (1.0 + weight * held / pool) / pool))
        return out

    def placed(self, req: RouteRequest, candidate: Candidate, now: float) -> None:
        uncached = max(0, req.prompt_tokens - self.cached_tokens(req, candidate))
        super().placed(req, candidate, now)
        self.pending.add(req.request_id, candidate.name, uncached)

    def first_token(self, request_id: str, now: float) -> None:
        super().first_token(request_id, now)
        self.pending.done(request_id)

    def released(self, request_id: str, replica: str, now: float) -> None:
        super().released(request_id, replica, now)
        self.pending.done(request_id)


def factory(params: Mapping[str, Any], env: PluginEnv) -> PrefixLoadScorer:
    params_of(
        params,
        {
            "chars_per_token": (int, float),
            "max_blocks_per_replica": int,
            "decode_weight": (int, float),
        },
    )
    cpt = float(params.get("chars_per_token", 4.0))
    most = int(params.get("max_blocks_per_replica", 1_000_000))
    weight = float(params.get("decode_weight", 1.0))
    if cpt <= 0 or most <= 0 or weight < 0:
        raise ValueError(
            "chars_per_token and max_blocks_per_replica must be positive, decode_weight >= 0"
        )
    return PrefixLoadScorer(env.block_chars, cpt, most, weight, env)
