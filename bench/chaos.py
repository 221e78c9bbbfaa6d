"""Chaos: gateway processes, Redis, replicas and clients failing at random, seeded.

The rig: two `enginesim serve` replicas (the `tiny` card), two `kvgate serve` processes
in front of both, sharing a private `redis-server` (``fail-open``), each with the config
a new user writes (replicas, admin token, the state backend). Clients, all at once:

- the openai SDK with its defaults (``max_retries=2``, its own timeout), non-stream and
  stream;
- a plain aiohttp client with a total timeout it never states (60 s), retrying 429/503
  after Retry-After and a refused connection on the other gateway (up to 5 attempts);
- the same client without retries, streaming;
- a client that disconnects mid-stream after a few events.

Faults, one every 3-10 s (seeded): SIGKILL a gateway (restarted 1-3 s later on its port),
SIGTERM a gateway (restarted once it has exited), SIGKILL a replica (restarted 2-4 s
later), SIGKILL Redis (restarted 2-5 s later). At least one gateway and one replica stay
up. At the end every process is brought back, the clients stop, and the ledger is read.

Every request is judged against docs/failure-behaviour.md:

- ``completed``: a JSON completion, or a stream ending in ``[DONE]`` with no error event;
- ``documented``: an OpenAI error object (a 429/503 with Retry-After), or a stream ended
  by an error event without ``[DONE]``; a client that gave up after the documented
  answers counts here too;
- ``excused_killed``: the connection to a gateway broke while that gateway was SIGKILLed
  (a killed process answers nothing: no contract can hold); ``excused_refused``: it was
  refused with nothing sent (the process was down; a retrying client tries the other);
- ``disconnected``: the client closed the stream itself;
- ``contract_broken``: anything else (a body that is not an error object, a 429/503
  without Retry-After, ``[DONE]`` after an error, a reset that no SIGKILL explains);
- ``lost``: a request that ended in none of the above: the client's own timeout with no
  answer, or retries exhausted on broken connections no SIGKILL explains.

    .venv/bin/python bench/chaos.py [--minutes 10] [--seed 1]

Writes bench/results/chaos.json and chaos.md. Every process it starts is stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvgate_demo.demo import free_port  # noqa: E402

MODEL = "tiny-llm"
FAULTS = ["kill_gateway", "term_gateway", "kill_replica", "kill_redis"]
ADMIN = "chaos-admin"
CLIENT_TOTAL_S = 60.0
WORDS = "sea oar bow net sun fog map jib gun tar keg ale".split()


@dataclass
class Child:
    """A process this bench starts, stops and restarts on the same port (by its PID)."""

    name: str
    cmd: list[str]
    port: int
    log: Path
    popen: subprocess.Popen | None = None
    kills: list[tuple[float, float]] = field(default_factory=list)  # (killed at, back at)

    def start(self) -> None:
        self.popen = subprocess.Popen(
            self.cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self.log.open("ab")
        )

    @property
    def up(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.up:
            assert self.popen is not None
            self.popen.send_signal(sig)

    def wait(self, timeout: float) -> None:
        if self.popen is not None:
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)

    def stop(self) -> None:
        self.signal(signal.SIGTERM)
        self.wait(30)

    def killed_during(self, start: float, end: float) -> bool:
        return any(k <= end + 0.5 and (back is None or back >= start) for k, back in self.kills)


class Rig:
    def __init__(self, workdir: Path, seed: int) -> None:
        self.workdir = workdir
        py = sys.executable
        self.redis = Child(
            "redis",
            ["redis-server", "--port", "0", "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(workdir)],
            free_port(), workdir / "redis.log",
        )  # fmt: skip
        self.redis.cmd[2] = str(self.redis.port)
        self.replicas = []
        for i in range(2):
            port = free_port()
            self.replicas.append(
                Child(
                    f"replica{i}",
                    [
                        py,
                        "-m",
                        "enginesim",
                        "serve",
                        "--profile",
                        "tiny",
                        "--port",
                        str(port),
                        "--speed",
                        "1",
                        "--seed",
                        str(seed + i),
                        "--log-level",
                        "WARNING",
                    ],
                    port,
                    workdir / f"replica{i}.log",
                )  # fmt: skip
            )
        self.gateways = []
        for i in range(2):
            port = free_port()
            cfg = {
                "listen": {"host": "127.0.0.1", "port": port},
                "replicas": [
                    {"name": f"r{j}", "url": f"http://127.0.0.1:{r.port}", "engine": "vllm"}
                    for j, r in enumerate(self.replicas)
                ],
                "auth": {"admin_token": ADMIN},
                "logging": {"level": "warning", "access_log": False},
                "state": {
                    "backend": "redis",
                    "redis_url": f"redis://127.0.0.1:{self.redis.port}/0",
                    "key_prefix": f"chaos-{seed}",
                },
            }
            path = workdir / f"gw{i}.yaml"
            path.write_text(json.dumps(cfg))
            self.gateways.append(
                Child(
                    f"gw{i}",
                    [py, "-m", "gateway.cli", "serve", "-c", str(path)],
                    port,
                    workdir / f"gw{i}.log",
                )  # fmt: skip
            )

    def children(self) -> list[Child]:
        return [self.redis, *self.replicas, *self.gateways]

    def url(self, gw: Child) -> str:
        return f"http://127.0.0.1:{gw.port}"


async def wait_ok(url: str, limit_s: float = 30.0) -> bool:
    deadline = time.monotonic() + limit_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as s:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                async with s.get(url) as r:
                    if r.status == 200:
                        return True
            await asyncio.sleep(0.1)
    return False


# ---------------------------------------------------------------------- the judge
def is_error_object(doc: Any) -> bool:
    err = doc.get("error") if isinstance(doc, dict) else None
    return isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err)


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)
    by_client: dict[str, Counter] = field(default_factory=dict)
    broken: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    codes: Counter = field(default_factory=Counter)  # the documented answers, by status and code

    def add(self, client: str, outcome: str, detail: str = "") -> None:
        self.outcomes[outcome] += 1
        self.by_client.setdefault(client, Counter())[outcome] += 1
        if outcome == "contract_broken" and len(self.broken) < 20:
            self.broken.append(f"{client}: {detail}")
        if outcome == "lost" and len(self.lost) < 20:
            self.lost.append(f"{client}: {detail}")


def body(rng: random.Random, stream: bool) -> dict[str, Any]:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 300)))
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": rng.randint(8, 160),
        "stream": stream,
    }


def error_code(doc: Any) -> str:
    """The code of an error object (or of its inner part, as the SDK's ``e.body`` is)."""
    err = doc.get("error", doc) if isinstance(doc, dict) else None
    return str(err.get("code")) if isinstance(err, dict) else "?"


async def judge_http(
    r: aiohttp.ClientResponse, stream: bool, cut_after: int | None, codes: Counter
) -> str:
    """One answer: completed, documented, disconnected or contract_broken:<why>."""
    if r.status != 200:
        raw = await r.read()
        try:
            doc = json.loads(raw)
        except ValueError:
            return f"contract_broken:{r.status} body is not JSON: {raw[:80]!r}"
        if not is_error_object(doc):
            return f"contract_broken:{r.status} not an error object: {raw[:80]!r}"
        if r.status in (429, 503) and "Retry-After" not in r.headers:
            if r.headers.get("x-should-retry") != "false":
                return f"contract_broken:{r.status} without Retry-After"
        codes[f"{r.status} {error_code(doc)}"] += 1
        return "documented"
    if not stream:
        doc = json.loads(await r.read())
        return "completed" if doc.get("choices") else f"contract_broken:200 without choices {doc}"
    events, done, error = 0, False, False
    async for line in r.content:
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            if error:
                return "contract_broken:[DONE] after an error event"
            done = True
            continue
        events += 1
        if data.startswith(b'{"error"'):
            doc = json.loads(data)
            if not is_error_object(doc):
                return "contract_broken:an error event that is not an error object"
            codes[f"event {error_code(doc)}"] += 1
            error = True
        if cut_after is not None and events >= cut_after:
            return "disconnected"
    if done:
        return "completed"
    if error:
        return "documented"
    return "contract_broken:a stream that ended without [DONE] or an error event"


def refused(exc: BaseException) -> bool:
    """The SDK's connection error was a refused connection: the gateway it knows was
    down, and nothing was sent (its retries all landed there too). Read from the chain's
    ConnectionRefusedError: the SDK ships its own copy of httpx (``httpx2``)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def causes(exc: BaseException) -> str:
    """The exception chain's types and first words, for a lost request's sample."""
    out, seen = [], exc.__cause__ or exc.__context__
    while seen is not None and len(out) < 4:
        out.append(f"{type(seen).__name__}: {str(seen)[:50]}")
        seen = seen.__cause__ or seen.__context__
    return " <- ".join(out) or "no cause"


class Clients:
    def __init__(self, rig: Rig, seed: int, tally: Tally) -> None:
        self.rig = rig
        self.seed = seed
        self.tally = tally
        self.stop = asyncio.Event()
        self.t0 = time.monotonic()

    def at(self, gw: Child) -> str:
        """Where and when, for a lost request's sample (read beside the fault log)."""
        return f" at {time.monotonic() - self.t0:.1f} s on {gw.name}"

    def excused(self, gw: Child, start: float) -> bool:
        return gw.killed_during(start, time.monotonic())

    async def plain(self, idx: int, stream: bool, retrying: bool, cut: bool) -> None:
        rng = random.Random(f"{self.seed} plain {idx}")
        name = f"aiohttp-{'stream' if stream else 'json'}-{'retry' if retrying else 'once'}"
        if cut:
            name = "aiohttp-disconnects"
        timeout = aiohttp.ClientTimeout(total=CLIENT_TOTAL_S)
        conn = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(timeout=timeout, connector=conn) as s:
            while not self.stop.is_set():
                req = body(rng, stream)
                gw = rng.choice(self.rig.gateways)
                result = ""
                for _attempt in range(5 if retrying else 1):
                    start = time.monotonic()
                    try:
                        url = self.rig.url(gw) + "/v1/chat/completions"
                        async with s.post(url, json=req) as r:
                            cut_after = rng.randint(1, 6) if cut else None
                            result = await judge_http(r, stream, cut_after, self.tally.codes)
                            if retrying and r.status in (429, 503) and result == "documented":
                                await asyncio.sleep(float(r.headers.get("Retry-After", 1)))
                                continue
                    except aiohttp.ClientConnectorError:
                        result = "excused:refused"  # nothing was sent: the process is down
                    except (aiohttp.ClientError, ConnectionError) as e:
                        result = (
                            "excused:killed"
                            if self.excused(gw, start)
                            else f"lost:connection broke ({type(e).__name__}: {e})" + self.at(gw)
                        )
                    except TimeoutError:
                        result = (
                            "excused:killed" if self.excused(gw, start) else "lost:client timeout"
                        )
                    if retrying and result.startswith("excused"):
                        gw = self.rig.gateways[1 - self.rig.gateways.index(gw)]
                        await asyncio.sleep(0.2)
                        continue
                    break
                kind, _, detail = result.partition(":")
                if kind == "excused":  # refused (down) or cut by a SIGKILL
                    kind, detail = f"excused_{detail}", ""
                self.tally.add(name, kind, detail)
                await asyncio.sleep(rng.uniform(0.0, 0.3))

    async def sdk(self, idx: int, stream: bool) -> None:
        rng = random.Random(f"{self.seed} sdk {idx}")
        name = f"openai-sdk-{'stream' if stream else 'json'}"
        clients = [
            openai.AsyncOpenAI(base_url=self.rig.url(g) + "/v1", api_key="unused")
            for g in self.rig.gateways
        ]
        try:
            while not self.stop.is_set():
                req = body(rng, stream)
                i = rng.randrange(len(clients))
                gw, client = self.rig.gateways[i], clients[i]
                start = time.monotonic()
                try:
                    if stream:
                        events, done = 0, False
                        out = await client.chat.completions.create(
                            model=MODEL, messages=req["messages"],
                            max_tokens=req["max_tokens"], stream=True,
                        )  # fmt: skip
                        async for chunk in out:
                            events += 1
                            if chunk.choices and chunk.choices[0].finish_reason:
                                done = True
                        outcome = "completed" if done else "contract_broken:no finish_reason"
                    else:
                        got = await client.chat.completions.create(
                            model=MODEL, messages=req["messages"], max_tokens=req["max_tokens"]
                        )
                        outcome = "completed" if got.choices else "contract_broken:no choices"
                except openai.APIStatusError as e:
                    self.tally.codes[f"{e.status_code} {error_code(e.body)}"] += 1
                    outcome = (
                        "documented"
                        if is_error_object(e.body if isinstance(e.body, dict) else None)
                        or isinstance(e.body, dict)
                        and "message" in e.body
                        else f"contract_broken:{e.status_code} {str(e)[:80]}"
                    )
                except openai.APIError as e:
                    # A stream's error event: the SDK raises APIError with its body.
                    if e.body is not None and not isinstance(e, openai.APIConnectionError):
                        outcome = "documented"
                    elif refused(e):
                        outcome = "excused:refused"  # its gateway was down: nothing sent
                    elif self.excused(gw, start):
                        outcome = "excused:killed"
                    elif isinstance(e, openai.APITimeoutError):
                        outcome = "lost:sdk timeout"
                    else:
                        outcome = f"lost:{type(e).__name__} ({causes(e)})" + self.at(gw)
                except (aiohttp.ClientError, ConnectionError, ValueError) as e:
                    outcome = f"contract_broken:{type(e).__name__}"
                kind, _, detail = outcome.partition(":")
                if kind == "excused":
                    kind, detail = f"excused_{detail}", ""
                self.tally.add(name, kind, detail)
                await asyncio.sleep(rng.uniform(0.0, 0.3))
        finally:
            for c in clients:
                await c.close()


# ---------------------------------------------------------------------- faults
async def chaos(
    rig: Rig, rng: random.Random, until: float, log: list[dict], kinds: list[str]
) -> None:
    async def restart(child: Child, after: float, health: str) -> None:
        await asyncio.sleep(after)
        child.start()
        await wait_ok(f"http://127.0.0.1:{child.port}{health}") if health else None
        child.kills[-1] = (child.kills[-1][0], time.monotonic())

    pending: list[asyncio.Task] = []
    t0 = time.monotonic()
    while time.monotonic() < until:
        await asyncio.sleep(rng.uniform(3.0, 10.0))
        if time.monotonic() >= until:
            break
        fault = rng.choice(kinds)
        now = time.monotonic()
        if fault in ("kill_gateway", "term_gateway"):
            live = [g for g in rig.gateways if g.up]
            if len(live) < 2:
                continue
            g = rng.choice(live)
            if fault == "kill_gateway":
                g.signal(signal.SIGKILL)
                g.wait(10)
                g.kills.append((now, None))
                pending.append(asyncio.create_task(restart(g, rng.uniform(1, 3), "/ready")))
            else:
                g.signal(signal.SIGTERM)
                await asyncio.to_thread(g.wait, 40)
                g.start()
                await wait_ok(rig.url(g) + "/ready")
            target = g.name
        elif fault == "kill_replica":
            live = [r for r in rig.replicas if r.up]
            if len(live) < 2:
                continue
            r = rng.choice(live)
            r.signal(signal.SIGKILL)
            r.wait(10)
            r.kills.append((now, None))
            pending.append(asyncio.create_task(restart(r, rng.uniform(2, 4), "/health")))
            target = r.name
        else:
            if not rig.redis.up:
                continue
            rig.redis.signal(signal.SIGKILL)
            rig.redis.wait(10)
            rig.redis.kills.append((now, None))
            pending.append(asyncio.create_task(restart(rig.redis, rng.uniform(2, 5), "")))
            target = "redis"
        log.append({"t": round(now - t0, 1), "fault": fault, "target": target})
        print(f"{now - t0:7.1f} s {fault} {target}", flush=True)
    await asyncio.gather(*pending)


async def ledger(rig: Rig) -> dict[str, Any]:
    """Reserved tokens and running requests of every gateway, once idle (30 s at most)."""
    headers = {"Authorization": f"Bearer {ADMIN}"}
    last: dict[str, Any] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as s:
        for _ in range(60):
            last = {}
            for g in rig.gateways:
                async with s.get(rig.url(g) + "/admin/state", headers=headers) as r:
                    reps = (await r.json())["replicas"]
                last[g.name] = {
                    "reserved_tokens": sum(v["reserved_tokens"] for v in reps.values()),
                    "running": sum(v["running"] for v in reps.values()),
                }
            if all(v["reserved_tokens"] == 0 and v["running"] == 0 for v in last.values()):
                break
            await asyncio.sleep(0.5)
    return last


async def main_async(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-chaos-"))
    rig = Rig(workdir, args.seed)
    rng = random.Random(args.seed)
    tally = Tally()
    faults: list[dict] = []
    try:
        rig.redis.start()
        for r in rig.replicas:
            r.start()
        for r in rig.replicas:
            assert await wait_ok(f"http://127.0.0.1:{r.port}/health"), r.name
        for g in rig.gateways:
            g.start()
        for g in rig.gateways:
            assert await wait_ok(rig.url(g) + "/ready"), g.name
        clients = Clients(rig, args.seed, tally)
        t0 = time.monotonic()
        workers = [
            *(clients.sdk(i, False) for i in range(3)),
            *(clients.sdk(10 + i, True) for i in range(3)),
            *(clients.plain(i, False, True, False) for i in range(2)),
            *(clients.plain(10 + i, True, False, False) for i in range(2)),
            *(clients.plain(20 + i, True, False, True) for i in range(2)),
        ]
        tasks = [asyncio.create_task(w) for w in workers]
        clients.t0 = t0
        await chaos(rig, rng, t0 + args.minutes * 60, faults, args.faults.split(","))
        clients.stop.set()
        await asyncio.wait(tasks, timeout=CLIENT_TOTAL_S * 5 + 30)
        for t in tasks:
            if not t.done():
                t.cancel()
        book = await ledger(rig)
        elapsed = time.monotonic() - t0
    finally:
        for c in reversed(rig.children()):
            c.stop()
    requests = sum(tally.outcomes.values())
    doc = {
        "bench": "chaos",
        "seed": args.seed,
        "minutes": args.minutes,
        "elapsed_s": round(elapsed, 1),
        "requests": requests,
        "outcomes": dict(tally.outcomes),
        "by_client": {k: dict(v) for k, v in tally.by_client.items()},
        "lost": tally.outcomes.get("lost", 0),
        "contract_broken": tally.outcomes.get("contract_broken", 0),
        "documented_codes": dict(tally.codes.most_common()),
        "lost_samples": tally.lost,
        "broken_samples": tally.broken,
        "faults": Counter(f["fault"] for f in faults),
        "fault_log": faults,
        "ledger_after": book,
        "reserved_after": sum(v["reserved_tokens"] for v in book.values()),
    }
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    lines = [
        f"# Chaos run (seed {args.seed}, {args.minutes:g} min)",
        "",
        f"{requests} requests; faults: "
        + ", ".join(f"{k} {v}" for k, v in sorted(doc["faults"].items())),
        "",
        f"- requests lost: **{doc['lost']}** (target 0)",
        f"- answers that broke the contract: **{doc['contract_broken']}** (target 0)",
        f"- reserved after: **{doc['reserved_after']}** tokens (target 0)",
        "",
        "| client | " + " | ".join(sorted(tally.outcomes)) + " |",
        "| --- |" + " ---: |" * len(tally.outcomes),
    ]
    for client, c in sorted(tally.by_client.items()):
        lines.append(
            f"| {client} | " + " | ".join(str(c.get(k, 0)) for k in sorted(tally.outcomes)) + " |"
        )
    lines += [
        "",
        "Documented answers by code: "
        + ", ".join(f"{k} {v}" for k, v in tally.codes.most_common()),
    ]
    if tally.lost or tally.broken:
        lines += ["", "Samples:", *(f"- {x}" for x in tally.lost + tally.broken)]
    md = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(md)
    print(md)
    return (
        0 if doc["lost"] == 0 and doc["contract_broken"] == 0 and doc["reserved_after"] == 0 else 1
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--faults", default=",".join(FAULTS), help="the kinds to draw from")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "chaos.json")
    return asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
