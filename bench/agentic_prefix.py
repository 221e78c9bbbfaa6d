"""Prefix-heavy agentic traffic over 4 replicas: round robin, least-loaded, sglang-router
``cache_aware`` and kvgate, on the same replicas, from the same clients.

Workload (deterministic from ``--seed``): ``--tenants`` (16) tenants, each with its own
multi-thousand-token system prompt (~2,500 tokens) and tool schemas (8 tools, ~700
tokens): ~3,200 shared tokens per tenant, so the 16 tenants' prefixes alone (~51k
tokens) fill one replica's whole KV pool (52,544 tokens on ``seed2-8b-16gb``) and
placement decides what stays cached. Each tenant runs ``--sessions`` (3) multi-turn
sessions of ``--turns`` (4) turns: a user message with a tool result (~300 tokens), a
streamed answer of at most ``--max-tokens`` (96); the next turn resends the whole
history (the answer included). ``--concurrency`` (16) clients each run one session at a
time, sessions in a seeded shuffled order.

Contenders, each on 4 fresh enginesim ``seed2-8b-16gb`` replicas (vLLM flavour, prefix
caching of full blocks, generated blocks included) at ``--speed`` x simulated time:

- ``round_robin``: the client sends request i to replica i mod 4 (nginx's default);
- ``least_loaded``: the client sends each request to the replica with the fewest of its
  requests outstanding (nginx ``least_conn``), ties at random;
- ``sglang_cache_aware``: sglang-router (PyPI ``sglang-router``, run from a separate
  virtualenv: ``--sglang-python``) with ``--policy cache_aware`` and its defaults;
- ``kvgate``: ``kvgate serve`` with the config a new user writes: replicas, no
  ``routing:`` section (workload-aware by default: these requests carry tools, so they
  are agentic and placed by ``prefix_load`` + ``session_affinity``), no cap, limits
  learned; ``--kvgate-profile readme`` runs the README's agent profile instead.

The same client everywhere: streams (``stream: true``), the session id as the body's
``user``, the openai SDK's ``x-stainless-read-timeout`` header; a 429/503 is not
retried (``--shed-retries``, 0: an agent loop that fails a turn fails the task; it was
6 before issue 21), a timeout, 5xx or connection error up to 2 times; an attempt times out after ``--timeout`` simulated
seconds (120). TTFT runs from the turn's first attempt to its first content token, so
retries and queueing count. Times are in simulated seconds (wall x speed).

Reported per contender: the replicas' prefix-cache hit rate (hit / queried tokens from
their ``vllm:prefix_cache_*`` counters), TTFT p50/p90/p99 over all turns and over turns
after the first, end-to-end p90, completions, retries and give-ups, and the replicas'
preemptions (``vllm:num_preemptions_total``: a replica driven past its KV limit
preempts). The README profile was set before any run of this bench (weights 2/1/1 as
in docs/routing.md's example); the workload default's agentic scoring was tuned on
``--seed 1`` only (session affinity added) and is reported on seed 0.

    .venv/bin/python bench/agentic_prefix.py [--runs 3] [--speed 10]

``--trace FILE`` writes every turn of every run, for the contenders whose replicas or
gateway say where it went: the turn's TTFT and end to end, the prompt tokens and the
engine's cached tokens (its usage chunk: the clients then ask for one, every contender
alike), and for kvgate its access line (replica, queue wait, the gateway's TTFT, the
route's reason): why a slow turn was slow, queue or prefill, and where.

Results: bench/results/agentic_prefix.json (every run, and the medians of the runs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvgate_demo.demo import (  # noqa: E402
    Process,
    access_records,
    engine_counter,
    free_port,
    gateway_config,
    run_async,
    start_gateway,
    start_replica,
    stopping,
    wait_http,
)

PROFILE = "seed2-8b-16gb"
MODEL = "llama-3.1-8b-instruct-awq"
REPLICAS = 4
CONTENDERS = ("round_robin", "least_loaded", "sglang_cache_aware", "kvgate")
KVGATE_ROUTING = {
    "block_chars": 64,
    "max_prefix_blocks": 1024,
    "default_profile": {
        "scorers": [
            {"name": "prefix_cache", "weight": 2.0, "params": {"chars_per_token": 4.5}},
            {"name": "session_affinity", "weight": 1.0},
            {"name": "running_headroom", "weight": 1.0},
        ]
    },
}

_WORDS = (
    "agent tool call result file path read write search query index module function "
    "class method value error test pass fail build deploy config schema field type "
    "string number array object return input output step plan context history user "
    "assistant system policy rule check verify update create delete list fetch parse "
    "format render cache block token request response session tenant replica queue"
).split()


def _text(rng: random.Random, words: int) -> str:
    out = []
    for i in range(words):
        out.append(rng.choice(_WORDS))
        if i % 14 == 13:
            out.append(".\n")
    return " ".join(out)


def tenant_prefix(
    t: int, seed: int, system_words: int = 2300, n_tools: int = 8
) -> tuple[str, list[dict]]:
    rng = random.Random(f"tenant-{seed}-{t}")
    system = f"You are the operations agent of tenant {t}. Follow these rules.\n" + _text(
        rng, system_words
    )
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"t{t}_tool_{k}",
                "description": _text(rng, 45),
                "parameters": {
                    "type": "object",
                    "properties": {
                        f"arg_{j}": {"type": "string", "description": _text(rng, 8)}
                        for j in range(4)
                    },
                    "required": ["arg_0"],
                },
            },
        }
        for k in range(n_tools)
    ]
    return system, tools


@dataclass
class Session:
    tenant: int
    sid: str
    turns: list[str]


def workload(
    args: argparse.Namespace, system_words: int = 2300, n_tools: int = 8, result_words: int = 260
) -> tuple[list[Session], dict[int, tuple[str, list]]]:
    """``--tenants`` prefixes (a system prompt of `system_words` and `n_tools` tool
    schemas), ``--sessions`` sessions each of ``--turns`` tool results of `result_words`."""
    prefixes = {t: tenant_prefix(t, args.seed, system_words, n_tools) for t in range(args.tenants)}
    rng = random.Random(args.seed)
    sessions = []
    for t in range(args.tenants):
        for s in range(args.sessions):
            turns = [
                f"Turn {k}: tool result follows.\n" + _text(rng, result_words)
                for k in range(args.turns)
            ]
            sessions.append(Session(t, f"t{t}-s{s}-{args.seed}", turns))
    rng.shuffle(sessions)
    return sessions, prefixes


def turn_body(sess: Session, messages: list[dict], tools: list, max_tokens: int) -> dict:
    """A session's next turn: its whole history so far, streamed."""
    return {
        "model": MODEL,
        "messages": messages,
        "tools": tools,
        "max_tokens": max_tokens,
        "stream": True,
        "user": sess.sid,
    }


