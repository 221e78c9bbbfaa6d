"""Told waits: what clients do with the Retry-After they are told (sans-IO).

A shed is a help only to a client that comes back. The openai SDKs come back after any
Retry-After up to a minute and give each attempt its whole timeout anew; a client whose
one timeout bounds the whole call (a wrapper's deadline, `asyncio.timeout` around the
SDK, a user who stops waiting) gives up on a wait longer than what its timeout has left,
and the wait it sits out comes off the time its retry has. Neither says which it is.
Two things are learned per population (tenant, and whether its clients say which attempt
they send), from what `admission.retries.RetryMemory` sees of its sheds and retries:

* **how long they come back after**: the longest Retry-After after which a recent shed
  request (of the last ``RETURNS``) came back. A wait estimate that would tell a longer
  one does not shed: the request stays queued until its deadline, as it would in front of
  a fixed-concurrency proxy, where a client that counts its told wait would be lost by
  the shed (in virtual time, 32 such clients on the real vLLM's regime were shed with
  Retry-Afters past their 4 s timeout and gave up at once: 16 of 300 served, where a
  fixed proxy's queue served 100). Nothing seen: 0, no wait is told on an estimate; a
  deadline passed still sheds, and its client's return teaches the window.
* **whose clock their timeout is**: a retry whose client left at the timeout it stated,
  counted from its first attempt (within a tenth), while its own attempt had most of it
  left, is one vote for a *whole-call* clock; a retry whose client was still there past
  that (served, or left later) is one vote for a clock per attempt. Once at least
  ``MIN_VOTES`` of the recent ``VOTES`` say whole call and they are the majority, a
  retry's queue deadline counts from its first attempt: otherwise kvgate starts
  retries whose clients are gone before their answers (the wasted service is what the
  other requests needed). Per attempt is the default: the SDKs' own behaviour, and the
  reading that never sheds a retry early.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque

RETURNS = 64  # recent returns after a told wait that set how long clients come back after
VOTES = 16  # recent votes on a population's clock
MIN_VOTES = 3  # whole-call votes before retries are timed from their first attempt
CLOSE = 0.1  # of the stated timeout: "at" it, "past" it, and a wait that took a share of it


class ToldWaits:
    """Per population (tenant, said): the told waits its clients came back after, and
    the votes on its clock (module docstring). At most `populations` of each kept."""

    __slots__ = ("_returns", "_votes", "_max")

    def __init__(self, populations: int) -> None:
        self._returns: OrderedDict[tuple[str, bool], deque[float]] = OrderedDict()
        self._votes: OrderedDict[tuple[str, bool], deque[bool]] = OrderedDict()
        self._max = max(1, populations)

    def came_back(self, tenant: str, said: bool, told: float, past_budget: bool) -> None:
        """A request of the population left unserved came back after being told `told`
        seconds (0: it left on its own and retried); `past_budget`: its budget counted
        from its first attempt had run out by then, so its clock is an attempt's."""
        if told > 0:
            _recent(self._returns, (tenant, said), RETURNS, self._max).append(told)
        if past_budget:
            _recent(self._votes, (tenant, said), VOTES, self._max).append(True)

    def returns_after(self, tenant: str, said: bool) -> float:
        """The longest wait that may be told the population on an estimate: any (inf)
        where its clock is an attempt's, else the longest told wait a recent shed request
        came back after (0: none seen)."""
        clock = self.clock(tenant, said)
        if clock == "attempt" or (said and clock is None):
            return math.inf  # clients that say their attempt are the SDKs: believed per attempt
        seen = self._returns.get((tenant, said))
        return max(seen) if seen else 0.0

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
        since_first = now - first
        if since_first > (1.0 + CLOSE) * timeout:
            vote = True  # still there past its whole budget: a clock per attempt
        elif left and abs(since_first - timeout) <= CLOSE * timeout:
            vote = False  # left as its budget since the first attempt ran out
        else:
            return
        _recent(self._votes, (tenant, said), VOTES, self._max).append(vote)

    def clock(self, tenant: str, said: bool) -> str | None:
        """Whose clock the population's timeouts are (module docstring): "attempt" once a
        recent client outlived its budget counted from its first attempt (a whole call's
        cannot) and such votes are not outnumbered; "call" with at least ``MIN_VOTES``
        whole-call votes in the majority; None: not known."""
        votes = self._votes.get((tenant, said))
        if not votes:
            return None
        per_attempt = sum(votes)
        whole = len(votes) - per_attempt
        if per_attempt and per_attempt >= whole:
            return "attempt"
        if whole >= MIN_VOTES and whole > per_attempt:
            return "call"
        return None


def _recent(
    table: OrderedDict[tuple[str, bool], deque], key: tuple[str, bool], size: int, most: int
) -> deque:
    """`table`'s recent values of `key` (created, and the least recently used dropped past
    `most`)."""
    got = table.get(key)
    if got is None:
        got = table[key] = deque(maxlen=size)
        if len(table) > most:
            table.popitem(last=False)
    table.move_to_end(key)
    return got
