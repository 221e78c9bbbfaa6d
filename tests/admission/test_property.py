"""Randomized property test of the ledger invariants (virtual time, seeded).

Random submits, releases, top-ups, capacity changes, readiness flaps, removals and
expiries; after every operation:

* the controller's per-replica reserved tokens equal the sum of the reservations the
  test saw handed out (a shadow ledger built only from returned verdicts);
* no replica that received an admission or a top-up holds more than its effective pool
  (invariant 3), and a replica whose pool shrank below its reservations never grows them;
* no replica that received an admission runs more requests than its cap;
* every request is in exactly one state (admitted, queued, or finished);
and at the end, releasing everything returns the ledger and the queue to zero (invariant 2).
With tenants (weights, concurrency and queue caps, the fair order), the same, and every
tenant's running and queued counts match what it was handed, its running never past its
``max_concurrent``, and a request given up for another tenant's is answered at once.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

import pytest

from admission.types import Admit, Queued, Refuse, Shed
from tests.admission.helpers import admits, controller, replica, request, sheds

REPLICAS = ("r1", "r2", "r3")
MODELS = {"r1": ("m", "n"), "r2": ("m",), "r3": ("n",)}
BLOCK = {"r1": 16, "r2": 1, "r3": 32}


def _state(name: str, capacity: int, ready: bool = True):  # noqa: ANN202 - test helper
    return replica(
        name,
        capacity,
        models=MODELS[name],
        ready=ready,
        block_size=BLOCK[name],
        max_model_len=4096,
    )


@dataclass
class _Policy:
    weight: float
    max_concurrent: int | None
    max_queued: int | None
    queue_timeout_s: float | None = None


@pytest.mark.parametrize("with_tenants", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_random_operations_keep_ledger_invariants(seed: int, with_tenants: bool) -> None:
    rng = random.Random(seed)
    headroom = rng.choice([0.0, 0.05, 0.2])
    ctrl = controller(headroom=headroom, queue_max_per_model=rng.choice([0, 3, 20]))
    policies = {
        "a": _Policy(3.0, None, None),
        "b": _Policy(1.0, 2, 4),
        "c": _Policy(0.5, 1, 0),
    }
    tenant_of: dict[str, str] = {}
    if with_tenants:
        ctrl.set_tenants(policies.get)
    caps: dict[str, int | None] = {}
    capacity: dict[str, int] = {}
    now = 0.0
    for name in REPLICAS:
        capacity[name] = rng.choice([512, 1024, 2048])
        caps[name] = rng.choice([None, 2, 4])
        ctrl.upsert_replica(_state(name, capacity[name]), now, max_running=caps[name])

    held: dict[str, tuple[str, int]] = {}  # request -> (replica, tokens)
    queued: set[str] = set()
    finished: set[str] = set()
    seq = 0
    seen: dict[str, int] = {"admit": 0, "queued": 0, "shed": 0, "queue_admit": 0}

    def effective(name: str) -> int:
        return capacity[name]  # the headroom is kept by estimated reservations

    def take_admits(admits: list[Admit]) -> set[str]:
        touched = set()
        for a in admits:
            assert a.request_id in queued, f"admitted {a.request_id} that was not queued"
            queued.remove(a.request_id)
            held[a.request_id] = (a.replica, a.reserved_tokens)
            touched.add(a.replica)
            seen["queue_admit"] += 1
        return touched

    for _ in range(1500):
        now += rng.expovariate(20.0)
        before = {n: ctrl.report.reserved_tokens(n) for n in REPLICAS}
        touched: set[str] = set()
        held_before = set(held)
        op = rng.random()
        if op < 0.40:
            rid = f"q{seq}"
            seq += 1
            model = rng.choice(["m", "n", "m", "zz"] if rng.random() < 0.05 else ["m", "n"])
            prompt = rng.randint(1, 900)
            out = rng.randint(1, 400)
            deadline = now + rng.choice([0.05, 0.5, 5.0, math.inf])
            req = request(
                rid, prompt, out, model=model, priority=rng.randint(0, 2), deadline=deadline
            )
            if rng.random() < 0.3:  # counted from its characters: grown by the headroom
                req = replace(req, prompt_exact=False)
            if with_tenants:
                req = replace(req, tenant=rng.choice(["a", "b", "c", "d"]))
            tenant_of[rid] = req.tenant
            decision = ctrl.submit(req, now)
            verdict = decision.verdict
            for shed in sheds(decision.events):  # given up for this one (fair queue share)
                assert shed.request_id in queued and shed.status == 503
                queued.remove(shed.request_id)
                finished.add(shed.request_id)
                seen["displaced"] = seen.get("displaced", 0) + 1
            touched |= take_admits(admits(decision.events))
            seen[type(verdict).__name__.lower()] = seen.get(type(verdict).__name__.lower(), 0) + 1
            if isinstance(verdict, Admit):
                held[rid] = (verdict.replica, verdict.reserved_tokens)
                touched.add(verdict.replica)
            elif isinstance(verdict, Queued):
                queued.add(rid)
            else:
                assert isinstance(verdict, (Shed, Refuse))
                if isinstance(verdict, Shed):
                    # At least the floor's floor (10 ms: admission/shedding.py), at most the cap.
                    assert 0.01 <= verdict.retry_after <= ctrl.config.max_retry_after_s
                finished.add(rid)
        elif op < 0.70:
            pool = list(held) + list(queued) + ["ghost"]
            rid = rng.choice(pool)
            touched |= take_admits(ctrl.release(rid, now))
            held.pop(rid, None)
            queued.discard(rid)
            finished.add(rid)
        elif op < 0.82 and held:
            rid = rng.choice(list(held))
            name, tokens = held[rid]
            ok = ctrl.top_up(rid, tokens + rng.randint(1, 200), now)
            if ok:
                touched.add(name)
                reservation = ctrl.report.reservation(rid)
                assert reservation is not None
                held[rid] = (name, reservation.reserved_tokens)
        elif op < 0.90:
            name = rng.choice(REPLICAS)
            capacity[name] = rng.choice([256, 512, 1024, 2048, 4096])
            touched |= take_admits(
                ctrl.upsert_replica(
                    _state(name, capacity[name], ready=rng.random() < 0.85),
                    now,
                    max_running=caps[name],
                )
            )
        elif op < 0.93:
            ctrl.mark_unready(rng.choice(REPLICAS), now)
        elif op < 0.95:
            touched |= take_admits(ctrl.remove_replica(rng.choice(REPLICAS), now))
        else:
            events = ctrl.advance(now)
            for shed in sheds(events):
                assert shed.request_id in queued
                queued.remove(shed.request_id)
                finished.add(shed.request_id)
                assert 0.01 <= shed.retry_after <= ctrl.config.max_retry_after_s
            touched |= take_admits(admits(events))

        # --- invariants after every operation ---
        touched_ids = set(held) - held_before
        assert not (set(held) & queued)
        usage = {u.name: u for u in ctrl.report.replica_usage()}
        for name in REPLICAS:
            shadow = sum(t for r, t in held.values() if r == name)
            assert ctrl.report.reserved_tokens(name) == shadow
            running = sum(1 for r, _ in held.values() if r == name)
            if name in usage:
                assert usage[name].running == running
                # The single readings the virtual-time harness takes agree with the table.
                assert ctrl.report.running(name) == running
                assert ctrl.report.limit_allowed(name) == usage[name].limit
            if name in touched:
                assert shadow <= effective(name), (name, shadow, effective(name))
                if caps[name] is not None:
                    assert running <= caps[name]
            else:
                assert shadow <= max(effective(name), before[name])
        assert ctrl.report.queue_depth() == len(queued)
        if with_tenants:
            for t, policy in policies.items():
                mine = sum(1 for r in held if tenant_of.get(r) == t)
                assert ctrl.report.tenant_running(t) == mine
                if policy.max_concurrent is not None and any(
                    tenant_of.get(r) == t for r in touched_ids
                ):
                    assert mine <= policy.max_concurrent, (t, mine)
                assert ctrl.report.tenant_queued(t) == sum(1 for r in queued if tenant_of[r] == t)

    # The run must have exercised every path, or the invariants above prove little.
    assert seen["admit"] > 50 and seen["shed"] > 0, seen
    if ctrl.config.queue_max_per_model:
        assert seen["queued"] > 10 and seen["queue_admit"] > 5, seen
    assert ctrl.report.top_up_failures > 0

    for rid in list(held) + list(queued):
        for a in ctrl.release(rid, now):
            # Releasing everything may admit still-queued requests; release those too.
            held[a.request_id] = (a.replica, a.reserved_tokens)
            queued.discard(a.request_id)
        held.pop(rid, None)
        queued.discard(rid)
    for rid in list(held):
        ctrl.release(rid, now)
    assert ctrl.report.reserved_tokens() == 0
    assert ctrl.report.queue_depth() == 0
    assert ctrl.next_deadline() is None
