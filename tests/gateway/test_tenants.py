"""Tenants through the live gateway over real HTTP, in front of enginesim replicas:
hashed keys, 401s, model access, priority clamp, rate limits with true headers and
exact Retry-After, fair sharing between tenants, per-tenant metrics, no plain keys in
logs or metrics; and the official openai client reading the headers."""

from __future__ import annotations

import asyncio
import io
import logging
import math

import aiohttp
import openai
import pytest

from admission.tenants import hash_key
from gateway.logging import JsonFormatter, access_log
from tests.gateway.conftest import MODEL, wait_for
from tests.gateway.test_failures import read_events
from tests.gateway.test_ops import scrape

MSG = [{"role": "user", "content": "hi"}]
KEY_A = "sk-team-a-0123456789abcdef"
KEY_B = "sk-team-b-fedcba9876543210"
KEY_LEGACY = "sk-legacy-plain-key-555"


def body(max_tokens: int = 4, **extra) -> dict:
    return {"model": MODEL, "messages": MSG, "max_tokens": max_tokens, "ignore_eos": True, **extra}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def tenant(name: str, key: str, **policy) -> dict:
    return {"name": name, "keys_sha256": [hash_key(key)], **policy}


async def post(s, gw, key: str | None, payload: dict, headers: dict | None = None):
    h = dict(headers or {})
    if key is not None:
        h.update(auth(key))
    return await s.post(gw.url + "/v1/chat/completions", json=payload, headers=h)


async def test_missing_or_wrong_key_is_401(replica, gateway):
    gw = await gateway(await replica(), tenants=[tenant("a", KEY_A)])
    async with aiohttp.ClientSession() as s:
        for key, headers in (
            (None, {}),
            ("sk-wrong", {}),
            (None, {"Authorization": "Basic " + KEY_A}),
            (KEY_A[:-1], {}),
        ):
            async with await post(s, gw, key, body(), headers) as r:
                assert r.status == 401
                err = (await r.json())["error"]
                assert err["code"] == "invalid_api_key"
                assert err["type"] == "authentication_error"
        async with await post(s, gw, KEY_A, body()) as r:
            assert r.status == 200


