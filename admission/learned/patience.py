"""Client patience: how long clients that state no timeout wait, learned from what they do.

Most HTTP clients never say how long they wait (curl, aiohttp or httpx with a timeout,
batch scripts); the openai SDKs do (``x-stainless-read-timeout``) and are believed. For
the others each ended request of a population (tenant, model, stream or not) is one
observation of its client's patience, measured from the attempt's arrival at kvgate:

* the client left (a disconnect while queued or running) at ``t``: an *event*, its
  patience was ``t``;
* it stayed to the end (served, shed, failed) at ``t``: *censored*, its patience is
  more than ``t``. Under a working gateway this is the common case, and dropping it
  would learn the patience of the few who left as everyone's.

Attempts, not first arrivals: HTTP clients and the openai SDKs all time out per
attempt, so a retry's clock starts anew. A client with one deadline over all its retries
is then seen shorter on its retries, which errs toward shedding early with a
Retry-After, never toward holding a request past the moment its client is gone.

The estimate is the Kaplan-Meier survival curve over the last ``WINDOW`` observations,
which uses both kinds; its ``QUANTILE`` (p10: the patience 90% of clients have) is the
deadline of a request that states none. Rules:

* cold start: fewer than ``MIN_EVENTS`` departures in the window, and nothing learned
  before: no estimate, and no deadline unless ``queue_timeout_s`` is configured (with
  shared state, the budget another gateway process learned of the population, if any:
  `ClientPatience.adopt`). A population that never leaves teaches nothing and keeps
  none. Except a configured timeout: when the window's departures, at least
  ``MIN_COHORT`` of them, all came after one wait (within a tenth), the
  clients share one timeout and it is that wait (a plain HTTP client with ``total=T``:
  fewer than ``MIN_EVENTS`` of its clients may leave at T together, and waiting for
  ``MIN_EVENTS`` held the rest of a run to the configured timeout; measured:
  docs/admission.md).
* a curve that never falls to 1 - p within what was observed (most clients stayed as
  long as anyone was seen): no estimate either; a few impatient clients do not set the
  deadline of a patient population (a mixed one gets its low quantile, not its minimum).
* once learned, an estimate holds while departures are rare (a gateway that sheds in
  time sees few): it is dropped only when at least ``MIN_EVENTS`` clients of the window
  were seen staying past it, the evidence that the population waits longer now.

A stream's budget has a shape. The openai SDKs' read timeout runs per chunk: such a
client waits as long as bytes keep coming and leaves after a *quiet* stretch as long as
its timeout. Other clients (aiohttp's ``total``, ``curl --max-time``) put one deadline
on the whole stream. Where stream clients leave tells which: one that leaves after a
stall (a quiet stretch over ``STALL_GAPS`` of the stream's own mean gaps, and longer than
its wait for the first token, which a per-chunk client sat through) is on a per-chunk
clock; one that leaves otherwise, while the stream flows, is on its own clock, a
*whole*-stream deadline. Stream populations keep a second curve, of the
quiet stretches clients sat through (a departure: the stretch it left in; a stay: at
least its wait for the first token), and the budget of a stream is

* ``whole`` (the default until departures mid-stream say otherwise: a deadline that was
  never seen is not assumed generous): the total-time curve's p10 bounds the whole
  stream, as it bounds a non-stream response;
* per chunk (most departures mid-stream came after a stall): the quiet curve's p10
  bounds the first token and every gap, as the SDK's stated read timeout does.

A departure while the stream flows proves a deadline only when it is a clock's. A client
with a total timeout leaves at it, whatever it has received and whenever its first token
came: its population's departures mid-stream come after one total wait. A client that
stops reading once it has what it wanted (a user pressing stop, an agent that read
enough) leaves a few events after its first token, whenever that came: its departures
are as spread as its first tokens (and its reading), and it was patient for all it
waited. So a flowing departure counts as one only when at least ``MIN_COHORT`` and most
of the population's recent ones (``SHAPE_MEMORY``) left within a tenth of its wait, and
that cohort's first tokens came ``CLOCK_SPREAD`` times further apart than it left
(relatively); the cohort's earlier members, taken as stays, then count as departures
too. Otherwise it is a stay at its wait, and it does not vote on the shape. Counted as
departures, readers that stop after a few events (the chaos bench's clients, and
tests/gateway/test_patience_stoppers.py's) taught their population a whole-stream
deadline that no stream met, and kvgate shed the patient streams beside them
(measured: docs/admission.md, docs/benchmarks-faults.md). Not told apart: a clock whose
clients got their first tokens nearly as close together as they left is not seen as one
(it keeps the default, and its departures before the first token still teach), and
readers that all leave at one total time however far apart their first tokens came
would be read as a clock. Hence a last check: a whole-stream deadline applies only
while one of the population's recent streams (``SHAPE_MEMORY``) was read to its end
within it. Readers leave long before any stream ends (stoppers admitted at once in a
cold start left together and taught a deadline of a few milliseconds by chance:
docs/admission.md); a real clock lets its short streams finish; and a deadline no
stream meets is not one kvgate could keep anyway.

Clients that leave together (within ``TOGETHER_S`` of a close's first departure) after
waits that differ (by more than their departure instants do, and than a tenth) did not
each run out of patience: something ended them at once (a load generator stopping
mid-run, a client process killed, a network path dropped). Such a mass close counts
once, its first departure; once one of its members' wait shows it, the others count as
having stayed as long as they did, those counted before it included (a busy gateway's
loop begins requests in one iteration and loses them in one: on its millisecond clock
the first members it gets round to may share one wait by chance). A departure is timed
by when its connection was lost (`ClientEnd.left_at`), not by when kvgate's handler got
round to it: on a loaded machine those are tens of milliseconds apart, and one close was
taken for clients leaving one by one. A cohort that leaves together after one
wait (sent together with one timeout) is not a mass close: each counts, unless at least
``MIN_EVENTS`` clients of its population were seen waiting past that wait (the same
evidence that drops a learned estimate). Both tests come from a load generator stopping
at saturation in front of an engine that answers in milliseconds: its in-flight
requests' waits differ by a few milliseconds, which a fixed tolerance took for one
timeout, or not at all, when it sent them in one batch.

Memory: ``WINDOW`` observations per population, at most ``POPULATIONS`` populations
(tenants come from configured keys, models from discovery; the oldest is dropped).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass

QUANTILE = 0.1
MIN_EVENTS = 10
MIN_COHORT = 3  # departures after one wait that show a configured timeout
WINDOW = 256
POPULATIONS = 1024
STALL_GAPS = 10.0  # a last gap this many times the stream's mean gap is a stall
REFRESH_STAYS = 16  # stays between two computations of the estimate
SHAPE_MEMORY = 64  # departures mid-stream that decide a stream budget's shape
CLOCK_SPREAD = 2.0  # a clock's cohort left this many times closer together than it began
TOGETHER_S = 0.02  # departures this close to a close's first one are part of that close


def _spread(values: list[float]) -> float:
    """How far apart `values` lie, relative to the smallest: (max - min) / min."""
    lo = min(values)
    return (max(values) - lo) / lo if lo > 0 else math.inf


def km_quantile(observations: list[tuple[float, bool]], q: float) -> float | None:
    """The smallest time by which a fraction `q` of the population has left, by the
    Kaplan-Meier estimate over `observations` of (time, left); None when the estimated
    curve never falls that far. A censored time equal to an event time is at risk at it
    (the usual convention: it was seen staying that long)."""
    ordered = sorted(observations)
    at_risk = len(ordered)
    survival = 1.0
    i = 0
    while i < len(ordered):
        t = ordered[i][0]
        left = stayed = 0
        while i < len(ordered) and ordered[i][0] == t:
            if ordered[i][1]:
                left += 1
            else:
                stayed += 1
            i += 1
        if left:
            survival *= 1.0 - left / at_risk
            if 1.0 - survival >= q - 1e-12:
                return t
        at_risk -= left + stayed
    return None


class Patience:
    """The patience of one population of clients (`observe`, then `estimate`)."""

    __slots__ = ("_window", "_events", "_held", "_dirty", "_stale", "observed", "left")

    def __init__(self) -> None:
        self._window: deque[tuple[float, bool]] = deque(maxlen=WINDOW)
        self._events = 0  # departures in the window
        self._held: float | None = None
        self._dirty = False
        self._stale = 0  # stays since the estimate was last computed
        self.observed = 0  # all observations ever (for the report)
        self.left = 0  # all departures ever

    def relabel(self, waited_s: float) -> None:
        """The latest stay of `waited_s` in the window was a departure after all."""
        if self._flip(waited_s, True):
            self.left += 1

    def unlabel(self, waited_s: float) -> None:
        """The latest departure of `waited_s` in the window stayed after all. The count
        of departures ever (`left`, a counter) keeps it; the window, which the estimate
        reads, does not."""
        self._flip(waited_s, False)

    def _flip(self, waited_s: float, left: bool) -> bool:
        """Mark the latest observation of `waited_s` labelled the other way as `left`;
        whether there was one."""
        w = self._window
        for i in range(len(w) - 1, -1, -1):
            if w[i] == (waited_s, not left):
                w[i] = (waited_s, left)
                self._events += 1 if left else -1
                self._dirty = True
                return True
        return False

    def observe(self, waited_s: float, left: bool) -> None:
        """One ended request: its client left after `waited_s`, or stayed that long."""
        w = self._window
        if len(w) == w.maxlen and w[0][1]:
            self._events -= 1
        w.append((max(0.0, waited_s), left))
        self.observed += 1
        if left:
            self._events += 1
            self.left += 1
            self._dirty = True  # a departure moves the low quantile: at once
        else:
            # Stays move it slowly: recompute after a batch of them, so the request path
            # pays a sort of the window once per REFRESH_STAYS ends, not on every one.
            self._stale += 1
            if self._stale >= REFRESH_STAYS:
                self._dirty = True

    def _one_timeout(self) -> bool:
        """At least ``MIN_COHORT`` departures in the window, all after one wait."""
        if self._events < MIN_COHORT:
            return False
        waits = [t for t, left in self._window if left]
        lo, hi = min(waits), max(waits)
        return hi - lo <= 0.1 * lo

    @property
    def events(self) -> int:
        """Departures in the window."""
        return self._events

    def estimate(self) -> float | None:
        """The learned patience (the window's p10), or None: use the default."""
        if self._dirty:
            self._dirty = False
            self._stale = 0
            self._held = self._learn()
        return self._held

    def _learn(self) -> float | None:
        if self._events >= MIN_EVENTS or self._one_timeout():
            return km_quantile(list(self._window), QUANTILE)
        held = self._held
        if held is None:
            return None
        return None if self.stayed_past(held) >= MIN_EVENTS else held

    def stayed_past(self, seconds: float) -> int:
        """Clients of the window seen waiting longer than `seconds`."""
        return sum(1 for t, _ in self._window if t > seconds)


@dataclass(slots=True, frozen=True)
class ClientEnd:
    """One client's patience as an ended request shows it."""

    waited_s: float  # since its arrival
    left: bool  # it disconnected then (else it stayed to the end)
    quiet_s: float | None = None  # a stream: the quiet stretch it left in, or sat through
    stalled: bool | None = None  # a stream it left mid-way: after a stall (None: unknown)
    first_s: float | None = None  # a stream with content: its first token's wait
    # When it left, as the gateway's transport saw its connection lost (None: at the
    # `now` it is observed). A busy gateway learns of a close late, one handler at a
    # time: the instant it noticed is its own slowness, not the client's.
    left_at: float | None = None


def stream_end(
    waited_s: float,
    left: bool,
    first_s: float | None,
    quiet_s: float,
    gap_s: float | None,
    left_at: float | None = None,
) -> ClientEnd:
    """What a stream's end shows of its client: it left (or stayed) after `waited_s`,
    its first token came after `first_s` (None: none came), its last quiet stretch is
    `quiet_s` (since its last event, or since arrival), `gap_s` its mean gap between
    events (None: fewer than two); `left_at`, when it left (`ClientEnd`)."""
    if not left:
        # It sat through at least its wait for the first token (no gap log is kept).
        quiet = first_s if first_s is not None else waited_s
        return ClientEnd(waited_s, False, quiet, first_s=first_s)
    stalled = None
    if first_s is not None:
        # Left while tokens flowed: its own clock, or it had enough. After a stall (and a
        # stretch longer than its first-token wait, which a per-chunk client sat
        # through): a per-chunk clock. One event and no gap: the first test alone.
        stalled = quiet_s > first_s and (gap_s is None or quiet_s > STALL_GAPS * gap_s)
    return ClientEnd(waited_s, True, quiet_s, stalled, first_s, left_at)


@dataclass(slots=True)
class _Flowing:
    """One departure while a stream flowed: its wait, its first token's wait (None: not
    told), its last quiet stretch, and whether it was counted as a departure."""

    waited: float
    first: float | None
    quiet: float | None
    counted: bool = False


@dataclass(slots=True, frozen=True)
class Budget:
    """A learned budget: seconds, and whether it bounds the whole response (a stream's
    per-chunk budget bounds its first token and its gaps)."""

    seconds: float
    whole: bool = True


class Population:
    """One population's curves: total time, and for streams the quiet stretches and
    where its clients left (while the stream flowed, or after a stall)."""

    __slots__ = (
        "total",
        "quiet",
        "flowing",
        "stalled",
        "_close_at",
        "_close_waited",
        "_mass",
        "_opening",
        "_followers",
        "_recent",
        "_served",
    )

    def __init__(self) -> None:
        self.total = Patience()
        self.quiet = Patience()  # streams only
        self.flowing = 0  # departures mid-stream while tokens flowed, on a clock
        self.stalled = 0  # departures mid-stream after a stall
        self._close_at = -math.inf  # when the current close's first departure left
        self._close_waited = 0.0  # and how long that client had waited
        self._mass = False  # one of the close left at its moment, not after its wait
        self._opening = False  # the departure being observed opened its close
        # The close's departures counted after its first, until one shows a mass close:
        # (wait, quiet stretch, stalled), to be taken back then.
        self._followers: list[tuple[float, float | None, bool | None]] = []
        # The recent departures while tokens flowed.
        self._recent: deque[_Flowing] = deque(maxlen=SHAPE_MEMORY)
        # How long the recent streams its clients read to the end took (streams only).
        self._served: deque[float] = deque(maxlen=SHAPE_MEMORY)

    def served(self, waited: float) -> None:
        """A stream of this population was read to its end after `waited`."""
        self._served.append(waited)

    def on_a_clock(self, waited: float, first: float | None, quiet: float | None) -> bool:
        """Whether a departure while tokens flowed, after `waited` (its first token after
        `first`; None: not told), is a clock's (the module's doc). The earlier members
        of its cohort, taken as stays, become departures."""
        recent = self._recent
        recent.append(_Flowing(waited, first, quiet))
        cohort = [r for r in recent if abs(r.waited - waited) <= 0.1 * min(r.waited, waited)]
        if len(cohort) < MIN_COHORT or 2 * len(cohort) <= len(recent):
            return False
        firsts = [r.first for r in cohort if r.first is not None]
        if len(firsts) == len(cohort) and _spread(firsts) <= CLOCK_SPREAD * _spread(
            [r.waited for r in cohort]
        ):
            return False  # they left as they began: readers, not a clock
        for r in cohort[:-1]:
            if not r.counted:
                r.counted = True
                self.total.relabel(r.waited)
                if r.quiet is not None:
                    self.quiet.relabel(r.quiet)
                self.flowing += 1
        cohort[-1].counted = True
        return True

    def left_alone(self, end: ClientEnd, now: float) -> bool:
        """Whether a departure at `now` is its client's own (else part of a mass close
        that its first departure already counted)."""
        if now - self._close_at >= TOGETHER_S:
            # A new close begins.
            self._close_at, self._close_waited, self._mass = now, end.waited_s, False
            self._opening = True
            self._followers.clear()
            return True
        self._opening = False
        if not self._mass:
            first = self._close_waited
            # A cohort with one timeout leaves after one wait, a mass close at one moment:
            # this one's wait is further from the first's than its departure is (and than
            # a tenth). Or they waited alike (sent together), but a wait their population
            # was seen sitting through is no timeout of its.
            mass = abs(end.waited_s - first) > max(now - self._close_at, 0.1 * first)
            if mass or self.total.stayed_past(1.1 * first) >= MIN_EVENTS:
                self._mass = True
                self._take_back()
        return not self._mass

    def followed(self, waited: float, quiet: float | None, stalled: bool | None) -> None:
        """A departure of the current close was counted (after `left_alone`)."""
        if not self._opening:
            self._followers.append((waited, quiet, stalled))

    def _take_back(self) -> None:
        """The close is a mass close: the departures counted after its first, which only
        came first (alike by chance, or requests a busy gateway began in one loop
        iteration and lost in one: equal waits on its millisecond clock), stayed."""
        for waited, quiet, stalled in self._followers:
            self.total.unlabel(waited)
            if quiet is not None:
                self.quiet.unlabel(quiet)
            if stalled is True:
                self.stalled = max(0, self.stalled - 1)
            elif stalled is False:
                self.flowing = max(0, self.flowing - 1)
        self._followers.clear()

    @property
    def per_chunk(self) -> bool:
        return self.stalled > self.flowing

    def budget(self, stream: bool) -> Budget | None:
        if stream and self.per_chunk:
            q = self.quiet.estimate()
            return None if q is None else Budget(q, whole=False)
        q = self.total.estimate()
        if q is None:
            return None
        if stream and not any(t <= q for t in self._served):
            # A whole-stream deadline none of its recent streams was read within is not
            # one kvgate could keep, and readers that stop a few events in look like it
            # (the module's doc).
            return None
        return Budget(q)


@dataclass(slots=True, frozen=True)
class PatienceReading:
    """One population as the report shows it."""

    tenant: str
    model: str
    stream: bool
    patience_s: float | None  # None: not learned, the configured default applies
    whole: bool  # the budget bounds the whole response (False: a stream's every chunk)
    observed: int
    left: int
    window_events: int
    shared: bool = False  # the budget is the fleet's (another process learned it)


class ClientPatience:
    """Patience by population (tenant, model, stream), bounded in number.

    A population this process has not learned takes the budget another gateway process
    learned of it (`adopt`, from the shared state: gateway/state/patience_sync.py): the same
    clients reach every process behind a load balancer, and without it each new
    process (a worker, a host added, a restart) kept a wave of them under the default
    queue timeout until they left, as a fresh kvgate's first wave does. What this
    process learned itself wins over the fleet's."""

    __slots__ = ("_pops", "_shared")

    def __init__(self) -> None:
        self._pops: OrderedDict[tuple[str, str, bool], Population] = OrderedDict()
        self._shared: OrderedDict[tuple[str, str, bool], Budget] = OrderedDict()

    def observe(self, tenant: str, model: str, stream: bool, end: ClientEnd, now: float) -> None:
        """One ended request of a client that stated no timeout, at `now`. A stream's
        `quiet_s` is the quiet stretch it left in (or at least sat through); `stalled`,
        for a departure after the first token, whether it came after a stall."""
        key = (tenant, model, stream)
        pop = self._pops.get(key)
        if pop is None:
            pop = self._pops[key] = Population()
            if len(self._pops) > POPULATIONS:
                self._pops.popitem(last=False)
        else:
            self._pops.move_to_end(key)
        if not math.isfinite(end.waited_s):
            return
        waited = max(0.0, end.waited_s)
        quiet = end.quiet_s
        if not (stream and quiet is not None and math.isfinite(quiet)):
            quiet = None
        else:
            quiet = max(0.0, quiet)
        # A close is told by when its clients left, not by when kvgate noticed each.
        at = now if end.left_at is None else min(end.left_at, now)
        left = end.left and pop.left_alone(end, at)
        if left and end.stalled is False:
            # Left while tokens flowed: a clock's deadline, or a reader that had enough.
            left = pop.on_a_clock(waited, end.first_s, quiet)
        pop.total.observe(waited, left)
        if stream and not end.left and end.first_s is not None:
            pop.served(waited)
        if quiet is not None:
            pop.quiet.observe(quiet, left)
        shared = self._shared.get(key)
        if shared is not None and not left:
            # The fleet's budget is dropped here as one learned here would be: once
            # ``MIN_EVENTS`` clients of the window were seen staying past it.
            seen, curve = (waited, pop.total) if shared.whole else (quiet, pop.quiet)
            if seen is not None and seen > shared.seconds:
                if curve.stayed_past(shared.seconds) >= MIN_EVENTS:
                    del self._shared[key]
        if left and end.stalled is not None:
            if end.stalled:
                pop.stalled += 1
            else:
                pop.flowing += 1
            if pop.stalled + pop.flowing > SHAPE_MEMORY:  # the recent clients decide
                pop.stalled //= 2
                pop.flowing //= 2
        if left:
            pop.followed(waited, quiet, end.stalled)

    def budget(self, tenant: str, model: str, stream: bool) -> Budget | None:
        """The population's budget: learned here, else the fleet's; None: the default."""
        own = self.learned(tenant, model, stream)
        return own if own is not None else self._shared.get((tenant, model, stream))

    def learned(self, tenant: str, model: str, stream: bool) -> Budget | None:
        """The budget this process learned of the population itself (None: none)."""
        pop = self._pops.get((tenant, model, stream))
        return pop.budget(stream) if pop is not None else None

    def adopt(self, tenant: str, model: str, stream: bool, budget: Budget | None) -> None:
        """Another process's learned budget of the population (None: none usable)."""
        key = (tenant, model, stream)
        if budget is None:
            self._shared.pop(key, None)
            return
        self._shared[key] = budget
        self._shared.move_to_end(key)
        if len(self._shared) > POPULATIONS:
            self._shared.popitem(last=False)

    def populations(self) -> list[tuple[str, str, bool]]:
        """The populations this process has seen clients of."""
        return list(self._pops)

    def estimate(self, tenant: str, model: str, stream: bool) -> float | None:
        b = self.budget(tenant, model, stream)
        return None if b is None else b.seconds

    def readings(self) -> list[PatienceReading]:
        out = []
        for key in sorted({*self._pops, *self._shared}):
            t, m, s = key
            p = self._pops.get(key)
            own = p.budget(s) if p is not None else None
            b = own if own is not None else self._shared.get(key)
            out.append(
                PatienceReading(
                    t,
                    m,
                    s,
                    None if b is None else b.seconds,
                    True if b is None else b.whole,
                    p.total.observed if p is not None else 0,
                    p.total.left if p is not None else 0,
                    p.total.events if p is not None else 0,
                    shared=own is None and b is not None,
                )
            )
        return out
