"""Tenants sharing an oversubscribed pool: throughput share against weight, and SLO
attainment, through a real kvgate process in front of simulated replicas.

Rig: two `seed2-8b-16gb` replicas (enginesim, vLLM flavour, clock x`--speed`) behind one
`kvgate serve`; every time below is in the replica's simulated seconds. Three tenants,
each with its own hashed key, all streaming with ``stream_options.include_usage``:

- ``interactive``: weight 3, 96 closed-loop clients, prompts ~600 tokens, 120 out;
  SLO: TTFT 10 s, ITL 0.1 s (10 tokens/s per user), end to end 30 s.
- ``batch``: weight 1, 64 closed-loop clients, prompts ~2,000 tokens, 200 out; SLO:
  end to end 300 s only.
- ``trickle``: weight 1, 2 clients that each wait 10 s between requests, prompts ~300
  tokens, 60 out; SLO: TTFT 5 s, end to end 20 s.

interactive and batch each keep far more requests outstanding than the two replicas run
(kvgate learns a running limit per replica; the KV pools fill too), so both are always
backlogged: the fair order should split the served tokens between them 3 to 1 (0.75 of
their sum to interactive), while the trickle, far below its share, is served as it asks.
A shed request (429/503) is retried after its ``retry-after-ms``, like the openai SDK.

Three modes, the same load each: ``fair``: the tenants with their weights, kvgate told
their TTFT and end-to-end targets (attainment is measured, placement ignores them) but
not interactive's ITL target; ``fair+itl``: the same, and kvgate told the ITL target
too, so interactive's requests go only where the replica's ITL model predicts the target
holds, or wait (admission/learned/itl.py, routing/filters/slo_itl.py); ``fifo``: all keys
map to one tenant (one first-come line, no weights, no targets). Attainment is always
measured against every target in the list above, from the client's clocks.
Measured over the run after the first 10% (warm-up), per tenant: tokens served (prompt
+ completion of completed requests), share, requests, and attainment of each target from
the client's own clocks.

    .venv/bin/python bench/tenants.py [--speed 25] [--seconds 90] [--runs 2]

Results: bench/results/tenants.json and a Markdown table on stdout.
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
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from admission.tenants import hash_key  # noqa: E402
from enginesim.tokenizer import GEN_VOCAB  # noqa: E402
from kvgate_demo.demo import (  # noqa: E402
    gateway_config,
    run_async,
    start_gateway,
    start_replica,
    stopping,
    wait_http,
)

PROFILE = "seed2-8b-16gb"
MODEL = "llama-3.1-8b-instruct-awq"
WORDS = [w for w in GEN_VOCAB if w.strip() and w.strip().isalpha()]
MODES = ("fair", "fair+itl", "fifo")


@dataclass(frozen=True)
class TenantSpec:
    name: str
    weight: float
    clients: int
    prompt: int
    output: int
    think_s: float  # simulated seconds between a client's requests
    slo: dict[str, float]


TENANTS = (
    TenantSpec(
        "interactive", 3.0, 96, 600, 120, 0.0, {"ttft_s": 10.0, "itl_s": 0.1, "e2e_s": 30.0}
    ),
    TenantSpec("batch", 1.0, 64, 2000, 200, 0.0, {"e2e_s": 300.0}),
    TenantSpec("trickle", 1.0, 2, 300, 60, 10.0, {"ttft_s": 5.0, "e2e_s": 20.0}),
)


@dataclass
class Sample:
    start: float
    end: float
    ok: bool
    ttft: float | None = None
    itl: float | None = None
    tokens: int = 0
    retries: int = 0


@dataclass
class TenantRun:
    samples: list[Sample] = field(default_factory=list)
    sheds: int = 0
    errors: int = 0


def prompt_text(rng: random.Random, n: int) -> str:
    # A unique head defeats the prefix cache, so every request costs its full prefill.
    return f"{rng.randrange(10**9)} " + "".join(rng.choice(WORDS) for _ in range(n))


async def one_request(
    s: aiohttp.ClientSession, url: str, key: str, spec: TenantSpec, rng: random.Random
) -> tuple[Sample | None, float | None]:
    """One attempt: (sample, None) when answered, (None, retry_after_s) when shed."""
    payload = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt_text(rng, spec.prompt)}],
        "max_tokens": spec.output,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    first = last = None
    events = 0
    tokens = 0
    async with s.post(
        url + "/v1/chat/completions",
        json=payload,
        headers={"Authorization": f"Bearer {key}"},
    ) as r:
        if r.status in (429, 503):
            await r.read()
            return None, int(r.headers.get("retry-after-ms", "1000")) / 1000
        if r.status != 200:
            await r.read()
            return Sample(t0, loop.time(), False), None
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            doc = json.loads(line[6:])
            if "error" in doc:
                return Sample(t0, loop.time(), False), None
            if doc.get("usage"):
                tokens = doc["usage"]["prompt_tokens"] + doc["usage"]["completion_tokens"]
            if doc.get("choices") and doc["choices"][0].get("delta", {}).get("content"):
                now = loop.time()
                first = first if first is not None else now
                last = now
                events += 1
    end = loop.time()
    itl = (last - first) / (events - 1) if first is not None and events > 1 else None
    ttft = first - t0 if first is not None else None
    return Sample(t0, end, tokens > 0, ttft, itl, tokens), None


async def client(
    url: str, key: str, spec: TenantSpec, out: TenantRun, stop_at: float, speed: float, seed: int
) -> None:
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    timeout = aiohttp.ClientTimeout(total=600 / speed)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        if spec.think_s:
            await asyncio.sleep(rng.uniform(0, spec.think_s / speed))
        while loop.time() < stop_at:
            start = loop.time()
            retries = 0
            while loop.time() < stop_at:
                try:
                    sample, wait = await one_request(s, url, key, spec, rng)
                except (aiohttp.ClientError, TimeoutError):
                    out.errors += 1
                    sample, wait = None, 1.0 / speed
                if sample is not None:
                    sample.start = start  # from the first attempt
                    sample.retries = retries
                    out.samples.append(sample)
                    break
                out.sheds += 1
                retries += 1
                await asyncio.sleep(wait or 0.0)
            if spec.think_s:
                await asyncio.sleep(spec.think_s / speed)


def tenants_config(mode: str, speed: float) -> list[dict]:
    """kvgate's tenants for one mode (module docstring)."""
    if mode == "fifo":  # one tenant for everyone: a first-come line
        return [
            {
                "name": "everyone",
                "keys_sha256": [hash_key(f"sk-bench-{t.name}") for t in TENANTS],
                "queue_timeout_s": 300 / speed,
            }
        ]
    return [
        {
            "name": t.name,
            "keys_sha256": [hash_key(f"sk-bench-{t.name}")],
            "weight": t.weight,
            "queue_timeout_s": 300 / speed,
            "slo": {k: v / speed for k, v in t.slo.items() if k != "itl_s" or mode == "fair+itl"},
        }
        for t in TENANTS
    ]


