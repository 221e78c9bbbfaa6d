"""Prefill waiting on each replica: the prompt tokens of requests placed there that have
not yet produced their first token, less what the replica was expected to hold cached.

It is the load a new prompt queues behind before its own prefill starts (Dynamo's
``active_prefill``): a cold first turn placed on a replica already prefilling three
others waits for them, however much KV headroom it has. A request leaves the count at
its first token (the relay sees it and the router's ``first_token`` hook says so) or at
its release, whichever comes first, so a request never counts twice or forever.
"""

from __future__ import annotations


class PendingPrefill:
    """Uncached prompt tokens per replica, by request, until each one's first token."""

    __slots__ = ("_by_request", "_by_replica")

    def __init__(self) -> None:
        self._by_request: dict[str, tuple[str, int]] = {}
        self._by_replica: dict[str, int] = {}

    def add(self, request_id: str, replica: str, tokens: int) -> None:
        self.done(request_id)  # a request placed again (a retry) counts where it went last
        tokens = max(0, tokens)
        self._by_request[request_id] = (replica, tokens)
        self._by_replica[replica] = self._by_replica.get(replica, 0) + tokens

    def done(self, request_id: str) -> None:
        """Its first token came (or it ended): its prefill no longer waits."""
        got = self._by_request.pop(request_id, None)
        if got is None:
            return
        replica, tokens = got
        left = self._by_replica.get(replica, 0) - tokens
        if left > 0:
            self._by_replica[replica] = left
        else:
            self._by_replica.pop(replica, None)

    def tokens(self, replica: str) -> int:
        return self._by_replica.get(replica, 0)

    def by_replica(self) -> dict[str, int]:
        """Pending tokens per replica with any (read-only: a scorer reads it per decision)."""
        return self._by_replica

    def requests(self) -> int:
        return len(self._by_request)


class PrefillBlocks:
    """The token blocks of prompts in prefill per replica: placed there and not yet
    through their first token. A replica's KV events say what its engine stored; a
    prompt being prefilled is not stored yet, and the next request of its tenant
    placed as if it were not there would go cold to another replica. The precise index
    counts these blocks as held on top of the engine's (routing.prefixmatch)."""

    __slots__ = ("_by_request", "_by_replica")

    def __init__(self) -> None:
        self._by_request: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._by_replica: dict[str, dict[int, int]] = {}  # chain hash -> prompts holding it

    def add(self, request_id: str, replica: str, chain: tuple[int, ...]) -> None:
        """`chain`: the prompt's blocks beyond those the engine already holds."""
        self.done(request_id)
        self._by_request[request_id] = (replica, chain)
        held = self._by_replica.get(replica)
        if held is None:
            held = self._by_replica[replica] = {}
        get = held.get  # a plain dict and a loop: a Counter's construction and update
        for h in chain:  # cost more than the counting, on the decision's path
            held[h] = get(h, 0) + 1

    def done(self, request_id: str) -> bool:
        """Its first token came (or it ended); True if it was counted."""
        got = self._by_request.pop(request_id, None)
        if got is None:
            return False
        replica, chain = got
        held = self._by_replica[replica]
        for h in chain:
            n = held[h] - 1
            if n:
                held[h] = n
            else:
                del held[h]
        if not held:
            del self._by_replica[replica]
        return True

    def of(self, replica: str) -> dict[int, int] | None:
        """The chain hashes in prefill on `replica` (None: none)."""
        return self._by_replica.get(replica)

    def by_replica(self) -> dict[str, dict[int, int]]:
        """`of` for every replica with any (read-only: read per decision)."""
        return self._by_replica
