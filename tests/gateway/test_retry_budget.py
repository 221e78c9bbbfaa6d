"""The retry budget of clients that do not say which retry they send, through the live
gateway (admission/learned/retry_budget.py): a plain HTTP client's attempt after two sheds is its
last (the cold budget, the openai SDKs' default) and queues ahead of first attempts, as
an SDK's last retry does; an operator sees the budget and what it was learned from."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.gateway.conftest import wait_for
from tests.gateway.test_ops import scrape
from tests.gateway.test_queue import body, hold_pool

URL = "/v1/chat/completions"


pytestmark = pytest.mark.slow


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


async def _order_behind_one_queued(
    s, gw, queued: dict, then: dict, headers: dict, then_headers: dict
) -> list[str]:
    """`queued` (with `headers`) waits for the held pool, `then` (with `then_headers`)
    queues after it; the order they are served in once the pool frees."""
    order: list[str] = []

    async def send(name: str, payload: dict, hdrs: dict) -> None:
        async with s.post(gw.url + URL, json=payload, headers=hdrs) as r:
            assert r.status == 200, await r.text()
            await r.read()
        order.append(name)

    big = await hold_pool(s, gw, 440)
    model = queued["model"]
    depth = gw.report.queue_depth(model)
    waiting = asyncio.create_task(send("queued", queued, headers))
    assert await wait_for(lambda: gw.report.queue_depth(model) == depth + 1)
    later = asyncio.create_task(send("then", then, then_headers))
    assert await wait_for(lambda: gw.report.queue_depth(model) == depth + 2)
    big.close()
    await asyncio.wait_for(asyncio.gather(waiting, later), 30.0)
    return order


async def test_identical_bodies_are_one_request_only_where_the_client_says_so(replica, gateway):
    """Two SDK clients sending one prompt (pass@k, a batch with repeated prompts): the
    second's first attempt (retry count 0) is a request of its own, queued by its own
    arrival, not the retry of the first one kvgate shed; a retry (count 1) or an
    Idempotency-Key naming the shed request keeps the shed one's place."""
    srv = await replica(speed=5.0)
    gw = await gateway(srv, pool_tokens=512)
    other = body(300, user="other")
    async with aiohttp.ClientSession() as s:
        for tag, headers, expected in (
            ("pass-at-k", {"x-stainless-retry-count": "0"}, ["queued", "then"]),
            ("sdk-retry", {"x-stainless-retry-count": "1"}, ["then", "queued"]),
            ("idempotent", {"Idempotency-Key": "job-1/item-2"}, ["then", "queued"]),
        ):
            # `other` is a first attempt of another request, however its client says it.
            first = {"Idempotency-Key": "job-1/item-1"} if "Idempotency-Key" in headers else {}
            prompt = body(300, user=tag)
            shed_headers = {"x-kvgate-queue-timeout": "0", **headers}
            if "x-stainless-retry-count" in headers:
                shed_headers["x-stainless-retry-count"] = "0"
            big = await hold_pool(s, gw, 440)
            async with s.post(gw.url + URL, json=prompt, headers=shed_headers) as r:
                assert r.status == 503, await r.text()
            big.close()
            assert await wait_for(lambda: gw.report.reserved_tokens() == 0)
            order = await _order_behind_one_queued(s, gw, other, prompt, first, headers)
            assert order == expected, tag


async def test_a_plain_client_that_leaves_is_not_taken_back_by_an_identical_request(
    replica, gateway
):
    """Clients that say nothing and close their connections before an answer (a load
    tool ending its run) teach the retry budget nothing, and past the grace a client
    retrying its own timeout comes back within, an identical request is another
    client's, queued by its own arrival."""
    srv = await replica(speed=5.0)
    gw = await gateway(srv, pool_tokens=512, auth={"admin_token": "adm"})
    prompt = body(300, user="load-tool")
    async with aiohttp.ClientSession() as s:
        big = await hold_pool(s, gw, 440)
        gone = [asyncio.create_task(s.post(gw.url + URL, json=prompt)) for _ in range(3)]
        assert await wait_for(lambda: gw.report.queue_depth(prompt["model"]) == 3)
        for task in gone:
            task.cancel()
        await asyncio.gather(*gone, return_exceptions=True)
        assert await wait_for(lambda: gw.report.queue_depth(prompt["model"]) == 0)
        big.close()
        assert await wait_for(lambda: gw.report.reserved_tokens() == 0)
        await asyncio.sleep(5.5)  # admission/retries.py's grace
        # Both state how long they wait (the three that left taught a short patience).
        wait = {"x-kvgate-queue-timeout": "20"}
        other = body(300, user="other")
        order = await _order_behind_one_queued(s, gw, other, prompt, wait, wait)
        assert order == ["queued", "then"]
        async with s.get(gw.url + "/admin/replicas", headers={"Authorization": "Bearer adm"}) as r:
            rows = (await r.json())["client_retry_budget"]
        assert all(row["gave_up"] == 0 and row["came_back"] == 0 for row in rows)


async def test_an_sdk_client_back_after_its_whole_budget_shows_a_clock_per_attempt(
    replica, gateway
):
    """A client with the SDK's headers and a 0.5 s timeout, shed at once and back after
    0.6 s (past its whole budget since its first attempt: a whole call's clock could not
    be back), shows a clock per attempt: an operator sees it, and any wait may be told
    to its tenant's SDK clients (admission/learned/toldwait.py)."""
    srv = await replica(speed=1.0)
    gw = await gateway(srv, pool_tokens=512, auth={"admin_token": "adm"})
    payload = body(300, user="sdk")
    sdk = {"x-stainless-read-timeout": "0.5"}
    async with aiohttp.ClientSession() as s:
        big = await hold_pool(s, gw, 440)
        stated = {**sdk, "x-stainless-retry-count": "0", "x-kvgate-queue-timeout": "0"}
        async with s.post(gw.url + URL, json=payload, headers=stated) as r:
            assert r.status == 503, await r.text()
        await asyncio.sleep(0.6)
        retry = {**sdk, "x-stainless-retry-count": "1", "x-kvgate-queue-timeout": "0"}
        async with s.post(gw.url + URL, json=payload, headers=retry) as r:
            assert r.status == 503, await r.text()
        big.close()
        async with s.get(gw.url + "/admin/replicas", headers={"Authorization": "Bearer adm"}) as r:
            (row,) = (await r.json())["client_told_waits"]
    assert row["tenant"] == "default" and row["says_attempt"] is True
    assert row["clock"] == "attempt" and row["votes_attempt"] == 1
    assert row["comes_back_after_s"] is None  # any wait may be told
