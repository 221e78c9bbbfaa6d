"""The precise prefix index: per replica, the blocks its engine says it holds, from the
engine's own KV events (routing.kvevents), so a block the engine evicted is gone from
the index and a restarted engine starts empty.

Keys. The engine names a block by its own hash (vLLM: sha256 or its builtin hash, seeded
per process), which kvgate cannot recompute. Every ``BlockStored`` carries the blocks'
token ids and the parent's hash, so the index maps each engine hash to kvgate's own
chain: xxh3-64 of the block's token ids (little-endian uint32), seeded with the parent
block's own hash (0 at the root) - the same chain `token_block_hashes` computes for a
prompt's token ids. A block whose parent the index never saw (stored before the
subscription began) cannot be chained and is left out; so are blocks keyed by more than
their tokens (LoRA, media, cache salt) and blocks of another medium than the GPU pool.

Order. Messages carry sequence numbers. The next one is applied; one ahead of it is a
gap (`apply` answers GAP and applies nothing: the gateway asks the engine's replay
socket for the missing ones, else `resync` starts over from that message); one at or
behind the last applied, outside a replay, is an engine that restarted: everything is
dropped and the message applied. A replica whose engine served prompts
(``prefix_cache_queries_total`` moved) while no event came for ``stale_after_s`` is not
trusted (`usable`): the scorer falls back to the approximate index, and the gateway
subscribes again.
"""

from __future__ import annotations

from array import array
from collections.abc import Container, Iterable, Sequence

import xxhash

from routing.holders import Holders, drop_holder, held_length
from routing.kvevents import Cleared, Event, Removed, Stored

_xxh = xxhash.xxh3_64_intdigest

APPLIED, GAP, DUPLICATE, RESTARTED = "applied", "gap", "duplicate", "restarted"
_POOL_MEDIA = (None, "GPU", "gpu")


