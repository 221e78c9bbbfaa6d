"""The retry budget of clients that do not say which retry they send, through the live
gateway (admission/retry_budget.py): a plain HTTP client's attempt after two sheds is its
last (the cold budget, the openai SDKs' default) and queues ahead of first attempts, as
an SDK's last retry does; an operator sees the budget and what it was learned from."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.gateway.conftest import wait_for
from tests.gateway.test_ops import scrape
from tests.gateway.test_queue import body, hold_pool

URL = "/v1/chat/completions"


async def _shed(s: aiohttp.ClientSession, gw, payload: dict) -> None:
    """One attempt that cannot wait (a zero queue timeout): shed at once."""
    async with s.post(gw.url + URL, json=payload, headers={"x-kvgate-queue-timeout": "0"}) as r:
        assert r.status == 503, await r.text()
        assert int(r.headers["Retry-After"]) >= 1


async def test_a_plain_clients_third_attempt_queues_ahead_of_first_attempts(replica, gateway):
    srv = await replica(speed=5.0)
    gw = await gateway(srv, pool_tokens=512, auth={"admin_token": "adm"})
    # Two requests of 300 tokens: one fits beside nothing else in the 512-token pool.
    first = body(300, user="first-attempt")
    retried = body(300, user="retried")
    async with aiohttp.ClientSession() as s:
        big = await hold_pool(s, gw, 440)
        # A first attempt queues; then another request is shed twice and comes back with
        # nothing stated. By arrival the first attempt goes first; as the retried one's
        # last attempt, it does.
        order: list[str] = []

        async def send(name: str, payload: dict) -> None:
            async with s.post(gw.url + URL, json=payload) as r:
                assert r.status == 200, await r.text()
                await r.read()
            order.append(name)

        waiting = asyncio.create_task(send("first-attempt", first))
        assert await wait_for(lambda: gw.report.queue_depth(first["model"]) == 1)
        await _shed(s, gw, retried)
        await _shed(s, gw, retried)
        last = asyncio.create_task(send("retried", retried))
        assert await wait_for(lambda: gw.report.queue_depth(first["model"]) == 2)
        big.close()
        await asyncio.wait_for(asyncio.gather(waiting, last), 30.0)
        assert order == ["retried", "first-attempt"]

        # An operator sees the budget (cold: 3 sheds) and the sheds that came back.
        async with s.get(gw.url + "/admin/replicas", headers={"Authorization": "Bearer adm"}) as r:
            (row,) = (await r.json())["client_retry_budget"]
        assert row == {"tenant": "default", "gives_up_after_sheds": 3, "came_back": 2, "gave_up": 0}
        live = await scrape(gw)
        assert live[("kvgate_client_retry_budget", (("tenant", "default"),))] == 3
        outcome = (("outcome", "came_back"), ("tenant", "default"))
        assert live[("kvgate_client_retry_outcomes", outcome)] == 2


async def test_a_stated_retry_count_is_believed_over_the_budget(replica, gateway):
    """A client that says which retry this is (the openai SDKs) is believed: its count
    of 0 on a request kvgate shed twice is a first attempt, queued behind an earlier one."""
    srv = await replica(speed=5.0)
    gw = await gateway(srv, pool_tokens=512)
    first = body(300, user="first-attempt")
    retried = body(300, user="retried")
    headers = {"x-stainless-retry-count": "0"}
    async with aiohttp.ClientSession() as s:
        big = await hold_pool(s, gw, 440)
        order: list[str] = []

        async def send(name: str, payload: dict, headers: dict) -> None:
            async with s.post(gw.url + URL, json=payload, headers=headers) as r:
                assert r.status == 200, await r.text()
                await r.read()
            order.append(name)

        waiting = asyncio.create_task(send("first-attempt", first, {}))
        assert await wait_for(lambda: gw.report.queue_depth(first["model"]) == 1)
        await _shed(s, gw, retried)
        await _shed(s, gw, retried)
        last = asyncio.create_task(send("retried", retried, headers))
        assert await wait_for(lambda: gw.report.queue_depth(first["model"]) == 2)
        big.close()
        await asyncio.wait_for(asyncio.gather(waiting, last), 30.0)
        assert order == ["first-attempt", "retried"]
