"""What N gateways x R replicas cost one real Redis (issue 50 items 1 and 4).

bench/fleet_vt.py counted, in virtual time on the in-memory backend, the renewals that
many gateways ask of their shared state (10 gateways x 1,000 replicas: ~145 lease
scripts a second, ~289,000 records). This runs the same gateways against a real
``redis-server`` on the real event loop and measures whether it keeps up.

The rig: one private ``redis-server`` (127.0.0.1, a free port, ``--save ""
--appendonly no``, a temporary directory; stopped by its PID at the end, also on an
error) and one Python process (uvloop, as ``kvgate serve`` runs) holding G gateways.
Each gateway is built as fleet_vt builds one, and as ``kvgate serve`` runs one for
admission and sharing: an `AdmissionController` (``learn_limit: false``) behind its
`AdmissionDoor`, R replicas upserted with their pools (half of 16,384 tokens, half of
twice that; a running cap of 64), and a `StateSync` on a `RedisBackend` of its own
(its own connection pool, as a process has; `make_backend` from a `StateConfig` with a
key prefix of the cell's own). The lease loop is the real one (`StateSync.start`: one
renewal, then its task, which wakes every ``min(interval, 50 ms)`` and renews when
`renewal_due` says so). Each gateway carries two records per replica (pool and
running) in every lease script.

Demand, per cell (``--demand``):

- ``idle``: no requests. Every ask is 0; renewals come at the interval (the floor).
- ``busy``: each gateway holds requests of 3,500 + 500 tokens (``--load`` of its share
  of the fleet's pool, 0.5 by default), admitted through its door and held for the
  cell; whatever is still queued once the slices settled is withdrawn, so no queue
  stands: renewals at the interval, asks and uses not 0.
- ``queued``: as busy but over-subscribed (1.2 of the fleet's pool): every gateway keeps
  a standing queue, so its lease loop renews at every tick (the early renewals that
  requests queued behind a slice bring): the ceiling of what the lease loop asks
  (fleet_vt's 10 x 1,000, with arrivals and departures, asked ~145 a second, between
  the interval's 20 and this ceiling's 200).

Requests are submitted before the measured window; in it nothing but the lease loops
(and the doors' expiry tasks) runs, so the client's CPU is the renewals' own.

Measured per cell over ``--seconds`` (after the slices settled):

- renewals issued and completed a second (all gateways), and the errors (a round trip
  over ``timeout_s``, 0.5 s, fails: the gateway then runs fail-open);
- one renewal as the gateway sees it (`StateSync.renew`, p50 and p99), the part of it
  spent awaiting the backend (lease script and the limits/patience reads, as the
  client sees them: the event loop's own delay included) and the Python rest (building
  the asks, applying the slices);
- lateness: renewals that took longer than the interval, gaps between one gateway's
  renewal starts over ``interval + tick`` (the loop's own granularity), and the longest
  gap (a gap of ``lease_ttl_s``, 3 s, loses the lease);
- the Redis side: its CPU (``INFO cpu`` used_cpu_user + used_cpu_sys, over the wall
  seconds: a share of one core; Redis runs its commands on one thread), its commands a
  second (``INFO commandstats``, all of them: the lease script is ``evalsha``, the
  limits and patience reads ``hgetall``), the script's own time per call on the server,
  and ``used_memory`` at the cell's end (and what the cell's records added);
- the client side: the Python process's CPU (``time.process_time``, a share of one core)
  and the event loop's lag (a 10 ms sleeper's overshoot, p99): where this is near one
  core, the client saturated, not Redis;
- the lease hashes in Redis under the cell's prefix (2 x R expected, each with G
  holders).

The machine has 2 cores and the client and Redis share them (and with whatever else runs
there: the machine's busy cores over the window, less the two, are reported as others'
CPU); a real deployment spreads the G gateways over G processes (and hosts), so a
saturated client here bounds what is asked of Redis, and says nothing of Redis.

    PYTHONPATH=. .venv/bin/python bench/redis_load.py [--gateways 1 5 10 20] \\
        [--replicas 10 100 1000] [--seconds 10] [--interval 0.5] \\
        [--demand idle busy queued] [--load 0.5] [--out bench/results/redis_load.json] \\
        [--append]

Writes the cells to ``--out`` (JSON: one entry per run, ``--append`` adds one) and prints
a Markdown table, one row per cell.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from admission.config import AdmissionConfig
from admission.controller import AdmissionController
from admission.lease import LeaseRequest, RenewResult, SharedLimit, SharedPatience
from admission.types import AdmissionRequest, Admit, Queued, RequestEnd
from gateway.config import StateConfig
from gateway.door import AdmissionDoor
from gateway.state import HolderRecord, StateBackend
from gateway.state.sharing import StateSync, make_backend
from routing.scheduler import default_profile
from routing.types import ReplicaState

MODEL = "m"
SMALL_POOL = 16_384  # tokens; the odd replicas have twice this (as bench/fleet_vt.py)
MAX_RUNNING = 64
PROMPT, OUTPUT = 3_500, 500  # one request's need: 4,000 tokens
OVERSUBSCRIBED = 1.2  # the queued demand, of the fleet's pool
LAG_TICK_S = 0.01  # the event-loop lag probe's sleep
SUBMIT_BATCH = 20  # requests submitted between two yields to the event loop
PING_EVERY_S = 0.005  # the PING probe's pace

# Another process, so that what it sees is Redis's delay, not this event loop's: PINGs
# on one connection over `seconds`, then their round trips (seconds) as JSON on stdout.
_PROBE = """
import json, socket, sys, time
port, seconds, every = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
s = socket.create_connection(("127.0.0.1", port))
rtts, end = [], time.perf_counter() + seconds
while time.perf_counter() < end:
    t0 = time.perf_counter()
    s.sendall(b"PING\\r\\n")
    buf = b""
    while not buf.endswith(b"\\r\\n"):
        buf += s.recv(64)
    rtts.append(time.perf_counter() - t0)
    time.sleep(every)
