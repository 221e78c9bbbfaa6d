"""The running ceiling of one replica, learned online from what it measures (sans-IO).

Seed 000 names three ceilings: KV capacity, the running-request cap and the per-user
latency SLO, the latency one usually binding first (seed 001's card holds more of that
job's requests in its KV pool than it serves inside a 45 s client timeout: measured in
docs/benchmarks.md). The ledger enforces the KV ceiling; a configured or engine-reported
cap is an upper bound. This module learns the rest, per replica, so that no operator has
to run the ceiling sweep and copy its answer.
Each change of the allowed count is kept with its evidence (`admission/learned/limitlog.py`).

The limit L is the number of requests kvgate lets run on the replica at once. It moves
on evidence, one *window* at a time. A window is at least ``LIMIT_WINDOW`` (and at least
L) requests that completed after they were admitted under the current limit, so every
window measures the replica at one setting: requests admitted under an earlier limit
are ignored, as a sweep step ignores its warm-up.

Per window:

* **Latency.** Each completion is scored twice. Against its client's own timeout (the
  openai SDKs send it): its service time, for a stream its time to first token, over
  ``latency_budget_fraction`` of that timeout (or more: `latency_ratio`); the slowest counts,
  since a client times out on the tail. Against the model's configured targets
  (`LatencyTargets`: TTFT, inter-token latency, end-to-end): the window's
  ``target_quantile`` (the median user by default, as seed 000's per-user decode rate
  is) counts. A failed request (an upstream timeout, or a client that left at the
  timeout it declared) scores ``FAILURE_RATIO``. Each score is aimed at from a little
  inside (``_INSIDE_HARD``, ``_INSIDE_SOFT``). When the worse of the two is over its aim
  by ``r`` > 1.05 (between the aim and that, the limit holds: no dithering), the limit
  goes to ``mean_running / r``, within [0.5, 0.9] of the current limit: past the knee,
  latency grows in proportion to concurrency, so this lands at the aim. This is the
  latency ceiling, and it is what follows a replica that slows down and comes back.
* **Growth.** While the replica is kept busy and latency allows it, the limit grows:
  from a cold start as TCP's slow start, one more per request served under half its
  aim, so it doubles in about one service time and a burst on a healthy replica is not
  queued; never past what that completion predicts (its load over its score). (What
  admission takes is bounded besides by the room the running requests leave,
  admission/room.py.)
  Slow start ends at a window whose slowest came past half its aim (TCP's ssthresh) or
  at any cut. From then on the limit grows by ``LIMIT_PROBE_STEP`` per window, never
  past what the latency score predicts (``mean_running / r``; ``1 / e`` as far where
  service grows by a share ``e`` of the load's, an upper estimate). A replica not kept
  busy (mean running under 80% of the limit) holds.
* **Failures.** A request the replica failed (an upstream error or timeout, a client
  that left at its timeout while being served) scores ``FAILURE_RATIO``; one whose client
  left after the queue took most of its budget brings the service it got, a lower bound
  (admission/learning.py): the queue's misjudgement is not the replica's slowness. The mean
  running is measured between a window's first and last completions (no warm-up in it).

Between windows, the engine's preemptions act at once (each discovery round): when its
counter rose, the limit drops to 75% of the most that ran since the last round (the count
at this instant may be a lull).

Rules measured and deleted, as the scenario matrix (bench/matrix.py) lost nothing
without them: a goodput knee that stopped growth, judging each cut and giving back one
that bought no latency, holding where the service's slope in the load was flat, a cut
to what the engine runs while requests waited in it, and slow start bounded by the
running requests' deadline room (docs/admission.md).

The limit is a float kept within [1, cap]; the controller uses its floor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from admission.config import AdmissionConfig
from admission.learned.limitlog import LimitHistory, Seen

FAILURE_RATIO = 2.0
_INSIDE_HARD = 0.85  # aim this far inside a client's timeout budget (its slowest request)
_INSIDE_SOFT = 0.95  # and this far inside a configured target (its quantile)
_SLOW_START_END = 0.5  # slow start ends at a window whose slowest is this far to its aim
_BAND = 1.05  # cut only when a score is this far past its aim; between, the limit holds
# Completions per window (at least; and at least the limit): a window's slowest and its
# quantile are then a measurement of the setting, not of one request.
LIMIT_WINDOW = 16
# Growth per busy window out of slow start: a step past the knee costs about this share
# more latency for one window before the latency score cuts it back.
LIMIT_PROBE_STEP = 0.15
# A latency cut lands within these shares of the limit: one window's score moves it at
# most by half, and always by a tenth (a cut that changes nothing measures nothing).
_CUT_LEAST = 0.5
_CUT_MOST = 0.9
# A window whose mean running stayed under this share of the limit did not keep the
# replica busy: it is no evidence for more.
_KEPT_BUSY = 0.8
# On a preemption the limit drops to this share of the most that ran since the last round.
_PREEMPTION_CUT = 0.75


_DEFAULT = AdmissionConfig.model_fields  # one place for each default: the settings'


@dataclass(slots=True, frozen=True)
class LimitSettings:
    """The knobs of `RunningLimit`: `AdmissionConfig`'s settings (by their own defaults
    unless given) and this module's constants (`from_config` reads both)."""

    initial: float = _DEFAULT["initial_limit"].default
    window: int = LIMIT_WINDOW
    budget_fraction: float = _DEFAULT["latency_budget_fraction"].default
    probe_step: float = LIMIT_PROBE_STEP
    target_quantile: float = _DEFAULT["latency_target_quantile"].default

    @classmethod
    def from_config(cls, config: AdmissionConfig) -> LimitSettings:
        return cls(
            initial=config.initial_limit,
            window=LIMIT_WINDOW,
            budget_fraction=config.latency_budget_fraction,
            probe_step=LIMIT_PROBE_STEP,
            target_quantile=config.latency_target_quantile,
        )


