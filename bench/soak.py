"""Soak: steady load with random faults and client disconnects, kvgate's memory and ledger.

Setting (every process on 127.0.0.1, started here and stopped by PID at the end):

- three enginesim replicas (``--profile``, default llama3-70b-h100x4: a large pool, so the
  engines are not what limits the run) as separate processes;
- one ``kvgate serve`` process in front of them (learned limits on, outlier ejection on);
- an open-loop Poisson load at ``--rate`` requests/s for ``--minutes``: 60% streams,
  prompts of 20-400 words, ``max_tokens`` 16-200; 5% of clients disconnect mid-request
  (a stream after a few events, a non-stream request after 0.2-2 s);
- a fault every 20-40 s on a random replica: a crash (SIGKILL, restarted on the same port
  5-10 s later), a hang (5 s), 503s (5 s), dropped connections after 3 tokens (5 s), or a
  4x slowdown (10 s), through enginesim's ``/admin/faults`` (the crash is a real kill).

Measured: kvgate's RSS every 5 s (``/proc/PID/status`` VmRSS); growth is the median of the
last minute against the median of the minute after warm-up (``--warmup`` minutes). At the
end the load stops, in-flight requests finish, and ``/admin/replicas`` must show nothing
reserved, held or queued. Every request the clients sent is accounted for: client-side
outcome classes must sum to the number sent, and kvgate's ``kvgate_requests_total`` must
count the same number. A request whose answer breaks a documented promise (not an error
object, a stream without ``[DONE]`` or an error event, a connection error) is counted
under ``bad:``.

Then a second phase measures what one process holds: a fresh kvgate (limits not learned,
so the engines' own caps bound running requests) gets ``--streams`` concurrent long
streams; its RSS once all are running, minus its RSS idle, per stream. The streams are
then disconnected and the ledger must return to zero.

Results: ``bench/results/soak.json`` and a summary on stdout.

    .venv/bin/python bench/soak.py [--minutes 10] [--rate 6] [--streams 300]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvgate_demo.demo import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
ADMIN = "soak-admin-token"
WORDS = "the quick brown fox jumps over a lazy dog while seven tired engines count tokens".split()


# ---------------------------------------------------------------------- processes
class Child:
    """A child process this script started; stopped by its own PID only."""

    def __init__(self, name: str, cmd: list[str], log: Path) -> None:
        self.name, self.cmd, self.log = name, cmd, log
        self.popen: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        with self.log.open("ab") as f:
            self.popen = subprocess.Popen(self.cmd, stdout=f, stderr=f, cwd=ROOT)

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)


def start_replica(workdir: Path, i: int, port: int, profile: str) -> Child:
    cmd = [sys.executable, "-m", "enginesim", "serve", "--profile", profile, "--port", str(port),
           "--seed", str(i + 1), "--log-level", "warning"]  # fmt: skip
    return Child(f"r{i}", cmd, workdir / f"r{i}.log")


def start_kvgate(
    workdir: Path, name: str, port: int, replica_ports: list[int], *, learn: bool
) -> Child:
    cfg = {
        "listen": {"host": "127.0.0.1", "port": port},
        "replicas": [
            {"name": f"r{i}", "url": f"http://127.0.0.1:{p}"} for i, p in enumerate(replica_ports)
        ],
        "admission": {"queue_timeout_s": 20.0, "learn_limit": learn},
        "upstream": {"first_byte_s": 15.0, "idle_s": 5.0, "total_s": 180.0},
        "discovery": {"refresh_interval_s": 1.0, "probe_timeout_s": 1.0},
        "outlier": {"consecutive_failures": 3, "base_ejection_s": 5.0, "max_ejection_s": 30.0},
        "auth": {"admin_token": ADMIN},
        "limits": {"client_write_timeout_s": 10.0},
        "logging": {"level": "warning", "access_log": False},
    }
    path = workdir / f"{name}.yaml"
    path.write_text(json.dumps(cfg))
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path)]
    return Child(name, cmd, workdir / f"{name}.log")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


async def wait_ok(s: aiohttp.ClientSession, url: str, limit_s: float = 60.0) -> None:
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        with contextlib.suppress(aiohttp.ClientError, OSError):
            async with s.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status == 200:
                    return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {limit_s}s")


async def admin_replicas(s: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with s.get(url + "/admin/replicas", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
        return await r.json()


async def requests_total(s: aiohttp.ClientSession, url: str) -> Counter[str]:
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    out: Counter[str] = Counter()
    for line in text.splitlines():
        if line.startswith("kvgate_requests_total{"):
            outcome = line.split('outcome="')[1].split('"')[0]
            out[outcome] += int(float(line.rsplit(" ", 1)[1]))
    return out


# ---------------------------------------------------------------------- one request
def classify_answer(status: int, headers: Any, raw: bytes, stream: bool) -> str:
    if status != 200:
        try:
            doc = json.loads(raw)
            err = doc["error"]
            assert set(doc) == {"error"} and set(err) == {"message", "type", "param", "code"}
        except (ValueError, KeyError, AssertionError, TypeError):
            return f"bad: {status} without an error object"
        if status in (429, 503):
            if "Retry-After" not in headers:
                return "bad: shed without Retry-After"
            return f"shed_{status}_{err['code']}"
        return f"error_{status}_{err['code']}"
    if not stream:
        try:
            ok = json.loads(raw)["object"] == "chat.completion"
        except (ValueError, KeyError):
            ok = False
        return "completed" if ok else "bad: 200 without a completion"
    events = [e for e in raw.replace(b"\r\n", b"\n").split(b"\n\n") if e.strip()]
    if events and events[-1] == b"data: [DONE]":
        return "completed_stream"
    if events and events[-1].startswith(b'data: {"error"'):
        return "cut_" + json.loads(events[-1][6:])["error"]["code"]
    return "bad: stream ended without [DONE] or an error event"


async def one_request(s: aiohttp.ClientSession, url: str, rng: random.Random) -> str:
    stream = rng.random() < 0.6
    body = {
        "model": MODEL_NAME,
        "messages": [
            {"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(20, 400)))}
        ],
        "max_tokens": rng.randint(16, 200),
        "stream": stream,
    }
    leave = rng.random() < 0.05
    try:
        if leave and not stream:
            task = asyncio.ensure_future(_post(s, url, body, stream))
            await asyncio.sleep(rng.uniform(0.2, 2.0))
            if task.done():
                return task.result()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            return "client_left"
        if leave:
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                if r.status != 200:
                    return classify_answer(r.status, r.headers, await r.read(), stream)
                for _ in range(rng.randint(1, 8)):
                    if not await r.content.readany():
                        break
                r.close()  # gone mid-stream
                return "client_left"
        return await _post(s, url, body, stream)
    except (aiohttp.ClientError, TimeoutError) as e:
        return f"bad: client error {type(e).__name__}"


async def _post(s: aiohttp.ClientSession, url: str, body: dict[str, Any], stream: bool) -> str:
    async with s.post(url + "/v1/chat/completions", json=body) as r:
        return classify_answer(r.status, r.headers, await r.read(), stream)


MODEL_NAME = ""


# ---------------------------------------------------------------------- faults
async def inject_faults(
    s: aiohttp.ClientSession,
    replicas: list[Child],
    ports: list[int],
    rng: random.Random,
    stop_at: float,
    log: list[dict[str, Any]],
) -> None:
    t0 = time.monotonic()
    while True:
        await asyncio.sleep(rng.uniform(20, 40))
        if time.monotonic() >= stop_at - 15:
            return
        i = rng.randrange(len(replicas))
        kind = rng.choice(["crash", "hang", "error", "drop", "slow"])
        base = f"http://127.0.0.1:{ports[i]}"
        log.append({"t": round(time.monotonic() - t0, 1), "replica": f"r{i}", "fault": kind})
        try:
            if kind == "crash":
                replicas[i].kill()
                await asyncio.sleep(rng.uniform(5, 10))
                replicas[i].start()
                await wait_ok(s, base + "/health")
                continue
            fault: dict[str, Any] = {"mode": kind}
            if kind == "error":
                fault["status"] = 503
            elif kind == "drop":
                fault["after_tokens"] = 3
            elif kind == "slow":
                fault["factor"] = 4.0
            async with s.post(base + "/admin/faults", json=fault) as r:
                r.raise_for_status()
            await asyncio.sleep(10.0 if kind == "slow" else 5.0)
            async with s.post(base + "/admin/faults", json={"mode": "none"}) as r:
                r.raise_for_status()
        except (aiohttp.ClientError, OSError) as e:
            log.append({"t": round(time.monotonic() - t0, 1), "error": f"{type(e).__name__}: {e}"})


# ---------------------------------------------------------------------- phases
async def soak(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    rng = random.Random(args.seed)
    ports = [free_port() for _ in range(3)]
    replicas = [start_replica(workdir, i, p, args.profile) for i, p in enumerate(ports)]
    gw_port = free_port()
    gw = start_kvgate(workdir, "kvgate", gw_port, ports, learn=True)
    url = f"http://127.0.0.1:{gw_port}"
    outcomes: Counter[str] = Counter()
    faults: list[dict[str, Any]] = []
    samples: list[tuple[float, int]] = []
    sent = 0
    try:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(
            connector=conn, timeout=aiohttp.ClientTimeout(total=240)
        ) as s:
            for p in ports:
                await wait_ok(s, f"http://127.0.0.1:{p}/health")
            await wait_ok(s, url + "/ready")
            t0 = time.monotonic()
            stop_at = t0 + args.minutes * 60
            fault_task = asyncio.ensure_future(
                inject_faults(s, replicas, ports, rng, stop_at, faults)
            )
            tasks: set[asyncio.Task[None]] = set()

            async def run_one(r: random.Random) -> None:
                outcomes[await one_request(s, url, r)] += 1

            next_sample = t0
            next_send = t0
            while (now := time.monotonic()) < stop_at:
                if now >= next_sample:
                    samples.append((round(now - t0, 1), rss_kib(gw.pid)))
                    next_sample += 5.0
                if now >= next_send:
                    sent += 1
                    t = asyncio.ensure_future(run_one(random.Random(rng.random())))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
                    next_send += rng.expovariate(args.rate)
                await asyncio.sleep(max(0.0, min(next_send, next_sample) - time.monotonic()))
            fault_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await fault_task
            # A replica killed by the last fault comes back, and an interrupted fault is
            # cleared, before the final accounting.
            for rep, p in zip(replicas, ports, strict=True):
                if rep.popen is not None and rep.popen.poll() is not None:
                    rep.start()
                await wait_ok(s, f"http://127.0.0.1:{p}/admin/faults")
                async with s.post(f"http://127.0.0.1:{p}/admin/faults", json={"mode": "none"}) as r:
                    r.raise_for_status()
            if tasks:
                await asyncio.wait(tasks, timeout=300)
            samples.append((round(time.monotonic() - t0, 1), rss_kib(gw.pid)))
            # The ledger must return to zero (abandoned holds end within abandoned_hold_s).
            end = time.monotonic() + 60
            while True:
                snap = await admin_replicas(s, url)
                reserved = sum(r["reserved_tokens"] for r in snap["replicas"])
                held = sum(r["held"] for r in snap["replicas"])
                queued = sum(snap["queue"].values())
                if (reserved == held == queued == 0) or time.monotonic() > end:
                    break
                await asyncio.sleep(0.5)
            counted = await requests_total(s, url)
    finally:
        gw.stop()
        for rep in replicas:
            rep.stop()
    warm = [r for t, r in samples if args.warmup * 60 <= t < (args.warmup + 1) * 60]
    last = [r for t, r in samples if t >= args.minutes * 60 - 60]
    growth = (statistics.median(last) / statistics.median(warm) - 1) if warm and last else None
    return {
        "minutes": args.minutes,
        "rate_rps": args.rate,
        "sent": sent,
        "client_outcomes": dict(sorted(outcomes.items())),
        "client_outcomes_total": sum(outcomes.values()),
        "kvgate_requests_total": dict(sorted(counted.items())),
        "kvgate_requests_counted": sum(counted.values()),
        "bad": sum(v for k, v in outcomes.items() if k.startswith("bad")),
        "faults": faults,
        "rss_kib_samples": samples,
        "rss_warm_median_kib": statistics.median(warm) if warm else None,
        "rss_last_median_kib": statistics.median(last) if last else None,
        "rss_growth_after_warmup": round(growth, 4) if growth is not None else None,
        "end_reserved_tokens": reserved,
        "end_held": held,
        "end_queued": queued,
    }


async def streams_phase(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    ports = [free_port() for _ in range(3)]
    replicas = [start_replica(workdir, 10 + i, p, args.profile) for i, p in enumerate(ports)]
    gw_port = free_port()
    gw = start_kvgate(workdir, "kvgate-streams", gw_port, ports, learn=False)
    url = f"http://127.0.0.1:{gw_port}"
    try:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=600)
        ) as s:
            for p in ports:
                await wait_ok(s, f"http://127.0.0.1:{p}/health")
            await wait_ok(s, url + "/ready")
            # Warm the process (imports, pools, first requests) before the idle reading.
            for _ in range(20):
                async with s.post(url + "/v1/chat/completions", json={
                    "model": MODEL_NAME, "messages": [{"role": "user", "content": "warm up"}],
                    "max_tokens": 8}) as r:  # fmt: skip
                    await r.read()
            idle = rss_kib(gw.pid)
            body = {
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": "tell a very long story " * 20}],
                "max_tokens": 1500,
                "ignore_eos": True,
                "stream": True,
            }
            opened: list[aiohttp.ClientResponse] = []

            async def open_one() -> None:
                r = await s.post(url + "/v1/chat/completions", json=body)
                await r.content.readany()
                opened.append(r)

            await asyncio.gather(*(open_one() for _ in range(args.streams)))
            snap = await admin_replicas(s, url)
            running = sum(r["running"] for r in snap["replicas"])
            # Keep reading all streams for a few seconds so buffers are in their steady state.
            end = time.monotonic() + 5
            while time.monotonic() < end:
                await asyncio.gather(*(r.content.readany() for r in opened))
            held_rss = rss_kib(gw.pid)
            for r in opened:
                r.close()
            end = time.monotonic() + 60
            while True:
                snap = await admin_replicas(s, url)
                reserved = sum(r["reserved_tokens"] for r in snap["replicas"])
                if reserved == 0 or time.monotonic() > end:
                    break
                await asyncio.sleep(0.5)
    finally:
        gw.stop()
        for rep in replicas:
            rep.stop()
    return {
        "streams_opened": args.streams,
        "streams_running_at_kvgate": running,
        "rss_idle_kib": idle,
        "rss_with_streams_kib": held_rss,
        "kib_per_stream": round((held_rss - idle) / max(1, running), 1),
        "reserved_after_disconnect": reserved,
    }


def main() -> int:
    global MODEL_NAME
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--rate", type=float, default=6.0, help="requests/s (Poisson)")
    ap.add_argument("--streams", type=int, default=300)
    ap.add_argument("--profile", default="llama3-70b-h100x4")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "soak.json"))
    args = ap.parse_args()
    from enginesim.profiles import load_profile

    MODEL_NAME = load_profile(args.profile).served_model_name
    with tempfile.TemporaryDirectory(prefix="kvgate-soak-") as tmp:
        workdir = Path(tmp)
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        result = {"started": started, "commit": commit, "profile": args.profile, "seed": args.seed}
        result["soak"] = asyncio.run(soak(args, workdir))
        result["streams"] = asyncio.run(streams_phase(args, workdir))
        log = (workdir / "kvgate.log").read_text(errors="replace")
        result["kvgate_log_tracebacks"] = log.count("Traceback")
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    sk, st = result["soak"], result["streams"]
    print(json.dumps({k: v for k, v in sk.items() if k != "rss_kib_samples"}, indent=1))
    print(json.dumps(st, indent=1))
    ok = (
        sk["bad"] == 0
        and sk["end_reserved_tokens"] == 0
        and sk["client_outcomes_total"] == sk["sent"] == sk["kvgate_requests_counted"]
        and st["reserved_after_disconnect"] == 0
    )
    growth = sk["rss_growth_after_warmup"]
    print(f"RSS growth after warm-up: {growth:.2%} (target < 5%)" if growth is not None else "")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
