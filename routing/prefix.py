"""Prefix blocks and the per-replica index of them, which the ``prefix_cache`` scorer
(routing/scorers/prefix_cache.py) keeps.

Blocks
    A prompt is cut into fixed blocks of ``block_chars`` characters (no exact tokenizer
    is assumed; only full blocks count, as an engine caches only full blocks). Each
    block's hash is xxh3-64 of its bytes seeded with its parent's hash, so a hash names
    the whole prefix up to its block, and two prompts share a hash only where they share
    everything before it. The gateway computes the chain once per request
    (`block_hashes`), at most ``max_blocks`` long, and passes it on `RouteRequest`.

Index
    Per replica, an LRU set of block hashes approximates what its prefix cache holds:
    a request placed there is assumed cached there. A chain is touched leaf first, root
    last, so eviction takes the leaves of the oldest chains first, as engines free a
    sequence's blocks in reverse. A lookup walks the chain from the start and stops at
    the first miss.

Aging
    Each block carries the index's touch count at its last touch, so its age is the
    blocks touched on that replica since. The engine's cache holds less than kvgate
    placed (output blocks and running requests take room, other clients add their own):
    its answers (routing.prefixfeedback) teach a `horizon`, the age past which a block
    is taken as evicted there. A lookup stops at the first block older than it.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Sequence
from itertools import count, repeat

import xxhash

from routing.holders import Holders, drop_holder, held_length

_xxh = xxhash.xxh3_64_intdigest


def block_hashes(text: str, block_chars: int, max_blocks: int) -> tuple[int, ...]:
    """The hash chain of `text`'s full blocks of `block_chars` characters (at most
    `max_blocks`): each hash covers its block and, through its seed, every block before.
    (The gateway passes its ``routing.block_chars`` and ``routing.max_prefix_blocks``.)"""
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

    __slots__ = ("_lru", "capacity", "_holders", "_name", "clock", "horizon", "aging")

    def __init__(
        self,
        capacity: int,
        *,
        name: str = "",
        holders: Holders | None = None,
    ) -> None:
        self.capacity = max(0, capacity)
        self._lru: OrderedDict[int, int] = OrderedDict()  # hash -> clock at its last touch
        self._holders = holders
        self._name = name
        self.clock = 0  # blocks touched so far
        # The learned age (in blocks touched since) past which the engine no longer holds
        # a block (module docstring, Aging); infinite until its answers say otherwise.
        self.horizon = math.inf
        # Blocks are stamped once the replica's engine has answered (before, a block's
        # stamp is 0: placed before anything was known of how long the replica keeps it).
        self.aging = False

    def __len__(self) -> int:
        return len(self._lru)

    def match(self, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` present, and within the horizon; the walk stops at
        the first miss."""
        lru = self._lru
        if self.horizon == math.inf:
            for i, h in enumerate(hashes):
                if h not in lru:
                    return i
            return len(hashes)
        oldest = self.clock - self.horizon
        for i, h in enumerate(hashes):
            t = lru.get(h)
            if t is None or t < oldest:
                return i
        return len(hashes)

    def stamps(self, hashes: Sequence[int]) -> list[int | None]:
        """The clock at each block's last touch (None: not held), whatever the horizon."""
        return list(map(self._lru.get, hashes))

    def insert(self, hashes: Sequence[int]) -> None:
        """Touch the chain, leaf first (the root ends most recent), evicting the least
        recently used blocks beyond capacity.

        The blocks held of a chain are its first ones (a block is touched after its
        leaf-side children every time, so it outlives them), found by bisection: the
        new leaf-side part is added block by block (its holders too), the held part
        moved to the end in C."""
        lru = self._lru
        start = self.clock + 1
        self.clock += len(hashes)
        lo = held_length(hashes, lru, 0, len(hashes))  # hashes[:lo] held
        stamps = count(start) if self.aging else repeat(0)
        if lo < len(hashes):
            self._touch(reversed(hashes[lo:]), stamps)
        if lo:
            held = hashes[lo - 1 :: -1] if lo < len(hashes) else hashes[::-1]
            try:
                deque(map(lru.move_to_end, held), maxlen=0)
            except KeyError:  # not the chain's first blocks after all: one by one
                self._touch(held, stamps)
            else:
                if self.aging:
                    lru.update(zip(held, stamps, strict=False))
        self._evict()

    def _touch(self, hashes: Iterable[int], stamps: Iterator[int]) -> None:
        lru = self._lru
        holders = self._holders
        for t, h in zip(stamps, hashes, strict=False):  # stamps never end
            if h in lru:
                lru.move_to_end(h)
            elif holders is not None:
                holders[h] = holders.get(h, ()) + (self._name,)
            lru[h] = t

    def resize(self, capacity: int) -> None:
        self.capacity = max(0, capacity)
        self._evict()

    def _evict(self) -> None:
        lru = self._lru
        holders = self._holders
        while len(lru) > self.capacity:
            h, _ = lru.popitem(last=False)
            if holders is not None:
                drop_holder(holders, h, self._name)
