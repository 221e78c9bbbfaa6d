"""Which ceiling binds a request that cannot be admitted now (sans-IO).

A shed request is told why it waits (`gateway.denials` words it): a replica at its KV
pool and one at its running limit call for different remedies (a shorter request fits
the first; only time helps the second), and a running limit kvgate learned is not the
pool being full. Read from the model's ready replicas at the moment of the shed:

- ``kv_pool`` / ``kv_share``: no replica has the request's KV need free, in its pool or
  in this process's leased slice of it (several gateway processes);
- ``running_learned`` / ``running_cap`` / ``running_share``: the KV need fits somewhere,
  but every such replica runs as many requests as it may: the limit kvgate learned, the
  configured or engine's cap, or this process's leased share of the cap;
- ``running_deadlines``: the same, where what binds is the requests it runs, one of which
  one more would slow past its client's deadline (admission/room.py);
- ``tenant_concurrency``: the tenant runs as many requests as it may;
- ``queue``: a replica has room, but the queue ahead of the request is longer than it can
  wait for;
- ``no_replica``: no replica serving the model is ready.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from admission.replica import Replica


def _running_bound(r: Replica, room: Callable[[Replica], float]) -> str | None:
    """The running ceiling `r` is at, or None when it may run one more."""
    allowed = r.allowed
    if allowed is None or r.running < allowed:
        return "running_deadlines" if r.whole_running + 1 > room(r) else None
    learned = None if r.limit is None else r.limit.allowed(r.cap)
    own = r.cap if learned is None else learned
    if r.share_running is not None and (own is None or r.share_running < own):
        return "running_share"
    if learned is not None and (r.cap is None or learned < r.cap):
        return "running_learned"
    return "running_cap"


def binding_ceiling(
    replicas: Iterable[Replica],
    raw: int,
    tenant_capped: bool,
    room: Callable[[Replica], float],
) -> str:
    """The ceiling that keeps a request of `raw` KV tokens from `replicas` (the model's).

    `room(r)` is `r`'s deadline room now (`Ledger.peek_room`): a replica the placement
    walk before the shed did not reach holds a room worked out at an earlier time.
    """
    if tenant_capped:
        return "tenant_concurrency"
    usable = [r for r in replicas if r.usable]
    if not usable:
        return "no_replica"
    running: list[str] = []
    for r in usable:
        if r.free >= r.need(raw):
            bound = _running_bound(r, room)
            if bound is None:
                return "queue"
            running.append(bound)
    if running:  # the KV need fits, the running limit does not: the most common reason
        return max(set(running), key=running.count)
    sliced = any(
        r.share_tokens is not None and r.share_tokens < r.effective
        and r.room_beyond_slice >= r.need(raw)
        for r in usable
    )  # fmt: skip
    return "kv_share" if sliced else "kv_pool"
