"""Replicas from DNS (issue 22, item 1), against a real DNS server (dnsmasq) whose
records change while kvgate runs: a new address joins once it is ready, a vanished one
takes no new request at once while its running stream finishes, then leaves the ledger.
Each replica is an enginesim on its own loopback address (127.0.0.2, .3, ...), all on
one port, as the pods behind a headless Service are."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from tests.gateway.conftest import MODEL, wait_for
from tests.gateway.dnsmasq import Dnsmasq

pytestmark = pytest.mark.slow


@pytest.fixture
async def dnsmasq(tmp_path) -> Any:
    made: list[Dnsmasq] = []

    async def factory(**kwargs: Any) -> Dnsmasq:
        d = Dnsmasq(tmp_path, **kwargs)
        await d.start()
        made.append(d)
        return d

    yield factory
    for d in made:
        d.stop()


async def engines(replica, *hosts: str, **kw: Any) -> list[Any]:
    first = await replica(host=hosts[0], **kw)
    rest = [await replica(host=h, port=first.port, **kw) for h in hosts[1:]]
    return [first, *rest]


def group(port: int, **extra: Any) -> dict[str, Any]:
    return {"name": "llm", "host": "llm.test", "port": port, "resolve_interval_s": 0.2, **extra}


async def stream(s: aiohttp.ClientSession, url: str, max_tokens: int) -> str:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me"}],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    async with s.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        text = (await r.read()).decode()
    assert text.rstrip().endswith("data: [DONE]"), text[-200:]
    return text


async def test_replicas_follow_the_records_and_a_vanished_one_drains(
    replica, gateway, dnsmasq
) -> None:
    # Slow engines (real time, about a second a stream): the streams on .2 outlast the DNS
    # change and the new replica's probe (at x50 they ended first on a quiet machine).
    a, b, c = await engines(replica, "127.0.0.2", "127.0.0.3", "127.0.0.4", speed=1.0)
    port = a.port
    dns = await dnsmasq()
    # .9 is in DNS but nothing answers there: it never joins admission.
    dns.set_hosts("llm.test", ["127.0.0.2", "127.0.0.3", "127.0.0.9"])
    gw = await gateway(
        replicas=[],
        replica_groups=[group(port)],
        dns={"servers": [dns.server]},
    )
    name = {h: f"llm-{h}:{port}" for h in ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.9")}

    def ready() -> set[str]:
        return {u.name for u in gw.report.replica_usage() if u.ready}

    # Before the first request (the first probe round may still be on its way).
    assert await wait_for(lambda: ready() == {name["127.0.0.2"], name["127.0.0.3"]})
    assert name["127.0.0.9"] not in gw.report.replica_names()
    async with aiohttp.ClientSession() as s:
        # Long streams on both; then .2 vanishes from DNS and .4 appears.
        running = [asyncio.create_task(stream(s, gw.url, 400)) for _ in range(4)]
        assert await wait_for(lambda: gw.report.reserved_tokens(name["127.0.0.2"]) > 0)
        finished_on_a = a.core.stats().num_finished
        dns.set_hosts("llm.test", ["127.0.0.3", "127.0.0.4"])
        assert await wait_for(lambda: ready() == {name["127.0.0.3"], name["127.0.0.4"]})
        # Gone from DNS: no new request for it, while its streams still run there.
        assert gw.report.reserved_tokens(name["127.0.0.2"]) > 0
        seen_a = a.core.stats().num_finished + a.core.stats().num_running
        for _ in range(6):
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
            async with s.post(gw.url + "/v1/completions", json=body) as r:
                assert r.status == 200
        assert a.core.stats().num_finished + a.core.stats().num_running <= seen_a
        # Its streams finish whole, then it leaves the ledger.
        await asyncio.gather(*running)
        assert a.core.stats().num_finished > finished_on_a
        assert await wait_for(lambda: name["127.0.0.2"] not in gw.report.replica_names())
        assert c.core.stats().num_finished > 0  # the new one serves
    assert gw.report.reserved_tokens() == 0


async def test_srv_records_give_address_and_port(replica, gateway, dnsmasq) -> None:
    (a,) = await engines(replica, "127.0.0.5")
    dns = await dnsmasq(
        srv=[f"_http._tcp.llm.test,pod-0.llm.test,{a.port}"],
        records=["pod-0.llm.test,127.0.0.5"],
    )
    gw = await gateway(
        replicas=[],
        replica_groups=[
            {
                "name": "llm",
                "host": "_http._tcp.llm.test",
                "record": "SRV",
                "resolve_interval_s": 0.2,
            }
        ],
        dns={"servers": [dns.server]},
    )
    assert [u.name for u in gw.report.replica_usage() if u.ready] == [f"llm-127.0.0.5:{a.port}"]
    async with aiohttp.ClientSession() as s:
        await stream(s, gw.url, 8)


async def test_a_failed_resolution_keeps_the_replicas(replica, gateway, dnsmasq) -> None:
    (a,) = await engines(replica, "127.0.0.6")
    dns = await dnsmasq()
    dns.set_hosts("llm.test", ["127.0.0.6"])
    gw = await gateway(
        replicas=[], replica_groups=[group(a.port)], dns={"servers": [dns.server], "timeout_s": 0.2}
    )
    # The first answer may come a round late on a loaded machine (a 0.2 s timeout;
    # failed once in CI with no replica yet): the test is what a later failure keeps.
    assert await wait_for(lambda: len([u for u in gw.report.replica_usage() if u.ready]) == 1)
    dns.stop()  # DNS down: the answer is kept, not emptied
    await wait_for(lambda: False, within=1.0)
    assert len([u for u in gw.report.replica_usage() if u.ready]) == 1
