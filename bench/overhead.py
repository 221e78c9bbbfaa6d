"""What kvgate costs on the request path: kvgate vs nginx vs straight, side by side.

The upstream is a zero-latency OpenAI-shaped server: an nginx instance that answers every
POST from memory (a chat completion, or a 64-chunk SSE stream), so neither proxy waits on
an engine and the measured difference is the proxy's own work. Three targets are measured
in the same run, interleaved, several rounds each:

- ``straight``: the client talks to the upstream directly;
- ``nginx``: Debian's nginx as a plain reverse proxy (one worker, keep-alive upstream pool,
  ``proxy_buffering off`` so streams are relayed as they come);
- ``kvgate``: ``kvgate serve`` (one process, uvloop) with the upstream as an ``openai``
  replica whose pool is pinned large, so admission always admits but still runs: token
  estimate, ledger reserve and release, picker, usage injection and stripping.

(a) Saturation: requests/s at concurrency 32 with ``wrk`` (closed loop).
(b) Latency: an open-loop load at a fixed rate (default 500 requests/s) from an aiohttp
    client; added latency over ``straight`` at p50 and p99, and added time to first token
    on streams.

Access logs are off on both proxies. Everything runs on 127.0.0.1; every process this
script starts is stopped by PID at the end. Results go to ``bench/results/overhead.json``
and a Markdown table on stdout.

    .venv/bin/python bench/overhead.py [--rounds 3] [--seconds 5] [--rate 500]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvgate_demo.demo import Process, free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MODEL = "bench-model"
STREAM_CHUNKS = 64

BODY_NONSTREAM = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Say hello in one word."}],
    "max_tokens": 16,
}
BODY_STREAM = {**BODY_NONSTREAM, "max_tokens": STREAM_CHUNKS, "stream": True}


def _nginx_str(s: str) -> str:
    """Quote a string for an nginx ``return`` directive."""
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _completion_json() -> str:
    return json.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 1,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "Hello"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13},
        },
        separators=(",", ":"),
    )


def _stream_body() -> str:
    """64 content chunks, a finish chunk, the usage chunk and [DONE], as vLLM sends them."""
    events = []
    base = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
    for i in range(STREAM_CHUNKS):
        delta = {"content": " tok"} if i else {"role": "assistant", "content": "tok"}
        events.append({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
    events.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
    events.append(
        {
            **base,
            "choices": [],
            "usage": {"prompt_tokens": 12, "completion_tokens": STREAM_CHUNKS, "total_tokens": 76},
        }
    )
    out = "".join(f"data: {json.dumps(e, separators=(',', ':'))}\n\n" for e in events)
    return out + "data: [DONE]\n\n"


MODELS_JSON = json.dumps(
    {"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 8192}]}
)


def _wait_port(port: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def start_nginx(workdir: Path, name: str, servers: str) -> Process:
    conf = workdir / f"{name}.conf"
    conf.write_text(
        f"""
worker_processes 1;
error_log {workdir}/{name}.error.log warn;
pid {workdir}/{name}.pid;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  client_body_temp_path {workdir}/{name}.body;
  proxy_temp_path {workdir}/{name}.proxy;
  fastcgi_temp_path {workdir}/{name}.fcgi;
  uwsgi_temp_path {workdir}/{name}.uwsgi;
  scgi_temp_path {workdir}/{name}.scgi;
  keepalive_requests 10000000;
  {servers}
}}
"""
    )
    popen = subprocess.Popen(
        ["nginx", "-p", str(workdir), "-c", str(conf), "-g", "daemon off;"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return Process(name, popen, "")


def upstream_servers(workdir: Path, port_ns: int, port_st: int) -> str:
    # nginx's static module answers POST with 405; error_page turns that into a 200 with
    # the file's bytes, which is how a stream body too long for a `return` is served.
    (workdir / "stream.sse").write_text(_stream_body())
    return f"""
  server {{
    listen 127.0.0.1:{port_ns};
    default_type application/json;
    location = /v1/models {{ return 200 {_nginx_str(MODELS_JSON)}; }}
    location = /health {{ return 200 ''; }}
    location / {{ return 200 {_nginx_str(_completion_json())}; }}
  }}
  server {{
    listen 127.0.0.1:{port_st};
    location = /v1/models {{ default_type application/json; return 200 {_nginx_str(MODELS_JSON)}; }}
    location = /health {{ return 200 ''; }}
    location / {{ default_type text/event-stream; root {workdir}; try_files /stream.sse =404;
                  error_page 405 =200 $uri; }}
    location = /v1/chat/completions {{ default_type text/event-stream; root {workdir};
                  try_files /stream.sse =404; error_page 405 =200 /stream.sse; }}
    location = /stream.sse {{ default_type text/event-stream; root {workdir}; }}
  }}
