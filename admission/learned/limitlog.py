"""What moved a replica's learned running limit, and on what evidence (sans-IO).

The limit moves on windows of completions and on the engine's own signals
(`admission/learned/limit.py`); its current value and last reason alone cannot tell an operator
why a replica runs 4 today where it ran 8 yesterday. Each change of the allowed count is
kept here with the evidence that made it, the last `HISTORY` of them per replica: the
gateway logs each one (`kvgate.limit`) and `/admin/replicas` lists them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

HISTORY = 16  # changes kept per replica
# The evidence of a change: what ran, the worst score over its aim, the window's completions.
Seen = tuple[float | None, float | None, int]


@dataclass(slots=True, frozen=True)
class LimitChange:
    """One change of the allowed count: `before` -> `after` at `at` (the loop's clock)."""

    seq: int  # 1, 2, ... per replica: what a reader has seen
    at: float
    before: int
    after: int
    reason: str
    # What ran: a window's mean running, the peak before a preemption, what the engine
    # ran while its queue waited (None: not measured, e.g. a limit adopted from a peer).
    running: float | None = None
    # A window's worst latency score over its aim (1.0: at the aim; None: no window).
    score: float | None = None
    completions: int = 0  # in the window that decided it (0: an engine signal)

    def describe(self) -> str:
        """One line for the log: the change and the evidence that made it."""
        parts = [f"limit {self.before} -> {self.after} ({self.reason})"]
        if self.completions:
            parts.append(f"window of {self.completions} completions")
        if self.score is not None:
            parts.append(f"slowest at {self.score:.2f}x its aim")
        if self.running is not None:
            parts.append(f"{self.running:.1f} running")
        return ", ".join(parts)

    def fields(self) -> dict[str, object]:
        """The change as log or JSON fields (times left to the reader's clock)."""
        return {
            "limit_before": self.before,
            "limit_after": self.after,
            "reason": self.reason,
            "running": None if self.running is None else round(self.running, 2),
            "score": None if self.score is None else round(self.score, 3),
            "completions": self.completions,
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
        before: int,
        after: int,
        reason: str,
        running: float | None = None,
        score: float | None = None,
        completions: int = 0,
    ) -> None:
        """Keep a change of the allowed count (equal counts are not a change)."""
        if before == after:
            return
        self.count += 1
        self.changes.append(
            LimitChange(self.count, at, before, after, reason, running, score, completions)
        )

    def since(self, seq: int) -> list[LimitChange]:
        """The changes numbered after `seq` that are still kept."""
        return [c for c in self.changes if c.seq > seq]
