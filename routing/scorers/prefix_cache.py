"""The ``prefix_cache`` scorer: the expected cached fraction of the prompt on each
replica, matched blocks / blocks (0 for a prompt shorter than a block).

Each replica's `routing.prefix.PrefixIndex` approximates its prefix cache: a request
placed there (`placed`) is assumed cached there. An index is sized from the replica's
pool (effective tokens x ``chars_per_token`` / ``block_chars``, at most
``max_blocks_per_replica``), so memory is bounded by replicas x that bound (about 100
bytes per block). Chasing hits alone drives the warm replica to its limit; combine it
with a load scorer (``running_headroom``, ``kv_headroom``).

Where a replica's engine publishes its KV events (routing.kvindex, ``env.kv_index``)
and the request carries its token-block chain, that replica is matched against what
its engine says it holds instead: exact blocks of the engine's block size, evictions
and restarts included. A replica whose events are missing or stale keeps the
approximate index, corrected by what its engine says it held for each request
(``prompt_cached``, routing.prefixfeedback).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from routing.holders import Holders
from routing.plugin import (
    BatchScorer,
    ExplainHook,
    FirstTokenHook,
    HintHook,
    PlacementHook,
    PluginEnv,
    PrefixReader,
    PromptCachedHook,
    ReleaseHook,
    Scorer,
    WarmHook,
    params_of,
)
from routing.prefill import PrefillBlocks
from routing.prefix import PrefixIndex
from routing.prefixfeedback import HitFeedback
from routing.prefixmatch import PrefixMatches
from routing.types import Candidate, RouteRequest


class PrefixCacheScorer(
    Scorer,
    BatchScorer,
    PlacementHook,
    ReleaseHook,
    FirstTokenHook,
    PromptCachedHook,
    HintHook,
    WarmHook,
    ExplainHook,
    PrefixReader,
):
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
        self._kv = env.kv_index if env is not None else None
        self._indexes: dict[str, PrefixIndex] = {}
        # hash -> replicas whose index holds it (kept exact by the indexes).
        self._holders: Holders = {}
        # Token chains placed on publishing replicas and not yet through their prefill.
        self.prefilling = PrefillBlocks()
        # The request's matches per replica, walked once per decision.
        self._matches = PrefixMatches(self._indexes, self._kv, self.prefilling)
        # The engines' answers correct the approximate index (routing.prefixfeedback).
        self.feedback = HitFeedback(self._indexes, block_chars)

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
        out = _deepest_holders(self._holders, req.prefix_hashes, most)
        if self._kv is not None and req.token_hashes:
            # The engines' blocks: the deepest is the deepest match, from the one walk
            # of the chain the decision's scoring reads too (routing.prefixmatch).
            deepest = self._matches.deepest(req)
            if deepest:
                for name in _deepest_holders(self._kv.holders, req.token_hashes, most, deepest):
                    if name not in out:
                        out.insert(0, name)
        return out[: max(most, 1)]

    def warm(self, req: RouteRequest) -> list[tuple[str, int]]:
        """The replicas `hints` names with the prompt tokens each is expected to hold
        cached (the engine's blocks where it publishes them, else matched blocks x
        block_chars / chars_per_token; within the prompt), warmest first: a fact for
        admission's expected-TTFT choice, not a decision."""
        hashes = req.prefix_hashes
        out = []
        for name in self.hints(req):
            exact = self.engine_match(req, name, None)
            if exact is not None:
                cached = exact * req.token_block_size
                if cached:
                    out.append((name, min(req.prompt_tokens or cached, cached)))
                continue
            idx = self._indexes.get(name)
            if idx is None:
                continue
            blocks = idx.match(hashes)
            if blocks:
                cached = int(blocks * self.block_chars / self.cpt_of(name))
                out.append((name, min(req.prompt_tokens or cached, cached)))
        out.sort(key=lambda x: -x[1])
        return out

    def explain(self, req: RouteRequest, chosen: Candidate) -> str | None:
        if not req.token_hashes and not req.prefix_hashes:
            return None
        return "prefix_warm" if self.matched(req, chosen)[1] else None

    def engine_match(self, req: RouteRequest, name: str, queries: float | None) -> int | None:
        """Leading blocks of the prompt's token chain the replica's engine holds, from
        its KV events; None where there are none to trust (the approximate index then)."""
        return self._matches.engine(req, name, queries)

    def matched(self, req: RouteRequest, candidate: Candidate) -> tuple[bool, int]:
        """(from the engine's own events?, leading blocks of the prompt held there)."""
        return self._matches.get(req, candidate)

    def cached_each(self, req: RouteRequest, candidates: Sequence[Candidate]) -> list[int]:
        """`cached_tokens` of each candidate, in one pass over the matches (what
        `prefix_load.scores` computes inline)."""
        return [
            self._as_tokens(req, c.name, exact, blocks)
            for c, (_, exact, blocks) in zip(
                candidates, self._matches.each(req, candidates), strict=True
            )
        ]

    def cached_tokens(self, req: RouteRequest, candidate: Candidate) -> int:
        """Prompt tokens `candidate` is expected to hold cached: the engine's own blocks
        where it publishes them, else the index's matched blocks x block_chars /
        chars_per_token; within the prompt. After the scoring (the explanation, the
        placement hooks) the chosen replica's match is a lookup in the decision's memo."""
        if self._kv is None:
            exact, blocks = False, self._matches.get(req, candidate)[1]
        else:
            _, exact, blocks = self._matches.one(req, candidate)
        return self._as_tokens(req, candidate.name, exact, blocks)

    def _as_tokens(self, req: RouteRequest, replica: str, exact: bool, blocks: int) -> int:
        """`blocks` matched on `replica` in prompt tokens, within the prompt."""
        if not blocks:
            return 0
        if exact:
            cached = blocks * req.token_block_size
        else:
            cpt = self.feedback.chars_per_token.get(replica, self.chars_per_token)
            cached = int(blocks * self.block_chars / cpt)
        prompt = req.prompt_tokens
        return prompt if prompt and prompt < cached else cached  # min(), cheaper

    def score(self, req: RouteRequest, candidate: Candidate) -> float:
        exact, blocks = self.matched(req, candidate)
        if not blocks:
            return 0.0
        return blocks / len(req.token_hashes if exact else req.prefix_hashes)

    def scores(self, req: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
        """`score` of each candidate, in one pass."""
        tokens, chars = len(req.token_hashes), len(req.prefix_hashes)
        return [
            (blocks / (tokens if exact else chars)) if blocks else 0.0
            for _, exact, blocks in self._matches.each(req, candidates)
        ]

    def cpt_of(self, replica: str) -> float:
        """Characters per engine token on `replica`: its answers' (routing.prefixfeedback),
        else the configured ``chars_per_token``."""
        return self.feedback.chars_per_token.get(replica, self.chars_per_token)

    def capacity_for(self, candidate: Candidate) -> int:
        cpt = self.feedback.chars_per_token.get(candidate.name, self.chars_per_token)
        blocks = int(candidate.effective_capacity * cpt / self.block_chars)
        # Conditionals, not max(min()): this runs on every placement.
        most = self.max_blocks_per_replica
        if blocks > most:
            blocks = most
        return blocks if blocks > 1 else 1

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
        exact, predicted = self._matches.get(req, candidate)
        if exact:  # stored by the engine once prefilled; until then, in prefill there
            if predicted < len(req.token_hashes):  # what the engine holds needs no copy
                self.prefilling.add(req.request_id, candidate.name, req.token_hashes[predicted:])
        else:  # the engine's answer will say what it held (module docstring)
            self.feedback.placed(
                req.request_id, candidate.name, idx, req.prefix_hashes, predicted,
                candidate.block_size,
            )  # fmt: skip
        idx.insert(req.prefix_hashes)
        self._matches.forget()  # the index changed: matches are walked again

    def first_token(self, request_id: str, now: float) -> None:
        if self.prefilling.done(request_id):
            self._matches.forget()

    def prompt_cached(
        self, request_id: str, cached_tokens: int, chars_per_token: float, now: float
    ) -> None:
        if self.feedback.answered(request_id, cached_tokens, chars_per_token):
            self._matches.forget()  # a horizon moved

    def released(self, request_id: str, replica: str, now: float) -> None:
        self.feedback.forget(request_id)
        if self.prefilling.done(request_id):
            self._matches.forget()


def _deepest_holders(
    holders: Holders, hashes: tuple[int, ...], most: int, deepest: int | None = None
) -> list[str]:
    """Up to `most` holders of the deepest block of `hashes` some replica holds (found
    by bisection: a replica holds a chain's blocks from the root, as lookups stop at the
    first miss and eviction takes leaves first; `deepest`: its depth, known), then those
    of the root."""
    if not hashes:
        return []
    root = holders.get(hashes[0])
    if not root:
        return []
    if deepest is not None:
        lo = deepest - 1
    elif holders.get(hashes[-1]):  # the whole chain is held somewhere (a returning one)
        lo = len(hashes) - 1
    else:
        lo, hi = 0, len(hashes) - 2  # hashes[lo] is held; find the deepest held
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


def factory(params: Mapping[str, Any], env: PluginEnv) -> PrefixCacheScorer:
    params_of(params, {"chars_per_token": (int, float), "max_blocks_per_replica": int})
    cpt = float(params.get("chars_per_token", 4.0))
    most = int(params.get("max_blocks_per_replica", 1_000_000))
    if cpt <= 0 or most <= 0:
        raise ValueError("chars_per_token and max_blocks_per_replica must be positive")
    return PrefixCacheScorer(env.block_chars, cpt, most, env)
