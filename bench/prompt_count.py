"""Tokens kvgate reserves per prompt token, on prefix-heavy agentic traffic: this tree
against a baseline commit, on the same workload and fresh replicas.

Workload: bench/agentic_prefix.py's (deterministic from ``--seed``): ``--tenants``
tenants, each with a long system prompt (~2,500 tokens) and 8 tool schemas (~700
tokens) shared by its ``--sessions`` sessions; each session runs ``--turns`` turns, a
user message with a tool result (~300 tokens) and a streamed answer of at most
``--max-tokens``, the next turn resending the whole history (the answer included).
``--concurrency`` clients each run one session at a time. kvgate starts cold (no
warm-up): its estimator has learned nothing, as in front of a batch that arrives at
once (seed 001's batch shape).

Each contender is ``kvgate serve`` (from this tree, or from ``--baseline``'s tree, taken
with ``git archive``) in front of ``--replicas`` fresh enginesim ``seed2-8b-16gb``
replicas (vLLM flavour: they count at ``/tokenize`` and report usage), with its access
log on. Per request, from the access line: ``prompt_tokens_est`` (the prompt count its
reservation rested on) over ``prompt_tokens`` (the engine's usage: exact), and the
whole reservation ``reserved_tokens`` over the tokens the engine used (prompt and
completion). Reported: median and p90 of both ratios, over all requests and over turns
after the first; the tokenize calls kvgate made per request (``kvgate_prompt_counts_total``
``replica`` + ``failed``); how the prompts were counted.

    .venv/bin/python bench/prompt_count.py [--baseline REV] [--speed 20]

Results: bench/results/prompt_count.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.agentic_prefix import PROFILE, Dispatch, Session, run_turn, turn_body  # noqa: E402
from bench.agentic_prefix import workload as agentic_workload  # noqa: E402
from bench.coding_speculation import counter_by_label  # noqa: E402
from kvgate_demo.demo import (  # noqa: E402
    access_records,
    gateway_config,
    run_async,
    start_gateway,
    start_replica,
    stopping,
    wait_http,
)

# The last commit before exact prefix counts (gateway/prefixcount.py).
BASELINE = "7dbdbef"


def workload(args: argparse.Namespace) -> tuple[list[Session], dict[int, tuple[str, list]]]:
    """bench/agentic_prefix.py's workload, sized by ``--system-words``, ``--tools`` and
    ``--result-words`` (its own sizes fill the 8,192-token context of seed2's card in
    four turns, where every prompt is near the limit and counted by any kvgate)."""
    return agentic_workload(args, args.system_words, args.tools, args.result_words)


def quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


async def prompt_counts(url: str) -> dict[str, float]:
    return await counter_by_label(url, "kvgate_prompt_counts_total", "how")


async def all_ready(url: str, replicas: int, limit_s: float = 60.0) -> None:
    """Wait until kvgate's /ready lists every replica (discovery found them all)."""
    deadline = time.monotonic() + limit_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            async with s.get(url + "/ready") as r:
                if r.status == 200 and len((await r.json())["replicas"]) >= replicas:
                    return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url}: not every replica ready within {limit_s:.0f} s")


async def drive(url: str, args: argparse.Namespace) -> dict[str, int]:
    """Run every session through `url`; returns request id -> turn index."""
    sessions, prefixes = workload(args)
    dispatch = Dispatch("kvgate", [url], args.seed)
    queue: asyncio.Queue = asyncio.Queue()
    for s in sessions:
        queue.put_nowait(s)
    turns: dict[str, int] = {}

    async def client(http: aiohttp.ClientSession) -> None:
        while not queue.empty():
            sess = queue.get_nowait()
            system, tools = prefixes[sess.tenant]
            messages: list[dict] = [{"role": "system", "content": system}]
            for k, user in enumerate(sess.turns):
                messages.append({"role": "user", "content": user})
                body = turn_body(sess, messages, tools, args.max_tokens)
                ok, _, _, _, reply, _, trace = await run_turn(http, dispatch, body, args)
                if trace.get("request_id"):
                    turns[trace["request_id"]] = k
                if not ok:
                    break
                messages.append({"role": "assistant", "content": reply})

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await asyncio.gather(*(client(http) for _ in range(args.concurrency)))
    return turns


