"""Block pool: reference counts, the LRU free queue and prefix-cache eviction."""

from __future__ import annotations

import pytest

from enginesim.kvpool import BlockPool, chain_hashes


def test_allocate_release_counts() -> None:
    pool = BlockPool(8, 16)
    a = pool.allocate(5)
    assert pool.num_used == 5 and pool.num_free == 3
    with pytest.raises(ValueError):
        pool.allocate(4)
    pool.release(a)
    assert pool.num_used == 0 and pool.num_free == 8
    pool.check()


def test_double_release_is_an_error() -> None:
    pool = BlockPool(4, 16)
    a = pool.allocate(1)
    pool.release(a)
    with pytest.raises(ValueError):
        pool.release(a)


def test_chain_hash_depends_on_whole_prefix() -> None:
    a = chain_hashes(list(range(64)), 16)
    b = chain_hashes([99] + list(range(1, 64)), 16)
    assert len(a) == 4
    assert all(x != y for x, y in zip(a, b, strict=True))  # a change in block 0 changes every hash
    assert chain_hashes(list(range(40)), 16) == a[:2]  # partial blocks are not hashed


def test_cached_blocks_are_free_and_revived_by_a_hit() -> None:
    pool = BlockPool(8, 16)
    hashes = chain_hashes(list(range(48)), 16)
    blocks = pool.allocate(3)
    for b, h in zip(blocks, hashes, strict=True):
        pool.register(b, h)
    pool.release(blocks)
    assert pool.num_free == 8 and pool.num_cached_free == 3
    hit = pool.match_prefix(hashes)
    assert hit == blocks
    pool.acquire(hit)
    assert pool.num_used == 3 and pool.num_cached_free == 0
    pool.acquire(hit)  # a second sequence shares them
    pool.release(hit)
    assert pool.num_used == 3
    pool.release(hit)
    assert pool.num_used == 0
    pool.check()


def test_eviction_is_lru_and_drops_the_hash() -> None:
    pool = BlockPool(4, 16)
    old = pool.allocate(2)
    new = pool.allocate(2)
    hs = chain_hashes(list(range(64)), 16)
    for b, h in zip(old + new, hs, strict=True):
        pool.register(b, h)
    pool.release(old)  # freed first: evicted first
    pool.release(new)
    taken = pool.allocate(2)
    assert set(taken) == set(old)
    assert pool.match_prefix(hs[:2]) == []  # evicted content is no longer a hit
    assert pool.num_cached_free == 2
    pool.check()


def test_caching_disabled_never_hits() -> None:
    pool = BlockPool(4, 16, enable_caching=False)
    b = pool.allocate(1)
    h = chain_hashes(list(range(16)), 16)
    pool.register(b[0], h[0])
    pool.release(b)
    assert pool.match_prefix(h) == [] and pool.num_cached_free == 0
