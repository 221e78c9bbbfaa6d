"""Shared prompt prefixes in a replica's KV ledger (sans-IO).

An engine with prefix caching (vLLM's, SGLang's radix cache) holds one copy of the KV of
a prompt prefix that several running requests share: the second request of a tenant's
agent, with the same system prompt and tool schemas, references the blocks the first
one computed and allocates only its own suffix. A ledger that reserves every request's
whole prompt counts that prefix once per request and turns away work the engine has room
for: with 3,000 shared tokens and 8 requests of one tenant on a replica, it counts
21,000 tokens the engine does not hold.

`SharedPrefixes` is the ledger's record of the prefixes running requests pin on one
replica, by the prompt's block hash chain (`routing.prefix.block_hashes`: each hash
names the whole prefix up to its block). Per pinned hash: how many reservations pin it
and since when its KV is there to share. A reservation that pins a chain holds its own
need less what it pins (its *private* part); each pinned block is counted once, at a
fixed whole number of tokens, while anything pins it. So the replica's reservations total

    sum of private parts + pinned blocks x worth

which is at least what the engine holds as long as a block's worth is at most the
tokens it really holds (the gateway passes a lower bound, `AdmissionRequest
.prefix_block_tokens`) and each request pays back the partial blocks at the edge of
what it shares (`margin`): an engine shares whole blocks of its own block size only.

Only KV that exists is shared. vLLM registers a block for reuse once it is computed, so
a request admitted while another is still prefilling the same prefix computes its own
copy. A newly pinned block is therefore shared only from ``ready_at`` on (its pinner's
admission plus a margin over its predicted prefill: the controller's `_settle_time`);
until then a newcomer pins only the part that is ready, and pays for the rest of its
prompt as its own copy. ``ready_at`` never decreases
along a chain, and a pinned block's parent is pinned (each pinner pins a chain from its
root), so "pinned and ready" holds for a leading run of any chain: `shareable` finds its
end by bisection, in O(log n) lookups.
"""

from __future__ import annotations

from collections.abc import Sequence


class SharedPrefixes:
    """The prefixes pinned on one replica: ``hash -> [pins, ready_at]``."""

    __slots__ = ("_pins", "worth")

    def __init__(self) -> None:
        self._pins: dict[int, list[float]] = {}
        # Whole tokens each pinned block counts for; fixed while anything is pinned
        # (blocks are added and removed at one worth), set by the first pin of an empty
        # record.
        self.worth = 0

    def __len__(self) -> int:
        return len(self._pins)

    @property
    def tokens(self) -> int:
        """What the pinned blocks add to the ledger: each counted once."""
        return len(self._pins) * self.worth

    def shareable(self, hashes: Sequence[int], now: float) -> int:
        """Leading blocks of `hashes` pinned here whose KV is there to share at `now`."""
        pins = self._pins
        n = len(hashes)
        if not n:
            return 0
        p = pins.get(hashes[0])
        if p is None or p[1] > now:  # the common miss: another tenant's prompt
            return 0
        p = pins.get(hashes[-1])
        if p is not None and p[1] <= now:  # the whole chain
            return n
        lo, hi = 1, n - 1  # invariant: the first `lo` blocks are shareable
        while lo < hi:
            mid = (lo + hi + 1) // 2
            p = pins.get(hashes[mid - 1])
            if p is not None and p[1] <= now:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def pinned_depth(self, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` pinned here, shareable yet or not."""
        pins = self._pins
        lo, hi = 0, len(hashes)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in pins:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def credit(self, shared_blocks: int, block_tokens: int, margin: int) -> int:
        """Tokens a request that shares `shared_blocks` leading blocks need not reserve:
        those blocks at the lower of the record's worth and the request's own bound,
        less `margin` (the partial blocks at the edge of what is shared)."""
        if shared_blocks <= 0 or block_tokens <= 0 or not self._pins:
            return 0
        return max(0, shared_blocks * min(self.worth, block_tokens) - margin)

    def pin(
        self,
        hashes: Sequence[int],
        shared: int,
        block_tokens: int,
        ready_at: float,
        budget: int,
    ) -> tuple[tuple[int, ...], int]:
        """Pin the chain of a request admitted here that shares its first `shared` blocks.

        It pins those, and when nothing beyond them is pinned (no copy still being
        computed by another request) the rest of its chain too, which later requests may
        share from `ready_at` on, as far as the new blocks' tokens stay within `budget`
        (what the request reserves: its pinned blocks are part of it). Returns the
        hashes pinned (to `unpin` at its release) and the tokens the new blocks add."""
        pins = self._pins
        if not pins:
            self.worth = max(0, block_tokens)
        worth = self.worth
        if worth <= 0:
            return (), 0
        upto = shared
        if block_tokens >= worth and self.pinned_depth(hashes) == shared:
            upto = min(len(hashes), shared + max(0, budget) // worth)
        if upto <= 0:
            return (), 0
        ready = ready_at
        if shared:
            ready = max(ready, pins[hashes[shared - 1]][1])
        before = len(pins)
        for h in hashes[:shared]:  # pinned already
            pins[h][0] += 1
        for h in hashes[shared:upto]:  # not pinned (the chain beyond is not either)
            p = pins.get(h)
            if p is None:
                pins[h] = [1, ready]
            else:  # a repeated hash within one chain
                p[0] += 1
        return tuple(hashes[:upto]), (len(pins) - before) * worth

    def unpin(self, pinned: Sequence[int]) -> int:
        """Release one reservation's pins; returns the tokens the record shrank by."""
        pins = self._pins
        before = len(pins)
        for h in pinned:
            p = pins[h]
            if p[0] <= 1:
                del pins[h]
            else:
                p[0] -= 1
        return (before - len(pins)) * self.worth
