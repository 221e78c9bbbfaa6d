"""Told waits: what clients do with the Retry-After they are told (sans-IO).

A shed is a help only to a client that comes back. The openai SDKs come back after any
Retry-After up to a minute and give each attempt its whole timeout anew; a client whose
one timeout bounds the whole call (a wrapper's deadline, `asyncio.timeout` around the
SDK, a user who stops waiting) gives up on a wait longer than what its timeout has left,
and the wait it sits out comes off the time its retry has. Neither says which it is.
Two things are learned per population (tenant, and whether its clients say which attempt
they send), from what `admission.retries.RetryMemory` sees of its sheds and retries:

* **whose clock their timeout is**: a request back after its budget counted from its
  first attempt ran out, or a retry still there then (served, or left later), is one
  vote for a clock per *attempt*: a whole call's cannot be. A retry whose client left at
  the timeout it stated, counted from its first attempt (within ``CLOSE``), while its own
  attempt had most of it left, is one vote for a *whole call's*. The recent ``VOTES``
  decide: per attempt where such votes are not outnumbered, a whole call with at least
  ``MIN_VOTES`` in the majority. A whole call's retry then has its queue deadline counted
  from its first attempt: otherwise kvgate starts retries whose clients are gone before
  their answers, and the service they waste is what the other requests needed.
* **how long they come back after**: the longest Retry-After after which a recent shed
  request (of the last ``RETURNS``) came back. Unless the clock is known per attempt, a
  wait estimate that would tell a longer one does not shed: the request stays queued
  until its deadline, as it would in front of a fixed-concurrency proxy, where a client
  that counts its told wait would be lost by the shed, and in a closed loop its next
  request sent at once. Nothing seen: 0, no wait is told on an estimate; a deadline
  passed still sheds, and its client's return teaches the rest.

Clients that say which attempt they send (the openai and anthropic SDKs) are believed
per attempt until their retries vote otherwise: held in the queue instead of told their
wait, the SDK's first wave lost more than the whole-call clients with its headers won,
and those, given up on their first shed, never come back to show their clock
(measured: docs/benchmarks-matrix.md).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from typing import NamedTuple

RETURNS = 64  # recent returns after a told wait that set how long clients come back after
VOTES = 16  # recent votes on a population's clock
MIN_VOTES = 3  # whole-call votes before retries are timed from their first attempt
CLOSE = 0.1  # of the stated timeout: "at" it, "past" it, and a wait that took a share of it


class ToldWaitReading(NamedTuple):
    """What an operator sees of one population (`ToldWaits.readings`)."""

    tenant: str
    says_attempt: bool  # its clients say which attempt they send (the SDKs)
    clock: str | None  # "attempt", "call", or None: not known
    comes_back_after_s: float | None  # the longest wait told on an estimate; None: any
    returns: int  # recent returns after a told wait
    votes_attempt: int  # recent votes for a clock per attempt
    votes_call: int  # and for a whole call's


class _Population:
    """One population's recent returns and clock votes, and what they decide (kept
    current on each change: the request path reads them on every arrival)."""

    __slots__ = ("returns", "votes", "clock", "longest")

    def __init__(self) -> None:
        self.returns: deque[float] = deque(maxlen=RETURNS)
        self.votes: deque[bool] = deque(maxlen=VOTES)  # True: an attempt's clock
        self.clock: str | None = None
        self.longest = 0.0

    def decide(self) -> None:
        self.longest = max(self.returns) if self.returns else 0.0
        per_attempt = sum(self.votes)
        whole = len(self.votes) - per_attempt
        if per_attempt and per_attempt >= whole:
            self.clock = "attempt"
        elif whole >= MIN_VOTES and whole > per_attempt:
            self.clock = "call"
        else:
            self.clock = None


class ToldWaits:
    """Per population (tenant, said): the told waits its clients came back after, and
    the votes on its clock (module docstring). At most `populations` kept (the least
    recently changed dropped first)."""

    __slots__ = ("_pops", "_max")

    def __init__(self, populations: int) -> None:
        self._pops: OrderedDict[tuple[str, bool], _Population] = OrderedDict()
        self._max = max(1, populations)

    def _changing(self, tenant: str, said: bool) -> _Population:
        key = (tenant, said)
        pop = self._pops.get(key)
        if pop is None:
            pop = self._pops[key] = _Population()
            if len(self._pops) > self._max:
                self._pops.popitem(last=False)
        self._pops.move_to_end(key)
        return pop

    def came_back(self, tenant: str, said: bool, told: float, past_budget: bool) -> None:
        """A request of the population left unserved came back after being told `told`
        seconds (0: it left on its own and retried); `past_budget`: its budget counted
        from its first attempt had run out by then, so its clock is an attempt's."""
        if told <= 0 and not past_budget:
            return
        pop = self._changing(tenant, said)
        if told > 0:
            pop.returns.append(told)
        if past_budget:
            pop.votes.append(True)
        pop.decide()

    def returns_after(self, tenant: str, said: bool) -> float:
        """The longest wait that may be told the population on an estimate: any (inf)
        where its clock is an attempt's, or is not known for clients that say their
        attempt (the SDKs, believed per attempt); else the longest told wait a recent
        shed request came back after (0: none seen)."""
        pop = self._pops.get((tenant, said))
        if pop is None:
            return math.inf if said else 0.0
        if pop.clock == "attempt" or (said and pop.clock is None):
            return math.inf
        return pop.longest

    def retry_ended(
        self,
        tenant: str,
        said: bool,
        timeout: float,
        first: float,
        attempt: float,
        left: bool,
        now: float,
    ) -> None:
        """A retry (first attempt at `first`, this one at `attempt`) of a client that stated
        `timeout` ended at `now`: its client `left` before an answer, or stayed to the end
        (served, shed, failed). A vote on the population's clock, where it says one."""
        if timeout <= 0 or attempt - first < CLOSE * timeout:
            return  # its earlier attempts and waits took too little of it to tell
        if attempt - first > timeout:
            return  # back after its budget ran out: its return voted (`came_back`)
        since_first = now - first
        if since_first > (1.0 + CLOSE) * timeout:
            vote = True  # still there past its whole budget: a clock per attempt
        elif left and abs(since_first - timeout) <= CLOSE * timeout:
            vote = False  # left as its budget since the first attempt ran out
        else:
            return
        pop = self._changing(tenant, said)
        pop.votes.append(vote)
        pop.decide()

    def clock(self, tenant: str, said: bool) -> str | None:
        """Whose clock the population's timeouts are (module docstring): "attempt" once a
        recent client outlived its budget counted from its first attempt (a whole call's
        cannot) and such votes are not outnumbered; "call" with at least ``MIN_VOTES``
        whole-call votes in the majority; None: not known."""
        pop = self._pops.get((tenant, said))
        return None if pop is None else pop.clock

    def readings(self) -> list[ToldWaitReading]:
        out = []
        for (tenant, said), pop in sorted(self._pops.items()):
            limit = self.returns_after(tenant, said)
            per_attempt = sum(pop.votes)
            out.append(
                ToldWaitReading(
                    tenant,
                    said,
                    pop.clock,
                    None if math.isinf(limit) else limit,
                    len(pop.returns),
                    per_attempt,
                    len(pop.votes) - per_attempt,
                )
            )
        return out