"""


def proxy_servers(pairs: list[tuple[int, int]]) -> str:
    out = []
    for i, (listen, upstream) in enumerate(pairs):
        out.append(
            f"""
  upstream up{i} {{ server 127.0.0.1:{upstream}; keepalive 128; }}
  server {{
    listen 127.0.0.1:{listen};
    location / {{
      proxy_pass http://up{i};
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }}
  }}"""
        )
    return "\n".join(out)


def start_kvgate(workdir: Path, name: str, port: int, upstream_port: int) -> Process:
    cfg = workdir / f"{name}.yaml"
    cfg.write_text(
        json.dumps(
            {
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
        )
    )
    popen = subprocess.Popen(
        [str(ROOT / ".venv" / "bin" / "kvgate"), "serve", "--config", str(cfg)],
        stdout=subprocess.DEVNULL,
        stderr=open(workdir / f"{name}.log", "wb"),  # noqa: SIM115 - closed with the process
    )
    return Process(name, popen, "")


async def _wait_ready(url: str, limit_s: float = 20.0) -> None:
    deadline = time.monotonic() + limit_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {limit_s}s")


def wrk_rps(url: str, body: dict, seconds: float, workdir: Path, connections: int = 32) -> float:
    script = workdir / "post.lua"
    script.write_text(
        "wrk.method = 'POST'\n"
        f"wrk.body = '{json.dumps(body)}'\n"
        "wrk.headers['Content-Type'] = 'application/json'\n"
    )
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "-s", str(script), url],
        capture_output=True,
        text=True,
        check=True,
        timeout=seconds + 30,
    ).stdout
    m = re.search(r"Requests/sec:\s*([\d.]+)", out)
    non2xx = re.search(r"Non-2xx or 3xx responses:\s*(\d+)", out)
    if not m:
        raise RuntimeError(f"wrk printed no rate:\n{out}")
    if non2xx and int(non2xx.group(1)) > 0:
        raise RuntimeError(f"{url}: {non2xx.group(1)} non-2xx responses under wrk:\n{out}")
    return float(m.group(1))


@dataclass
class OpenLoopResult:
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    errors: int = 0
    late_starts: int = 0

    def pct(self, values: list[float], q: float) -> float:
        if not values:
            return float("nan")
        s = sorted(values)
        return s[min(len(s) - 1, int(q * len(s)))]


async def open_loop(url: str, body: dict, rate: float, seconds: float) -> OpenLoopResult:
    """Fire requests on a fixed schedule (not waiting for answers) and time each one.

    Times come from `time.perf_counter` (uvloop's `loop.time()` has millisecond
    resolution, too coarse for sub-millisecond differences). Latency counts from the
    scheduled send time, so a client that falls behind its schedule shows it."""
    res = OpenLoopResult()
    payload = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    clock = time.perf_counter
    async with aiohttp.ClientSession(connector=conn) as session:
        # Warm the connection pool so connection set-up is not measured.
        for resp in await asyncio.gather(
            *(session.post(url, data=payload, headers=headers) for _ in range(16))
        ):
            await resp.read()

        async def one(scheduled: float) -> None:
            if clock() - scheduled > 0.002:
                res.late_starts += 1
            try:
                async with session.post(url, data=payload, headers=headers) as r:
                    first = None
                    async for _chunk in r.content.iter_any():
                        if first is None:
                            first = clock()
                    end = clock()
                    if r.status != 200:
                        res.errors += 1
                        return
                res.latencies.append(end - scheduled)
                if first is not None:
                    res.ttfts.append(first - scheduled)
            except aiohttp.ClientError:
                res.errors += 1

        n = int(rate * seconds)
        t0 = clock() + 0.05
        tasks = []
        for i in range(n):
            at = t0 + i / rate
            delay = at - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(at)))
        await asyncio.gather(*tasks)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5.0, help="length of each measurement")
    ap.add_argument("--rate", type=float, default=500.0, help="open-loop requests/s")
    ap.add_argument("--out", type=Path, default=RESULTS / "overhead.json")
    args = ap.parse_args()
    for tool in ("nginx", "wrk"):
        if not shutil.which(tool):
            print(f"{tool} is not installed: apt-get install -y nginx wrk", file=sys.stderr)
            return 2
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    workdir = Path(tempfile.mkdtemp(prefix="kvgate-bench-"))
    workdir.chmod(0o755)  # nginx workers drop root and must read the stream body
    up_ns, up_st = free_port(), free_port()
    ngx_ns, ngx_st = free_port(), free_port()
    kv_ns, kv_st = free_port(), free_port()
    procs: list[Process] = []
    try:
        procs.append(start_nginx(workdir, "upstream", upstream_servers(workdir, up_ns, up_st)))
        procs.append(
            start_nginx(workdir, "proxy", proxy_servers([(ngx_ns, up_ns), (ngx_st, up_st)]))
        )
        procs.append(start_kvgate(workdir, "kvgate-ns", kv_ns, up_ns))
        procs.append(start_kvgate(workdir, "kvgate-st", kv_st, up_st))
        for p in (up_ns, up_st, ngx_ns, ngx_st, kv_ns, kv_st):
            _wait_port(p)
        asyncio.run(_wait_ready(f"http://127.0.0.1:{kv_ns}/ready"))
        asyncio.run(_wait_ready(f"http://127.0.0.1:{kv_st}/ready"))

        targets = {
            "straight": {"ns": up_ns, "st": up_st},
            "nginx": {"ns": ngx_ns, "st": ngx_st},
            "kvgate": {"ns": kv_ns, "st": kv_st},
        }
        path = "/v1/chat/completions"
        rps: dict[str, dict[str, list[float]]] = {t: {"ns": [], "st": []} for t in targets}
        lat: dict[str, dict[str, list[dict]]] = {t: {"ns": [], "st": []} for t in targets}
        for rnd in range(args.rounds):
            for kind, body in (("ns", BODY_NONSTREAM), ("st", BODY_STREAM)):
                for name, ports in targets.items():
                    url = f"http://127.0.0.1:{ports[kind]}{path}"
                    r = wrk_rps(url, body, args.seconds, workdir)
                    rps[name][kind].append(r)
                    print(f"round {rnd + 1} {kind} {name:8s} saturation {r:9.0f} req/s", flush=True)
                for name, ports in targets.items():
                    url = f"http://127.0.0.1:{ports[kind]}{path}"
                    ol = asyncio.run(open_loop(url, body, args.rate, args.seconds))
                    row = {
                        "p50_ms": ol.pct(ol.latencies, 0.50) * 1e3,
                        "p99_ms": ol.pct(ol.latencies, 0.99) * 1e3,
                        "ttft_p50_ms": ol.pct(ol.ttfts, 0.50) * 1e3,
                        "errors": ol.errors,
                        "late_starts": ol.late_starts,
                        "n": len(ol.latencies),
                    }
                    lat[name][kind].append(row)
                    print(
                        f"round {rnd + 1} {kind} {name:8s} open-loop p50 {row['p50_ms']:.3f} ms "
                        f"p99 {row['p99_ms']:.3f} ms ttft50 {row['ttft_p50_ms']:.3f} ms "
                        f"errors {ol.errors}",
                        flush=True,
                    )
    finally:
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    med = statistics.median
    summary: dict = {
        "rounds": args.rounds,
        "seconds": args.seconds,
        "rate": args.rate,
        "cpus": os.cpu_count(),
    }
    lines = [
        "| case | straight | nginx | kvgate | kvgate / nginx |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for kind, label in (("ns", "non-stream"), ("st", f"stream ({STREAM_CHUNKS} chunks)")):
        s = {t: med(rps[t][kind]) for t in targets}
        summary[f"rps_{kind}"] = s
        lines.append(
            f"| saturation req/s, c=32, {label} | {s['straight']:.0f} | {s['nginx']:.0f} | "
            f"{s['kvgate']:.0f} | {s['kvgate'] / s['nginx']:.2f}x |"
        )
    lines += [
        "",
        f"| open loop {args.rate:.0f} req/s | nginx added | kvgate added | target |",
        "| --- | ---: | ---: | ---: |",
    ]
    for kind, label in (("ns", "non-stream"), ("st", "stream")):
        m = {
            t: {k: med(r[k] for r in lat[t][kind]) for k in ("p50_ms", "p99_ms", "ttft_p50_ms")}
            for t in targets
        }
        summary[f"latency_{kind}"] = m
        for key, target in (("p50_ms", "<= 1 ms"), ("p99_ms", "<= 5 ms")) + (
            (("ttft_p50_ms", "<= 1 ms"),) if kind == "st" else ()
        ):
            lines.append(
                f"| {label} {key.replace('_ms', '')} | {m['nginx'][key] - m['straight'][key]:+.3f} ms | "
                f"{m['kvgate'][key] - m['straight'][key]:+.3f} ms | {target} |"
            )
    summary["raw"] = {"rps": rps, "latency": lat}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    print()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
