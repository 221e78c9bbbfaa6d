"""The scenario matrix (issue 47, item 4) in virtual time: engines x clients x load x
workload seeds, kvgate against the replica alone and the best fixed concurrency.

Every cell runs on one virtual clock (bench/vtime.py: the gateway's own admission,
accounting and retry code in front of enginesim's engine core), so the whole matrix takes
CPU minutes and repeats exactly. kvgate runs as a new user configures it: only its
replica (admission's defaults). In each cell three contenders get the same clients, the
same load and the same workload:

- ``kvgate``: admission in front of the replica;
- ``alone``: every attempt straight at the replica (its own scheduler is all there is);
- ``fixed C``: a proxy that holds at most C attempts at the replica and queues the rest
  in order (C in 2, 4, 8, 16); the best of them is the one with the most goodput among
  those that complete 95% of the requests (else among all), as seed 001's sweep finds it.

Engines (enginesim profiles): ``seed2`` (seed 001's 8B model on a 16 GB card: prefill
bound, large prompts, small answers; seed 001's workload) and ``vllm-cpu-tiny`` (the
real vLLM's regime on this machine: pool 4,096 tokens, prompts 600-1,800 and answers
40-200 tokens; flat, decode bound). Clients (T: 1.5x the worst latency straight at 8,
non-stream, per engine and seed):

- ``sdk``, ``sdk-stream``: the openai SDK: states T (``x-stainless-read-timeout``) and
  which retry it sends, retries a shed after ``retry-after-ms`` and a timeout after
  0.5 s then 1 s, two retries;
- ``plain``: states nothing, whole-second ``Retry-After``, retries sheds and timeouts;
- ``plain-noretry``: the same, but a timed-out attempt is lost;
- ``told-wait``: the SDK's headers, but T bounds the whole call: the Retry-After it waits
  counts in it, and a retry told to wait past what is left is given up;
- ``plain-told-wait``: the same whole-call T, stating nothing (the issue's own client);
- ``no-timeout``: states nothing and waits for ever (a shed is still retried).

Loads: closed loops of 1, 8, 32 and 64 clients (one request outstanding each); open loop
Poisson arrivals at 0.5x, 1x and 2x the replica's capacity (the best goodput straight at
a fixed concurrency, clients that never give up); a burst (every request at once);
agentic sessions that all open at once (`agentic`: a shared system prompt, each turn the
last one's prompt, answer and a new message, sent once the last is answered).

Targets per cell (the issue's): goodput at least 0.95x the better of ``alone`` and the
best fixed; of what the best fixed completes, at most 1% lost; no more preemptions than
the best fixed. Workload seeds come from ``--master`` (not chosen per run). What it
leaves out: the agentic cell's TTFT against sglang-router (bench/agentic_prefix.py, real
processes, four replicas; here one), per-chunk idle timeouts,
the real engines (bench/real_vllm.py) and the gateway's own HTTP latency.

    PYTHONPATH=$PWD .venv/bin/python bench/matrix.py [--master 47] [--seeds 2]
        [--engines seed2 vllm-cpu-tiny] [--clients ...] [--loads ...] [--jobs 2]

Prints a Markdown table (one row per engine, client and load, over the seeds) and the
misses; writes each cell's verdict to bench/results/matrix.jsonl.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from admission.config import AdmissionConfig  # noqa: E402
from bench.closed_loop import PLAIN_BACKOFF_S  # noqa: E402
from bench.enginesim_vs_vllm import token_ids  # noqa: E402
from bench.first_wave_vt import vllm_items  # noqa: E402
from bench.parity_sweep import TIMEOUT_FACTOR  # noqa: E402
from bench.vtime import VtReport, run  # noqa: E402
from enginesim.types import Workload  # noqa: E402
from enginesim.workloads import WorkItem, seed2_workload  # noqa: E402

PARITY = 0.95  # goodput against the better reference
KEPT = 0.99  # of what the best fixed completes
IN_TIME = 0.95  # a fixed concurrency that completes this share is a candidate for best
FIXED = (2, 4, 8, 16)

ENGINES: dict[str, dict[str, Any]] = {
    "seed2": {"profile": "seed2-8b-16gb", "requests": 150, "pool": None},
    "vllm-cpu-tiny": {"profile": "vllm-cpu-tiny", "requests": 300, "pool": None},
}
_SDK = {"send_timeout": True, "retry_after_unit_s": None, "timeout_backoff_s": PLAIN_BACKOFF_S}
_PLAIN = {"send_timeout": False, "retry_after_unit_s": 1.0, "timeout_backoff_s": PLAIN_BACKOFF_S}
CLIENTS: dict[str, dict[str, Any]] = {
    "sdk": _SDK,
    "sdk-stream": {**_SDK, "stream": True},
    "plain": _PLAIN,
    "plain-noretry": {**_PLAIN, "timeout_backoff_s": None},
    "told-wait": {**_SDK, "total_timeout": True},
    "plain-told-wait": {**_PLAIN, "total_timeout": True},
    "no-timeout": {**_PLAIN, "no_timeout": True},
}
LOADS = (
    "closed-1", "closed-8", "closed-32", "closed-64", "open-0.5", "open-1", "open-2", "burst",
    "agentic",
)  # fmt: skip
TURNS = 6  # per agentic session


def workload(engine: str, seed: int) -> list[WorkItem]:
    spec = ENGINES[engine]
    if engine == "seed2":
        return seed2_workload(spec["requests"], seed=seed)
    return vllm_items(seed, spec["requests"])


def agentic(engine: str, seed: int) -> list[list[WorkItem]]:
    """Agentic sessions that all open at once: ``TURNS`` turns each, as many sessions as
    make the engine's request count. Every prompt starts with one system prompt (tools and
    instructions) shared by all sessions, then the session's history: each turn's prompt
    is the last one's, its answer and a new message, so an engine that caches prefixes
    holds most of it (seed2: a 2,000-token system prompt, 200-600-token messages and
    40-200-token answers; vllm-cpu-tiny: 200, 60-140 and 40-100, inside its 2,048-token
    context)."""
    rng = random.Random(seed * 31 + 7)
    if engine == "seed2":
        system, message, answers = 2000, (200, 600), (40, 200)
    else:
        system, message, answers = 200, (60, 140), (40, 100)
    shared = token_ids(rng, system)
    out: list[list[WorkItem]] = []
    for s in range(ENGINES[engine]["requests"] // TURNS):
        history = shared + token_ids(rng, rng.randint(*message))
        session = []
        for t in range(TURNS):
            answer = rng.randint(*answers)
            session.append(
                WorkItem(f"a{seed}-{s}-{t}", [], "", list(history), answer, Workload.AGENTIC)
            )
            history = history + token_ids(rng, answer) + token_ids(rng, rng.randint(*message))
        out.append(session)
    return out


def calibrate(engine: str, seed: int) -> tuple[float, float]:
    """(T, capacity): 1.5x the worst latency straight at 8 (non-stream, clients that never
    give up), and the best goodput straight at a fixed concurrency (requests/s)."""
    spec, items = ENGINES[engine], workload(engine, seed)
    best = 0.0
    worst_at_8 = 0.0
    for c in (1, 2, 4, 8, 16):
        r = run(spec["profile"], items, concurrency=c, timeout_s=1e9, straight=True,
                pool_tokens=spec["pool"], seed=seed)  # fmt: skip
        best = max(best, r.completed / r.wall_s if r.wall_s > 0 else 0.0)
        if c == 8:
            worst_at_8 = max(r.latencies)
    return TIMEOUT_FACTOR * worst_at_8, best


def arrivals(load: str, n: int, capacity: float, seed: int) -> list[float] | None:
    """Open-loop arrival times for `load` (None: a closed loop)."""
    if load == "burst":
        return [0.0] * n
    if not load.startswith("open-"):
        return None
    rate = float(load.split("-", 1)[1]) * capacity
    rng = random.Random(seed * 7919 + int(rate * 1000))
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def one(
    args: tuple[str, int, str, str, str, int | None, float, float, dict[str, Any]],
) -> dict[str, Any]:
    """One contender in one cell."""
    engine, seed, client, load, contender, cap, timeout_s, capacity, overrides = args
    spec = ENGINES[engine]
    kw = dict(CLIENTS[client])
    if kw.pop("no_timeout", False):
        timeout_s = 1e9
    sessions = agentic(engine, seed) if load == "agentic" else None
    items = workload(engine, seed) if sessions is None else []  # sessions bring their own
    times = None if sessions is not None else arrivals(load, len(items), capacity, seed)
    if sessions is not None:
        concurrency = len(sessions)
    else:
        concurrency = int(load.split("-")[1]) if times is None else len(items)
    rep: VtReport = run(
        spec["profile"], items, concurrency=concurrency, timeout_s=timeout_s,
        max_retries=2, pool_tokens=spec["pool"], seed=seed, arrivals=times,
        straight=contender != "kvgate", fixed=cap, sessions=sessions,
        config=AdmissionConfig(**overrides) if overrides else None, **kw,
    )  # fmt: skip
    return {
        "engine": engine,
        "seed": seed,
        "client": client,
        "load": load,
        "contender": contender,
        "requests": rep.requests,
        "completed": rep.completed,
        "timed_out": rep.timed_out,
        "failed": rep.failed,
        "preemptions": rep.preemptions,
        "wall_s": round(rep.wall_s, 3),
        "goodput": rep.completed / rep.wall_s if rep.wall_s > 0 else 0.0,
    }


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """kvgate's row in one cell (engine, seed, client, load) against its references."""
    by = {r["contender"]: r for r in rows}
    kv, alone = by["kvgate"], by["alone"]
    fixed = [r for r in rows if r["contender"].startswith("fixed")]
    fit = [r for r in fixed if r["completed"] >= IN_TIME * r["requests"]] or fixed
    best = max(fit, key=lambda r: r["goodput"])
    ref = max(alone["goodput"], best["goodput"])
    ratio = kv["goodput"] / ref if ref > 0 else math.inf
    lost = max(0, best["completed"] - kv["completed"])
    misses = []
    if ratio < PARITY:
        misses.append("goodput")
    if kv["completed"] < KEPT * best["completed"]:
        misses.append("lost")
    if kv["preemptions"] > best["preemptions"]:
        misses.append("preemptions")
    return {
        **{k: kv[k] for k in ("engine", "seed", "client", "load")},
        "ratio": round(ratio, 3),
        "kvgate": f"{kv['completed']}/{kv['requests']}",
        "alone": f"{alone['completed']}/{alone['requests']}",
        "best_fixed": f"{best['contender']} {best['completed']}/{best['requests']}",
        "lost": lost,
        "preemptions": (kv["preemptions"], best["preemptions"]),
        "misses": misses,
    }