def summarise(runs: dict[str, TenantRun], t_from: float, t_to: float, speed: float) -> dict:
    out: dict[str, dict] = {}
    total = 0
    for t in TENANTS:
        got = [x for x in runs[t.name].samples if t_from <= x.end <= t_to]
        ok = [x for x in got if x.ok]
        tokens = sum(x.tokens for x in ok)
        total += tokens
        slo: dict[str, float | None] = {}
        for target, limit in t.slo.items():
            if target == "ttft_s":
                vals = [x.ttft for x in got]
            elif target == "itl_s":
                vals = [x.itl for x in got]
            else:
                vals = [x.end - x.start if x.ok else None for x in got]
            judged = [v for v in vals]
            met = sum(1 for v in judged if v is not None and v * speed <= limit)
            slo[target] = met / len(judged) if judged else None
        ttfts = [x.ttft * speed for x in ok if x.ttft is not None]
        itls = [x.itl * speed for x in ok if x.itl is not None]
        out[t.name] = {
            "weight": t.weight,
            "completed": len(ok),
            "failed": len(got) - len(ok),
            "sheds": runs[t.name].sheds,
            "errors": runs[t.name].errors,
            "tokens": tokens,
            "tokens_per_s": tokens / ((t_to - t_from) * speed),
            "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            "ttft_p99_s": sorted(ttfts)[int(0.99 * (len(ttfts) - 1))] if ttfts else None,
            "itl_p50_s": statistics.median(itls) if itls else None,
            "slo_attainment": slo,
        }
    for t in TENANTS:
        out[t.name]["share"] = out[t.name]["tokens"] / total if total else 0.0
    ib = out["interactive"]["tokens"] + out["batch"]["tokens"]
    out["_interactive_vs_batch"] = out["interactive"]["tokens"] / ib if ib else None
    return out


