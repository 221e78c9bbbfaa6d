"""`set_pool_share`: a replica's pool and running limit capped at this process's lease
(shared state), without changing what can ever fit there."""

from __future__ import annotations

import dataclasses

import pytest

from admission.config import AdmissionConfig
from admission.controller import AdmissionController
from admission.learned.limit import LimitSettings, RunningLimit
from admission.lease import PoolShare
from admission.types import Admit, Queued, Shed
from routing.scheduler import default_profile
from tests.admission.helpers import controller, replica, request


def test_a_share_caps_admission_and_growing_it_admits_the_queue() -> None:
    c = controller()
    c.upsert_replica(replica("r1", 1000), 0.0)
    assert c.set_pool_share("r1", 300, 0.0) == []
    assert isinstance(c.submit(request("a", 100, 100), 0.0).verdict, Admit)
    # 200 of the 300-token slice are held: the next 200 do not fit the slice...
    assert isinstance(c.submit(request("b", 100, 100), 0.0).verdict, Queued)
    d = c.report.pool_demand("r1")
    assert d is not None
    assert (d.effective, d.reserved, d.queued_tokens, d.share_tokens) == (1000, 200, 200, 300)
    # ...until the lease grows.
    admitted = c.set_pool_share("r1", 400, 1.0)
    assert [a.request_id for a in admitted] == ["b"]
    c.release("a", 2.0)
    c.release("b", 2.0)
    assert c.report.reserved_tokens() == 0


def test_a_request_larger_than_the_share_waits_and_is_never_refused() -> None:
    c = controller()
    c.upsert_replica(replica("r1", 1000), 0.0)
    c.set_pool_share("r1", 100, 0.0)
    v = c.submit(request("big", 400, 400), 0.0).verdict
    assert isinstance(v, Queued)  # fits the pool, not the slice: it waits for the lease
    admitted = c.set_pool_share("r1", None, 1.0)  # no cap: the whole pool
    assert [a.request_id for a in admitted] == ["big"]
    c.release("big", 2.0)


def test_a_shrunk_share_keeps_reservations_and_admits_nothing_more() -> None:
    c = controller()
    c.upsert_replica(replica("r1", 1000), 0.0)
    assert isinstance(c.submit(request("a", 200, 200), 0.0).verdict, Admit)
    c.set_pool_share("r1", 100, 1.0)
    assert c.report.reserved_tokens("r1") == 400
    assert isinstance(c.submit(request("b", 1, 1), 1.0).verdict, Queued)
    c.release("a", 2.0)
    assert c.report.reservation("b") is not None  # admitted once a freed its slice
    c.release("b", 3.0)


def test_a_running_share_caps_the_running_count() -> None:
    c = controller()
    c.upsert_replica(replica("r1", 10_000, max_running=8), 0.0)
    c.set_pool_share("r1", None, 0.0, running=2)
    assert isinstance(c.submit(request("a", 10, 10), 0.0).verdict, Admit)
    assert isinstance(c.submit(request("b", 10, 10), 0.0).verdict, Admit)
    assert isinstance(c.submit(request("c", 10, 10), 0.0).verdict, Queued)
    d = c.report.pool_demand("r1")
    assert d is not None and (d.running_limit, d.share_running, d.queued) == (8, 2, 1)
    assert [a.request_id for a in c.set_pool_share("r1", None, 1.0, running=3)] == ["c"]
    for rid in "abc":
        c.release(rid, 2.0)


def test_the_learned_limit_judges_every_process_load() -> None:
    c = AdmissionController(
        AdmissionConfig(learn_limit=True, initial_limit=8), default_profile(seed=1), seed=1
    )
    c.upsert_replica(replica("r1", 100_000), 0.0)
    c.set_pool_share("r1", None, 0.0, others_running=5)
    lim = c.report.limit_of("r1")
    assert lim is not None and lim.others == 5
    assert isinstance(c.submit(request("a", 10, 10), 0.0).verdict, Admit)
    assert lim._running == 1  # this process's own count; the area integrates both
    c.release("a", 1.0)
    assert lim._area == 6.0  # (1 here + 5 elsewhere) x 1 s


@pytest.mark.parametrize("others", [0, 3, 7])
def test_the_service_is_learned_at_the_whole_load_whatever_part_runs_here(
    others: int,
) -> None:
    """The load a replica's service is learned and predicted at is the whole limit,
    not this process's part of it: with the others running 0, 3 or 7 of a shared limit
    of 8, the part here is 8, 5 or 1 while the engine's batch is the same."""
    c = AdmissionController(
        AdmissionConfig(learn_limit=True, initial_limit=8), default_profile(seed=1), seed=1
    )
    c.upsert_replica(replica("r1", 100_000), 0.0)
    c.set_pool_share("r1", None, 0.0, others_running=others)
    rep = c._ledger.replicas["r1"]
    assert rep.allowed == 8 - others
    assert rep.serving_load == 8
    # The report's single reading of it agrees with its table.
    assert c.report.limit_allowed("r1") == c.report.replica_usage()[0].limit == 8 - others


def test_adopt_takes_a_shared_value_and_restarts_the_window() -> None:
    lim = RunningLimit(LimitSettings(initial=2.0), 0.0)
    lim.adopt(7.5, 10.0, "latency")
    assert (lim.value, lim.reason, lim.allowed(None), lim.allowed(5)) == (7.5, "latency", 7, 5)
    lim.adopt(0.5, 11.0)  # below one request: not a limit
    assert lim.value == 7.5


