"""The admission bridge hands each queued request its verdict, including one the
controller produces before the request's handler gets back to awaiting it."""

from __future__ import annotations

from admission.types import Admit, Queued
from gateway.admitter import AdmissionBridge
from tests.admission.helpers import controller, replica, request


async def test_an_admission_between_queueing_and_waiting_reaches_its_waiter() -> None:
    # A retry after a replica's 5xx is queued, then that replica is reinstated, which can
    # admit the retry at once: the waiter registered in between must receive it (it used
    # to be taken for a departed client's and given back, and the retry waited forever).
    ctrl = controller()
    bridge = AdmissionBridge(ctrl)
    ctrl.upsert_replica(replica("r1", 200), 0.0)
    assert isinstance(ctrl.submit(request("holder", 100, 100), 0.0), Admit)
    assert isinstance(ctrl.submit(request("retry", 100, 100), 0.0), Queued)
    waiter = bridge.expect("retry")
    bridge.release("holder")  # frees the room: the controller admits "retry" here
    verdict = await bridge.wait_queued("retry", waiter)
    assert isinstance(verdict, Admit) and verdict.replica == "r1"
    assert ctrl.reserved_tokens() == 200  # held by the retry, not given back
    bridge.release("retry")
    assert ctrl.reserved_tokens() == 0 and ctrl.queue_depth() == 0


async def test_without_a_waiter_an_admission_is_given_back() -> None:
    # The other side of the same rule: nobody waits (the client left), nothing leaks.
    ctrl = controller()
    bridge = AdmissionBridge(ctrl)
    ctrl.upsert_replica(replica("r1", 200), 0.0)
    assert isinstance(ctrl.submit(request("holder", 100, 100), 0.0), Admit)
    assert isinstance(ctrl.submit(request("gone", 100, 100), 0.0), Queued)
    bridge.release("holder")
    assert ctrl.reserved_tokens() == 0 and ctrl.queue_depth() == 0
