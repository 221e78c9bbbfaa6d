"""The engines' own load signals on kvgate's /metrics (`kvgate_replica_engine_*`): what
the dashboard sets beside the ledger and the preemption alert reads."""

from __future__ import annotations

import aiohttp

from tests.gateway.conftest import MODEL, wait_for
from tests.gateway.test_ops import scrape


async def test_engine_kv_usage_follows_the_engine(replica, gateway):
    # A stream that lasts several discovery rounds (ignore_eos: no early stop) at a real
    # pace, so that a round sees the engine hold its KV even on a loaded machine.
    srv = await replica(speed=1.0)
    gw = await gateway(srv)
    key = ("kvgate_replica_engine_kv_usage_ratio", (("replica", "r0"),))
    running = ("kvgate_replica_engine_running", (("replica", "r0"),))
    preempt = ("kvgate_replica_engine_preemptions_total", (("replica", "r0"),))
    idle = await scrape(gw)
    assert idle[key] == 0.0
    assert idle[preempt] == 0.0
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "word " * 200}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    seen: dict = {}
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            await r.content.readline()  # the stream has started: the engine holds its KV

            async def busy() -> bool:
                seen.update(await scrape(gw))
                return seen[key] > 0 and seen[running] == 1

            ok = False
            for _ in range(50):  # bounded: discovery runs every 0.2 s
                if await busy():
                    ok = True
                    break
                await wait_for(lambda: False, within=0.1)
            assert ok, seen.get(key)
            assert 0 < seen[key] <= 1
        # Leaving the stream closes it: kvgate aborts the engine's request.
    assert await wait_for(lambda: srv.core.stats().blocks_in_use == 0)
    # The next rounds see the engine's pool empty again.
    for _ in range(50):
        seen = await scrape(gw)
        if seen[key] == 0.0 and seen[running] == 0:
            break
        await wait_for(lambda: False, within=0.1)
    assert seen[key] == 0.0


async def test_no_engine_signals_before_the_first_round(gateway):
    # A replica that never answered has no engine view: no sample, rather than a false 0.
    gw = await gateway(replicas=[{"name": "gone", "url": "http://127.0.0.1:9"}])
    metrics = await scrape(gw)
    assert not [k for k in metrics if k[0].startswith("kvgate_replica_engine_")]


async def test_no_kv_usage_claimed_for_an_engine_that_reports_none(enginesim_server, gateway):
    # llama-server exports no KV usage gauge: kvgate reports its running count, not a 0 usage.
    srv = await enginesim_server("llamacpp-tiny", speed=50.0)
    gw = await gateway(srv, engine="llamacpp")
    metrics = await scrape(gw)
    assert ("kvgate_replica_engine_running", (("replica", "r0"),)) in metrics
    assert not [k for k in metrics if k[0] == "kvgate_replica_engine_kv_usage_ratio"]
