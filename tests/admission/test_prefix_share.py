"""Shared prompt prefixes counted once in a replica's ledger (admission/prefixshare.py).

- The record: a chain is shareable up to its first block that is not pinned or not yet
  computed (found by bisection); pins are counted, each block once at one worth.
- The controller: a request sharing a running request's computed prefix reserves its
  need less that prefix (and a margin); one admitted while the prefix is still being
  computed pays for its whole prompt; a replica that does not share prefixes gives no
  credit; the ledger returns to zero in any release order.
- A randomized test: whatever the order of admissions, releases, top-ups and time, each
  replica's reserved total is its reservations' private parts plus its pinned blocks
  counted once, never past the effective pool, and at least what an engine that shares
  only computed blocks holds (each block truly worth more than its bound).
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from admission.prefixshare import SharedPrefixes
from admission.types import AdmissionRequest, Admit, Events, Queued
from tests.admission.helpers import controller, replica, request


def chain(tag: str, n: int) -> tuple[int, ...]:
    """A hash chain: blocks of one tenant's prefix share their leading hashes."""
    return tuple(hash((tag, i)) for i in range(n))


def test_shareable_stops_at_the_first_block_not_pinned_or_not_computed() -> None:
    rec = SharedPrefixes()
    a = chain("a", 10)
    pins, added = rec.pin(a[:6], 0, 8, ready_at=5.0, budget=10_000)
    assert pins == a[:6] and added == 6 * 8 and rec.tokens == 48
    assert rec.shareable(a, 4.9) == 0  # not computed yet
    assert rec.shareable(a, 5.0) == 6  # the walk stops at the first block not pinned
    assert rec.pinned_depth(a) == 6
    other = (a[0], a[1], 12345)
    assert rec.shareable(other, 5.0) == 2
    assert rec.shareable((), 5.0) == 0


def test_pins_are_counted_and_each_block_counts_once() -> None:
    rec = SharedPrefixes()
    a = chain("a", 8)
    first, added1 = rec.pin(a[:4], 0, 10, ready_at=1.0, budget=10_000)
    # A second request shares the 4 computed blocks and extends the chain by 4.
    second, added2 = rec.pin(a, rec.shareable(a, 2.0), 10, ready_at=3.0, budget=10_000)
    assert added1 == 40 and added2 == 40 and rec.tokens == 80
    # The extension is computed later than the shared part: the chain is shareable up
    # to the old depth until then.
    assert rec.shareable(a, 2.5) == 4 and rec.shareable(a, 3.0) == 8
    assert rec.unpin(first) == 0  # still pinned by the second
    assert rec.tokens == 80
    assert rec.unpin(second) == 80 and rec.tokens == 0 and len(rec) == 0


def test_a_copy_still_being_computed_is_not_extended_and_the_budget_bounds_new_pins() -> None:
    rec = SharedPrefixes()
    a = chain("a", 10)
    rec.pin(a[:3], 0, 8, ready_at=0.0, budget=10_000)
    rec.pin(a[:6], 3, 8, ready_at=10.0, budget=10_000)  # blocks 3..5 being computed
    # A third request at t=1 shares 3 computed blocks; blocks 3..5 are someone's copy in
    # progress, so it pins only what it shares (its own copy of the rest stays private).
    pins, added = rec.pin(a, rec.shareable(a, 1.0), 8, ready_at=2.0, budget=10_000)
    assert pins == a[:3] and added == 0
    # New pins stay within the request's own reservation.
    rec2 = SharedPrefixes()
    pins, added = rec2.pin(a, 0, 8, ready_at=0.0, budget=20)
    assert len(pins) == 2 and added == 16
    # A request whose bound is below the record's worth does not extend it.
    pins, added = rec2.pin(a, 2, 4, ready_at=0.0, budget=10_000)
    assert pins == a[:2] and added == 0
    assert rec2.credit(2, 4, 0) == 8 and rec2.credit(2, 100, 0) == 16
    assert rec2.credit(2, 8, 20) == 0


def sharing_replica(name: str = "r1", capacity: int = 1000, *, shares: bool = True, bs: int = 1):
    st = replica(name, capacity, block_size=bs)
    st.shares_prefix = shares
    return st


def agentic(rid: str, hashes: tuple[int, ...], prompt: int, output: int, w: int = 10):
    return replace(request(rid, prompt, output), prefix_hashes=hashes, prefix_block_tokens=w)


