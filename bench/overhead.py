"""What kvgate costs on the request path, side by side with what a user would run instead.

Contenders, all in the same run, with the same clients and timeouts:

- ``straight``: the client talks to an upstream directly (the floor);
- ``nginx``: Debian's nginx as a plain reverse proxy (one worker, keep-alive upstream
  pool, ``proxy_buffering off`` so streams are relayed as they come);
- ``bare``: a bare aiohttp + uvloop pass-through proxy of ~30 lines
  (`bench/bare_proxy.py`): what a user would write by hand, the floor a Python gateway
  starts from; kvgate's target is 0.8x its requests/s;
- ``kvgate``: ``kvgate serve`` (one process, uvloop), the upstreams as ``openai``
  replicas whose pools are pinned large, so admission always admits but still runs:
  validation, token estimate, classifier, ledger reserve and release, picker, usage
  injection and stripping, metrics;
- ``kvgate-main`` (with ``--baseline-src DIR``): the same from another checkout (main
  before this work), to show the change in the same run;
- ``vllm-router`` and ``sglang-router``: the Rust routers from PyPI, round robin, from
  the venv given by ``--routers-venv`` (``python -m venv V && V/bin/pip install
  vllm-router sglang-router``; not a kvgate dependency). Left out when absent.

Two upstream modes (``--upstreams``):

- ``nginx``: two nginx servers per kind answering from memory (a chat completion, or a
  64-chunk SSE stream in one read): the proxies' own work, with the upstream nearly free;
- ``python``: two zero-compute Python servers shaped like an engine's HTTP server
  (`bench/engine_backend.py`: parse the body, stream one write per event), as in front of
  vLLM or SGLang; streams arrive in many small reads. Every proxy round-robins over both.

Measured, interleaved per round (contenders in turn), medians of ``--rounds``:

(a) saturation: requests/s at concurrency 32 with ``wrk`` (closed loop, 2 s timeout);
(b) latency: an open-loop load at half the bare proxy's median saturation (measured in
    (a) of the same run; ``--rate`` overrides), and again at a light ``--low-rate``
    (200 req/s): added latency over ``straight`` at p50 and p99, and added time to first
    byte on streams. The client is one Python process speaking HTTP/1.1 on raw asyncio
    protocols (a fraction of aiohttp's cost per request); when it cannot keep the
    schedule, ``late`` counts the sends more than 2 ms behind it (the latency counts from
    the scheduled time, so falling behind shows);
(c) memory (python mode): RSS growth per idle keep-alive connection (500 held open) and
    per stream in flight (200 held open by the backend), per proxy process.

The machine is shared and has 2 cores: read the ratios between contenders of one run,
not the absolute numbers. Access logs are off everywhere. Everything runs on 127.0.0.1;
every process this script starts is stopped by PID at the end. Results go to
``bench/results/overhead.json`` and a Markdown summary on stdout.

    .venv/bin/python bench/overhead.py [--rounds 3] [--seconds 5] \\
        [--upstreams nginx,python] [--routers-venv /tmp/routers] [--baseline-src /work/main]
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
KINDS = ("ns", "st")
KIND_LABEL = {"ns": "non-stream", "st": f"stream ({STREAM_CHUNKS} chunks)"}

BODY_NONSTREAM = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Say hello in one word."}],
    "max_tokens": 16,
}
BODY_STREAM = {**BODY_NONSTREAM, "max_tokens": STREAM_CHUNKS, "stream": True}
BODIES = {"ns": BODY_NONSTREAM, "st": BODY_STREAM}


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


def _wait_port(port: int, timeout: float = 20.0) -> None:
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


def proxy_servers(pairs: list[tuple[int, list[int]]]) -> str:
    out = []
    for i, (listen, upstreams) in enumerate(pairs):
        servers = " ".join(f"server 127.0.0.1:{u};" for u in upstreams)
        out.append(
            f"""
  upstream up{i} {{ {servers} keepalive 128; }}
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


