"""Scale-out: saturation requests/s at 1, 2 and 4 gateway processes on one port, and what
the Redis state backend adds to latency against the in-process one.

The rig is bench/overhead.py's (read it): a zero-latency nginx upstream answering every
POST from memory, ``wrk -t1 -c32`` for 5 s per measurement (closed loop, non-streamed
chat completions), an aiohttp open-loop client at a fixed rate for latency. Targets,
all running at once and measured one at a time, interleaved over the rounds:

- ``memory x1``: ``kvgate serve`` with the default in-process state (one process);
- ``redis xN`` for N = 1, 2, 4: ``kvgate serve --workers N`` with ``state.backend: redis``
  on a private ``redis-server`` (each target its own key prefix), all workers on one
  port (SO_REUSEPORT).

Latency: the open loop (default 500 requests/s) against ``straight`` (the upstream
itself), ``memory x1`` and ``redis x1``; reported as p50 and p99 and the difference
redis - memory. Leases are renewed in the background, so the request path of the redis
backend does what the memory one does; the difference is the lease loop's share of the
CPU and noise.

The machine's core count bounds what more processes can buy: with 2 cores, the client
(wrk), the upstream (nginx) and the workers share them. Medians of the rounds go to
``bench/results/scaleout.json`` and a Markdown table on stdout (the committed
``bench/results/scaleout.txt`` is that stdout). Every process this
starts is stopped by PID.

    .venv/bin/python bench/scaleout.py [--rounds 3] [--seconds 5] [--rate 500]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import (  # noqa: E402
    BODY_NONSTREAM,
    _wait_port,
    _wait_ready,
    open_loop,
    start_nginx,
    upstream_servers,
    wrk_rps,
)

from kvgate_demo.demo import Process, free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PATH = "/v1/chat/completions"


def start_redis(workdir: Path, port: int) -> Process:
    popen = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    return Process("redis", popen, "")


def start_kvgate(
    workdir: Path, name: str, port: int, upstream_port: int, workers: int, redis_url: str | None
) -> Process:
    cfg: dict = {
        "listen": {"host": "127.0.0.1", "port": port},
        "replicas": [
            {
                "name": "upstream",
                "url": f"http://127.0.0.1:{upstream_port}",
                "engine": "openai",
                "pool_tokens": 1_000_000_000,
                "max_running": 100_000,
            }
        ],
        "logging": {"level": "warning", "access_log": False},
    }
    if redis_url is not None:
        cfg["state"] = {"backend": "redis", "redis_url": redis_url, "key_prefix": f"bench-{name}"}
    path = workdir / f"{name}.yaml"
    path.write_text(json.dumps(cfg))
    popen = subprocess.Popen(
        [str(ROOT / ".venv" / "bin" / "kvgate"), "serve", "--config", str(path),
         "--workers", str(workers)],
        stdout=subprocess.DEVNULL,
        stderr=open(workdir / f"{name}.log", "wb"),  # noqa: SIM115 - closed with the process
    )  # fmt: skip
    return Process(name, popen, "")


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5.0, help="length of each measurement")
    ap.add_argument("--rate", type=float, default=500.0, help="open-loop requests/s")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--out", type=Path, default=RESULTS / "scaleout.json")
    args = ap.parse_args()
    for tool in ("nginx", "wrk", "redis-server"):
        if not shutil.which(tool):
            print(f"{tool} is not installed: apt-get install -y nginx wrk redis-server")
            return 2
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    workdir = Path(tempfile.mkdtemp(prefix="kvgate-scaleout-"))
    workdir.chmod(0o755)  # nginx workers drop root and must read the stream body
    up_ns, up_st, redis_port = free_port(), free_port(), free_port()
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    targets = {
        "memory x1": (free_port(), 1, None),
        "redis x1": (free_port(), 1, redis_url),
        "redis x2": (free_port(), 2, redis_url),
        "redis x4": (free_port(), 4, redis_url),
    }
    procs: list[Process] = []
    try:
        procs.append(start_nginx(workdir, "upstream", upstream_servers(workdir, up_ns, up_st)))
        procs.append(start_redis(workdir, redis_port))
        _wait_port(up_ns)
        _wait_port(redis_port)
        for name, (port, workers, url) in targets.items():
            procs.append(start_kvgate(workdir, name.replace(" ", "-"), port, up_ns, workers, url))
        for port, _, _ in targets.values():
            _wait_port(port, 30.0)
            asyncio.run(_wait_ready(f"http://127.0.0.1:{port}/ready"))

        rps: dict[str, list[float]] = {t: [] for t in targets}
        lat: dict[str, list[dict]] = {t: [] for t in ("straight", "memory x1", "redis x1")}
        for rnd in range(args.rounds):
            order = list(targets.items())
            if rnd % 2:
                order.reverse()  # interleaved: no target always runs first or last
            for name, (port, _, _) in order:
                url = f"http://127.0.0.1:{port}{PATH}"
                r = wrk_rps(url, BODY_NONSTREAM, args.seconds, workdir, args.connections)
                rps[name].append(r)
                print(f"round {rnd + 1} {name:9s} saturation {r:8.0f} req/s", flush=True)
            lat_order = list(lat)
            if rnd % 2:
                lat_order.reverse()  # interleaved too: the order itself moved p50 by 0.3 ms
            for name in lat_order:
                port = up_ns if name == "straight" else targets[name][0]
                url = f"http://127.0.0.1:{port}{PATH}"
                ol = asyncio.run(open_loop(url, BODY_NONSTREAM, args.rate, args.seconds))
                row = {
                    "p50_ms": ol.pct(ol.latencies, 0.50) * 1e3,
                    "p99_ms": ol.pct(ol.latencies, 0.99) * 1e3,
                    "errors": ol.errors,
                    "late_starts": ol.late_starts,
                    "n": len(ol.latencies),
                }
                lat[name].append(row)
                print(
                    f"round {rnd + 1} {name:9s} open-loop p50 {row['p50_ms']:.3f} ms "
                    f"p99 {row['p99_ms']:.3f} ms errors {ol.errors}",
                    flush=True,
                )
    finally:
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    med = statistics.median
    s = {t: med(v) for t, v in rps.items()}
    base = s["redis x1"]
    lines = [
        f"| saturation, non-stream, wrk -c{args.connections} | req/s | vs redis x1 |",
        "| --- | ---: | ---: |",
    ]
    for t, v in s.items():
        lines.append(f"| {t} | {v:.0f} | {v / base:.2f}x |")
    m = {t: {k: med(r[k] for r in rows) for k in ("p50_ms", "p99_ms")} for t, rows in lat.items()}
    lines += [
        "",
        f"| open loop {args.rate:.0f} req/s | straight | memory x1 | redis x1 | redis - memory |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for key in ("p50_ms", "p99_ms"):
        lines.append(
            f"| {key.replace('_ms', '')} | {m['straight'][key]:.3f} ms | "
            f"{m['memory x1'][key]:.3f} ms | {m['redis x1'][key]:.3f} ms | "
            f"{m['redis x1'][key] - m['memory x1'][key]:+.3f} ms |"
        )
    summary = {
        "rounds": args.rounds,
        "seconds": args.seconds,
        "rate": args.rate,
        "connections": args.connections,
        "cpus": os.cpu_count(),
        "rps": s,
        "scale_2_over_1": s["redis x2"] / base,
        "scale_4_over_1": s["redis x4"] / base,
        "latency": m,
        "raw": {"rps": rps, "latency": lat},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    print()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
