"""Backfill past a waiting head (admission/backfill.py), on virtual time."""

from __future__ import annotations

from admission.controller import AdmissionController
from admission.types import Admit, Completion, Queued
from tests.admission.helpers import admits, controller, replica, request


def teach_service(ctrl: AdmissionController, now: float) -> float:
    """Completions whose service is 10 ms per output token; returns the time reached."""
    for i, out in enumerate((50, 100, 200, 400)):
        assert isinstance(ctrl.submit(request(f"w{i}", 100, out), now).verdict, Admit)
        now += out * 0.01
        done = Completion(ok=True, service_s=out * 0.01, prompt_tokens=100, completion_tokens=out)
        ctrl.release(f"w{i}", now, done)
    return now


def short_and_long_running(ctrl: AdmissionController, now: float) -> None:
    """`short` (300 tokens, ends first) and `long` (600) run; 100 of 1,000 are free."""
    assert isinstance(ctrl.submit(request("short", 200, 100), now).verdict, Admit)
    assert isinstance(ctrl.submit(request("long", 200, 400), now).verdict, Admit)


def test_a_request_within_the_room_beside_the_head_starts_past_it() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica(capacity=1000), 0.0)
    now = teach_service(ctrl, 0.0)
    short_and_long_running(ctrl, now)
    # The head needs 350: once `short` ends 400 are free, and 50 are left beside it.
    assert isinstance(ctrl.submit(request("head", 300, 50), now).verdict, Queued)
    assert isinstance(ctrl.submit(request("fits", 30, 10), now).verdict, Admit)
    # 100 free now would take this one too, but not beside the head at its shadow.
    assert isinstance(ctrl.submit(request("too_big", 30, 30), now).verdict, Queued)
    # The head starts when `short` ends, as it would have with nothing passing it.
    assert [a.request_id for a in admits(ctrl.release("short", now + 1.0))] == ["head"]
    assert ctrl.report.reserved_tokens() == 600 + 40 + 350


def test_nothing_passes_the_head_before_any_service_was_seen() -> None:
    """Without a service sample the order of the running requests' ends is unknown."""
    ctrl = controller()
    ctrl.upsert_replica(replica(capacity=1000), 0.0)
    short_and_long_running(ctrl, 0.0)
    assert isinstance(ctrl.submit(request("head", 300, 50), 0.0).verdict, Queued)
    assert isinstance(ctrl.submit(request("small", 30, 10), 0.0).verdict, Queued)
    assert [a.request_id for a in admits(ctrl.release("short", 1.0))] == ["head", "small"]


def test_a_head_waiting_for_a_running_slot_lets_nothing_pass() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica(capacity=1000, max_running=2), 0.0)
    now = teach_service(ctrl, 0.0)
    short_and_long_running(ctrl, now)
    assert isinstance(ctrl.submit(request("head", 300, 50), now).verdict, Queued)
    assert isinstance(ctrl.submit(request("small", 5, 5), now).verdict, Queued)
    assert [a.request_id for a in admits(ctrl.release("short", now + 1.0))] == ["head"]
