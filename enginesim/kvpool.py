"""Paged KV block pool with a vLLM-style prefix cache.

The pool owns `num_blocks` blocks of `block_size` token slots. A sequence holds
`ceil(tokens / block_size)` blocks. Full blocks can be registered in the prefix cache
under a chained hash (hash of the parent block's hash and the block's token ids), so two
sequences that share a prefix share the same physical blocks by reference count.

Free-list discipline follows vLLM's `BlockPool`: every block with reference count zero
sits in one LRU-ordered free queue, whether or not it still holds cached content. A
cached block with no reference is "free but evictable": a cache hit revives it (removes
it from the free queue); an allocation pops the least recently freed block and, if it
was cached, drops its hash from the cache. This is what makes cached blocks count as free
capacity, which is the point of the design: prefix caching never reduces the pool.

Everything here is O(blocks touched); nothing is per token.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Sequence

# Parent hash of the first block in a chain. Any constant works: block hashes only have
# to agree between sequences in this process.
ROOT_HASH = 0x9E3779B97F4A7C15


def root_hash(lora_name: str | None) -> int:
    """The parent hash of a chain's first block: a LoRA adapter's chain is its own
    (vLLM keys a cached block by its adapter too), the base model's is ROOT_HASH."""
    if lora_name is None:
        return ROOT_HASH
    return hash((ROOT_HASH, zlib.crc32(lora_name.encode("utf-8"))))


def chain_hashes(
    token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH, start_block: int = 0
) -> list[int]:
    """Chained hashes of the full blocks of `token_ids` from `start_block` on.

    `parent` is the hash of block `start_block - 1` (ROOT_HASH for block 0). Python's hash
    of a tuple of ints is not randomised per process, so results are deterministic.
    """
    out: list[int] = []
    n_full = len(token_ids) // block_size
    h = parent
    for b in range(start_block, n_full):
        h = hash((h, tuple(token_ids[b * block_size : (b + 1) * block_size])))
        out.append(h)
    return out


class BlockPool:
    """Reference-counted KV blocks, an LRU free queue, and the prefix-cache index."""

    __slots__ = (
        "num_blocks",
        "block_size",
        "enable_caching",
        "_ref",
        "_hash",
        "_free",
        "_cached",
        "_num_cached_free",
    )

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        # Insertion order is eviction order: the head is the least recently freed block.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._num_cached_free = 0

    # -- capacity -------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that an allocation may take (truly empty plus evictable cached)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - len(self._free)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold cached content (evictable)."""
        return self._num_cached_free

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # -- prefix cache -----------------------------------------------------------------
    def match_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix of the chain `hashes` (no refs taken)."""
        out: list[int] = []
        if not self.enable_caching:
            return out
        cached = self._cached
        for h in hashes:
            bid = cached.get(h)
            if bid is None:
                break
            out.append(bid)
        return out

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks found by `match_prefix`."""
        ref, free = self._ref, self._free
        for bid in block_ids:
            if ref[bid] == 0:
                del free[bid]
                if self._hash[bid] is not None:
                    self._num_cached_free -= 1
            ref[bid] += 1

    def register(self, block_id: int, block_hash: int) -> None:
        """Publish a full block in the prefix cache (first writer wins on duplicates)."""
        if not self.enable_caching or self._hash[block_id] is not None:
            return
        if block_hash in self._cached:
            return  # an identical block is already cached; this copy stays private
        self._hash[block_id] = block_hash
        self._cached[block_hash] = block_id

    # -- allocation -------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks from the head of the free queue, evicting cached content.

        Raises ValueError if fewer than `n` are free: callers check `num_free` first, so
        this is a bug guard that keeps the never-over-the-pool invariant unbreakable.
        """
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks, only {len(self._free)} free")
        out: list[int] = []
        free, ref, hashes = self._free, self._ref, self._hash
        for _ in range(n):
            bid, _ = free.popitem(last=False)
            h = hashes[bid]
            if h is not None:
                hashes[bid] = None
                self._num_cached_free -= 1
                if self._cached.get(h) == bid:
                    del self._cached[h]
            ref[bid] = 1
            out.append(bid)
        return out

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; unreferenced blocks join the free queue.

        Blocks are released in reverse order so a sequence's tail blocks (the least
        likely to be shared) are evicted before its head blocks, as vLLM does.
        """
        ref, free, hashes = self._ref, self._free, self._hash
        for bid in reversed(block_ids):
            r = ref[bid] - 1
            if r < 0:
                raise ValueError(f"block {bid} released more times than acquired")
            ref[bid] = r
            if r == 0:
                free[bid] = None
                if hashes[bid] is not None:
                    self._num_cached_free += 1

    def check(self) -> None:
        """Assert internal consistency (used by tests after every step)."""
        assert len(self._free) + sum(1 for r in self._ref if r > 0) == self.num_blocks
        assert all(self._ref[b] == 0 for b in self._free)
        assert self._num_cached_free == sum(1 for b in self._free if self._hash[b] is not None)
        for h, bid in self._cached.items():
            assert self._hash[bid] == h
