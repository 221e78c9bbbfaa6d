"""Operational surface: health, readiness, metrics, admin, access log, socket options."""

from __future__ import annotations

import asyncio
import json
import logging
import socket

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gateway.logging import ACCESS_LOGGER, JsonFormatter
from tests.gateway.conftest import MODEL, wait_for

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


async def scrape(gw) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    out = {}
    for fam in text_string_to_metric_families(text):  # raises if the exposition is malformed
        for smp in fam.samples:
            out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out


async def test_health_and_ready(replica, gateway):
    srv = await replica()
    gw = await gateway(srv)
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/health") as r:
            assert r.status == 200
        async with s.get(gw.url + "/ready") as r:
            assert r.status == 200  # discovery's first round ran before start() returned


async def test_not_ready_without_reachable_replica(gateway):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    gw = await gateway(replicas=[{"name": "gone", "url": f"http://127.0.0.1:{port}"}])
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/health") as r:
            assert r.status == 200
        async with s.get(gw.url + "/ready") as r:
            assert r.status == 503
        async with s.get(gw.url + "/v1/models") as r:
            assert (await r.json())["data"] == []


async def test_replica_becoming_ready_admits_queued_request(replica, gateway):
    """A discovery round that finds a replica ready admits what waits in the queue."""
    busy, idle = await replica(speed=1.0), await replica()
    gw = await gateway(busy, idle, pool_tokens=512, discovery={"refresh_interval_s": 30.0})
    gw.state.discovery.mark_down("r1")  # as after a refused connection
    big = {**BODY, "max_tokens": 440, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as s:
        first = await s.post(gw.url + "/v1/chat/completions", json=big)
        assert (await first.content.readany()).startswith(b"data:")
        queued = asyncio.create_task(
            s.post(gw.url + "/v1/chat/completions", json={**BODY, "max_tokens": 100})
        )
        assert await wait_for(lambda: gw.report.queue_depth() == 1)
        watcher = gw.state.discovery.watchers["r1"]
        for _ in range(gw.state.config.discovery.success_threshold):  # marked down: rounds
            assert gw.report.queue_depth() == 1  # until then it still waits
            await watcher.refresh()  # one discovery round for r1
        r = await queued
        assert r.status == 200
        r.release()
        assert idle.core.stats().num_finished == 1  # served by the replica that came back
        assert busy.core.stats().num_running == 1  # while the big one still runs
        first.close()


async def test_metrics_move_with_traffic(replica, gateway):
    gw = await gateway(await replica())
    before = await scrape(gw)
    assert before[("kvgate_replica_capacity_tokens", (("replica", "r0"),))] > 0
    assert before[("kvgate_replica_reserved_tokens", (("replica", "r0"),))] == 0
    async with aiohttp.ClientSession() as s:
        for stream in (False, True):
            async with s.post(
                gw.url + "/v1/chat/completions", json={**BODY, "stream": stream}
            ) as r:
                assert r.status == 200
                await r.read()
        async with s.post(gw.url + "/v1/chat/completions", json={**BODY, "model": "nope"}) as r:
            assert r.status == 404
    after = await scrape(gw)
    ok = ("kvgate_requests_total", (("model", MODEL), ("outcome", "ok")))
    assert after[ok] == 2
    assert (
        after[("kvgate_requests_total", (("model", "_unknown"), ("outcome", "model_not_found")))]
        == 1
    )
    assert after[("kvgate_ttft_seconds_count", ())] == 1  # the streamed one
    assert after[("kvgate_itl_seconds_count", ())] == 1
    assert after[("kvgate_queue_wait_seconds_count", ())] == 2
    assert after[("kvgate_queue_depth", (("model", MODEL),))] == 0
    assert after[("kvgate_replica_running", (("replica", "r0"),))] == 0
    # The admission core's top-up failure count is exported as read at scrape time.
    assert after[("kvgate_reservation_topup_failures_total", ())] == 0
    # The report only reads: the count is set where the ledger keeps it.
    ledger = gw.state.door._controller._ledger
    ledger.top_up_failures = 3
    assert (await scrape(gw))[("kvgate_reservation_topup_failures_total", ())] == 3
    ledger.top_up_failures = 0


async def test_admin_replicas_requires_token(replica, gateway):
    gw = await gateway(await replica(), pool_tokens=1024, auth={"admin_token": "s3cret"})
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/admin/replicas") as r:
            assert r.status == 401
            assert (await r.json())["error"]["code"] == "invalid_admin_token"
        async with s.get(
            gw.url + "/admin/replicas", headers={"Authorization": "Bearer wrong"}
        ) as r:
            assert r.status == 401
        async with s.get(
            gw.url + "/admin/replicas", headers={"Authorization": "Bearer s3cret"}
        ) as r:
            assert r.status == 200
            data = await r.json()
    (rep,) = data["replicas"]
    assert rep["name"] == "r0" and rep["ready"] is True
    assert rep["capacity_tokens"] == 1024 and rep["capacity_pinned"] is True
    assert rep["effective_capacity_tokens"] == 1024  # headroom: the estimates' margin
    assert rep["reserved_tokens"] == 0 and rep["running"] == 0 and rep["queue"] == 0
    assert rep["binding_ceiling"] == "none"
    assert rep["models"] == [MODEL]
    assert rep["service"] is None  # nothing served yet


async def test_admin_shows_the_queues_service_model(replica, gateway):
    gw = await gateway(await replica(), auth={"admin_token": "t"})
    admin = {"Authorization": "Bearer t"}
    async with aiohttp.ClientSession() as s:
        for max_tokens in (5, 20, 40):
            body = {**BODY, "max_tokens": max_tokens, "ignore_eos": True}
            async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
        async with s.get(gw.url + "/admin/replicas", headers=admin) as r:
            (rep,) = (await r.json())["replicas"]
    service = rep["service"]
    assert service["samples"] == 3
    # Fitted to the three answers: a positive time for the longest, no negative slope.
    assert service["base_s"] + 40 * service["per_output_token_s"] > 0
    assert service["per_output_token_s"] >= 0 and service["per_prompt_token_s"] >= 0


async def test_admin_closed_without_token(replica, gateway):
    gw = await gateway(await replica())
    async with (
        aiohttp.ClientSession() as s,
        s.get(gw.url + "/admin/replicas", headers={"Authorization": "Bearer "}) as r,
    ):
        assert r.status == 401


async def test_client_sockets_have_tcp_nodelay(replica, gateway):
    gw = await gateway(await replica())
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/health") as r:
            assert r.status == 200
        # The keep-alive connection is still open on the server side: inspect its socket.
        conns = gw.runner.server.connections
        assert conns
        for proto in conns:
            sock = proto.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


async def test_access_log_is_one_json_line_without_prompt(replica, gateway, caplog):
    gw = await gateway(await replica())
    secret = "the-prompt-text-must-not-be-logged"
    logger = logging.getLogger(ACCESS_LOGGER)
    was_disabled = logger.disabled
    logger.disabled = False
    try:
        with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
            async with (
                aiohttp.ClientSession() as s,
                s.post(
                    gw.url + "/v1/chat/completions",
                    json={**BODY, "messages": [{"role": "user", "content": secret}]},
                ) as r,
            ):
                assert r.status == 200
                request_id = r.headers["x-request-id"]
            await gw.drain(5.0)
    finally:
        logger.disabled = was_disabled
    records = [rec for rec in caplog.records if rec.name == ACCESS_LOGGER]
    assert len(records) == 1
    line = JsonFormatter().format(records[0])
    assert "\n" not in line and secret not in line
    entry = json.loads(line)
    assert entry["request_id"] == request_id
    assert entry["tenant"] == "default" and entry["model"] == MODEL
    assert entry["replica"] == "r0" and entry["outcome"] == "ok" and entry["status"] == 200
    assert entry["prompt_tokens"] > 0 and entry["completion_tokens"] > 0
    for key in ("queue_wait_s", "duration_s", "ttft_s"):
        assert key in entry
