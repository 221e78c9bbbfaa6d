"""vLLM data parallel through kvgate: one ledger per engine rank, requests pinned to it.

A stand-in for ``vllm serve --data-parallel-size 2`` on loopback: one URL, two engines of
960 tokens each. Its ``/metrics`` has vLLM's DP shape (every sample labelled
``engine="0"``/``"1"``, one ``vllm:cache_config_info`` per engine), and its completions
record the ``X-data-parallel-rank`` header (vLLM pins a request to that engine) and wait
until the test lets them finish.

With ``data_parallel_size: 2`` kvgate sees two replicas of 960 tokens. Two requests of
~610 tokens each go one to each rank, each carrying its rank's header; a third fits
neither rank and waits, although the two pools together (1,920) would have room: summed
into one pool, two such requests could land on one engine and overrun it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web

from tests.gateway.conftest import wait_for

M = "dp-model"
BLOCKS = 60  # x 16 = 960 tokens per engine


class FakeVLLMDataParallel:
    """A loopback stand-in for a vLLM server with two data-parallel engines."""

    def __init__(self, model: str = M, blocks: int = BLOCKS) -> None:
        self.model = model
        self.blocks = blocks
        self.ranks: list[str | None] = []
        self.running = {"0": 0, "1": 0}
        self.release = asyncio.Event()
        self.url = ""
        self._runner: web.AppRunner | None = None

    def metrics(self) -> str:
        lines = ["# TYPE vllm:num_requests_running gauge"]
        for e in ("0", "1"):
            lines.append(
                f'vllm:num_requests_running{{engine="{e}",model_name="{self.model}"}} {self.running[e]}'
            )
        lines.append("# TYPE vllm:num_requests_waiting gauge")
        for e in ("0", "1"):
            lines.append(f'vllm:num_requests_waiting{{engine="{e}",model_name="{self.model}"}} 0.0')
        lines.append("# TYPE vllm:kv_cache_usage_perc gauge")
        for e in ("0", "1"):
            lines.append(f'vllm:kv_cache_usage_perc{{engine="{e}",model_name="{self.model}"}} 0.0')
        lines.append("# TYPE vllm:cache_config_info gauge")
        for e in ("0", "1"):
            lines.append(
                f'vllm:cache_config_info{{block_size="16",cache_dtype="auto",engine="{e}",'
                f'gpu_memory_utilization="0.9",num_gpu_blocks="{self.blocks}",'
                f'enable_prefix_caching="True"}} 1.0'
            )
        return "\n".join(lines) + "\n"

    async def start(self) -> None:
        app = web.Application()

        async def metrics(_r: web.Request) -> web.Response:
            return web.Response(text=self.metrics(), content_type="text/plain")

        async def models(_r: web.Request) -> web.Response:
            return web.json_response(
                {
                    "object": "list",
                    "data": [{"id": self.model, "object": "model", "max_model_len": 2048}],
                }
            )

        async def chat(r: web.Request) -> web.Response:
            body = await r.json()
            rank = r.headers.get("X-data-parallel-rank")
            self.ranks.append(rank)
            engine = rank if rank in self.running else "0"
            self.running[engine] += 1
            try:
                await self.release.wait()
            finally:
                self.running[engine] -= 1
            return web.json_response(
                {
                    "id": "x",
                    "object": "chat.completion",
                    "created": 0,
                    "model": M,
                    "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": "ok"},
                         "finish_reason": "stop"}
                    ],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
                    "echo_max_tokens": body.get("max_tokens"),
                }
            )  # fmt: skip

        app.router.add_get("/metrics", metrics)
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/chat/completions", chat)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        self.release.set()
        if self._runner is not None:
            await self._runner.cleanup()


async def test_one_ledger_per_rank_and_requests_pinned(gateway):
    fake = FakeVLLMDataParallel()
    await fake.start()
    try:
        gw = await gateway(
            replicas=[{"name": "big", "url": fake.url, "data_parallel_size": 2}],
            admission={"queue_timeout_s": 30.0, "learn_limit": False},
        )
        usage = {u.name: u for u in gw.report.replica_usage()}
        assert set(usage) == {"big-dp0", "big-dp1"}
        # Each engine's pool less its null block.
        pool = (BLOCKS - 1) * 16
        assert usage["big-dp0"].capacity_tokens == pool == usage["big-dp1"].capacity_tokens
        body: dict[str, Any] = {
            "model": M,
            "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 600,
        }
        async with aiohttp.ClientSession() as s:
            first = [asyncio.ensure_future(s.post(gw.url + "/v1/chat/completions", json=body))
                     for _ in range(2)]  # fmt: skip
            assert await wait_for(lambda: len(fake.ranks) == 2, within=10.0)
            # One request on each rank, each pinned to the rank that reserved it.
            assert sorted(fake.ranks) == ["0", "1"]
            reserved = {u.name: u.reserved_tokens for u in gw.report.replica_usage()}
            assert all(v > 0 for v in reserved.values()), reserved
            # A third fits neither rank's ledger: it waits, though the summed pools could
            # hold it.
            third = asyncio.ensure_future(s.post(gw.url + "/v1/chat/completions", json=body))
            assert await wait_for(lambda: gw.report.queue_depth() == 1, within=10.0)
            assert len(fake.ranks) == 2
            fake.release.set()
            for fut in [*first, third]:
                r = await asyncio.wait_for(fut, 20.0)
                assert r.status == 200
                doc = json.loads(await r.read())
                assert doc["choices"][0]["message"]["content"] == "ok"
                r.release()
        assert len(fake.ranks) == 3 and fake.ranks[2] in ("0", "1")
    finally:
        await fake.stop()


async def test_a_dead_dp_server_takes_all_its_ranks_out_and_the_retry_goes_elsewhere(
    replica, gateway
):
    """The ranks share one URL: a refused connection on one rank marks every rank of
    that server down, so the retry goes to another server instead of a sibling rank."""
    from tests.gateway.conftest import MODEL

    fake = FakeVLLMDataParallel(model=MODEL, blocks=1000)  # 16,000 tokens a rank
    fake.release.set()
    await fake.start()
    srv = await replica()  # 4,096 tokens: the ranks have more headroom
    gw = await gateway(
        replicas=[
            {"name": "big", "url": fake.url, "data_parallel_size": 2},
            {"name": "small", "url": srv.url},
        ],
        discovery={"refresh_interval_s": 30.0},  # only the request path learns of it
    )
    await fake.stop()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    def ready() -> dict[str, bool]:
        return {u.name: u.ready for u in gw.report.replica_usage()}

    statuses = []
    async with aiohttp.ClientSession() as s:
        # The picker breaks ties at random: send until one request has met a dead rank
        # (two in three do).
        for _ in range(20):
            async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
                statuses.append(r.status)
                await r.read()
            if not all(ready().values()):
                break
    # Both ranks went down with the first refusal, and every request completed (a retry
    # never went to the sibling rank of the dead server).
    assert ready() == {"big-dp0": False, "big-dp1": False, "small": True}
    assert set(statuses) == {200}
    assert srv.core.stats().num_finished == len(statuses)