async def run_once(mode: str, args: argparse.Namespace, workdir: Path) -> dict:
    speed = args.speed
    replicas = [
        start_replica(PROFILE, speed, log=workdir / f"replica-{mode}-{i}.log") for i in range(2)
    ]
    with stopping(*replicas):
        for r in replicas:
            await wait_http(r.url + "/health", proc=r)
        config = gateway_config([r.url for r in replicas], speed=speed, timeout_s=300.0)
        config["tenants"] = tenants_config(mode, speed)
        # The ITL model's memory, a minute of the replica's time.
        config["admission"]["itl_memory_s"] = 60.0 / speed
        gw = start_gateway(config, workdir=workdir, log=workdir / f"kvgate-{mode}.log")
        with stopping(gw):
            await wait_http(gw.url + "/ready", proc=gw)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            stop_at = t0 + args.seconds
            runs = {t.name: TenantRun() for t in TENANTS}
            tasks = [
                asyncio.create_task(
                    client(
                        gw.url,
                        f"sk-bench-{t.name}",
                        t,
                        runs[t.name],
                        stop_at,
                        speed,
                        seed=hash((t.name, i, args.seed)) & 0xFFFF,
                    )
                )
                for t in TENANTS
                for i in range(t.clients)
            ]
            await asyncio.gather(*tasks)
            async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
                metrics = await r.text()
    summary = summarise(runs, t0 + 0.1 * args.seconds, stop_at, speed)
    summary["_kvgate_slo"] = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in metrics.splitlines()
        if line.startswith(("kvgate_tenant_slo_total", "kvgate_tenant_slo_met_total"))
    }
    return summary


def table(results: dict[str, list[dict]]) -> str:
    lines = [
        "| mode | tenant | weight | tokens/s | share | interactive / (interactive + batch) "
        "| completed | sheds | TTFT p50 / p99 (s) | ITL p50 (s) | SLO attainment |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for mode, runs in results.items():
        for t in TENANTS:

            def med(key: str, runs: list[dict] = runs, name: str = t.name) -> float | None:
                vals = [r[name][key] for r in runs if r[name][key] is not None]
                return statistics.median(vals) if vals else None

            ib = statistics.median(r["_interactive_vs_batch"] for r in runs)
            att = []
            for target in t.slo:
                vals = [r[t.name]["slo_attainment"][target] for r in runs]
                vals = [v for v in vals if v is not None]
                each = ", ".join(f"{v:.0%}" for v in vals)
                att.append(f"{target[:-2]} {statistics.median(vals):.0%} [{each}]" if vals else "")
            ttft50, ttft99, itl50 = med("ttft_p50_s"), med("ttft_p99_s"), med("itl_p50_s")
            lines.append(
                f"| {mode} | {t.name} | {t.weight:g} | {med('tokens_per_s'):.0f} | "
                f"{med('share'):.2f} | {ib:.2f} | {med('completed'):.0f} | {med('sheds'):.0f} | "
                f"{ttft50 if ttft50 is None else round(ttft50, 1)} / "
                f"{ttft99 if ttft99 is None else round(ttft99, 1)} | "
                f"{itl50 if itl50 is None else round(itl50, 3)} | {'; '.join(att)} |"
            )
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> int:
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="kvgate-tenants-") as tmp:
        for run in range(args.runs):
            for mode in MODES:
                t = time.monotonic()
                res = await run_once(mode, args, Path(tmp))
                results[mode].append(res)
                print(
                    f"run {run + 1} {mode}: interactive/(interactive+batch) "
                    f"{res['_interactive_vs_batch']:.2f}, "
                    + ", ".join(
                        f"{n} {res[n]['tokens_per_s']:.0f} tok/s" for n in (x.name for x in TENANTS)
                    )
                    + f" ({time.monotonic() - t:.0f} s wall)",
                    flush=True,
                )
    doc = {
        "speed": args.speed,
        "seconds_wall": args.seconds,
        "runs": args.runs,
        "tenants": [t.__dict__ for t in TENANTS],
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    print(table(results))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--speed", type=float, default=25.0)
    p.add_argument("--seconds", type=float, default=90.0, help="wall seconds per run")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tenants.json")
    args = p.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        return run_async(main_async(args))
    return 1


if __name__ == "__main__":
    sys.exit(main())