def start_kvgate(
    workdir: Path,
    name: str,
    port: int,
    upstream_ports: int | list[int],
    *,
    src: Path | None = None,
    workers: int | None = None,
    redis_url: str | None = None,
) -> Process:
    """``kvgate serve`` from this checkout, or from `src` (another checkout's code on this
    venv's packages); with `workers`, N processes sharing state in the Redis at
    `redis_url` (``kvgate serve --workers N`` needs the redis backend)."""
    ports = [upstream_ports] if isinstance(upstream_ports, int) else upstream_ports
    cfg = workdir / f"{name}.yaml"
    cfg.write_text(
        json.dumps(
            {
                "listen": {"host": "127.0.0.1", "port": port},
                "replicas": [
                    {
                        "name": f"upstream{i}",
                        "url": f"http://127.0.0.1:{p}",
                        "engine": "openai",
                        "pool_tokens": 1_000_000_000,
                        "max_running": 100_000,
                    }
                    for i, p in enumerate(ports)
                ],
                "logging": {"level": "warning", "access_log": False},
                **(
                    {"state": {"backend": "redis", "redis_url": redis_url, "key_prefix": name}}
                    if redis_url
                    else {}
                ),
            }
        )
    )
    cmd = [sys.executable, "-c", "from gateway.cli import main; raise SystemExit(main())"]
    cmd += ["serve", "--config", str(cfg)]
    if workers:
        cmd += ["--workers", str(workers)]
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(src)
    popen = subprocess.Popen(
        cmd,
        cwd=str(src or ROOT),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(workdir / f"{name}.log", "wb"),  # noqa: SIM115 - closed with the process
    )
    return Process(name, popen, "")


def start_python(workdir: Path, name: str, script: str, args: list[str]) -> Process:
    popen = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / script), *args],
        stdout=subprocess.DEVNULL,
        stderr=open(workdir / f"{name}.log", "wb"),  # noqa: SIM115 - closed with the process
    )
    return Process(name, popen, "")


def start_router(
    workdir: Path, name: str, venv: Path, port: int, upstream_ports: list[int]
) -> Process:
    """vllm-router or sglang-router, round robin, logs at warning, metrics on a free port."""
    urls = [f"http://127.0.0.1:{p}" for p in upstream_ports]
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls]
    common += ["--policy", "round_robin", "--prometheus-port", str(free_port())]
    if name.startswith("vllm-router"):
        cmd = [str(venv / "bin" / "vllm-router"), *common, "--log-level", "warning"]
    else:
        cmd = [str(venv / "bin" / "python"), "-m", "sglang_router.launch_router", *common]
        cmd += ["--log-level", "warn"]
    popen = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=open(workdir / f"{name}.log", "wb"),  # noqa: SIM115 - closed with the process
    )
    return Process(name, popen, "")


async def _wait_ready(url: str, limit_s: float = 30.0, method: str = "GET") -> None:
    deadline = time.monotonic() + limit_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.request(
                    method, url, json=BODY_NONSTREAM if method == "POST" else None
                ) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {limit_s}s")


def wrk_rps(url: str, body: dict, seconds: float, workdir: Path, connections: int = 32) -> float:
    script = workdir / "post.lua"
    script.write_text(
        "wrk.method = 'POST'\n"
        f"wrk.body = '{json.dumps(body)}'\n"
        "wrk.headers['Content-Type'] = 'application/json'\n"
    )
    out = subprocess.run(
        [
            "wrk",
            "-t1",
            f"-c{connections}",
            f"-d{max(1, round(seconds))}s",
            "--timeout",
            "2s",
            "-s",
            str(script),
            url,
        ],
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
    statuses: dict[int, int] = field(default_factory=dict)  # non-200 answers by status

    def pct(self, values: list[float], q: float) -> float:
        if not values:
            return float("nan")
        s = sorted(values)
        return s[min(len(s) - 1, int(q * len(s)))]


class _Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 client connection of the open-loop generator: a minimal
    response reader (Content-Length or chunked), so the client costs a fraction of what
    aiohttp's does and can keep a schedule of thousands of requests/s on a shared core."""

    def __init__(self, pool: list[_Conn], res: OpenLoopResult) -> None:
        self.pool, self.res = pool, res
        self.transport: asyncio.Transport | None = None
        self.scheduled = self.first = 0.0
        self.head = b""
        self.length: int | None = None  # None: chunked
        self.got = 0
        self.tail = b""
        self.status = 0
        self.in_body = False
        self.done: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, payload: bytes, scheduled: float, done: asyncio.Future[None]) -> None:
        self.scheduled, self.first, self.done = scheduled, 0.0, done
        self.head, self.tail, self.got, self.in_body, self.length = b"", b"", 0, False, None
        assert self.transport is not None
        self.transport.write(payload)

    def data_received(self, data: bytes) -> None:
        if not self.first:
            self.first = time.perf_counter()
        if not self.in_body:
            self.head += data
            i = self.head.find(b"\r\n\r\n")
            if i < 0:
                return
            head, data = self.head[:i].lower(), self.head[i + 4 :]
            self.status = int(head[9:12])
            m = re.search(rb"\ncontent-length: *(\d+)", head)
            self.length = int(m.group(1)) if m else None
            self.in_body = True
        self.got += len(data)
        if self.length is not None:
            finished = self.got >= self.length
        else:
            self.tail = (self.tail + data)[-7:]
            finished = self.tail.endswith(b"0\r\n\r\n")
        if finished:
            end = time.perf_counter()
            if self.status == 200:
                self.res.latencies.append(end - self.scheduled)
                self.res.ttfts.append(self.first - self.scheduled)
            else:
                self.res.errors += 1
                self.res.statuses[self.status] = self.res.statuses.get(self.status, 0) + 1
            self.pool.append(self)
            if self.done is not None and not self.done.done():
                self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.res.errors += 1
            self.done.set_result(None)
        if self in self.pool:
            self.pool.remove(self)


