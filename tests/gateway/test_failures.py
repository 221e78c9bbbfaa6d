"""Every failure path ends in an explicit answer and frees its reservation.

The `gateway` fixture's finalizer checks, after each test, that the ledger is back to
zero and that live replicas hold no KV blocks; these tests add the path-specific
assertions (status, error object, upstream abort, metrics).
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest

from enginesim.faults import make_fault
from tests.gateway.conftest import MODEL, wait_for

LONG = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "tell me a long story"}],
    "max_tokens": 1500,
    "ignore_eos": True,
}
SHORT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


async def read_events(resp: aiohttp.ClientResponse, n: int) -> list[bytes]:
    """Read `n` SSE events (or until the stream ends)."""
    events: list[bytes] = []
    buf = b""
    while len(events) < n:
        chunk = await resp.content.readany()
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf and len(events) < n:
            ev, buf = buf.split(b"\n\n", 1)
            events.append(ev)
    return events


async def upstream_errors(gw) -> dict[tuple[str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
        text = await r.text()
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "kvgate_upstream_errors":
            for smp in fam.samples:
                if smp.name.endswith("_total"):
                    out[(smp.labels["replica"], smp.labels["kind"])] = smp.value
    return out


async def test_client_disconnect_mid_stream_aborts_upstream(replica, gateway):
    srv = await replica(speed=1.0)
    gw = await gateway(srv)
    aborted_before = srv.core.stats().num_aborted
    async with aiohttp.ClientSession() as s:
        resp = await s.post(gw.url + "/v1/chat/completions", json={**LONG, "stream": True})
        assert resp.status == 200
        assert len(await read_events(resp, 3)) == 3
        assert gw.report.reserved_tokens() > 0
        assert srv.core.stats().blocks_in_use > 0
        resp.close()  # drop the connection mid-stream
    assert await wait_for(lambda: gw.report.reserved_tokens() == 0)
    assert await wait_for(lambda: srv.core.stats().blocks_in_use == 0)
    assert srv.core.stats().num_aborted == aborted_before + 1


async def test_client_disconnect_non_stream_cancels_handler_and_upstream(replica, gateway):
    srv = await replica(speed=1.0)
    gw = await gateway(srv)

    async def call() -> None:
        async with (
            aiohttp.ClientSession() as s,
            s.post(gw.url + "/v1/chat/completions", json=LONG) as r,
        ):
            await r.read()

    task = asyncio.create_task(call())
    assert await wait_for(lambda: srv.core.stats().num_running == 1)
    assert gw.report.reserved_tokens() > 0
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await wait_for(lambda: gw.report.reserved_tokens() == 0)
    assert await wait_for(lambda: srv.core.stats().blocks_in_use == 0)
    assert srv.core.stats().num_aborted == 1


async def test_client_disconnect_while_queued_leaves_the_queue(replica, gateway):
    srv = await replica(speed=1.0)
    gw = await gateway(srv, pool_tokens=512)
    async with aiohttp.ClientSession() as s:
        big = await s.post(
            gw.url + "/v1/chat/completions", json={**LONG, "max_tokens": 440, "stream": True}
        )
        assert len(await read_events(big, 1)) == 1

        async def queued() -> None:
            async with (
                aiohttp.ClientSession() as s2,
                s2.post(gw.url + "/v1/chat/completions", json={**SHORT, "max_tokens": 100}) as r,
            ):
                await r.read()

        task = asyncio.create_task(queued())
        assert await wait_for(lambda: gw.report.queue_depth() == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await wait_for(lambda: gw.report.queue_depth() == 0)
        big.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_upstream_5xx_keeps_the_engines_status_and_message(replica, gateway, stream):
    srv = await replica()
    gw = await gateway(srv)
    srv.set_fault(make_fault("error", status=503))
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw.url + "/v1/chat/completions", json={**SHORT, "stream": stream}) as r,
    ):
        assert r.status == 503
        assert int(r.headers["Retry-After"]) >= 1  # a 503 always says when to come back
        body = await r.json()
    assert body["error"] == {
        "message": "injected fault: engine error (503)",
        "type": "overloaded_error",
        "param": None,
        "code": "503",
    }
    assert (await upstream_errors(gw))[("r0", "status_5xx")] >= 1
    srv.set_fault(make_fault("none"))


async def test_5xx_before_any_byte_is_retried_on_another_replica(replica, gateway):
    bad, good = await replica(), await replica()
    gw = await gateway(bad, good, discovery={"refresh_interval_s": 30.0})
    bad.set_fault(make_fault("error", status=500))
    n = 0
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as c:
        # Equal replicas tie; the picker breaks ties at random, so within a few requests
        # one lands on the bad replica first (P(never in 30) ~ 1e-9).
        while n < 30 and ("r0", "status_5xx") not in await upstream_errors(gw):
            r = await c.chat.completions.create(
                model=MODEL, messages=SHORT["messages"], max_tokens=4
            )
            assert r.usage is not None and r.usage.completion_tokens > 0
            n += 1
    assert (await upstream_errors(gw))[("r0", "status_5xx")] == 1
    assert good.core.stats().num_finished == n
    # One 5xx does not take the replica out of rotation: discovery decides its health.
    assert all(u.ready for u in gw.report.replica_usage())
    bad.set_fault(make_fault("none"))


async def test_connection_dropped_mid_stream_ends_with_error_event(replica, gateway):
    srv = await replica()
    gw = await gateway(srv)
    srv.set_fault(make_fault("drop", after_tokens=3))
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw.url + "/v1/chat/completions", json={**LONG, "stream": True}) as r,
    ):
        assert r.status == 200
        raw = await r.read()
    events = [e for e in raw.split(b"\n\n") if e]
    assert len(events) >= 2
    last = json.loads(events[-1][len(b"data: ") :])
    assert last["error"]["code"] == "upstream_dropped"
    # The SDK turns the error event into an exception rather than a silent truncation.
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as c:
        stream = await c.chat.completions.create(
            model=MODEL,
            messages=LONG["messages"],
            max_tokens=200,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        with pytest.raises(openai.APIError):
            async for _ in stream:
                pass
    srv.set_fault(make_fault("none"))
    assert (await upstream_errors(gw))[("r0", "dropped")] >= 2


async def test_connection_dropped_before_response_is_502(replica, gateway):
    srv = await replica()
    gw = await gateway(srv)
    srv.set_fault(make_fault("drop", after_tokens=0))
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw.url + "/v1/chat/completions", json=SHORT) as r,
    ):
        assert r.status == 502
        assert (await r.json())["error"]["code"] == "upstream_dropped"
    srv.set_fault(make_fault("none"))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.slow
async def test_hung_replica_is_504_and_aborted(replica, gateway, stream):
    srv = await replica()
    gw = await gateway(srv, upstream={"first_byte_s": 0.3, "total_s": 0.6})
    srv.set_fault(make_fault("hang"))
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw.url + "/v1/chat/completions", json={**SHORT, "stream": stream}) as r,
    ):
        assert r.status == 504
        assert (await r.json())["error"]["code"] == "upstream_timeout"
    if stream:  # closing a stream stops the engine at its next write: released at once
        assert gw.report.reserved_tokens() == 0
    else:  # the engine may still be generating a non-stream request: held until it says
        assert gw.report.held() == 1
    srv.set_fault(make_fault("none"))
    assert await wait_for(lambda: gw.report.reserved_tokens() == 0)
    assert (await upstream_errors(gw))[("r0", "timeout")] == 1


@pytest.mark.slow
async def test_stream_stalling_mid_way_hits_idle_timeout(replica, gateway):
    srv = await replica(speed=1.0)
    gw = await gateway(srv, upstream={"idle_s": 0.3})
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw.url + "/v1/chat/completions", json={**LONG, "stream": True}) as r,
    ):
        assert len(await read_events(r, 2)) == 2
        srv.set_fault(make_fault("hang"))
        rest = await r.read()
    last = [e for e in rest.split(b"\n\n") if e][-1]
    assert json.loads(last[len(b"data: ") :])["error"]["code"] == "upstream_timeout"
    srv.set_fault(make_fault("none"))
    assert await wait_for(lambda: srv.core.stats().blocks_in_use == 0)


async def test_crashed_replica_is_marked_unready_and_request_retried(replica, gateway):
    dead, alive = await replica(), await replica()
    gw = await gateway(dead, alive, discovery={"refresh_interval_s": 30.0})
    dead.set_fault(make_fault("crash"))
    assert await wait_for(lambda: dead.crashed)
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as c:
        for _ in range(4):
            r = await c.chat.completions.create(
                model=MODEL, messages=SHORT["messages"], max_tokens=4
            )
            assert r.choices[0].message.content is not None
    ready = {u.name: u.ready for u in gw.report.replica_usage()}
    assert alive.core.stats().num_finished == 4
    # If the picker tried the dead one it is out of rotation now; it never served.
    if ("r0", "connect") in await upstream_errors(gw):
        assert ready["r0"] is False


async def test_only_replica_crashed_is_502_then_503(replica, gateway):
    srv = await replica()
    gw = await gateway(srv, discovery={"refresh_interval_s": 30.0})
    srv.set_fault(make_fault("crash"))
    assert await wait_for(lambda: srv.crashed)
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/chat/completions", json=SHORT) as r:
            assert r.status == 502
            assert (await r.json())["error"]["code"] == "upstream_connect"
        # Marked unready: the next request is shed at once, honestly, instead of tried.
        async with s.post(gw.url + "/v1/chat/completions", json=SHORT) as r:
            assert r.status == 503
            assert "Retry-After" in r.headers
        async with s.get(gw.url + "/ready") as r:
            assert r.status == 503


async def test_crash_mid_stream_ends_with_error_event(replica, gateway):
    srv = await replica(speed=1.0)
    gw = await gateway(srv)
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw.url + "/v1/chat/completions", json={**LONG, "stream": True}) as r,
    ):
        assert len(await read_events(r, 2)) == 2
        srv.set_fault(make_fault("crash"))
        rest = await r.read()
    last = [e for e in rest.split(b"\n\n") if e][-1]
    assert json.loads(last[len(b"data: ") :])["error"]["code"] == "upstream_dropped"
    assert gw.report.reserved_tokens() == 0


async def test_burst_with_random_disconnects_leaves_nothing_behind(replica, gateway):
    """40 concurrent requests (stream and not) over two small replicas; a seeded third
    of the clients give up at random moments. Every survivor completes or is shed
    explicitly; the finalizer checks the ledger and the replicas' KV blocks."""
    import random

    rng = random.Random(7)
    a, b = await replica(speed=20.0), await replica(speed=20.0)
    gw = await gateway(a, b, pool_tokens=1024, admission={"queue_timeout_s": 5.0})
    statuses: list[int] = []

    async def one(i: int) -> None:
        stream = i % 2 == 0
        req = {**LONG, "max_tokens": rng.randint(20, 300), "stream": stream}
        async with (
            aiohttp.ClientSession() as s,
            s.post(gw.url + "/v1/chat/completions", json=req) as r,
        ):
            statuses.append(r.status)
            await r.read()

    tasks = [asyncio.create_task(one(i)) for i in range(40)]
    victims = rng.sample(tasks, 13)
    await asyncio.sleep(0.05)
    for t in victims:
        await asyncio.sleep(rng.random() * 0.02)
        t.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    survivors = [r for t, r in zip(tasks, results, strict=True) if t not in victims]
    assert not [r for r in survivors if isinstance(r, BaseException)]
    assert set(statuses) <= {200, 503}
    assert statuses.count(200) >= len(survivors) // 2


@pytest.mark.slow
async def test_a_stream_longer_than_many_idle_windows_is_not_cut(replica, gateway):
    """The idle bound is between chunks, not on the whole stream: a stream that goes on
    for several idle windows, a chunk at a time, ends normally (the relay's one timer is
    re-armed from the last chunk each time it fires)."""
    srv = await replica(speed=1.0)
    gw = await gateway(srv, upstream={"idle_s": 0.5, "first_byte_s": 5.0})
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            gw.url + "/v1/chat/completions", json={**LONG, "max_tokens": 500, "stream": True}
        ) as r,
    ):
        assert r.status == 200
        body = await r.read()
    took = loop.time() - started
    events = [e for e in body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    assert not any(b'"error"' in e for e in events)
    assert len(events) >= 500
    assert took > 1.0  # the premise: it outlived two idle windows
