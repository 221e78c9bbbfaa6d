"""What moved a learned limit is kept with its evidence (admission/learned/limitlog.py): each
change of the allowed count, never a move within one count, at most `HISTORY` of them."""

from __future__ import annotations

from admission.learned.limit import LimitSettings, RunningLimit
from admission.learned.limitlog import HISTORY, LimitHistory
from tests.admission.test_limit import feed_window

SIGNALS = {"cap": None}


def test_a_latency_cut_is_kept_with_its_window() -> None:
    lim = RunningLimit(LimitSettings(initial=10, window=4))
    feed_window(lim, 0.0, running=10, ratio=1.7)  # slowest 1.7 / 0.85 = 2x its aim
    (change,) = lim.history.changes
    assert (change.before, change.after, change.reason) == (10, 5, "latency")
    assert change.running is not None and change.running > 9.0
    assert change.score is not None and abs(change.score - 2.0) < 1e-9
    # The window closes on the completion past its size (at least the limit, 10).
    assert change.completions == 11
    assert "limit 10 -> 5 (latency" in change.describe()
    assert "slowest at 2.00x its aim" in change.describe()


def test_a_preemption_is_kept_with_the_peak_that_ran() -> None:
    lim = RunningLimit(LimitSettings(initial=16))
    lim.running_changed(16, 0.5)
    lim.engine_signals(preemptions_total=0, running=16, now=1.0, **SIGNALS)
    lim.engine_signals(preemptions_total=3, running=16, now=2.0, **SIGNALS)
    (change,) = lim.history.changes
    assert (change.before, change.after, change.reason) == (16, 12, "preemption")
    assert (change.running, change.score, change.completions) == (16, None, 0)
    assert change.at == 2.0


def test_slow_start_steps_are_kept_and_a_move_within_one_count_is_not() -> None:
    lim = RunningLimit(LimitSettings(initial=2, window=16))
    lim.running_changed(2, 0.0)
    for i in range(3):
        lim.running_changed(int(lim.value), float(i))
        lim.completed(float(i) + 1, float(i), ok=True, ratio=(0.1, None), cap=None)
    assert [(c.before, c.after, c.reason) for c in lim.history.changes] == [
        (2, 3, "slow_start"),
        (3, 4, "slow_start"),
        (4, 5, "slow_start"),
    ]
    before = len(lim.history.changes)
    lim.adopt(5.5, 10.0)  # from a peer, within the same count
    assert len(lim.history.changes) == before
    lim.adopt(3.0, 11.0)
    assert (lim.history.changes[-1].after, lim.history.changes[-1].reason) == (3, "shared")


def test_the_history_keeps_the_last_changes_numbered() -> None:
    h = LimitHistory()
    for i in range(HISTORY + 5):
        h.record(float(i), i + 1, i + 2, "probe")
    assert len(h.changes) == HISTORY and h.count == HISTORY + 5
    assert [c.seq for c in h.since(HISTORY + 3)] == [HISTORY + 4, HISTORY + 5]
    assert h.since(0)[0].seq == 6  # the first five are gone
