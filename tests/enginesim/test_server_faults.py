"""Fault injection as a client of the simulated replica sees it."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.enginesim.helpers import (
    CHAT,
    COMPLETIONS,
    chat_body,
    parse_sse,
    scrape,
    wait_until,
)


async def _set_fault(session: aiohttp.ClientSession, url: str, **body) -> dict:
    async with session.post(url + "/admin/faults", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def _long_stream(server, **extra) -> dict:
    limit = server.profile.max_model_len
    return {
        "prompt": "w " * 30,
        "max_tokens": limit - 100,
        "ignore_eos": True,
        "stream": True,
        **extra,
    }


async def test_admin_faults_roundtrip_and_validation(enginesim_server, session):
    server = await enginesim_server("tiny")
    async with session.get(server.url + "/admin/faults") as r:
        assert (await r.json())["mode"] == "none"
    state = await _set_fault(session, server.url, mode="slow", factor=3)
    assert state["mode"] == "slow" and state["factor"] == 3.0 and state["crashed"] is False
    async with session.get(server.url + "/admin/faults") as r:
        assert (await r.json())["mode"] == "slow"
    for bad in ({"mode": "explode"}, {"status": 500}, {"mode": "error", "status": 404},
                {"mode": "slow", "factor": 0.5}, {"mode": "drop", "after_tokens": -1},
                {"mode": "drop", "after_tokens": "3"}, {"mode": "none", "extra": 1}, [1]):  # fmt: skip
        async with session.post(server.url + "/admin/faults", json=bad) as r:
            assert r.status == 400, bad
            assert (await r.json())["error"]["type"] == "BadRequestError"
    await _set_fault(session, server.url, mode="none")
    assert server.driver.slow_factor == 1.0


async def test_error_fault(enginesim_server, session):
    server = await enginesim_server("tiny", speed=50.0)
    await _set_fault(session, server.url, mode="error", status=503)
    async with session.post(server.url + CHAT, json=chat_body(max_tokens=3)) as r:
        assert r.status == 503
        err = (await r.json())["error"]
    assert err["code"] == 503 and err["type"] == "ServiceUnavailableError"
    async with session.get(server.url + "/health") as r:
        assert r.status == 503
    async with session.get(server.url + "/metrics") as r:  # the API server is still up
        assert r.status == 200
    assert server.driver.num_in_flight == 0
    await _set_fault(session, server.url, mode="none")
    async with session.post(server.url + CHAT, json=chat_body(max_tokens=3)) as r:
        assert r.status == 200


@pytest.mark.slow  # the stall is seen through real-time timeouts
async def test_hang_fault_stalls_streams_and_new_requests(enginesim_server, session):
    server = await enginesim_server("tiny", speed=5.0)
    resp = await session.post(server.url + COMPLETIONS, json=_long_stream(server, max_tokens=60))
    await resp.content.readuntil(b"\n\n")
    await _set_fault(session, server.url, mode="hang")
    steps = server.driver.steps

    # A new request is accepted but never answered while hung.
    pending = asyncio.create_task(session.post(server.url + CHAT, json=chat_body(max_tokens=3)))
    done, _ = await asyncio.wait({pending}, timeout=0.3)
    assert not done
    async with aiohttp.ClientSession() as other:
        with pytest.raises(asyncio.TimeoutError):
            await other.get(server.url + "/health", timeout=aiohttp.ClientTimeout(total=0.2))
    # The in-flight stream stalls: at most the chunks of the step in progress arrive.
    with pytest.raises(asyncio.TimeoutError):
        async with asyncio.timeout(0.3):
            while True:
                await resp.content.readuntil(b"\n\n")
    assert server.driver.steps <= steps + 1

    # Clearing resumes both.
    await _set_fault(session, server.url, mode="none")
    rest = await resp.content.read()
    assert rest.endswith(b"data: [DONE]\n\n")
    answered = await pending
    assert answered.status == 200
    answered.release()
    await wait_until(lambda: server.core.stats().blocks_in_use == 0)


async def test_drop_fault_stream_and_non_stream(enginesim_server, session):
    server = await enginesim_server("tiny", speed=20.0)
    await _set_fault(session, server.url, mode="drop", after_tokens=4)
    received = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async with session.post(server.url + COMPLETIONS, json=_long_stream(server)) as r:
            assert r.status == 200
            async for line in r.content:
                received += line
    assert received.count(b"data: ") == 4  # one token per chunk without speculation
    assert b"[DONE]" not in received
    await wait_until(lambda: server.core.stats().blocks_in_use == 0)

    body = {"prompt": "hello", "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await session.post(server.url + COMPLETIONS, json=body)
    await wait_until(lambda: server.core.stats().blocks_in_use == 0)
    assert server.driver.num_in_flight == 0

    await _set_fault(session, server.url, mode="none")
    async with session.post(server.url + COMPLETIONS, json={**body, "max_tokens": 8}) as r:
        assert (await r.json())["usage"]["completion_tokens"] == 8


async def test_slow_fault_stretches_steps(enginesim_server, session):
    server = await enginesim_server("tiny", speed=1.0)  # real time: no loop lag in the ratio
    body = {"prompt": "time me", "max_tokens": 25, "ignore_eos": True}

    async def e2e() -> float:
        before = (await scrape(session, server.url))["vllm:e2e_request_latency_seconds_sum"]
        async with session.post(server.url + COMPLETIONS, json=body) as r:
            assert r.status == 200
        after = (await scrape(session, server.url))["vllm:e2e_request_latency_seconds_sum"]
        return after - before

    normal = await e2e()
    await _set_fault(session, server.url, mode="slow", factor=6.0)
    slow = await e2e()
    assert slow > 3.0 * normal, (normal, slow)
    await _set_fault(session, server.url, mode="none")
    again = await e2e()
    assert again < slow / 2, (again, slow)


async def test_crash_fault_embedded(enginesim_server, session):
    server = await enginesim_server("tiny", speed=5.0)
    resp = await session.post(server.url + COMPLETIONS, json=_long_stream(server))
    await resp.content.readuntil(b"\n\n")
    state = await _set_fault(session, server.url, mode="crash")
    assert state["crashed"] is True
    with pytest.raises(aiohttp.ClientPayloadError):
        await resp.content.read()
    await wait_until(lambda: server.driver.num_in_flight == 0)
    async with aiohttp.ClientSession() as fresh:
        with pytest.raises(aiohttp.ClientConnectorError):
            await fresh.get(server.url + "/health")
        with pytest.raises(aiohttp.ClientConnectorError):
            await fresh.get(server.url + "/admin/faults")
    assert server.core.stats().blocks_in_use == 0


async def test_crash_after_tokens_breaks_stream_mid_flight(enginesim_server, session):
    server = await enginesim_server("tiny", speed=20.0)
    await _set_fault(session, server.url, mode="crash", after_tokens=10)
    assert not server.crashed
    with pytest.raises(aiohttp.ClientPayloadError):
        async with session.post(
            server.url + CHAT, json=chat_body(max_tokens=500, ignore_eos=True, stream=True)
        ) as r:
            await r.read()
    assert server.crashed
    async with aiohttp.ClientSession() as fresh:
        with pytest.raises(aiohttp.ClientConnectorError):
            await fresh.post(server.url + CHAT, json=chat_body(max_tokens=3))


async def test_fault_given_at_start(enginesim_server, session):
    from enginesim.faults import make_fault

    server = await enginesim_server("tiny", fault=make_fault("error", status=502))
    async with session.post(server.url + CHAT, json=chat_body(max_tokens=3)) as r:
        assert r.status == 502
    await _set_fault(session, server.url, mode="none")
    async with session.post(server.url + CHAT, json=chat_body(max_tokens=3, stream=True)) as r:
        assert parse_sse(await r.read())[-1] == "[DONE]"
