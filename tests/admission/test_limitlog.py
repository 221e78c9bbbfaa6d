"""What the admission rule lets a replica run is kept with what binds it
(admission/limitlog.py): each change of the count, at most `HISTORY` of them."""

from __future__ import annotations

from admission.limitlog import HISTORY, LimitHistory
from tests.admission.helpers import controller, replica


def test_a_cap_and_a_share_are_kept_as_what_binds() -> None:
    c = controller()
    c.upsert_replica(replica("r1", 10_000), 0.0)
    assert c.report.limit_history("r1").changes == type(c.report.limit_history("r1").changes)()
    c.set_pool_share("r1", None, 1.0, running=3)
    c.upsert_replica(replica("r1", 10_000, max_running=2), 2.0)
    c.set_pool_share("r1", None, 3.0)
    history = c.report.limit_history("r1")
    assert history is not None
    assert [(ch.before, ch.after, ch.reason) for ch in history.changes] == [
        (None, 3, "share"),
        (3, 2, "cap"),
    ]
    assert "limit pool -> 3 (share)" in history.changes[0].describe()
    usage = c.report.replica_usage()[0]
    assert (usage.limit, usage.limit_reason) == (2, "cap")


def test_the_history_keeps_the_last_changes_numbered() -> None:
    h = LimitHistory()
    for i in range(HISTORY + 5):
        h.record(float(i), i + 1, i + 2, "deadline")
    assert len(h.changes) == HISTORY and h.count == HISTORY + 5
    assert [c.seq for c in h.since(HISTORY + 3)] == [HISTORY + 4, HISTORY + 5]
    assert h.since(0)[0].seq == 6  # the first five are gone