def ratios(records: list[dict], turns: dict[str, int], later: bool) -> dict[str, float | None]:
    prompt, reserved = [], []
    for r in records:
        if r.get("outcome") != "ok" or not r.get("prompt_tokens"):
            continue
        if later and turns.get(r["request_id"], 0) == 0:
            continue
        prompt.append(r["prompt_tokens_est"] / r["prompt_tokens"])
        used = r["prompt_tokens"] + (r.get("completion_tokens") or 0)
        if r.get("reserved_tokens"):
            reserved.append(r["reserved_tokens"] / used)
    return {
        "n": len(prompt),
        "prompt_p50": quantile(prompt, 0.5),
        "prompt_p90": quantile(prompt, 0.9),
        "prompt_max": max(prompt, default=None),
        "reserved_p50": quantile(reserved, 0.5),
        "reserved_p90": quantile(reserved, 0.9),
    }


async def one(name: str, source: Path | None, args: argparse.Namespace, workdir: Path) -> dict:
    replicas = [
        start_replica(PROFILE, args.speed, log=workdir / f"{name}-replica-{i}.log")
        for i in range(args.replicas)
    ]
    with stopping(*replicas):
        for p in replicas:
            await wait_http(p.url + "/health", proc=p)
        config = gateway_config(
            [p.url for p in replicas], speed=args.speed, timeout_s=args.timeout, access_log=True
        )
        log = workdir / f"{name}-kvgate.log"
        gw = start_gateway(config, workdir=workdir, log=log, source=source)
        with stopping(gw):
            try:
                await wait_http(gw.url + "/health", limit_s=120.0, proc=gw)
            except RuntimeError:
                print(log.read_text(errors="replace")[-3000:], file=sys.stderr)  # noqa: ASYNC240
                raise
            await all_ready(gw.url, args.replicas)
            t0 = time.monotonic()
            turns = await drive(gw.url, args)
            wall = time.monotonic() - t0
            counts = await prompt_counts(gw.url)
        records = list(access_records(log))
    requests = len(records)
    calls = counts.get("replica", 0.0) + counts.get("failed", 0.0)
    return {
        "contender": name,
        "requests": requests,
        "ok": sum(r.get("outcome") == "ok" for r in records),
        "outcomes": dict(Counter(r.get("outcome") for r in records)),
        "all": ratios(records, turns, later=False),
        "later_turns": ratios(records, turns, later=True),
        "tokenize_calls": calls,
        "tokenize_per_request": calls / requests if requests else None,
        "prompt_counts": counts,
        "wall_s": wall,
    }


def baseline_tree(rev: str, into: Path) -> Path:
    tar = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True)
    into.mkdir()
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar.stdout, check=True)
    return into


def table(rows: list[dict]) -> str:
    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    out = [
        "| kvgate | requests | est / exact prompt p50 / p90 (all) | later turns p50 / p90 "
        "| reserved / used p50 / p90 | tokenize calls / request |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        a, lt = r["all"], r["later_turns"]
        out.append(
            f"| {r['contender']} | {r['ok']}/{r['requests']} | {f(a['prompt_p50'])} / "
            f"{f(a['prompt_p90'])} | {f(lt['prompt_p50'])} / {f(lt['prompt_p90'])} | "
            f"{f(a['reserved_p50'])} / {f(a['reserved_p90'])} | "
            f"{f(r['tokenize_per_request'])} |"
        )
    return "\n".join(out)


async def main_async(args: argparse.Namespace) -> int:
    rows = []
    with tempfile.TemporaryDirectory(prefix="prompt-count-") as tmp:
        workdir = Path(tmp)
        contenders: list[tuple[str, Path | None]] = []
        if args.baseline:
            base = baseline_tree(args.baseline, workdir / "baseline")
            contenders.append((f"baseline {args.baseline}", base))
        contenders.append(("this tree", None))
        for name, source in contenders:
            row = await one(name.split()[0], source, args, workdir)
            row["contender"] = name
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(table(rows))
    Path(args.out).write_text(  # noqa: ASYNC240 (once, after the runs)
        json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n"
    )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default=BASELINE, help="git revision to compare ('': none)")
    ap.add_argument("--speed", type=float, default=20.0)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-words", type=int, default=1000)
    ap.add_argument("--tools", type=int, default=4)
    ap.add_argument("--result-words", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=300.0, help="per attempt, simulated s")
    ap.add_argument("--shed-retries", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "prompt_count.json"))
    args = ap.parse_args()
    return run_async(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
