"""A real monitoring stack on loopback, for the deploy tests and docs/deploy.md's screenshot.

Starts two `enginesim` replicas (tiny profile) and a third that answers every
completion with a 500 (so upstream errors and outlier ejections happen), `kvgate serve`
in front of them, and Debian's `prometheus` scraping kvgate every second with kvgate's
alert rules loaded; drives a short streaming load through kvgate with a queue timeout
short enough that some requests are shed; then evaluates every Grafana panel's PromQL
through Prometheus's HTTP API (`/api/v1/query_range`, as Grafana does).

Every process is started here and stopped by its own PID. Run as a script it prints
what each panel returned and, with ``--hold S``, keeps the stack up for S seconds (for a
screenshot of Prometheus's graph page).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml

from kvgate_demo.demo import Process as Proc
from kvgate_demo.demo import free_port
from tests.deploy.panels import ROOT, Target, declared_families, targets

MODEL = "tiny-llm"
SCRAPE_S = 1
RATE_INTERVAL = "10s"


@dataclass
class Stack:
    workdir: Path
    procs: list[Proc] = field(default_factory=list)
    gateway: str = ""
    prometheus: str = ""
    faulty: str = ""  # the replica whose engine fails for the first half of the load
    consoles: Path | None = None  # Prometheus's console templates folder

    async def fault(self, mode: str) -> None:
        """Set the faulty replica's fault (enginesim's POST /admin/faults)."""
        body = {"mode": mode, "status": 500} if mode == "error" else {"mode": mode}
        async with aiohttp.ClientSession() as s:
            async with s.post(self.faulty + "/admin/faults", json=body) as r:
                assert r.status == 200, await r.text()

    def start(self, argv: list[str], name: str, url: str) -> Proc:
        log = (self.workdir / f"{name}.log").open("wb")
        p = Proc(name, subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT), url)
        self.procs.append(p)
        return p

    def stop(self) -> None:
        """SIGTERM to every process first, then wait for each (killed after 10 s): the
        stops overlap instead of adding up."""
        running = [p for p in reversed(self.procs) if p.popen.poll() is None]
        for p in running:
            with contextlib.suppress(ProcessLookupError):
                p.popen.send_signal(signal.SIGTERM)
        for p in running:
            try:
                p.popen.wait(10)
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait(10)

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""


async def wait_ok(url: str, proc: Proc, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}")
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not answer 200 within {limit_s:.0f} s")


# Two tenants with SLO targets (the attainment panel), each user sending with one key.
TENANTS = {
    "team-a": {"key": "sk-live-team-a", "slo": {"ttft_s": 1.0, "e2e_s": 10.0}},
    "team-b": {"key": "sk-live-team-b", "slo": {"ttft_s": 0.05}},
}


def gateway_config(replicas: dict[str, str], port: int) -> dict:
    # Shared state on Redis when the suite provides one (scripts/test.sh does), under a
    # key prefix of this run's own.
    redis_url = os.environ.get("KVGATE_REDIS_URL")
    state = (
        {"backend": "redis", "redis_url": redis_url, "key_prefix": f"kvgate-live-{port}"}
        if redis_url
        else {"backend": "memory"}
    )
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "state": state,
        "tenants": [
            {"name": name, "keys_sha256": [hashlib.sha256(t["key"].encode()).hexdigest()]}
            | {"slo": t["slo"]}
            for name, t in TENANTS.items()
        ],
        "replicas": [{"name": n, "url": u} for n, u in replicas.items()],
        "discovery": {"refresh_interval_s": 0.5, "probe_timeout_s": 1.0},
        "outlier": {
            "consecutive_failures": 2,
            "base_ejection_s": 6.0,
            "max_ejection_s": 12.0,
            "max_ejection_percent": 50.0,
        },
        "upstream": {"first_byte_s": 10.0, "idle_s": 10.0, "total_s": 30.0},
        "logging": {"level": "warning", "access_log": False},
        # Stop at once on SIGTERM (the default keeps the listener 2 s for load balancers).
        "shutdown": {"listen_grace_s": 0.0},
    }


def prometheus_config(gateway_hostport: str) -> dict:
    return {
        "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
        "rule_files": ["alerts.yaml"],
        "scrape_configs": [
            {"job_name": "kvgate", "static_configs": [{"targets": [gateway_hostport]}]}
        ],
    }


@contextlib.contextmanager
def stack_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="kvgate-live-") as d:
        yield Path(d)


async def start_stack(st: Stack, speed: float = 2.0) -> None:
    """Prometheus first, scraping the port kvgate will listen on: it reads its targets
    only some 5 s after it starts, and the replicas and kvgate start meanwhile (the
    replicas all at once). The scrapes before kvgate listens find it down."""
    prom_exe = shutil.which("prometheus")
    if prom_exe is None:
        raise RuntimeError("prometheus not found: apt-get install prometheus")
    workdir = st.workdir
    py = sys.executable
    port = free_port()
    st.gateway = f"http://127.0.0.1:{port}"

    promdir = workdir / "prometheus"
    promdir.mkdir()
    shutil.copy(ROOT / "deploy" / "prometheus" / "alerts.yaml", promdir / "alerts.yaml")
    (promdir / "prometheus.yml").write_text(yaml.safe_dump(prometheus_config(f"127.0.0.1:{port}")))
    pport = free_port()
    st.prometheus = f"http://127.0.0.1:{pport}"
    # Console templates (deploy tests' screenshot: tests/deploy/screenshot.py) go here.
    for d in ("consoles", "console_libraries"):
        (promdir / d).mkdir()
    st.consoles = promdir / "consoles"
    argv = [
        prom_exe,
        f"--config.file={promdir / 'prometheus.yml'}",
        f"--storage.tsdb.path={promdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{pport}",
        f"--web.console.templates={promdir / 'consoles'}",
        f"--web.console.libraries={promdir / 'console_libraries'}",
        "--storage.tsdb.retention.time=1h",
    ]
    prom = st.start(argv, "prometheus", st.prometheus)

    replicas: dict[str, str] = {}
    started: list[Awaitable[None]] = []
    for name in ("replica-a", "replica-b", "replica-bad"):
        rport = free_port()
        url = f"http://127.0.0.1:{rport}"
        argv = [py, "-m", "enginesim", "serve", "--profile", "tiny", "--port", str(rport)]
        argv += ["--speed", str(speed), "--log-level", "WARNING"]
        p = st.start(argv, name, url)
        started.append(wait_ok(url + "/v1/models", p))
        replicas[name] = url
    await asyncio.gather(*started)
    cfg = workdir / "kvgate.yaml"
    cfg.write_text(yaml.safe_dump(gateway_config(replicas, port)))
    st.faulty = replicas["replica-bad"]
    gw = st.start([py, "-m", "gateway.cli", "serve", "--config", str(cfg)], "kvgate", st.gateway)
    await wait_ok(st.gateway + "/ready", gw)
    await wait_ok(st.prometheus + "/-/ready", prom)
    await first_scrape(st.prometheus)


async def first_scrape(prometheus: str, limit_s: float = 30.0) -> None:
    """Wait until Prometheus has scraped kvgate once, so the run's start is on record."""
    deadline = time.monotonic() + limit_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            params = {"query": 'up{job="kvgate"} == 1'}
            async with s.get(prometheus + "/api/v1/query", params=params) as r:
                if (await r.json())["data"]["result"]:
                    return
            await asyncio.sleep(0.2)
    raise RuntimeError(f"Prometheus did not scrape kvgate within {limit_s:.0f} s")


