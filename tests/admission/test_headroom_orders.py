"""The per-model headroom orders (admission/views.py, admission/candidates.py) follow the
ledger as a decision reads them: whatever came between two decisions, a read finds the
replicas in the order a view built afresh from their ledgers now gives; a replica that a
release returns to where its reservation took it is not moved at all."""

from __future__ import annotations

import random
from typing import Any

import pytest

import admission.candidates as candidates
from admission.controller import AdmissionController
from admission.types import Admit
from tests.admission.helpers import controller, replica, request


def _built_afresh(c: AdmissionController) -> tuple[list[tuple[float, str]], ...]:
    """The two orders as a view built now from every present replica's ledger gives them."""
    views = c._views
    views.membership_changed()  # the next `view` is built anew
    orders = views.orders(views.view("m"))
    return list(orders.by_free()), list(orders.by_run())


@pytest.mark.parametrize("seed", range(4))
def test_a_read_finds_the_orders_of_the_ledgers_now(seed: int) -> None:
    rng = random.Random(seed)
    c = controller()
    for i in range(12):
        c.upsert_replica(replica(f"r{i}", rng.choice((4_000, 8_000)), max_running=8), 0.0)
    running: list[str] = []
    for i in range(200):
        t = 1.0 + i * 0.01
        # Several releases and top-ups may come between two decisions.
        for _ in range(rng.randrange(3)):
            if running:
                rid = running.pop(rng.randrange(len(running)))
                c.release(rid, t)
        if running and rng.random() < 0.3:
            c.top_up(rng.choice(running), rng.randint(200, 1_200), t)
        rid = f"q{i}"
        if isinstance(c.submit(request(rid, rng.randint(50, 900), 50), t).verdict, Admit):
            running.append(rid)
        views = c._views
        orders = views.orders(views.view("m"))
        assert (list(orders.by_free()), list(orders.by_run())) == _built_afresh(c)


def test_a_reservation_released_before_the_next_decision_moves_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    c = controller()
    for i in range(4):
        c.upsert_replica(replica(f"r{i}", 8_000), 0.0)
    c.submit(request("warm", 100, 50), 1.0)  # the view and its orders are built
    c.release("warm", 1.0)
    moves: list[object] = []
    move = candidates._move

    def counted(*a: Any) -> None:
        moves.append(a)
        move(*a)

    monkeypatch.setattr(candidates, "_move", counted)
    for i in range(5):
        assert isinstance(c.submit(request(f"q{i}", 100, 50), 2.0 + i).verdict, Admit)
        c.release(f"q{i}", 2.0 + i)
    assert moves == []
    # One still running is placed anew by the next decision that reads the orders.
    assert isinstance(c.submit(request("held", 100, 50), 9.0).verdict, Admit)
    c.submit(request("next", 100, 50), 9.5)
    assert moves
