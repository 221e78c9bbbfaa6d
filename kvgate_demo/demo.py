"""`kvgate demo`: seed 001's cliff, straight at a replica and then through kvgate.

Starts a simulated replica (`enginesim serve`, seed 001's 8B model on a 16 GB card) on
loopback, replays seed 001's workload (738 production-shaped requests: large prompts,
small structured JSON outputs) at client concurrency 32 straight at it, then starts a
fresh replica behind `kvgate serve` and replays the same requests through the gateway
with a client that honours Retry-After. Prints one side-by-side table.

The replica's clock runs `--speed` times faster than the wall clock, so the 738-request
job that takes tens of minutes on the real card takes a couple of minutes here. Every
time in the table is converted back to the replica's (simulated) seconds. Replica and
gateway run as separate processes, as they would in production, and are stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from enginesim.profiles import load_profile
from enginesim.workloads import seed2_workload
from loadtests.replay import ReplayResult, replay

DEFAULT_PROFILE = "seed2-8b-16gb"
# Seed 001's client gave up on a request after this long (simulated seconds): the
# timeout the simulator's calibration uses (enginesim/calibrate.py), under which the
# healthy run at concurrency 8 loses nothing (p99 31 s) and concurrency 32 collapses.
DEFAULT_TIMEOUT_S = 45.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Process:
    """A child process this demo started; stopped by its own PID only."""

    name: str
    popen: subprocess.Popen
    url: str

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)


async def wait_http(url: str, limit_s: float = 30.0, proc: Process | None = None) -> None:
    deadline = time.monotonic() + limit_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc is not None and proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited with status {proc.popen.returncode}")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not answer 200 within {limit_s:.0f}s")


def start_replica(profile: str, speed: float, *, log: Path, flavor: str | None = None) -> Process:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "enginesim",
        "serve",
        "--profile",
        profile,
        "--port",
        str(port),
        "--speed",
        str(speed),
        "--log-level",
        "WARNING",
    ]
    if flavor:
        cmd += ["--flavor", flavor]
    popen = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    return Process(f"replica:{port}", popen, f"http://127.0.0.1:{port}")


def start_gateway(config: dict, *, workdir: Path, log: Path, source: Path | None = None) -> Process:
    """A `kvgate serve` subprocess; `source`: another source tree to run it from (a
    bench's baseline), else this one."""
    port = free_port()
    config = {**config, "listen": {"host": "127.0.0.1", "port": port}}
    cfg = workdir / f"kvgate-{port}.yaml"
    cfg.write_text(json.dumps(config, indent=2))  # JSON is YAML
    popen = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg)],
        stdout=subprocess.DEVNULL,
        stderr=log.open("wb"),
        cwd=source,
        env=None if source is None else {**os.environ, "PYTHONPATH": str(source)},
    )
    return Process(f"kvgate:{port}", popen, f"http://127.0.0.1:{port}")


@contextlib.contextmanager
def stopping(*procs: Process) -> Iterator[None]:
    try:
        yield
    finally:
        for p in reversed(procs):
            p.stop()


async def engine_counter(url: str, name: str) -> float:
    """A counter from the replica's own /metrics (summed over label sets)."""
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name in (name, name + "_total"):
                total += sample.value
    return total


def gateway_config(
    replica_urls: Sequence[str],
    *,
    speed: float,
    timeout_s: float,
    max_running: int | None = None,
    admission: dict | None = None,
    engine: str = "vllm",
    access_log: bool = False,
) -> dict:
    """kvgate in front of the replicas, with its timers in wall seconds.

    No running cap and no queue deadline are configured: kvgate learns each replica's
    running limit, and queues a request only while its client's own timeout (sent in
    ``x-stainless-read-timeout``, as the openai SDKs do) still leaves room for its
    predicted service. `max_running` is an optional upper bound for experiments.
    `access_log`: one line per request in kvgate's log (the demo reads its losses there).
    """
    return {
        "replicas": [
            {
                "name": f"replica-{i}",
                "url": u,
                "engine": engine,
                **({"max_running": max_running} if max_running else {}),
            }
            for i, u in enumerate(replica_urls)
        ],
        "admission": {
            "queue_max_per_model": 1024,
            # A 1 s retry floor in the replica's time, not 25 replica seconds.
            "min_retry_after_s": 1.0 / speed,
            **(admission or {}),
        },
        "upstream": {"first_byte_s": timeout_s / speed, "total_s": 2 * timeout_s / speed},
        "discovery": {"refresh_interval_s": 0.5},
        "logging": {"level": "info" if access_log else "warning", "access_log": access_log},
        "auth": {"admin_token": ADMIN_TOKEN},
    }


ADMIN_TOKEN = "demo-admin"


