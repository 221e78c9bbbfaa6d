"""The ``prefix_cache`` scorer: the expected cached fraction of the prompt on each
replica, matched blocks / blocks (0 for a prompt shorter than a block).

Each replica's `routing.prefix.PrefixIndex` approximates its prefix cache: a request
placed there (`placed`) is assumed cached there. An index is sized from the replica's
pool (effective tokens x ``chars_per_token`` / ``block_chars``, at most
``max_blocks_per_replica``), so memory is bounded by replicas x that bound (about 100
bytes per block). Chasing hits alone drives the warm replica to its limit; combine it
with a load scorer (``running_headroom``, ``kv_headroom``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from routing.plugin import (
    ExplainHook,
    HintHook,
    PlacementHook,
    PluginEnv,
    PrefixReader,
    Scorer,
    WarmHook,
    params_of,
)
from routing.prefix import PrefixIndex
from routing.types import Candidate, RouteRequest


class PrefixCacheScorer(Scorer, PlacementHook, HintHook, WarmHook, ExplainHook, PrefixReader):
    """Expected cached-prefix fraction of the prompt on each replica (module docstring)."""

    name = "prefix_cache"
    needs_prefix = True

    def __init__(
        self,
        block_chars: int,
        chars_per_token: float,
        max_blocks_per_replica: int,
        env: PluginEnv | None = None,
    ) -> None:
        self.block_chars = block_chars
        self.chars_per_token = chars_per_token
        self.max_blocks_per_replica = max_blocks_per_replica
        self._indexes: dict[str, PrefixIndex] = {}
        # hash -> replicas whose index holds it (kept exact by the indexes).
        self._holders: dict[int, tuple[str, ...]] = {}

    def index(self, replica: str) -> PrefixIndex | None:
        return self._indexes.get(replica)

    def indexed_blocks(self) -> int:
        """Blocks held over all replicas (memory is about 100 bytes each)."""
        return sum(len(i) for i in self._indexes.values())

    def hints(self, req: RouteRequest, most: int = 4) -> list[str]:
        """Up to `most` replicas holding the request's chain deepest: the holders of the
        deepest block some index holds (found by bisection: an index holds a chain's
        blocks from the root, as lookups stop at the first miss and eviction takes
        leaves first), then those of the root (the shared system prompt), so the
        warmest replicas come first. Their exact depth is the scorer's to compute."""
        hashes = req.prefix_hashes
        if not hashes:
            return []
        holders = self._holders
        root = holders.get(hashes[0])
        if not root:
            return []
        lo, hi = 0, len(hashes) - 1  # hashes[lo] is held; find the deepest held
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if holders.get(hashes[mid]):
                lo = mid
            else:
                hi = mid - 1
        out = list(holders[hashes[lo]][-most:])
        for name in reversed(root):
            if len(out) >= most:
                break
            if name not in out:
                out.append(name)
        return out

    def warm(self, req: RouteRequest) -> list[tuple[str, int]]:
        """The replicas `hints` names with the prompt tokens each is expected to hold
        cached (matched blocks x block_chars / chars_per_token, within the prompt),
        warmest first: a fact for admission's expected-TTFT choice, not a decision."""
        hashes = req.prefix_hashes
        out = []
        for name in self.hints(req):
            idx = self._indexes.get(name)
            if idx is None:
                continue
            blocks = idx.match(hashes)
            if blocks:
                cached = int(blocks * self.block_chars / self.chars_per_token)
                out.append((name, min(req.prompt_tokens or cached, cached)))
        out.sort(key=lambda x: -x[1])
        return out

    def explain(self, req: RouteRequest, chosen: Candidate) -> str | None:
        if not req.prefix_hashes:
            return None
        idx = self._indexes.get(chosen.name)
        return "prefix_warm" if idx is not None and idx.match(req.prefix_hashes[:1]) else None

    def cached_tokens(self, req: RouteRequest, candidate: Candidate) -> int:
        """Prompt tokens `candidate` is expected to hold cached (the index's matched
        blocks x block_chars / chars_per_token, within the prompt)."""
        hashes = req.prefix_hashes
        idx = self._indexes.get(candidate.name)
        if not hashes or idx is None:
            return 0
        cached = int(idx.match(hashes) * self.block_chars / self.chars_per_token)
        return min(req.prompt_tokens or cached, cached)

    def score(self, req: RouteRequest, candidate: Candidate) -> float:
        hashes = req.prefix_hashes
        if not hashes:
            return 0.0
        idx = self._indexes.get(candidate.name)
        if idx is None:
            return 0.0
        return idx.match(hashes) / len(hashes)

    def capacity_for(self, candidate: Candidate) -> int:
        blocks = int(candidate.effective_capacity * self.chars_per_token / self.block_chars)
        return max(1, min(self.max_blocks_per_replica, blocks))

    def placed(self, req: RouteRequest, candidate: Candidate, now: float) -> None:
        if not req.prefix_hashes:
            return
        capacity = self.capacity_for(candidate)
        idx = self._indexes.get(candidate.name)
        if idx is None:
            idx = self._indexes[candidate.name] = PrefixIndex(
                capacity, name=candidate.name, holders=self._holders
            )
        elif idx.capacity != capacity:
            idx.resize(capacity)
        idx.insert(req.prefix_hashes)


def factory(params: Mapping[str, Any], env: PluginEnv) -> PrefixCacheScorer:
    params_of(params, {"chars_per_token": (int, float), "max_blocks_per_replica": int})
    cpt = float(params.get("chars_per_token", 4.0))
    most = int(params.get("max_blocks_per_replica", 1_000_000))
    if cpt <= 0 or most <= 0:
        raise ValueError("chars_per_token and max_blocks_per_replica must be positive")
    return PrefixCacheScorer(env.block_chars, cpt, most, env)
