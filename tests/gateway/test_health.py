"""Discovery hysteresis and outlier ejection over real loopback HTTP.

A failed probe round no longer takes a replica out at once; consecutive upstream
failures eject a replica for a while, and what was reserved there still releases.
The `gateway` fixture checks that nothing stays reserved after each test.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from enginesim.faults import make_fault
from tests.gateway.conftest import MODEL, wait_for

SHORT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
ADMIN = "admin-secret"


async def _status_of_a_short_chat(gw) -> int:
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw.url + "/v1/chat/completions", json=SHORT) as r,
    ):
        await r.read()
        return r.status


def _usage(gw, name: str):
    return next(u for u in gw.report.replica_usage() if u.name == name)


async def _metric(gw, family: str, replica: str) -> float | None:
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
        text = await r.text()
    for fam in text_string_to_metric_families(text):
        if fam.name == family:
            for smp in fam.samples:
                if smp.labels.get("replica") == replica and not smp.name.endswith("_created"):
                    return smp.value
    return None


@pytest.mark.slow
async def test_failed_probe_rounds_keep_a_single_replica_ready_until_threshold(replica, gateway):
    srv = await replica()
    gw = await gateway(
        srv,
        discovery={"fail_threshold": 3, "success_threshold": 2, "probe_timeout_s": 0.2},
    )
    hyst = gw.state.discovery.watchers["r0"].hysteresis
    assert _usage(gw, "r0").ready
    srv.set_fault(make_fault("hang"))  # probes time out
    try:
        assert await wait_for(lambda: hyst._fails >= 1, within=5.0)
        # One (and two) failed rounds: still ready, so requests would still be admitted.
        assert hyst._fails < 3 and _usage(gw, "r0").ready
        async with aiohttp.ClientSession() as s, s.get(gw.url + "/ready") as r:
            assert r.status == 200
        assert await wait_for(lambda: not _usage(gw, "r0").ready, within=5.0)
        assert hyst._fails >= 3
    finally:
        srv.set_fault(make_fault("none"))
    # Back after two good rounds in a row; a request then completes.
    assert await wait_for(lambda: _usage(gw, "r0").ready, within=5.0)
    assert hyst._oks >= 2
    assert await _status_of_a_short_chat(gw) == 200


@pytest.mark.slow
async def test_a_slow_metrics_answer_still_arrives_and_keeps_the_replica_ready(replica, gateway):
    """vLLM's API server on a busy CPU answered /metrics 3.5 s late. Each round's GET was
    cut at the probe timeout: no answer ever arrived, the learned limit heard nothing
    (no preemption, no engine queue) while the engine was loaded, and after
    `fail_threshold` rounds a replica that served every request was taken out. A GET the
    round's timeout cuts now runs on, and the next round takes its answer."""
    srv = await replica()
    gw = await gateway(
        srv,
        discovery={
            "fail_threshold": 3,
            "success_threshold": 1,
            "probe_timeout_s": 0.2,
            "refresh_interval_s": 0.2,
        },
    )
    watcher = gw.state.discovery.watchers["r0"]
    srv.set_fault(make_fault("slow_metrics", delay_s=0.35))
    try:
        assert await wait_for(lambda: watcher.error is not None, within=5.0)
        assert "timed out after 0.2 s" in watcher.error
        seen = {watcher.state.updated_at}
        loop = asyncio.get_running_loop()
        end = loop.time() + 3.0
        while loop.time() < end:
            assert _usage(gw, "r0").ready  # late, not dead: never taken out
            seen.add(watcher.state.updated_at)
            await asyncio.sleep(0.05)
        assert len(seen) >= 3, seen  # fresh answers kept arriving, a round late
        assert await _status_of_a_short_chat(gw) == 200
    finally:
        srv.set_fault(make_fault("none"))


@pytest.mark.slow
async def test_a_replica_slower_than_the_probe_timeout_from_the_start_still_joins(replica, gateway):
    """An engine whose /metrics always answers later than the probe timeout (vLLM
    loaded from the start): its answers arrive every other round, a round late. Counted
    as failures, the rounds between kept hysteresis from two good rounds in a row and a
    replica that serves every request never joined. Those rounds now give no verdict."""
    srv = await replica()
    srv.set_fault(make_fault("slow_metrics", delay_s=0.45))
    try:
        gw = await gateway(
            srv,
            discovery={"success_threshold": 2, "probe_timeout_s": 0.2, "refresh_interval_s": 0.2},
        )
        watcher = gw.state.discovery.watchers["r0"]
        assert await wait_for(lambda: _usage(gw, "r0").ready, within=5.0), watcher.error
        assert watcher.state.capacity_tokens is not None
        assert await _status_of_a_short_chat(gw) == 200
    finally:
        srv.set_fault(make_fault("none"))