async def watch_limits(
    url: str, out: list[tuple[float, int, str]], *, every_s: float = 0.2
) -> None:
    """Record the replica's learned limit from ``/admin/replicas`` until cancelled:
    (wall seconds since start, limit, what last moved it), one entry per change."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with aiohttp.ClientSession() as s:
        while True:
            with contextlib.suppress(aiohttp.ClientError, OSError, ValueError, KeyError):
                async with s.get(url + "/admin/replicas", headers=headers) as r:
                    doc = await r.json()
                rep = doc["replicas"][0]
                limit = rep.get("limit")
                if limit is not None and (not out or out[-1][1] != limit):
                    out.append((loop.time() - start, int(limit), str(rep.get("limit_reason"))))
            await asyncio.sleep(every_s)


@dataclass
class Row:
    label: str
    result: ReplayResult
    preemptions: float
    limits: list[tuple[float, int, str]] = field(default_factory=list)
    gateway_log: Path | None = None  # kvgate's log, for a phase through it

    def limit_summary(self) -> str:
        """The learned limit: its value over the second half of the run (min-max)."""
        if not self.limits:
            return "-"
        half = self.result.wall_s / 2
        late = [v for t, v, _ in self.limits if t >= half]
        before = [v for t, v, _ in self.limits if t < half]
        values = late + ([before[-1]] if before else [])
        lo, hi = min(values), max(values)
        return f"{lo}" if lo == hi else f"{lo}-{hi}"


def render_table(rows: Sequence[Row], speed: float) -> str:
    def sim(x: float) -> str:
        return f"{x * speed:,.1f} s"

    metrics: list[tuple[str, callable]] = [
        ("requests", lambda r: f"{r.result.requests}"),
        ("completed", lambda r: f"{r.result.completed}"),
        ("timed out (client gave up)", lambda r: f"{r.result.timed_out}"),
        ("other errors", lambda r: f"{r.result.errors + r.result.gave_up}"),
        ("shed, then retried after Retry-After", lambda r: f"{r.result.shed_retries}"),
        (
            "retries per completed request",
            lambda r: f"{r.result.shed_retries / max(1, r.result.completed):.2f}",
        ),
        ("learned running limit (second half)", lambda r: r.limit_summary()),
        ("wall time (simulated)", lambda r: sim(r.result.wall_s)),
        (
            "aggregate tokens/s (prompt+output, completed)",
            lambda r: f"{r.result.tokens_per_s / speed:,.0f}",
        ),
        ("p50 latency of completed", lambda r: sim(r.result.quantile(0.5))),
        ("max latency of completed", lambda r: sim(max(r.result.latencies, default=float("nan")))),
        ("replica preemptions", lambda r: f"{r.preemptions:,.0f}"),
    ]
    width = max(len(m[0]) for m in metrics)
    cols = [max(len(r.label), 14) for r in rows]
    head = (
        "| "
        + "metric".ljust(width)
        + " | "
        + " | ".join(r.label.rjust(c) for r, c in zip(rows, cols, strict=True))
        + " |"
    )
    sep = "| " + "-" * width + " | " + " | ".join("-" * (c - 1) + ":" for c in cols) + " |"
    lines = [head, sep]
    for name, fn in metrics:
        lines.append(
            "| "
            + name.ljust(width)
            + " | "
            + " | ".join(fn(r).rjust(c) for r, c in zip(rows, cols, strict=True))
            + " |"
        )
    return "\n".join(lines)


async def run_phase(
    label: str,
    items: Sequence,
    *,
    profile: str,
    model: str,
    speed: float,
    timeout_s: float,
    concurrency: int,
    through_kvgate: bool,
    workdir: Path,
    max_running: int | None = None,
    time_limit_s: float = 900.0,
    max_retries: int | None = None,
    slow_at: tuple[float, float, float] | None = None,
    stream: bool = False,
    admission: dict | None = None,
    access_log: bool = False,
) -> Row:
    """Replay `items` on a fresh replica, straight or through a fresh kvgate, and read the
    replica's preemption counter afterwards. `timeout_s` is in simulated seconds."""
    slug = label.replace(" ", "-").replace("=", "")
    replica = start_replica(profile, speed, log=workdir / f"replica-{slug}.log")
    with stopping(replica):
        await wait_http(replica.url + "/health", proc=replica)
        target = replica.url
        gw: Process | None = None
        gateway_log: Path | None = None
        if through_kvgate:
            gateway_log = workdir / f"kvgate-{slug}.log"
            gw = start_gateway(
                gateway_config(
                    [replica.url],
                    speed=speed,
                    timeout_s=timeout_s,
                    max_running=max_running,
                    admission=admission,
                    engine=str(load_profile(profile).flavor),
                    access_log=access_log,
                ),
                workdir=workdir,
                log=gateway_log,
            )
        limits: list[tuple[float, int, str]] = []
        with stopping(*([gw] if gw else [])):
            tasks: list[asyncio.Task] = []
            if gw is not None:
                await wait_http(gw.url + "/ready", proc=gw)
                target = gw.url
                tasks.append(asyncio.create_task(watch_limits(gw.url, limits)))
            if slow_at is not None:
                tasks.append(asyncio.create_task(slow_replica(replica.url, *slow_at)))
            try:
                res = await replay(
                    target,
                    model,
                    items,
                    concurrency=concurrency,
                    timeout_s=timeout_s / speed,
                    retry_shed=True,
                    time_limit_s=time_limit_s,
                    max_retries=max_retries,
                    stream=stream,
                )
            finally:
                for t in tasks:
                    t.cancel()
                for t in tasks:
                    with contextlib.suppress(asyncio.CancelledError):
                        await t
        preemptions = await engine_counter(replica.url, "vllm:num_preemptions")
        preemptions += await engine_counter(replica.url, "sglang:num_retracted_reqs")
    return Row(label, res, preemptions, limits, gateway_log)


