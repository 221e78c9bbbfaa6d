"""Retry memory, and the queue order it feeds (virtual time)."""

from __future__ import annotations

from admission.config import AdmissionConfig
from admission.controller import AdmissionController
from admission.retries import RetryMemory
from admission.types import AdmissionRequest, Admit, Queued
from routing.scheduler import default_profile
from routing.types import ReplicaState


def test_remembers_first_arrival_until_ttl() -> None:
    mem = RetryMemory(ttl_s=10.0, max_entries=100)
    assert mem.first_arrival("k", now=0.0) is None
    mem.remember("k", arrival=1.0, now=2.0)
    assert mem.first_arrival("k", now=5.0) == 1.0
    # Shed again later: the first arrival stands, the expiry moves.
    mem.remember("k", arrival=7.0, now=8.0)
    assert mem.first_arrival("k", now=17.0) == 1.0
    assert mem.first_arrival("k", now=18.0) is None  # 8 + 10
    assert len(mem) == 0


def test_forget_and_bounds() -> None:
    mem = RetryMemory(ttl_s=10.0, max_entries=3)
    for i in range(5):
        mem.remember(i, arrival=float(i), now=float(i))
    assert len(mem) == 3
    assert mem.first_arrival(0, now=5.0) is None and mem.first_arrival(1, now=5.0) is None
    assert mem.first_arrival(4, now=5.0) == 4.0
    mem.forget(4)
    assert mem.first_arrival(4, now=5.0) is None
    # Expired entries are dropped when new ones come in.
    mem.remember("late", arrival=30.0, now=30.0)
    assert len(mem) == 1
    disabled = RetryMemory(ttl_s=0.0, max_entries=3)
    disabled.remember("k", 1.0, 1.0)
    assert disabled.first_arrival("k", 1.0) is None


def test_an_older_arrival_is_queued_and_admitted_first() -> None:
    ctrl = AdmissionController(
        AdmissionConfig(headroom=0.0, queue_timeout_s=100.0), default_profile(seed=1), seed=1
    )
    ctrl.upsert_replica(
        ReplicaState(
            name="r",
            base_url="",
            ready=True,
            models=["m"],
            capacity_tokens=1000,
            block_size=1,
            max_running=1,
        ),
        now=0.0,
    )

    def req(rid: str, arrival: float) -> AdmissionRequest:
        return AdmissionRequest(
            rid, "m", prompt_tokens=10, expected_output=10, max_tokens=10, arrival=arrival
        )

    assert isinstance(ctrl.submit(req("running", 0.0), now=0.0).verdict, Admit)
    newer = ctrl.submit(req("newer", 5.0), now=5.0).verdict
    retry = ctrl.submit(req("retry", 1.0), now=6.0).verdict  # a retry that first arrived at t=1
    assert isinstance(newer, Queued) and isinstance(retry, Queued)
    assert retry.position == 0  # ahead of the newer arrival
    admitted = ctrl.release("running", now=7.0)
    assert [a.request_id for a in admitted] == ["retry"]
    assert [a.request_id for a in ctrl.release("retry", now=8.0)] == ["newer"]
    ctrl.release("newer", now=9.0)
    assert ctrl.report.reserved_tokens() == 0