async def open_loop(url: str, body: dict, rate: float, seconds: float) -> OpenLoopResult:
    """Fire requests on a fixed schedule (not waiting for answers) and time each one.

    Times come from `time.perf_counter` (uvloop's `loop.time()` has millisecond
    resolution, too coarse for sub-millisecond differences). Latency counts from the
    scheduled send time, so a client that falls behind its schedule shows it. A request
    goes out on an idle keep-alive connection, or a new one when all are busy."""
    res = OpenLoopResult()
    loop = asyncio.get_running_loop()
    m = re.match(r"http://([^:/]+):(\d+)(/.*)", url)
    assert m is not None
    host, port, path = m.group(1), int(m.group(2)), m.group(3)
    data = json.dumps(body).encode()
    payload = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode() + data
    pool: list[_Conn] = []
    conns: list[_Conn] = []

    async def connect() -> _Conn:
        _, c = await loop.create_connection(lambda: _Conn(pool, res), host, port)
        conns.append(c)
        return c

    clock = time.perf_counter
    # Warm up: connections opened and each used once, so set-up is not measured.
    warm = [await connect() for _ in range(32)]
    futs = []
    for c in warm:
        f = loop.create_future()
        c.send(payload, clock(), f)
        futs.append(f)
    await asyncio.gather(*futs)
    res.latencies.clear()
    res.ttfts.clear()
    res.errors = 0
    res.statuses.clear()

    async def one(scheduled: float) -> None:
        if clock() - scheduled > 0.002:
            res.late_starts += 1
        c = pool.pop() if pool else await connect()
        f = loop.create_future()
        c.send(payload, scheduled, f)
        try:
            await asyncio.wait_for(f, 10.0)
        except TimeoutError:
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
    for c in conns:
        if c.transport is not None:
            c.transport.close()
    return res


# ------------------------------------------------------------------ memory
def rss_kib(pid: int) -> int:
    """Resident memory of a process and its children (kvgate --workers, nginx workers)."""
    total = 0
    pids = [pid]
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pids += [int(k) for k in kids]
    except OSError:
        pass
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


async def idle_connections_kib(port: int, pid: int, n: int = 500) -> float:
    """RSS growth per idle keep-alive connection: n connections each make one request and
    stay open."""
    url = f"http://127.0.0.1:{port}/v1/models"
    await asyncio.sleep(0.5)
    before = rss_kib(pid)
    conn = aiohttp.TCPConnector(limit=0, force_close=False, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=conn) as s:
        sem = asyncio.Semaphore(n)

        async def one() -> None:
            async with sem, s.get(url) as r:
                await r.read()

        await asyncio.gather(*(one() for _ in range(n)))
        await asyncio.sleep(1.0)
        after = rss_kib(pid)
    return (after - before) / n


