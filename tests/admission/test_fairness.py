"""The queue's fair order (admission/fairqueue.py) through the controller, in virtual
time: weighted fair sharing in tokens across tenants, priority classes above it, EDF
within a tenant, tenant caps, and per-replica ITL placement."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import pytest

from admission.config import AdmissionConfig
from admission.controller import AdmissionController
from admission.types import AdmissionRequest, Admit, Completion, Events, Queued, Shed
from routing.config import RoutingConfig
from routing.scheduler import build_router
from tests.admission.helpers import controller, replica, sheds


@dataclass
class Policy:
    weight: float = 1.0
    max_concurrent: int | None = None
    max_queued: int | None = None
    queue_timeout_s: float | None = None


def req(
    rid: str,
    tenant: str,
    prompt: int = 50,
    output: int = 50,
    *,
    priority: int = 0,
    arrival: float = 0.0,
    deadline: float = float("inf"),
    itl_target: float | None = None,
) -> AdmissionRequest:
    return AdmissionRequest(
        request_id=rid,
        model="m",
        prompt_tokens=prompt,
        expected_output=output,
        max_tokens=output,
        tenant=tenant,
        priority=priority,
        arrival=arrival,
        deadline=deadline,
        itl_target_s=itl_target,
    )


@dataclass
class SimResult:
    served: dict[str, int] = field(default_factory=dict)  # tokens served per tenant
    completed: dict[str, int] = field(default_factory=dict)
    shed: dict[str, int] = field(default_factory=dict)
    waits: dict[str, list[float]] = field(default_factory=dict)  # queue wait of admitted
    ttfts: dict[str, list[float]] = field(default_factory=dict)


def simulate(
    policies: dict[str, Policy],
    rates: dict[str, float] | None = None,
    *,
    clients: dict[str, int] | None = None,
    seconds: float = 60.0,
    service_s: float = 1.0,
    prefill_s: float = 0.1,
    pool: int = 1000,
    one_tenant: bool = False,
) -> SimResult:
    """One replica of `pool` tokens; every request is 100 tokens and runs `service_s`
    (first token after `prefill_s`). Tenant t sends `rates[t]` requests a second, evenly
    spaced (open loop: a shed request is not retried), or keeps `clients[t]` requests
    outstanding (closed loop: the next one when one ends, a shed one again after its
    Retry-After). `one_tenant`: everyone is tenant ``default`` (one first-come line).
    Returns what each tenant got."""
    ctrl = controller(queue_timeout_s=30.0)
    ctrl.set_tenants(policies.get)
    ctrl.upsert_replica(replica(capacity=pool), 0.0)
    res = SimResult()
    events: list[tuple[float, int, str, str]] = []  # (time, seq, kind, request id)
    seq = itertools.count()
    for tenant, rate in (rates or {}).items():
        t = 0.0
        i = 0
        while t < seconds:
            heapq.heappush(events, (t, next(seq), "arrive", f"{tenant}-{i}"))
            i += 1
            t += 1.0 / rate
    closed = dict(clients or {})
    counter = itertools.count()
    for tenant, n in closed.items():
        for _ in range(n):
            heapq.heappush(events, (0.0, next(seq), "arrive", f"{tenant}-c{next(counter)}"))
    arrival: dict[str, float] = {}

    def started(a: Admit, now: float) -> None:
        tenant = a.request_id.split("-")[0]
        res.waits.setdefault(tenant, []).append(now - arrival[a.request_id])
        res.ttfts.setdefault(tenant, []).append(now - arrival[a.request_id] + prefill_s)
        heapq.heappush(events, (now + service_s, next(seq), "done", a.request_id))

    def settled(happened: Events, now: float) -> None:
        for e in happened:
            if isinstance(e, Admit):
                started(e, now)
            else:
                res.shed[e.request_id.split("-")[0]] = (
                    res.shed.get(e.request_id.split("-")[0], 0) + 1
                )

    while events:
        now, _, kind, rid = heapq.heappop(events)
        tenant = rid.split("-")[0]
        settled(ctrl.advance(now), now)  # expiries, and what they unblocked
        if kind == "arrive":
            arrival.setdefault(rid, now)
            r = req(rid, "default" if one_tenant else tenant, arrival=arrival[rid])
            decision = ctrl.submit(r, now)
            v = decision.verdict
            if isinstance(v, Admit):
                started(v, now)
            elif isinstance(v, Shed):
                res.shed[tenant] = res.shed.get(tenant, 0) + 1
                if tenant in closed and now < seconds:
                    heapq.heappush(events, (now + v.retry_after, next(seq), "arrive", rid))
            settled(decision.events + ctrl.advance(now), now)
        else:
            res.completed[tenant] = res.completed.get(tenant, 0) + 1
            if now <= seconds:  # the share while all were sending (not the drain after)
                res.served[tenant] = res.served.get(tenant, 0) + 100
            done = Completion(ok=True, prompt_tokens=50, completion_tokens=50)
            settled(ctrl.release(rid, now, done), now)
            if tenant in closed and now < seconds:
                heapq.heappush(events, (now, next(seq), "arrive", f"{tenant}-c{next(counter)}"))
    assert ctrl.report.reserved_tokens() == 0
    return res


@pytest.mark.slow
def test_a_flood_does_not_starve_a_trickle() -> None:
    """A sends 10x its fair share; B a trickle well within its own. B waits at most about
    one completion gap and meets a 1 s TTFT target on every request; A gets the rest."""
    fair = simulate({"a": Policy(), "b": Policy()}, {"a": 50.0, "b": 1.0})
    # Capacity is 10 requests/s (10 x 100 tokens, 1 s each); A's share is 5.
    assert fair.completed["b"] >= 59  # every request it sent (the last may still run)
    assert fair.shed.get("b", 0) == 0
    assert max(fair.waits["b"]) <= 0.2
    assert max(fair.ttfts["b"]) <= 1.0
    a_rate = fair.completed["a"] / 60.0
    assert a_rate >= 8.5  # A gets what B leaves: capacity minus B's 1/s
    # The same traffic in one line (everyone the same tenant: first come, first served)
    # makes B wait behind A's backlog.
    fifo = simulate({}, {"a": 50.0, "b": 1.0}, one_tenant=True)
    assert max(fifo.waits.get("b", [0.0])) > 5.0 or fifo.shed.get("b", 0) > 10


def test_weights_share_contended_capacity_in_tokens() -> None:
    """Both tenants keep more requests outstanding than the replica runs (30 each, room
    for 10): served tokens go 3 to 1, as their weights. Without weights, 1 to 1."""
    r = simulate({"a": Policy(weight=3.0), "b": Policy(weight=1.0)}, clients={"a": 30, "b": 30})
    ratio = r.served["a"] / r.served["b"]
    assert 2.8 <= ratio <= 3.2, ratio
    even = simulate({}, clients={"a": 30, "b": 30})
    assert 0.9 <= even.served["a"] / even.served["b"] <= 1.1


def test_counters_count_true_usage_not_estimates() -> None:
    """A tenant whose requests are estimated small but turn out large is charged what it
    used: the other tenant goes next."""
    ctrl = controller()
    ctrl.upsert_replica(replica(capacity=100), 0.0)
    assert isinstance(ctrl.submit(req("a-0", "a", 40, 40), 0.0).verdict, Admit)  # 20 free
    assert isinstance(ctrl.submit(req("b-0", "b", 10, 10), 0.0).verdict, Admit)
    assert isinstance(ctrl.submit(req("a-1", "a", 40, 40), 1.0).verdict, Queued)
    assert isinstance(ctrl.submit(req("b-1", "b", 40, 40), 1.0).verdict, Queued)
    # b-0 used 400 tokens, not 20: b is now far ahead in tokens served.
    ctrl.release("b-0", 2.0, Completion(ok=True, prompt_tokens=10, completion_tokens=390))
    got = ctrl.release("a-0", 3.0, Completion(ok=True, prompt_tokens=40, completion_tokens=40))
    assert [a.request_id for a in got] == ["a-1"]
    ctrl.release("a-1", 4.0)
    ctrl.release("b-1", 5.0)


def test_priority_classes_come_before_fair_sharing() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica(capacity=100), 0.0)
    assert isinstance(ctrl.submit(req("x-0", "x", 50, 50), 0.0).verdict, Admit)
    for rid, tenant, prio in [("a-0", "a", 0), ("b-0", "b", 5), ("a-1", "a", 5)]:
        assert isinstance(ctrl.submit(req(rid, tenant, 50, 50, priority=prio), 1.0).verdict, Queued)
    order = []
    current = "x-0"
    for t in range(2, 6):
        got = ctrl.release(current, float(t))
        if not got:
            break
        current = got[0].request_id
        order.append(current)
    # Both priority-5 entries first (fairly between a and b), then the priority-0 one.
    assert order[2] == "a-0" and set(order[:2]) == {"b-0", "a-1"}


def test_earliest_deadline_first_within_a_tenant() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica(capacity=100), 0.0)
    assert isinstance(ctrl.submit(req("a-0", "a", 50, 50), 0.0).verdict, Admit)
    assert isinstance(ctrl.submit(req("a-late", "a", 50, 50, deadline=20.0), 1.0).verdict, Queued)
    assert isinstance(ctrl.submit(req("a-soon", "a", 50, 50, deadline=5.0), 2.0).verdict, Queued)
    got = ctrl.release("a-0", 3.0)
    assert [a.request_id for a in got] == ["a-soon"]
    ctrl.release("a-soon", 3.5)
    ctrl.release("a-late", 4.0)


def test_a_retry_keeps_its_place_only_within_its_tenant() -> None:
    """A retry (first arrival earlier) goes before its own tenant's newer entries, but
    not before another tenant that has been served less."""
    ctrl = controller()
    ctrl.upsert_replica(replica(capacity=100), 0.0)
    assert isinstance(ctrl.submit(req("a-0", "a", 50, 50, arrival=0.0), 0.0).verdict, Admit)
    assert isinstance(ctrl.submit(req("a-1", "a", 50, 50, arrival=1.0), 1.0).verdict, Queued)
    # b is lifted to a's counter: a tie, which the earlier head (a-1) wins.
    assert isinstance(ctrl.submit(req("b-0", "b", 50, 50, arrival=1.0), 1.0).verdict, Queued)
    got = ctrl.release("a-0", 2.0)
    assert [a.request_id for a in got] == ["a-1"]
    # a has now been served 100 tokens more than b.
    assert isinstance(ctrl.submit(req("a-new", "a", 50, 50, arrival=2.5), 2.5).verdict, Queued)
    # A retry of a request a first sent at 0.5, before b-0 arrived.
    assert isinstance(ctrl.submit(req("a-retry", "a", 50, 50, arrival=0.5), 3.0).verdict, Queued)
    order = []
    current = "a-1"
    for t in range(4, 8):
        got = ctrl.release(current, float(t))
        if not got:
            break
        current = got[0].request_id
        order.append(current)
    assert order == ["b-0", "a-retry", "a-new"]
    ctrl.release(current, 9.0)
    assert ctrl.report.queue_depth() == 0 and ctrl.report.reserved_tokens() == 0


def test_tenant_concurrency_cap_waits_without_blocking_others() -> None:
    ctrl = controller()
    ctrl.set_tenants({"a": Policy(max_concurrent=1)}.get)
    ctrl.upsert_replica(replica(capacity=1000), 0.0)
    assert isinstance(ctrl.submit(req("a-0", "a"), 0.0).verdict, Admit)
    assert isinstance(ctrl.submit(req("a-1", "a"), 0.0).verdict, Queued)  # room, but a is capped
    assert isinstance(ctrl.submit(req("b-0", "b"), 0.0).verdict, Admit)  # a's entry blocks nobody
    assert ctrl.report.tenant_running("a") == 1 and ctrl.report.tenant_queued("a") == 1
    got = ctrl.release("a-0", 1.0)
    assert [a.request_id for a in got] == ["a-1"]
    ctrl.release("a-1", 2.0)
    ctrl.release("b-0", 2.0)
    assert ctrl.report.reserved_tokens() == 0


def test_tenant_queue_cap_is_a_429_naming_the_limit() -> None:
    ctrl = controller()
    ctrl.set_tenants({"a": Policy(max_concurrent=1, max_queued=1)}.get)
    ctrl.upsert_replica(replica(capacity=1000), 0.0)
    assert isinstance(ctrl.submit(req("a-0", "a"), 0.0).verdict, Admit)
    assert isinstance(ctrl.submit(req("a-1", "a"), 0.0).verdict, Queued)
    v = ctrl.submit(req("a-2", "a"), 0.0).verdict
    assert isinstance(v, Shed) and v.status == 429 and v.reason == "tenant_concurrency"
    assert v.retry_after > 0
    assert ctrl.report.tenant_queued("a") == 1
    # Not capped by concurrency, only the queue: the reason says so.
    ctrl2 = controller()
    ctrl2.set_tenants({"a": Policy(max_queued=0)}.get)
    ctrl2.upsert_replica(replica(capacity=100), 0.0)
    assert isinstance(ctrl2.submit(req("a-0", "a", 50, 50), 0.0).verdict, Admit)
    v2 = ctrl2.submit(req("a-1", "a", 50, 50), 0.0).verdict
    assert isinstance(v2, Shed) and (v2.status, v2.reason) == (429, "tenant_queue")
    ctrl.release("a-0", 1.0)
    ctrl.release("a-1", 1.0)
    ctrl2.release("a-0", 1.0)


def test_tenant_queue_timeout_replaces_the_default() -> None:
    ctrl = controller(queue_timeout_s=30.0)
    ctrl.set_tenants({"a": Policy(queue_timeout_s=2.0)}.get)
    ctrl.upsert_replica(replica(capacity=100), 0.0)
    assert isinstance(ctrl.submit(req("a-0", "a", 50, 50), 0.0).verdict, Admit)
    assert isinstance(ctrl.submit(req("a-1", "a", 50, 50), 0.0).verdict, Queued)
    assert isinstance(ctrl.submit(req("b-1", "b", 50, 50), 0.0).verdict, Queued)
    assert ctrl.next_deadline() == 2.0
    shed = sheds(ctrl.advance(2.0))
    assert [s.request_id for s in shed] == ["a-1"]
    ctrl.release("a-0", 3.0)
    ctrl.release("b-1", 3.0)


def test_position_counts_what_the_fair_order_serves_first() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica(capacity=100), 0.0)
    assert isinstance(ctrl.submit(req("x-0", "x", 50, 50), 0.0).verdict, Admit)
    for i in range(5):
        assert isinstance(ctrl.submit(req(f"a-{i}", "a", 50, 50), 0.0).verdict, Queued)
    b = ctrl.submit(req("b-0", "b", 50, 50), 0.0).verdict
    # b's first request goes next to a's head, not behind all five.
    assert isinstance(b, Queued) and b.position <= 1
    a = ctrl.submit(req("a-5", "a", 50, 50), 0.0).verdict
    assert isinstance(a, Queued) and a.position == 6
    for rid in ["x-0", *(f"a-{i}" for i in range(6)), "b-0"]:
        ctrl.release(rid, 1.0)
    assert ctrl.report.queue_depth() == 0 and ctrl.report.reserved_tokens() == 0


def _slo_controller() -> AdmissionController:
    cfg = RoutingConfig.model_validate({"default_profile": {"filters": [{"name": "slo_itl"}]}})
    ctrl = AdmissionController(
        AdmissionConfig(headroom=0.0, learn_limit=False, retry_jitter=0.0),
        build_router(cfg, seed=1),
        seed=1,
    )
    ctrl.upsert_replica(replica("slow", 10_000), 0.0)
    ctrl.upsert_replica(replica("fast", 10_000), 0.0)
    return ctrl


def _teach(ctrl: AdmissionController, itl: dict[str, float], n: int = 6) -> None:
    """Streams that ran alone on each replica, with the gaps `itl` gives per replica. A
    filler takes one replica; the stream goes to the other (the most headroom)."""
    seen = dict.fromkeys(itl, 0)
    for i in range(60):
        filler = ctrl.submit(req(f"f-{i}", "z", 5000, 10), 0.0).verdict
        v = ctrl.submit(req(f"t-{i}", "z", 50, 50), 0.0).verdict
        assert isinstance(filler, Admit) and isinstance(v, Admit)
        assert v.replica != filler.replica
        ctrl.release(f"t-{i}", 1.0, Completion(ok=True, ttft_s=0.1, itl_s=itl[v.replica]))
        ctrl.release(f"f-{i}", 1.0)
        seen[v.replica] += 1
        if min(seen.values()) >= n:
            return
    raise AssertionError(f"the picker never chose one replica: {seen}")


def test_itl_target_goes_to_a_replica_that_meets_it_or_waits() -> None:
    ctrl = _slo_controller()
    _teach(ctrl, {"slow": 0.2, "fast": 0.02})
    assert ctrl.report.predicted_itl("slow", 1) == pytest.approx(0.2)
    assert ctrl.report.predicted_itl("fast", 1) == pytest.approx(0.02)
    # Seen only alone, a gap is read as growing in proportion to the batch: with a
    # target of 0.05 s, "fast" holds it for up to 2 running, "slow" never.
    for i in range(2):
        v = ctrl.submit(req(f"s-{i}", "t", 50, 50, itl_target=0.05), 1.0).verdict
        assert isinstance(v, Admit) and v.replica == "fast"
    waiting = ctrl.submit(req("s-2", "t", 50, 50, itl_target=0.05), 1.0).verdict
    assert isinstance(waiting, Queued)  # room everywhere, but no replica meets the target
    # A request without a target is not held up by it.
    free = ctrl.submit(req("n-0", "u", 50, 50), 1.0).verdict
    assert isinstance(free, Admit) and free.replica == "slow"
    got = ctrl.release("s-0", 2.0)
    assert [(a.request_id, a.replica) for a in got] == [("s-2", "fast")]
    for rid in ("s-1", "s-2", "n-0"):
        ctrl.release(rid, 3.0)
    assert ctrl.report.reserved_tokens() == 0


def test_an_itl_target_a_lighter_load_would_meet_holds_the_replicas_for_it() -> None:
    """Both replicas meet 0.05 s alone but not at 3 running: the waiting entry with the
    target blocks them, so a request behind it does not keep the load up."""
    ctrl = _slo_controller()
    _teach(ctrl, {"slow": 0.02, "fast": 0.02})
    for i in range(4):
        v = ctrl.submit(req(f"s-{i}", "t", 50, 50, itl_target=0.05), 1.0).verdict
        assert isinstance(v, Admit)
    held = ctrl.submit(req("s-4", "t", 50, 50, itl_target=0.05), 1.0).verdict
    assert isinstance(held, Queued)
    behind = ctrl.submit(req("n-0", "u", 50, 50), 1.1).verdict
    assert isinstance(behind, Queued)  # room, but the replicas are draining for s-4
    # One running less: s-4 fits its target, and once it is in, the hold ends.
    got = ctrl.release("s-0", 2.0)
    assert [a.request_id for a in got] == ["s-4", "n-0"]
    for rid in ("s-1", "s-2", "s-3", "s-4", "n-0"):
        ctrl.release(rid, 3.0)
    assert ctrl.report.reserved_tokens() == 0 and ctrl.report.queue_depth() == 0


def test_itl_model_fits_gap_against_running_and_keeps_light_load_evidence() -> None:
    from admission.learned.itl import ItlModel

    m = ItlModel(per_load=4, min_samples=4)
    assert m.predict(1) is None
    for n in (1, 2, 4, 8):
        m.add(n, 0.01 + 0.01 * n)
    assert m.predict(1) == pytest.approx(0.02)
    assert m.predict(10) == pytest.approx(0.11)
    # A long busy spell at 8 running does not push out what was seen alone.
    for _ in range(500):
        m.add(8, 0.3)
    assert m.predict(1) is not None and m.predict(1) < 0.1
    assert (m.predict(8) or 0) > 0.2
    flat = ItlModel(min_samples=2)
    flat.add(2, 0.05)
    flat.add(2, 0.05)
    assert flat.predict(1) == pytest.approx(0.05)
    assert flat.predict(4) == pytest.approx(0.1)  # one count seen: proportional past it
