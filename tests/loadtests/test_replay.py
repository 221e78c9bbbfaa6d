"""The batch replay client against a live simulated replica on loopback."""

from __future__ import annotations

import asyncio

from aiohttp import web
from multidict import CIMultiDict

from enginesim.workloads import synthetic_items
from loadtests.replay import _retry_after, replay


def test_retry_after_prefers_milliseconds() -> None:
    assert _retry_after(CIMultiDict({"retry-after-ms": "250", "Retry-After": "1"}), 9.0) == 0.25
    assert _retry_after(CIMultiDict({"Retry-After": "3"}), 9.0) == 3.0
    assert _retry_after(CIMultiDict({"Retry-After": "soon"}), 9.0) == 9.0
    assert _retry_after(CIMultiDict(), 9.0) == 9.0


async def test_replay_counts_completions_and_usage(enginesim_server) -> None:
    srv = await enginesim_server("tiny", speed=50)
    items = synthetic_items(6, prompt_tokens=64, output_tokens=8)
    res = await replay(srv.url, srv.model_name, items, concurrency=3, timeout_s=30)
    assert (res.completed, res.timed_out, res.errors) == (6, 0, 0)
    assert res.completion_tokens == 6 * 8  # ignore_eos + max_tokens: exact output lengths
    assert res.prompt_tokens >= 6 * 64
    assert len(res.latencies) == 6 and res.wall_s > 0


async def test_replay_times_out_and_the_engine_aborts(enginesim_server) -> None:
    # At speed 1 a 500-token answer takes far longer than the 0.2 s client timeout.
    srv = await enginesim_server("tiny", speed=1)
    items = synthetic_items(2, prompt_tokens=32, output_tokens=500)
    res = await replay(srv.url, srv.model_name, items, concurrency=2, timeout_s=0.2)
    assert (res.completed, res.timed_out) == (0, 2)
    # The client's disconnect aborted the engine's requests and freed their blocks.
    for _ in range(200):
        if srv.core.stats().blocks_in_use == 0:
            break
        await asyncio.sleep(0.01)
    assert srv.core.stats().blocks_in_use == 0


async def test_replay_retries_shed_answers_after_retry_after() -> None:
    """A server that sheds the first two attempts with retry-after-ms: the client waits
    and retries until it succeeds, and counts the retries."""
    calls = 0

    async def handler(request: web.Request) -> web.Response:
        nonlocal calls
        calls += 1
        if calls <= 2:
            return web.json_response(
                {"error": {"message": "busy", "type": "overloaded", "param": None, "code": None}},
                status=503,
                headers={"Retry-After": "1", "retry-after-ms": "20"},
            )
        return web.json_response({"usage": {"prompt_tokens": 5, "completion_tokens": 2}})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        items = synthetic_items(1, prompt_tokens=8, output_tokens=2)
        res = await replay(
            f"http://127.0.0.1:{port}", "m", items, concurrency=1, timeout_s=5, retry_shed=True
        )
    finally:
        await runner.cleanup()
    assert (res.completed, res.shed_retries, calls) == (1, 2, 3)
    assert abs(res.retry_wait_s - 0.04) < 1e-9