@dataclass
class Turn:
    tenant: int
    session: str
    turn: int
    ok: bool
    ttft_s: float | None
    e2e_s: float | None
    retries: int
    error: str = ""
    request_id: str = ""  # kvgate's x-request-id (joins its access line)
    prompt_tokens: int | None = None  # the engine's usage, with --trace
    cached_tokens: int | None = None
    start_s: float | None = None  # when the turn's first attempt left, simulated s into the run


@dataclass
class Outcome:
    turns: list[Turn] = field(default_factory=list)


class Dispatch:
    """Where a request goes: one front URL, or client-side round robin / least loaded."""

    def __init__(self, mode: str, urls: list[str], seed: int) -> None:
        self.mode = mode
        self.urls = urls
        self._rr = itertools.cycle(range(len(urls)))
        self.outstanding = [0] * len(urls)
        self._rng = random.Random(seed)

    def acquire(self) -> int:
        if self.mode == "round_robin":
            i = next(self._rr)
        elif self.mode == "least_loaded":
            low = min(self.outstanding)
            i = self._rng.choice([k for k, n in enumerate(self.outstanding) if n == low])
        else:
            i = 0
        self.outstanding[i] += 1
        return i

    def release(self, i: int) -> None:
        self.outstanding[i] -= 1


async def run_turn(
    http: aiohttp.ClientSession,
    dispatch: Dispatch,
    body: dict,
    args: argparse.Namespace,
) -> tuple[bool, float | None, float | None, int, str, str, dict]:
    """(ok, ttft, e2e, retries, reply text, error, trace) of one turn, times in simulated
    s; trace: the last attempt's request id and the engine's usage, where given."""
    loop = asyncio.get_running_loop()
    speed = args.speed
    timeout_wall = args.timeout / speed
    start = loop.time()
    retries = 0
    shed_left, fail_left = args.shed_retries, 2
    error = ""
    trace: dict = {}
    while True:
        i = dispatch.acquire()
        url = dispatch.urls[i]
        ttft = None
        parts: list[str] = []
        try:
            async with http.post(
                url + "/v1/chat/completions",
                json=body,
                headers={"x-stainless-read-timeout": f"{timeout_wall:.3f}"},
                timeout=aiohttp.ClientTimeout(total=timeout_wall),
            ) as r:
                trace = {"request_id": r.headers.get("x-request-id", "")}
                if r.status in (429, 503):
                    wait = 1.0 / speed
                    with contextlib.suppress(TypeError, ValueError):
                        wait = float(r.headers.get("Retry-After", ""))
                    await r.read()
                    if shed_left <= 0:
                        return False, None, None, retries, "", f"shed {r.status}", trace
                    shed_left -= 1
                    retries += 1
                    dispatch.release(i)
                    i = -1
                    await asyncio.sleep(min(wait, 60.0 / speed))
                    continue
                if r.status != 200:
                    error = f"status {r.status}"
                    raise aiohttp.ClientResponseError(r.request_info, (), status=r.status)
                async for raw in r.content:
                    line = raw.decode("utf-8", "replace").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    try:
                        chunk = json.loads(data)
                    except json.JSONDecodeError:
                        continue
                    if "error" in chunk:
                        error = "stream error"
                        raise aiohttp.ClientPayloadError(error)
                    usage = chunk.get("usage")
                    if usage:
                        trace["prompt_tokens"] = usage.get("prompt_tokens")
                        details = usage.get("prompt_tokens_details") or {}
                        trace["cached_tokens"] = details.get("cached_tokens")
                    for ch in chunk.get("choices") or []:
                        piece = (ch.get("delta") or {}).get("content")
                        if piece:
                            if ttft is None:
                                ttft = loop.time() - start
                            parts.append(piece)
            e2e = loop.time() - start
            return True, (ttft or e2e) * speed, e2e * speed, retries, "".join(parts), "", trace
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            error = error or type(e).__name__
            if fail_left <= 0:
                return False, None, None, retries, "", error, trace
            fail_left -= 1
            retries += 1
            error = ""
        finally:
            if i >= 0:
                dispatch.release(i)


