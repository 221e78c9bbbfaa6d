"""A deadline nobody states is not assumed (invariant 7, docs/principles.md): a request whose client
states no timeout, of a population whose patience is not learned yet, waits in the queue
until it starts or its client leaves, unless an operator configured `queue_timeout_s`."""

from __future__ import annotations

from admission.types import Queued
from bench.matrix import CLIENTS
from bench.vtime import run
from enginesim.workloads import seed2_workload
from tests.admission.helpers import admits, controller, filled, request, sheds


def test_an_unstated_deadline_is_not_assumed_while_queued() -> None:
    ctrl = controller()
    now = filled(ctrl)
    assert isinstance(ctrl.submit(request("patient", 100, 100), now).verdict, Queued)
    # An hour on, nothing has shed it: no time passing is a reason to.
    assert sheds(ctrl.advance(now + 3600.0)) == []
    assert ctrl.report.queue_depth() == 1
    # Room frees: it starts.
    events = ctrl.release("run0", now + 3600.5)
    assert [a.request_id for a in admits(events)] == ["patient"]


def test_a_configured_queue_timeout_still_bounds_the_wait() -> None:
    ctrl = controller(queue_timeout_s=30.0)
    now = filled(ctrl)
    assert isinstance(ctrl.submit(request("patient", 100, 100), now).verdict, Queued)
    assert sheds(ctrl.advance(now + 1.0)) == []
    # Shed by its deadline: at it, or once nothing released leaves it time to start.
    (shed,) = sheds(ctrl.advance(now + 30.5))
    assert shed.request_id == "patient" and shed.reason in ("queue_timeout", "deadline")
    assert ctrl.report.queue_depth() == 0


def test_a_burst_of_clients_that_wait_for_ever_is_served_whole() -> None:
    """Seed 001's card and job, 150 requests at once from clients that state no timeout
    and never give up waiting (a script on `requests` without a timeout), retrying a shed
    twice: under the 30 s default this replaced, each was shed after 30 s queued and
    again on its return, and 36 failed after three sheds (114 of 150 completed)."""
    seed = 368937
    items = seed2_workload(150, seed=seed)
    kw = {k: v for k, v in CLIENTS["no-timeout"].items() if k != "no_timeout"}
    report = run("seed2-8b-16gb", items, concurrency=len(items), timeout_s=1e9,
                 max_retries=2, seed=seed, arrivals=[0.0] * len(items), **kw)  # fmt: skip
    assert report.completed == len(items), (report.failed, report.sheds)
    assert report.preemptions == 0
    # Served near the replica's best fixed concurrency (16 here), not held back.
    fixed = run("seed2-8b-16gb", items, concurrency=len(items), timeout_s=1e9, straight=True,
                fixed=16, seed=seed, arrivals=[0.0] * len(items), **kw)  # fmt: skip
    assert report.wall_s <= 1.1 * fixed.wall_s, (report.wall_s, fixed.wall_s)