def table(verdicts: list[dict[str, Any]]) -> str:
    """One row per (engine, client, load), over the seeds."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for v in verdicts:
        groups.setdefault((v["engine"], v["client"], v["load"]), []).append(v)
    lines = [
        "| engine | client | load | goodput vs better ref (min) | kvgate completed | "
        "best fixed completed | lost vs best fixed | met |",
        "| --- | --- | --- | ---: | --- | --- | ---: | --- |",
    ]
    for (engine, client, load), vs in groups.items():
        met = sum(not v["misses"] for v in vs)
        missed = sorted({m for v in vs for m in v["misses"]})
        lines.append(
            f"| {engine} | {client} | {load} | {min(v['ratio'] for v in vs):.2f} | "
            f"{', '.join(v['kvgate'] for v in vs)} | {', '.join(v['best_fixed'] for v in vs)} | "
            f"{sum(v['lost'] for v in vs)} | {met}/{len(vs)}"
            f"{' (' + ', '.join(missed) + ')' if missed else ''} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--master", type=int, default=47, help="draws the workload seeds")
    ap.add_argument("--seeds", type=int, default=2, help="workload seeds per cell")
    ap.add_argument("--engines", nargs="+", choices=list(ENGINES), default=list(ENGINES))
    ap.add_argument("--clients", nargs="+", choices=list(CLIENTS), default=list(CLIENTS))
    ap.add_argument("--loads", nargs="+", choices=LOADS, default=list(LOADS))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="FIELD=JSON",
        help="judge a candidate rule: admission settings over the defaults (the default "
        "run is a new user's configuration)",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "matrix.jsonl")
    args = ap.parse_args()
    started = time.time()
    overrides = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    seeds = random.Random(args.master).sample(range(1_000_000), args.seeds)
    calib = {(e, s): calibrate(e, s) for e in args.engines for s in seeds}
    tasks = []
    for (engine, seed), (timeout_s, capacity) in calib.items():
        for client in args.clients:
            for load in args.loads:
                contenders = [("kvgate", None), ("alone", None)]
                contenders += [(f"fixed {c}", c) for c in FIXED]
                for name, cap in contenders:
                    tasks.append(
                        (engine, seed, client, load, name, cap, timeout_s, capacity, overrides)
                    )
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(one, tasks, chunksize=4))
    cells: dict[tuple[str, int, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["engine"], r["seed"], r["client"], r["load"]), []).append(r)
    verdicts = [verdict(rs) for rs in cells.values()]
    met = sum(not v["misses"] for v in verdicts)
    print(f"seeds {seeds} (master {args.master}); T and capacity per engine and seed: "
          + ", ".join(f"{e}/{s}: {t:.1f} s, {c:.3f} req/s" for (e, s), (t, c) in calib.items()))  # fmt: skip
    print(table(verdicts))
    print(f"\n{met} of {len(verdicts)} cells met; {time.time() - started:.0f} s")
    for v in verdicts:
        if v["misses"]:
            print(f"  missed {v['engine']}/{v['seed']} {v['client']} {v['load']}: "
                  f"{', '.join(v['misses'])} (ratio {v['ratio']}, kvgate {v['kvgate']}, "
                  f"best {v['best_fixed']}, preemptions {v['preemptions']})")  # fmt: skip
    # One line per cell's verdict (the runs repeat exactly from the master seed).
    head = {"seeds": seeds, "master": args.master, "met": met, "set": overrides}
    lines = [json.dumps(head)]
    lines += [json.dumps(v, separators=(",", ":")) for v in verdicts]
    args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
