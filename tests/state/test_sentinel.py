"""Redis Sentinel fails the primary over under load: three real ``kvgate serve`` processes
configured with the sentinels (``state.redis_sentinel``), not the primary's address, in
front of one enginesim replica. The primary is SIGKILLed mid-load; the sentinels (real
``redis-server --sentinel`` processes, quorum 2 of 3) promote its replica. No request
fails, the engine never runs more than its cap, each process finds the new primary on
its own and re-registers its leases there, one record each, within the pool."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from tests.gateway.conftest import wait_for
from tests.state.cluster import Load, Node, Sampler, admin_state, config, start_all
from tests.state.conftest import RedisServer
from tests.state.test_processes import (
    CAP,
    EFFECTIVE,
    Watch,
    nodes,
    re_registered,
    replica,
    replicas,
    settled,
)

pytestmark = pytest.mark.slow

__all__ = ["nodes", "replica"]  # fixtures this module takes from test_processes

MASTER = "kvgate-test"


class Sentinels:
    """A primary, its replica and three sentinels watching it, all stopped by PID."""

    def __init__(self, folder: Path) -> None:
        self.primary = RedisServer()
        # A replica's full sync goes through an RDB file in its --dir: the test's folder.
        self.replica = RedisServer(
            args=["--replicaof", "127.0.0.1", str(self.primary.port), "--dir", str(folder)]
        )
        self.sentinels = []
        for i in range(3):
            conf = folder / f"sentinel{i}.conf"  # a sentinel rewrites its file as it learns
            conf.write_text(
                f"sentinel monitor {MASTER} 127.0.0.1 {self.primary.port} 2\n"
                # Down after a second without an answer; a failover may take four.
                f"sentinel down-after-milliseconds {MASTER} 1000\n"
                f"sentinel failover-timeout {MASTER} 4000\n"
            )
            self.sentinels.append(RedisServer(args=["--sentinel"], conf=conf))

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{s.port}" for s in self.sentinels]

    async def start(self) -> None:
        self.primary.start()
        self.replica.start()
        assert await wait_for(self._replicating, within=10, step=0.1)
        for s in self.sentinels:
            s.start()
        # Each sentinel knows the replica and the two others: a failover can be agreed.
        assert await self._until_all_see(within=15.0)

    def _replicating(self) -> bool:
        import redis

        info = redis.Redis(port=self.replica.port).info("replication")
        return info.get("master_link_status") == "up"

    async def _until_all_see(self, within: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while loop.time() < deadline:
            ready = 0
            for s in self.sentinels:
                r = aioredis.Redis(port=s.port, decode_responses=True)
                try:
                    others = await r.execute_command("SENTINEL", "SENTINELS", MASTER)
                    replicas_seen = await r.execute_command("SENTINEL", "REPLICAS", MASTER)
                finally:
                    await r.aclose()
                ready += len(others) == 2 and len(replicas_seen) == 1
            if ready == len(self.sentinels):
                return True
            await asyncio.sleep(0.2)
        return False

    async def primary_port(self) -> int:
        r = aioredis.Redis(port=self.sentinels[0].port, decode_responses=True)
        try:
            _, port = await r.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER)
        finally:
            await r.aclose()
        return int(port)

    def stop(self) -> None:
        for s in [*self.sentinels, self.replica, self.primary]:
            s.stop()


class Reserved(Sampler):
    """Samples what the processes hold reserved on r0, summed, until stopped."""

    def __init__(self, s: aiohttp.ClientSession, nodes: list[Node]) -> None:
        self.s, self.nodes = s, nodes
        self.max_sum = 0
        self.samples = 0

    async def _run(self) -> None:
        while True:
            states = [await admin_state(self.s, n) for n in self.nodes]
            held = sum(st["replicas"]["r0"]["reserved_tokens"] for st in states)
            self.max_sum = max(self.max_sum, held)
            self.samples += 1
            await asyncio.sleep(0.01)


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[Sentinels]:
    rig = Sentinels(tmp_path)
    try:
        yield rig
    finally:
        rig.stop()


async def test_a_primary_killed_under_load_fails_over_and_nothing_is_lost(
    tmp_path: Path, prefix: str, replica: Any, sentinels: Sentinels, nodes: list[Node]
) -> None:
    await sentinels.start()
    sentinel = {"addresses": sentinels.addresses, "master": MASTER}
    cfg = config(None, prefix, replicas(replica), redis_sentinel=sentinel)
    nodes += await start_all(tmp_path, cfg, ["gw0", "gw1", "gw2"])
    load = Load()
    async with aiohttp.ClientSession() as s:
        reserved = Reserved(s, nodes)
        with Watch(replica, None) as w, reserved:
            clients = [asyncio.create_task(load.client(s, nodes[i % 3], 20)) for i in range(12)]
            assert await wait_for(lambda: load.statuses.get(200, 0) >= 20, within=30)
            sentinels.primary.kill()
            promoted = sentinels.replica.port
            for _ in range(300):
                if await sentinels.primary_port() == promoted:
                    break
                await asyncio.sleep(0.05)
            assert await sentinels.primary_port() == promoted
            during = load.statuses.get(200, 0)
            await asyncio.gather(*clients)
            assert load.statuses.get(200, 0) > during  # served on after the failover
        assert w.max_engine_running <= CAP
        # What the three admitted together, as their own reports say (the lease records
        # overstate it while a rebuild's slices are cut below what the records grant).
        assert reserved.samples > 50 and 0 < reserved.max_sum <= EFFECTIVE
        assert not load.errors
        assert all(code in (200, 503) for code in load.statuses), load.statuses
        assert load.statuses.get(200, 0) >= 200
        await settled(s, nodes, replica)
        # Every process renews on the promoted primary: one record each, within the pool.
        await re_registered(s, nodes, f"redis://127.0.0.1:{promoted}/0", prefix)
        for n in nodes:  # each saw the primary go, and found the new one on its own
            text = n.log.read_text()
            assert "unreachable" in text or "had lost" in text, text[-2000:]
