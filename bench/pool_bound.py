"""How fast any admission that keeps the pool by final sizes can be, on the real vLLM.

invariant 3 (docs/principles.md): the gateway never admits more KV demand to a replica than its
pool. kvgate books each request's final size (prompt + output); vLLM books only what a
request holds so far and preempts when the outputs outgrow the pool. This bench measures
the ceiling the invariant sets, with an oracle no gateway has: it knows every request's
final size exactly (the engine's own prompt count with the chat template, plus its
``max_tokens``: the workload ignores EOS) and sends a request the moment the final sizes
of all it has in flight fit the pool, in vLLM's blocks. Two oracles: ``fifo`` keeps the
order (the head waits for room, as kvgate's strict order does), ``first-fit`` sends any
request that fits (backfilling past the head, perfect packing); ``fifo-via-kvgate`` sends
the in-order oracle's requests through a fresh ``kvgate serve`` configured with the
replica's URL alone, so what the gateway's hop and its own booking cost shows beside
it (the oracle still decides when each request goes). Beside them in the same
rep, straight at fixed concurrencies: the best fixed one is the 1.10x target's judge in
`bench/real_vllm.py`. No timeouts, no retries: every request completes; what is compared
is wall time.

The same engine, workload and restarts as `bench/real_vllm.py`.

    PYTHONPATH=$PWD .venv/bin/python bench/pool_bound.py [--reps 3] [--fixed 6 8]

Results: bench/results/pool_bound.json, and a table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.closed_loop import Outcome, PlainClient, drive  # noqa: E402
from bench.engine_gauges import engine_fed, watch_engine  # noqa: E402
from bench.real_vllm import (  # noqa: E402
    Request,
    body,
    pool_of,
    start_engine,
    workload,
)
from kvgate_demo.demo import start_gateway, stopping, wait_http  # noqa: E402
from tests.realengine.vllm import MODEL_NAME, vllm_path  # noqa: E402

ORACLES = ("fifo", "first-fit")
VIA_KVGATE = "fifo-via-kvgate"  # the in-order oracle's requests sent through a fresh kvgate
RUNNING_EVERY_S = 0.1
ENGINE_EVERY_S = 0.25
NO_TIMEOUT_S = 3600.0


async def final_blocks(session: aiohttp.ClientSession, url: str, reqs: list[Request],
                       block: int) -> list[int]:  # fmt: skip
    """Each request's final size in the engine's blocks: its prompt as the engine counts it
    (`/tokenize` with the chat messages) plus its whole output."""
    out = []
    for r in reqs:
        payload = {"model": MODEL_NAME, "messages": body(r)["messages"]}
        async with session.post(url + "/tokenize", json=payload) as resp:
            resp.raise_for_status()
            prompt = (await resp.json())["count"]
        out.append(math.ceil((prompt + r.max_tokens) / block))
    return out


async def oracle(url: str, reqs: list[Request], sizes: list[int], room: int,
                 order: str) -> dict[str, Any]:  # fmt: skip
    """Send each request when the final sizes in flight leave room for it."""
    waiting = list(range(len(reqs)))
    held = 0
    running = 0
    samples: list[int] = []
    changed = asyncio.Event()
    loop = asyncio.get_running_loop()

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        nonlocal held, running
        try:
            async with session.post(url + "/v1/chat/completions", json=body(reqs[i])) as r:
                r.raise_for_status()
                await r.read()
        finally:
            held -= sizes[i]
            running -= 1
            changed.set()

    async def sample() -> None:
        while True:
            samples.append(running)
            await asyncio.sleep(RUNNING_EVERY_S)

    t0 = loop.time()
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        sampler = asyncio.create_task(sample())
        tasks = []
        while waiting:
            for i in list(waiting):
                if held + sizes[i] <= room:
                    waiting.remove(i)
                    held += sizes[i]
                    running += 1
                    tasks.append(asyncio.create_task(one(session, i)))
                elif order == "fifo":
                    break
            changed.clear()
            if waiting:
                await changed.wait()
        await asyncio.gather(*tasks)
        sampler.cancel()
    return {"wall_s": round(loop.time() - t0, 2),
            "mean_running": round(statistics.fmean(samples), 2)}  # fmt: skip


async def fixed(url: str, reqs: list[Request], concurrency: int) -> dict[str, Any]:
    """Straight at a fixed concurrency: real_vllm.py's plain client in a closed loop, with
    no timeout that could cut an attempt short (as its calibration runs)."""
    out = Outcome(requests=len(reqs))
    client = PlainClient(url, NO_TIMEOUT_S, out)
    try:
        await drive(client, [body(r) for r in reqs], concurrency, out)
    finally:
        await client.close()
    if out.completed != out.requests:
        raise RuntimeError(f"straight at {concurrency}: {out.completed} of {out.requests}")
    return {"wall_s": round(out.wall_s, 2), "mean_running": float(concurrency)}


async def contender(name: str, reqs: list[Request], workdir: Path, rep: int) -> dict[str, Any]:
    engine = start_engine(f"bound-r{rep}-{name}", workdir)
    try:
        pool = pool_of(engine)
        ((labels, _),) = engine.metrics()["vllm:cache_config_info"]
        block = int(labels["block_size"])
        before = engine.metric("vllm:num_preemptions_total")
        sizes = []
        if not name.startswith("c"):
            async with aiohttp.ClientSession() as s:
                sizes = await final_blocks(s, engine.url, reqs, block)
        gw = None
        if name == VIA_KVGATE:  # configured as a new user would: the replica's URL alone
            config = {
                "replicas": [{"name": "vllm", "url": engine.url}],
                "logging": {"level": "warning", "access_log": False},
            }
            gw = start_gateway(config, workdir=workdir, log=workdir / f"kvgate-{rep}.log")
        with stopping(*([gw] if gw else [])):
            url = engine.url
            if gw is not None:
                await wait_http(gw.url + "/ready", 60.0, gw)
                url = gw.url
            held: list[tuple[float, float]] = []
            watch = asyncio.create_task(watch_engine(engine.url, held, ENGINE_EVERY_S))
            try:
                if name.startswith("c"):
                    row = await fixed(url, reqs, int(name[1:]))
                else:
                    # vLLM keeps one block of its pool as the null block, given to nobody.
                    order = "fifo" if name == VIA_KVGATE else name
                    row = await oracle(url, reqs, sizes, pool // block - 1, order)
            finally:
                watch.cancel()
        row.update(**engine_fed(held), contender=name, rep=rep, pool_tokens=pool,
                   preemptions=int(engine.metric("vllm:num_preemptions_total") - before))  # fmt: skip
    finally:
        engine.stop()
    print(f"  rep {rep} {name}: {row}", file=sys.stderr)
    return row


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--fixed", type=int, nargs="+", default=[6, 8])
    ap.add_argument("--oracles", nargs="+", choices=[*ORACLES, VIA_KVGATE],
                    default=[*ORACLES, VIA_KVGATE])  # fmt: skip
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    reqs = workload(args.requests, vllm_path("KVGATE_VLLM_MODEL"))
    names = [f"c{c}" for c in args.fixed] + list(args.oracles)
    rows = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kvgate-pool-bound-") as tmp:
        for rep in range(1, args.reps + 1):
            for name in names:
                rows.append(await contender(name, reqs, Path(tmp), rep))
    print(
        "| contender | wall (s), median | per rep | running (sent / at the engine) "
        "| preemptions | / best fixed |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    best = {}  # per rep, the fastest fixed concurrency
    for rep in range(1, args.reps + 1):
        best[rep] = min(r["wall_s"] for r in rows if r["rep"] == rep and r["contender"][0] == "c")
    summary = []
    for name in names:
        mine = [r for r in rows if r["contender"] == name]
        ratio = statistics.median(r["wall_s"] / best[r["rep"]] for r in mine)
        line = {
            "contender": name,
            "wall_s": round(statistics.median(r["wall_s"] for r in mine), 2),
            "per_rep": [r["wall_s"] for r in mine],
            "mean_running": round(statistics.median(r["mean_running"] for r in mine), 2),
            "engine_mean_running": round(
                statistics.median(r["engine_mean_running"] for r in mine), 2
            ),
            "preemptions": statistics.median(r["preemptions"] for r in mine),
            "ratio_to_best_fixed": round(ratio, 3),
        }
        summary.append(line)
        print(f"| {name} | {line['wall_s']} | {line['per_rep']} "
              f"| {line['mean_running']} / {line['engine_mean_running']} "
              f"| {line['preemptions']} | {line['ratio_to_best_fixed']} |")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "meta": {
            "workload": "bench/real_vllm.py's (seed 001's shape)",
            "requests": len(reqs),
            "load_before": load_before,
            "load_after": os.getloadavg(),
            "at": time.strftime("%Y-%m-%d %H:%M"),
        },  # fmt: skip
        "summary": summary,
        "rows": rows,
    }
    (args.out / "pool_bound.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