def token_block_hashes(
    token_ids: Sequence[int], block_size: int, max_blocks: int = 4096
) -> tuple[int, ...]:
    """kvgate's chain over the full blocks of `token_ids` (module docstring, Keys)."""
    if block_size <= 0:
        return ()
    n = min(len(token_ids) // block_size, max_blocks)
    data = memoryview(array("I", token_ids[: n * block_size]).tobytes())
    step = 4 * block_size
    out = []
    parent = 0
    for i in range(0, n * step, step):
        parent = _xxh(data[i : i + step], parent)
        out.append(parent)
    return tuple(out)


class EngineBlocks:
    """What one replica's engine holds, as its events say (module docstring)."""

    __slots__ = (
        "name", "block_size", "_own", "_held", "_holders", "last_seq", "last_event_at",
        "queries_at_event", "stale_after_s", "events", "gaps", "restarts", "resyncs",
        "unchained", "_replayed", "_owner", "_up", "_kids", "orphans",
    )  # fmt: skip

    def __init__(
        self,
        name: str,
        holders: Holders | None = None,
        stale_after_s: float = 10.0,
        owner: KVIndex | None = None,
    ) -> None:
        self.name = name
        self._owner = owner  # its version moves with every change here
        self.block_size: int | None = None
        self._own: dict[bytes | int, int] = {}  # engine hash -> kvgate's chain hash
        self._held: dict[int, int] = {}  # chain hash -> engine blocks that carry it
        # Each held chain hash's parent (0: the root), the held children of each, and
        # how many held blocks have a parent not held (a hole: an evicted parent). With
        # none, what this replica holds of any chain is its first blocks, and a match
        # is a bisection (`KVIndex.depths`).
        self._up: dict[int, int] = {}
        self._kids: dict[int, int] = {}
        self.orphans = 0
        self._holders = holders
        self.last_seq: int | None = None
        self.last_event_at: float | None = None
        self.queries_at_event: float | None = None
        self.stale_after_s = stale_after_s
        self.events = self.gaps = self.restarts = self.resyncs = self.unchained = 0
        # Sequence numbers a replay applied: their live copies, queued on the SUB socket
        # while the replay ran, are duplicates, not a restarted engine.
        self._replayed: set[int] = set()

    def __len__(self) -> int:
        return len(self._held)

    def chain_hashes(self) -> set[int]:
        return set(self._held)

    # ---------------------------------------------------------------- events
    def apply(
        self,
        seq: int,
        events: Iterable[Event],
        now: float,
        *,
        replay: bool = False,
        queries_total: float | None = None,
    ) -> str:
        """Apply one message in sequence (module docstring, Order)."""
        last = self.last_seq
        if last is not None:
            if seq <= last:
                if replay:
                    return DUPLICATE
                if seq in self._replayed:
                    self._replayed.discard(seq)
                    return DUPLICATE
                self.clear()
                self.restarts += 1
                result = RESTARTED
            elif seq > last + 1:
                self.gaps += 1
                return GAP
            else:
                result = APPLIED
        else:
            result = APPLIED
        if replay:
            self._replayed.add(seq)
        elif self._replayed:
            self._replayed.clear()  # live and in order again: no copy of a replay is left
        self.last_seq = seq
        self.last_event_at = now
        self.queries_at_event = queries_total
        if self._owner is not None:
            self._owner.version += 1
        for ev in events:
            self.events += 1
            if isinstance(ev, Stored):
                self._stored(ev)
            elif isinstance(ev, Removed):
                self._removed(ev.hashes, ev.medium)
            elif isinstance(ev, Cleared):
                self.clear()
        return result

    def resync(self, seq: int, events: Iterable[Event], now: float) -> None:
        """The missing messages cannot be had: start over from this one."""
        self.clear()
        self.resyncs += 1
        self.last_seq = None
        self.apply(seq, events, now)

    def _stored(self, ev: Stored) -> None:
        if ev.medium not in _POOL_MEDIA or ev.keyed or ev.block_size <= 0:
            return
        self.block_size = ev.block_size
        if ev.parent is None:
            parent = 0
        else:
            got = self._own.get(ev.parent)
            if got is None:  # stored before we listened: the chain cannot be named
                self.unchained += len(ev.hashes)
                return
            parent = got
        step = 4 * ev.block_size
        full = min(len(ev.hashes), len(ev.token_ids) // ev.block_size)
        data = memoryview(array("I", ev.token_ids[: full * ev.block_size]).tobytes())
        own, held, holders = self._own, self._held, self._holders
        ups, kids = self._up, self._kids
        for i in range(full):
            h = ev.hashes[i]
            up = parent
            parent = _xxh(data[i * step : (i + 1) * step], up)
            old = own.get(h)
            if old == parent:
                continue
            if old is not None:
                self._drop(old)
            own[h] = parent
            n = held.get(parent, 0)
            held[parent] = n + 1
            if n:
                continue
            if holders is not None:
                holders[parent] = holders.get(parent, ()) + (self.name,)
            ups[parent] = up  # a new block: its place in the chain, for holes
            if up:
                kids[up] = kids.get(up, 0) + 1
                if up not in held:
                    self.orphans += 1
            if parent in kids:  # its held children have their parent again
                self.orphans -= kids[parent]

    def _removed(self, hashes: Iterable[bytes | int], medium: str | None) -> None:
        if medium not in _POOL_MEDIA:
            return
        for h in hashes:
            own = self._own.pop(h, None)
            if own is not None:
                self._drop(own)

    def _drop(self, own: int) -> None:
        n = self._held.get(own, 0) - 1
        if n > 0:
            self._held[own] = n
            return
        held = self._held
        held.pop(own, None)
        if self._holders is not None:
            drop_holder(self._holders, own, self.name)
        kids = self._kids
        if own in kids:  # its held children lose their parent
            self.orphans += kids[own]
        up = self._up.pop(own, 0)
        if up:
            left = kids.get(up, 0) - 1
            if left > 0:
                kids[up] = left
            else:
                kids.pop(up, None)
            if up not in held:
                self.orphans -= 1  # it was one of those itself

    def clear(self) -> None:
        if self._owner is not None:
            self._owner.version += 1
        self._replayed.clear()
        for own in list(self._held):
            self._held[own] = 1
            self._drop(own)
        self._own.clear()
        self._up.clear()
        self._kids.clear()
        self.orphans = 0

    # ---------------------------------------------------------------- reads
    def match(self, chain: Sequence[int]) -> int:
        """Leading blocks of `chain` the engine holds; the walk stops at the first miss."""
        held = self._held
        for i, h in enumerate(chain):
            if h not in held:
                return i
        return len(chain)

    def match_with(self, chain: Sequence[int], start: int, also: Container[int]) -> int:
        """`match`, the walk going on from `start` through blocks held or in `also`."""
        held = self._held
        n = len(chain)
        i = start
        while i < n and (chain[i] in held or chain[i] in also):
            i += 1
        return i

    def silent(self, now: float, queries_total: float | None) -> bool:
        """No event for ``stale_after_s`` while the engine served prompts (its prefix-cache
        query counter rose): a subscription to renew. A restart is not one (its counter
        starts over lower): ZMQ reconnects by itself and the sequence starting over
        clears the index, where a socket renewed as the new engine came up lost its
        first messages, and the index their blocks."""
        if self.last_event_at is None or now - self.last_event_at <= self.stale_after_s:
            return False
        seen = self.queries_at_event
        return queries_total is not None and seen is not None and queries_total > seen

    def usable(self, now: float, queries_total: float | None) -> bool:
        """Subscribed, and not silent while its engine served prompts (module docstring)."""
        if self.last_seq is None or self.last_event_at is None:
            return False
        seen = self.queries_at_event
        if queries_total is not None and seen is not None and queries_total < seen:
            return False  # the engine's counters started over: it restarted
        if now - self.last_event_at <= self.stale_after_s:
            return True
        return queries_total is None or seen is None or queries_total <= seen


class KVIndex:
    """The precise index of every replica whose engine publishes KV events, and, per
    chain hash, the replicas holding it (for the scorer's hints)."""

    def __init__(self, stale_after_s: float = 10.0) -> None:
        self.stale_after_s = stale_after_s
        self.holders: Holders = {}
        self._replicas: dict[str, EngineBlocks] = {}
        # Moves with every applied message and every clear: a reader that memoizes a
        # match (the prefix scorer, per request) knows when to walk again.
        self.version = 0

    def replica(self, name: str) -> EngineBlocks:
        got = self._replicas.get(name)
        if got is None:
            got = self._replicas[name] = EngineBlocks(name, self.holders, self.stale_after_s, self)
        return got

    def depths(self, chain: Sequence[int]) -> dict[str, int]:
        """Leading blocks of `chain` each replica's engine holds, for every replica that
        holds its first block (absent: 0), as `EngineBlocks.match` gives each. A replica
        without holes (`EngineBlocks.orphans`) holds a chain's first blocks only, so its
        depth is a bisection (log n probes: a long agentic prompt's 2,000 blocks cost
        11, not 2,000); one with holes is walked to its first miss."""
        n = len(chain)
        alive = self.holders.get(chain[0]) if n else None
        if not alive:
            return {}
        out: dict[str, int] = {}
        last = chain[n - 1]
        replicas = self._replicas
        depth = 0  # the last depth a bisection found (0: none yet)
        for name in alive:
            r = replicas[name]
            if r.orphans:
                out[name] = r.match(chain)
                continue
            held = r._held
            if last in held:
                out[name] = n
                continue
            # The holders of a prompt's root mostly stop at a few depths (a tenant's
            # shared system prompt, then each session's own turns): two probes confirm
            # the depth found last, where a bisection costs log n.
            if depth and chain[depth - 1] in held and chain[depth] not in held:
                out[name] = depth
                continue
            depth = out[name] = held_length(chain, held, 1, n - 1)  # chain[0] held, [-1] not
        return out

    def get(self, name: str) -> EngineBlocks | None:
        return self._replicas.get(name)

    def by_name(self) -> dict[str, EngineBlocks]:
        """Every replica's blocks by name (read-only: the scorers read it per decision)."""
        return self._replicas

    def names(self) -> list[str]:
        return list(self._replicas)

    def block_sizes(self, names: Iterable[str]) -> set[int]:
        """The block sizes the events of these replicas use (to hash a prompt once each)."""
        out = set()
        for n in names:
            r = self._replicas.get(n)
            if r is not None and r.block_size:
                out.add(r.block_size)
        return out