async def test_a_model_the_tenant_may_not_use_is_404(replica, gateway):
    gw = await gateway(await replica(), tenants=[tenant("a", KEY_A, models=["other-model"])])
    async with aiohttp.ClientSession() as s, await post(s, gw, KEY_A, body()) as r:
        assert r.status == 404
        err = (await r.json())["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "do not have access" in err["message"]


async def test_rate_limit_headers_are_true_and_the_429_says_when(replica, gateway):
    gw = await gateway(await replica(), tenants=[tenant("a", KEY_A, rpm=3, tpm=100_000)])
    loop = asyncio.get_running_loop()
    remaining = []
    async with aiohttp.ClientSession() as s:
        t0 = loop.time()
        for _ in range(3):
            async with await post(s, gw, KEY_A, body()) as r:
                assert r.status == 200
                assert r.headers["x-ratelimit-limit-requests"] == "3"
                assert r.headers["x-ratelimit-limit-tokens"] == "100000"
                remaining.append(int(r.headers["x-ratelimit-remaining-requests"]))
                assert 0 < int(r.headers["x-ratelimit-remaining-tokens"]) <= 100_000
        assert remaining == [2, 1, 0]
        async with await post(s, gw, KEY_A, body()) as r:
            t1 = loop.time()
            assert r.status == 429
            err = (await r.json())["error"]
            assert err["code"] == "rate_limit_exceeded" and err["type"] == "rate_limit_error"
            assert "requests per min" in err["message"]
            # 3 a minute: one back every 20 s after the first was charged at t0..t1.
            ms = int(r.headers["retry-after-ms"])
            assert 20_000 - (t1 - t0) * 1000 - 1 <= ms <= 20_000 + 1
            # Whole seconds, rounded up (20 unless the three requests took over a second).
            assert r.headers["Retry-After"] == str(math.ceil(ms / 1000))
            assert t1 - t0 >= 1.0 or r.headers["Retry-After"] == "20"
            assert r.headers["x-ratelimit-remaining-requests"] == "0"
            reset = r.headers["x-ratelimit-reset-requests"]
            assert reset.endswith("s") and reset.startswith(("59", "1m0"))
    live = await scrape(gw)
    assert live[("kvgate_tenant_rate_limited_total", (("limit", "requests"), ("tenant", "a")))] == 1
    assert live[("kvgate_tenant_requests_total", (("outcome", "ok"), ("tenant", "a")))] == 3


async def test_tokens_per_minute_429_names_tokens_and_usage_corrects_the_charge(replica, gateway):
    gw = await gateway(await replica(), tenants=[tenant("a", KEY_A, tpm=600)])
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as s:
        # Charged its estimate up front (prompt + max_tokens 300 before any output was
        # learned); the engine stops where it likes (no ignore_eos), and the usage
        # replaces the estimate.
        t0 = loop.time()
        first = {"model": MODEL, "messages": MSG, "max_tokens": 300}
        async with await post(s, gw, KEY_A, first) as r:
            assert r.status == 200
            used1 = (await r.json())["usage"]["total_tokens"]
        async with await post(s, gw, KEY_A, body(2)) as r:
            assert r.status == 200
            used2 = (await r.json())["usage"]["total_tokens"]
        async with await post(s, gw, KEY_A, body(1000)) as r:
            refill = (loop.time() - t0) * 600 / 60
            assert r.status == 429
            err = (await r.json())["error"]
            assert "tokens per min" in err["message"] and "Request too large" in err["message"]
            # More than the whole budget: never passes, and says so to the SDKs.
            assert "Retry-After" not in r.headers
            assert r.headers["x-should-retry"] == "false"
            # Not charged; what is left is the budget less the two true usages.
            left = int(r.headers["x-ratelimit-remaining-tokens"])
            assert 600 - used1 - used2 - 1 <= left <= 600 - used1 - used2 + refill + 1
        # Within the budget but over what is left now: a 429 with the exact wait.
        async with await post(s, gw, KEY_A, body(590)) as r:
            assert r.status == 429
            assert "tokens per min" in (await r.json())["error"]["message"]
            assert int(r.headers["retry-after-ms"]) > 1000
    live = await scrape(gw)
    assert live[("kvgate_tenant_rate_limited_total", (("limit", "tokens"), ("tenant", "a")))] == 2


async def test_priority_is_clamped_to_the_tenant_range(replica, gateway):
    srv = await replica(speed=1.0)
    gw = await gateway(
        srv,
        pool_tokens=512,
        tenants=[
            tenant("a", KEY_A),  # range [0, 0]: the header cannot lift it
            tenant("vip", KEY_B, priority={"min": 0, "max": 5, "default": 0}),
        ],
    )
    order: list[str] = []

    async def one(s, name: str, key: str, prio: str | None) -> None:
        headers = {"x-kvgate-priority": prio} if prio is not None else {}
        async with await post(s, gw, key, body(20), headers) as r:
            assert r.status == 200, await r.text()
        order.append(name)

    async with aiohttp.ClientSession() as s:
        big = await s.post(
            gw.url + "/v1/chat/completions", json=body(450, stream=True), headers=auth(KEY_A)
        )
        assert len(await read_events(big, 1)) == 1
        tasks = [asyncio.create_task(one(s, "a-first", KEY_A, None))]
        assert await wait_for(lambda: gw.report.queue_depth() == 1)
        tasks.append(asyncio.create_task(one(s, "a-asks-99", KEY_A, "99")))
        assert await wait_for(lambda: gw.report.queue_depth() == 2)
        tasks.append(asyncio.create_task(one(s, "vip-asks-99", KEY_B, "99")))
        assert await wait_for(lambda: gw.report.queue_depth() == 3)
        big.close()
        await asyncio.gather(*tasks)
    # vip's 99 is clamped to 5 and goes first; a's 99 to 0: behind its own first.
    assert order == ["vip-asks-99", "a-first", "a-asks-99"]


async def test_a_tenant_cannot_name_another_by_header(replica, gateway):
    gw = await gateway(
        await replica(), tenants=[tenant("a", KEY_A, rpm=1), tenant("b", KEY_B, rpm=100)]
    )
    naming_b = {
        "x-kvgate-tenant": "b",
        "x-tenant": "b",
        "OpenAI-Organization": "b",
        "OpenAI-Project": "b",
        "x-api-key": KEY_B,
    }
    async with aiohttp.ClientSession() as s:
        async with await post(s, gw, KEY_A, body(), naming_b) as r:
            assert r.status == 200
            assert r.headers["x-ratelimit-limit-requests"] == "1"  # a's, not b's
        async with await post(s, gw, KEY_A, body(), naming_b) as r:
            assert r.status == 429  # a's limit, whatever the headers say
        async with await post(s, gw, KEY_B, body()) as r:
            assert r.status == 200
            assert r.headers["x-ratelimit-remaining-requests"] == "99"
    live = await scrape(gw)
    assert live[("kvgate_tenant_requests_total", (("outcome", "ok"), ("tenant", "b")))] == 1


async def test_plain_keys_never_reach_logs_or_metrics(replica, gateway):
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("kvgate")
    old_level, old_disabled = root.level, access_log.disabled
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    access_log.disabled = False
    try:
        gw = await gateway(
            await replica(),
            auth={"api_keys": {KEY_LEGACY: "legacy"}},
            tenants=[tenant("a", KEY_A, rpm=100, slo={"ttft_s": 5.0, "e2e_s": 10.0})],
        )
        async with aiohttp.ClientSession() as s:
            for key in (KEY_A, KEY_LEGACY, "sk-wrong-key-777"):
                async with await post(s, gw, key, body(stream=True)) as r:
                    await r.read()
        text = ""
        async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
            text = await r.text()
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
        access_log.disabled = old_disabled
    logs = buf.getvalue()
    assert '"tenant":"a"' in logs and '"tenant":"legacy"' in logs  # the lines were written
    for secret in (KEY_A, KEY_LEGACY, "sk-wrong-key-777"):
        assert secret not in logs
        assert secret not in text
        assert secret not in repr(gw.config)
    assert 'kvgate_tenant_requests_total{outcome="ok",tenant="a"} 1.0' in text
    assert 'kvgate_tenant_slo_met_total{target="ttft",tenant="a"} 1.0' in text
    assert 'kvgate_tenant_tokens_total{kind="completion",tenant="legacy"} 4.0' in text
    assert 'kvgate_tenant_queue_wait_seconds_count{tenant="a"} 1.0' in text


async def test_a_flooding_tenant_does_not_delay_a_trickle(replica, gateway):
    """Two tenants on one small replica: A keeps 12 requests queued, B sends one now and
    then. B is served next after whatever runs, not behind A's queue."""
    srv = await replica(speed=5.0)
    gw = await gateway(
        srv,
        pool_tokens=512,
        max_running=2,
        tenants=[tenant("a", KEY_A), tenant("b", KEY_B)],
    )
    done: list[str] = []

    async def one(s, name: str, key: str) -> None:
        async with await post(s, gw, key, body(40)) as r:
            assert r.status == 200, await r.text()
        done.append(name)

    async with aiohttp.ClientSession() as s:
        flood = []
        for i in range(12):
            flood.append(asyncio.create_task(one(s, f"a{i}", KEY_A)))
        assert await wait_for(lambda: gw.report.tenant_queued("a") >= 8)
        trickle = asyncio.create_task(one(s, "b0", KEY_B))
        await trickle
        # The two running when b arrived, a's head (tied with b in the fair order, and
        # earlier), and at most one more running beside b finished before it; in one
        # first-come line it would wait behind all of a's queue (at least 8 more).
        before_b = done.index("b0")
        assert before_b <= 5, done
        await asyncio.gather(*flood)
    assert len(done) == 13


async def test_openai_client_reads_the_rate_limit_headers(replica, gateway):
    gw = await gateway(await replica(), tenants=[tenant("a", KEY_A, rpm=2, tpm=50_000)])
    async with openai.AsyncOpenAI(
        base_url=gw.url + "/v1", api_key=KEY_A, max_retries=0, timeout=20.0
    ) as c:
        raw = await c.chat.completions.with_raw_response.create(
            model=MODEL, messages=MSG, max_tokens=3
        )
        assert raw.headers["x-ratelimit-limit-requests"] == "2"
        assert raw.headers["x-ratelimit-remaining-requests"] == "1"
        assert raw.parse().usage.completion_tokens > 0
        await c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3)
        with pytest.raises(openai.RateLimitError) as exc:
            await c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3)
    e = exc.value
    assert e.status_code == 429 and e.code == "rate_limit_exceeded"
    assert 29_000 <= int(e.response.headers["retry-after-ms"]) <= 30_001
    async with openai.AsyncOpenAI(
        base_url=gw.url + "/v1", api_key="sk-nope", max_retries=0, timeout=20.0
    ) as bad:
        with pytest.raises(openai.AuthenticationError) as auth_exc:
            await bad.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3)
    assert auth_exc.value.code == "invalid_api_key"


