"""What a vLLM engine itself runs during a bench: its running gauge and KV usage, read
from its /metrics while the clients work (bench/real_vllm.py, bench/pool_bound.py). An API
server starved of CPU answers a scrape only once its answers are done
(scripts/REAL_ENGINE_NOTES.md), and the mean then reads near 0 (seen beside a CI run:
0.27 where the quiet machine gave 3.2-3.5): quote it from a quiet machine."""

from __future__ import annotations

import asyncio
import statistics
from typing import Any

import aiohttp

from routing.adapters._common import parse_prometheus, total

_RUNNING, _USAGE = "vllm:num_requests_running", "vllm:kv_cache_usage_perc"
_READ = frozenset((_RUNNING, _USAGE))  # parsed alone: the scrape shares the engine's cores


async def watch_engine(url: str, held: list[tuple[float, float]], every_s: float) -> None:
    """Read the engine's own gauges every `every_s` until cancelled: the requests it
    runs and its KV usage. What a gateway counts as running includes requests on their
    way to the engine and answers on their way back; this is what the engine had."""
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(url + "/metrics") as r:
                    samples = parse_prometheus(await r.text(), _READ)
                if samples is not None:
                    running = total(samples, _RUNNING) or 0.0
                    usage = total(samples, _USAGE) or 0.0
                    held.append((running, usage))
            except aiohttp.ClientError:
                pass  # a missed reading; the next one counts
            await asyncio.sleep(every_s)


def engine_fed(held: list[tuple[float, float]]) -> dict[str, Any]:
    """The engine's mean running requests and KV usage over the run's readings."""
    if not held:
        return {}
    return {
        "engine_mean_running": round(statistics.fmean(r for r, _ in held), 2),
        "engine_mean_kv_usage": round(statistics.fmean(u for _, u in held), 3),
    }