def _round(c: AdmissionController, kv_usage: float, t: float) -> int:
    """One discovery round reporting the engine's KV usage; the effective pool after it."""
    state = dataclasses.replace(replica("r1", 10_000), kv_usage=kv_usage, updated_at=t)
    c.upsert_replica(state, t)
    d = c.report.pool_demand("r1")
    assert d is not None
    return d.effective


def test_the_pool_check_counts_what_the_other_processes_reserve() -> None:
    """Two processes share a 10,000-token pool and each reserves 2,500: the engine is half
    full. This process once read the others' half as foreign load and cut its view of the
    pool to 5,000; counting the fleet's reservations, the pool stands. A pool that is
    really overstated is still found with the others counted."""
    c = controller()
    c.upsert_replica(replica("r1", 10_000), 0.0)
    c.set_pool_share("r1", 5_000, 0.0, others_tokens=2_500)
    for i in range(5):
        assert isinstance(c.submit(request(f"a{i}", 250, 250), 0.0).verdict, Admit)
    assert [_round(c, 0.5, t) for t in (1.0, 2.0, 3.0)] == [10_000] * 3
    # The engine says it is full with the same 5,000 reserved: its pool is 5,000.
    assert [_round(c, 1.0, t) for t in (4.0, 5.0)] == [10_000, 5_000]
    for i in range(5):
        c.release(f"a{i}", 6.0)
    assert c.report.reserved_tokens() == 0


def test_a_renewals_shares_settle_the_queue_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # A renewal brings a share of every replica; settling after each placed the whole
    # queue once per replica (54 ms a renewal at 100 replicas in bench/fleet_vt.py).
    c = AdmissionController(AdmissionConfig(headroom=0.0), default_profile(seed=1))
    for k in range(50):
        c.upsert_replica(replica(f"r{k}", 1000), 0.0)
    settles = []
    real = c._settle
    monkeypatch.setattr(c, "_settle", lambda now: settles.append(now) or real(now))
    c.set_pool_shares([PoolShare(f"r{k}", 500) for k in range(50)], 1.0)
    assert settles == [1.0]
    demands = [c.report.pool_demand(f"r{k}") for k in range(50)]
    assert all(d is not None and d.share_tokens == 500 for d in demands)


def _drained(c: AdmissionController, upto: float) -> float:
    """Requests of 100 tokens, one every 0.1 s, each served in 0.1 s: a drain history
    (about 1,000 tokens/s) that wait estimates divide by. Returns the time after."""
    t = 0.0
    k = 0
    while t < upto:
        assert isinstance(c.submit(request(f"d{k}", 50, 50), t).verdict, Admit)
        c.release(f"d{k}", t + 0.1)
        t += 0.1
        k += 1
    return t


@pytest.mark.parametrize(("others", "queued"), [(1, True), (3, False)])
def test_a_wait_counts_the_running_room_a_renewal_brings_into_the_slice(
    others: int, queued: bool
) -> None:
    """A slice of a shared running limit grows at the next renewal into what the limit
    has beyond what every process runs: with the replica's cap of four running one here
    and `others` elsewhere, a request past this process's slice of one is queued while
    the cap has room (its queue asks for it), not shed for a deadline its slice alone
    could not meet; it is shed for its deadline when the others run the rest."""
    c = controller()
    c.upsert_replica(replica("r1", 100_000, max_running=4), 0.0)
    now = _drained(c, 2.0)
    c.set_pool_share("r1", None, now, running=1, others_running=others)
    assert isinstance(c.submit(request("held", 100, 100), now).verdict, Admit)
    late = c.submit(request("next", 100, 100, deadline=now + 0.01), now).verdict
    assert isinstance(late, Queued) is queued
    if not queued:
        assert isinstance(late, Shed) and late.reason == "deadline"


@pytest.mark.parametrize(
    ("others", "within", "queued"), [(300, 0.1, True), (800, 0.1, True), (800, 0.01, False)]
)
def test_a_wait_counts_the_pool_room_a_renewal_brings_into_the_slice(
    others: int, within: float, queued: bool
) -> None:
    """A slice of a shared pool grows at the next renewal into what the pool has beyond
    every process's reservations, and into what the whole pool releases: its holdings
    turn over at the pace this process's own requests are held there (0.1 s here). With
    room beyond the slice, a request larger than what the slice has free is queued (its
    queue asks for the room); with the pool reserved by the others, it waits for the
    pool's releases (400 tokens of 1,000 held for 0.1 s: 0.04 s), not for this process's
    own alone (0.4 s at its 1,000 tokens/s), and a deadline sooner than that is shed."""
    c = controller()
    c.upsert_replica(replica("r1", 1000), 0.0)
    now = _drained(c, 2.0)
    c.set_pool_share("r1", 200, now, others_tokens=others)
    assert isinstance(c.submit(request("held", 100, 100), now).verdict, Admit)
    late = c.submit(request("big", 200, 200, deadline=now + within), now).verdict
    assert isinstance(late, Queued) is queued
    if not queued:
        assert isinstance(late, Shed) and late.reason == "deadline"
