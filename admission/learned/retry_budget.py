"""How many times clients that do not say try a request, learned from which unserved
requests come back (sans-IO).

The openai SDKs say which retry an attempt is (``x-stainless-retry-count``; kvgate takes
their default of two retries as the budget) and their last one queues ahead of first
attempts (admission/settling.py). Other clients that retry (an HTTP client in a retry
loop, a batch script) say nothing, and their last attempt, shed like any other, is a
request lost: on the real vLLM the plain client's failures were requests shed on their
third attempt (scripts/REAL_ENGINE_NOTES.md), in virtual time requests that timed out in
the first wave's queue and were shed on both retries.

`admission.retries.RetryMemory` counts a request's *unserved* attempts (shed, or its
client left before an answer began) and sees what became of each: the request came back
after its ``n``-th (its client tries past ``n``), or it was not back in time (its client
gave up after ``n``). Per tenant, the budget is the smallest ``n`` at which at least
``MIN_GAVE_UP`` of the recent outcomes (``WINDOW``) gave up and they are at least
``GAVE_UP_SHARE`` of that ``n``'s outcomes; an attempt after ``n - 1`` unserved ones is
then its client's last. A share, not every one: a client whose attempt failed otherwise
(an engine error it retried) spent an attempt the memory never saw.

Cold start: ``PRIOR``, the openai SDKs' default of two retries (and tenacity's
``stop_after_attempt(3)``'s), as kvgate reads an SDK's count, until the clients say
otherwise: ``MIN_GAVE_UP`` of them back after that many drop it. Learning it only from
departures would lose ``MIN_GAVE_UP`` requests first. A budget taken too low costs
little: a last attempt queues ahead of its tenant's first attempts, and the others keep
their first arrival anyway. A population that always comes back (retries without end)
shows no budget.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

WINDOW = 128  # recent outcomes per tenant
MIN_GAVE_UP = 3  # gave up after one count of unserved attempts, before it is a budget
GAVE_UP_SHARE = 0.8  # of that count's outcomes
PRIOR = 3  # unserved attempts, until the clients show another budget (module docstring)


@dataclass(slots=True, frozen=True)
class BudgetReading:
    """One tenant's learned budget, for metrics and /admin/replicas."""

    tenant: str
    attempts: int | None  # unserved attempts its clients give up after (None: none shown)
    came_back: int  # outcomes in the window: unserved and back
    gave_up: int  # unserved and never back


class RetryBudget:
    """Per tenant, the unserved attempts after which clients that say nothing give up."""

    __slots__ = ("_seen", "_budget")

    def __init__(self) -> None:
        self._seen: dict[str, deque[tuple[int, bool]]] = {}
        self._budget: dict[str, int | None] = {}

    def outcome(self, tenant: str, unserved: int, came_back: bool) -> None:
        """A request of `tenant` left unserved `unserved` times came back (or did not)."""
        seen = self._seen.get(tenant)
        if seen is None:
            seen = self._seen[tenant] = deque(maxlen=WINDOW)
        seen.append((unserved, came_back))
        self._budget[tenant] = _budget(seen)

    def attempts(self, tenant: str) -> int | None:
        """Unserved attempts after which `tenant`'s clients give up (None: they show none)."""
        return self._budget.get(tenant, PRIOR)

    def is_last(self, tenant: str, unserved: int) -> bool:
        """Whether an attempt after `unserved` unserved ones is its client's last."""
        budget = self.attempts(tenant)
        return budget is not None and unserved + 1 >= budget

    def readings(self) -> list[BudgetReading]:
        out = []
        for tenant, seen in sorted(self._seen.items()):
            back = sum(1 for _, came_back in seen if came_back)
            out.append(BudgetReading(tenant, self.attempts(tenant), back, len(seen) - back))
        return out


def _budget(seen: deque[tuple[int, bool]]) -> int | None:
    """The smallest count of unserved attempts most of whose recent outcomes gave up;
    else the prior, while fewer than ``MIN_GAVE_UP`` came back after it."""
    back: dict[int, int] = {}
    gone: dict[int, int] = {}
    for unserved, came_back in seen:
        counts = back if came_back else gone
        counts[unserved] = counts.get(unserved, 0) + 1
    for unserved in sorted(gone):
        n = gone[unserved]
        if n >= MIN_GAVE_UP and n >= GAVE_UP_SHARE * (n + back.get(unserved, 0)):
            return unserved
    beyond = sum(n for unserved, n in back.items() if unserved >= PRIOR)
    return PRIOR if beyond < MIN_GAVE_UP else None
