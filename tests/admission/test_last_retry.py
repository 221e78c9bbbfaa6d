"""A client's last retry (the openai SDKs say which retry an attempt is; a plain client's
last is known once its budget is learned): shed, it fails for sure, so it is never shed
on an estimate, and when its time to start runs out it may run one over the learned limit
(never over a cap) before it is shed."""

from __future__ import annotations

from dataclasses import replace

from admission.types import AdmissionRequest, Admit, Queued, Shed
from tests.admission.helpers import controller, filled, replica, request, sheds


def last(rid: str, prompt: int, output: int, *, deadline: float) -> AdmissionRequest:
    return replace(request(rid, prompt, output, deadline=deadline), last_retry=True)


def test_a_last_retry_is_queued_where_an_estimate_would_shed_it_until_its_deadline() -> None:
    ctrl = controller()
    now = filled(ctrl)
    # The pool is full and about 0.4 s of draining away: a first attempt that must be
    # served within 0.2 s is shed on the estimate, a last retry waits at the head.
    first = ctrl.submit(request("first", 100, 100, deadline=now + 0.2), now).verdict
    assert isinstance(first, Shed) and first.reason == "deadline"
    queued = ctrl.submit(last("last", 100, 100, deadline=now + 0.2), now).verdict
    assert isinstance(queued, Queued)
    # Re-estimated on expiry it still looks late, and stays. At its deadline there is
    # no learned limit to run over and the pool is full: it goes.
    assert sheds(ctrl.advance(now + 0.1)) == []
    assert ctrl.advance(now + 0.2) == []  # its one chance: nothing fits
    shed = sheds(ctrl.advance(now + 0.2))
    assert [(s.request_id, s.reason) for s in shed] == [("last", "queue_timeout")]
    for i in range(5):
        ctrl.release(f"run{i}", now + 1.0)
    assert ctrl.report.reserved_tokens() == 0


def test_a_last_retry_out_of_time_runs_one_over_the_learned_limit_never_over_a_cap() -> None:
    ctrl = controller(learn_limit=True, initial_limit=2)
    ctrl.upsert_replica(replica(capacity=10_000), 0.0)
    for i in range(2):
        assert isinstance(ctrl.submit(request(f"run{i}", 100, 100), 0.0).verdict, Admit)
    # A first attempt waits; two last retries queue ahead of it while their time lasts.
    assert isinstance(ctrl.submit(request("first", 100, 100, deadline=1.0), 0.0).verdict, Queued)
    for name in ("last1", "last2"):
        assert isinstance(ctrl.submit(last(name, 100, 100, deadline=2.0), 0.0).verdict, Queued)
    # A first attempt out of time is shed as ever: the chance is a last retry's.
    assert [(s.request_id, s.reason) for s in sheds(ctrl.advance(1.9))] == [
        ("first", "queue_timeout")
    ]
    # At their deadline: the first runs one over the limit, the second finds it taken.
    events = ctrl.advance(2.0)
    assert [a.request_id for a in events if isinstance(a, Admit)] == ["last1"]
    assert [(s.request_id, s.reason) for s in sheds(ctrl.advance(2.0))] == [
        ("last2", "queue_timeout")
    ]
    assert ctrl.report.replica_usage()[0].running == 3

    capped = controller(learn_limit=True, initial_limit=2)
    capped.upsert_replica(replica(capacity=10_000, max_running=2), 0.0)
    for i in range(2):
        capped.submit(request(f"run{i}", 100, 100), 0.0)
    assert isinstance(capped.submit(last("last", 100, 100, deadline=1.0), 0.0).verdict, Queued)
    capped.advance(1.0)
    assert [(s.request_id, s.reason) for s in sheds(capped.advance(1.0))] == [
        ("last", "queue_timeout")
    ]
    assert capped.report.replica_usage()[0].running == 2
