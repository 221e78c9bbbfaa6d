"""The pool check: a replica's configured pool held against its engine's own KV usage.

The engine holds at most what the gateway fleet reserved there (this process's
reservations and what the other processes sharing it reported), so its pool is at most
``reserved / usage``: this process alone would read the others' load as foreign and cut
its view of the pool (two processes each cut it to about half). When that bound stays
below 90% of the configured pool for two discovery rounds, the pool is overstated (a
wrong pin, or other clients on the engine) and the bound is used instead. Without fresh
confirmation for ``POOL_MEMORY_S`` the configured pool is trusted again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

POOL_MEMORY_S = 300.0  # how long a pool measured smaller than configured is kept
# A usage below this share says too little of the pool to bound it (at low usage one
# request's rounding moves the bound far).
_READABLE_USAGE = 0.5
_OVERSTATED = 0.9  # a bound under this share of the configured pool says it is overstated
_ROUNDS = 2  # discovery rounds in a row that must show it: one reading may be mid-change


@dataclass(slots=True)
class PoolCheck:
    """The pool a replica's KV usage shows, when smaller than the configured one."""

    bound: int | None = None  # in tokens; None: the configured pool stands
    rounds_below: int = 0  # discovery rounds in a row that showed it below
    confirmed_at: float = 0.0  # when a round last confirmed it

    def observe(
        self, capacity: int, reserved: int, others_reserved: int, kv_usage: float, now: float
    ) -> None:
        """One discovery round's KV usage, with what this process (`reserved`) and the
        others (`others_reserved`) hold there."""
        fleet = reserved + others_reserved
        if kv_usage >= _READABLE_USAGE and reserved > 0:
            bound = int(fleet / kv_usage)
            if bound < _OVERSTATED * capacity:
                self.rounds_below += 1
                if self.rounds_below >= _ROUNDS:
                    known = self.bound
                    self.bound = bound if known is None else min(known, bound)
                    self.confirmed_at = now
                return
        self.rounds_below = 0
        if self.bound is not None and now - self.confirmed_at > POOL_MEMORY_S:
            self.bound = None

    def pool(self, capacity: int, headroom: float) -> int:
        """The pool to admit into: the configured one (0: unknown), or the measured bound
        less `headroom` where it is smaller. The headroom: the bound is itself an
        estimate (an upper bound, as the outputs reserved are not all generated yet)."""
        if capacity and self.bound is not None and self.bound < capacity:
            return math.floor(self.bound * (1.0 - headroom))
        return capacity
