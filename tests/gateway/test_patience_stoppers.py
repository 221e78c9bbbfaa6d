"""Clients that stop reading a stream once they have what they want (a user pressing
stop, an agent that read enough) through the live gateway: they share a population with
patient streaming clients that state no timeout, and their departures must not teach
kvgate a whole-stream deadline that the patient clients' streams never meet (the chaos
bench, seed 1: 4,864 sheds against 683 completions for such a client)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import aiohttp
import pytest

from tests.gateway.conftest import MODEL
from tests.gateway.test_queue import body

STATED_NEVER = aiohttp.ClientTimeout(total=60.0)  # the clients' own, never sent


pytestmark = pytest.mark.slow


async def _stream(s: aiohttp.ClientSession, url: str, max_tokens: int, stop_after: int | None):
    """One streaming request: "ok", "stopped" (closed after `stop_after` events), or the
    HTTP status of an answer that was not a stream."""
    async with s.post(url, json=body(max_tokens, stream=True)) as r:
        if r.status != 200:
            await r.read()
            return str(r.status)
        events = 0
        async for line in r.content:
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            events += 1
            if stop_after is not None and events >= stop_after:
                return "stopped"  # leaving the block closes the connection
        return "ok"


async def test_clients_that_stop_reading_do_not_teach_patient_streams_a_deadline(replica, gateway):
    srv = await replica(speed=1.0)
    gw = await gateway(srv)
    url = gw.url + "/v1/chat/completions"
    outcomes: dict[str, Counter] = {"patient": Counter(), "stopper": Counter()}
    patient_done = asyncio.Event()

    async def patient(i: int) -> None:
        rng = random.Random(f"patient {i}")
        async with aiohttp.ClientSession(timeout=STATED_NEVER) as s:
            for _ in range(15):
                outcomes["patient"][await _stream(s, url, rng.randint(60, 160), None)] += 1
                await asyncio.sleep(rng.uniform(0.0, 0.05))
        patient_done.set()

    async def stopper(i: int) -> None:
        rng = random.Random(f"stopper {i}")
        async with aiohttp.ClientSession(timeout=STATED_NEVER) as s:
            while not patient_done.is_set():
                got = await _stream(s, url, rng.randint(60, 160), rng.randint(1, 6))
                outcomes["stopper"][got] += 1
                await asyncio.sleep(rng.uniform(0.0, 0.05))

    await asyncio.gather(*(patient(i) for i in range(3)), *(stopper(i) for i in range(3)))
    seen = (outcomes, [r for r in gw.report.patience_readings() if r.stream])
    # The stoppers did what they do (and were seen leaving), and taught nothing: the
    # patient clients were served, never shed, and the population keeps the default.
    assert outcomes["stopper"]["stopped"] >= 20, seen
    assert outcomes["patient"] == Counter({"ok": 45}), seen
    assert gw.report.patience("default", MODEL, True) is None, seen
