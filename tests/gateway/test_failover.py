"""Failover over real loopback HTTP (gateway/upstream/failover.py): a retry never goes back to
the replica that failed it, and a client's request never counts against a replica's
health; only the replica's own failures do (invariant 8, docs/principles.md).

Replicas are embedded enginesim servers; a crash aborts every connection and stops
listening, which is how a SIGKILLed engine looks from outside. The `gateway` fixture
checks that nothing stays reserved or queued after each test.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from enginesim.faults import make_fault
from tests.enginesim.test_server_cli import _spawn
from tests.gateway.conftest import MODEL, wait_for
from tests.gateway.test_health import ADMIN, _metric, _usage

SHORT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class FailureLog(logging.Handler):
    """The request path's failure lines: (request id, replica, kind) in order."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.failures: list[tuple[str, str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "fields", None) or {}
        if record.msg.startswith("upstream %s failed for"):
            self.failures.append((fields["request_id"], fields["replica"], fields["kind"]))


async def _total(gw, family: str, replica: str) -> float:
    """A counter's total for `replica` over its other labels."""
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
        text = await r.text()
    return sum(
        smp.value
        for fam in text_string_to_metric_families(text)
        if fam.name == family
        for smp in fam.samples
        if smp.name.endswith("_total") and smp.labels.get("replica") == replica
    )


@contextmanager
def failure_log() -> Iterator[FailureLog]:
    handler = FailureLog()
    logger = logging.getLogger("kvgate.pipeline")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


async def test_retries_after_a_crash_never_go_back_to_the_dead_replica(replica, gateway):
    """Two replicas of two running slots each, ten non-stream requests: four run, six
    wait. The first replica dies with two in flight; their retries must wait for the
    live one, since it is full. Before the fix the dead replica was reinstated right
    after the retry was queued, the retry was admitted back to it, the connection was
    refused and the client got 502 upstream_connect."""
    dead, alive = await replica(speed=5.0), await replica(speed=5.0)
    gw = await gateway(
        dead,
        alive,
        max_running=2,
        discovery={"refresh_interval_s": 30.0},  # only the request path learns of the crash
    )
    n = 10
    body = {**SHORT, "max_tokens": 40, "ignore_eos": True}
    with failure_log() as seen:
        async with aiohttp.ClientSession() as s:

            async def one() -> tuple[int, dict]:
                async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
                    return r.status, await r.json()

            tasks = [asyncio.create_task(one()) for _ in range(n)]
            assert await wait_for(lambda: dead.core.stats().num_running == 2, within=10.0)
            assert gw.report.queue_depth() > 0  # the live replica is full: retries must queue
            dead.set_fault(make_fault("crash"))
            results = await asyncio.gather(*tasks)
    # Every request had sent no byte when its replica failed: every one completes.
    assert [status for status, _ in results] == [200] * n, results
    assert alive.core.stats().num_finished == n
    # The crash hit requests in flight, and no request failed twice on one replica.
    assert sum(1 for _, rep, kind in seen.failures if rep == "r0" and kind == "dropped") == 2
    per_request: dict[str, list[str]] = {}
    for rid, rep, _ in seen.failures:
        per_request.setdefault(rid, []).append(rep)
    assert per_request and all(reps == ["r0"] for reps in per_request.values()), per_request
    assert await _total(gw, "kvgate_upstream_retries", "r0") == len(per_request)
    assert gw.report.reserved_tokens() == 0 and gw.report.queue_depth() == 0


@pytest.mark.slow
async def test_retries_after_a_sigkill_never_go_back_to_the_killed_engine(replica, gateway):
    """The same with a real process: an `enginesim serve` SIGKILLed while it runs two
    requests and the live replica is full."""
    # Real time (x1): the two requests on r0 are still running when it is killed, also on
    # a quiet machine (at x5 all eight could finish before the poll saw them).
    proc, url = await _spawn("--profile", "tiny", "--speed", "1")
    try:
        alive = await replica(speed=1.0)
        gw = await gateway(
            alive,
            replicas=[
                {"name": "r0", "url": url, "max_running": 2},
                {"name": "r1", "url": alive.url, "max_running": 2},
            ],
            discovery={"refresh_interval_s": 30.0},
        )
        n = 8
        body = {**SHORT, "max_tokens": 40, "ignore_eos": True}
        with failure_log() as seen:
            async with aiohttp.ClientSession() as s:

                async def one() -> int:
                    async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
                        await r.read()
                        return r.status

                tasks = [asyncio.create_task(one()) for _ in range(n)]
                assert await wait_for(lambda: _usage(gw, "r0").running == 2, within=10.0)
                assert await wait_for(lambda: gw.report.queue_depth() > 0, within=5.0)
                proc.send_signal(signal.SIGKILL)
                statuses = await asyncio.gather(*tasks)
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
    assert statuses == [200] * n
    assert any(kind == "dropped" for _, _, kind in seen.failures)
    # Each request failed once, on the killed engine, and its retry completed on the live
    # one (the killed one may have finished a request before the kill).
    assert {rep for _, rep, _ in seen.failures} == {"r0"}
    failed = {rid for rid, _, _ in seen.failures}
    assert len(failed) == len(seen.failures)
    assert len(failed) <= alive.core.stats().num_finished <= n