def test_a_request_sharing_a_computed_prefix_reserves_its_need_less_that_prefix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("admission.ledger.PREFIX_SETTLE_S", 1.0)
    ctrl = controller()
    ctrl.upsert_replica(sharing_replica(capacity=1000), 0.0)
    prefix = chain("tenant", 40)  # 40 blocks x 10 tokens bound: 400 tokens
    a = ctrl.submit(agentic("a", prefix, 500, 100), 0.0).verdict
    assert isinstance(a, Admit) and a.reserved_tokens == 600
    assert ctrl.report.reserved_tokens("r1") == 600
    # Before the prefix is computed a second request pays for its whole prompt: 600 more
    # do not fit in 1000.
    assert isinstance(ctrl.submit(agentic("b", prefix, 500, 100), 0.5).verdict, Queued)
    # Once computed (PREFIX_SETTLE_S), it shares 40 blocks: 600 - (400 - margin 11), the
    # margin being a block of the engine (1) and one of the prefix (10).
    admits = ctrl.advance(1.0)
    assert [x.request_id for x in admits] == ["b"]
    assert ctrl.report.reserved_tokens("r1") == 600 + 211
    # Release in either order: the pinned prefix leaves with its last holder.
    ctrl.release("a", 2.0)
    # b's private part (with its margin) and the prefix it still pins.
    assert ctrl.report.reserved_tokens("r1") == 211 + 400
    ctrl.release("b", 3.0)
    assert ctrl.report.reserved_tokens("r1") == 0


def test_no_credit_on_a_replica_that_does_not_share_or_without_a_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("admission.ledger.PREFIX_SETTLE_S", 0.0)
    for shares, w in ((False, 10), (True, 0)):
        ctrl = controller()
        ctrl.upsert_replica(sharing_replica(capacity=1000, shares=shares), 0.0)
        prefix = chain("tenant", 40)
        assert isinstance(ctrl.submit(agentic("a", prefix, 500, 100, w), 0.0).verdict, Admit)
        assert isinstance(ctrl.submit(agentic("b", prefix, 500, 100, w), 1.0).verdict, Queued)
        ctrl.release("a", 2.0)
        ctrl.release("b", 2.0)
        assert ctrl.report.reserved_tokens() == 0


def test_the_model_view_says_whether_a_replica_shares() -> None:
    ctrl = controller()
    ctrl.upsert_replica(sharing_replica("r1", shares=False), 0.0)
    assert not ctrl.report.shares_prefix("m")
    ctrl.upsert_replica(sharing_replica("r2", shares=True), 0.0)
    assert ctrl.report.shares_prefix("m") and not ctrl.report.shares_prefix("other")
    assert not controller(share_prefix=False).report.shares_prefix("m")