async def drive(
    front: list[str], mode: str, args: argparse.Namespace, sessions: list[Session], prefixes
) -> Outcome:
    out = Outcome()
    dispatch = Dispatch(mode, front, args.seed)
    t0 = asyncio.get_running_loop().time()
    queue: asyncio.Queue[Session] = asyncio.Queue()
    for s in sessions:
        queue.put_nowait(s)

    async def client(http: aiohttp.ClientSession) -> None:
        while True:
            try:
                sess = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            system, tools = prefixes[sess.tenant]
            messages: list[dict] = [{"role": "system", "content": system}]
            for k, user in enumerate(sess.turns):
                messages.append({"role": "user", "content": user})
                body = turn_body(sess, messages, tools, args.max_tokens)
                if args.trace:
                    body["stream_options"] = {"include_usage": True}
                sent = (asyncio.get_running_loop().time() - t0) * args.speed
                got = await run_turn(http, dispatch, body, args)
                ok, ttft, e2e, retries, reply, err, trace = got
                if args.trace:
                    trace["start_s"] = sent
                out.turns.append(
                    Turn(sess.tenant, sess.sid, k, ok, ttft, e2e, retries, err, **trace)
                )
                if not ok:
                    break  # an agent whose turn failed gives up its session
                messages.append({"role": "assistant", "content": reply})

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as http:
        await asyncio.gather(*(client(http) for _ in range(args.concurrency)))
    return out


def start_sglang_router(python: str, urls: list[str], workdir: Path) -> Process:
    port = free_port()
    cmd = [
        python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
        "--port", str(port), "--policy", "cache_aware", "--log-level", "warn",
        "--worker-urls", *urls,
    ]  # fmt: skip
    log = (workdir / f"sglang-router-{port}.log").open("wb")
    popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    return Process(f"sglang-router:{port}", popen, f"http://127.0.0.1:{port}")