async def test_a_retry_after_a_dropped_connection_leaves_the_replica_in_service(replica, gateway):
    """One request's failure is no verdict on the replica: the retry avoids it, everyone
    else may still use it, and discovery keeps judging its health."""
    flaky, other = await replica(), await replica()
    gw = await gateway(flaky, other, discovery={"refresh_interval_s": 30.0})
    flaky.set_fault(make_fault("drop", after_tokens=0))
    with failure_log() as seen:
        async with aiohttp.ClientSession() as s:
            # Ties break at random: within a few requests one meets the dropping replica.
            for _ in range(30):
                async with s.post(gw.url + "/v1/chat/completions", json=SHORT) as r:
                    assert r.status == 200
                if seen.failures:
                    break
    assert [(rep, kind) for _, rep, kind in seen.failures] == [("r0", "dropped")]
    assert _usage(gw, "r0").ready and not _usage(gw, "r0").ejected
    flaky.set_fault(make_fault("none"))
    async with aiohttp.ClientSession() as s:
        served = 0
        for _ in range(30):  # the replica that dropped one request serves again
            async with s.post(gw.url + "/v1/chat/completions", json=SHORT) as r:
                assert r.status == 200
            served = flaky.core.stats().num_finished
            if served:
                break
    assert served == 1


async def test_requests_that_fail_on_every_replica_eject_none(replica, gateway):
    """Five requests that both replicas answer 500 (what an engine does with input it
    cannot handle): the request's fault, not theirs. The client gets the engine's own
    answer, and neither replica is ejected, though five failures in a row eject by
    default (before the fix each replica was charged every time and one was ejected)."""
    a, b = await replica(), await replica()
    gw = await gateway(a, b, discovery={"fail_threshold": 1000}, auth={"admin_token": ADMIN})
    for srv in (a, b):
        srv.set_fault(make_fault("error", status=500))
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(5):
                async with s.post(gw.url + "/v1/chat/completions", json=SHORT) as r:
                    assert r.status == 500
                    err = (await r.json())["error"]
                assert err["message"] == "injected fault: engine error (500)"
            async with s.get(
                gw.url + "/admin/replicas", headers={"Authorization": f"Bearer {ADMIN}"}
            ) as r:
                snap = {x["name"]: x for x in (await r.json())["replicas"]}
    finally:
        for srv in (a, b):
            srv.set_fault(make_fault("none"))
    assert await _metric(gw, "kvgate_upstream_errors", "r0") == 5
    assert await _metric(gw, "kvgate_upstream_errors", "r1") == 5
    for name in ("r0", "r1"):
        assert snap[name]["ejected"] is False and snap[name]["ejections"] == 0
        assert await _metric(gw, "kvgate_replica_ejections", name) in (None, 0.0)


async def test_lone_surrogates_from_one_client_eject_no_replica(replica, gateway):
    """The input of issue 19.3: refused by kvgate with a 400, it never reaches a replica."""
    a, b = await replica(), await replica()
    gw = await gateway(a, b, outlier={"consecutive_failures": 1})
    raw = b'{"model": "tiny-llm", "messages": [{"role": "user", "content": "\\ud800"}]}'
    async with aiohttp.ClientSession() as s:
        for _ in range(5):
            async with s.post(
                gw.url + "/v1/chat/completions",
                data=raw,
                headers={"Content-Type": "application/json"},
            ) as r:
                assert r.status == 400
                err = (await r.json())["error"]
            assert err["type"] == "invalid_request_error" and err["param"] == "messages"
    for name in ("r0", "r1"):
        assert not _usage(gw, name).ejected
        assert await _metric(gw, "kvgate_upstream_errors", name) is None


async def test_a_replica_that_answers_500_to_everything_is_still_ejected(replica, gateway):
    """The other side: a 500 the other replica then answers 200 is the replica's own
    failure, and enough of them in a row eject it (default: five)."""
    bad, good = await replica(), await replica()
    gw = await gateway(bad, good, discovery={"fail_threshold": 1000})
    bad.set_fault(make_fault("error", status=500))
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(60):
                async with s.post(gw.url + "/v1/chat/completions", json=SHORT) as r:
                    assert r.status == 200  # retried on the good replica
                if _usage(gw, "r0").ejected:
                    break
        assert _usage(gw, "r0").ejected and not _usage(gw, "r1").ejected
        assert await _metric(gw, "kvgate_upstream_errors", "r0") == 5
        assert await _metric(gw, "kvgate_replica_ejections", "r0") == 1.0
    finally:
        bad.set_fault(make_fault("none"))