def test_a_replica_that_stops_sharing_gives_no_credit_and_its_pins_are_released(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("admission.ledger.PREFIX_SETTLE_S", 0.0)
    ctrl = controller()
    ctrl.upsert_replica(sharing_replica(capacity=2000), 0.0)
    prefix = chain("tenant", 40)
    ctrl.submit(agentic("a", prefix, 500, 100), 0.0)
    ctrl.upsert_replica(sharing_replica(capacity=2000, shares=False), 0.5)  # restarted so
    b = ctrl.submit(agentic("b", prefix, 500, 100), 1.0).verdict
    assert isinstance(b, Admit) and ctrl.report.reserved_tokens("r1") == 1200  # no credit
    assert not ctrl.report.shares_prefix("m")
    ctrl.release("a", 2.0)
    ctrl.release("b", 2.0)
    assert ctrl.report.reserved_tokens() == 0


def test_disabled_by_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("admission.ledger.PREFIX_SETTLE_S", 0.0)
    ctrl = controller(share_prefix=False)
    ctrl.upsert_replica(sharing_replica(capacity=1000), 0.0)
    prefix = chain("tenant", 40)
    assert isinstance(ctrl.submit(agentic("a", prefix, 500, 100), 0.0).verdict, Admit)
    assert isinstance(ctrl.submit(agentic("b", prefix, 500, 100), 1.0).verdict, Queued)


def test_a_top_up_counts_the_shared_part_as_held(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("admission.ledger.PREFIX_SETTLE_S", 0.0)
    ctrl = controller()
    ctrl.upsert_replica(sharing_replica(capacity=2000), 0.0)
    prefix = chain("tenant", 40)
    ctrl.submit(agentic("a", prefix, 500, 100), 0.0)
    b = ctrl.submit(agentic("b", prefix, 500, 100), 1.0).verdict
    assert isinstance(b, Admit) and b.reserved_tokens == 600
    before = ctrl.report.reserved_tokens("r1")
    assert ctrl.top_up("b", 600, 1.5)  # within what it holds, the shared part included
    assert ctrl.report.reserved_tokens("r1") == before
    assert ctrl.top_up("b", 650, 1.6)
    assert ctrl.report.reserved_tokens("r1") == before + 50
    ctrl.release("b", 2.0)
    ctrl.release("a", 2.0)
    assert ctrl.report.reserved_tokens() == 0


class _Engine:
    """An engine that shares computed prefix blocks: a request references, block by
    block from the root, a live copy computed by the time it arrives, and computes its
    own copy of the rest (ready `settle` later); a copy lives while referenced."""

    def __init__(self, settle: float, true_block: int) -> None:
        self.settle = settle
        self.true_block = true_block
        self.copies: dict[int, list[tuple[float, set[str]]]] = {}
        self.private: dict[str, int] = {}
        self.refs: dict[str, list[tuple[int, int]]] = {}

    def admit(self, rid: str, req: AdmissionRequest, now: float) -> None:
        sharing = True
        refs = []
        for h in req.prefix_hashes:
            copies = self.copies.setdefault(h, [])
            ready = [i for i, (at, users) in enumerate(copies) if at <= now and users]
            if sharing and ready:
                i = ready[0]
            else:
                sharing = False
                copies.append((now + self.settle, set()))
                i = len(copies) - 1
            copies[i][1].add(rid)
            refs.append((h, i))
        self.refs[rid] = refs
        blocks = len(req.prefix_hashes) * self.true_block
        self.private[rid] = req.prompt_tokens - blocks + req.expected_output

    def release(self, rid: str) -> None:
        for h, i in self.refs.pop(rid):
            self.copies[h][i][1].discard(rid)
        del self.private[rid]

    def holds(self) -> int:
        live = sum(1 for cs in self.copies.values() for _, users in cs if users)
        return sum(self.private.values()) + live * self.true_block


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_the_shared_ledger_exact_and_safe(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(seed)
    bs = rng.choice([1, 4, 16])
    settle = rng.choice([0.0, 0.5, 2.0])
    monkeypatch.setattr("admission.ledger.PREFIX_SETTLE_S", settle)
    ctrl = controller(queue_max_per_model=50)
    ctrl.upsert_replica(sharing_replica(capacity=rng.choice([1500, 3000, 6000]), bs=bs), 0.0)
    tenants = {t: chain(t, rng.randint(5, 60)) for t in "abcd"}
    engine = _Engine(settle, true_block=12)  # requests pass a lower bound (8-12)
    pending: dict[str, AdmissionRequest] = {}
    live: set[str] = set()
    now = 0.0
    shared_any = False

    def admitted(rid: str) -> None:
        engine.admit(rid, pending.pop(rid), now)
        live.add(rid)

    def settled(events: Events) -> None:
        for e in events:
            if isinstance(e, Admit):
                admitted(e.request_id)
            else:  # shed from the queue: it is answered, nothing to release
                del pending[e.request_id]

    for n in range(300):
        op = rng.random()
        now += rng.choice([0.0, 0.1, 0.7])
        if op < 0.5:
            t = rng.choice("abcd")
            hashes = tenants[t][: rng.randint(1, len(tenants[t]))]
            prompt = len(hashes) * 12 + rng.randint(0, 200)
            req = agentic(f"q{n}", hashes, prompt, rng.randint(1, 200), rng.choice([8, 10, 12]))
            pending[req.request_id] = req
            decision = ctrl.submit(req, now)
            v = decision.verdict
            if isinstance(v, Admit):
                admitted(req.request_id)
            elif not isinstance(v, Queued):
                del pending[req.request_id]
            settled(decision.events)
        elif op < 0.85 and live:
            rid = rng.choice(sorted(live))
            live.discard(rid)
            engine.release(rid)
            for a in ctrl.release(rid, now):
                admitted(a.request_id)
        elif live:
            rid = rng.choice(sorted(live))
            res = ctrl.report.reservation(rid)
            assert res is not None
            ctrl.top_up(rid, res.reserved_tokens + rng.randint(0, 40), now)
        settled(ctrl.advance(now))
        rep = ctrl._ledger.replicas["r1"]
        private = sum(r.tokens for r in ctrl._ledger.reservations.values())
        pinned = rep.prefixes.tokens if rep.prefixes is not None else 0
        assert rep.reserved == private + pinned
        assert rep.reserved <= rep.effective
        assert rep.reserved >= engine.holds()  # never less than the engine holds
        full = sum(r.tokens + r.covered for r in ctrl._ledger.reservations.values())
        shared_any = shared_any or rep.reserved < full
    assert shared_any  # the credit was exercised, not only the bookkeeping
    for rid in sorted(live):
        ctrl.release(rid, now)
    for rid in sorted(pending):
        ctrl.release(rid, now)
    assert ctrl.report.reserved_tokens() == 0 and ctrl.report.queue_depth() == 0
