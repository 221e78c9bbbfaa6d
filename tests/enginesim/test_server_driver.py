"""The wall-clock driver keeps the engine's virtual timeline exact whatever the host's pace."""

from __future__ import annotations

import aiohttp
import pytest

from tests.enginesim.helpers import COMPLETIONS, scrape


@pytest.mark.parametrize("speed", [1.0, 200.0])
async def test_simulated_latency_is_the_engines_step_time(enginesim_server, speed):
    # At speed 200 the event loop cannot pace 2 ms steps (10 us of wall each); the clock
    # must slip rather than run ahead, so simulated latency is still the sum of the steps.
    server = await enginesim_server("tiny", speed=speed)
    body = {"prompt": "measure " * 10, "max_tokens": 60, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + COMPLETIONS, json=body) as r:
            await r.read()
        m = await scrape(s, server.url)
    busy = server.core.busy_time
    e2e = m["vllm:e2e_request_latency_seconds_sum"]
    assert server.core.total_steps == 60  # one prefill step (it emits a token) + 59 decodes
    assert busy - 1e-9 <= e2e <= busy * 1.05 + 0.002, (e2e, busy)
    itl = m["vllm:inter_token_latency_seconds_sum"] / m["vllm:inter_token_latency_seconds_count"]
    decode_step = (busy - m["vllm:time_to_first_token_seconds_sum"]) / 59
    assert itl == pytest.approx(decode_step, rel=0.1)


async def test_virtual_clock_follows_wall_time_when_idle(enginesim_server):
    import asyncio

    server = await enginesim_server("tiny", speed=10.0)
    loop = asyncio.get_running_loop()

    def read() -> tuple[float, float, float]:
        # Bracket the virtual read between two wall reads: on a busy host the process can
        # be paused between any two calls, which widens the bracket but never breaks it.
        before = loop.time()
        v = server.driver.vnow()
        return before, v, loop.time()

    a0, v0, b0 = read()
    await asyncio.sleep(0.05)
    a1, v1, b1 = read()
    assert server.driver.slipped == 0.0
    assert 10.0 * (a1 - b0) - 1e-9 <= v1 - v0 <= 10.0 * (b1 - a0) + 1e-9
