"""Placement stops walking the most-free order where no replica further on could hold the
request (admission/placement.py): a decision when slices are full costs what fits, not
the fleet, and places exactly as the whole walk does."""

from __future__ import annotations

import random

import pytest

import admission.placement as placement
from admission.ledger import Ledger
from admission.types import Admit
from tests.admission.helpers import controller, replica, request


def _fleet(seed: int, n: int):
    """`n` replicas of two pool sizes, each capped at a random leased slice."""
    rng = random.Random(seed)
    c = controller()
    for i in range(n):
        c.upsert_replica(replica(f"r{i}", rng.choice((4_000, 8_000)), block_size=16), 0.0)
    for i in range(n):
        c.set_pool_share(f"r{i}", rng.randrange(0, 3_000), 0.0)
    return c, rng


def _run(c, rng: random.Random, steps: int) -> list[tuple[str, str | None]]:
    """Submit and release at random; what each submit was answered."""
    out: list[tuple[str, str | None]] = []
    running: list[str] = []
    for i in range(steps):
        t = 1.0 + i * 0.01
        if running and rng.random() < 0.4:
            c.release(running.pop(rng.randrange(len(running))), t)
            continue
        rid = f"q{i}"
        v = c.submit(request(rid, rng.randint(50, 1_500), rng.randint(10, 400)), t).verdict
        if isinstance(v, Admit):
            running.append(rid)
            out.append((rid, v.replica))
        else:
            out.append((rid, type(v).__name__))
    return out


@pytest.mark.parametrize("seed", range(8))
def test_pruned_placement_is_the_whole_walk(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    pruned = _run(*_fleet(seed, 40), 300)
    monkeypatch.setattr(placement, "_least_need", lambda view, req: -float("inf"))
    whole = _run(*_fleet(seed, 40), 300)
    assert pruned == whole
    assert any(r not in ("Queued", "Shed") for _, r in pruned)  # some were placed
    assert any(r == "Queued" for _, r in pruned)  # and some found no room


def _nearly_full():
    """1,000 replicas whose slices are nearly full but two."""
    c = controller()
    for i in range(1_000):
        c.upsert_replica(replica(f"r{i}", 8_000), 0.0)
        c.set_pool_share(f"r{i}", 100 if i not in (7, 500) else 2_000, 0.0)
    return c


def test_a_full_fleet_is_not_walked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request none of 1,000 nearly full slices can hold looks at none of them, one
    that two can hold at about those two."""
    seen: list[str] = []
    fits_now = Ledger.fits_now

    def counted(self, rep, req, now):  # type: ignore[no-untyped-def]
        seen.append(rep.name)
        return fits_now(self, rep, req, now)

    monkeypatch.setattr(Ledger, "fits_now", counted)
    c = _nearly_full()
    assert not isinstance(c.submit(request("big", 1_500, 600), 1.0).verdict, Admit)
    assert len(seen) <= 2  # the two larger slices at most: they lack 2,100 too
    seen.clear()
    v = _nearly_full().submit(request("mid", 800, 200), 1.0).verdict
    assert isinstance(v, Admit) and v.replica in ("r7", "r500")
    assert len(seen) <= 3
