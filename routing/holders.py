"""What the prefix indexes share (routing.prefix, routing.kvindex): the inverted index (a
block hash -> the replicas holding it, so a request's chain is walked once for every
replica, routing.prefixmatch, rather than once per replica), and the bisection of a
chain whose held blocks are its first ones."""

from __future__ import annotations

from collections.abc import Container, Sequence

Holders = dict[int, tuple[str, ...]]


def drop_holder(holders: Holders, block: int, name: str) -> None:
    """`name` no longer holds `block`; a block nobody holds leaves the index."""
    left = tuple(r for r in holders.get(block, ()) if r != name)
    if left:
        holders[block] = left
    else:
        holders.pop(block, None)


def held_length(chain: Sequence[int], held: Container[int], lo: int, hi: int) -> int:
    """How many of `chain`'s first blocks are in `held`, where chain[:lo] is known held,
    chain[hi:] known not, and the held blocks are a prefix of it (a bisection)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if chain[mid] in held:
            lo = mid + 1
        else:
            hi = mid
    return lo
