"""One request's matched prefix per replica, walked once per decision.

A decision reads each candidate's cached prefix several times (its score, `prefix_load`'s
cost, the explanation, the placement's prefill count, admission's expected-TTFT
choice). `PrefixMatches` walks the prompt's chains once per request and replica and
remembers the answer until the request, the engines' KV events (`KVIndex.version`) or
the approximate index (`forget`) change. The engines' blocks are walked once for every
replica together (`KVIndex.depths`, against the index of holders), not once per replica;
prompts still in prefill on a replica count as held there (routing.prefill.PrefillBlocks).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from routing.prefill import PrefillBlocks
from routing.prefix import PrefixIndex
from routing.types import Candidate, RouteRequest


class PrefixMatches:
    """(from the engine's events?, leading prompt blocks held) per replica, for the
    request last asked about (module docstring)."""

    __slots__ = ("_indexes", "_kv", "_prefilling", "_req", "_version", "_memo", "_depths")

    def __init__(
        self, indexes: Mapping[str, PrefixIndex], kv: Any, prefilling: PrefillBlocks
    ) -> None:
        self._indexes = indexes  # the approximate index per replica (routing.prefix)
        self._kv = kv  # the engines' own blocks (routing.kvindex.KVIndex), or None
        self._prefilling = prefilling  # prompts placed and not yet stored (routing.prefill)
        self._req: RouteRequest | None = None
        self._version = -1
        self._memo: dict[str, tuple[float | None, bool, int]] = {}
        self._depths: dict[str, int] | None = None

    def forget(self) -> None:
        """The approximate index changed: walk again."""
        self._req = None

    def _for(self, req: RouteRequest) -> dict[str, tuple[float | None, bool, int]]:
        """The memo of `req` (a new request or changed events start a new one)."""
        kv = self._kv
        version = kv.version if kv is not None else 0
        if req is not self._req or version != self._version:
            self._req = req
            self._version = version
            self._memo = {}
            self._depths = None
        return self._memo

    def get(self, req: RouteRequest, candidate: Candidate) -> tuple[bool, int]:
        """(from the engine's own events?, leading prompt blocks held) on `candidate`:
        the engine's blocks where it publishes trusted events (`trusted`), else the
        approximate index's."""
        if self._kv is None:  # the approximate index alone: one walk, nothing to keep
            return False, self._approximate(req, candidate.name)
        queries = candidate.engine.prefix_cache_queries_total
        got = self._for(req).get(candidate.name)
        if got is None or got[0] != queries:
            got = self._walk(req, candidate.name, queries)
        return got[1], got[2]

    def each(self, req: RouteRequest, candidates: Sequence[Candidate]) -> list[tuple[bool, int]]:
        """`get` for each candidate, in one pass."""
        if self._kv is None:
            approximate = self._approximate
            return [(False, approximate(req, c.name)) for c in candidates]
        memo = self._for(req)
        walk = self._walk
        out = []
        for c in candidates:
            queries = c.engine.prefix_cache_queries_total
            got = memo.get(c.name)
            if got is None or got[0] != queries:
                got = walk(req, c.name, queries)
            out.append((got[1], got[2]))
        return out

    def _walk(
        self, req: RouteRequest, name: str, queries: float | None
    ) -> tuple[float | None, bool, int]:
        blocks = self.trusted(req, name, queries) if self._kv is not None else None
        if blocks is not None:
            depths = self._depths
            if depths is None:
                depths = self._depths = self._kv.depths(req.token_hashes)
            depth = depths.get(name, 0)
            also = self._prefilling.of(name)
            if also:  # prompts in prefill there count as held (routing.prefill)
                depth = blocks.match_with(req.token_hashes, depth, also)
            got = (queries, True, depth)
        else:
            got = (queries, False, self._approximate(req, name))
        self._memo[name] = got
        return got

    def _approximate(self, req: RouteRequest, name: str) -> int:
        idx = self._indexes.get(name)
        hashes = req.prefix_hashes
        return idx.match(hashes) if idx is not None and hashes else 0

    def trusted(self, req: RouteRequest, name: str, queries: float | None) -> Any:
        """The replica's engine blocks (routing.kvindex.EngineBlocks) where its events
        can name the prompt's blocks and are trusted now (`queries`: the engine's
        prefix-cache query counter, which says whether silence is staleness), else None
        (the approximate index then)."""
        kv = self._kv
        if kv is None or not req.token_hashes:
            return None
        blocks = kv.get(name)
        if blocks is None or blocks.block_size != req.token_block_size:
            return None
        return blocks if blocks.usable(req.now, queries) else None

    def engine(self, req: RouteRequest, name: str, queries: float | None) -> int | None:
        """Leading blocks of the prompt's token chain the replica's engine holds, from
        its KV events; None where there are none to trust."""
        blocks = self.trusted(req, name, queries)
        return None if blocks is None else blocks.match(req.token_hashes)
