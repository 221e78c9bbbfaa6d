"""Shared leases, the pure part: what a process asks for and is granted, and the
arithmetic that decides it (`grant`). The backends that keep the records live in the
gateway (`gateway.state`): `MemoryBackend` calls `grant`, ``gateway/state/lease.lua`` is
the same arithmetic for Redis, and the contract tests run both.

Policy (the reasons: docs/shared-state.md): a holder counts as holding the larger of its grant
and its reported use, since a slice cannot be taken back from requests already running
on it. Entitlements are max-min fair (water-filling): holders are taken in order of want
(then of what each holds, most first, then name), and each is entitled to the smaller of its want and an equal split of what
the earlier ones left. So a holder that wants little gets it all, the rest share the
remainder equally, and when every want fits, each gets its want. The grant is the
entitlement within what the others do not hold, so the sum over holders never exceeds
the total; a holder above its entitlement shrinks on its own next renewal, and the
others then grow into what it freed. A rate-limited holder also gets a refill `rate`:
what it spent and has not refilled is its use, which the others are not granted, and it
refills at the larger of its entitlement and that use (within what the others hold).

Heads: an equal split smaller than every holder's next request starts none of them
while the pool stands idle (docs/benchmarks-fleet.md). So a holder may name its *head*,
the one request it most needs started there (its size, and its deadline on the
backend's clock). When the wants exceed the total and a head is named, the heads are
dealt first, whole, the earliest deadline first, while each fits what is left, and what
is left is water-filled over the wants less the heads dealt. Without a head that fits,
the water-filling above. Heads come before the split, not after each holder's use: a
holder that kept its use first would leave a process that restarted beside it only
its heads.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LeaseRequest:
    """Ask for a slice of `resource` (e.g. ``pool:r0``), whose whole is `total`; the process
    holds `used` of it now and wants `want`."""

    resource: str
    total: int
    want: int
    used: int
    # The request this process has queued longest-due among those it asks of `resource`
    # (0: none), in the resource's units, and the seconds left to its deadline
    # (`grant`'s heads).
    head: int = 0
    slack: float = math.inf


@dataclass(frozen=True, slots=True)
class Lease:
    """The slice granted, how many processes hold `resource`, and what the others use."""

    resource: str
    granted: int
    holders: int
    others_used: int
    # A rate-limited holder's refill slice (lease.grant): at least `granted`, more while
    # it has spent more than its grant.
    rate: int = -1

    def refill(self) -> int:
        return self.granted if self.rate < 0 else self.rate


@dataclass(frozen=True, slots=True)
class RenewResult:
    processes: int  # processes alive (heartbeat within the TTL), this one included
    leases: list[Lease]
    # The backend still held this process's heartbeat from its last renewal: False on a
    # first renewal, and where the backend lost its records since (a Redis restarted
    # empty, a failover to a replica that had not received them).
    known: bool = True


@dataclass(frozen=True, slots=True)
class PoolShare:
    """What this process may hold of a replica when several share it: `tokens` of its
    pool and `running` requests (None: no cap), and what the others hold there."""

    replica: str
    tokens: int | None
    running: int | None = None
    others_running: int = 0
    others_tokens: int = 0


@dataclass(frozen=True, slots=True)
class HolderRecord:
    granted: int
    want: int
    used: int
    expires_in_s: float


@dataclass(frozen=True, slots=True)
class SharedLimit:
    value: float
    version: int
    reason: str


@dataclass(frozen=True, slots=True)
class SharedPatience:
    """A population's client patience as the process that learned it last published it
    (admission/learned/patience.py)."""

    seconds: float
    whole: bool
    version: int


def grant(
    total: int,
    want: int,
    others: Iterable[tuple[str, int, int, int]],
    holder: str = "",
    used: int = 0,
    granted: int = 0,
    heads: Mapping[str, tuple[int, float]] | None = None,
) -> tuple[int, int, int, int]:
    """(granted, holders, others_used, rate) for `holder` wanting `want` of `total` and
    using `used` (and granted `granted` at its last renewal) while the other live holders
    hold ``(name, granted, want, used)`` each; `heads`: by holder (this one included), the
    head each names, ``(size, deadline)`` (module docstring).

    `rate` is the slice at which a rate-limited holder's spent budget refills: the
    larger of its entitlement and its use, within what the others do not hold. A holder
    whose grant fell below what it spent admits nothing new until it is back within the
    grant, while its spent cells refill at the rate they were granted at, and the others
    grow into what refills; without it the spent cells would refill at the smaller
    grant's rate and the budget would go partly unused meanwhile."""
    total = max(0, total)
    want = max(0, want)
    used = max(0, used)
    held = 0
    used_sum = 0
    # Equal wants are ordered by what each holds, most first: the rounding of an equal
    # split gives its larger parts to those holding least, so a limit smaller than the
    # number of holders turns among them instead of starving the same one (then by name).
    wants: list[tuple[int, int, str]] = [(want, -max(granted, used), holder)]
    wanted = want
    for name, g, w, u in others:
        w = max(w, u)
        held += max(g, u)
        used_sum += u
        wanted += w
        wants.append((w, -max(g, u), name))
    n = len(wants)
    if wanted <= total:
        # Every want fits: each is entitled to its own, and the rest is split equally.
        # Taken in order of want, what remains before the k-th of n is the total less
        # the wants before it, at least the wants from the k-th on, so at least
        # (n - k + 1) times the k-th's: the equal split never binds, whatever the order.
        entitled = want + (total - wanted) // n
    else:
        wants.sort()
        remaining = total
        entitled = 0
        for i, (w, neg_used, name) in enumerate(wants):
            share = min(w, remaining // (n - i))
            remaining -= share
            if name == holder and w == want and -neg_used == max(granted, used):
                entitled = share
        entitled += remaining // n  # what nobody wants, split equally
        if heads and (dealt := _heads_first(total, wants, holder, heads)) is not None:
            entitled = dealt
    free = total - held
    return max(0, min(entitled, free)), n, used_sum, max(0, min(max(entitled, used), free))


def _heads_first(
    total: int,
    wants: list[tuple[int, int, str]],
    holder: str,
    heads: Mapping[str, tuple[int, float]],
) -> int | None:
    """`holder`'s entitlement by heads (module docstring), or None where no live holder's
    head fits the total. `wants`: ``(want, _, name)`` per live holder."""
    live = {name for _, _, name in wants}
    rest = total
    dealt: dict[str, int] = {}
    for _due, name, size in sorted((d, n, s) for n, (s, d) in heads.items() if n in live):
        if 0 < size <= rest:
            dealt[name] = size
            rest -= size
    if not dealt:
        return None
    beyond = sorted((max(0, w - dealt.get(name, 0)), name) for w, _, name in wants)
    n = len(beyond)
    mine = 0
    for i, (w, name) in enumerate(beyond):
        share = min(w, rest // (n - i))
        rest -= share
        if name == holder:
            mine = share
    return dealt.get(holder, 0) + mine + rest // n