async def test_concurrency_and_queue_caps_are_429s_naming_the_limit(replica, gateway):
    srv = await replica(speed=2.0)
    gw = await gateway(
        srv,
        tenants=[
            tenant("a", KEY_A, max_concurrent=1, max_queued=0),
            tenant("b", KEY_B, max_queued=0),
        ],
        pool_tokens=512,
    )
    async with aiohttp.ClientSession() as s:
        held = await s.post(
            gw.url + "/v1/chat/completions", json=body(200, stream=True), headers=auth(KEY_A)
        )
        assert len(await read_events(held, 1)) == 1
        async with await post(s, gw, KEY_A, body()) as r:
            assert r.status == 429
            err = (await r.json())["error"]
            assert err["code"] == "rate_limit_exceeded"
            assert "Concurrency limit reached for tenant a" in err["message"]
            assert float(r.headers["retry-after-ms"]) > 0 and "Retry-After" in r.headers
        # b has no concurrency cap: it runs beside a's stream.
        async with await post(s, gw, KEY_B, body()) as r:
            assert r.status == 200
        # Fill the pool with a second stream of b's; b's next request cannot start and
        # may not queue.
        held_b = await s.post(
            gw.url + "/v1/chat/completions", json=body(200, stream=True), headers=auth(KEY_B)
        )
        assert len(await read_events(held_b, 1)) == 1
        async with await post(s, gw, KEY_B, body(100)) as r:
            assert r.status == 429
            assert "Queue limit reached for tenant b" in (await r.json())["error"]["message"]
        held.close()
        held_b.close()
    live = await scrape(gw)
    key = "kvgate_tenant_rate_limited_total"
    assert live[(key, (("limit", "concurrency"), ("tenant", "a")))] == 1
    assert live[(key, (("limit", "queue"), ("tenant", "b")))] == 1


