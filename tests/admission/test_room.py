"""The deadline room (admission/room.py): a replica takes no more requests than its
running requests' deadlines allow."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest

from admission.room import deadline_room
from admission.service import ServiceModel
from admission.types import Admit, Completion, Queued, Shed
from tests.admission.helpers import controller, replica, request, served_one_by_one


@dataclass
class _Running:
    due: float
    admitted_at: float
    prompt_tokens: int = 400
    output_tokens: int = 100


def _service(seconds: float, load: float) -> ServiceModel:
    """Every sample the same: `seconds` at `load` (no margin; elasticity 1)."""
    s = ServiceModel()
    for _ in range(8):
        s.add(400, 100, seconds, load=load)
    return s


def test_the_room_is_the_load_at_which_the_tightest_running_request_still_ends_in_time() -> None:
    service = _service(2.0, load=2)
    # At load 4 its service is 4 s, 3 s of it left at t = 1, and its client leaves at t =
    # 3.4: at a load L it has 3 x L / 4 s left, which ends in time while L <= 4 x 2.4 / 3.
    tight = _Running(due=3.4, admitted_at=0.0)
    easy = _Running(due=100.0, admitted_at=0.0)
    assert deadline_room(service, 4, [easy, tight], 1.0) == pytest.approx(4 * 2.4 / 3)
    # A client already gone, or a request the prediction has done, keeps nothing.
    gone = _Running(due=0.5, admitted_at=0.0)
    done = _Running(due=10.0, admitted_at=-5.0)
    assert deadline_room(service, 4, [gone, done], 1.0) == math.inf
    # Nothing bounded, or no service seen yet: no room to keep.
    assert deadline_room(service, 4, [], 1.0) == math.inf
    assert deadline_room(ServiceModel(), 4, [tight], 1.0) == math.inf


@pytest.mark.parametrize("budget", [5.0, None])
def test_a_replica_takes_no_more_than_a_running_requests_deadline_allows(budget) -> None:
    """Service took 2 s alone and grows in proportion to the load (elasticity 1 until
    loads spread). A request whose client leaves after 5 s, admitted alone, ends in time
    at a load up to 2.5 (2 x L s within 5): the replica takes one more beside it and
    queues the rest, naming the ceiling, until it ends. A request whose client states no
    deadline (and whose clients' patience is not learned) keeps nothing: the pool alone
    bounds the replica."""
    ctrl = controller(min_drain_samples=1)
    ctrl.upsert_replica(replica("r1", 100_000), 0.0)
    now = served_one_by_one(ctrl, 16, 2.0)
    assert isinstance(ctrl.submit(request("tight", 400, 100, latency_budget=budget), now).verdict,
                      Admit)  # fmt: skip
    verdicts = [type(ctrl.submit(request(f"n{i}", 400, 100), now).verdict) for i in range(4)]
    (usage,) = ctrl.report.replica_usage()
    if budget is None:
        assert verdicts == [Admit, Admit, Admit, Admit]
        assert (usage.binding_ceiling, usage.limit, usage.limit_reason) == ("none", None, "kv")
        for rid in ("tight", "n0", "n1", "n2", "n3"):
            ctrl.release(rid, now + 2.0)
        assert ctrl.report.reserved_tokens() == 0
        return
    assert verdicts == [Admit, Queued, Queued, Queued]
    assert usage.binding_ceiling == "deadlines" and usage.running == 2
    assert (usage.limit, usage.limit_reason) == (2, "deadline")
    # A request that cannot wait longer is shed, told what binds.
    assert isinstance(ctrl.submit(request("hurry", 400, 100, latency_budget=0.1), now).verdict,
                      Queued)  # fmt: skip
    (shed,) = [e for e in ctrl.advance(now + 0.1) if isinstance(e, Shed)]
    assert shed.request_id == "hurry" and shed.binds == "running_deadlines", shed
    # A last retry out of time to start fails for sure if shed: it is taken all the same
    # (the room is an upper estimate's), the pool permitting.
    last = replace(request("last", 400, 100, latency_budget=0.1), last_retry=True)
    assert isinstance(ctrl.submit(last, now).verdict, Queued)
    assert [e.request_id for e in ctrl.advance(now + 0.1) if isinstance(e, Admit)] == ["last"]
    # When the tight one ends no deadline is at stake: the pool takes the rest.
    events = ctrl.release("tight", now + 4.0, Completion(service_s=4.0, prompt_tokens=400,
                                                         completion_tokens=100))  # fmt: skip
    assert [e.request_id for e in events if isinstance(e, Admit)] == ["n1", "n2", "n3"]
    for rid in ("n0", "n1", "n2", "n3", "last"):
        ctrl.release(rid, now + 6.0)
    assert ctrl.report.reserved_tokens() == 0 and ctrl.report.queue_depth() == 0


def test_a_cold_replica_takes_what_its_pool_fits_at_once() -> None:
    """The rule's first half: a fresh replica whose pool holds 20 requests, nothing
    learned, no deadline at stake, admits all 20 at once; the 21st waits for the pool
    (never a count), and every reservation returns."""
    ctrl = controller()
    ctrl.upsert_replica(replica("r1", 20 * 500), 0.0)
    verdicts = [type(ctrl.submit(request(f"c{i}", 400, 100), 0.0).verdict) for i in range(21)]
    assert verdicts == [Admit] * 20 + [Queued]
    (usage,) = ctrl.report.replica_usage()
    assert (usage.binding_ceiling, usage.limit, usage.limit_reason) == ("kv_capacity", None, "kv")
    for i in range(21):
        ctrl.release(f"c{i}", 1.0)
    assert ctrl.report.reserved_tokens() == 0 and ctrl.report.queue_depth() == 0


def test_a_cold_replica_with_stated_deadlines_still_takes_its_pool() -> None:
    """Before any service was seen nothing predicts a miss: stated deadlines do not make
    a cold replica queue (the first 20 of a pool for 20 start at once)."""
    ctrl = controller()
    ctrl.upsert_replica(replica("r1", 20 * 500), 0.0)
    for i in range(20):
        req = request(f"c{i}", 400, 100, latency_budget=45.0)
        assert isinstance(ctrl.submit(req, 0.0).verdict, Admit)
    for i in range(20):
        ctrl.release(f"c{i}", 1.0)
    assert ctrl.report.reserved_tokens() == 0


def test_a_21st_that_would_make_a_running_request_miss_waits_then_is_shed_with_when() -> None:
    """A replica whose pool holds 21 served 5 at once in 2.5 s and 20 at once in 10 s:
    service grows in proportion to the load (0.5 s per request running). Twenty run
    again, each with a stated 10.2 s: at 21 running each would take 10.5 s, past its
    deadline, so the 21st (predicted late itself too) waits while it can still start in
    time (a tenth of its budget: the prediction is an upper estimate), then is shed with
    a Retry-After for when it could start; once the twenty end, the next starts at once."""
    ctrl = controller(min_drain_samples=1)
    ctrl.upsert_replica(replica("r1", 21 * 500), 0.0)
    now = 0.0
    for n in (5, 20):  # two waves at different loads: the elasticity is learned
        for i in range(n):
            assert isinstance(ctrl.submit(request(f"w{n}-{i}", 400, 100), now).verdict, Admit)
        now += 10.0 * n / 20
        for i in range(n):
            done = Completion(service_s=10.0 * n / 20, prompt_tokens=400, completion_tokens=100)
            ctrl.release(f"w{n}-{i}", now, done)
    start = now
    for i in range(20):
        req = request(f"r{i}", 400, 100, latency_budget=10.2)
        assert isinstance(ctrl.submit(req, start).verdict, Admit), i
    now = start + 1.0
    verdict = ctrl.submit(request("late", 400, 100, latency_budget=10.2), now).verdict
    assert isinstance(verdict, Queued)
    (usage,) = ctrl.report.replica_usage()
    assert usage.binding_ceiling == "deadlines" and usage.limit_reason == "deadline"
    assert not ctrl.advance(now + 1.0)
    (shed,) = [e for e in ctrl.advance(now + 1.02) if isinstance(e, Shed)]
    assert shed.request_id == "late" and shed.binds == "running_deadlines"
    assert shed.retry_after > 0
    for i in range(20):
        ctrl.release(f"r{i}", start + 10.0, Completion(service_s=10.0, prompt_tokens=400,
                                                       completion_tokens=100))  # fmt: skip
    assert isinstance(ctrl.submit(request("next", 400, 100, latency_budget=10.2),
                                  start + 10.0).verdict, Admit)  # fmt: skip
    ctrl.release("next", start + 20.0)
    assert ctrl.report.reserved_tokens() == 0 and ctrl.report.queue_depth() == 0