print(json.dumps(rtts))
"""


# ------------------------------------------------------------------ the Redis server
class RedisProcess:
    """A private redis-server on a free loopback port, stopped by its PID."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self._dir: str | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not on PATH")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._dir = tempfile.mkdtemp(prefix="kvgate-redis-load-")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self._dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not listen on {self.port}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


@contextlib.contextmanager
def redis_server() -> Iterator[RedisProcess]:
    server = RedisProcess()
    try:
        server.start()
        yield server
    finally:
        server.stop()


# ------------------------------------------------------------------ instrumentation
class TimedBackend(StateBackend):
    """A backend that times every call it passes on (as the client sees it: the event
    loop's delay in handing back the answer included)."""

    def __init__(self, inner: StateBackend) -> None:
        self.inner = inner
        self.name = inner.name
        self.busy_s = 0.0  # time spent awaiting the backend, all calls
        self.calls: dict[str, int] = {}
        self.lease_s: list[float] = []  # each lease script's round trip
        self.records = 0  # lease records sent

    async def _timed(self, what: str, coro: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await coro
        finally:
            dt = time.perf_counter() - t0
            self.busy_s += dt
            self.calls[what] = self.calls.get(what, 0) + 1
            if what == "renew":
                self.lease_s.append(dt)

    async def connect(self) -> None:
        await self.inner.connect()

    async def close(self) -> None:
        await self.inner.close()

    async def renew(
        self, holder: str, requests: Sequence[LeaseRequest], ttl_s: float
    ) -> RenewResult:
        self.records += len(requests)
        out: RenewResult = await self._timed("renew", self.inner.renew(holder, requests, ttl_s))
        return out

    async def release(self, holder: str, resources: Sequence[str] | None = None) -> None:
        await self._timed("release", self.inner.release(holder, resources))

    async def holders(self, resource: str) -> dict[str, HolderRecord]:
        out: dict[str, HolderRecord] = await self._timed("holders", self.inner.holders(resource))
        return out

    async def publish_limit(self, replica: str, value: float, reason: str) -> int:
        out: int = await self._timed(
            "publish_limit", self.inner.publish_limit(replica, value, reason)
        )
        return out

    async def limits(self) -> dict[str, SharedLimit]:
        out: dict[str, SharedLimit] = await self._timed("limits", self.inner.limits())
        return out

    async def publish_patience(self, population: str, seconds: float, whole: bool) -> int:
        out: int = await self._timed(
            "publish_patience", self.inner.publish_patience(population, seconds, whole)
        )
        return out

    async def patiences(self) -> dict[str, SharedPatience]:
        out: dict[str, SharedPatience] = await self._timed("patiences", self.inner.patiences())
        return out

    async def put_response(self, response_id: str, replica: str, tokens: int, ttl_s: float) -> None:
        await self._timed(
            "put_response", self.inner.put_response(response_id, replica, tokens, ttl_s)
        )

    async def response(self, response_id: str) -> tuple[str, int] | None:
        out: tuple[str, int] | None = await self._timed(
            "response", self.inner.response(response_id)
        )
        return out


@dataclass
class Renewal:
    start: float  # loop time
    took_s: float
    backend_s: float  # of which awaiting the backend
    interval_round: bool  # the interval's round (patience too), not an early one
    failed: bool
    lease_s: float | None  # the lease script's round trip within it (None: not reached)


@dataclass
class Gateway:
    name: str
    door: AdmissionDoor
    backend: TimedBackend
    sync: StateSync
    renewals: list[Renewal] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)
    waiting: dict[str, asyncio.Future[Any]] = field(default_factory=dict)
    recording: bool = False

    def instrument(self) -> None:
        """Time every renewal the lease loop makes (its task calls ``self.renew``, so an
        instance attribute stands in for the method)."""
        inner = self.sync.renew
        loop = asyncio.get_running_loop()

        async def renew(patience: bool = True) -> None:
            start, t0 = loop.time(), time.perf_counter()
            b0, e0, n0 = self.backend.busy_s, self.sync.errors, len(self.backend.lease_s)
            await inner(patience=patience)
            if self.recording:
                lease = self.backend.lease_s[n0:]
                self.renewals.append(
                    Renewal(
                        start,
                        time.perf_counter() - t0,
                        self.backend.busy_s - b0,
                        patience,
                        self.sync.errors > e0,
                        lease[0] if lease else None,
                    )
                )

        self.sync.renew = renew  # type: ignore[method-assign]  # the bench's probe


