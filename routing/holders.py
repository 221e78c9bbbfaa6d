"""The inverted index the prefix indexes share (routing.prefix, routing.kvindex): a block
hash -> the replicas holding it, so a request's chain is walked once for every replica
(routing.prefixmatch) rather than once per replica."""

from __future__ import annotations

Holders = dict[int, tuple[str, ...]]


def drop_holder(holders: Holders, block: int, name: str) -> None:
    """`name` no longer holds `block`; a block nobody holds leaves the index."""
    left = tuple(r for r in holders.get(block, ()) if r != name)
    if left:
        holders[block] = left
    else:
        holders.pop(block, None)
