"""Behaviour of the admission controller on virtual time."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from pydantic import ValidationError

from admission.config import AdmissionConfig
from admission.controller import AdmissionController
from admission.types import Admit, Queued, Refuse, Shed
from gateway.denials import refusal_message
from routing.types import Router
from tests.admission.helpers import admits, controller, filled, replica, request, sheds, warm_drain


def test_headroom_is_kept_by_estimated_reservations_and_never_overcommits() -> None:
    """Requests of known size (an exact prompt, the whole max_tokens reserved) pack the
    pool whole; one whose output is an estimate below its max_tokens reserves
    1 / (1 - headroom) of it, as one with a prompt counted from its characters does."""
    ctrl = controller(headroom=0.1)
    ctrl.upsert_replica(replica(capacity=1000, block_size=1), 0.0)
    (usage,) = ctrl.report.replica_usage()
    assert usage.effective_capacity_tokens == 1000
    assert ctrl.submit(request("a", 400, 50), 0.0).verdict == Admit("a", "r1", 450)
    estimated = request("b", 400, 50, max_tokens=400)  # 50 of 400 reserved: a guess
    assert ctrl.submit(estimated, 0.0).verdict == Admit("b", "r1", 500)  # ceil(450 / 0.9)
    assert isinstance(ctrl.submit(request("c", 49, 1), 0.0).verdict, Admit)  # 50: exactly full
    assert ctrl.report.reserved_tokens() == 1000
    assert isinstance(ctrl.submit(request("d", 1, 1), 0.0).verdict, Queued)
    counted = replace(request("e", 400, 50), prompt_exact=False)
    fresh = controller(headroom=0.1)
    fresh.upsert_replica(replica(capacity=1000, block_size=1), 0.0)
    assert fresh.submit(counted, 0.0).verdict == Admit("e", "r1", 500)


def test_need_is_rounded_up_to_the_replica_block_size() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica(capacity=1024, block_size=16), 0.0)
    verdict = ctrl.submit(request("a", 100, 1), 0.0).verdict
    assert verdict == Admit("a", "r1", 112)  # ceil(101 / 16) * 16
    assert ctrl.report.reserved_tokens("r1") == 112


def test_running_cap_from_config_engine_or_default() -> None:
    ctrl = controller(default_max_running=3)
    ctrl.upsert_replica(replica("a", 10_000, models=("m",), max_running=1), 0.0)
    ctrl.upsert_replica(replica("b", 10_000, models=("m",)), 0.0, max_running=2)
    ctrl.upsert_replica(replica("c", 10_000, models=("m",)), 0.0)
    caps = {u.name: u.max_running for u in ctrl.report.replica_usage()}
    assert caps == {"a": 1, "b": 2, "c": 3}
    verdicts = [ctrl.submit(request(f"q{i}", 10, 10), 0.0).verdict for i in range(7)]
    assert [type(v) for v in verdicts] == [Admit] * 6 + [Queued]
    running = {u.name: u.running for u in ctrl.report.replica_usage()}
    assert running == {"a": 1, "b": 2, "c": 3}
    ceilings = {u.binding_ceiling for u in ctrl.report.replica_usage()}
    assert ceilings == {"running_cap"}


def test_queue_drains_in_priority_then_arrival_order() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica(capacity=100), 0.0)
    assert isinstance(ctrl.submit(request("big", 50, 50), 0.0).verdict, Admit)
    for rid, prio in [("low1", 0), ("high1", 5), ("low2", 0), ("high2", 5), ("mid", 1)]:
        assert isinstance(ctrl.submit(request(rid, 50, 50, priority=prio), 1.0).verdict, Queued)
    order: list[str] = []
    current = "big"
    for t in range(2, 8):
        admitted = ctrl.release(current, float(t))
        if not admitted:
            break
        assert len(admitted) == 1
        current = admitted[0].request_id
        order.append(current)
    assert order == ["high1", "high2", "mid", "low1", "low2"]
    assert ctrl.report.reserved_tokens() == 0 and ctrl.report.queue_depth() == 0


def test_strict_order_small_request_does_not_pass_a_large_head() -> None:
    """Documented head-of-line policy: no backfill past a waiting head on its replicas."""
    ctrl = controller()
    ctrl.upsert_replica(replica(capacity=100), 0.0)
    assert isinstance(ctrl.submit(request("a", 30, 30), 0.0).verdict, Admit)  # 40 free
    assert isinstance(ctrl.submit(request("large", 40, 40), 0.0).verdict, Queued)
    small = ctrl.submit(request("small", 5, 5), 0.0).verdict
    assert isinstance(small, Queued) and small.position == 1
    admitted = ctrl.release("a", 1.0)
    assert [a.request_id for a in admitted] == ["large", "small"]


def test_head_blocks_only_its_own_replicas() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica("ra", 100, models=("A",)), 0.0)
    ctrl.upsert_replica(replica("rb", 100, models=("B",)), 0.0)
    assert isinstance(ctrl.submit(request("a1", 50, 40, model="A"), 0.0).verdict, Admit)
    assert isinstance(ctrl.submit(request("a2", 50, 40, model="A"), 0.0).verdict, Queued)
    assert isinstance(ctrl.submit(request("b1", 50, 40, model="B"), 0.0).verdict, Admit)


def test_higher_priority_arrival_is_admitted_past_the_queue_when_it_fits() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica(capacity=100), 0.0)
    assert isinstance(ctrl.submit(request("a", 30, 30), 0.0).verdict, Admit)  # 40 free
    assert isinstance(ctrl.submit(request("large", 40, 40), 0.0).verdict, Queued)
    assert isinstance(ctrl.submit(request("vip", 10, 10, priority=9), 0.0).verdict, Admit)


def test_refuse_unknown_model_404() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica(), 0.0)
    verdict = ctrl.submit(request("x", model="nope"), 0.0).verdict
    assert isinstance(verdict, Refuse)
    assert (verdict.status, verdict.code) == (404, "model_not_found")
    assert ctrl.report.queue_depth() == 0


def test_refuse_never_fits_400_at_once_even_when_busy() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica("a", 1000, max_model_len=4096), 0.0)
    ctrl.upsert_replica(replica("b", 2000, max_model_len=4096), 0.0)
    assert isinstance(ctrl.submit(request("busy", 1000, 900), 0.0).verdict, Admit)
    too_long = ctrl.submit(request("long", 4000, 100, max_tokens=200), 0.0).verdict
    assert isinstance(too_long, Refuse)
    assert (too_long.status, too_long.code) == (400, "context_length_exceeded")
    assert "4096" in refusal_message(too_long)
    too_big = ctrl.submit(request("big", 1500, 600), 0.0).verdict  # 2100 > largest pool 2000
    assert isinstance(too_big, Refuse) and too_big.code == "context_length_exceeded"
    assert ctrl.report.queue_depth() == 0
    # Fits the larger pool: queued, not refused.
    assert isinstance(ctrl.submit(request("ok", 1500, 400), 0.0).verdict, (Admit, Queued))


def test_known_but_unready_replica_limits_still_refuse() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica(capacity=1000, max_model_len=512), 0.0)
    ctrl.mark_unready("r1", 0.0)
    verdict = ctrl.submit(request("long", 600, 10), 0.0).verdict
    assert isinstance(verdict, Refuse) and verdict.status == 400
    shed = ctrl.submit(request("short", 10, 10), 0.0).verdict
    assert isinstance(shed, Shed) and shed.reason == "no_replica_ready" and shed.status == 503


def test_replica_without_capacity_receives_nothing() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica(capacity=None), 0.0)
    assert ctrl.report.models() == set()
    verdict = ctrl.submit(request("a"), 0.0).verdict
    assert isinstance(verdict, Shed) and verdict.reason == "no_replica_ready"
    # A pinned capacity makes it usable.
    ctrl.upsert_replica(replica(capacity=None), 1.0, pinned_capacity=500)
    assert ctrl.report.models() == {"m"}
    assert isinstance(ctrl.submit(request("b"), 1.0).verdict, Admit)


def test_release_is_idempotent_and_returns_ledger_to_zero() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica(capacity=1000), 0.0)
    ctrl.submit(request("a", 100, 100), 0.0)
    ctrl.submit(request("b", 100, 100), 0.0)
    assert ctrl.release("a", 1.0) == []
    assert ctrl.release("a", 1.0) == []
    assert ctrl.release("never-seen", 1.0) == []
    assert ctrl.report.reserved_tokens() == 200
    ctrl.release("b", 2.0)
    assert ctrl.report.reserved_tokens() == 0
    assert all(u.running == 0 for u in ctrl.report.replica_usage())


def test_release_of_queued_request_drops_it() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica(capacity=100), 0.0)
    ctrl.submit(request("a", 50, 50), 0.0)
    ctrl.submit(request("q", 50, 50), 0.0)
    assert ctrl.report.queue_depth("m") == 1
    assert ctrl.release("q", 1.0) == []
    assert ctrl.report.queue_depth() == 0 and ctrl.next_deadline() is None
    assert ctrl.release("a", 2.0) == []  # nothing left to admit
    assert ctrl.report.reserved_tokens() == 0


def test_top_up_grows_block_rounded_then_release_frees_all() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica(capacity=256, block_size=16), 0.0)
    assert ctrl.submit(request("a", 50, 14), 0.0).verdict == Admit("a", "r1", 64)
    assert ctrl.top_up("a", 60, 1.0) is True  # already covered
    assert ctrl.report.reserved_tokens() == 64
    assert ctrl.top_up("a", 65, 1.0) is True
    assert ctrl.report.reserved_tokens() == 80
    assert ctrl.submit(request("b", 100, 76), 1.0).verdict == Admit("b", "r1", 176)  # 256 used
    assert ctrl.top_up("a", 81, 2.0) is False  # no room: refused, counted
    assert ctrl.report.top_up_failures == 1
    assert ctrl.report.reserved_tokens() == 256
    assert ctrl.top_up("unknown", 10, 2.0) is False
    ctrl.release("a", 3.0)
    ctrl.release("b", 3.0)
    assert ctrl.report.reserved_tokens() == 0


def test_capacity_growth_admits_from_queue() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica(capacity=100), 0.0)
    ctrl.submit(request("a", 50, 50), 0.0)
    assert isinstance(ctrl.submit(request("b", 50, 50), 0.0).verdict, Queued)
    admitted = ctrl.upsert_replica(replica(capacity=200), 1.0)
    assert admitted == [Admit("b", "r1", 100)]


def test_new_ready_replica_admits_from_queue() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica("r1", 100), 0.0)
    ctrl.submit(request("a", 50, 50), 0.0)
    ctrl.submit(request("b", 50, 50), 0.0)
    admitted = ctrl.upsert_replica(replica("r2", 100), 1.0)
    assert admitted == [Admit("b", "r2", 100)]


def test_unready_and_removed_replicas_keep_reservations_and_queue() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica("r1", 100), 0.0)
    ctrl.upsert_replica(replica("r2", 100), 0.0)
    first, second = (
        ctrl.submit(request("a", 50, 50), 0.0).verdict,
        ctrl.submit(request("b", 50, 50), 0.0).verdict,
    )
    assert isinstance(first, Admit) and isinstance(second, Admit)
    by_replica = {first.replica: "a", second.replica: "b"}
    assert set(by_replica) == {"r1", "r2"}
    assert isinstance(ctrl.submit(request("c", 50, 50), 0.0).verdict, Queued)
    ctrl.mark_unready("r1", 1.0)
    assert ctrl.report.models() == {"m"}
    assert ctrl.report.reserved_tokens("r1") == 100
    # r1's release frees its ledger but c may not go to an unready replica.
    assert ctrl.release(by_replica["r1"], 2.0) == []
    assert ctrl.report.reserved_tokens("r1") == 0
    assert ctrl.report.queue_depth() == 1
    assert ctrl.remove_replica("r2", 3.0) == []
    assert ctrl.report.reserved_tokens("r2") == 100  # still held until released
    assert ctrl.report.queue_depth() == 1  # queued request not dropped
    assert ctrl.release(by_replica["r2"], 4.0) == []
    assert ctrl.report.reserved_tokens() == 0
    assert "r2" not in {u.name for u in ctrl.report.replica_usage()}
    # r1 comes back: c is admitted there.
    assert ctrl.upsert_replica(replica("r1", 100), 5.0) == [Admit("c", "r1", 100)]


def test_unready_replica_reports_not_ready_ceiling() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica(capacity=100), 0.0)
    ctrl.mark_unready("r1", 0.0)
    (usage,) = ctrl.report.replica_usage()
    assert usage.ready is False and usage.binding_ceiling == "not_ready"


def test_queue_full_sheds_with_retry_after_from_drain_rate() -> None:
    ctrl = controller(queue_max_per_model=2, max_retry_after_s=600.0)
    ctrl.upsert_replica(replica(capacity=1000), 0.0)
    now = warm_drain(ctrl, 200, rate=100.0)  # 100 tokens/s released
    rate = ctrl.report.drain_rate("m", now)
    assert rate is not None and 80.0 < rate[0] < 130.0
    for i in range(5):
        assert isinstance(ctrl.submit(request(f"run{i}", 100, 100), now).verdict, Admit)
    assert isinstance(ctrl.submit(request("q1", 100, 100), now).verdict, Queued)
    assert isinstance(ctrl.submit(request("q2", 100, 100), now).verdict, Queued)
    shed = ctrl.submit(request("q3", 100, 100), now).verdict
    assert isinstance(shed, Shed) and shed.reason == "queue_full" and shed.status == 503
    # 600 tokens (two queued + itself) must drain. Served one at a time the replica
    # released ~100 tokens/s; five running now, each held ~2 s as those were, release
    # 1,000 tokens per 2 s (admission/learned/drain.py): about 1.2 s, not the past rate's 6 s.
    expected = 600 / ctrl.report.drain_rate("m", now)[0]  # type: ignore[index]
    assert shed.retry_after == pytest.approx(expected, rel=1e-6)
    assert 1.0 < shed.retry_after < 1.5
    # The shed request is expected back: the next one waits behind it too (800 tokens).
    assert ctrl.report.returning() == 1
    assert ctrl.report.retry_after("m", 200, now) == pytest.approx(expected * 800 / 600)


def _queue_room(ctrl: AdmissionController, replicas: int, pool: int, cap: int) -> int:
    """Fill `replicas` replicas of pool `pool` and running cap `cap` with 200-token
    requests, then queue more until one is shed: the requests the queue held."""
    for k in range(replicas):
        ctrl.upsert_replica(replica(f"r{k}", pool, max_running=cap), 0.0)
    i = 0
    while isinstance(ctrl.submit(request(f"run{i}", 100, 100), 0.0).verdict, Admit):
        i += 1
    queued = 1  # the first refused to run queued
    while True:
        verdict = ctrl.submit(request(f"q{queued}", 100, 100), 0.0).verdict
        if isinstance(verdict, Shed):
            assert verdict.reason == "queue_full"
            return queued
        assert isinstance(verdict, Queued)
        queued += 1


def test_unset_queue_bound_follows_what_the_replicas_run() -> None:
    """With `queue_max_per_model` unset a model's queue holds as many requests as its
    replicas run at once: each its running cap, or fewer where its pool binds first at
    the mean reservation; at least 256 (the fixed bound before, which refused requests
    whose deadlines allowed them to wait in front of many replicas). A setting wins."""
    # Eight replicas running 64 each (their pools hold 500 of these): 512.
    assert _queue_room(controller(), 8, 100_000, 64) == 512
    # Forty whose 2,000-token pools hold ten 200-token requests each under a cap of 64.
    assert _queue_room(controller(), 40, 2_000, 64) == 400
    # One replica: the floor, as the fixed bound was.
    assert _queue_room(controller(), 1, 100_000, 64) == 256
    # A setting wins, in front of many replicas too.
    assert _queue_room(controller(queue_max_per_model=256), 8, 100_000, 64) == 256


def test_retry_after_is_clamped() -> None:
    ctrl = controller(queue_max_per_model=0, max_retry_after_s=3.0)
    ctrl.upsert_replica(replica(capacity=1000), 0.0)
    now = warm_drain(ctrl, 10, rate=10_000.0)
    ctrl.submit(request("big", 500, 500), now)
    tiny = ctrl.submit(request("x", 1, 1), now).verdict
    # A tiny wait on a replica that releases every millisecond: the floor's floor, 10 ms.
    assert isinstance(tiny, Shed) and tiny.retry_after == pytest.approx(0.01)
    # One that releases every 2 s: min_retry_after_s, 1 s.
    ctrl3 = controller(queue_max_per_model=0)
    ctrl3.upsert_replica(replica(capacity=1000), 0.0)
    now3 = warm_drain(ctrl3, 200, rate=100.0)
    ctrl3.submit(request("big", 500, 500), now3)
    shed = ctrl3.submit(request("x", 1, 1), now3).verdict
    assert isinstance(shed, Shed) and shed.retry_after == 1.0
    ctrl2 = controller(queue_max_per_model=0, max_retry_after_s=3.0)
    ctrl2.upsert_replica(replica(capacity=1000), 0.0)
    now2 = warm_drain(ctrl2, 10, rate=0.1)
    ctrl2.submit(request("big", 500, 500), now2)
    slow = ctrl2.submit(request("x", 100, 100), now2).verdict
    assert isinstance(slow, Shed) and slow.retry_after == 3.0


def test_cold_start_queues_and_uses_documented_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("admission.shedding.COLD_RETRY_AFTER_S", 4.0)
    ctrl = controller(queue_max_per_model=1)
    ctrl.upsert_replica(replica(capacity=100), 0.0)
    ctrl.submit(request("a", 50, 50), 0.0)
    queued = ctrl.submit(request("b", 50, 50, deadline=0.5), 0.0).verdict
    assert isinstance(queued, Queued) and queued.estimated_wait == 4.0  # no evidence to shed
    full = ctrl.submit(request("c", 50, 50), 0.0).verdict
    assert isinstance(full, Shed) and full.retry_after == 4.0


def test_deadline_that_cannot_be_met_is_shed_at_submit() -> None:
    ctrl = controller()
    now = filled(ctrl)
    # Needs 200 tokens to drain; five running, each held ~2 s, release 500 tokens/s
    # (admission/learned/drain.py): ~0.4 s. A 0.2 s deadline cannot be met.
    shed = ctrl.submit(request("hurry", 100, 100, deadline=now + 0.2), now).verdict
    assert isinstance(shed, Shed) and shed.reason == "deadline"
    assert 0.2 <= shed.retry_after <= 1.0
    assert ctrl.report.queue_depth() == 0
    ok = ctrl.submit(request("patient", 100, 100, deadline=now + 5.0), now).verdict
    assert isinstance(ok, Queued) and 0.2 < ok.estimated_wait < 1.0
    # The configured queue timeout also bounds the deadline.
    ctrl2 = controller(queue_timeout_s=0.2)
    now2 = filled(ctrl2)
    assert isinstance(ctrl2.submit(request("x", 100, 100), now2).verdict, Shed)


def test_expire_sheds_overdue_and_admits_what_it_unblocks() -> None:
    ctrl = controller(queue_timeout_s=10.0)
    ctrl.upsert_replica(replica(capacity=100), 0.0)
    ctrl.submit(request("a", 40, 40), 0.0)  # 20 free
    assert isinstance(ctrl.submit(request("large", 40, 40, deadline=2.0), 0.0).verdict, Queued)
    assert isinstance(ctrl.submit(request("small", 5, 5), 0.0).verdict, Queued)
    assert ctrl.next_deadline() == 2.0
    assert ctrl.advance(1.0) == []
    events = ctrl.advance(2.0)
    shed = sheds(events)
    assert [(s.request_id, s.reason) for s in shed] == [("large", "queue_timeout")]
    assert 1.0 <= shed[0].retry_after <= ctrl.config.max_retry_after_s
    # small is no longer blocked; its admission is returned by the same call (one
    # output channel: nothing is handed out by a later one).
    assert admits(events) == [Admit("small", "r1", 10)]
    assert ctrl.release("large", 2.0) == []
    assert ctrl.next_deadline() is None
    ctrl.release("small", 3.0)
    ctrl.release("a", 3.0)
    assert ctrl.report.reserved_tokens() == 0


def test_expire_sheds_entries_whose_deadline_can_no_longer_be_met() -> None:
    ctrl = controller()
    now = filled(ctrl)
    queued = ctrl.submit(request("q", 100, 100, deadline=now + 4.0), now).verdict
    assert isinstance(queued, Queued)
    # Nothing drains for a long while: the rate decays and the wait outgrows the deadline.
    shed = sheds(ctrl.advance(now + 3.0))
    assert [(s.request_id, s.reason) for s in shed] == [("q", "deadline")]


def test_duplicate_request_id_is_rejected() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica(), 0.0)
    ctrl.submit(request("a"), 0.0)
    with pytest.raises(ValueError):
        ctrl.submit(request("a"), 0.0)


def test_picker_spreads_ties_and_prefers_headroom() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica("r1", 1000), 0.0)
    ctrl.upsert_replica(replica("r2", 1000), 0.0)
    ctrl.upsert_replica(replica("r3", 2000), 0.0)
    first = ctrl.submit(request("a", 50, 50), 0.0).verdict
    assert isinstance(first, Admit)
    # r1 and r2 tie at 100% headroom; r3 too. After "a" the chosen one is below 100%.
    placed = [ctrl.submit(request(f"q{i}", 50, 50), 0.0).verdict for i in range(6)]
    names = [p.replica for p in placed if isinstance(p, Admit)]
    assert len(set(names) | {first.replica}) == 3


def test_models_is_union_of_ready_replicas() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica("r1", 100, models=("a", "b")), 0.0)
    ctrl.upsert_replica(replica("r2", 100, models=("c",), ready=False), 0.0)
    assert ctrl.report.models() == {"a", "b"}


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ValidationError) as err:
        AdmissionConfig(headroom=1.5)
    assert "headroom" in str(err.value)
    with pytest.raises(ValidationError) as err:
        AdmissionConfig(headrom=0.1)  # type: ignore[call-arg]
    assert "headrom" in str(err.value)


def test_binding_ceiling_reports_kv_capacity_when_the_head_does_not_fit() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica(capacity=100), 0.0)
    ctrl.submit(request("a", 30, 30), 0.0)
    assert ctrl.report.replica_usage()[0].binding_ceiling == "none"
    ctrl.submit(request("b", 30, 30), 0.0)
    (usage,) = ctrl.report.replica_usage()
    assert usage.binding_ceiling == "kv_capacity"
    assert (usage.reserved_tokens, usage.running) == (60, 1)


def test_custom_picker_sees_the_request_and_may_decline() -> None:
    from routing.types import Candidate, RouteRequest

    seen: list[tuple[RouteRequest, list[str]]] = []

    class OnlyR2(Router):
        def pick(self, req: RouteRequest, candidates: list[Candidate]) -> Candidate | None:
            seen.append((req, [c.name for c in candidates]))
            return next((c for c in candidates if c.name == "r2"), None)

    ctrl = controller_with(OnlyR2())
    ctrl.upsert_replica(replica("r1", 1000, block_size=16), 0.0)
    ctrl.upsert_replica(replica("r2", 1000, block_size=16), 0.0)
    req = request("a", 100, 100)
    req.workload = "coding"
    assert ctrl.submit(req, 0.0).verdict == Admit("a", "r2", 208)
    route, names = seen[0]
    assert (route.model, route.workload, route.need_tokens) == ("m", "coding", 208)
    assert sorted(names) == ["r1", "r2"]
    ctrl.remove_replica("r2", 1.0)
    assert isinstance(ctrl.submit(request("b", 10, 10), 1.0).verdict, Queued)  # picker declined r1


def controller_with(picker: Router) -> AdmissionController:
    return AdmissionController(AdmissionConfig(headroom=0.0), picker)


def test_a_finer_retry_floor_passes_the_honest_wait_through() -> None:
    """With min_retry_after_s below 1 s a short honest wait is not rounded up to 1 s; the
    shell still sends a whole-second Retry-After, and the precise value as retry-after-ms."""
    from gateway.errors import retry_after_headers

    ctrl = controller(queue_max_per_model=0, min_retry_after_s=0.01)
    ctrl.upsert_replica(replica(capacity=1000), 0.0)
    now = warm_drain(ctrl, 10, rate=10_000.0)
    ctrl.submit(request("big", 500, 500), now)
    tiny = ctrl.submit(request("x", 1, 1), now).verdict
    assert isinstance(tiny, Shed) and 0.01 <= tiny.retry_after < 1.0
    headers = retry_after_headers(tiny.retry_after)
    assert headers["Retry-After"] == "1"
    assert int(headers["retry-after-ms"]) == math.ceil(tiny.retry_after * 1000) < 1000


def test_an_estimate_over_the_limit_is_forwarded_clamped_never_refused() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica(capacity=1000, max_model_len=800), 0.0)
    guess = request("guess", 900, 50)
    guess.prompt_exact = False
    verdict = ctrl.submit(guess, 0.0).verdict
    # Clamped to what the replica holds: prompt 750 + 50 output (max_model_len 800).
    assert verdict == Admit("guess", "r1", 800)
    exact = request("exact", 900, 50)
    assert isinstance(ctrl.submit(exact, 0.0).verdict, Refuse)
    # max_tokens is declared, hence exact: over the context on its own, refused at once.
    over = request("over", 10, 900)
    over.prompt_exact = False
    refused = ctrl.submit(over, 0.0).verdict
    assert isinstance(refused, Refuse) and refused.code == "context_length_exceeded"


def test_retry_after_grows_with_the_backlog_and_its_jitter_stays_in_bounds() -> None:
    ctrl = controller(queue_max_per_model=0, retry_jitter=0.0)
    ctrl.upsert_replica(replica(capacity=1000), 0.0)
    now = warm_drain(ctrl, 200, 100.0)
    assert isinstance(ctrl.submit(request("hold", 500, 500), now).verdict, Admit)  # pool full
    delays = []
    for i in range(5):
        req = request(f"s{i}", 100, 100)
        req.arrival = now
        shed = ctrl.submit(req, now).verdict
        assert isinstance(shed, Shed)
        delays.append(shed.retry_after)
    # Each shed request is expected back, so each next one is told to wait longer.
    assert delays == sorted(delays) and delays[-1] > delays[0]
    assert ctrl.report.returning() == 5

    jittery = controller(queue_max_per_model=0, retry_jitter=0.1)
    jittery.upsert_replica(replica(capacity=1000), 0.0)
    now = warm_drain(jittery, 200, 100.0)
    assert isinstance(jittery.submit(request("hold", 500, 500), now).verdict, Admit)
    seen = []
    for i in range(60):
        base = jittery.report.retry_after("m", 200, now)  # what the next shed waits, unjittered
        req = request(f"j{i}", 100, 100)
        req.arrival = now
        shed = jittery.submit(req, now).verdict
        assert isinstance(shed, Shed)
        if jittery.config.min_retry_after_s < shed.retry_after < jittery.config.max_retry_after_s:
            assert 0.9 * base - 1e-9 <= shed.retry_after <= 1.1 * base + 1e-9
            seen.append(shed.retry_after / base)
    assert len(seen) >= 10 and max(seen) - min(seen) > 0.05  # spread, not lockstep


def test_a_returning_request_does_not_count_itself_ahead() -> None:
    ctrl = controller(queue_max_per_model=0)
    ctrl.upsert_replica(replica(capacity=1000), 0.0)
    now = warm_drain(ctrl, 200, 100.0)
    assert isinstance(ctrl.submit(request("hold", 500, 500), now).verdict, Admit)
    first = request("x", 100, 100)
    first.retry_key = 42
    first.arrival = now
    assert isinstance(ctrl.submit(first, now).verdict, Shed)
    assert ctrl.report.returning() == 1
    again = request("x.1", 100, 100)
    again.retry_key = 42
    again.arrival = first.arrival
    ctrl.submit(again, now + 1.0)
    assert ctrl.report.returning() == 1  # the old entry left; the new shed is the only one
