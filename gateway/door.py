"""The door to admission: the gateway's only holder of the `AdmissionController`.

The controller is a synchronous state machine. Every call that changes it returns what
it caused: `submit` a `Decision` (the request's verdict and the verdicts it settled for
queued requests), the other changes their `Events` (queued requests admitted or shed).
The door makes each change, hands every event to the waiter of its request, and owns the
futures the queued handlers await, in one place, so no call site can forget to hand an
admission out. Everything else in the gateway reads `report` and never changes admission
but through here.

Deadlines (of queued requests, and of abandoned reservations held while their engine may
still be generating) are enforced by one background task that sleeps until the
controller's `next_deadline()` and then calls `advance`. It is woken when a new entry may
have moved the earliest deadline forward. Time is always the event loop's monotonic clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Sequence

from admission.config import AdmissionConfig
from admission.controller import AdmissionController
from admission.learned.limitlog import LimitHistory
from admission.learned.patience import Budget
from admission.lease import PoolShare
from admission.report import AdmissionReport
from admission.retries import RetryIdentity
from admission.types import (
    AdmissionRequest,
    Admit,
    AttemptEnd,
    Events,
    Queued,
    Refuse,
    RequestEnd,
    Shed,
    Verdict,
)
from gateway.logging import iso8601
from gateway.tasks import cancel_all
from routing.types import ReplicaState, Router

log = logging.getLogger("kvgate.admission")
limit_log = logging.getLogger("kvgate.limit")


class AdmissionDoor:
    def __init__(
        self, controller: AdmissionController, loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        self._controller = controller
        # The loop whose clock and futures it uses: `loop` (virtual time passes one whose
        # clock it drives: bench/vtime.py), else the running loop of its first use.
        self._bound = loop
        self._waiters: dict[str, asyncio.Future[Admit | Shed]] = {}
        self._wake = asyncio.Event()
        self._armed = math.inf  # the deadline the expiry task currently sleeps towards
        self._task: asyncio.Task[None] | None = None
        # replica -> its limit's history and the last change of it logged
        self._limits_logged: dict[str, tuple[LimitHistory, int]] = {}

    @property
    def report(self) -> AdmissionReport:
        """Every read of admission (ledger, queue, learned limits)."""
        return self._controller.report

    @property
    def router(self) -> Router:
        """The routing policy admission places requests with."""
        return self._controller.router

    @property
    def _loop(self) -> asyncio.AbstractEventLoop:
        # Bound on first use, so the app can build the door before its loop runs.
        if self._bound is None:
            self._bound = asyncio.get_running_loop()
        return self._bound

    def now(self) -> float:
        return self._loop.time()

    def _time(self, now: float | None) -> float:
        return self._loop.time() if now is None else now

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._task is None:
            self._task = self._loop.create_task(self._expiry_loop(), name="kvgate-expiry")

    async def stop(self) -> None:
        await cancel_all([self._task])
        self._task = None
        for rid, fut in list(self._waiters.items()):
            if not fut.done():
                fut.set_result(Shed(rid, "shutdown", 1.0))
        self._waiters.clear()

    def shed_all(self, reason: str, retry_after: float) -> int:
        """Shed every queued request at once (graceful shutdown); returns how many. Each
        waiter's ``finally`` releases its queue entry."""
        n = 0
        for rid, fut in list(self._waiters.items()):
            if not fut.done():
                fut.set_result(Shed(rid, reason, retry_after))
                n += 1
        return n

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    # ---------------------------------------------------------------- requests
    async def admit(
        self, req: AdmissionRequest, identity: RetryIdentity | None = None, said: bool = False
    ) -> tuple[Admit | Shed | Refuse, bool]:
        """Submit `req`; if queued, wait for its Admit or Shed.

        `identity`, `said`: as `submit` takes them; None: the gateway's own retry of a
        failed attempt, which its client never sees. Returns (verdict, queued).
        Cancellation (client disconnect) propagates; the caller releases in ``finally``,
        which also drops the queue entry.
        """
        verdict = self.submit(req, identity=identity, said=said)
        queued = isinstance(verdict, Queued)
        got = await self.wait_queued(req.request_id) if queued else verdict
        assert not isinstance(got, Queued)
        if identity is not None:
            self.answered(req, got)
        return got, queued

    # ---------------------------------------------------------- what clients' attempts do
    def answered(self, req: AdmissionRequest, verdict: Verdict) -> None:
        """The verdict a client's attempt got (AdmissionController.answered)."""
        self._controller.answered(req, verdict, self._loop.time())

    def submit(
        self,
        req: AdmissionRequest,
        now: float | None = None,
        *,
        identity: RetryIdentity | None = None,
        said: bool = False,
    ) -> Verdict:
        """Decide `req` and deliver what the decision settled for others (an entry a
        full queue gave up for it, entries admitted in the same scan). A Queued request
        registers its waiter with `expect` before anything else can admit or shed it.

        `identity`: a client's attempt, told to the retry memory before its decision
        (`AdmissionController.arrived`; `said`: its client says which attempt it sends);
        None: the gateway's own retry of a failed attempt, or a caller with no clients."""
        now = self._time(now)
        if identity is not None:
            self._controller.arrived(req, identity, now, said)
        decision = self._controller.submit(req, now)
        self._resolve(decision.events)
        return decision.verdict

    def expect(self, request_id: str) -> asyncio.Future[Admit | Shed]:
        """Register the waiter of a request the controller just queued (its `submit`
        answered Queued), before anything else can admit or shed it: a verdict for a
        request nobody waits for is taken for a departed client's and given back."""
        fut: asyncio.Future[Admit | Shed] = self._loop.create_future()
        self._waiters[request_id] = fut
        self._rearm()  # this entry may expire before what the task sleeps towards
        return fut

    async def wait_queued(
        self, request_id: str, fut: asyncio.Future[Admit | Shed] | None = None
    ) -> Admit | Shed:
        """Wait for the Admit or Shed of a queued request: `fut` from `expect`, or
        registered now (when nothing ran since its `submit`)."""
        if fut is None:
            fut = self.expect(request_id)
        try:
            return await fut
        finally:
            self.withdraw(request_id)

    def withdraw(self, request_id: str) -> None:
        """The waiter of a queued request left (its client did): a verdict for it is
        then given back (`_resolve`)."""
        self._waiters.pop(request_id, None)

    def first_token(self, request_id: str | None) -> None:
        """A request's first token left its replica (the relay saw it): routing stops
        counting its prefill as waiting there (routing.prefill). Changes no admission."""
        if request_id is not None:
            self._controller.router.first_token(request_id, self._loop.time())

    def attempt_ended(self, end: AttemptEnd) -> None:
        """A client's attempt ended (`AdmissionController.attempt_ended`): what its client
        did and what its engine held cached; hand out what a patience learned shorter
        sheds of the queue."""
        self._resolve(self._controller.attempt_ended(end, self._loop.time()))
        if end.patience is not None:
            self._rearm()  # the queue's deadlines may have come forward

    def request_ended(self, end: RequestEnd) -> None:
        """Give a request's admission back (`AdmissionController.request_ended`) and hand
        out what that admits; an abandoned one's hold ends at its deadline, by the expiry
        task."""
        self._resolve(self._controller.request_ended(end, self._loop.time()))
        if end.abandoned:
            self._rearm()

    def adopt_patience(
        self, tenant: str, model: str, stream: bool, budget: Budget | None, now: float | None = None
    ) -> None:
        """Take the patience another gateway process learned of a population (shared
        state), and hand out what it sheds of the queue."""
        self._resolve(
            self._controller.adopt_patience(tenant, model, stream, budget, self._time(now))
        )
        self._rearm()

    def top_up(self, request_id: str, total_tokens: int, now: float | None = None) -> bool:
        """Grow a stream's reservation (`AdmissionController.top_up`)."""
        return self._controller.top_up(request_id, total_tokens, self._time(now))

    # ---------------------------------------------------------------- replicas
    def upsert_replica(
        self,
        state: ReplicaState,
        now: float | None = None,
        *,
        pinned_capacity: int | None = None,
        max_running: int | None = None,
    ) -> None:
        now = self._time(now)
        self._resolve(
            self._controller.upsert_replica(
                state, now, pinned_capacity=pinned_capacity, max_running=max_running
            )
        )
        self._log_limit_changes(state.name, now)

    def remove_replica(self, name: str, now: float | None = None) -> None:
        self._resolve(self._controller.remove_replica(name, self._time(now)))
        self._limits_logged.pop(name, None)

    def _log_limit_changes(self, name: str, now: float) -> None:
        """Log what moved `name`'s learned limit since its last discovery round, each
        change at INFO with the evidence that made it (slow start's steps at DEBUG)."""
        limit = self._controller.report.limit_of(name)
        if limit is None:
            return
        logged, seen = self._limits_logged.get(name, (None, 0))
        if logged is not limit.history:
            seen = 0  # a new limit (the replica came back, a reload): its changes from 1
        changes = limit.history.since(seen)
        if not changes:
            return
        self._limits_logged[name] = (limit.history, changes[-1].seq)
        wall = time.time() - now  # the loop's clock to the wall's
        for c in changes:
            limit_log.log(
                logging.DEBUG if c.reason == "slow_start" else logging.INFO,
                "replica %s: %s",
                name,
                c.describe(),
                extra={"fields": {"replica": name, "at": iso8601(wall + c.at), **c.fields()}},
            )

    def set_ejected(self, name: str, ejected: bool, now: float | None = None) -> None:
        self._resolve(self._controller.set_ejected(name, ejected, self._time(now)))

    def set_pool_shares(self, shares: Sequence[PoolShare], now: float | None = None) -> None:
        """This process's leased shares of the replicas (`AdmissionController.set_pool_shares`)."""
        self._resolve(self._controller.set_pool_shares(shares, self._time(now)))

    def adopt_limit(
        self, replica: str, value: float, reason: str, now: float | None = None
    ) -> None:
        """Take another process's learned running limit for `replica` (shared state)."""
        self._resolve(self._controller.adopt_limit(replica, value, reason, self._time(now)))

    def reconfigure(self, config: AdmissionConfig, router: Router | None = None) -> None:
        """Reloaded admission settings (and routing policy), from now on."""
        self._resolve(self._controller.reconfigure(config, router, self._loop.time()))
        self._rearm()

    def advance(self, now: float | None = None) -> None:
        """Let time act now (expiries, time-driven settling), e.g. after a tenant's share
        grew; the expiry task does this at every deadline."""
        self._resolve(self._controller.advance(self._time(now)))

    # ---------------------------------------------------------------- delivery
    def _resolve(self, events: Events) -> None:
        """Deliver verdicts the controller produced for queued requests."""
        for v in events:
            fut = self._waiters.pop(v.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(v)
            elif isinstance(v, Admit):
                # Its waiter is gone (cancelled in the same loop iteration): give the
                # reservation straight back so it cannot leak.
                log.debug("admission for departed request %s returned", v.request_id)
                self.request_ended(RequestEnd(v.request_id))

    def next_deadline(self) -> float | None:
        """When time next acts on admission (`AdmissionController.next_deadline`)."""
        return self._controller.next_deadline()

    def _rearm(self) -> None:
        first = self.next_deadline()
        if first is not None and first < self._armed:
            self._wake.set()

    # ---------------------------------------------------------------- deadlines
    async def _expiry_loop(self) -> None:
        ctrl = self._controller
        while True:
            deadline = self.next_deadline()
            self._armed = deadline if deadline is not None else math.inf
            self._wake.clear()
            if deadline is None or deadline == math.inf:
                await self._wake.wait()
            else:
                delay = deadline - self._loop.time()
                if delay > 0:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(delay):
                            await self._wake.wait()
            try:
                self._resolve(ctrl.advance(self._loop.time()))
            except Exception:  # a bug here must not stop deadline enforcement for good
                log.exception("admission expiry failed")