class RunningLimit:
    """The learned running limit of one replica."""

    __slots__ = (
        "_s",
        "value",
        "reason",
        "_slow_start",
        "_changed_at",
        "_count",
        "_hard",
        "_soft",
        "_started",
        "_area",
        "_running",
        "_last",
        "_preemptions",
        "windows",
        "others",
        "_opened",
        "_peak",
        "_slope",
        "history",
    )

    def __init__(self, settings: LimitSettings, now: float = 0.0) -> None:
        self._s = settings
        self.value = max(1.0, settings.initial)
        self.reason = "cold_start"
        self._slow_start = True
        self._changed_at = now
        self._opened = self.value  # the limit when the window opened
        self._count = 0  # completions in the window
        self._hard: list[float] = []  # ratios against clients' own timeouts
        self._soft: list[float] = []  # ratios against configured latency targets
        self._started = now
        self._area = 0.0  # integral of running requests over the window
        self._running = 0
        self._peak = 0  # most running since the last engine round
        self._slope: Callable[[], float] | None = None  # service's growth in load, or None
        self._last = now
        self._preemptions: float | None = None
        self.windows = 0
        # Requests other gateway processes run on the replica (shared state): the limit
        # is the replica's, so it judges the whole load, not this process's part.
        self.others = 0
        self.history = LimitHistory()  # each change of the allowed count, with its evidence

    @property
    def slow_start(self) -> bool:
        """Whether it still grows as slow start does (one more per request in time)."""
        return self._slow_start

    def allowed(self, cap: int | None) -> int:
        """Requests that may run now: floor of the limit, within the hard cap."""
        n = max(1, int(self.value))
        return n if cap is None else min(n, cap)

    # ------------------------------------------------------------------ inputs
    def running_changed(self, running: int, now: float) -> None:
        """The replica's admitted request count is now `running`."""
        if now > self._last:
            self._area += (self._running + self.others) * (now - self._last)
            self._last = now
        self._running = running
        self._peak = max(self._peak, running)

    def completed(
        self,
        now: float,
        admitted_at: float,
        *,
        ok: bool,
        ratio: tuple[float | None, float | None],
        cap: int | None,
        load: float | None = None,
        slope: Callable[[], float] | None = None,
    ) -> None:
        """A request admitted at `admitted_at` ended at `now`; `ratio` is its measured /
        target latency ratio against its client's timeout and against the configured
        targets (`latency_ratio`; None where it had none); `load` the number running
        while it was served (None: what runs now)."""
        hard, soft = ratio
        if not ok and hard is None:
            # Failed by the replica (an upstream error or timeout, a client that left at
            # its timeout while being served).
            hard = FAILURE_RATIO
        self._slope = slope
        if self._slow_start and ok:
            self._slow_grow(hard, soft, cap, load, now)
        if admitted_at < self._changed_at:
            return  # admitted under an earlier limit: no evidence about this one
        if self._count == 0:
            # The mean running is measured between completions: from the first counted one
            # on, so the requests started before it do not dilute it.
            self._started = now
            self._area = 0.0
            self._last = now
        self._count += 1
        if hard is not None:
            self._hard.append(hard)
        if soft is not None:
            self._soft.append(soft)
        # Slow start needs less evidence to double than a cut or a probe; and
        # the limit as the window opened (slow start grows it under a window's feet).
        window = self._s.window // 2 if self._slow_start else self._s.window
        window = max(window, math.ceil(self._opened))
        if self.others > 0:
            # Processes sharing the replica (gateway/state/sharing.py) each see their part of
            # its completions: this one's part of the evidence is its part of the load.
            own = max(1, self._running)
            window = max(2, math.ceil(window * own / (own + self.others)))
        if self._count > window:
            self._close_window(now, cap)

    def _slow_grow(
        self,
        hard: float | None,
        soft: float | None,
        cap: int | None,
        load: float | None,
        now: float,
    ) -> None:
        """Slow start, as TCP's: one more per request served in time while the replica
        is kept busy, so the limit doubles in about one service time, not one window.
        Never past what this completion's latency predicts the replica takes
        (``load / ratio``, the load it was served at: past the knee latency grows with
        the batch, and while the limit grows a completion reports a lighter load than
        runs now), nor the cap."""
        running = self._running + self.others
        if running < self.allowed(cap):
            return  # not kept busy: no evidence for more
        scores = []
        if hard is not None:
            scores.append(hard / _INSIDE_HARD)
        if soft is not None:
            scores.append(soft / _INSIDE_SOFT)
        ratio = max(scores) if scores else 0.0
        if ratio > _SLOW_START_END:
            return  # no evidence for more; the window judges whether slow start ends
        served_at = running if load is None else min(running, load + self.others)
        predicted = served_at / ratio if ratio > 0 else math.inf
        value = min(self.value + 1.0, predicted, float(cap) if cap is not None else math.inf)
        if value > self.value:
            self.history.record(now, int(self.value), int(value), "slow_start", served_at, ratio, 1)
            self.value = value
            self.reason = "slow_start"

    def engine_signals(
        self, *, preemptions_total: float | None, running: int, now: float, cap: int | None
    ) -> None:
        """One discovery round's preemption counter, against what kvgate holds there."""
        running += self.others  # what every gateway process holds there
        # The engine preempted at some moment since the last round, when up to the peak
        # ran: a cut is judged against that, not against a lull at this instant.
        peak = max(running, self._peak + self.others)
        self._peak = self._running
        if preemptions_total is None:
            return
        before = self._preemptions
        self._preemptions = preemptions_total
        # While more run than the limit allows, the excess was admitted under an earlier,
        # larger limit: preemptions then are that limit's doing, already judged. Judged
        # on the peak: a burst can end before the round that sees its preemptions.
        if (
            before is not None
            and preemptions_total > before
            and 0 < peak <= max(1, int(self.value))
        ):
            self._slow_start = False
            self._set(
                min(self.value, peak) * _PREEMPTION_CUT, "preemption", now, cap, (peak, None, 0)
            )

    def adopt(self, value: float, now: float, reason: str = "shared") -> None:
        """Take `value` learned by another gateway process for the same replica (shared
        state): it measured the same replica, so this process starts from it. The window
        restarts, as after any change."""
        if value >= 1.0 and value != self.value:
            self._slow_start = False
            if int(value) != int(self.value):
                self._changed_at = now
            self.history.record(now, int(self.value), int(value), reason)
            self.value = value
            self.reason = reason
            self._reset_window(now)

    # ------------------------------------------------------------------ the window
    def _close_window(self, now: float, cap: int | None) -> None:
        self.running_changed(self._running, now)
        span = now - self._started
        if span <= 0:
            return
        self.windows += 1
        mean_running = self._area / span
        # Clients' timeouts are hard: the window's slowest request counts. Targets are
        # service levels: their quantile (the median user by default, as seed 000's
        # "per-user decode rate" is) counts. Each is aimed at from a little inside.
        aims: list[float] = []
        if self._hard:
            aims.append(max(self._hard) / _INSIDE_HARD)
        if self._soft:
            aims.append(_quantile(self._soft, self._s.target_quantile) / _INSIDE_SOFT)
        ratio = max(aims) if aims else None  # 1.0 = exactly at the aimed-at point
        base = max(1.0, mean_running)
        seen = (mean_running, ratio, self._count)  # the evidence a change records
        if ratio is not None and ratio > _BAND:
            self._slow_start = False
            lo, hi = _CUT_LEAST * self.value, _CUT_MOST * self.value
            self._set(min(hi, max(lo, base / ratio)), "latency", now, cap, seen)
            return
        # The setting the window measured: the limit as it opened (slow start grows it
        # during the window, and what runs follows with a lag).
        allowed = min(self.allowed(cap), max(1, int(self._opened)))
        if mean_running < _KEPT_BUSY * allowed:
            self._reset_window(now)  # not kept busy: no evidence for more, hold
            return
        if self._slow_start:
            if ratio is None or ratio <= _SLOW_START_END:
                self._reset_window(now)  # growth is per completion (`_slow_grow`)
                return
            # A window whose slowest came past half its aim (TCP's ssthresh) ends it:
            # from here each window probes, judged at one setting.
            self._slow_start = False
        value, reason = max(self.value * (1.0 + self._s.probe_step), self.value + 1.0), "probe"
        if ratio is not None and ratio > 0:
            in_time = max(self.value, self._in_time(base, ratio))
            if in_time <= value:
                value, reason = in_time, "latency"
        if cap is not None and value >= cap:
            reason = "running_cap"
        self._set(value, reason, now, cap, seen)

    def _in_time(self, base: float, ratio: float) -> float:
        """The load at which the window's score would reach its aim, for growth: in
        proportion, or ``1 / e`` as far where service grows by a share ``e`` of that."""
        e = self._slope() if self._slope is not None and ratio < 1.0 else 1.0
        return base / ratio if e >= 1.0 else base * (1.0 + (1.0 / ratio - 1.0) / max(e, 1e-9))

    def _set(self, value: float, reason: str, now: float, cap: int | None, seen: Seen) -> None:
        hi = float(cap) if cap is not None else math.inf
        value = min(max(1.0, value), hi)
        if int(value) != int(self.value):
            self._changed_at = now
            self.history.record(now, int(self.value), int(value), reason, *seen)
        self.value = value
        self.reason = reason
        self._reset_window(now)

    def _reset_window(self, now: float) -> None:
        self._opened = self.value
        self._count = 0
        self._hard = []
        self._soft = []
        self._started = now
        self._area = 0.0
        self._last = now


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
