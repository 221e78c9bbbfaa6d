"""When a client left (gateway/http.py, `connection_lost_at`): the instant the transport
saw its connection lost, not when its handler got round to the loss. A busy loop runs a
load generator's 32 cancelled handlers over tens of milliseconds; timed by them, one
close looked like clients leaving one by one and taught a patience
(admission/learned/patience.py, docs/benchmarks-cost.md)."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from gateway.accounting import patience_seen
from gateway.config import LimitsConfig
from gateway.http import connection_lost_at, install
from gateway.outcome import OK
from tests.gateway.conftest import left_ctx, wait_for


async def test_a_lost_connection_is_timed_when_the_transport_saw_it() -> None:
    entered = asyncio.Event()
    seen: dict[str, float | None] = {}

    async def hold(request: web.Request) -> web.Response:
        entered.set()
        seen["before"] = connection_lost_at(request)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen["lost_at"] = connection_lost_at(request)
            seen["noticed"] = asyncio.get_running_loop().time()
            raise
        return web.Response()

    app = web.Application()
    app.router.add_post("/", hold)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    install(runner, LimitsConfig())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        await entered.wait()
        closed = asyncio.get_running_loop().time()
        writer.close()
        assert await wait_for(lambda: "noticed" in seen)
    finally:
        await runner.cleanup()
    lost_at, noticed = seen["lost_at"], seen["noticed"]
    assert seen["before"] is None  # open: not lost
    assert lost_at is not None and noticed is not None
    assert closed <= lost_at <= noticed


def test_a_client_that_left_waited_until_its_connection_was_lost() -> None:
    # Lost at 10.02; its handler ended at 10.09, behind the loop's other work.
    end = patience_seen(left_ctx(10.0, left_at=10.02), 10.09)
    assert end is not None and end.left
    assert end.waited_s == pytest.approx(0.02) and end.left_at == 10.02
    # A stream's quiet stretch ends there too.
    ctx = left_ctx(
        10.0, stream=True, left_at=10.02, first_byte_at=10.005, last_event_at=10.01, events=3
    )
    stream = patience_seen(ctx, 10.09)
    assert stream is not None and stream.quiet_s == pytest.approx(0.01)
    assert stream.waited_s == pytest.approx(0.02) and stream.left_at == 10.02
    # Not seen lost (a handler that ended otherwise): timed when it ended, as before.
    assert patience_seen(left_ctx(10.0), 10.09).left_at is None  # type: ignore[union-attr]
    # A client that stayed is timed at its end, whatever its connection did later.
    stayed = patience_seen(left_ctx(10.0, left_at=10.5, outcome=OK), 10.09)
    assert stayed is not None and not stayed.left and stayed.left_at is None
    assert stayed.waited_s == pytest.approx(0.09)
