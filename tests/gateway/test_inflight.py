"""The requests in flight (gateway/shutdown.py): the count and the idle event follow
every request that starts and ends, a cut reaches each running request once, and a cut
request that has not started its stream is answered 503 ``shutting_down``. The whole
shutdown over real HTTP is tests/gateway/test_shutdown.py."""

from __future__ import annotations

import asyncio
import json

from gateway.config import config_from_mapping
from gateway.context import RequestContext
from gateway.outcome import SHUTDOWN_CUT
from gateway.shutdown import InFlight

CONFIG = config_from_mapping(
    {"replicas": [{"name": "r0", "url": "http://127.0.0.1:9"}], "admission": {}}, env={}
)


def ctx(n: int) -> RequestContext:
    return RequestContext(
        request_id=f"kvg-test-{n}", kind="chat", upstream_path="/v1/chat/completions", arrival=0.0
    )


async def _request(flight: InFlight, c: RequestContext, go: asyncio.Event) -> str:
    task = flight.enter(c)
    try:
        await go.wait()
        return "done"
    except asyncio.CancelledError:
        return "cut" if c.cut else "cancelled"
    finally:
        flight.leave(task)


async def test_idle_is_set_exactly_while_nothing_is_in_flight():
    flight = InFlight(CONFIG)
    assert flight.idle.is_set() and flight.count == 0
    go = asyncio.Event()
    tasks = [asyncio.create_task(_request(flight, ctx(i), go)) for i in range(3)]
    await asyncio.sleep(0)  # let each task start and enter
    assert flight.count == 3 and not flight.idle.is_set()
    go.set()
    assert await asyncio.gather(*tasks) == ["done"] * 3
    assert flight.count == 0 and flight.idle.is_set()


async def test_a_cut_reaches_each_running_request_once():
    flight = InFlight(CONFIG)
    go = asyncio.Event()
    contexts = [ctx(i) for i in range(3)]
    tasks = [asyncio.create_task(_request(flight, c, go)) for c in contexts]
    await asyncio.sleep(0)
    assert flight.cut_running() == 3
    assert flight.cut_running() == 0  # already cut: not cancelled a second time
    assert await asyncio.gather(*tasks) == ["cut"] * 3
    assert all(c.cut for c in contexts)
    assert flight.idle.is_set() and flight.cut_running() == 0


async def test_a_cut_request_without_a_started_stream_gets_the_shutdown_503():
    flight = InFlight(CONFIG)
    c = ctx(1)
    resp = await flight.cut_answer(c)
    assert (c.status, c.outcome) == (503, SHUTDOWN_CUT)
    assert resp.status == 503
    assert int(resp.headers["Retry-After"]) >= 1
    assert resp.headers["x-request-id"] == "kvg-test-1"
    err = json.loads(resp.body)["error"]
    assert err["code"] == "shutting_down"
