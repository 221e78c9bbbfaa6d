"""Two and three real ``kvgate serve`` processes on one Redis share ONE real ``enginesim
serve`` replica (its pool discovered from the engine, nothing pinned) under a load that
drives the engine's KV usage past 50% (issue 19).

The engine's KV usage is the whole fleet's: a process that read the others' load as
foreign would cut its view of the pool (to about half with two) and its queue would wait
while the pool had room. Sampled every 50 ms from each process's ``/admin/state`` and the
engine's ``/metrics`` while the load runs:

- no process's view of the pool falls below 90% of the pool the engine reports;
- no process whose queue's next request fits in the pool's free room (the pool less what
  the whole fleet reserves) is held by a slice below an equal split for longer than 3 s
  (a slice follows demand at the next renewal, and what another process holds above its
  own grant frees as its requests end);
- the engine runs what the processes together admitted (never more than the fleet's
  running reservations, and on average close to them);
- everything completes, and nothing is reserved after.

On commit 9e53387 (the pool check before it counted the fleet) the first check fails: a
process's view fell to 2,759 (two processes) and 1,840 (three) of 3,891; with the engine's
clock at a fifth of wall time (half the suite time of a tenth), to 2,593 and 1,986.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate_demo.demo import Process, start_replica, wait_http
from tests.state.cluster import (
    MODEL,
    Node,
    admin_state,
    all_see,
    config,
    start_all,
    states_when,
    stop,
)

# Real `kvgate serve` and `enginesim serve` processes under a load of over ten seconds.
pytestmark = pytest.mark.slow

SPEED = 0.2  # the engine's clock at a fifth of wall time: a request lasts over half a second
# Three-letter words: about one token per four characters, as kvgate's estimate assumes.
WORDS = "sea oar bow net sun fog map jib gun tar keg ale".split()


def body(rng: random.Random) -> dict[str, Any]:
    """A prompt of its own (no prefix another request's blocks could share)."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(850))
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 48,
        "ignore_eos": True,
    }


STARVED_FOR_S = 3.0  # a dozen renewals, a few requests' service


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[Process]:
    proc = start_replica("tiny", SPEED, log=tmp_path / "engine.log")
    try:
        await wait_http(proc.url + "/health", proc=proc)
        yield proc
    finally:
        proc.stop()


async def engine_gauges(s: aiohttp.ClientSession, url: str) -> tuple[float, float, float]:
    """(KV usage in [0, 1], requests running, requests waiting) from the engine's /metrics."""
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    got: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            got[smp.name] = got.get(smp.name, 0.0) + smp.value
    return (
        got.get("vllm:kv_cache_usage_perc", 0.0),
        got.get("vllm:num_requests_running", 0.0),
        got.get("vllm:num_requests_waiting", 0.0),
    )


@dataclass
class Sampler:
    engine_url: str
    nodes: list[Node]
    samples: list[tuple[float, tuple[float, float, float], list[dict[str, Any]]]] = field(
        default_factory=list
    )

    async def run(self, s: aiohttp.ClientSession) -> None:
        loop = asyncio.get_running_loop()
        while True:
            with contextlib.suppress(aiohttp.ClientError, KeyError):
                gauges = await engine_gauges(s, self.engine_url)
                views = [(await admin_state(s, n))["replicas"]["r0"] for n in self.nodes]
                self.samples.append((loop.time(), gauges, views))
            await asyncio.sleep(0.05)


async def load(s: aiohttp.ClientSession, node: Node, count: int, statuses: list[int]) -> None:
    """One closed-loop client: `count` requests, each retried after a shed as told."""
    rng = random.Random(f"{node.url} {len(statuses)} {id(statuses)}")
    for _ in range(count):
        req = body(rng)
        for _attempt in range(200):
            async with s.post(node.url + "/v1/chat/completions", json=req) as r:
                await r.read()
                if r.status in (429, 503):
                    await asyncio.sleep(min(2.0, float(r.headers.get("retry-after-ms", 500)) / 1e3))
                    continue
                statuses.append(r.status)
                break


@pytest.mark.parametrize("processes", [2, 3])
async def test_processes_sharing_one_engine_keep_its_whole_pool(
    tmp_path: Path, redis_url: str, prefix: str, engine: Process, processes: int
) -> None:
    cfg = config(redis_url, prefix, [{"name": "r0", "url": engine.url}])
    cfg["admission"] = {"queue_timeout_s": 30.0, "learn_limit": False}
    nodes = await start_all(tmp_path, cfg, [f"gw{i}" for i in range(processes)])
    statuses: list[int] = []
    try:
        async with aiohttp.ClientSession() as s:
            await states_when(s, nodes, all_see(processes), f"not every process sees {processes}")
            states = [await admin_state(s, n) for n in nodes]
            pool = max(st["replicas"]["r0"]["effective_tokens"] for st in states)
            sampler = Sampler(engine.url, nodes)
            watch = asyncio.get_running_loop().create_task(sampler.run(s))
            clients, each = 12, 3  # 12 clients per process (over twice what its slice runs), 3 each
            try:
                async with asyncio.timeout(80):
                    await asyncio.gather(
                        *(load(s, n, each, statuses) for n in nodes for _ in range(clients))
                    )
            finally:
                watch.cancel()
            states = [await admin_state(s, n) for n in nodes]
    finally:
        await asyncio.gather(*(stop(n) for n in nodes))  # all at once: each drains

    assert statuses == [200] * (processes * clients * each), statuses
    assert all(st["replicas"]["r0"]["reserved_tokens"] == 0 for st in states), states
    samples = sampler.samples
    assert len(samples) > 20
    assert max(g[0] for _, g, _ in samples) > 0.5, "the load never filled half the pool"

    # 1. Every process keeps the whole pool in view (the engine's usage is the fleet's).
    lowest = min(v["effective_tokens"] for _, _, views in samples for v in views)
    assert lowest >= 0.9 * pool, f"a process's view of the pool fell to {lowest} of {pool}"

    # 2. No slice starves a queue while the pool has room for its next request.
    for i in range(processes):
        since: float | None = None
        for t, _, views in samples:
            v = views[i]
            fleet_reserved = sum(w["reserved_tokens"] for w in views)
            head = v["queued_tokens"] / v["queued"] if v["queued"] else 0
            share = v["share_tokens"] if v["share_tokens"] is not None else pool
            starved = (
                head > 0
                and fleet_reserved + head <= v["effective_tokens"]
                and v["reserved_tokens"] + head > share
                and share < v["effective_tokens"] // processes - 64  # below an equal split
            )
            if not starved:
                since = None
            elif since is None:
                since = t
            else:
                assert t - since <= STARVED_FOR_S, (
                    f"process {i}'s slice ({share}) held its queue (next {head:.0f} tokens) "
                    f"for {t - since:.1f} s while the fleet reserved {fleet_reserved} of "
                    f"{v['effective_tokens']}"
                )

    # 3. The engine runs what the fleet admitted: never more, and on average close to it.
    admitted = [sum(v["running"] for v in views) for _, _, views in samples]
    running = [g[1] for _, g, _ in samples]
    assert max(running) <= max(admitted), (max(running), max(admitted))
    busy = [(e, a) for e, a in zip(running, admitted, strict=True) if a > 0]
    assert busy
    ratio = sum(e for e, _ in busy) / sum(a for _, a in busy)
    assert 0.8 <= ratio <= 1.05, f"engine ran {ratio:.2f}x what the processes admitted"
