"""Prefix-aware placement: block hash chains, a per-replica LRU index, and the
``prefix_cache`` and ``session_affinity`` scorers.

Blocks
    A prompt is cut into fixed blocks of ``block_chars`` characters (no exact tokenizer
    is assumed; only full blocks count, as an engine caches only full blocks). Each
    block's hash is xxh3-64 of its bytes seeded with its parent's hash, so a hash names
    the whole prefix up to its block, and two prompts share a hash only where they share
    everything before it. The gateway computes the chain once per request
    (`block_hashes`), at most ``max_blocks`` long, and passes it on `RouteRequest`.

Index
    Per replica, an LRU set of block hashes approximates what its prefix cache holds:
    a request placed there is assumed cached there. It is sized from the replica's pool
    (effective tokens x ``chars_per_token`` / ``block_chars``, at most
    ``max_blocks_per_replica``), so memory is bounded by replicas x that bound (about
    100 bytes per block). A chain is touched leaf first, root last, so eviction takes the
    leaves of the oldest chains first, as engines free a sequence's blocks in reverse.
    A lookup walks the chain from the start and stops at the first miss.

Score
    ``prefix_cache``: the expected cached fraction of the prompt, matched blocks / blocks
    (0 for a prompt shorter than a block). Chasing hits alone drives the warm replica to
    its limit; combine it with a load scorer (``running_headroom``, ``kv_headroom``).

Session affinity
    ``session_affinity``: 1 for the replica that last served the request's session
    (``x-session-id`` header, else the body's ``user``) within ``ttl_s``, else 0.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import xxhash

from routing.registry import PluginEnv, params_of, register
from routing.types import Candidate, RouteRequest

_xxh = xxhash.xxh3_64_intdigest


def block_hashes(text: str, block_chars: int = 64, max_blocks: int = 512) -> tuple[int, ...]:
    """The hash chain of `text`'s full blocks of `block_chars` characters (at most
    `max_blocks`): each hash covers its block and, through its seed, every block before."""
    if block_chars <= 0:
        raise ValueError("block_chars must be positive")
    n = min(len(text) // block_chars, max_blocks)
    out = []
    parent = 0
    if text.isascii():  # one encoding of the whole text: characters are bytes
        data = memoryview(text[: n * block_chars].encode("ascii"))
        for i in range(0, n * block_chars, block_chars):
            parent = _xxh(data[i : i + block_chars], parent)
            out.append(parent)
        return tuple(out)
    for i in range(n):
        parent = _xxh(
            text[i * block_chars : (i + 1) * block_chars].encode("utf-8", "replace"), parent
        )
        out.append(parent)
    return tuple(out)


class PrefixIndex:
    """An LRU set of block hashes holding at most `capacity` blocks.

    With `holders` (shared by the indexes of one scorer) it also keeps, per hash, the
    names of the replicas whose index holds it, exactly (added on insert, dropped on
    eviction), so the warm replicas of a prompt are found without asking every index.
    """

    __slots__ = ("_lru", "capacity", "_holders", "_name")

    def __init__(
        self,
        capacity: int,
        *,
        name: str = "",
        holders: dict[int, tuple[str, ...]] | None = None,
    ) -> None:
        self.capacity = max(0, capacity)
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._holders = holders
        self._name = name

    def __len__(self) -> int:
        return len(self._lru)

    def match(self, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` present; the walk stops at the first miss."""
        lru = self._lru
        for i, h in enumerate(hashes):
            if h not in lru:
                return i
        return len(hashes)

    def insert(self, hashes: Sequence[int]) -> None:
        """Touch the chain, leaf first (the root ends most recent), evicting the least
        recently used blocks beyond capacity."""
        lru = self._lru
        holders = self._holders
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                if holders is not None:
                    holders[h] = holders.get(h, ()) + (self._name,)
        self._evict()

    def resize(self, capacity: int) -> None:
        self.capacity = max(0, capacity)
        self._evict()

    def _evict(self) -> None:
        lru = self._lru
        holders = self._holders
        while len(lru) > self.capacity:
            h, _ = lru.popitem(last=False)
            if holders is not None:
                left = tuple(n for n in holders.get(h, ()) if n != self._name)
                if left:
                    holders[h] = left
                else:
                    holders.pop(h, None)


class PrefixCacheScorer:
    """Expected cached-prefix fraction of the prompt on each replica (module docstring)."""

    name = "prefix_cache"
    needs_prefix = True

    def __init__(self, block_chars: int, chars_per_token: float, max_blocks_per_replica: int):
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


@register("scorer", "prefix_cache")
def _prefix_cache(params: Mapping[str, Any], env: PluginEnv) -> PrefixCacheScorer:
    params_of(params, {"chars_per_token": (int, float), "max_blocks_per_replica": int})
    cpt = float(params.get("chars_per_token", 4.0))
    most = int(params.get("max_blocks_per_replica", 1_000_000))
    if cpt <= 0 or most <= 0:
        raise ValueError("chars_per_token and max_blocks_per_replica must be positive")
    return PrefixCacheScorer(env.block_chars, cpt, most)


class SessionAffinityScorer:
    """1 for the replica that last served the request's session within `ttl_s`."""

    name = "session_affinity"

    def __init__(self, ttl_s: float, max_sessions: int) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        # session -> (replica, expires at); in order of expiry (ttl is constant).
        self._table: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def hints(self, req: RouteRequest) -> list[str]:
        """The replica that last served the request's session, if any."""
        if req.session is None:
            return []
        got = self.replica_of(req.session, req.now)
        return [got] if got is not None else []

    def replica_of(self, session: str, now: float) -> str | None:
        got = self._table.get(session)
        if got is None or got[1] <= now:
            return None
        return got[0]

    def score(self, req: RouteRequest, candidate: Candidate) -> float:
        if req.session is None:
            return 0.0
        got = self._table.get(req.session)
        return 1.0 if got is not None and got[0] == candidate.name and got[1] > req.now else 0.0

    def placed(self, req: RouteRequest, candidate: Candidate, now: float) -> None:
        if req.session is None:
            return
        table = self._table
        table[req.session] = (candidate.name, now + self.ttl_s)
        table.move_to_end(req.session)
        while table and (len(table) > self.max_sessions or next(iter(table.values()))[1] <= now):
            table.popitem(last=False)


@register("scorer", "session_affinity")
def _session(params: Mapping[str, Any], env: PluginEnv) -> SessionAffinityScorer:
    params_of(params, {"ttl_s": (int, float), "max_sessions": int})
    ttl = float(params.get("ttl_s", 600.0))
    most = int(params.get("max_sessions", 100_000))
    if ttl <= 0 or most <= 0:
        raise ValueError("ttl_s and max_sessions must be positive")
    return SessionAffinityScorer(ttl, most)
