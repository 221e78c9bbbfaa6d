"""The phase-aware timeout of one relayed stream (first byte, idle gap, total, and the
client's write timeout), with one timer."""

from __future__ import annotations

import asyncio


class StreamWatchdog:
    """The phase-aware timeout of one stream with one timer, re-armed only when it fires.

    Re-arming a timer on every chunk (``asyncio.Timeout.reschedule``: a cancelled and a
    new timer handle) cost more than the rest of the relay's per-chunk work. Here the
    relay only notes the time of the last upstream read (``last``) and whether it is
    writing to the client (``writing``, since ``write_since``); when the timer fires, it
    checks the deadline that applies now (first byte, idle gap from ``last``, total;
    while writing the client's write timeout from ``write_since``, within the total) and
    either re-arms for it or cancels the task, which `expired` then tells
    apart from any other cancellation (as ``asyncio.timeout`` does)."""

    __slots__ = (
        "_loop",
        "_task",
        "_handle",
        "_first",
        "_idle",
        "_total",
        "_write",
        "last",
        "writing",
        "write_since",
        "_armed",
        "_fired",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        first: float,
        idle: float,
        total: float,
        write: float,
    ) -> None:
        self._loop = loop
        self._task = asyncio.current_task()
        self._first, self._idle, self._total, self._write = first, idle, total, write
        self.last: float | None = None  # loop time after the last upstream read
        self.writing = False
        self.write_since = 0.0  # loop time the current write to the client began
        self._fired = False
        self._armed = first  # when the timer fires next
        self._handle: asyncio.TimerHandle | None = loop.call_at(first, self._check)

    def begin_write(self, now: float) -> None:
        """A write to the client begins: it must end within the write timeout. The timer
        is re-armed only when it would fire later than that (with the defaults, the
        engine's idle bound comes first and nothing is re-armed)."""
        self.write_since = now
        self.writing = True
        due = now + self._write
        if self._handle is not None and self._armed > due:
            self._handle.cancel()
            self._armed = due
            self._handle = self._loop.call_at(due, self._check)

    def _check(self) -> None:
        now = self._loop.time()
        if self.writing:
            due = min(self.write_since + self._write, self._total)
        elif self.last is None:
            due = self._first
        else:
            due = min(self.last + self._idle, self._total)
        if now < due:
            self._armed = due
            self._handle = self._loop.call_at(due, self._check)
            return
        self._handle = None
        if self._task is not None:
            self._fired = True
            self._task.cancel()

    def expired(self) -> bool:
        """True when this watchdog cancelled the task and nothing else did too."""
        return self._fired and self._task is not None and self._task.uncancel() == 0

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
