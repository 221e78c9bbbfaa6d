"""A request's avoid set (the replicas that failed it): placement never puts it there,
whether at once or later from the queue, and the replicas stay usable for everyone else."""

from __future__ import annotations

from dataclasses import replace

from admission.types import Admit, Queued, Shed
from tests.admission.helpers import admits, controller, replica, request


def test_a_request_never_lands_on_a_replica_it_avoids() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica("a", 10_000), 0.0)
    ctrl.upsert_replica(replica("b", 10_000), 0.0)
    # Equal replicas tie and the picker breaks ties at random: without the avoid set
    # about half of these would go to "a".
    placed = set()
    for i in range(20):
        verdict = ctrl.submit(replace(request(f"r{i}", 10, 10), avoid=frozenset({"a"})), 0.0)
        assert isinstance(verdict.verdict, Admit)
        placed.add(verdict.verdict.replica)
    assert placed == {"b"}
    # The avoided replica still serves the others (and has the most headroom now).
    assert ctrl.submit(request("plain", 10, 10), 0.0).verdict.replica == "a"


def test_a_request_that_avoids_every_usable_replica_is_shed_at_once() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica("a", 10_000), 0.0)
    verdict = ctrl.submit(replace(request("r", 10, 10), avoid=frozenset({"a"})), 0.0).verdict
    # Not queued until its deadline for a replica it will never use.
    assert isinstance(verdict, Shed) and verdict.reason == "no_replica"
    assert ctrl.report.queue_depth() == 0


def test_a_queued_retry_waits_for_the_replica_it_may_use_and_blocks_only_that_one() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica("a", 1_000), 0.0)
    ctrl.upsert_replica(replica("b", 200), 0.0)
    assert ctrl.submit(request("full-b", 100, 100), 0.0).verdict == Admit("full-b", "b", 200)
    retry = replace(request("retry", 100, 100), avoid=frozenset({"a"}))
    # "a" has room, but the retry avoids it: it waits for "b".
    assert isinstance(ctrl.submit(retry, 1.0).verdict, Queued)
    # A later request is not held behind the retry on "a", which the retry never waits for.
    later = ctrl.submit(request("later", 100, 100), 2.0).verdict
    assert later == Admit("later", "a", 200)
    # Room on "a" does not admit the retry there; room on "b" does.
    assert ctrl.release("later", 3.0) == []
    assert admits(ctrl.release("full-b", 4.0)) == [Admit("retry", "b", 200)]
    ctrl.release("retry", 5.0)
    assert ctrl.report.reserved_tokens() == 0