@dataclass
class Cell:
    gateways: int
    replicas: int
    interval_s: float
    demand: str
    seconds: float
    renewals_issued: int
    renewals_completed: int
    renewal_errors: int
    issued_per_s: float
    completed_per_s: float
    interval_rounds_per_s: float  # of which the interval's (patience shared too)
    records_per_s: float
    renew_ms_p50: float
    renew_ms_p99: float
    backend_ms_p50: float  # awaiting Redis within one renewal (client-side view)
    backend_ms_p99: float
    lease_rtt_ms_p50: float  # the lease script's round trip alone
    lease_rtt_ms_p99: float
    python_ms_p50: float  # renewal less its backend waits
    python_ms_p99: float
    over_interval: int  # renewals that took longer than the interval
    late_gaps: int  # gaps between a gateway's renewal starts over interval + tick
    max_gap_s: float
    round_trips_per_s: float  # the gateways' calls to the backend (client side)
    round_trips_by_call: dict[str, int]  # of which: lease script, limits, patience reads
    redis_cpu_core: float  # share of one core
    redis_ops_per_s: float  # every command, the scripts' own included
    redis_evalsha_per_s: float
    redis_eval_calls: int  # EVAL (a script the server had not cached: redis-py resends)
    redis_script_us_per_call: float  # the lease script's own time on the server
    redis_script_us_p99: float  # INFO latencystats
    redis_hgetall_per_s: float
    ping_ms_p50: float  # a PING from another process, every 5 ms: Redis's queue
    ping_ms_p99: float
    ping_ms_max: float
    redis_commands: dict[str, int]
    used_memory_mb: float
    records_memory_mb: float  # what the cell's records added (used_memory's delta)
    lease_keys_mb: float  # MEMORY USAGE of the lease hashes (a sample of 200, scaled)
    client_cpu_core: float
    machine_cpu_cores: float  # the whole machine's busy cores over the window
    others_cpu_cores: float  # of which neither the client nor Redis (other jobs, probe)
    loop_lag_ms_p99: float
    queue_depth_mean: float  # per gateway, sampled
    held_requests: int  # admitted and held at the window's end, all gateways
    lease_keys: int  # lease hashes under the cell's prefix at its end
    holders_per_key_min: int
    setup_s: float
    setup_errors: int  # renewals failed before the window (all gateways)


