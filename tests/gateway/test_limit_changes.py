"""An operator sees what the admission rule lets a replica run and what binds it: each
change of the count is logged (`kvgate.limit`) and listed in `/admin/replicas`
(`limit_changes`); and a preemption corrects the replica's pool, not a count."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from tests.gateway.conftest import MODEL, wait_for

ADMIN = "admin-secret"


def stream(i: int) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"{i} " + "word " * 450}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }


async def replicas(s: aiohttp.ClientSession, url: str) -> dict:
    async with s.get(url + "/admin/replicas", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
        (shown,) = (await r.json())["replicas"]
    return shown


async def test_a_preemption_corrects_the_pool_not_a_count(replica, gateway):
    # The pool pinned four times what the engine has: 16 streams of ~850 tokens overrun
    # its 4,096, the engine preempts, and the next round takes the pool as what kvgate
    # had reserved there at most (less the headroom): the pool view was wrong.
    srv = await replica(speed=5.0)
    gw = await gateway(srv, pool_tokens=4 * 4096, auth={"admin_token": ADMIN})

    async def one(s: aiohttp.ClientSession, i: int) -> None:
        async with s.post(gw.url + "/v1/chat/completions", json=stream(i)) as r:
            await r.read()

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(one(s, i) for i in range(16)))
        assert srv.core.stats().num_preemptions > 0

        async def corrected() -> bool:
            return (await replicas(s, gw.url))["effective_capacity_tokens"] < 4 * 4096

        for _ in range(50):
            if await corrected():
                break
            await asyncio.sleep(0.1)
        shown = await replicas(s, gw.url)
    assert shown["effective_capacity_tokens"] < 4 * 4096, shown
    # No count was cut: only the pool bounds the replica.
    assert (shown["limit"], shown["limit_reason"]) == (None, "kv")
    assert gw.report.reserved_tokens() == 0


async def test_what_binds_is_logged_and_listed(replica, gateway, caplog):
    caplog.set_level(logging.INFO, logger="kvgate.limit")
    gw = await gateway(await replica(), max_running=3, auth={"admin_token": ADMIN})
    logged = lambda: [r for r in caplog.records if r.name == "kvgate.limit"]  # noqa: E731
    assert await wait_for(lambda: len(logged()) == 1, within=5.0)
    async with aiohttp.ClientSession() as s:
        shown = await replicas(s, gw.url)
    assert (shown["limit"], shown["limit_reason"]) == (3, "cap")
    (change,) = shown["limit_changes"]
    assert (change["limit_before"], change["limit_after"], change["reason"]) == (None, 3, "cap")
    assert change["at"].endswith("Z")
    (line,) = logged()
    assert line.levelno == logging.INFO and line.fields["replica"] == "r0"  # type: ignore[attr-defined]
    assert line.getMessage().startswith("replica r0: limit pool -> 3 (cap)")
