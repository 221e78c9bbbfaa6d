"""Learned client patience through the live gateway (admission/learned/patience.py): a plain HTTP
client with a total timeout it never states teaches kvgate how long it waits, and is then
answered (served, or shed with Retry-After) before it would give up; the openai SDK,
which states its timeout, is believed and teaches nothing."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from admission.learned.patience import MIN_COHORT, MIN_EVENTS, ClientEnd
from gateway.accounting import patience_seen
from gateway.outcome import OK
from tests.gateway.conftest import MODEL, left_ctx, wait_for
from tests.gateway.test_ops import scrape
from tests.gateway.test_queue import body, hold_pool

TIMEOUT = 0.6  # the plain client's total timeout, never sent


pytestmark = pytest.mark.slow


def _post(s: aiohttp.ClientSession, gw, max_tokens: int, stream: bool = False):
    """A plain client's chat request, with the total timeout it never states."""
    return s.post(
        gw.url + "/v1/chat/completions",
        json=body(max_tokens, stream=stream),
        timeout=aiohttp.ClientTimeout(total=TIMEOUT),
    )


async def _timed_out(s: aiohttp.ClientSession, gw) -> str:
    """One plain request with a total timeout: "timeout", or the HTTP status."""
    try:
        async with _post(s, gw, 50) as r:
            await r.read()
            return str(r.status)
    except TimeoutError:
        return "timeout"


async def _teach(gw) -> tuple[int, int]:
    """MIN_EVENTS plain clients queue behind a full pool and give up at TIMEOUT. The
    first MIN_COHORT to leave together teach their timeout, and the rest of the wave,
    queued as long, is shed then (503), unless its clients left first. Returns the plain
    population's (observed, left) as the gateway saw them."""
    async with aiohttp.ClientSession() as s:
        outcomes = await asyncio.gather(*(_timed_out(s, gw) for _ in range(MIN_EVENTS)))
    assert set(outcomes) <= {"timeout", "503"}, outcomes
    assert outcomes.count("timeout") >= MIN_COHORT

    def plain():
        return next((r for r in gw.report.patience_readings() if not r.stream), None)

    # Every one of them ended at the gateway (it notices a disconnect a little later).
    assert await wait_for(lambda: (p := plain()) is not None and p.observed == MIN_EVENTS)
    assert gw.report.patience("default", MODEL) is not None
    assert MIN_COHORT <= plain().left <= MIN_EVENTS
    return plain().observed, plain().left


async def test_a_plain_client_with_an_unstated_timeout_is_shed_before_it_gives_up(replica, gateway):
    srv = await replica(speed=1.0)
    gw = await gateway(
        srv, pool_tokens=512, admission={"queue_timeout_s": 30.0}, auth={"admin_token": "adm"}
    )
    async with aiohttp.ClientSession() as s:
        big = await hold_pool(s, gw, 440)
        # Before it has learned anything, the configured 30 s holds them: they time out.
        _, left = await _teach(gw)
        learned = gw.report.patience("default", MODEL)
        # Seen at the gateway: from the request's arrival to the disconnect it noticed.
        assert learned is not None and 0.7 * TIMEOUT <= learned <= TIMEOUT + 0.4
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        async with _post(s, gw, 50) as r:
            waited = loop.time() - t0
            assert r.status == 503
            assert int(r.headers["Retry-After"]) >= 1
            assert (await r.json())["error"]["code"] == "overloaded"
        assert waited < TIMEOUT
        # An operator sees it: the metric and the admin view.
        live = await scrape(gw)
        key = (
            "kvgate_client_patience_seconds",
            (("model", MODEL), ("quantile", "0.1"), ("stream", "false"), ("tenant", "default")),
        )
        assert live[key] == pytest.approx(learned)
        async with s.get(gw.url + "/admin/replicas", headers={"Authorization": "Bearer adm"}) as r:
            (row,) = (await r.json())["client_patience"]
        assert row["tenant"] == "default" and row["model"] == MODEL and not row["stream"]
        assert row["patience_s"] == pytest.approx(learned, abs=1e-3)
        assert row["left"] == left
        big.close()
    # Served once there is room: the learned budget admits what fits in it.
    async with aiohttp.ClientSession() as s:
        assert await wait_for(lambda: gw.report.reserved_tokens() == 0)
        async with s.post(
            gw.url + "/v1/chat/completions",
            json=body(5),
            timeout=aiohttp.ClientTimeout(total=10 * TIMEOUT),
        ) as r:
            assert r.status == 200


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
async def test_the_openai_sdk_states_its_timeout_and_is_believed_first(replica, gateway, stream):
    srv = await replica(speed=1.0)
    gw = await gateway(srv, pool_tokens=512, admission={"queue_timeout_s": 30.0})
    async with aiohttp.ClientSession() as s:
        big = await hold_pool(s, gw, 440)
        taught = await _teach(gw)  # plain non-stream clients of the same tenant: 0.6 s
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", timeout=5.0)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        # Its defaults otherwise (two retries): each attempt queues within its own 5 s
        # read timeout (40% of it, with no drain history to shed on sooner), not the
        # plain clients' 0.6 s; it ends served (the pool frees) or shed after that.
        status = 200
        try:
            if stream:
                got = await client.chat.completions.create(
                    model=MODEL, messages=body(50)["messages"], max_tokens=50, stream=True
                )
                async for _ in got:
                    pass
            else:
                await client.chat.completions.create(
                    model=MODEL, messages=body(50)["messages"], max_tokens=50
                )
        except openai.APIStatusError as e:
            status = e.status_code
        waited = loop.time() - t0
        await client.close()
        big.close()
    # Queued past the plain clients' patience (their budget would shed it in 0.24 s);
    # shed, only after the 2 s its own timeout gives the queue.
    assert waited > TIMEOUT
    assert status == 200 or (status == 503 and waited >= 2.0)
    # It stated its timeout: nothing learned from it, the plain population's unchanged.
    # (The stream holding the pool is a plain client too: it stayed, and says so.)
    readings = {r.stream: r for r in gw.report.patience_readings()}
    assert (readings[False].observed, readings[False].left) == taught
    assert (readings[True].observed, readings[True].left) == (1, 0)


