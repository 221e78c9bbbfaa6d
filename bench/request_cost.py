"""Request cost: machine instructions a whole ``kvgate serve`` process spends per request,
for this checkout and others side by side (callgrind), repeatable where wall time is not.

`bench/overhead.py` measures requests/s at saturation, which on a shared 2-core machine
moves by 10-30% from one round to the next (wrk, nginx and kvgate share the cores).
This counts instead: each kvgate runs under ``valgrind --tool=callgrind`` in front of the
zero-latency nginx upstream of `bench/overhead.py`, a sequential keep-alive aiohttp
client sends ``--warmup`` requests, the counters are zeroed (``callgrind_control -z``),
``--requests`` more are sent and the counters dumped: the instructions of the process
(event loop, aiohttp, kvgate, discovery timers) divided by the requests. Non-stream and
stream (64 chunks) requests, each kind on a fresh process. Repeat runs of one checkout
agree within 0.5%.

Every request states a read timeout (``x-stainless-read-timeout``, as the openai SDK
does), so each checkout's work per request is the same whatever it learns of clients; a
fresh process per kind keeps one kind's learning out of the other's.

    .venv/bin/python bench/request_cost.py [--requests 500] [--baseline-src DIR ...]

``--baseline-src`` takes other checkouts (e.g. ``git worktree add /tmp/pre <commit>``);
they run on this venv's packages. Results: bench/results/request_cost.json and a
Markdown table with each checkout's ratio to the first baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.overhead import (  # noqa: E402
    BODY_NONSTREAM,
    BODY_STREAM,
    _wait_port,
    start_nginx,
    upstream_servers,
)
from kvgate_demo.demo import free_port  # noqa: E402

STATED = {"x-stainless-read-timeout": "600"}


async def drive(url: str, body: dict, n: int) -> None:
    async with aiohttp.ClientSession(headers=STATED) as s:
        for _ in range(n):
            async with s.post(url, json=body) as r:
                await r.read()
                if r.status != 200:
                    raise SystemExit(f"{url}: {r.status} {await r.text()}")


def instructions(dump: Path) -> int:
    for line in dump.read_text().splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise SystemExit(f"no summary in {dump}")


def one(src: Path, kind: str, upstream: int, requests: int, warmup: int, work: Path) -> float:
    """Instructions per request of one fresh kvgate from `src`."""
    port = free_port()
    cfg = work / f"{kind}.json"
    cfg.write_text(
        json.dumps(
            {
                "listen": {"host": "127.0.0.1", "port": port},
                "replicas": [
                    {
                        "name": "upstream0",
                        "url": f"http://127.0.0.1:{upstream}",
                        "engine": "openai",
                        "pool_tokens": 1_000_000_000,
                        "max_running": 100_000,
                    }
                ],
                "logging": {"level": "warning", "access_log": False},
            }
        )
    )
    out = work / f"callgrind.{kind}.{time.monotonic_ns()}"
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable]
    cmd += ["-c", "from gateway.cli import main; raise SystemExit(main())"]
    cmd += ["serve", "--config", str(cfg)]
    with (work / f"{kind}.log").open("wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=str(src), env=dict(os.environ, PYTHONPATH=str(src)), stdout=log, stderr=log
        )
    try:
        _wait_port(port, timeout=120)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        body = BODY_STREAM if kind == "stream" else BODY_NONSTREAM
        asyncio.run(drive(url, body, warmup))
        subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
        asyncio.run(drive(url, body, requests))
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
        time.sleep(0.5)
        dumps = sorted(work.glob(f"{out.name}*"), key=lambda p: p.stat().st_mtime)
        return instructions(dumps[-1]) / requests
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--baseline-src", type=Path, nargs="*", default=[])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "request_cost.json")
    args = ap.parse_args()
    for tool in ("valgrind", "callgrind_control", "nginx"):
        if subprocess.run(["which", tool], capture_output=True).returncode:
            print(f"{tool} is not installed", file=sys.stderr)
            return 2
    work = Path(tempfile.mkdtemp(prefix="kvgate-request-cost-"))
    work.chmod(0o755)  # nginx's worker reads its files as another user
    up = {"non-stream": free_port(), "stream": free_port()}
    nginx = start_nginx(work, "upstream", upstream_servers(work, up["non-stream"], up["stream"]))
    sources = [*args.baseline_src, ROOT]
    rows = []
    try:
        for port in up.values():
            _wait_port(port)
        for src in sources:
            row = {"src": str(src), "commit": _commit(src)}
            for kind, port in up.items():
                row[kind] = one(src, kind, port, args.requests, args.warmup, work)
                print(f"{row['commit']} {kind}: {row[kind]:,.0f} instructions/request", flush=True)
            rows.append(row)
    finally:
        nginx.stop()
    args.out.write_text(json.dumps({"requests": args.requests, "rows": rows}, indent=2) + "\n")
    base = rows[0]
    print("\n| checkout | non-stream instr/request | stream (64 chunks) | vs first |")
    print("| --- | ---: | ---: | ---: |")
    for r in rows:
        ratio = "/".join(f"{r[k] / base[k]:.3f}" for k in up)
        print(f"| {r['commit']} | {r['non-stream']:,.0f} | {r['stream']:,.0f} | {ratio} |")
    return 0


def _commit(src: Path) -> str:
    got = subprocess.run(
        ["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return got.stdout.strip() or str(src)


if __name__ == "__main__":
    raise SystemExit(main())
