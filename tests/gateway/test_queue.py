"""Admission through the live shell: queue in order, shed honestly, refuse at once."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.gateway.conftest import MODEL, wait_for
from tests.gateway.test_failures import read_events
from tests.gateway.test_ops import scrape

MSG = [{"role": "user", "content": "hi"}]


def body(max_tokens: int, **extra) -> dict:
    return {"model": MODEL, "messages": MSG, "max_tokens": max_tokens, "ignore_eos": True, **extra}


async def hold_pool(s: aiohttp.ClientSession, gw, max_tokens: int) -> aiohttp.ClientResponse:
    """Start a stream that holds most of a 512-token pool; returns once it is running
    (close the response to end it)."""
    big = await s.post(gw.url + "/v1/chat/completions", json=body(max_tokens, stream=True))
    assert len(await read_events(big, 1)) == 1
    return big


@pytest.mark.slow
async def test_requests_beyond_the_pool_wait_and_complete_in_order(replica, gateway):
    srv = await replica(speed=5.0)
    # 512-token pool: two 200-token requests fit (their prompts estimated, so grown by the
    # 5% cold margin), not three.
    gw = await gateway(srv, pool_tokens=512)
    effective = gw.report.replica_usage()[0].effective_capacity_tokens
    finished: list[int] = []
    peak_reserved = 0
    peak_queue = 0

    async def one(s: aiohttp.ClientSession, i: int) -> None:
        async with s.post(gw.url + "/v1/chat/completions", json=body(200)) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["usage"]["completion_tokens"] == 200
        finished.append(i)

    async with aiohttp.ClientSession() as s:
        tasks = []
        for i in range(5):
            tasks.append(asyncio.create_task(one(s, i)))
            # Submit strictly one after another so arrival order is the index order: wait
            # until the gateway has seen request i (admitted, queued or done).
            assert await wait_for(
                lambda n=i + 1: (
                    gw.report.queue_depth()
                    + sum(u.running for u in gw.report.replica_usage())
                    + len(finished)
                    >= n
                )
            )
        while not all(t.done() for t in tasks):
            peak_reserved = max(peak_reserved, gw.report.reserved_tokens())
            peak_queue = max(peak_queue, gw.report.queue_depth())
            assert sum(u.running for u in gw.report.replica_usage()) <= 2
            await asyncio.sleep(0.005)
        await asyncio.gather(*tasks)
    assert peak_queue >= 2
    assert peak_reserved <= effective  # invariant 3: never more than the effective pool
    # Queued requests are admitted, and so finish, in arrival order.
    assert finished[2:] == [2, 3, 4]
    assert srv.core.stats().num_preemptions == 0


async def test_deadline_shed_503_with_retry_after(replica, gateway):
    srv = await replica(speed=1.0)
    gw = await gateway(srv, pool_tokens=512)
    async with aiohttp.ClientSession() as s:
        big = await hold_pool(s, gw, 440)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        async with s.post(
            gw.url + "/v1/chat/completions",
            json=body(100),
            headers={"x-kvgate-queue-timeout": "0.2"},
        ) as r:
            waited = loop.time() - t0
            assert r.status == 503
            retry_after = int(r.headers["Retry-After"])
            err = (await r.json())["error"]
        big.close()
    assert err["code"] == "overloaded"
    assert 1 <= retry_after <= 60
    # With no drain history there is no evidence to shed on at submit, so it was queued;
    # the expiry task shed it at its 0.2 s deadline (a 503 at all shows it did not wait
    # for the big request, which would have admitted it).
    assert waited >= 0.15


async def test_queue_full_is_503_at_once(replica, gateway):
    srv = await replica(speed=1.0)
    gw = await gateway(srv, pool_tokens=512, admission={"queue_max_per_model": 1})
    async with aiohttp.ClientSession() as s:
        big = await hold_pool(s, gw, 440)
        waiting = asyncio.create_task(s.post(gw.url + "/v1/chat/completions", json=body(50)))
        assert await wait_for(lambda: gw.report.queue_depth() == 1)
        live = await scrape(gw)
        assert live[("kvgate_queue_depth", (("model", MODEL),))] == 1
        assert live[("kvgate_replica_reserved_tokens", (("replica", "r0"),))] >= 440
        assert live[("kvgate_replica_running", (("replica", "r0"),))] == 1
        async with s.post(gw.url + "/v1/chat/completions", json=body(50)) as r:
            assert r.status == 503
            assert "Retry-After" in r.headers
        big.close()
        # The queued one is admitted once the big one is gone.
        r2 = await waiting
        assert r2.status == 200
        r2.release()
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as m:
        assert 'kvgate_shed_total{reason="queue_full"} 1.0' in await m.text()


async def test_never_fits_is_400_never_queued(replica, gateway):
    gw = await gateway(await replica(), pool_tokens=512)
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw.url + "/v1/chat/completions", json=body(1000)) as r,
    ):
        assert r.status == 400
        assert (await r.json())["error"]["code"] == "context_length_exceeded"
    assert gw.report.queue_depth() == 0


async def test_stream_outgrowing_its_reservation_is_topped_up_not_cut(
    replica, gateway, monkeypatch
):
    srv = await replica(speed=2.0)
    # Learn an output length of 4 from one request, so the next reservation is small.
    monkeypatch.setattr("admission.learned.estimate.MIN_OUTPUT_SAMPLES", 1)
    gw = await gateway(srv)
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/chat/completions", json=body(4)) as r:
            assert r.status == 200
        resp = await s.post(gw.url + "/v1/chat/completions", json=body(300, stream=True))
        await read_events(resp, 1)
        first = gw.report.reserved_tokens()
        assert first < 64  # prompt + learned 4, block-rounded
        raw = await resp.read()
    assert gw.report.top_up_failures == 0
    content_events = [e for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    assert len(content_events) >= 299  # the whole stream arrived
    assert raw.rstrip().endswith(b"data: [DONE]")


async def test_reservation_grows_during_stream(replica, gateway, monkeypatch):
    srv = await replica(speed=1.0)
    monkeypatch.setattr("admission.learned.estimate.MIN_OUTPUT_SAMPLES", 1)
    gw = await gateway(srv)
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/chat/completions", json=body(4)) as r:
            assert r.status == 200
        resp = await s.post(gw.url + "/v1/chat/completions", json=body(400, stream=True))
        await read_events(resp, 1)
        first = gw.report.reserved_tokens()
        await read_events(resp, 150)
        assert gw.report.reserved_tokens() > first + 100
        resp.close()


@pytest.mark.parametrize("memory_s", [120.0, 0.0])
@pytest.mark.parametrize("unserved", ["shed", "client_left"])
async def test_a_request_left_unserved_that_retries_keeps_its_place(
    replica, gateway, memory_s, unserved
):
    """C is left unserved (shed, its queue deadline 0; or queued, and its client left
    before an answer began), D arrives and queues, then C retries. With retry memory C
    is admitted as of its first arrival, ahead of D; without, after D."""
    srv = await replica(speed=1.0)
    gw = await gateway(srv, max_running=1, admission={"retry_memory_s": memory_s})
    finished: list[str] = []

    def short(tag: str) -> dict:
        return {**body(4), "messages": [{"role": "user", "content": tag}]}

    async def run(s: aiohttp.ClientSession, tag: str) -> None:
        async with s.post(gw.url + "/v1/chat/completions", json=short(tag)) as r:
            assert r.status == 200, await r.text()
        finished.append(tag)

    async with aiohttp.ClientSession() as s:
        big = await s.post(gw.url + "/v1/chat/completions", json=body(1500, stream=True))
        assert len(await read_events(big, 1)) == 1  # holds the only running slot
        if unserved == "shed":
            async with s.post(
                gw.url + "/v1/chat/completions",
                json=short("C"),
                headers={"x-kvgate-queue-timeout": "0"},
            ) as r:
                assert r.status == 503
        else:
            gone = asyncio.create_task(run(s, "C"))
            assert await wait_for(lambda: gw.report.queue_depth() == 1)
            gone.cancel()  # its connection closes: the gateway's handler is cancelled
            await asyncio.gather(gone, return_exceptions=True)
            assert await wait_for(lambda: gw.report.queue_depth() == 0)
        d = asyncio.create_task(run(s, "D"))
        assert await wait_for(lambda: gw.report.queue_depth() == 1)
        c = asyncio.create_task(run(s, "C"))
        assert await wait_for(lambda: gw.report.queue_depth() == 2)
        big.close()  # frees the slot: the head of the queue goes first
        await asyncio.gather(c, d)
    assert finished == (["C", "D"] if memory_s else ["D", "C"])


async def test_the_clients_read_timeout_bounds_its_queue_wait(replica, gateway):
    srv = await replica(speed=1.0)
    # The configured queue timeout is long; the client's own (openai SDK) header is not.
    gw = await gateway(srv, pool_tokens=512, admission={"queue_timeout_s": 30.0})
    async with aiohttp.ClientSession() as s:
        big = await hold_pool(s, gw, 440)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        async with s.post(
            gw.url + "/v1/chat/completions",
            json=body(100),
            headers={"x-stainless-read-timeout": "1.0", "x-stainless-retry-count": "0"},
        ) as r:
            waited = loop.time() - t0
            assert r.status == 503
            assert (await r.json())["error"]["code"] == "overloaded"
        big.close()
    # Queued for at most the part of its 1 s the learned limit leaves to queueing (40%).
    assert 0.2 <= waited < 1.0


async def test_bad_sdk_headers_are_a_clear_400(replica, gateway):
    gw = await gateway(await replica())
    async with aiohttp.ClientSession() as s:
        for name, value in (
            ("x-stainless-read-timeout", "soon"),
            ("x-stainless-read-timeout", "-1"),
            ("x-stainless-retry-count", "two"),
        ):
            async with s.post(
                gw.url + "/v1/chat/completions", json=body(4), headers={name: value}
            ) as r:
                assert r.status == 400
                err = (await r.json())["error"]
                assert err["param"] == name and err["type"] == "invalid_request_error"


async def test_a_last_retry_is_admitted_before_earlier_first_attempts(replica, gateway):
    srv = await replica(speed=1.0)
    gw = await gateway(srv, pool_tokens=512)
    order: list[str] = []

    async def one(s: aiohttp.ClientSession, name: str, retry: int) -> None:
        async with s.post(
            gw.url + "/v1/chat/completions",
            json=body(20),
            headers={"x-stainless-retry-count": str(retry)},
        ) as r:
            assert r.status == 200
        order.append(name)

    async with aiohttp.ClientSession() as s:
        # 8 prompt tokens (counted exactly: near the pool) + 450 = 464 of 486 reserved:
        # a 20-token request (32 with its prompt, block-rounded) must wait.
        big = await hold_pool(s, gw, 450)
        first = asyncio.create_task(one(s, "first-attempt", 0))
        assert await wait_for(lambda: gw.report.queue_depth() == 1)
        last = asyncio.create_task(one(s, "last-retry", 2))
        assert await wait_for(lambda: gw.report.queue_depth() == 2)
        big.close()
        await asyncio.gather(first, last)
    # Both fit once the big one is gone; the last retry was served first all the same.
    assert order[0] == "last-retry"


async def test_the_learned_limit_and_binding_ceiling_are_exported(replica, gateway):
    gw = await gateway(await replica(), admission={"initial_limit": 3})
    live = await scrape(gw)
    assert live[("kvgate_replica_limit", (("replica", "r0"),))] == 3
    binding = {
        dict(labels)["ceiling"]: v
        for (name, labels), v in live.items()
        if name == "kvgate_replica_binding_ceiling"
    }
    assert binding["none"] == 1 and sum(binding.values()) == 1


async def test_a_shed_request_that_comes_back_is_not_counted_twice(replica, gateway):
    srv = await replica(speed=1.0)
    gw = await gateway(srv, pool_tokens=512)
    async with aiohttp.ClientSession() as s:
        big = await hold_pool(s, gw, 440)
        for attempt in range(3):  # the same request, shed, retried
            async with s.post(
                gw.url + "/v1/chat/completions",
                json=body(100),
                headers={"x-kvgate-queue-timeout": "0"},
            ) as r:
                assert r.status == 503
            # Expected back once: its own earlier shed does not count ahead of it.
            assert gw.report.returning() == 1, attempt
        big.close()


async def test_a_shed_by_the_learned_running_limit_says_so_not_kv_capacity(replica, gateway):
    """The learned limit lets one request run while the pool is almost empty: the one
    that cannot wait is told the running limit binds, not that the KV pool is full."""
    srv = await replica(speed=5.0)
    gw = await gateway(
        srv,
        pool_tokens=100_000,
        admission={"learn_limit": True, "initial_limit": 1, "queue_max_per_model": 0},
    )
    async with aiohttp.ClientSession() as s:
        held = await hold_pool(s, gw, 200)
        async with s.post(gw.url + "/v1/chat/completions", json=body(16)) as r:
            assert r.status == 503
            message = (await r.json())["error"]["message"]
        held.close()
    assert "running limit kvgate learned" in message, message
    assert "KV capacity" not in message, message


@pytest.mark.slow
async def test_a_non_stream_request_that_asks_for_its_whole_bound_is_reserved_for_it(
    replica, gateway, monkeypatch
):
    """Once history says outputs are short (8 tokens), a non-stream request without
    ignore_eos is reserved that, but one with ignore_eos generates all of its max_tokens
    and is reserved (and its service predicted) for all of it, as it cannot be topped up
    the way a stream is; min_tokens is a floor too. (A gateway each: one's answer would
    join the next one's history.)"""
    monkeypatch.setattr("admission.learned.estimate.MIN_OUTPUT_SAMPLES", 3)
    reserved = {}
    for name, extra in (
        ("plain", {"ignore_eos": False}),
        ("min_tokens", {"ignore_eos": False, "min_tokens": 120}),
        ("ignore_eos", {}),
    ):
        gw = await gateway(await replica(speed=0.5))
        async with aiohttp.ClientSession() as s:
            for _ in range(3):  # history: outputs of 8 tokens
                async with s.post(gw.url + "/v1/chat/completions", json=body(8)) as r:
                    assert r.status == 200
            task = asyncio.create_task(
                s.post(gw.url + "/v1/chat/completions", json=body(200, **extra))
            )
            assert await wait_for(lambda: gw.report.reserved_tokens() > 0)  # noqa: B023
            reserved[name] = gw.report.reserved_tokens()
            (await task).close()
    assert reserved["plain"] < 100, reserved
    assert 120 <= reserved["min_tokens"] < 200, reserved
    assert reserved["ignore_eos"] >= 200, reserved


@pytest.mark.slow
async def test_with_no_queue_timeout_set_only_what_a_client_states_bounds_its_wait(
    replica, gateway
):
    """The default configuration assumes no queue deadline: a request whose client states
    none waits until room frees (its clients' patience is not learned yet), and one that
    states `x-kvgate-queue-timeout` is shed by it, uncapped."""
    srv = await replica(speed=0.25)  # the held stream outlasts the waits below
    gw = await gateway(srv, pool_tokens=512, admission={"queue_timeout_s": None})
    assert gw.state.config.admission.queue_timeout_s is None
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as s:
        big = await hold_pool(s, gw, 440)
        t0 = loop.time()
        async with s.post(
            gw.url + "/v1/chat/completions",
            json=body(100),
            headers={"x-kvgate-queue-timeout": "0.5"},
        ) as r:
            stated_wait = loop.time() - t0
            assert r.status == 503, await r.text()
        patient = asyncio.create_task(s.post(gw.url + "/v1/chat/completions", json=body(100)))
        assert await wait_for(lambda: gw.report.queue_depth() == 1)
        await asyncio.sleep(1.5)  # three times the stated wait: still queued
        assert not patient.done() and gw.report.queue_depth() == 1
        big.close()
        async with await patient as r:
            assert r.status == 200, await r.text()
    assert 0.4 <= stated_wait < 1.5
    assert gw.report.reserved_tokens() == 0
