"""One output channel: every call that changes the controller returns its own verdict
and every event it caused for other requests, and nothing is handed out by a later call
(h11's rule; admission/controller.py)."""

from __future__ import annotations

import pytest

from admission.types import Admit, Completion, Decision, Queued, Shed
from tests.admission.helpers import admits, controller, replica, request, sheds
from tests.admission.test_fairness import req
from tests.admission.test_prefix_share import agentic, chain, sharing_replica


def test_a_release_returns_the_admission_it_unblocks() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica(capacity=200), 0.0)
    assert isinstance(ctrl.submit(request("a", 100, 100), 0.0).verdict, Admit)
    assert isinstance(ctrl.submit(request("b", 100, 100), 0.0).verdict, Queued)
    assert ctrl.release("a", 1.0) == [Admit("b", "r1", 200)]
    assert ctrl.release("b", 2.0) == []
    assert ctrl.report.reserved_tokens() == 0


def test_a_submit_returns_the_entry_it_displaced_from_a_full_queue() -> None:
    ctrl = controller(queue_max_per_model=2)
    ctrl.upsert_replica(replica(capacity=100), 0.0)
    assert isinstance(ctrl.submit(req("a-0", "a"), 0.0).verdict, Admit)
    for rid in ("a-1", "a-2"):
        assert isinstance(ctrl.submit(req(rid, "a"), 0.0).verdict, Queued)
    # b holds less than its share of the two queue slots: a's last entry gives way, and
    # the newcomer's own decision carries that shed, so the caller answers it at once.
    decision = ctrl.submit(req("b-1", "b"), 0.0)
    assert isinstance(decision, Decision) and isinstance(decision.verdict, Queued)
    (displaced,) = decision.events
    assert isinstance(displaced, Shed)
    assert (displaced.request_id, displaced.reason, displaced.status) == ("a-2", "queue_full", 503)
    assert ctrl.report.queue_depth() == 2 and ctrl.report.tenant_queued("a") == 1
    # Nothing is left to hand out later: the next calls carry only their own events.
    assert ctrl.advance(0.0) == []
    assert ctrl.next_deadline() is None or ctrl.next_deadline() > 0.0
    for rid in ("a-0", "a-1", "b-1"):
        ctrl.release(rid, 1.0)
    assert ctrl.report.reserved_tokens() == 0 and ctrl.report.queue_depth() == 0


def test_a_submit_returns_the_earlier_entry_its_scan_admitted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # b waits for a's prefix to be computed (PREFIX_SETTLE_S); c's submit after that
    # scans the queue and admits b first: b's Admit is in c's decision, not kept for the
    # next call (this was `_pending`).
    monkeypatch.setattr("admission.ledger.PREFIX_SETTLE_S", 1.0)
    ctrl = controller()
    ctrl.upsert_replica(sharing_replica(capacity=1000), 0.0)
    prefix = chain("tenant", 40)
    assert isinstance(ctrl.submit(agentic("a", prefix, 500, 100), 0.0).verdict, Admit)
    assert isinstance(ctrl.submit(agentic("b", prefix, 500, 100), 0.5).verdict, Queued)
    decision = ctrl.submit(request("c", 10, 10), 1.0)
    assert [e.request_id for e in admits(decision.events)] == ["b"]
    assert ctrl.report.reservation("b") is not None
    for rid in ("a", "b", "c"):
        ctrl.release(rid, 2.0)
    assert ctrl.report.reserved_tokens() == 0


def test_advance_returns_expiries_then_what_they_unblocked() -> None:
    ctrl = controller(queue_timeout_s=10.0)
    ctrl.upsert_replica(replica(capacity=100), 0.0)
    assert isinstance(ctrl.submit(request("a", 40, 40), 0.0).verdict, Admit)
    assert isinstance(ctrl.submit(request("large", 40, 40, deadline=2.0), 0.0).verdict, Queued)
    assert isinstance(ctrl.submit(request("small", 5, 5), 0.0).verdict, Queued)
    events = ctrl.advance(2.0)
    assert [type(e).__name__ for e in events] == ["Shed", "Admit"]
    assert [e.request_id for e in events] == ["large", "small"]
    assert sheds(events)[0].reason == "queue_timeout"
    for rid in ("a", "small"):
        ctrl.release(rid, 3.0)
    assert ctrl.report.reserved_tokens() == 0


