"""The scaling signal on enginesim: does ``kvgate_model_desired_replicas`` say four when
demand doubles from what two replicas serve, within a minute, and fall back after?

Two simulated replicas (tiny profile) behind kvgate with the config a new user writes
(two replicas, nothing else). First the clients find what the two serve: a closed loop
of 48 clients for ``--calibrate`` seconds, its completions per second X (kvgate is told
nothing of it). Then open-loop Poisson arrivals at X, 2X and X/2, each phase
``--phase`` seconds, while /metrics is scraped every 5 s. Clients: plain aiohttp, a
total timeout of 30 s they never state to kvgate, no retries; the same for every phase.

    .venv/bin/python bench/scaling_signal.py [--phase 60] [--calibrate 20] [--speed 10]

Targets: at 2X the gauge reads 4 (or more) within 60 s of the doubling; at X it reads
about 2; at X/2 it falls back (1 or 2). Results: bench/results/scaling_signal.json and
Markdown on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from enginesim.server import EngineServer  # noqa: E402
from gateway.app import Gateway  # noqa: E402
from gateway.config import config_from_mapping  # noqa: E402

MODEL = "tiny-llm"
BODY = {"model": MODEL, "prompt": "tell me a story " * 12, "max_tokens": 48}
CLIENT_TIMEOUT_S = 30.0


async def one(s: aiohttp.ClientSession, url: str, outcomes: dict[str, int]) -> None:
    try:
        async with s.post(url + "/v1/completions", json=BODY) as r:
            await r.read()
            key = "ok" if r.status == 200 else str(r.status)
    except (TimeoutError, aiohttp.ClientError):
        key = "timeout_or_error"
    outcomes[key] = outcomes.get(key, 0) + 1


async def calibrate(s: aiohttp.ClientSession, url: str, seconds: float) -> float:
    outcomes: dict[str, int] = {}
    end = time.monotonic() + seconds

    async def client() -> None:
        while time.monotonic() < end:
            await one(s, url, outcomes)

    start = time.monotonic()
    await asyncio.gather(*(client() for _ in range(48)))
    return outcomes.get("ok", 0) / (time.monotonic() - start)


async def gauge(s: aiohttp.ClientSession, url: str) -> float | None:
    async with s.get(url + "/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith("kvgate_model_desired_replicas{") and f'model="{MODEL}"' in line:
                return float(line.rsplit(" ", 1)[1])
    return None


async def phase(
    s: aiohttp.ClientSession, url: str, rate: float, seconds: float, rng: random.Random
) -> dict:
    outcomes: dict[str, int] = {}
    samples: list[tuple[float, float | None]] = []
    start = time.monotonic()
    tasks: set[asyncio.Task[None]] = set()

    async def scrape() -> None:
        while time.monotonic() - start < seconds:
            await asyncio.sleep(5.0)
            samples.append((round(time.monotonic() - start, 1), await gauge(s, url)))

    scraper = asyncio.create_task(scrape())
    t = start
    while t - start < seconds:
        t += rng.expovariate(rate)
        await asyncio.sleep(max(0.0, t - time.monotonic()))
        task = asyncio.create_task(one(s, url, outcomes))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await scraper
    await asyncio.gather(*tasks)
    return {"rate": round(rate, 2), "samples": samples, "outcomes": outcomes}


async def main(args: argparse.Namespace) -> dict:
    servers = [EngineServer("tiny", speed=args.speed, seed=i) for i in range(2)]
    for srv in servers:
        await srv.start()
    config = config_from_mapping(
        {"replicas": [{"name": f"sim-{i}", "url": srv.url} for i, srv in enumerate(servers)]},
        env={},
    )
    gw = Gateway(config, host="127.0.0.1", port=0)
    await gw.start()
    rng = random.Random(1)
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    conn = aiohttp.TCPConnector(limit=0)
    try:
        async with aiohttp.ClientSession(timeout=timeout, connector=conn) as s:
            x = await calibrate(s, gw.url, args.calibrate)
            phases = {}
            for name, factor in (("X", 1.0), ("2X", 2.0), ("X/2", 0.5)):
                phases[name] = await phase(s, gw.url, factor * x, args.phase, rng)
    finally:
        await gw.shutdown(0.0)
        for srv in servers:
            await srv.stop()
    doubled = phases["2X"]["samples"]
    reached = next((t for t, v in doubled if v is not None and v >= 4), None)
    return {"served_by_two_rps": round(x, 2), "phases": phases, "four_after_s": reached}


def report(res: dict) -> str:
    out = [
        f"What two replicas serve (closed loop, 48 clients): X = {res['served_by_two_rps']} req/s",
        "",
        "| phase | offered req/s | gauge samples (every 5 s) | median | outcomes |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, p in res["phases"].items():
        values = [v for _, v in p["samples"] if v is not None]
        med = statistics.median(values) if values else None
        out.append(
            f"| {name} | {p['rate']} | {' '.join(str(int(v)) for v in values)} | {med} | "
            f"{p['outcomes']} |"
        )
    four = res["four_after_s"]
    out.append("")
    out.append(
        f"2X: the gauge first read 4 or more {four} s after the doubling (target: within 60 s)"
        if four is not None
        else "2X: the gauge never read 4 (target missed)"
    )
    return "\n".join(out)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--phase", type=float, default=60.0)
    p.add_argument("--calibrate", type=float, default=20.0)
    p.add_argument("--speed", type=float, default=10.0)
    a = p.parse_args()
    result = asyncio.run(main(a))
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / "scaling_signal.json").write_text(json.dumps(result, indent=2))
    print(report(result))