async def warm_front(url: str, limit_s: float = 60.0) -> None:
    """Wait until a router answers a tiny completion (its workers registered)."""
    deadline = time.monotonic() + limit_s
    body = {"model": MODEL, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                async with s.post(
                    url + "/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=5)
                ) as r:
                    await r.read()
                    if r.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not serve a completion within {limit_s:.0f}s")


async def warm_up(front: str | None, urls: list[str], mode: str, args: argparse.Namespace) -> None:
    """The same warm-up for every contender before measuring: ``--warmup`` short chat
    requests of unrelated text, ``--warmup-concurrency`` at a time, through the
    contender (a long-running gateway is past its cold start; kvgate's learned running
    limit starts at 2 and grows only while replicas are kept busy)."""
    rng = random.Random(f"warmup-{args.seed}")
    dispatch = Dispatch(mode, [front] if front else urls, args.seed + 1)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(args.warmup):
        queue.put_nowait(i)

    async def client(http: aiohttp.ClientSession) -> None:
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"warm-up {i}: " + _text(rng, 300)}],
                "max_tokens": 48,
                "stream": True,
                "user": f"warmup-{i}",
            }
            await run_turn(http, dispatch, body, args)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await asyncio.gather(*(client(http) for _ in range(args.warmup_concurrency)))


