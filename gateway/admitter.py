"""The asyncio side of admission: waiting for queued requests and expiring deadlines.

The `AdmissionController` is a synchronous state machine. It answers `submit` with
Admit / Queued / Shed / Refuse, and any call that frees or adds capacity (`release`,
`upsert_replica`, `pump`) returns the queued requests it admitted as a result. This
bridge owns the futures the queued handlers await and routes every such verdict to its
waiter, in one place, so no call site can forget to hand an admission out.

Deadlines (of queued requests, and of abandoned reservations held while their engine
may still be generating) are enforced by one background task that sleeps until the
controller's `next_deadline()` and then calls `expire`. It is woken when a new entry may have moved
the earliest deadline forward. Time is always the event loop's monotonic clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Iterable

from admission.controller import AdmissionController
from admission.types import AdmissionRequest, Admit, Completion, Queued, Refuse, Shed

log = logging.getLogger("kvgate.admission")


class AdmissionBridge:
    def __init__(self, controller: AdmissionController) -> None:
        self.controller = controller
        self._loop = asyncio.get_running_loop()
        self._waiters: dict[str, asyncio.Future[Admit | Shed]] = {}
        self._wake = asyncio.Event()
        self._armed = math.inf  # the deadline the expiry task currently sleeps towards
        self._task: asyncio.Task[None] | None = None

    def now(self) -> float:
        return self._loop.time()

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._task is None:
            self._task = self._loop.create_task(self._expiry_loop(), name="kvgate-expiry")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
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
    async def admit(self, req: AdmissionRequest) -> tuple[Admit | Shed | Refuse, bool]:
        """Submit `req`; if queued, wait for its Admit or Shed.

        Returns (verdict, queued). Cancellation (client disconnect) propagates; the caller
        releases in ``finally``, which also drops the queue entry.
        """
        now = self._loop.time()
        verdict = self.controller.submit(req, now)
        # A full queue may have given another tenant's entry up for this one.
        self.resolve(self.controller.take_displaced())
        if not isinstance(verdict, Queued):
            return verdict, False
        return await self.wait_queued(req.request_id), True

    def expect(self, request_id: str) -> asyncio.Future[Admit | Shed]:
        """Register the waiter of a request the controller just queued (its `submit`
        answered Queued), before anything else can admit or shed it: a verdict for a
        request nobody waits for is taken for a departed client's and given back."""
        fut: asyncio.Future[Admit | Shed] = self._loop.create_future()
        self._waiters[request_id] = fut
        first = self.controller.next_deadline()
        if first is not None and first < self._armed:
            self._wake.set()  # this entry may expire before what the task sleeps towards
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
            self._waiters.pop(request_id, None)

    def release(self, request_id: str, completion: Completion | None = None) -> None:
        """Free a reservation or queue entry (idempotent) and hand out what that admits."""
        self.resolve(self.controller.release(request_id, self._loop.time(), completion))

    def abandon(self, request_id: str, completion: Completion | None = None) -> None:
        """Hold the reservation of a request whose engine may still be generating it
        (`AdmissionController.abandon`); the expiry task ends the hold at its deadline."""
        self.resolve(self.controller.abandon(request_id, self._loop.time(), completion))
        first = self.controller.next_deadline()
        if first is not None and first < self._armed:
            self._wake.set()

    def resolve(self, verdicts: Iterable[Admit | Shed]) -> None:
        """Deliver verdicts the controller produced for queued requests."""
        for v in verdicts:
            fut = self._waiters.pop(v.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(v)
            elif isinstance(v, Admit):
                # Its waiter is gone (cancelled in the same loop iteration): give the
                # reservation straight back so it cannot leak.
                log.debug("admission for departed request %s returned", v.request_id)
                self.release(v.request_id)

    # ---------------------------------------------------------------- deadlines
    async def _expiry_loop(self) -> None:
        ctrl = self.controller
        while True:
            deadline = ctrl.next_deadline()
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
            now = self._loop.time()
            try:
                self.resolve(ctrl.expire(now))
                # Shedding can unblock entries behind the shed ones; pump hands out those
                # admissions now instead of at the next unrelated release.
                self.resolve(ctrl.pump(now))
            except Exception:  # a bug here must not stop deadline enforcement for good
                log.exception("admission expiry failed")