def _q(xs: Sequence[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def _p99(stat: Any) -> float:
    """p99 of an INFO latencystats entry (redis-py parses ``p50=..,p99=..`` into a dict,
    or leaves the text)."""
    if isinstance(stat, dict):
        return float(stat.get("p99", 0.0))
    for part in str(stat).split(","):
        key, _, value = part.partition("=")
        if key == "p99":
            return float(value)
    return 0.0


# ------------------------------------------------------------------ one cell
def _replicas(n_rep: int) -> dict[str, int]:
    return {f"r{k}": SMALL_POOL * (2 if k % 2 else 1) for k in range(n_rep)}


def _new_gateway(
    name: str, pools: dict[str, int], config: StateConfig, n_gw: int, seed: int
) -> Gateway:
    loop = asyncio.get_running_loop()
    door = AdmissionDoor(
        AdmissionController(AdmissionConfig(learn_limit=False), default_profile(seed=seed)), loop
    )
    for rep, pool in pools.items():
        state = ReplicaState(
            rep, "", ready=True, models=[MODEL], capacity_tokens=pool, max_running=MAX_RUNNING
        )
        door.upsert_replica(state, pinned_capacity=pool, max_running=MAX_RUNNING)
    inner = make_backend(config)
    assert inner is not None
    backend = TimedBackend(inner)
    sync = StateSync(config, backend, door, holder=name, workers_hint=n_gw, loop=loop)
    return Gateway(name, door, backend, sync)


async def _submit(gw: Gateway, k: int) -> None:
    """Submit `k` requests of 4,000 tokens to `gw` (no deadline: a queued one waits), a
    few at a time, so the lease loops run between them (as they do between arrivals)."""
    for i in range(k):
        if i % SUBMIT_BATCH == 0:
            await asyncio.sleep(0)
        now = gw.door.now()
        rid = f"{gw.name}-{uuid.uuid4().hex[:10]}"
        req = AdmissionRequest(
            rid,
            MODEL,
            prompt_tokens=PROMPT,
            expected_output=OUTPUT,
            max_tokens=OUTPUT,
            arrival=now,
        )
        verdict = gw.door.submit(req)
        if isinstance(verdict, Admit):
            gw.admitted.append(rid)
        elif isinstance(verdict, Queued):
            fut = gw.door.expect(rid)
            gw.waiting[rid] = fut

            def done(f: asyncio.Future[Any], rid: str = rid) -> None:
                gw.waiting.pop(rid, None)
                if not f.cancelled() and isinstance(f.result(), Admit):
                    gw.admitted.append(rid)

            fut.add_done_callback(done)


async def _info(r: aioredis.Redis, section: str) -> dict[str, Any]:
    out: dict[str, Any] = await r.info(section)
    return out


def _machine_busy_s() -> float:
    """CPU seconds every core of this machine spent busy so far (/proc/stat; 0 where
    there is none): over a window, less the client's and Redis's, what others ran."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return 0.0
    ticks = [int(x) for x in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle and iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _cpu(info: dict[str, Any]) -> float:
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def _keys(r: aioredis.Redis, pattern: str) -> list[str]:
    return [k async for k in r.scan_iter(match=pattern, count=1000)]


async def run_cell(
    url: str,
    n_gw: int,
    n_rep: int,
    interval: float,
    demand: str,
    seconds: float,
    load: float = 0.5,
    seed: int = 1,
    settle_s: float | None = None,
) -> Cell:
    """G gateways x R replicas on the Redis at `url` for `seconds` (after they settle)."""
    loop = asyncio.get_running_loop()
    prefix = f"redisload-{uuid.uuid4().hex[:8]}"
    config = StateConfig(
        backend="redis",
        redis_url=url,
        key_prefix=prefix,
        renew_interval_s=interval,
        lease_ttl_s=max(3.0, 2 * interval),
    )
    pools = _replicas(n_rep)
    admin = aioredis.from_url(url, decode_responses=True)
    t_setup = time.perf_counter()
    mem0 = int((await _info(admin, "memory"))["used_memory"])
    gws: list[Gateway] = []
    try:
        for i in range(n_gw):
            gw = _new_gateway(f"g{i}", pools, config, n_gw, seed + i)
            gw.door.start()
            gw.instrument()
            await gw.sync.start()
            gws.append(gw)
        # Demand, through each door, once every gateway holds its first slices.
        if demand != "idle":
            fill = load if demand == "busy" else OVERSUBSCRIBED
            per_gw = math.ceil(fill * sum(pools.values()) / (PROMPT + OUTPUT) / n_gw)
            for _ in range(3):  # in rounds, so renewals grant the slices between them
                for gw in gws:
                    await _submit(gw, math.ceil(per_gw / 3))
                await asyncio.sleep(2 * interval)
        await asyncio.sleep(settle_s if settle_s is not None else 2 * interval + 0.2)
        if demand == "busy":  # no queue stands: renewals at the interval
            for gw in gws:
                for rid, fut in list(gw.waiting.items()):
                    gw.door.withdraw(rid)
                    gw.door.request_ended(RequestEnd(rid))
                    fut.cancel()
                gw.waiting.clear()
        setup_s = time.perf_counter() - t_setup

        # ---- the measured window
        setup_errors = sum(gw.sync.errors for gw in gws)
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        probe = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _PROBE, str(port), str(seconds), str(PING_EVERY_S),
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        await admin.config_resetstat()
        cpu0 = _cpu(await _info(admin, "cpu"))
        p0 = time.process_time()
        m0 = _machine_busy_s()
        w0 = time.perf_counter()
        t0 = loop.time()
        for gw in gws:
            gw.recording = True
        calls0 = [dict(gw.backend.calls) for gw in gws]
        lags: list[float] = []
        depths: list[float] = []
        end = t0 + seconds
        next_sample = t0
        while loop.time() < end:
            before = loop.time()
            await asyncio.sleep(LAG_TICK_S)
            after = loop.time()
            lags.append(max(0.0, after - before - LAG_TICK_S))
            if after >= next_sample:
                depths.append(statistics.fmean(gw.door.report.queue_depth() for gw in gws))
                next_sample += 0.1
        for gw in gws:
            gw.recording = False
        wall = time.perf_counter() - w0
        trips: dict[str, int] = {}
        for gw, c0 in zip(gws, calls0, strict=True):
            for name, n in gw.backend.calls.items():
                trips[name] = trips.get(name, 0) + n - c0.get(name, 0)
        client_cpu = (time.process_time() - p0) / wall
        redis_cpu = (_cpu(await _info(admin, "cpu")) - cpu0) / wall
        machine_cpu = (_machine_busy_s() - m0) / wall
        stats = await _info(admin, "commandstats")
        script_lat = (await _info(admin, "latencystats")).get(
            "latency_percentiles_usec_evalsha", {}
        )
        try:
            async with asyncio.timeout(seconds + 30):
                out, _ = await probe.communicate()
        finally:
            if probe.returncode is None:
                probe.kill()
                await probe.wait()
        pings = json.loads(out) if out else []
        mem1 = int((await _info(admin, "memory"))["used_memory"])
        lease_keys = await _keys(admin, "{" + prefix + "}:lease:*")
        holders = [int(await admin.hlen(k)) for k in lease_keys[:200]]
        sample = [int(await admin.memory_usage(k) or 0) for k in lease_keys[:200]]
        keys_bytes = sum(sample) * len(lease_keys) / max(1, len(sample))
        held = sum(len(gw.admitted) for gw in gws)
    finally:
        for gw in gws:
            gw.recording = False
            with contextlib.suppress(Exception):
                await gw.sync.stop()  # returns the leases, closes the backend
            for rid in gw.admitted:
                gw.door.request_ended(RequestEnd(rid))
            with contextlib.suppress(Exception):
                await gw.door.stop()
        with contextlib.suppress(Exception):
            for k in await _keys(admin, "{" + prefix + "}*"):
                await admin.delete(k)
        await admin.aclose()

    rs = [r for gw in gws for r in gw.renewals]
    ok = [r for r in rs if not r.failed]
    tick = gws[0].sync.tick_s
    gaps = [
        b.start - a.start for gw in gws for a, b in zip(gw.renewals, gw.renewals[1:], strict=False)
    ]
    lease_rtt = [r.lease_s for r in rs if r.lease_s is not None]
    calls = {
        name.removeprefix("cmdstat_"): int(v["calls"])
        for name, v in stats.items()
        if name.startswith("cmdstat_")
    }
    evalsha = stats.get("cmdstat_evalsha", {})
    script_us = float(evalsha.get("usec_per_call", 0.0))
    ignore = {"config|resetstat", "info"}  # this bench's own, in the window
    return Cell(
        gateways=n_gw,
        replicas=n_rep,
        interval_s=interval,
        demand=demand,
        seconds=wall,
        renewals_issued=len(rs),
        renewals_completed=len(ok),
        renewal_errors=len(rs) - len(ok),
        issued_per_s=len(rs) / wall,
        completed_per_s=len(ok) / wall,
        interval_rounds_per_s=sum(r.interval_round for r in rs) / wall,
        records_per_s=2 * n_rep * len(ok) / wall,
        renew_ms_p50=1e3 * _q([r.took_s for r in rs], 0.5),
        renew_ms_p99=1e3 * _q([r.took_s for r in rs], 0.99),
        backend_ms_p50=1e3 * _q([r.backend_s for r in rs], 0.5),
        backend_ms_p99=1e3 * _q([r.backend_s for r in rs], 0.99),
        lease_rtt_ms_p50=1e3 * _q(lease_rtt, 0.5),
        lease_rtt_ms_p99=1e3 * _q(lease_rtt, 0.99),
        python_ms_p50=1e3 * _q([r.took_s - r.backend_s for r in rs], 0.5),
        python_ms_p99=1e3 * _q([r.took_s - r.backend_s for r in rs], 0.99),
        over_interval=sum(r.took_s > interval for r in rs),
        late_gaps=sum(g > interval + tick for g in gaps),
        max_gap_s=max(gaps, default=0.0),
        round_trips_per_s=sum(trips.values()) / wall,
        round_trips_by_call=trips,
        redis_cpu_core=redis_cpu,
        redis_ops_per_s=sum(v for k, v in calls.items() if k not in ignore) / wall,
        redis_evalsha_per_s=calls.get("evalsha", 0) / wall,
        redis_eval_calls=calls.get("eval", 0),
        redis_script_us_per_call=script_us,
        redis_script_us_p99=_p99(script_lat),
        redis_hgetall_per_s=calls.get("hgetall", 0) / wall,
        ping_ms_p50=1e3 * _q(pings, 0.5),
        ping_ms_p99=1e3 * _q(pings, 0.99),
        ping_ms_max=1e3 * max(pings, default=0.0),
        redis_commands=calls,
        used_memory_mb=mem1 / 2**20,
        records_memory_mb=(mem1 - mem0) / 2**20,
        lease_keys_mb=keys_bytes / 2**20,
        client_cpu_core=client_cpu,
        machine_cpu_cores=machine_cpu,
        others_cpu_cores=max(0.0, machine_cpu - client_cpu - redis_cpu),
        loop_lag_ms_p99=1e3 * _q(lags, 0.99),
        queue_depth_mean=statistics.fmean(depths) if depths else 0.0,
        held_requests=held,
        lease_keys=len(lease_keys),
        holders_per_key_min=min(holders, default=0),
        setup_s=setup_s,
        setup_errors=setup_errors,
    )


# ------------------------------------------------------------------ report
HEADER = (
    "| G | R | interval s | demand | held / queued per gw | renewals/s issued / done "
    "| errors (setup) | round trips/s "
    "| records/s | renewal ms p50 / p99 | of it Redis wait ms p50 / p99 "
    "| lease script RTT ms p50 / p99 | Python ms p50 / p99 | script on server ms mean / p99 "
    "| PING ms p50 / p99 / max "
    "| Redis CPU (cores) | client CPU (cores) | others' CPU (cores) | loop lag p99 ms "
    "| over interval / late gaps | max gap s | lease keys (MB) | used_memory MB |"
)


def row(c: Cell) -> str:
    return (
        f"| {c.gateways} | {c.replicas} | {c.interval_s:g} | {c.demand} "
        f"| {c.held_requests / c.gateways:.0f} / {c.queue_depth_mean:.0f} "
        f"| {c.issued_per_s:.1f} / {c.completed_per_s:.1f} "
        f"| {c.renewal_errors} ({c.setup_errors}) "
        f"| {c.round_trips_per_s:.0f} | {c.records_per_s:,.0f} "
        f"| {c.renew_ms_p50:.1f} / {c.renew_ms_p99:.1f} "
        f"| {c.backend_ms_p50:.1f} / {c.backend_ms_p99:.1f} "
        f"| {c.lease_rtt_ms_p50:.1f} / {c.lease_rtt_ms_p99:.1f} "
        f"| {c.python_ms_p50:.1f} / {c.python_ms_p99:.1f} "
        f"| {c.redis_script_us_per_call / 1e3:.1f} / {c.redis_script_us_p99 / 1e3:.1f} "
        f"| {c.ping_ms_p50:.2f} / {c.ping_ms_p99:.1f} / {c.ping_ms_max:.0f} "
        f"| {c.redis_cpu_core:.2f} | {c.client_cpu_core:.2f} | {c.others_cpu_cores:.2f} "
        f"| {c.loop_lag_ms_p99:.1f} "
        f"| {c.over_interval} / {c.late_gaps} | {c.max_gap_s:.2f} "
        f"| {c.lease_keys} ({c.lease_keys_mb:.1f}) | {c.used_memory_mb:.1f} |"
    )


def table(cells: Sequence[Cell]) -> str:
    sep = "|" + "---|" * (HEADER.count("|") - 1)
    return "\n".join([HEADER, sep, *(row(c) for c in cells)])


async def run_all(args: argparse.Namespace) -> list[Cell]:
    cells: list[Cell] = []
    with redis_server() as server:
        for interval in args.interval:
            for n_rep in args.replicas:
                for n_gw in args.gateways:
                    for demand in args.demand:
                        c = await run_cell(
                            server.url, n_gw, n_rep, interval, demand, args.seconds,
                            args.load, args.seed,
                        )  # fmt: skip
                        cells.append(c)
                        print(row(c), file=sys.stderr, flush=True)
    return cells


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gateways", type=int, nargs="+", default=[1, 5, 10, 20])
    ap.add_argument("--replicas", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--interval", type=float, nargs="+", default=[0.5])
    ap.add_argument("--demand", nargs="+", default=["idle", "busy", "queued"],
                    choices=["idle", "busy", "queued"])  # fmt: skip
    ap.add_argument("--load", type=float, default=0.5, help="busy: held, of the pool")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="bench/results/redis_load.json")
    ap.add_argument(
        "--append", action="store_true", help="add this run to --out's runs, not replace them"
    )
    args = ap.parse_args()
    # A SIGTERM ends the run as ^C does: through the `finally`s that stop the server.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a declared dependency
        runner = asyncio.run
    cells = runner(run_all(args))
    version = subprocess.run(
        ["redis-server", "--version"], capture_output=True, text=True, check=False
    ).stdout.strip()
    meta = {
        "argv": sys.argv[1:],
        "redis": version,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    out = Path(args.out)
    runs = json.loads(out.read_text())["runs"] if args.append and out.exists() else []
    runs.append({"meta": meta, "cells": [asdict(c) for c in cells]})
    out.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    print(table(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
