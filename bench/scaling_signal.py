"""The scaling signal on enginesim: does ``kvgate_model_desired_replicas`` say four when
demand doubles from what two replicas serve, within a minute, and fall back after?

Two simulated replicas (seed2-8b-16gb: an 8B model on a 16 GB card, each its own process) behind kvgate with the config a new user writes
(two replicas, nothing else). First the clients find what the two serve: a closed loop
of 64 clients for twice ``--calibrate`` seconds, its completions per second over the
second half X (kvgate is told
nothing of it). Then open-loop Poisson arrivals at X, 2X and X/2, each phase
``--phase`` seconds, while /metrics is scraped every 5 s. Clients: plain aiohttp, a
total timeout of 30 s they never state to kvgate, no retries; the same for every phase.

    .venv/bin/python bench/scaling_signal.py [--phase 60] [--calibrate 20] [--speed 25] [--profile seed2-8b-16gb]

Targets: at 2X the gauge reads 4 (or more) within 60 s of the doubling; at X it reads
about 2; at X/2 it falls back (1 or 2). Results: bench/results/scaling_signal.json and
Markdown on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from gateway.app import Gateway  # noqa: E402
from gateway.config import config_from_mapping  # noqa: E402

# Seed 001's shape: prompts of about 800 tokens, answers of 150.
BODY: dict[str, object] = {"prompt": "tell me a story " * 200, "max_tokens": 150}
CLIENT_TIMEOUT_S = 30.0
# Enough clients that kvgate queues and sheds: their completions are what the two serve.
CALIBRATION_CLIENTS = 64


async def one(s: aiohttp.ClientSession, url: str, outcomes: dict[str, int]) -> None:
    try:
        async with s.post(url + "/v1/completions", json=BODY) as r:
            await r.read()
            key = "ok" if r.status == 200 else str(r.status)
    except (TimeoutError, aiohttp.ClientError):
        key = "timeout_or_error"
    outcomes[key] = outcomes.get(key, 0) + 1


async def calibrate(s: aiohttp.ClientSession, url: str, seconds: float) -> float:
    """Completions per second of the closed loop over its second `seconds` (the first
    lets kvgate learn the replicas' limits, as a gateway in service has)."""
    outcomes: dict[str, int] = {}
    start = time.monotonic()
    end = start + 2 * seconds
    counted: list[float] = []

    async def client() -> None:
        while time.monotonic() < end:
            ok = outcomes.get("ok", 0)
            await one(s, url, outcomes)
            if outcomes.get("ok", 0) > ok and time.monotonic() - start >= seconds:
                counted.append(time.monotonic())

    await asyncio.gather(*(client() for _ in range(CALIBRATION_CLIENTS)))
    return len([t for t in counted if t <= end]) / seconds


async def gauge(s: aiohttp.ClientSession, url: str) -> float | None:
    async with s.get(url + "/metrics") as r:
        for line in (await r.text()).splitlines():
            if (
                line.startswith("kvgate_model_desired_replicas{")
                and f'model="{BODY["model"]}"' in line
            ):
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(i: int, port: int, speed: float, profile: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "enginesim", "serve", "--profile", profile, "--host"]
    cmd += ["127.0.0.1", "--port", str(port), "--speed", str(speed), "--seed", str(i)]
    return subprocess.Popen([*cmd, "--log-level", "warning"], cwd=ROOT)


async def start_replicas(
    n: int, speed: float, profile: str
) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    """`n` enginesim processes (not in kvgate's process: the simulator's CPU is its own)."""
    procs, urls = [], []
    for i in range(n):
        port = free_port()
        procs.append(launch(i, port, speed, profile))
        urls.append(f"http://127.0.0.1:{port}")
    async with aiohttp.ClientSession() as s:
        for url in urls:
            for _ in range(200):
                try:
                    async with s.get(url + "/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
    return procs, urls


async def main(args: argparse.Namespace) -> dict:
    procs, urls = await start_replicas(2, args.speed, args.profile)
    config = config_from_mapping(
        {"replicas": [{"name": f"sim-{i}", "url": url} for i, url in enumerate(urls)]},
        env={},
    )
    gw = Gateway(config, host="127.0.0.1", port=0)
    await gw.start()
    BODY["model"] = sorted(gw.report.models())[0]  # what the replicas serve
    rng = random.Random(1)
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    conn = aiohttp.TCPConnector(limit=0)
    try:
        async with aiohttp.ClientSession(timeout=timeout, connector=conn) as s:
            x = await calibrate(s, gw.url, args.calibrate)
            print(f"calibrated: X = {x:.2f} req/s", file=sys.stderr, flush=True)
            phases = {}
            for name, factor in (("X", 1.0), ("2X", 2.0), ("X/2", 0.5)):
                phases[name] = await phase(s, gw.url, factor * x, args.phase, rng)
                print(f"{name}: {phases[name]}", file=sys.stderr, flush=True)
    finally:
        await gw.shutdown(0.0)
        for p in procs:
            p.terminate()
            p.wait(10)
    doubled = phases["2X"]["samples"]
    reached = next((t for t, v in doubled if v is not None and v >= 4), None)
    return {"served_by_two_rps": round(x, 2), "phases": phases, "four_after_s": reached}


def report(res: dict) -> str:
    out = [
        f"What two replicas serve (closed loop, {CALIBRATION_CLIENTS} clients): X = {res['served_by_two_rps']} req/s",
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
    p.add_argument("--speed", type=float, default=25.0)
    p.add_argument("--profile", default="seed2-8b-16gb")
    a = p.parse_args()
    result = asyncio.run(main(a))
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / "scaling_signal.json").write_text(json.dumps(result, indent=2))
    print(report(result))