@dataclass
class LoadResult:
    sent: int = 0
    ok: int = 0
    shed: int = 0
    other: dict[int, int] = field(default_factory=dict)


async def drive_load(gateway: str, seconds: float, concurrency: int = 40) -> LoadResult:
    """Closed-loop streaming clients, more than three times what the two tiny pools hold at
    once (about six each), so many queue, and a short queue timeout lets kvgate shed some
    (with 20, kvgate served every queued one within its 0.3 s in 2 runs of 3: no shed to
    show on the panel)."""
    res = LoadResult()
    end = time.monotonic() + seconds
    keys = [t["key"] for t in TENANTS.values()]

    async def user(i: int, s: aiohttp.ClientSession) -> None:
        headers = {
            "x-kvgate-queue-timeout": "0.3",
            "Authorization": f"Bearer {keys[i % len(keys)]}",
        }
        n = 0
        while time.monotonic() < end and n < 10_000:
            n += 1
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"user {i} turn {n} " + "word " * 300}],
                "max_tokens": 60 + (i * 17 + n * 31) % 120,
                "stream": True,
            }
            res.sent += 1
            async with s.post(gateway + "/v1/chat/completions", json=body, headers=headers) as r:
                await r.read()
                if r.status == 200:
                    res.ok += 1
                elif r.status in (429, 503):
                    res.shed += 1
                    await asyncio.sleep(min(float(r.headers.get("Retry-After", "1")), 1.0))
                else:
                    res.other[r.status] = res.other.get(r.status, 0) + 1

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        await asyncio.gather(*(user(i, s) for i in range(concurrency)))
    return res


