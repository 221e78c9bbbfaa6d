"""Seed 001's job against one simulated `seed2-8b-16gb` replica: straight vs through kvgate.

The client is a batch client that retries 429/503 after Retry-After, as the openai SDK
does but without a retry cap, and abandons an attempt after the client timeout (seed
001's runs lost requests to exactly that). In one run, each on a fresh replica:

- a sweep of fixed client concurrencies straight at the replica (1, 2, 4, ... 32), to
  find the best fixed concurrency: the shortest wall time among runs that completed all
  738 requests;
- client concurrency 32 and 128 straight at the replica: the cliff;
- client concurrency 32 and 128 through kvgate, with no running cap anywhere: kvgate
  learns the replica's limit, and the clients send their timeout as the openai SDKs do
  (``x-stainless-read-timeout``); nothing from the sweep is handed to kvgate;
- the same job from clients that behave like the openai SDK's defaults (``max_retries=2``,
  Retry-After honoured up to 60 s, timeouts retried): straight and through kvgate.

Targets (issue 6): straight at 32 and 128, at least 90% lost; through kvgate, 738 of
738 complete, zero timeouts, zero preemptions on the replica, wall time at most 1.10x the
best fixed concurrency, at most 1.5 retries per completed request at c=32. Times are the
replica's simulated seconds (wall x speed). kvgate's general constants (limit window,
latency budget share) were tuned on seed 1 of the workload in virtual time
(bench/vtime.py); this bench replays seed 0.

    .venv/bin/python bench/seed2_replay.py [--speed 25] [--requests 738]

Results: bench/results/seed2_replay.json (or --out) and a Markdown table on stdout; the
committed runs are seed2_replay.run{1,2,3,4}.json, their output seed2_replay.txt.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from enginesim.profiles import load_profile  # noqa: E402
from enginesim.workloads import seed2_workload  # noqa: E402
from kvgate_demo.demo import DEFAULT_TIMEOUT_S, run_async, run_phase  # noqa: E402

PROFILE = "seed2-8b-16gb"


async def one_run(
    label: str,
    items,
    model: str,
    args,
    *,
    through_kvgate: bool,
    concurrency: int,
    workdir: Path,
    max_retries: int | None = None,
) -> dict:
    row = await run_phase(
        label,
        items,
        profile=PROFILE,
        model=model,
        speed=args.speed,
        timeout_s=args.timeout,
        concurrency=concurrency,
        through_kvgate=through_kvgate,
        workdir=workdir,
        time_limit_s=args.time_limit,
        max_retries=max_retries,
    )
    res = row.result
    out = {
        "label": label,
        "through_kvgate": through_kvgate,
        "concurrency": concurrency,
        "requests": res.requests,
        "completed": res.completed,
        "timed_out": res.timed_out,
        "errors": res.errors,
        "gave_up": res.gave_up,
        "lost": res.lost,
        "shed_retries": res.shed_retries,
        "wall_s": res.wall_s * args.speed,
        "tokens_per_s": res.tokens_per_s / args.speed,
        "p50_s": res.quantile(0.5) * args.speed,
        "max_s": max(res.latencies, default=float("nan")) * args.speed,
        "preemptions": row.preemptions,
        "error_samples": res.error_samples,
        "retries": res.retries,
        "retries_per_completed": res.retries_per_completed,
        "failed": res.failed,
        "failed_after_s": [x * args.speed for x in res.failed_after],
        "limit": row.limit_summary(),
        "limits": [(t * args.speed, v, why) for t, v, why in row.limits],
    }
    print(
        f"{label:>16s}: completed {res.completed:4d}/{res.requests} timed out {res.timed_out:4d} "
        f"errors {res.errors + res.gave_up:3d} shed-retries {res.shed_retries:5d} "
        f"wall {out['wall_s']:8.1f} s preemptions {row.preemptions:6.0f} "
        f"retries/completed {res.retries_per_completed:5.2f} limit {out['limit']}",
        flush=True,
    )
    return out


async def main_async(args) -> int:
    profile = load_profile(PROFILE)
    items = seed2_workload(args.requests, seed=args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-seed2-"))
    rows = []
    sweep = [c for c in (1, 2, 4, 8, 16, 32) if c <= args.max_sweep]
    if args.reuse_straight is not None:
        # The straight rows do not depend on kvgate: repeat only kvgate's rows.
        kept = json.loads(args.reuse_straight.read_text())["rows"]
        rows = [r for r in kept if not r["through_kvgate"] and "sdk" not in r["label"]]
        sweep = []
        print(f"straight rows reused from {args.reuse_straight}", flush=True)
    for c in sweep:
        rows.append(
            await one_run(
                f"straight c={c}",
                items,
                profile.served_model_name,
                args,
                through_kvgate=False,
                concurrency=c,
                workdir=workdir,
            )
        )
    if args.reuse_straight is None and 128 not in sweep:
        rows.append(
            await one_run(
                "straight c=128",
                items,
                profile.served_model_name,
                args,
                through_kvgate=False,
                concurrency=128,
                workdir=workdir,
            )
        )
    complete_straight = [
        r for r in rows if not r["through_kvgate"] and r["completed"] == r["requests"]
    ]
    best = min(complete_straight, key=lambda r: r["wall_s"]) if complete_straight else None
    print(
        f"sweep's best fixed concurrency: {best['concurrency'] if best else None} "
        "(not given to kvgate)",
        flush=True,
    )
    for c in (32, 128):
        rows.append(
            await one_run(
                f"kvgate c={c}",
                items,
                profile.served_model_name,
                args,
                through_kvgate=True,
                concurrency=c,
                workdir=workdir,
            )
        )
    sdk_rows = []
    for through in (False, True) if args.reuse_straight is None else (True,):
        label = f"{'kvgate' if through else 'straight'} c=32 sdk"
        sdk_rows.append(
            await one_run(
                label,
                items,
                profile.served_model_name,
                args,
                through_kvgate=through,
                concurrency=32,
                workdir=workdir,
                max_retries=2,
            )
        )
    print()
    print(
        "| run | completed | lost | timed out | retries/completed | wall (sim s) | tok/s "
        "| p50 (s) | max (s) | preemptions | learned limit |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['label']} | {r['completed']} | {r['lost']} | {r['timed_out']} | "
            f"{r['retries_per_completed']:.2f} | {r['wall_s']:.0f} | {r['tokens_per_s']:.0f} | "
            f"{r['p50_s']:.1f} | {r['max_s']:.1f} | {r['preemptions']:.0f} | {r['limit']} |"
        )
    print()
    print(
        "| openai-SDK-like clients (max_retries=2), c=32 | completed | failed | timed-out "
        "attempts | median time to fail (s) | max time to fail (s) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in sdk_rows:
        fails = sorted(r["failed_after_s"])
        med = f"{fails[len(fails) // 2]:.1f}" if fails else "-"
        mx = f"{fails[-1]:.1f}" if fails else "-"
        print(
            f"| {r['label']} | {r['completed']} | {r['failed']} | {r['timed_out']} | {med} | {mx} |"
        )
    rows += sdk_rows
    verdicts = {}
    for r in rows:
        if r["label"] in ("straight c=32", "straight c=128"):
            verdicts[r["label"] + " loses >= 90%"] = r["lost"] >= 0.9 * r["requests"]
        if r["through_kvgate"]:
            verdicts[r["label"] + " completes all"] = r["completed"] == r["requests"]
            verdicts[r["label"] + " zero timeouts"] = r["timed_out"] == 0
            verdicts[r["label"] + " zero preemptions"] = r["preemptions"] == 0
            if r["label"] == "kvgate c=32":
                verdicts[
                    f"{r['label']} {r['retries_per_completed']:.2f} retries per completed <= 1.5"
                ] = r["retries_per_completed"] <= 1.5
            if best is not None:
                ratio = r["wall_s"] / best["wall_s"]
                r["wall_vs_best"] = ratio
                verdicts[
                    f"{r['label']} wall {ratio:.2f}x best fixed ({best['label']}) <= 1.10x"
                ] = ratio <= 1.10
    print()
    for k, v in verdicts.items():
        print(f"{'PASS' if v else 'MISS'}  {k}")
    out = {
        "profile": PROFILE,
        "speed": args.speed,
        "timeout_s": args.timeout,
        "requests": args.requests,
        "best_fixed": best["label"] if best else None,
        "rows": rows,
        "verdicts": verdicts,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--speed", type=float, default=25.0)
    ap.add_argument("--requests", type=int, default=738)
    ap.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="client timeout, simulated s"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-sweep", type=int, default=32)
    ap.add_argument("--time-limit", type=float, default=1800.0, help="wall seconds per run")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "seed2_replay.json")
    ap.add_argument(
        "--reuse-straight",
        type=Path,
        default=None,
        help="take the straight rows from this earlier result; run only kvgate's rows",
    )
    args = ap.parse_args()
    return run_async(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
