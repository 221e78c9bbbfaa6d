"""The admission door hands each queued request its verdict, including one the
controller produces before the request's handler gets back to awaiting it."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from admission.types import AdmissionRequest, Admit, Queued, RequestEnd, Shed
from gateway.door import AdmissionDoor
from tests.admission.helpers import controller, replica, request


async def test_an_admission_between_queueing_and_waiting_reaches_its_waiter() -> None:
    # A retry after a replica's 5xx is queued, then room frees, which can admit the
    # retry at once: the waiter registered in between must receive it (it used
    # to be taken for a departed client's and given back, and the retry waited forever).
    ctrl = controller()
    door = AdmissionDoor(ctrl)
    door.upsert_replica(replica("r1", 200), 0.0)
    assert isinstance(door.submit(request("holder", 100, 100), 0.0), Admit)
    assert isinstance(door.submit(request("retry", 100, 100), 0.0), Queued)
    waiter = door.expect("retry")
    door.request_ended(RequestEnd("holder"))  # frees the room: the controller admits "retry" here
    verdict = await door.wait_queued("retry", waiter)
    assert isinstance(verdict, Admit) and verdict.replica == "r1"
    assert door.report.reserved_tokens() == 200  # held by the retry, not given back
    door.request_ended(RequestEnd("retry"))
    assert door.report.reserved_tokens() == 0 and door.report.queue_depth() == 0


async def test_without_a_waiter_an_admission_is_given_back() -> None:
    # The other side of the same rule: nobody waits (the client left), nothing leaks.
    ctrl = controller()
    door = AdmissionDoor(ctrl)
    door.upsert_replica(replica("r1", 200), 0.0)
    assert isinstance(door.submit(request("holder", 100, 100), 0.0), Admit)
    assert isinstance(door.submit(request("gone", 100, 100), 0.0), Queued)
    door.request_ended(RequestEnd("holder"))
    assert door.report.reserved_tokens() == 0 and door.report.queue_depth() == 0


async def test_a_displaced_entry_is_answered_by_the_submit_that_displaced_it() -> None:
    # The newcomer's decision carries the shed of the entry it displaced; the door hands
    # it to that entry's waiter at once (there is no later call to fetch it from).
    ctrl = controller(queue_max_per_model=2)
    door = AdmissionDoor(ctrl)
    door.upsert_replica(replica("r1", 200), 0.0)

    def of(rid: str) -> AdmissionRequest:
        return dataclasses.replace(request(rid, 100, 100), tenant=rid[0])

    assert isinstance(door.submit(of("a-0"), 0.0), Admit)
    assert isinstance(door.submit(of("a-1"), 0.0), Queued)
    assert isinstance(door.submit(of("a-2"), 0.0), Queued)
    waiter = door.expect("a-2")
    assert isinstance(door.submit(of("b-1"), 0.0), Queued)
    assert waiter.done()
    shed = await door.wait_queued("a-2", waiter)
    assert isinstance(shed, Shed) and shed.reason == "queue_full"
    door.request_ended(RequestEnd("a-0"))  # admits a-1, whose waiter left: the door gives it back
    door.request_ended(RequestEnd("b-1"))  # leaves the queue
    assert door.report.reserved_tokens() == 0 and door.report.queue_depth() == 0


@pytest.mark.slow
def test_the_door_is_the_gateways_only_way_to_the_controller() -> None:
    # gateway_state.py builds the controller and hands it to the door; every other gateway
    # module changes admission through the door and reads its report.
    gateway = Path(__file__).resolve().parents[2] / "gateway"
    importers = set()
    for path in sorted(gateway.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "admission.controller":
                importers.add(path.name)
    assert importers == {"gateway_state.py", "door.py"}