async def test_a_larger_share_admits_waiting_requests_at_once(replica, gateway):
    srv = await replica(speed=2.0)
    gw = await gateway(srv, tenants=[tenant("a", KEY_A, max_concurrent=2, rpm=100)])
    gw.state.set_tenant_share("a", 0.5)  # this process may run 1 of a's 2, 50 rpm
    async with aiohttp.ClientSession() as s:
        held = await s.post(
            gw.url + "/v1/chat/completions", json=body(200, stream=True), headers=auth(KEY_A)
        )
        assert len(await read_events(held, 1)) == 1
        # The headers tell the tenant's limit, not this process's share of it.
        assert held.headers["x-ratelimit-limit-requests"] == "100"
        waiting = asyncio.create_task(post(s, gw, KEY_A, body()))
        assert await wait_for(lambda: gw.report.tenant_queued("a") == 1)
        gw.state.set_tenant_share("a", 1.0)
        assert gw.report.tenant_queued("a") == 0 and gw.report.tenant_running("a") == 2
        async with await waiting as r:
            assert r.status == 200
            assert r.headers["x-ratelimit-limit-requests"] == "100"
        held.close()


async def test_forwarded_endpoints_count_against_the_requests_per_minute(replica, gateway):
    """tokenize, detokenize, count_tokens and stored responses take no KV but are
    requests: each counts one against the tenant's RPM (no tokens), and over it gets the
    same 429 the completions do; another tenant is not touched."""
    gw = await gateway(
        await replica(), tenants=[tenant("a", KEY_A, rpm=2, tpm=10), tenant("b", KEY_B)]
    )
    auth = {"Authorization": f"Bearer {KEY_A}"}
    payload = {"model": MODEL, "prompt": "hello there, a prompt of more tokens than ten"}
    async with aiohttp.ClientSession() as s:
        for _ in range(2):  # its TPM of 10 does not apply: a tokenize generates nothing
            async with s.post(gw.url + "/tokenize", json=payload, headers=auth) as r:
                assert r.status == 200, await r.text()
        async with s.post(gw.url + "/tokenize", json=payload, headers=auth) as r:
            assert r.status == 429
            err = (await r.json())["error"]
            assert err["code"] == "rate_limit_exceeded" and "requests per min" in err["message"]
            assert 25_000 <= int(r.headers["retry-after-ms"]) <= 30_001
        async with await post(s, gw, KEY_A, body()) as r:
            assert r.status == 429  # the same budget the completions draw on
        other = {"Authorization": f"Bearer {KEY_B}"}
        async with s.post(gw.url + "/tokenize", json=payload, headers=other) as r:
            assert r.status == 200
    # Both 429s are counted where an operator looks for them (the completion's hit the
    # tokens per minute first).
    live = await scrape(gw)
    key = "kvgate_tenant_rate_limited_total"
    assert live[(key, (("limit", "requests"), ("tenant", "a")))] == 1
    assert live[(key, (("limit", "tokens"), ("tenant", "a")))] == 1
