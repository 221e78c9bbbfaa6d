"""Many gateway processes in front of many replicas, on real processes (issue 50 item 2):
bench/fleet_vt.py's cell, run by `kvgate serve` processes sharing one real Redis in front
of `enginesim serve` replicas on loopback.

The rig, all on this machine:

- ``--replicas`` simulated `seed2-8b-16gb` replicas (`enginesim serve --speed S`: the
  engine's clock runs S times the wall's);
- ``--gateways`` `kvgate serve` processes, each with the configuration a new user writes
  (the replicas, an admin token, and ``state.backend: redis`` on one private
  `redis-server`, the defaults otherwise: a 3 s lease renewed every 0.5 s), and, as the
  baseline, one process with the default in-process state that sees everything;
- the client, one asyncio process: seed 001's production-shaped requests
  (`enginesim.workloads.seed2_workload`, a new draw per ``--seed``) arriving open-loop
  (Poisson) at ``--load`` of the fleet's capacity, that capacity being one replica's
  best requests/s on these requests (found in the engine's own virtual time,
  `enginesim.simulate.run_closed_loop` at concurrency 4-24) times the replicas: the
  arrivals of the virtual-time cell (`bench.fleet_vt.Engines.arrivals`). Each
  request states its timeout as the openai SDKs do (``x-stainless-read-timeout``: 45
  of the engine's seconds, seed 001's client, in wall seconds) and is served or lost
  within it from its first arrival; a 429/503 is retried after its Retry-After, twice at
  most, while the timeout allows (the SDKs' ``max_retries=2``).

As in the virtual-time fleet, a load balancer spreads the arrivals over the gateways in
proportion to 1/(g+1), and the spread turns around halfway; gateway 0 is killed
(SIGKILL) at a third of the run and a new process takes its port 5 s later. A request
whose connection the kill broke, or that found the port closed, is sent again through
the balancer to a live gateway ("sent again"), with what is left of its timeout.

Reported per cell: goodput (served within the timeout, of those offered) and its ratio
to the one gateway on the same arrivals; requests lost; sent again; the latency of the
served from first arrival (p50, p90); the most any replica's pool was held past its
size in an atomic snapshot of its lease records in Redis (every 50 ms: the sum over
processes of the larger of what each was granted and what it used) and the engines'
preemptions; Redis round trips per second (the lease script's calls, from the server's
``INFO commandstats``) per gateway; the CPU each kind of process used (share of one
core), so a reader sees what the 2-core machine ran out of first.

    PYTHONPATH=. .venv/bin/python bench/fleet_real.py [--gateways 2 4 8] [--replicas 8] \\
        [--seconds 60] [--speed 5] [--load 0.8] [--seed 1]

Writes bench/results/fleet_real.json and prints a Markdown table. Every process this
starts is stopped by its PID.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.cpu_share import snapshot  # noqa: E402
from bench.fleet_vt import Engines, spread  # noqa: E402
from bench.shared_pool import start_redis  # noqa: E402
from enginesim.profiles import load_profile  # noqa: E402
from enginesim.workloads import WorkItem  # noqa: E402
from gateway.state.backend import StateUnavailable  # noqa: E402
from gateway.state.redis import RedisBackend  # noqa: E402
from kvgate_demo.demo import (  # noqa: E402
    DEFAULT_TIMEOUT_S,
    Process,
    engine_counter,
    free_port,
    start_replica,
    stopping,
    wait_http,
)
from loadtests.replay import _retry_after  # noqa: E402

PROFILE = "seed2-8b-16gb"
ADMIN = "bench-admin"
SDK_RETRIES = 2
RESTART_AFTER_S = 5.0
SNAPSHOT_S = 0.05
LEASE_SCRIPT_CALLS = ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_fcall")


@dataclass
class Arrival:
    at: float  # wall seconds from the start
    item: WorkItem


def config(replicas: list[str], redis_url: str | None, prefix: str, port: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": port},
        "replicas": [{"name": f"r{k}", "url": u, "engine": "vllm"} for k, u in enumerate(replicas)],
        "auth": {"admin_token": ADMIN},
        "logging": {"level": "warning", "access_log": False},
    }
    if redis_url is not None:
        cfg["state"] = {"backend": "redis", "redis_url": redis_url, "key_prefix": prefix}
    return cfg


def launch_gateway(cfg: dict[str, Any], workdir: Path, name: str) -> Process:
    path = workdir / f"{name}.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    popen = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path)],
        stdout=subprocess.DEVNULL,
        stderr=(workdir / f"{name}.log").open("ab"),
    )
    return Process(name, popen, f"http://127.0.0.1:{cfg['listen']['port']}")


def cpu_s(pid: int) -> float:
    """CPU seconds of a live process so far (bench/cpu_share.py reads /proc), 0 if gone."""
    return snapshot({"p": [pid]})["p"][0]


@dataclass
class Cell:
    gateways: int
    replicas: int
    offered: int = 0
    served: int = 0
    lost: int = 0
    lost_by: dict[str, int] = field(default_factory=dict)
    # The first lost requests: when each arrived and was lost (s into the run), why, its
    # attempts, and how often its gateway died under it.
    lost_detail: list[dict[str, Any]] = field(default_factory=list)
    sent_again: int = 0
    shed_retries: int = 0
    latency_p50_s: float = 0.0
    latency_p90_s: float = 0.0
    max_overcommit_tokens: int = 0
    snapshots: int = 0
    snapshot_calls: int = 0
    overcommits: list[dict[str, Any]] = field(default_factory=list)
    preemptions: float = 0.0
    round_trips_per_s: float = 0.0
    round_trips_per_gateway_s: float = 0.0
    cpu_gateways: float = 0.0
    cpu_replicas: float = 0.0
    cpu_redis: float = 0.0
    cpu_client: float = 0.0
    goodput: float = 0.0
    goodput_vs_one: float | None = None


class Balancer:
    """Which gateway a new connection goes to: 1/(g+1) by index, turned around at half
    time, among the ports that are open."""

    def __init__(self, urls: list[str], seconds: float, rng: random.Random) -> None:
        self.urls = urls
        self.down: set[int] = set()
        self.seconds = seconds
        self.rng = rng

    def pick(self, t: float) -> int:
        w = spread(len(self.urls), t, self.seconds)
        live = [g for g in range(len(self.urls)) if g not in self.down]
        return self.rng.choices(live, [w[g] for g in live])[0]


def _code(raw: bytes) -> str:
    """The error code of an OpenAI-shaped error body (what kvgate says shed it)."""
    try:
        return str(json.loads(raw)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "?"


async def one_request(
    s: aiohttp.ClientSession, bal: Balancer, a: Arrival, t0: float, timeout_s: float,
    model: str, cell: Cell, latencies: list[float],
) -> None:  # fmt: skip
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, t0 + a.at - loop.time()))
    deadline = t0 + a.at + timeout_s
    body = {
        "model": model,
        "messages": a.item.messages,
        "max_tokens": a.item.output_tokens,
        "ignore_eos": True,
    }
    attempt = resent = 0
    reason, g = "timeout", -1
    for _ in range(100):  # bounded: each pass is an attempt, a retry or a resend
        left = deadline - loop.time()
        if left <= 0:
            break
        g = bal.pick(loop.time() - t0)
        headers = {
            "x-stainless-read-timeout": f"{timeout_s:g}",
            "x-stainless-retry-count": str(attempt),
        }
        try:
            async with s.post(
                bal.urls[g] + "/v1/chat/completions",
                json=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=left),
            ) as r:
                raw = await r.read()
                if r.status == 200:
                    cell.served += 1
                    latencies.append(loop.time() - t0 - a.at)
                    return
                after = _retry_after(r.headers, 1.0) if r.status in (429, 503) else math.inf
                if attempt < SDK_RETRIES and loop.time() + after < deadline:
                    cell.shed_retries += 1
                    attempt += 1
                    await asyncio.sleep(after)
                    continue
                reason = f"{r.status} {_code(raw)}"
        except TimeoutError:
            reason = "timeout"
        except (aiohttp.ClientConnectionError, OSError):
            cell.sent_again += 1  # the gateway died under it: sent again through the balancer
            resent += 1
            await asyncio.sleep(0.05)
            continue
        break
    cell.lost += 1
    cell.lost_by[reason] = cell.lost_by.get(reason, 0) + 1
    if len(cell.lost_detail) < 20:
        cell.lost_detail.append(
            {
                "arrived_s": round(a.at, 3),
                "lost_s": round(loop.time() - t0, 3),
                "why": reason,
                "retries": attempt,
                "sent_again": resent,
                "gateway": g,
            }
        )


async def watch_pools(
    redis_url: str, prefix: str, pools: dict[str, int], cell: Cell, stop: asyncio.Event
) -> None:
    """Atomic snapshots of each replica's pool lease records: the most held past it."""
    b = RedisBackend(redis_url, prefix=prefix)
    try:
        while not stop.is_set():
            for rep, pool in pools.items():
                with contextlib.suppress(StateUnavailable):
                    cell.snapshot_calls += 1  # a script call of its own: not the gateways'
                    held = await b.holders(f"pool:{rep}")
                    over = sum(max(h.granted, h.used) for h in held.values()) - pool
                    cell.max_overcommit_tokens = max(cell.max_overcommit_tokens, over)
                    if over > 0 and len(cell.overcommits) < 5:  # what it was made of
                        records = {k: [h.granted, h.used] for k, h in held.items()}
                        cell.overcommits.append({"replica": rep, "over": over, "held": records})
            cell.snapshots += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), SNAPSHOT_S)
    finally:
        await b.close()