async def test_a_stream_client_with_a_total_deadline_is_learned_as_one(replica, gateway):
    srv = await replica(speed=1.0)
    gw = await gateway(srv, auth={"admin_token": "adm"})
    async with aiohttp.ClientSession() as s:
        # Its short streams end within the deadline (a deadline no stream of the
        # population was read within is not learned: admission/learned/patience.py).
        async with _post(s, gw, 5, stream=True) as r:
            assert r.status == 200
            await r.read()
        for _ in range(MIN_EVENTS):
            # aiohttp's total timeout cuts the stream while its tokens flow.
            got = 0
            with pytest.raises(TimeoutError):
                async with _post(s, gw, 400, stream=True) as r:
                    assert r.status == 200
                    async for _ in r.content:
                        got += 1
            assert got > 2  # it left mid-stream, not before the first token
        assert await wait_for(lambda: gw.report.patience("default", MODEL, True) is not None)
        async with s.get(gw.url + "/admin/replicas", headers={"Authorization": "Bearer adm"}) as r:
            (row,) = (await r.json())["client_patience"]
    assert row["stream"] and row["left"] == MIN_EVENTS
    assert 0.7 * TIMEOUT <= row["patience_s"] <= TIMEOUT + 0.4
    assert row["whole_response"] is True  # the whole stream, not its first token


def test_where_a_stream_client_left_is_read_from_its_gaps() -> None:
    # 100 events 20 ms apart from 0.5 s on; left 30 ms after the last: while it flowed.
    flowing = left_ctx(stream=True, first_byte_at=0.5, last_event_at=2.48, events=100)
    assert patience_seen(flowing, 2.51) == ClientEnd(2.51, True, pytest.approx(0.03), False, 0.5)
    # The same stream, left 3 s after its last event: after a stall (a per-chunk clock).
    stalled = left_ctx(stream=True, first_byte_at=0.5, last_event_at=2.48, events=100)
    assert patience_seen(stalled, 5.48).stalled is True
    # Before its first token: the shape is unknown, the wait is its quiet stretch.
    early = left_ctx(stream=True)
    assert patience_seen(early, 3.0) == ClientEnd(3.0, True, 3.0, None)
    # Served: it sat through at least its wait for the first token.
    served = left_ctx(stream=True, first_byte_at=0.5, last_event_at=2.48, events=100, outcome=OK)
    assert patience_seen(served, 2.5) == ClientEnd(2.5, False, 0.5, None, 0.5)
    # A stated timeout teaches nothing.
    assert patience_seen(left_ctx(stream=True, patience_stated=True), 3.0) is None
