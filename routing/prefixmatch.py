"""One request's matched prefix per replica, walked once per decision.

A decision reads each candidate's cached prefix several times (its score, `prefix_load`'s
cost, the explanation, the placement's prefill count, admission's expected-TTFT
choice). `PrefixMatches` walks the prompt's chains once per request and replica and
remembers the answer until the request, the engines' KV events (`KVIndex.version`) or
the approximate index (`forget`) change. The engines' blocks are matched once per
decision for every replica holding the prompt's first block (`KVIndex.depths`: a bisection
per replica without holes); prompts still in prefill on a replica count as held there
(routing.prefill.PrefillBlocks).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from routing.prefill import PrefillBlocks
from routing.prefix import PrefixIndex
from routing.types import Candidate, RouteRequest

# One replica's match: (the engine's prefix-cache query counter it was walked at, from
# the engine's own events?, leading prompt blocks held there).
Match = tuple[float | None, bool, int]


class PrefixMatches:
    """(from the engine's events?, leading prompt blocks held) per replica, for the
    request last asked about (module docstring)."""

    __slots__ = ("_indexes", "_kv", "_prefilling", "_req", "_version", "_now", "_memo", "_depths")

    def __init__(
        self, indexes: Mapping[str, PrefixIndex], kv: Any, prefilling: PrefillBlocks
    ) -> None:
        self._indexes = indexes  # the approximate index per replica (routing.prefix)
        self._kv = kv  # the engines' own blocks (routing.kvindex.KVIndex), or None
        self._prefilling = prefilling  # prompts placed and not yet stored (routing.prefill)
        self._req: RouteRequest | None = None
        self._version = -1
        self._now = 0.0
        # name -> (the engine's query counter it was walked at, exact?, depth): the
        # tuples `each` hands out as they are (a decision allocates none of its own).
        self._memo: dict[str, Match] = {}
        self._depths: dict[str, int] | None = None

    def forget(self) -> None:
        """The approximate index changed: walk again."""
        self._req = None

    def _for(self, req: RouteRequest) -> dict[str, Match]:
        """The memo of `req` (a new request, changed events or another decision time,
        which may turn a silent subscription stale, start a new one)."""
        version = self._kv.version
        if req is not self._req or version != self._version or req.now != self._now:
            self._req = req
            self._version = version
            self._now = req.now
            self._memo = {}
            self._depths = None
        return self._memo

    def get(self, req: RouteRequest, candidate: Candidate) -> tuple[bool, int]:
        """(from the engine's own events?, leading prompt blocks held) on `candidate`:
        the engine's blocks where it publishes trusted events (`trusted`), else the
        approximate index's."""
        if self._kv is None:  # the approximate index alone: one walk, nothing to keep
            return False, self._approximate(req, candidate.name)
        got = self.one(req, candidate)
        return got[1], got[2]

    def one(self, req: RouteRequest, candidate: Candidate) -> Match:
        """`each` of one candidate, its memo read directly where it still holds: after
        the scoring, a decision asks again for the chosen replica (the explanation,
        the placement hooks) and those reads cost a lookup, not a pass."""
        got = self._memo.get(candidate.name)
        if (
            got is not None
            and req is self._req
            and req.now == self._now
            and got[0] == candidate.engine.prefix_cache_queries_total
            and self._kv is not None
            and self._kv.version == self._version
        ):
            return got
        return self.each(req, (candidate,))[0]

    def each(self, req: RouteRequest, candidates: Sequence[Candidate]) -> list[Match]:
        """(queries, from the engine's events?, leading blocks held) for each candidate,
        in one pass (`get`'s answer after the first item). A candidate not in the memo
        is walked here: `trusted` inline (this runs for every candidate of every
        decision), its depth from the one walk of the chain against the holders, then
        on through the prompts in prefill there (routing.prefill)."""
        if self._kv is None:
            approximate = self._approximate
            return [(None, False, approximate(req, c.name)) for c in candidates]
        memo = self._for(req)
        chain = req.token_hashes
        engines = self._kv.by_name() if chain else {}
        size, now = req.token_block_size, req.now
        prefilling = self._prefilling.by_replica()  # read once, not per candidate
        out = []
        for c in candidates:
            name = c.name
            queries = c.engine.prefix_cache_queries_total
            got = memo.get(name)
            if got is None or got[0] != queries:
                blocks = engines.get(name)
                if blocks is not None and blocks.block_size == size and blocks.usable(now, queries):
                    depths = self._depths
                    if depths is None:
                        depths = self._depths = self._kv.depths(chain)
                    depth = depths.get(name, 0)
                    also = prefilling.get(name)
                    if also:
                        depth = blocks.match_with(chain, depth, also)
                    got = (queries, True, depth)
                else:
                    got = (queries, False, self._approximate(req, name))
                memo[name] = got
            out.append(got)
        return out

    def deepest(self, req: RouteRequest) -> int:
        """The most leading blocks of the prompt's token chain any replica's engine holds
        (its events, trusted or not), from the decision's one walk of the chain."""
        self._for(req)
        depths = self._depths
        if depths is None:
            depths = self._depths = self._kv.depths(req.token_hashes)
        return max(depths.values()) if depths else 0

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