def test_advance_ends_an_overdue_hold_and_returns_the_admission_it_frees() -> None:
    ctrl = controller(abandoned_hold_s=5.0)
    ctrl.upsert_replica(replica(capacity=200), 0.0)
    assert isinstance(ctrl.submit(request("gone", 100, 100), 0.0).verdict, Admit)
    assert ctrl.abandon("gone", 1.0, Completion(ok=False)) == []
    assert isinstance(ctrl.submit(request("next", 100, 100), 1.0).verdict, Queued)
    assert ctrl.next_deadline() == 6.0
    assert ctrl.advance(5.9) == [] and ctrl.report.held() == 1
    assert ctrl.advance(6.0) == [Admit("next", "r1", 200)]
    assert ctrl.report.held() == 0
    ctrl.release("next", 7.0)
    assert ctrl.report.reserved_tokens() == 0


def test_returning_from_ejection_returns_the_admission() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica("r1", 100), 0.0)
    ctrl.upsert_replica(replica("r2", 100), 0.0)
    assert ctrl.set_ejected("r1", True, 0.0) == []
    assert ctrl.submit(request("x", 50, 50), 0.0).verdict == Admit("x", "r2", 100)
    assert isinstance(ctrl.submit(request("a", 50, 50), 0.0).verdict, Queued)
    assert ctrl.mark_unready("r2", 0.5) == []  # less room admits nobody
    assert ctrl.set_ejected("r1", False, 1.0) == [Admit("a", "r1", 100)]
    for rid in ("x", "a"):
        ctrl.release(rid, 2.0)
    assert ctrl.report.reserved_tokens() == 0


def test_adopting_a_larger_shared_limit_returns_the_admissions_it_allows() -> None:
    ctrl = controller(learn_limit=True, initial_limit=1)
    ctrl.upsert_replica(replica("r1", 10_000, max_running=8), 0.0)
    assert isinstance(ctrl.submit(request("a", 10, 10), 0.0).verdict, Admit)
    assert isinstance(ctrl.submit(request("b", 10, 10), 0.0).verdict, Queued)
    events = ctrl.adopt_limit("r1", 4.0, "shared", 1.0)
    assert [e.request_id for e in events] == ["b"]
    limit = ctrl.report.limit_of("r1")
    assert limit is not None and (limit.value, limit.reason) == (4.0, "shared")
    assert ctrl.adopt_limit("nowhere", 4.0, "shared", 1.0) == []
    for rid in ("a", "b"):
        ctrl.release(rid, 2.0)
    assert ctrl.report.reserved_tokens() == 0


def test_the_report_only_reads() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica(capacity=100), 0.0)
    report = ctrl.report
    mutators = {"submit", "release", "abandon", "advance", "top_up", "upsert_replica"}
    assert not mutators & set(dir(report))
    # A read changes nothing: the same reads give the same answers, the ledger is intact.
    before = (report.reserved_tokens(), report.queue_depth(), report.replica_usage())
    report.retry_after("m", 50, 0.0)
    report.pool_demand("r1")
    assert (report.reserved_tokens(), report.queue_depth(), report.replica_usage()) == before
    choices = report.ttft_choices
    try:
        choices["x"] = 1  # type: ignore[index]
    except TypeError:
        pass
    else:  # pragma: no cover - the mapping must refuse writes
        raise AssertionError("ttft_choices is writable")
    assert isinstance(ctrl.submit(request("a", 10, 10), 0.0).verdict, Admit)
    ctrl.release("a", 1.0)
