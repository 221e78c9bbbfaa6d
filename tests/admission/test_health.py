"""Sans-IO replica health: probe hysteresis, outlier ejection, and the controller's
ejected flag (virtual time, no IO)."""

from __future__ import annotations

from admission.health import OutlierDetector, ProbeHysteresis
from admission.types import Admit, Queued, Shed
from tests.admission.helpers import controller, replica, request


def test_hysteresis_first_round_decides_then_needs_runs() -> None:
    h = ProbeHysteresis(fail_threshold=3, success_threshold=2)
    assert h.observe(True) is True
    # Two failed rounds, then a good one: still ready throughout, and the run restarts.
    assert [h.observe(ok) for ok in (False, False, True, False, False)] == [True] * 5
    assert h.observe(False) is False  # third failure in a row
    assert h.observe(True) is False  # one good round is not enough to return
    assert h.observe(False) is False
    assert [h.observe(True), h.observe(True)] == [False, True]


def test_hysteresis_starts_unready_and_force_down() -> None:
    h = ProbeHysteresis(fail_threshold=2, success_threshold=2)
    assert h.observe(False) is False
    assert [h.observe(True), h.observe(True)] == [False, True]
    h.force_down()
    assert h.observe(True) is False
    assert h.observe(True) is True


def test_thresholds_of_one_follow_every_round() -> None:
    h = ProbeHysteresis(1, 1)
    assert [h.observe(x) for x in (True, False, True, False)] == [True, False, True, False]


def _one(*, max_ejection_percent: float) -> OutlierDetector:
    """A detector that ejects on one failure (the outlier section's other defaults)."""
    return OutlierDetector(
        consecutive_failures=1,
        base_ejection_s=30.0,
        max_ejection_s=300.0,
        max_ejection_percent=max_ejection_percent,
    )


def _detector(**kw: float) -> OutlierDetector:
    d = OutlierDetector(
        consecutive_failures=int(kw.get("n", 3)),
        base_ejection_s=kw.get("base", 10.0),
        max_ejection_s=kw.get("cap", 35.0),
        max_ejection_percent=kw.get("pct", 50.0),
    )
    for name in ("a", "b"):
        d.add(name)
    return d


def test_consecutive_failures_eject_and_success_resets() -> None:
    d = _detector()
    assert d.failure("a", 0.0) is None
    assert d.failure("a", 0.0) is None
    d.success("a")  # the run is broken
    assert d.failure("a", 1.0) is None
    assert d.failure("a", 1.0) is None
    assert d.failure("a", 1.0) == 11.0
    assert d.ejected_until("a") == 11.0 and d.ejections("a") == 1
    assert d.failure("a", 2.0) is None  # already out: nothing changes
    assert d.expire(10.9) == []
    assert d.expire(11.0) == ["a"] and d.ejected_until("a") is None


def test_ejection_doubles_caps_and_is_forgotten() -> None:
    d = _detector(n=1)
    now = 0.0
    durations = []
    for _ in range(4):
        until = d.failure("a", now)
        assert until is not None
        durations.append(until - now)
        d.expire(until)
        now = until + 1.0  # fails again soon after it returns
    assert durations == [10.0, 20.0, 35.0, 35.0]
    # Healthy for longer than the cap: the next ejection is the base time again.
    now += 36.0
    until = d.failure("a", now)
    assert until == now + 10.0


def test_max_ejection_percent_keeps_enough_replicas() -> None:
    d = _detector(n=1, pct=50.0)
    assert d.failure("a", 0.0) is not None
    assert d.failure("b", 0.0) is None  # two of two would be out
    single = _one(max_ejection_percent=50.0)
    single.add("only")
    assert single.failure("only", 0.0) is None  # one of one: never
    full = _one(max_ejection_percent=100.0)
    full.add("only")
    assert full.failure("only", 0.0) is not None


def test_controller_ejected_replica_takes_nothing_new_and_releases() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica("r1", 1000), 0.0)
    first = ctrl.submit(request("x", 100, 100), 0.0).verdict
    assert isinstance(first, Admit)
    assert ctrl.set_ejected("r1", True, 1.0) == []
    # An upsert (discovery says ready) does not end the ejection.
    ctrl.upsert_replica(replica("r1", 1000), 1.5)
    usage = ctrl.report.replica_usage()[0]
    assert usage.ejected and not usage.ready and usage.binding_ceiling == "ejected"
    verdict = ctrl.submit(request("y", 100, 100, deadline=100.0), 2.0).verdict
    assert isinstance(verdict, Shed | Queued)
    # The reservation made before the ejection is released as its request ends.
    ctrl.release("x", 3.0)
    assert ctrl.report.reserved_tokens("r1") == 0
    admits = ctrl.set_ejected("r1", False, 4.0)
    if isinstance(verdict, Queued):
        assert [a.request_id for a in admits] == ["y"]
        ctrl.release("y", 5.0)
    assert ctrl.report.reserved_tokens() == 0 and ctrl.report.queue_depth() == 0
    assert not ctrl.report.replica_usage()[0].ejected