async def redis_calls(redis_url: str) -> int:
    b = RedisBackend(redis_url, prefix="bench")
    try:
        stats = await b._r.info("commandstats")  # noqa: SLF001 - a bench reading the server
    finally:
        await b.close()
    return sum(int(stats[k]["calls"]) for k in LEASE_SCRIPT_CALLS if k in stats)


async def pools_of(url: str) -> dict[str, int]:
    """Each replica's pool as the gateway sees it (its effective tokens)."""
    headers = {"Authorization": f"Bearer {ADMIN}"}
    async with aiohttp.ClientSession() as s:
        for _ in range(100):
            async with s.get(url + "/admin/state", headers=headers) as r:
                reps = (await r.json())["replicas"]
            pools = {k: v["effective_tokens"] for k, v in reps.items()}
            if all(pools.values()):
                return pools
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} never saw every replica's pool: {pools}")


async def run_cell(
    n_gw: int, replicas: list[Process], work: list[Arrival], args: argparse.Namespace,
    workdir: Path, redis: Process | None,
) -> Cell:  # fmt: skip
    cell = Cell(n_gw, len(replicas), offered=len(work))
    prefix = f"fleet-{n_gw}-{os.getpid()}-{time.monotonic_ns()}"
    ports = [free_port() for _ in range(n_gw)]
    urls = [r.url for r in replicas]
    redis_url = redis.url if redis is not None and n_gw > 1 else None
    cfgs = [config(urls, redis_url, prefix, p) for p in ports]
    gws = [launch_gateway(c, workdir, f"gw{n_gw}-{i}") for i, c in enumerate(cfgs)]
    timeout_s = DEFAULT_TIMEOUT_S / args.speed
    model = load_profile(PROFILE).served_model_name
    latencies: list[float] = []
    try:
        for g in gws:
            await wait_http(g.url + "/ready", proc=g)
        pools = await pools_of(gws[0].url) if redis_url else {}
        preempt0 = sum([await engine_counter(u, "vllm:num_preemptions") for u in urls])
        calls0 = await redis_calls(redis_url) if redis_url else 0
        pids = {"replicas": [r.popen.pid for r in replicas]}
        if redis is not None:
            pids["redis"] = [redis.popen.pid]
        cpu0 = {k: cpu for k, (cpu, _) in snapshot(pids).items()}
        gw_cpu = [cpu_s(g.popen.pid) for g in gws]
        client0 = time.process_time()
        stop = asyncio.Event()
        watch = (
            asyncio.create_task(watch_pools(redis_url, prefix, pools, cell, stop))
            if redis_url
            else None
        )
        bal = Balancer([g.url for g in gws], args.seconds, random.Random(args.seed))
        loop = asyncio.get_running_loop()
        t0 = loop.time() + 0.5
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as s:
            clients = [
                asyncio.create_task(
                    one_request(s, bal, a, t0, timeout_s, model, cell, latencies)
                )  # fmt: skip
                for a in work
            ]
            if n_gw > 1:
                await asyncio.sleep(t0 + args.seconds / 3 - loop.time())
                gw_cpu[0] += cpu_s(gws[0].popen.pid)
                gws[0].popen.send_signal(signal.SIGKILL)
                gws[0].popen.wait()
                bal.down.add(0)
                await asyncio.sleep(RESTART_AFTER_S)
                gws[0] = launch_gateway(cfgs[0], workdir, f"gw{n_gw}-0-restarted")
                await wait_http(gws[0].url + "/ready", proc=gws[0])
                gw_cpu[0] -= cpu_s(gws[0].popen.pid)
                bal.down.discard(0)
            await asyncio.gather(*clients)
        wall = loop.time() - t0
        stop.set()
        if watch is not None:
            await watch
        cell.cpu_client = (time.process_time() - client0) / wall
        cell.cpu_gateways = (
            sum(cpu_s(g.popen.pid) - c for g, c in zip(gws, gw_cpu, strict=True)) / wall
        )
        cpu1 = {k: cpu for k, (cpu, _) in snapshot(pids).items()}
        cell.cpu_replicas = (cpu1["replicas"] - cpu0["replicas"]) / wall
        cell.cpu_redis = (cpu1.get("redis", 0.0) - cpu0.get("redis", 0.0)) / wall
        cell.preemptions = sum([await engine_counter(u, "vllm:num_preemptions") for u in urls])
        cell.preemptions -= preempt0
        if redis_url:
            calls = await redis_calls(redis_url) - calls0 - cell.snapshot_calls
            cell.round_trips_per_s = calls / wall
            cell.round_trips_per_gateway_s = cell.round_trips_per_s / n_gw
    finally:
        for g in gws:  # the list as it is now: a restarted gateway replaced the killed one
            g.stop()
    latencies.sort()
    cell.goodput = cell.served / cell.offered if cell.offered else 0.0
    if latencies:
        cell.latency_p50_s = latencies[len(latencies) // 2]
        cell.latency_p90_s = latencies[int(0.9 * (len(latencies) - 1))]
    return cell


def table(cells: list[Cell]) -> str:
    rows = [
        "| gateways x replicas | offered | goodput (x one) | lost | sent again | latency p50 / p90 "
        "| overcommit (snapshots) | preemptions | round trips/s (per gateway) "
        "| CPU gateways / replicas / redis / client |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in cells:
        vs = f" ({c.goodput_vs_one:.3f})" if c.goodput_vs_one is not None else ""
        rows.append(
            f"| {c.gateways} x {c.replicas} | {c.offered} | {c.goodput:.3f}{vs} | {c.lost} "
            f"| {c.sent_again} | {c.latency_p50_s:.2f} / {c.latency_p90_s:.2f} s "
            f"| {c.max_overcommit_tokens} ({c.snapshots}) | {c.preemptions:.0f} "
            f"| {c.round_trips_per_s:.0f} ({c.round_trips_per_gateway_s:.1f}) "
            f"| {c.cpu_gateways:.2f} / {c.cpu_replicas:.2f} / {c.cpu_redis:.2f} "
            f"/ {c.cpu_client:.2f} |"
        )
    return "\n".join(rows)


async def main_async(args: argparse.Namespace) -> int:
    engines = Engines(PROFILE, args.speed, DEFAULT_TIMEOUT_S)
    timed = engines.arrivals(args.seconds, args.replicas, args.load, args.seed)
    work = [Arrival(t, item) for t, item in timed]
    rate = len(work) / args.seconds
    print(f"{len(work)} arrivals ({rate:.2f}/s) over {args.seconds:.0f} s", flush=True)
    cells: list[Cell] = []
    with tempfile.TemporaryDirectory(prefix="kvgate-fleet-") as tmp:
        workdir = Path(tmp)
        replicas = [
            start_replica(PROFILE, args.speed, log=workdir / f"replica-{k}.log")
            for k in range(args.replicas)
        ]
        redis = start_redis(free_port(), workdir)
        with stopping(redis, *replicas):
            for r in replicas:
                await wait_http(r.url + "/health", proc=r)
            one: Cell | None = None
            for n_gw in sorted(set(args.gateways) | {1}):
                cell = await run_cell(n_gw, replicas, work, args, workdir, redis)
                if n_gw == 1:
                    one = cell
                assert one is not None
                cell.goodput_vs_one = cell.goodput / one.goodput if one.goodput else None
                cells.append(cell)
                print(table([cell]).splitlines()[-1], json.dumps(cell.lost_by), flush=True)
                await asyncio.sleep(2.0)  # what the engines still abort drains
    print(table(cells))
    args.result = {"rate": rate, "cells": [asdict(c) for c in cells]}
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gateways", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--speed", type=float, default=5.0)
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="bench/results/fleet_real.json")
    args = ap.parse_args()
    rc = asyncio.run(main_async(args))
    Path(args.out).write_text(json.dumps(args.result, indent=1) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
