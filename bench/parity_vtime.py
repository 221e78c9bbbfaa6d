"""Never below the replica alone (issue 20 item 3), in virtual time: bench/parity_sweep.py's
sweep and judge with kvgate's admission core and enginesim's engine core on one virtual
clock (bench/vtime.py), so a whole sweep takes CPU minutes, repeats exactly, and two
trees can be compared cell by cell with no machine noise.

Both contenders get the same clients (bench/vtime.py's: one request outstanding each,
two retries after Retry-After, an attempt abandoned after T; ``sdk`` states T as the
openai SDK's read timeout does and reads ``retry-after-ms``; ``plain`` states nothing and
reads the whole-second ``Retry-After``). ``straight`` is the same loop with admission
sending every attempt to the engine at once (admission is not asked), so the engine's
own scheduler is all there is; ``kvgate`` is admission as a new user
configures it (the defaults). T is 1.5x the worst latency of a calibration cell (straight,
C = 8, non-stream, clients that never give up). Goodput, the targets and the judge are
bench/parity_sweep.py's.

Both kinds retry a timed-out attempt after 0.5 s, then 1 s, within the same two retries
(bench/closed_loop.py's clients, the openai SDK's first backoffs). What it leaves out, so
the HTTP sweep stays the judge of record: the gateway's own latency and discovery's
scrape delay (gauges reach admission every ``probe_s``).

    PYTHONPATH=$PWD .venv/bin/python bench/parity_vtime.py [--profile seed2-8b-16gb]
        [--requests 150] [--seed 5] [--concurrency 1 2 4 8 16 32 64] [--tag TAG]

Results: bench/results/parity_vtime.<profile>[.TAG].json and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from admission.config import AdmissionConfig  # noqa: E402
from bench.closed_loop import PLAIN_BACKOFF_S  # noqa: E402
from bench.parity_sweep import CONCURRENCIES, TIMEOUT_FACTOR, judge, table  # noqa: E402
from bench.vtime import VtReport, run  # noqa: E402
from enginesim.workloads import WorkItem, seed2_workload  # noqa: E402

CLIENTS = {
    "sdk": {"send_timeout": True, "retry_after_unit_s": None},
    "plain": {"send_timeout": False, "retry_after_unit_s": 1.0},
}


def cell(
    profile: str,
    items: list[WorkItem],
    *,
    contender: str,
    client: str,
    stream: bool,
    concurrency: int,
    timeout_s: float,
    seed: int,
    config: AdmissionConfig | None = None,
) -> dict[str, Any]:
    straight = contender == "straight"
    rep: VtReport = run(
        profile,
        items,
        concurrency=concurrency,
        timeout_s=timeout_s,
        config=config,
        straight=straight,
        max_retries=2,
        timeout_backoff_s=PLAIN_BACKOFF_S,
        stream=stream,
        seed=seed,
        **CLIENTS[client],
    )
    wall = rep.wall_s
    limits = [lim for _, lim, _ in rep.limits]
    return {
        "contender": contender,
        "client": client,
        "mode": "stream" if stream else "non-stream",
        "concurrency": concurrency,
        "requests": rep.requests,
        "completed": rep.completed,
        "timed_out": rep.timed_out,
        "failed": rep.failed,
        "retries": rep.retries,
        "preemptions": rep.preemptions,
        "wall_s": round(wall, 2),
        "goodput_rps": round(rep.completed / wall, 4) if wall > 0 else 0.0,
        "kvgate_limit": None if straight or not limits else f"{min(limits)}-{max(limits)}",
    }


def calibrate(profile: str, items: list[WorkItem], seed: int) -> float:
    """The worst latency straight at C = 8, non-stream, clients that never give up."""
    rep = run(profile, items, concurrency=8, timeout_s=1e9, straight=True, seed=seed)
    return max(rep.latencies)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="seed2-8b-16gb")
    ap.add_argument("--requests", type=int, default=150)
    ap.add_argument("--seed", type=int, default=5, help="the workload's (held out: 5)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCIES))
    ap.add_argument("--clients", nargs="+", choices=list(CLIENTS), default=list(CLIENTS))
    ap.add_argument("--modes", nargs="+", choices=("non-stream", "stream"),
                    default=["non-stream", "stream"])  # fmt: skip
    ap.add_argument("--tag", default="")
    ap.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="kvgate's admission settings for an experiment (default: none)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()

    items = seed2_workload(args.requests, seed=args.seed)
    config = AdmissionConfig(**dict(kv.split("=", 1) for kv in args.set)) if args.set else None
    started = time.process_time()
    timeout_s = TIMEOUT_FACTOR * calibrate(args.profile, items, args.seed)
    print(f"T = {timeout_s:.2f} s (1.5x the worst latency straight at 8)", flush=True)
    rows = []
    for mode in args.modes:
        for client in args.clients:
            for c in args.concurrency:
                for contender in ("straight", "kvgate"):
                    row = cell(args.profile, items, contender=contender, client=client,
                               stream=mode == "stream", concurrency=c, timeout_s=timeout_s,
                               seed=args.seed, config=config)  # fmt: skip
                    rows.append(row)
    verdicts = judge(rows)
    met = sum(v["met"] for v in verdicts)
    print(table(verdicts))
    print(f"\n{met} of {len(verdicts)} cells met; {time.process_time() - started:.0f} CPU s")
    name = f"parity_vtime.{args.profile}{'.' + args.tag if args.tag else ''}.json"
    out = {"args": {**vars(args), "out": None}, "timeout_s": timeout_s, "rows": rows,
           "verdicts": verdicts, "met": met}  # fmt: skip
    (args.out / name).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