async def test_consecutive_5xx_eject_a_replica_then_it_returns(replica, gateway):
    bad, good = await replica(), await replica()
    gw = await gateway(
        bad,
        good,
        # Discovery must not take `bad` out itself: this test is about the request path.
        discovery={"fail_threshold": 1000},
        auth={"admin_token": ADMIN},
    )
    pipeline = gw.state.pipeline
    assert pipeline.outliers is not None
    # Shorten the ejection for the test (the detector is sans-IO: plain attributes).
    pipeline.outliers.consecutive_failures = 2
    pipeline.outliers.base_ejection_s = 0.6
    bad.set_fault(make_fault("error", status=500))
    async with aiohttp.ClientSession() as s:
        for _ in range(40):
            async with s.post(gw.url + "/v1/chat/completions", json=SHORT) as r:
                # A 5xx before any byte is retried on the good replica: the client sees 200.
                assert r.status == 200
            if _usage(gw, "r0").ejected:
                break
        assert _usage(gw, "r0").ejected
        assert _usage(gw, "r0").binding_ceiling == "ejected"
        assert await _metric(gw, "kvgate_replica_ejections", "r0") == 1.0
        assert await _metric(gw, "kvgate_replica_ejected", "r0") == 1.0
        assert await _metric(gw, "kvgate_replica_ejected", "r1") == 0.0
        headers = {"Authorization": f"Bearer {ADMIN}"}
        async with s.get(gw.url + "/admin/replicas", headers=headers) as r:
            snap = {x["name"]: x for x in (await r.json())["replicas"]}
        assert snap["r0"]["ejected"] is True and snap["r0"]["ejections"] == 1
        assert 0 < snap["r0"]["ejected_for_s"] <= 0.6
        assert snap["r1"]["ejected"] is False and snap["r1"]["ejected_for_s"] is None
        # While ejected, every request goes to the good replica at the first attempt.
        before = await _metric(gw, "kvgate_upstream_errors", "r0")
        for _ in range(3):
            async with s.post(gw.url + "/v1/chat/completions", json=SHORT) as r:
                assert r.status == 200
        assert await _metric(gw, "kvgate_upstream_errors", "r0") == before
        bad.set_fault(make_fault("none"))
        assert await wait_for(lambda: not _usage(gw, "r0").ejected, within=5.0)
        assert _usage(gw, "r0").ready


async def test_max_ejection_percent_never_ejects_the_only_replica(replica, gateway):
    srv = await replica()
    gw = await gateway(srv, discovery={"fail_threshold": 1000})
    gw.state.pipeline.outliers.consecutive_failures = 1
    srv.set_fault(make_fault("error", status=500))
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            async with s.post(gw.url + "/v1/chat/completions", json=SHORT) as r:
                assert r.status == 500  # the engine's own answer, not a 503 no_replica
    assert not _usage(gw, "r0").ejected
    srv.set_fault(make_fault("none"))


async def test_requests_reserved_on_an_ejected_replica_finish_and_release(replica, gateway):
    srv = await replica(speed=5.0)
    gw = await gateway(srv, discovery={"fail_threshold": 1000})
    pipeline = gw.state.pipeline
    pipeline.outliers.max_ejection_percent = 100.0
    pipeline.outliers.consecutive_failures = 1
    body = {**SHORT, "max_tokens": 40, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            await r.content.readany()  # the stream is running on r0
            assert gw.report.reserved_tokens("r0") > 0
            pipeline.failover.ejection.failure("r0", "connect")  # as the request path reports it
            assert _usage(gw, "r0").ejected
            # Nothing new is admitted there...
            async with s.post(
                gw.url + "/v1/chat/completions",
                json=SHORT,
                headers={"x-kvgate-queue-timeout": "0"},
            ) as r2:
                assert r2.status == 503
            # ...while the running stream completes normally and releases.
            text = (await r.read()).decode()
            assert text.rstrip().endswith("data: [DONE]")
        assert await wait_for(lambda: gw.report.reserved_tokens("r0") == 0, within=2.0)


async def test_first_byte_timeouts_eject_a_hung_replica(replica, gateway):
    hung, good = await replica(), await replica()
    gw = await gateway(
        hung,
        good,
        discovery={"fail_threshold": 1000},  # the request path alone must find it
        upstream={"first_byte_s": 0.3, "total_s": 0.3},
    )
    gw.state.pipeline.outliers.consecutive_failures = 1
    hung.set_fault(make_fault("hang"))
    statuses = []
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(40):
                async with s.post(
                    gw.url + "/v1/chat/completions", json={**SHORT, "stream": True}
                ) as r:
                    statuses.append(r.status)
                    await r.read()
                if _usage(gw, "r0").ejected:
                    break
            assert _usage(gw, "r0").ejected
            # A stream's first-byte timeout is retried on the good replica: the client
            # never saw the hung one.
            assert set(statuses) == {200}
            # Ejected: the hung replica gets nothing more.
            for _ in range(3):
                async with s.post(gw.url + "/v1/chat/completions", json=SHORT) as r:
                    assert r.status == 200
    finally:
        hung.set_fault(make_fault("none"))