async def inflight_streams_kib(port: int, pid: int, n: int = 200) -> float:
    """RSS growth per stream in flight: n streams the backend holds after the first event."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body = {**BODY_STREAM, "bench_hold_s": 8}
    await asyncio.sleep(0.5)
    before = rss_kib(pid)
    started = 0
    all_started = asyncio.Event()
    release = asyncio.Event()
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:

        async def one() -> None:
            nonlocal started
            async with s.post(url, json=body) as r:
                await r.content.readany()
                started += 1
                if started == n:
                    all_started.set()
                await release.wait()

        tasks = [asyncio.create_task(one()) for _ in range(n)]
        try:
            await asyncio.wait_for(all_started.wait(), 6.0)
        except TimeoutError:
            pass
        await asyncio.sleep(0.5)
        after = rss_kib(pid)
        release.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return (after - before) / max(1, started)


# ------------------------------------------------------------------ the run
@dataclass
class Contender:
    name: str
    ports: dict[str, int]  # kind -> port
    procs: dict[str, Process] = field(default_factory=dict)  # kind -> process (memory)


def setup_mode(
    mode: str, workdir: Path, args: argparse.Namespace, procs: list[Process]
) -> list[Contender]:
    """Start the upstreams and every contender for one upstream mode."""
    routers_ok = args.routers_venv is not None and (args.routers_venv / "bin").exists()
    out: list[Contender] = []
    if mode == "nginx":
        ups = {k: [free_port(), free_port()] for k in KINDS}
        servers = upstream_servers(workdir, ups["ns"][0], ups["st"][0])
        servers += upstream_servers(workdir, ups["ns"][1], ups["st"][1])
        procs.append(start_nginx(workdir, "upstream", servers))
    else:
        both = [free_port(), free_port()]
        for i, p in enumerate(both):
            procs.append(start_python(workdir, f"engine{i}", "engine_backend.py", [str(p)]))
        ups = {k: both for k in KINDS}
    for p in {p for k in KINDS for p in ups[k]}:
        _wait_port(p)
    out.append(Contender("straight", {k: ups[k][0] for k in KINDS}))
    # One proxy process per kind in nginx mode (the upstream port says what it answers);
    # in python mode one process serves both kinds.
    per_kind = mode == "nginx"

    def ports_for() -> dict[str, int]:
        if per_kind:
            return {k: free_port() for k in KINDS}
        p = free_port()
        return dict.fromkeys(KINDS, p)

    ngx = ports_for()
    pairs = [(ngx[k], ups[k]) for k in (KINDS if per_kind else ("ns",))]
    procs.append(start_nginx(workdir, "proxy", proxy_servers(pairs)))
    out.append(Contender("nginx", ngx))

    def launch(name: str, start) -> None:  # type: ignore[no-untyped-def]
        ports = ports_for()
        c = Contender(name, ports)
        for k in KINDS if per_kind else ("ns",):
            proc = start(f"{name}-{mode}-{k}", ports[k], ups[k])
            procs.append(proc)
            c.procs[k] = proc
        if not per_kind:
            c.procs["st"] = c.procs["ns"]
        out.append(c)

    launch(
        "bare",
        lambda n, port, u: start_python(
            workdir, n, "bare_proxy.py", [str(port), *(f"http://127.0.0.1:{x}" for x in u)]
        ),
    )
    launch("kvgate", lambda n, port, u: start_kvgate(workdir, n, port, u))
    if args.baseline_src is not None:
        launch(
            "kvgate-main",
            lambda n, port, u: start_kvgate(workdir, n, port, u, src=args.baseline_src),
        )
    if args.workers:
        # The workers share their state in a private Redis (one key prefix per target).
        redis_port = free_port()
        procs.append(
            Process(
                "redis",
                subprocess.Popen(
                    ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1"]
                    + ["--save", "", "--appendonly", "no"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                ),
                "",
            )
        )
        _wait_port(redis_port)
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        launch(
            f"kvgate-w{args.workers}",
            lambda n, port, u: start_kvgate(
                workdir, n, port, u, workers=args.workers, redis_url=redis_url
            ),
        )
    if routers_ok:
        for r in ("vllm-router", "sglang-router"):
            launch(r, lambda n, port, u, r=r: start_router(workdir, n, args.routers_venv, port, u))
    for c in out:
        for k in KINDS:
            _wait_port(c.ports[k])
    for c in out:
        for k in KINDS if per_kind else ("ns",):
            url = f"http://127.0.0.1:{c.ports[k]}/v1/chat/completions"
            asyncio.run(_wait_ready(url, method="POST"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5.0, help="length of each measurement")
    ap.add_argument(
        "--rate",
        type=float,
        default=None,
        help="open-loop requests/s (default: half the bare proxy's saturation)",
    )
    ap.add_argument("--low-rate", type=float, default=200.0, help="a second, light rate")
    ap.add_argument("--upstreams", default="nginx,python")
    ap.add_argument("--routers-venv", type=Path, default=None)
    ap.add_argument("--baseline-src", type=Path, default=None)
    ap.add_argument("--workers", type=int, default=0, help="also run kvgate --workers N")
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

    summary: dict = {
        "rounds": args.rounds,
        "seconds": args.seconds,
        "cpus": os.cpu_count(),
        "modes": {},
    }
    report: list[str] = []
    for mode in args.upstreams.split(","):
        workdir = Path(tempfile.mkdtemp(prefix=f"kvgate-bench-{mode}-"))
        workdir.chmod(0o755)  # nginx workers drop root and must read the stream body
        procs: list[Process] = []
        try:
            contenders = setup_mode(mode, workdir, args, procs)
            res = run_mode(mode, contenders, workdir, args)
        finally:
            for p in reversed(procs):
                p.stop()
            shutil.rmtree(workdir, ignore_errors=True)
        summary["modes"][mode] = res
        report += render(mode, res)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2))
    print()
    print("\n".join(report))
    return 0


def run_mode(
    mode: str, contenders: list[Contender], workdir: Path, args: argparse.Namespace
) -> dict:
    path = "/v1/chat/completions"
    names = [c.name for c in contenders]
    # Memory first, on fresh processes (after load, freed memory would be reused).
    memory: dict[str, dict[str, float]] = {}
    if mode == "python":
        for c in contenders:
            proc = c.procs.get("ns")
            if proc is None:
                continue
            pid = proc.popen.pid
            memory[c.name] = {
                "idle_conn_kib": asyncio.run(idle_connections_kib(c.ports["ns"], pid)),
                "stream_kib": asyncio.run(inflight_streams_kib(c.ports["st"], pid)),
            }
            print(f"{mode} memory {c.name}: {memory[c.name]}", flush=True)
    rps: dict[str, dict[str, list[float]]] = {n: {k: [] for k in KINDS} for n in names}
    for rnd in range(args.rounds):
        for kind in KINDS:
            for c in contenders:
                url = f"http://127.0.0.1:{c.ports[kind]}{path}"
                try:
                    r = wrk_rps(url, BODIES[kind], args.seconds, workdir)
                except (RuntimeError, subprocess.SubprocessError) as e:
                    print(f"{mode} {c.name} {kind}: {e}", file=sys.stderr)
                    r = float("nan")
                rps[c.name][kind].append(r)
                print(f"{mode} round {rnd + 1} {kind} {c.name:14s} {r:9.0f} req/s", flush=True)
    sat = {n: {k: statistics.median(rps[n][k]) for k in KINDS} for n in names}
    rates = {k: args.rate or round(sat["bare"][k] / 2) for k in KINDS}
    half = open_loop_rounds(mode, contenders, args, rates)
    light = open_loop_rounds(mode, contenders, args, dict.fromkeys(KINDS, args.low_rate))
    return {
        "rates": rates,
        "rps": sat,
        "latency": half["median"],
        "low_rate": args.low_rate,
        "latency_low": light["median"],
        "memory": memory,
        "raw": {"rps": rps, "latency": half["raw"], "latency_low": light["raw"]},
    }


def open_loop_rounds(
    mode: str, contenders: list[Contender], args: argparse.Namespace, rates: dict[str, float]
) -> dict:
    """Open-loop rounds at `rates` (per kind), contenders interleaved; medians per key."""
    path = "/v1/chat/completions"
    names = [c.name for c in contenders]
    lat: dict[str, dict[str, list[dict]]] = {n: {k: [] for k in KINDS} for n in names}
    for rnd in range(args.rounds):
        for kind in KINDS:
            for c in contenders:
                url = f"http://127.0.0.1:{c.ports[kind]}{path}"
                ol = asyncio.run(open_loop(url, BODIES[kind], rates[kind], args.seconds))
                row = {
                    "p50_ms": ol.pct(ol.latencies, 0.50) * 1e3,
                    "p99_ms": ol.pct(ol.latencies, 0.99) * 1e3,
                    "ttft_p50_ms": ol.pct(ol.ttfts, 0.50) * 1e3,
                    "errors": ol.errors,
                    "late": ol.late_starts,
                    "n": len(ol.latencies),
                    "statuses": {str(k): v for k, v in sorted(ol.statuses.items())},
                }
                lat[c.name][kind].append(row)
                print(
                    f"{mode} round {rnd + 1} {kind} {c.name:14s} {rates[kind]:.0f}/s "
                    f"p50 {row['p50_ms']:.3f} p99 {row['p99_ms']:.3f} "
                    f"ttft50 {row['ttft_p50_ms']:.3f} ms errors {ol.errors} {row['statuses'] or ''} "
                    f"late {ol.late_starts}",
                    flush=True,
                )
    keys = ("p50_ms", "p99_ms", "ttft_p50_ms", "errors", "late")
    median = {
        n: {k: {key: statistics.median(r[key] for r in lat[n][k]) for key in keys} for k in KINDS}
        for n in names
    }
    return {"median": median, "raw": lat}


TARGETS = {"p50_ms": "<= 0.3 ms", "p99_ms": "<= 2 ms", "ttft_p50_ms": "<= 0.3 ms"}


def _latency_table(
    title: str, names: list[str], lat: dict, rates: dict, targets: bool
) -> list[str]:
    others = [n for n in names if n != "straight"]
    lines = [
        f"| {title}, added over straight | rate | " + " | ".join(others) + " | target |",
        "| --- | ---: |" + " ---: |" * (len(others) + 1),
    ]
    for k in KINDS:
        for key in ("p50_ms", "p99_ms") + (("ttft_p50_ms",) if k == "st" else ()):
            cells = [f"{lat[n][k][key] - lat['straight'][k][key]:+.3f} ms" for n in others]
            what = {"p50_ms": "p50", "p99_ms": "p99", "ttft_p50_ms": "first byte p50"}[key]
            lines.append(
                f"| {KIND_LABEL[k]} {what} | {rates[k]:,.0f}/s | "
                + " | ".join(cells)
                + f" | {TARGETS[key] if targets else ''} |"
            )
    late = ", ".join(
        f"{n} {lat[n][k]['late']:.0f}/{lat[n][k]['errors']:.0f}" for k in KINDS for n in names
    )
    lines += [
        "",
        f"({title}: client sends more than 2 ms late / errors, median of the rounds, "
        f"non-stream then stream: {late})",
    ]
    return lines


def render(mode: str, res: dict) -> list[str]:
    sat = res["rps"]
    names = list(sat)
    lines = [f"### upstream: {mode}", ""]
    lines += [
        "| saturation req/s, wrk c=32 | " + " | ".join(names) + " | kvgate / bare | target |",
        "| --- |" + " ---: |" * (len(names) + 2),
    ]
    for k in KINDS:
        row = [f"{sat[n][k]:,.0f}" for n in names]
        ratio = sat["kvgate"][k] / sat["bare"][k]
        lines.append(f"| {KIND_LABEL[k]} | " + " | ".join(row) + f" | {ratio:.2f}x | >= 0.8x |")
    lines.append("")
    lines += _latency_table(
        "open loop at half the bare proxy's saturation", names, res["latency"], res["rates"], True
    )
    lines.append("")
    low = res["low_rate"]
    lines += _latency_table(
        f"open loop at {low:.0f} req/s", names, res["latency_low"], dict.fromkeys(KINDS, low), False
    )
    if res["memory"]:
        mem = res["memory"]
        lines += [
            "",
            "| memory (RSS growth of a fresh process) | " + " | ".join(mem) + " |",
            "| --- |" + " ---: |" * len(mem),
            "| per idle keep-alive connection (500 open) | "
            + " | ".join(f"{m['idle_conn_kib']:.1f} KiB" for m in mem.values())
            + " |",
            "| per stream in flight (200 open) | "
            + " | ".join(f"{m['stream_kib']:.1f} KiB" for m in mem.values())
            + " |",
        ]
    lines.append("")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