async def kvgate_view(url: str) -> dict:
    """kvgate's routing decisions by reason, queue waits and learned limits at the end."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {"decisions": {}, "limits": {}}
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics") as r:
            text = await r.text()
    for fam in text_string_to_metric_families(text):
        for sm in fam.samples:
            if sm.name == "kvgate_routing_decisions_total":
                out["decisions"][sm.labels["reason"]] = sm.value
            elif sm.name == "kvgate_replica_limit":
                out["limits"][sm.labels["replica"]] = sm.value
            elif sm.name == "kvgate_prompt_counts_total":
                out.setdefault("prompt_counts", {})[sm.labels["how"]] = sm.value
            elif sm.name == "kvgate_queue_wait_seconds_sum":
                out["queue_wait_sum_s"] = sm.value
            elif sm.name == "kvgate_queue_wait_seconds_count":
                out["queue_wait_count"] = sm.value
    return out


async def sample_kvgate(url: str, every_s: float = 0.1) -> dict:
    """What bound kvgate's replicas while the sessions ran, sampled from /metrics until
    cancelled, in the samples with a queue: how often each ceiling held a replica
    (`kvgate_replica_binding_ceiling`), and the ledger's reservations against what the
    engines reported using (sums over replicas)."""
    from prometheus_client.parser import text_string_to_metric_families

    binding: dict[str, int] = {}
    n = queued = 0
    reserved_sum = engine_sum = 0.0
    try:
        async with aiohttp.ClientSession() as s:
            while True:
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with s.get(url + "/metrics") as r:
                        text = await r.text()
                    cap: dict[str, float] = {}
                    res: dict[str, float] = {}
                    use: dict[str, float] = {}
                    depth = 0.0
                    bound: list[str] = []
                    for fam in text_string_to_metric_families(text):
                        for sm in fam.samples:
                            rep = sm.labels.get("replica")
                            if sm.name == "kvgate_replica_binding_ceiling" and sm.value:
                                bound.append(sm.labels["ceiling"])
                            elif sm.name == "kvgate_replica_capacity_tokens" and rep:
                                cap[rep] = sm.value
                            elif sm.name == "kvgate_replica_reserved_tokens" and rep:
                                res[rep] = sm.value
                            elif sm.name == "kvgate_replica_engine_kv_usage_ratio" and rep:
                                use[rep] = sm.value
                            elif sm.name == "kvgate_queue_depth":
                                depth += sm.value
                    n += 1
                    if depth > 0:
                        queued += 1
                        for c in bound:
                            binding[c] = binding.get(c, 0) + 1
                        reserved_sum += sum(res.values())
                        engine_sum += sum(use.get(k, 0.0) * cap.get(k, 0.0) for k in res)
                await asyncio.sleep(every_s)
    except asyncio.CancelledError:
        pass
    return {
        "samples": n,
        "with_queue": queued,
        "binding": binding,
        "reserved_over_engine_used": reserved_sum / engine_sum if engine_sum else None,
    }


async def counters(urls: list[str]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"hits": [], "queries": [], "preemptions": []}
    for u in urls:
        out["hits"].append(await engine_counter(u, "vllm:prefix_cache_hits"))
        out["queries"].append(await engine_counter(u, "vllm:prefix_cache_queries"))
        out["preemptions"].append(await engine_counter(u, "vllm:num_preemptions"))
    return out


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, int(round(q * len(v) + 0.5)) - 1))]


async def one_contender(
    mode: str, args: argparse.Namespace, sessions, prefixes, workdir: Path, run: int
) -> dict:
    reps = [
        start_replica(PROFILE, args.speed, log=workdir / f"replica-{mode}-{run}-{i}.log")
        for i in range(REPLICAS)
    ]
    urls = [r.url for r in reps]
    with stopping(*reps):
        for r in reps:
            await wait_http(r.url + "/health", proc=r)
        front: Process | None = None
        if mode == "kvgate":
            cfg = gateway_config(urls, speed=args.speed, timeout_s=args.timeout)
            if args.kvgate_routing is not None:
                cfg["routing"] = args.kvgate_routing
            elif args.kvgate_profile == "readme":
                cfg["routing"] = KVGATE_ROUTING
            # "default": no routing section, as a new user writes it (workload-aware)
            cfg["admission"].update(args.kvgate_admission)
            if args.trace:  # the access lines, joined to the turns below
                cfg["logging"] = {"level": "info", "access_log": True}
            front = start_gateway(cfg, workdir=workdir, log=workdir / f"kvgate-{run}.log")
        elif mode == "sglang_cache_aware":
            front = start_sglang_router(args.sglang_python, urls, workdir)
        with stopping(*([front] if front else [])):
            if front is not None:
                if mode == "kvgate":
                    await wait_http(front.url + "/ready", proc=front)
                await warm_front(front.url)
            if args.warmup:
                await warm_up(front.url if front else None, urls, mode, args)
            before = await counters(urls)
            gate0 = await kvgate_view(front.url) if mode == "kvgate" and front else {}
            t0 = time.monotonic()
            sampler = (
                asyncio.ensure_future(sample_kvgate(front.url))
                if mode == "kvgate" and front
                else None
            )
            outcome = await drive([front.url] if front else urls, mode, args, sessions, prefixes)
            wall = time.monotonic() - t0
            samples = None
            if sampler is not None:
                sampler.cancel()
                samples = await sampler
            after = await counters(urls)
            gate = await kvgate_view(front.url) if mode == "kvgate" and front else {}
            if samples is not None:
                gate["samples"] = samples
            if gate0:  # the measured part only (the warm-up excluded)
                for key in ("queue_wait_sum_s", "queue_wait_count"):
                    gate[key] = gate.get(key, 0.0) - gate0.get(key, 0.0)
                gate["decisions"] = {
                    k: v - gate0["decisions"].get(k, 0.0) for k, v in gate["decisions"].items()
                }
    turns = [asdict(t) for t in outcome.turns] if args.keep_turns or args.trace else []
    if args.trace and mode == "kvgate":
        access = access_lines(workdir / f"kvgate-{run}.log")
        for t in turns:
            t["kvgate"] = access.get(t["request_id"])
    hits = sum(after["hits"]) - sum(before["hits"])
    queries = sum(after["queries"]) - sum(before["queries"])
    preempt = [a - b for a, b in zip(after["preemptions"], before["preemptions"], strict=True)]
    ok = [t for t in outcome.turns if t.ok]
    later = [t for t in ok if t.turn > 0]
    ttft = [t.ttft_s for t in ok if t.ttft_s is not None]
    ttft_later = [t.ttft_s for t in later if t.ttft_s is not None]
    e2e = [t.e2e_s for t in ok if t.e2e_s is not None]
    expected = len(sessions) * args.turns
    return {
        "contender": mode,
        "run": run,
        "turns_expected": expected,
        "completed": len(ok),
        "failed_turns": len(outcome.turns) - len(ok),
        "gave_up_sessions": sum(1 for t in outcome.turns if not t.ok),
        "retries": sum(t.retries for t in outcome.turns),
        "hit_rate": hits / queries if queries else 0.0,
        "ttft_p50": pct(ttft, 0.5),
        "ttft_p90": pct(ttft, 0.9),
        "ttft_p99": pct(ttft, 0.99),
        "ttft_later_p50": pct(ttft_later, 0.5),
        "ttft_later_p90": pct(ttft_later, 0.9),
        "ttft_later_p99": pct(ttft_later, 0.99),
        "e2e_p90": pct(e2e, 0.9),
        "preemptions": preempt,
        "queried_tokens_per_replica": [
            a - b for a, b in zip(after["queries"], before["queries"], strict=True)
        ],
        "wall_s": wall,
        "errors": sorted({t.error for t in outcome.turns if t.error}),
        "kvgate": gate,
        "turns": turns,
    }


def access_lines(log: Path) -> dict[str, dict]:
    """kvgate's access lines by request id: where each request went and how long it
    queued (the fields a trace needs)."""
    return {
        rec.get("request_id", ""): {
            k: rec.get(k)
            for k in ("replica", "queue_wait_s", "ttft_s", "duration_s", "route", "attempts")
        }
        for rec in access_records(log)
    }


METRICS = (
    "hit_rate", "ttft_p50", "ttft_p90", "ttft_p99", "ttft_later_p50", "ttft_later_p90",
    "ttft_later_p99", "e2e_p90", "completed", "retries",
)  # fmt: skip


def medians(rows: list[dict]) -> list[dict]:
    out = []
    for mode in CONTENDERS:
        mine = [r for r in rows if r["contender"] == mode]
        if not mine:
            continue
        m = {"contender": mode, "runs": len(mine), "turns_expected": mine[0]["turns_expected"]}
        for key in METRICS:
            vals = [r[key] for r in mine if r[key] is not None]
            m[key] = statistics.median(vals) if vals else None
        m["preemptions_max"] = max(sum(r["preemptions"]) for r in mine)
        m["gave_up_sessions_max"] = max(r["gave_up_sessions"] for r in mine)
        out.append(m)
    return out


def table(meds: list[dict]) -> str:
    head = (
        "| contender | hit rate | TTFT p50 / p90 / p99 (s) | later turns p50 / p90 / p99 (s) "
        "| e2e p90 (s) | completed | retries | preemptions (max of runs) |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"
    )
    lines = []
    for m in meds:

        def f(k: str, m: dict = m) -> str:
            v = m[k]
            return "-" if v is None else f"{v:.2f}"

        lines.append(
            f"| {m['contender']} | {m['hit_rate']:.2f} | {f('ttft_p50')} / {f('ttft_p90')} / "
            f"{f('ttft_p99')} | {f('ttft_later_p50')} / {f('ttft_later_p90')} / "
            f"{f('ttft_later_p99')} | {f('e2e_p90')} | {m['completed']:.0f}/{m['turns_expected']} "
            f"| {m['retries']:.0f} | {m['preemptions_max']:.0f} |"
        )
    return head + "\n".join(lines)


async def main_async(args: argparse.Namespace) -> int:
    sessions, prefixes = workload(args)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="agentic-") as tmp:
        workdir = Path(tmp)
        for run in range(args.runs):
            for mode in args.contenders:
                row = await one_contender(mode, args, sessions, prefixes, workdir, run)
                rows.append(row)
                print(
                    f"run {run} {mode}: completed {row['completed']}/{row['turns_expected']}, "
                    f"hit {row['hit_rate']:.2f}, TTFT p50/p90 {row['ttft_p50']}/{row['ttft_p90']}, "
                    f"e2e p90 {row['e2e_p90']}, preemptions {row['preemptions']}, "
                    f"wall {row['wall_s']:.0f}s",
                    flush=True,
                )
    meds = medians(rows)
    print(table(meds))
    out = Path(args.out)
    out.write_text(  # noqa: ASYNC240 (once, after the runs)
        json.dumps(
            {"args": {k: v for k, v in vars(args).items()}, "medians": meds, "runs": rows}, indent=2
        )
        + "\n"
    )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--speed", type=float, default=10.0)
    ap.add_argument("--tenants", type=int, default=16)
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=120.0, help="per attempt, simulated s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=CONTENDERS)
    ap.add_argument("--sglang-python", default=sys.executable)
    ap.add_argument("--keep-turns", action="store_true")
    ap.add_argument(
        "--trace",
        action="store_true",
        help="keep every turn with the engine's cached tokens and kvgate's access line",
    )
    ap.add_argument(
        "--kvgate-routing",
        type=json.loads,
        default=None,
        help="JSON routing section for kvgate instead of the default profile (tuning)",
    )
    ap.add_argument(
        "--kvgate-profile",
        choices=("default", "readme"),
        default="default",
        help="kvgate's routing: none (its default, workload-aware) or the README's agent profile",
    )
    ap.add_argument(
        "--shed-retries",
        type=int,
        default=0,
        help="retries of a 429/503 after its Retry-After (0: a shed turn fails, as an agent "
        "loop that does not retry)",
    )
    ap.add_argument("--warmup", type=int, default=160, help="warm-up requests (0: none)")
    ap.add_argument("--warmup-concurrency", type=int, default=32)
    ap.add_argument(
        "--kvgate-admission",
        type=json.loads,
        default={},
        help="JSON merged into kvgate's admission section (experiments only)",
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "agentic_prefix.json"))
    args = ap.parse_args()
    return run_async(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
