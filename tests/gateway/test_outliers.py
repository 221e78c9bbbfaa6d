"""Outlier ejection on the upstream side (gateway/upstream/outliers.py): every change, the
ejection and its end, reaches every subscriber, in order, whatever one of them does;
and over real loopback HTTP, the gateway's own subscribers (admission, metrics) and a
test's hear the same changes of a replica that answers 5xx."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from admission.health import OutlierDetector
from enginesim.faults import make_fault
from gateway.config import OutlierConfig
from gateway.upstream.outliers import EjectionChange, OutlierEjection
from tests.gateway.conftest import wait_for
from tests.gateway.test_health import SHORT, _metric, _usage


class Heard:
    """A subscriber that records every change and wakes whoever waits for a return."""

    def __init__(self) -> None:
        self.changes: list[EjectionChange] = []
        self.returned = asyncio.Event()

    def __call__(self, change: EjectionChange) -> None:
        self.changes.append(change)
        if not change.ejected:
            self.returned.set()


def ejection(base_s: float = 0.05, *, failures: int = 1) -> OutlierEjection:
    detector = OutlierDetector(
        consecutive_failures=failures,
        base_ejection_s=base_s,
        max_ejection_s=300.0,
        max_ejection_percent=50.0,
    )
    for name in ("a", "b", "c", "d"):  # two of four may be out at once
        detector.add(name)
    return OutlierEjection(detector)


async def test_an_ejection_and_its_end_reach_every_subscriber_in_order():
    out = ejection()
    first, second = Heard(), Heard()
    order: list[str] = []
    out.subscribe(first)
    out.subscribe(lambda c: order.append(f"first saw {c.ejected}"))
    out.subscribe(second)
    out.subscribe(lambda c: order.append(f"second saw {c.ejected}"))
    out.failure("a", "status_5xx")
    assert [(c.replica, c.ejected) for c in first.changes] == [("a", True)]
    assert first.changes == second.changes
    change = first.changes[0]
    assert change.until is not None and change.until - change.at == pytest.approx(0.05)
    async with asyncio.timeout(5.0):
        await second.returned.wait()
    assert [(c.replica, c.ejected) for c in first.changes] == [("a", True), ("a", False)]
    assert first.changes == second.changes
    end = first.changes[1]
    assert end.at >= change.until and end.until is None  # never before the ejection's end
    assert order == ["first saw True", "second saw True", "first saw False", "second saw False"]
    out.close()


async def test_a_subscriber_that_raises_does_not_keep_the_change_from_the_others():
    out = ejection()

    def broken(change: EjectionChange) -> None:
        raise RuntimeError("subscriber bug")

    heard = Heard()
    out.subscribe(broken)
    out.subscribe(heard)
    out.failure("a", "connect")
    assert [c.ejected for c in heard.changes] == [True]
    async with asyncio.timeout(5.0):
        await heard.returned.wait()  # the ejection still ended
    assert out.detector is not None and out.detector.ejected_until("a") is None
    out.close()


async def test_only_failures_that_say_the_replica_is_unwell_count():
    out = ejection(failures=2)
    heard = Heard()
    out.subscribe(heard)
    for kind in ("dropped", "stream_error", "status_4xx"):
        out.failure("a", kind)
        out.failure("a", kind)
    assert heard.changes == []
    out.failure("a", "timeout")
    out.success("a")  # an answer in between ends the run
    out.failure("a", "timeout")
    assert heard.changes == []
    out.failure("a", "timeout")
    assert [(c.replica, c.ejected) for c in heard.changes] == [("a", True)]
    out.close()


async def test_close_cancels_the_end_of_an_ejection():
    out = ejection(base_s=0.05)
    heard = Heard()
    out.subscribe(heard)
    out.failure("a", "connect")
    out.close()
    # The loop runs timers in the order of their time: once ours, set just after the
    # ejection's end, has run, the cancelled end would have been published.
    past_the_end = asyncio.Event()
    until = heard.changes[0].until
    assert until is not None
    asyncio.get_running_loop().call_at(until + 0.01, past_the_end.set)
    async with asyncio.timeout(5.0):
        await past_the_end.wait()
    assert [c.ejected for c in heard.changes] == [True]


async def test_disabled_ejection_publishes_nothing():
    out = OutlierEjection.from_config(OutlierConfig(enabled=False), ["a", "b"])
    heard = Heard()
    out.subscribe(heard)
    for _ in range(10):
        out.failure("a", "connect")
    assert out.detector is None and heard.changes == []


async def test_the_gateway_publishes_a_5xx_replica_s_ejection_and_its_return(replica, gateway):
    bad, good = await replica(), await replica()
    gw = await gateway(
        bad,
        good,
        discovery={"fail_threshold": 1000},  # the request path alone must find it
        outlier={"consecutive_failures": 2, "base_ejection_s": 0.5},
    )
    published = gw.state.pipeline.failover.ejection
    heard = Heard()
    admission_saw: list[bool] = []
    # Subscribers hear in order: admission (subscribed by the gateway) has heard first.
    published.subscribe(heard)
    published.subscribe(lambda c: admission_saw.append(_usage(gw, c.replica).ejected))
    bad.set_fault(make_fault("error", status=500))
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(40):
                async with s.post(gw.url + "/v1/chat/completions", json=SHORT) as r:
                    assert r.status == 200  # retried on the good replica
                if heard.changes:
                    break
        assert [(c.replica, c.ejected) for c in heard.changes] == [("r0", True)]
        assert admission_saw == [True]
        assert await _metric(gw, "kvgate_replica_ejections", "r0") == 1.0
    finally:
        bad.set_fault(make_fault("none"))
    async with asyncio.timeout(5.0):
        await heard.returned.wait()
    assert [(c.replica, c.ejected) for c in heard.changes] == [("r0", True), ("r0", False)]
    assert admission_saw == [True, False]
    assert await wait_for(lambda: _usage(gw, "r0").ready, within=5.0)
