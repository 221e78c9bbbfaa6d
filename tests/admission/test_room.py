"""The deadline room (admission/room.py): a replica takes no more requests than its
running requests' deadlines allow."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest

from admission.binding import binding_ceiling
from admission.learned.service import ServiceModel
from admission.room import deadline_room
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


@pytest.mark.parametrize("budget", [1.5, None])
def test_a_replica_takes_no_more_than_a_running_requests_deadline_allows(
    budget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Service takes 2 s at the replica's load of 4. A request whose client leaves after
    1.5 s is late by that prediction; the load at which it still ends in time is 3
    (4 x (1 + (1.5 / 2 - 1))), so the replica takes two more beside it and queues the
    rest, naming the ceiling, until it ends. A request whose client states no deadline
    (and whose clients' patience is not learned) keeps nothing: the cap of 4 binds."""
    monkeypatch.setattr("admission.shedding.MIN_DRAIN_SAMPLES", 1)
    ctrl = controller()
    ctrl.upsert_replica(replica("r1", 100_000, max_running=4), 0.0)
    now = served_one_by_one(ctrl, 16, 2.0)
    assert isinstance(ctrl.submit(request("tight", 400, 100, latency_budget=budget), now).verdict,
                      Admit)  # fmt: skip
    verdicts = [type(ctrl.submit(request(f"n{i}", 400, 100), now).verdict) for i in range(4)]
    (usage,) = ctrl.report.replica_usage()
    if budget is None:
        assert verdicts == [Admit, Admit, Admit, Queued]
        assert usage.binding_ceiling == "running_cap"
        return
    assert verdicts == [Admit, Admit, Queued, Queued]
    assert usage.binding_ceiling == "deadlines" and usage.running == 3
    # A request that cannot wait longer is shed, told what binds.
    assert isinstance(ctrl.submit(request("hurry", 400, 100, latency_budget=0.1), now).verdict,
                      Queued)  # fmt: skip
    (shed,) = [e for e in ctrl.advance(now + 0.1) if isinstance(e, Shed)]
    assert shed.request_id == "hurry" and shed.binds == "running_deadlines", shed
    # A last retry out of time to start fails for sure if shed: it is taken all the same,
    # as it would be one past the learned limit (the room is an upper estimate's).
    last = replace(request("last", 400, 100, latency_budget=0.1), last_retry=True)
    assert isinstance(ctrl.submit(last, now).verdict, Queued)
    assert [e.request_id for e in ctrl.advance(now + 0.1) if isinstance(e, Admit)] == ["last"]
    # When the tight one ends, the cap of 4 binds again.
    events = ctrl.release("tight", now + 1.4, Completion(service_s=1.4, prompt_tokens=400,
                                                         completion_tokens=100))  # fmt: skip
    assert [e.request_id for e in events if isinstance(e, Admit)] == ["n2"]
    for rid in ("n0", "n1", "n2", "n3", "last"):
        ctrl.release(rid, now + 2.0)
    assert ctrl.report.reserved_tokens() == 0 and ctrl.report.queue_depth() == 0


def test_the_room_is_recomputed_when_the_load_the_replica_serves_at_moves() -> None:
    """The room is kept per replica between decisions (it walks the running requests).
    What moves the load a replica serves at recomputes it, as a reservation coming or
    going does: here the other processes' reservations there, which leave the pool room
    for two running in all (a top-up and a learned limit's change go the same way,
    through the views' `touch`)."""
    ctrl = controller()
    ctrl.upsert_replica(replica("r1", 100_000, max_running=4), 0.0)
    now = served_one_by_one(ctrl, 16, 2.0)
    tight = request("tight", 400, 100, latency_budget=1.5)
    assert isinstance(ctrl.submit(tight, now).verdict, Admit)
    ledger = ctrl._ledger
    rep = ledger.replicas["r1"]
    before = ledger.room(rep, now)
    ctrl.set_pool_share("r1", None, now, others_running=1, others_tokens=90_000)
    assert rep.serving_load == 2
    fresh = deadline_room(rep.service, rep.serving_load, ledger.bounded["r1"].values(), now)
    assert ledger.room(rep, now) == fresh != before


def test_reading_the_report_leaves_the_room_to_the_next_decision() -> None:
    """A metrics scrape or an admin read between two decisions works the room out for
    itself and keeps nothing: the next decision computes it at its own time, as it would
    have unread (a reading once moved a virtual-time matrix cell by a request)."""
    ctrl = controller()
    ctrl.upsert_replica(replica("r1", 100_000, max_running=4), 0.0)
    now = served_one_by_one(ctrl, 16, 2.0)
    assert isinstance(
        ctrl.submit(request("tight", 400, 100, latency_budget=1.5), now).verdict, Admit
    )
    rep = ctrl._ledger.replicas["r1"]
    assert rep.room_stale  # the admission moved the load it serves at
    read = ctrl.report.replica_usage()[0]
    assert rep.room_stale  # the reading kept nothing
    fresh = deadline_room(rep.service, rep.serving_load, ctrl._ledger.bounded["r1"].values(), now)
    assert read.binding_ceiling == ("deadlines" if rep.running + 1 > fresh else "none")
    assert ctrl._ledger.room(rep, now + 0.5) != fresh  # the decision's own time counts


def test_a_shed_names_its_ceiling_by_the_room_now_not_a_room_kept_from_before() -> None:
    """The reason a shed names reads each replica's room as of the shed (the placement
    walk may not have reached every replica, so a kept room can be from an earlier
    time); reading it keeps nothing for the next decision."""
    ctrl = controller()
    ctrl.upsert_replica(replica("r1", 100_000, max_running=4), 0.0)
    now = served_one_by_one(ctrl, 16, 2.0)
    assert isinstance(ctrl.submit(request("tight", 400, 100, latency_budget=1.5), now).verdict,
                      Admit)  # fmt: skip
    for rid in ("n0", "n1"):
        assert isinstance(ctrl.submit(request(rid, 400, 100), now).verdict, Admit)
    ledger = ctrl._ledger
    rep = ledger.replicas["r1"]
    assert ledger.room(rep, now) == pytest.approx(3.0) and rep.running == 3
    # Kept from before the tight request's client left; stale since a discovery round.
    later = now + 2.0
    rep.room_stale = True
    assert ledger.peek_room(rep, later) == math.inf
    assert binding_ceiling([rep], 500, False, lambda r: ledger.peek_room(r, later)) == "queue"
    assert rep.room_stale and rep.room == pytest.approx(3.0)
    # The room kept would have named the running requests' deadlines.
    assert binding_ceiling([rep], 500, False, lambda r: r.room) == "running_deadlines"