@dataclass
class PanelResult:
    target: Target
    series: int
    points: int  # non-NaN values over the range
    pending: bool  # reads a metric family kvgate does not declare on this branch

    def line(self) -> str:
        state = "PENDING" if self.pending else ("ok" if self.points else "NO DATA")
        return (
            f"{state:8} {self.series:3d} series {self.points:5d} points  "
            f"{self.target.panel} [{self.target.ref}]"
        )


async def query_panels(prometheus: str, start: float, end: float) -> list[PanelResult]:
    declared = declared_families()
    out = []
    async with aiohttp.ClientSession() as s:
        for t in targets():
            params = {
                "query": t.promql(RATE_INTERVAL),
                "start": f"{start:.3f}",
                "end": f"{end:.3f}",
                "step": "1",
            }
            async with s.get(prometheus + "/api/v1/query_range", params=params) as r:
                body = await r.json()
            if body.get("status") != "success":
                raise AssertionError(f"{t.panel} [{t.ref}]: {body}")
            result = body["data"]["result"]
            points = sum(
                1 for series in result for _, v in series["values"] if not math.isnan(float(v))
            )
            out.append(PanelResult(t, len(result), points, not t.families <= declared))
    return out


async def alert_states(prometheus: str, start: float, end: float) -> dict[str, set[str]]:
    """Every alert Prometheus evaluated as pending or firing during the run (its ALERTS
    series), by name."""
    params = {"query": "ALERTS", "start": f"{start:.3f}", "end": f"{end:.3f}", "step": "1"}
    async with aiohttp.ClientSession() as s:
        async with s.get(prometheus + "/api/v1/query_range", params=params) as r:
            body = await r.json()
    out: dict[str, set[str]] = {}
    for series in body["data"]["result"]:
        m = series["metric"]
        out.setdefault(m["alertname"], set()).add(m["alertstate"])
    return out


async def alerts(prometheus: str) -> list[dict]:
    async with aiohttp.ClientSession() as s, s.get(prometheus + "/api/v1/rules") as r:
        body = await r.json()
    return [rule for g in body["data"]["groups"] for rule in g["rules"]]


async def run(
    load_s: float = 20.0,
    hold_s: float = 0.0,
    after: Callable[[Stack], Awaitable[None]] | None = None,
) -> dict:
    """Start the stack, load it, query every panel; `after` runs while it is still up."""
    with stack_dir() as workdir:
        st = Stack(workdir)
        try:
            await start_stack(st)
            start = time.time()
            # replica-bad answers 500 for the first half of the load (upstream errors,
            # an ejection), then recovers.
            await st.fault("error")
            load_task = asyncio.ensure_future(drive_load(st.gateway, load_s))
            await asyncio.sleep(load_s / 2)
            await st.fault("none")
            load = await load_task
            await asyncio.sleep(3 * SCRAPE_S)  # the last scrapes after the load
            panels = await query_panels(st.prometheus, start - 5, time.time())
            rules = await alerts(st.prometheus)
            seen = await alert_states(st.prometheus, start - 5, time.time())
            summary = {
                "load": load.__dict__,
                "panels": [p.line() for p in panels],
                "rules": {r["name"]: r.get("health") for r in rules},
                "alerts_seen": {k: sorted(v) for k, v in seen.items()},
                "results": panels,
            }
            if after is not None:
                await after(st)
            if hold_s > 0:
                print(f"prometheus {st.prometheus}  kvgate {st.gateway}", flush=True)
                await asyncio.sleep(hold_s)
            return summary
        except Exception:
            for name in (p.name for p in st.procs):
                print(f"--- {name} log ---\n{st.log(name)}", file=sys.stderr)
            raise
        finally:
            st.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--load", type=float, default=20.0, help="seconds of load")
    ap.add_argument("--hold", type=float, default=0.0, help="keep the stack up this long")
    ap.add_argument("--report", type=Path, default=None)
    args = ap.parse_args()
    summary = asyncio.run(run(args.load, args.hold))
    text = [f"load: {json.dumps(summary['load'])}", *summary["panels"]]
    text += [f"rule {k}: {v}" for k, v in summary["rules"].items()]
    text += [f"alert seen {k}: {v}" for k, v in summary["alerts_seen"].items()]
    print("\n".join(text))
    if args.report is not None:
        args.report.write_text("\n".join(text) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
