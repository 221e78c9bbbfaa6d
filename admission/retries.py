"""Retry memory: a shed request that comes back keeps its place in line (sans-IO).

Clients that honour Retry-After (the openai SDKs, batch clients) send the same request
again. Without memory each attempt queues as a newcomer, so under sustained overload the
order in which requests are served is a lottery among whoever retries at the right
moment: in seed 001's workload through kvgate at client concurrency 128, one request was
shed and retried for 24 simulated minutes while later arrivals got in. With memory, the
retry is admitted as of its first arrival: the queue is ordered by that arrival, so the
oldest waiting work goes first and shed-and-retry approximates one FIFO queue that lives
partly in the clients.

The gateway shell recognises a retry by a digest of (tenant, model, request body); the
memory maps it to the first attempt's arrival time. An identical request from the same
tenant that is not a retry inherits the earlier arrival too, which only moves it up
among that tenant's own requests; nobody can claim a place they did not queue for.
Entries expire `ttl_s` after they were last shed and the memory holds at most
`max_entries` (oldest dropped first), so it stays bounded under any load.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class RetryMemory:
    """First-arrival times of recently shed requests, bounded in time and size."""

    __slots__ = ("_entries", "_ttl", "_max")

    def __init__(self, ttl_s: float, max_entries: int) -> None:
        self._entries: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()
        self._ttl = ttl_s
        self._max = max_entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def enabled(self) -> bool:
        return self._ttl > 0 and self._max > 0

    def first_arrival(self, key: Hashable, now: float) -> float | None:
        """The first attempt's arrival if `key` was shed within the last `ttl_s`."""
        got = self._entries.get(key)
        if got is None:
            return None
        arrival, expires = got
        if expires <= now:
            del self._entries[key]
            return None
        return arrival

    def remember(self, key: Hashable, arrival: float, now: float) -> None:
        """Record that `key` (first seen at `arrival`) was shed at `now`."""
        if not self.enabled:
            return
        known = self._entries.pop(key, None)
        first = min(arrival, known[0]) if known is not None else arrival
        self._entries[key] = (first, now + self._ttl)  # newest expiry last
        while self._entries:
            oldest_key, (_, expires) = next(iter(self._entries.items()))
            if expires > now and len(self._entries) <= self._max:
                break
            del self._entries[oldest_key]

    def forget(self, key: Hashable) -> None:
        """The request got in: later identical requests are newcomers again."""
        self._entries.pop(key, None)
