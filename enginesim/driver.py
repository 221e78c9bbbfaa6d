"""The wall-clock driver of the sans-IO engine core.

`EngineCore` is a synchronous state machine on a virtual clock: it is told `now`, plans one
engine step, and says how long that step takes and what happens at its end. This driver
gives it a clock that follows the wall clock scaled by `speed` (speed 20 runs a test twenty
times faster, yet every token still streams at its simulated moment relative to the
others) and turns its events into per-request asyncio queues for the HTTP handlers.

One background task owns the core's stepping. While the core has work it plans a step at
the current virtual time, sleeps until the wall moment the step ends, and then delivers
the step's events. When the core is idle the task waits on an event that new requests
set; the virtual clock keeps following wall time meanwhile, so an idle gap of one second
is one (scaled) second of simulated idleness, as it would be on a real engine. Requests
that arrive mid-step join at the next step, as on a real engine.

When the host cannot keep up (a step's end has passed in virtual time by the moment the
loop gets to deliver it: a timer that fired late, or a `speed` higher than the event loop
can pace), the virtual clock slips back to the step's end instead of running ahead of the
engine. Simulated timings therefore stay exactly the core's (back-to-back steps stay
back-to-back) and only the wall-clock pace drops; `slipped` says by how much. Time spent
hung is not slipped: a hang is part of what the simulated clients experience.

Latency histograms are observed here, at delivery, in virtual seconds, as a client of the
simulated engine would measure them (the `slow` fault and hangs included).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from enginesim.metrics import EngineMetrics
from enginesim.types import EngineEvent, EventKind, SimRequest, StepResult

log = logging.getLogger(__name__)


class CoreLike:
    """The part of `enginesim.core.EngineCore` the driver uses (documentation only)."""

    def add_request(self, request: SimRequest, now: float) -> None: ...
    def abort(self, request_id: str, now: float) -> bool: ...
    def has_work(self) -> bool: ...
    def step(self, now: float) -> StepResult: ...


@dataclass(slots=True, eq=False)
class RequestHandle:
    """A request in flight: its event queue and the timestamps its latency metrics need.

    The queue carries TOKENS events followed by exactly one terminal event (FINISHED,
    ABORTED, or FAILED when the engine answers with an error), and for a llama.cpp core a
    STARTED event first, when a slot takes the request. PREEMPTED events are not
    forwarded: a client cannot see a preemption except as a pause in the stream.
    """

    request_id: str
    arrival: float
    queue: asyncio.Queue[EngineEvent] = field(default_factory=asyncio.Queue)
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_tokens: int = 0
    done: bool = False

    async def next_batch(self) -> list[EngineEvent]:
        """Wait for the next event, then take every event already queued behind it.

        Events of one engine step arrive together; handing them over as one batch lets
        the streaming handler put a step's last tokens and its finish reason in one chunk.
        """
        batch = [await self.queue.get()]
        while not self.queue.empty():
            batch.append(self.queue.get_nowait())
        return batch


class EngineDriver:
    """Runs an engine core against the event loop's clock.

    `speed` scales virtual time against wall time; `slow_factor` (the `slow` fault)
    stretches each step. `pause()` freezes stepping (the `hang` fault) while the virtual
    clock keeps running. `on_tokens(n)` is called after every delivery of `n` tokens.
    """

    def __init__(
        self,
        core: CoreLike,
        *,
        speed: float = 1.0,
        metrics: EngineMetrics | None = None,
        on_tokens: Callable[[int], None] | None = None,
    ) -> None:
        if not speed > 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        self.core = core
        self.speed = float(speed)
        self.slow_factor = 1.0
        self._metrics = metrics
        self._on_tokens = on_tokens
        self._handles: dict[str, RequestHandle] = {}
        self._wake = asyncio.Event()
        self._running = asyncio.Event()
        self._running.set()
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wall0 = 0.0
        self._last_stamp = 0.0  # latest virtual time handed to the core
        # Net virtual seconds the clock was set back to stay on the engine's timeline
        # (positive: the host lagged; early timer wake-ups count negative).
        self.slipped = 0.0
        self.steps = 0  # engine steps taken, for tests and diagnostics

    # -- clock -------------------------------------------------------------------------

    def vnow(self) -> float:
        """Current virtual time in seconds since the driver started."""
        if self._loop is None:
            return 0.0
        return (self._loop.time() - self._wall0) * self.speed - self.slipped

    def _stamp(self) -> float:
        """The virtual time to hand the core; the clock never slips back before it."""
        now = self.vnow()
        self._last_stamp = max(self._last_stamp, now)
        return now

    def _wall_delay(self, vtime: float) -> float:
        return max(0.0, (vtime - self.vnow()) / self.speed)

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        if self._task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._wall0 = self._loop.time()
        self._task = self._loop.create_task(self._run(), name="enginesim-driver")

    async def stop(self) -> None:
        """Stop stepping and end every request in flight with an ABORTED event."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.abort_all()

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    # -- requests ----------------------------------------------------------------------

    def submit(self, request: SimRequest) -> RequestHandle:
        """Add a request to the core; raises ValueError if the core refuses it."""
        if request.request_id in self._handles:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        now = self._stamp()
        self.core.add_request(request, now)
        handle = RequestHandle(request_id=request.request_id, arrival=now)
        self._handles[request.request_id] = handle
        self._wake.set()
        return handle

    def abort(self, request_id: str) -> bool:
        """Abort a request in flight and free its blocks now. False if it already ended."""
        handle = self._handles.pop(request_id, None)
        if handle is None:
            return False
        handle.done = True
        self.core.abort(request_id, self._stamp())
        if self._metrics is not None:
            self._metrics.observe_aborted()
        self._wake.set()
        return True

    def abort_all(self) -> int:
        """Abort every request in flight; their handles receive an ABORTED event."""
        ids = list(self._handles)
        now = self.vnow()
        for rid in ids:
            handle = self._handles[rid]
            self.abort(rid)
            handle.queue.put_nowait(
                EngineEvent(kind=EventKind.ABORTED, request_id=rid, time=now, finish_reason="abort")
            )
        return len(ids)

    @property
    def num_in_flight(self) -> int:
        return len(self._handles)

    # -- hang --------------------------------------------------------------------------

    def pause(self) -> None:
        """Stop taking steps (in-flight requests stall) until resume()."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()
        self._wake.set()

    # -- the loop ----------------------------------------------------------------------

    async def _run(self) -> None:
        core = self.core
        # Where the engine's timeline continues from, when the clock has run past it only
        # because of the host (late timers, delivery work, wake-up latency).
        resume_at: float | None = None
        while True:
            if not self._running.is_set():
                await self._running.wait()
                resume_at = None  # a hang stays on the timeline
                continue
            if not core.has_work():
                self._wake.clear()
                if not core.has_work():
                    await self._wake.wait()
                    # Idle time is real time up to what woke us (an arrival or an abort);
                    # the wake-up latency after it is the host's, not the engine's.
                    resume_at = self._last_stamp
                continue
            if resume_at is not None:
                # Start exactly there: at high speeds even the microseconds between two
                # clock reads are a visible gap on the virtual timeline.
                now = max(resume_at, self._last_stamp)
                self.slipped += self.vnow() - now
                self._last_stamp = now
                resume_at = None
            else:
                now = self._stamp()
            result = core.step(now)
            self.steps += 1
            if result.duration <= 0.0 and not result.events:
                # Work exists but nothing can run now (e.g. the waiting requests need more
                # free blocks than there are): only an add or an abort changes that.
                self._wake.clear()
                await self._wake.wait()
                resume_at = self._last_stamp
                continue
            end = result.start + result.duration * self.slow_factor
            # Always yield, even when late, so handlers run between steps.
            await asyncio.sleep(self._wall_delay(end))
            if not self._running.is_set():
                # Hung mid-step: the step's output appears only once the engine resumes,
                # and the hang stays on the timeline.
                await self._running.wait()
                self._deliver(result.events, self.vnow())
                continue
            # Deliver exactly at the step's end on the virtual timeline, never before a
            # time already handed to the core; the next step starts there, as on a busy
            # engine: the clock is set back if the loop was late, forward if the timer
            # fired early (coarse timers round short sleeps).
            at = max(end, self._last_stamp)
            self._deliver(result.events, at)
            resume_at = at

    def _deliver(self, events: list[EngineEvent], now: float) -> None:
        metrics = self._metrics
        tokens = 0
        for ev in events:
            handle = self._handles.get(ev.request_id)
            if handle is None:  # aborted while the step ran
                continue
            if ev.kind is EventKind.TOKENS:
                if not ev.token_ids:
                    continue
                if metrics is not None:
                    if handle.first_token_at is None:
                        metrics.observe_first_token(now - handle.arrival)
                    else:
                        metrics.observe_inter_token(now - (handle.last_token_at or now))
                if handle.first_token_at is None:
                    handle.first_token_at = now
                handle.last_token_at = now
                handle.num_tokens += len(ev.token_ids)
                tokens += len(ev.token_ids)
                handle.queue.put_nowait(ev)
            elif ev.kind is EventKind.FINISHED:
                del self._handles[ev.request_id]
                handle.done = True
                if metrics is not None:
                    metrics.observe_finished(now - handle.arrival, ev.finish_reason or "stop")
                handle.queue.put_nowait(ev)
            elif ev.kind is EventKind.ABORTED or ev.kind is EventKind.FAILED:
                del self._handles[ev.request_id]
                handle.done = True
                if metrics is not None:
                    metrics.observe_aborted()
                handle.queue.put_nowait(ev)
            elif ev.kind is EventKind.STARTED:
                handle.queue.put_nowait(ev)
            # PREEMPTED: counted by the core's stats; nothing to tell the client.
        if tokens and self._on_tokens is not None:
            self._on_tokens(tokens)
