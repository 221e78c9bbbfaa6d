"""What the admission rule let a replica run, and what bound it (sans-IO).

The rule (docs/admission.md) bounds a replica by its KV pool; a count binds only where a
cap is configured or reported (``cap``), where this process holds a leased share of it
(``share``), or where one more running request would be predicted to make a running one
miss its client's deadline (``deadline``, admission/room.py). Each change of that count
(None: only the pool bounds it, reason ``kv``) is kept here with what ran, the last
`HISTORY` of them per replica: the gateway logs each one (`kvgate.limit`) and
`/admin/replicas` lists them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

HISTORY = 16  # changes kept per replica


@dataclass(slots=True, frozen=True)
class LimitChange:
    """One change of the allowed count: `before` -> `after` at `at` (the loop's clock);
    None: no count, only the pool bounds the replica."""

    seq: int  # 1, 2, ... per replica: what a reader has seen
    at: float
    before: int | None
    after: int | None
    reason: str  # what binds from `at` on: kv | cap | share | deadline
    running: float | None = None  # what ran then (None: not measured)

    def describe(self) -> str:
        """One line for the log: the change and what ran."""
        before = "pool" if self.before is None else self.before
        after = "pool" if self.after is None else self.after
        parts = [f"limit {before} -> {after} ({self.reason})"]
        if self.running is not None:
            parts.append(f"{self.running:.0f} running")
        return ", ".join(parts)

    def fields(self) -> dict[str, object]:
        """The change as log or JSON fields (times left to the reader's clock)."""
        return {
            "limit_before": self.before,
            "limit_after": self.after,
            "reason": self.reason,
            "running": None if self.running is None else round(self.running, 2),
        }


class LimitHistory:
    """The last `HISTORY` changes of one replica's limit, numbered."""

    __slots__ = ("changes", "count")

    def __init__(self) -> None:
        self.changes: deque[LimitChange] = deque(maxlen=HISTORY)
        self.count = 0

    def record(
        self,
        at: float,
        before: int | None,
        after: int | None,
        reason: str,
        running: float | None = None,
    ) -> None:
        """Keep a change of the allowed count (equal counts are not a change)."""
        if before == after:
            return
        self.count += 1
        self.changes.append(LimitChange(self.count, at, before, after, reason, running))

    def since(self, seq: int) -> list[LimitChange]:
        """The changes numbered after `seq` that are still kept."""
        return [c for c in self.changes if c.seq > seq]
