"""Failover's own counts and its one retry (gateway/failover.py), over real loopback HTTP
in front of enginesim replicas: a retry is counted by the replica that failed and how,
and a request is retried once, never twice. The behaviour clients see of each failure is
tests/gateway/test_failures.py."""

from __future__ import annotations

import aiohttp

from enginesim.faults import make_fault
from tests.gateway.test_health import SHORT
from tests.gateway.test_ops import scrape


def _by_replica(sample: dict, family: str) -> dict[tuple[str, str], float]:
    out = {}
    for (name, labels), value in sample.items():
        if name == family:
            d = dict(labels)
            out[(d["replica"], d["kind"])] = value
    return out


async def test_a_retry_is_counted_by_the_replica_that_failed_and_how(replica, gateway):
    bad, good = await replica(), await replica()
    gw = await gateway(bad, good, discovery={"refresh_interval_s": 30.0})
    bad.set_fault(make_fault("error", status=500))
    try:
        async with aiohttp.ClientSession() as s:
            # Equal replicas tie and the picker breaks ties at random: within a few
            # requests one lands on the bad replica first (P(never in 30) ~ 1e-9).
            for _ in range(30):
                async with s.post(gw.url + "/v1/chat/completions", json=SHORT) as r:
                    assert r.status == 200
                errors = _by_replica(await scrape(gw), "kvgate_upstream_errors_total")
                if errors:
                    break
        sample = await scrape(gw)
        assert _by_replica(sample, "kvgate_upstream_errors_total") == {("r0", "status_5xx"): 1}
        assert _by_replica(sample, "kvgate_upstream_retries_total") == {("r0", "status_5xx"): 1}
    finally:
        bad.set_fault(make_fault("none"))


async def test_a_request_is_retried_once_and_then_gets_the_engines_answer(replica, gateway):
    one, two = await replica(), await replica()
    gw = await gateway(one, two, discovery={"refresh_interval_s": 30.0})
    for srv in (one, two):
        srv.set_fault(make_fault("error", status=500))
    try:
        async with (
            aiohttp.ClientSession() as s,
            s.post(gw.url + "/v1/chat/completions", json=SHORT) as r,
        ):
            assert r.status == 500  # the second replica's own answer, not retried again
            assert (await r.json())["error"]["code"] == "500"
        sample = await scrape(gw)
        errors = _by_replica(sample, "kvgate_upstream_errors_total")
        assert errors == {("r0", "status_5xx"): 1, ("r1", "status_5xx"): 1}
        retries = _by_replica(sample, "kvgate_upstream_retries_total")
        assert sum(retries.values()) == 1 and set(retries) <= set(errors)
    finally:
        for srv in (one, two):
            srv.set_fault(make_fault("none"))
