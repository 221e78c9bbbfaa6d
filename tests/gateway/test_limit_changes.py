"""An operator sees why a learned limit moved: each change of the allowed count is logged
(`kvgate.limit`, with its evidence) and listed in `/admin/replicas` (`limit_changes`)."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest

from tests.gateway.conftest import MODEL, wait_for

ADMIN = "admin-secret"


pytestmark = pytest.mark.slow


def stream(i: int) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"{i} " + "word " * 450}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }


async def test_a_preemption_cut_is_logged_and_listed_with_its_evidence(replica, gateway, caplog):
    # The pool pinned four times what the engine has and 16 allowed at once: 16 streams of
    # ~850 tokens overrun its 4,096, the engine preempts, and the next round cuts the limit.
    srv = await replica(speed=5.0)
    gw = await gateway(
        srv,
        pool_tokens=4 * 4096,
        admission={"initial_limit": 16},
        auth={"admin_token": ADMIN},
    )
    caplog.set_level(logging.INFO, logger="kvgate.limit")

    async def one(s: aiohttp.ClientSession, i: int) -> None:
        async with s.post(gw.url + "/v1/chat/completions", json=stream(i)) as r:
            await r.read()

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(one(s, i) for i in range(16)))
        assert srv.core.stats().num_preemptions > 0
        logged = lambda: [r for r in caplog.records if r.name == "kvgate.limit"]  # noqa: E731
        history = gw.report.limit_of("r0").history  # type: ignore[union-attr]
        # Logged at the discovery round after each change: wait until every cut is.
        cuts = lambda: [c for c in history.changes if c.reason != "slow_start"]  # noqa: E731
        assert await wait_for(lambda: 0 < len(cuts()) == len(logged()), within=5.0)
        async with s.get(
            gw.url + "/admin/replicas", headers={"Authorization": f"Bearer {ADMIN}"}
        ) as r:
            (shown,) = (await r.json())["replicas"]
    changes = [c for c in shown["limit_changes"] if c["reason"] != "slow_start"]
    cut = changes[0]
    # The first cut: 75% of the most that ran since the round before, out of 16 allowed.
    assert cut["reason"] == "preemption", changes
    assert cut["limit_before"] >= 16 and cut["limit_after"] <= 12
    assert cut["running"] >= cut["limit_after"] and cut["at"].endswith("Z")
    assert "preemption" in {c["reason"] for c in changes}
    # One INFO line per change listed, in order, each with its evidence.
    lines = logged()
    assert [(r.fields["limit_before"], r.fields["limit_after"]) for r in lines] == [  # type: ignore[attr-defined]
        (c["limit_before"], c["limit_after"]) for c in changes
    ]
    assert all(r.levelno == logging.INFO and r.fields["replica"] == "r0" for r in lines)  # type: ignore[attr-defined]
    assert (
        lines[0]
        .getMessage()
        .startswith(
            f"replica r0: limit {cut['limit_before']} -> {cut['limit_after']} ({cut['reason']})"
        )
    )
    assert shown["limit"] == changes[-1]["limit_after"]