def access_records(log: Path) -> Iterator[dict]:
    """kvgate's access lines (one JSON object per request) in a gateway's log."""
    for line in log.read_text(errors="replace").splitlines():
        if '"logger":"kvgate.access"' not in line:
            continue
        with contextlib.suppress(json.JSONDecodeError):
            yield json.loads(line)


def client_losses(log: Path, speed: float) -> list[str]:
    """What kvgate's access log says of each request whose client gave up on it: how long
    it queued and then ran before the client left, in the replica's seconds."""
    lines = []
    for rec in access_records(log):
        if rec.get("outcome") != "client_disconnect":
            continue
        queued = float(rec.get("queue_wait_s") or 0.0)
        ran = float(rec.get("duration_s") or 0.0) - queued
        lines.append(
            f"{rec.get('request_id')}: queued {queued * speed:.1f} s, then ran "
            f"{ran * speed:.1f} s on {rec.get('replica') or 'no replica'} before its client left"
        )
    return lines


async def slow_replica(url: str, start_s: float, end_s: float, factor: float) -> None:
    """Slow the replica's engine `factor` times from `start_s` to `end_s` (wall seconds
    from now) with enginesim's ``slow`` fault, then restore it."""
    async with aiohttp.ClientSession() as s:
        await asyncio.sleep(start_s)
        async with s.post(url + "/admin/faults", json={"mode": "slow", "factor": factor}) as r:
            r.raise_for_status()
        await asyncio.sleep(end_s - start_s)
        async with s.post(url + "/admin/faults", json={"mode": "none"}) as r:
            r.raise_for_status()


async def run_demo(args: argparse.Namespace) -> int:
    profile = load_profile(args.profile)
    items = seed2_workload(args.requests, seed=args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-demo-"))
    print(
        f"kvgate demo: {len(items)} requests of seed 001's workload, client concurrency "
        f"{args.concurrency}, client timeout {args.timeout:.0f} s, profile {profile.name} "
        f"(pool {profile.pool_tokens:,} tokens), replica clock x{args.speed:g}",
        flush=True,
    )
    rows: list[Row] = []
    for label, through in (("straight", False), ("through kvgate", True)):
        print(f"  {label} ...", flush=True)
        row = await run_phase(
            label,
            items,
            profile=args.profile,
            model=profile.served_model_name,
            speed=args.speed,
            timeout_s=args.timeout,
            concurrency=args.concurrency,
            through_kvgate=through,
            workdir=workdir,
            max_running=args.max_running or None,
            time_limit_s=args.time_limit,
            access_log=through,
        )
        rows.append(row)
        print(f"    done: {row.result.completed} completed, {row.result.timed_out} timed out")
    for row in rows:
        for sample in row.result.error_samples:
            print(f"  {row.label}: error: {sample}", file=sys.stderr)
    print()
    print(render_table(rows, args.speed))
    lost = client_losses(rows[1].gateway_log, args.speed) if rows[1].gateway_log else []
    if lost:  # the reason a run exits 1, in kvgate's own words
        print("\nthrough kvgate, clients gave up on:")
        print("\n".join(f"  {line}" for line in lost))
    print(f"\n(logs in {workdir})")
    return 0 if rows[1].result.completed == len(items) else 1


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvgate demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--profile", default=DEFAULT_PROFILE)
    ap.add_argument("--requests", type=int, default=738)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="client timeout per attempt, in simulated seconds",
    )
    ap.add_argument(
        "--speed",
        type=float,
        default=float(os.environ.get("KVGATE_DEMO_SPEED", 25)),
        help="replica clock speed-up over the wall clock",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--max-running",
        type=int,
        default=0,
        help="an upper bound on the replica's learned running limit (0: none)",
    )
    ap.add_argument(
        "--time-limit",
        type=float,
        default=900.0,
        help="wall seconds after which a phase stops by itself",
    )
    args = ap.parse_args(list(argv) if argv is not None else None)
    return run_async(run_demo(args))


def run_async(main: Coroutine[Any, Any, int]) -> int:
    """Run a demo's or bench's main coroutine on uvloop (asyncio's loop without it)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
