"""`kvgate showcase`: the ceiling sweep straight at a simulated replica, then through kvgate.

    kvgate showcase --out showcase-out     # about 6 minutes at the defaults

Starts a simulated replica (`enginesim serve`, seed 001's 8B model on a 16 GB card by
default, clock x25) and runs `kvgate sweep`'s staircase (seed 001's batch-json workload,
1 to 64 clients, seed 001's 45 s client timeout) straight at it; then starts a fresh
replica behind a fresh `kvgate serve` (no running cap, no queue deadline: kvgate learns
the limit) and runs the same staircase with the same clients through kvgate. Straight,
the curve falls off the cliff; through kvgate it holds the plateau. Writes one report with
both runs on the same plots, kvgate's learned limit marked.

Replica and gateway run as separate processes, as in production, and are stopped by PID.
Times and rates are in the replica's simulated seconds.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path


def main(argv: Sequence[str] | None = None) -> int:
    # Locust (imported by loadtests.sweep) patches the process with gevent: it comes
    # before anything that imports ssl (aiohttp, via kvgate_demo.demo).
    sw = importlib.import_module("loadtests.sweep")
    from enginesim.profiles import load_profile
    from kvgate_demo import demo
    from loadtests.report import points_table

    ap = argparse.ArgumentParser(
        prog="kvgate showcase",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--profile", default=demo.DEFAULT_PROFILE, help="enginesim profile")
    ap.add_argument("--workload", default="batch-json", choices=sw.WORKLOAD_NAMES)
    ap.add_argument("--out", default="", help="output folder (default: showcase-<time>)")
    sw.add_sweep_arguments(ap)
    ap.set_defaults(speed=25.0, timeout=demo.DEFAULT_TIMEOUT_S, hold=600.0)
    args = ap.parse_args(list(argv) if argv is not None else None)
    profile = load_profile(args.profile)
    out = Path(args.out or datetime.now().strftime("showcase-%Y%m%d-%H%M%S"))
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-showcase-"))
    try:
        steps = sw.parse_steps(args.steps)
    except ValueError as e:
        ap.error(str(e))
    minutes = 2 * len(steps) * args.hold / args.speed / 60
    print(
        f"kvgate showcase: {args.workload} workload on {profile.name} (pool "
        f"{profile.pool_tokens:,} tokens), clock x{args.speed:g}; steps {args.steps}, "
        f"{args.hold:g} s each, client timeout {args.timeout:g} s; straight, then through "
        f"kvgate (about {minutes:.1f} min)",
        file=sys.stderr,
    )
    results = []
    for label, through in (("straight", False), ("through kvgate", True)):
        slug = "kvgate" if through else "straight"
        replica = demo.start_replica(args.profile, args.speed, log=workdir / f"replica-{slug}.log")
        with demo.stopping(replica):
            wait_ok(replica.url + "/health", replica)
            target = replica.url
            gw = None
            if through:
                gw = demo.start_gateway(
                    demo.gateway_config(
                        [replica.url],
                        speed=args.speed,
                        timeout_s=args.timeout,
                        engine=str(profile.flavor),
                    ),
                    workdir=workdir,
                    log=workdir / "kvgate.log",
                )
            with demo.stopping(*([gw] if gw else [])):
                if gw is not None:
                    wait_ok(gw.url + "/ready", gw)
                    target = gw.url
                cfg = sw.config_from_args(args, target, label)
                cfg.workload = args.workload
                results.append(sw.run_sweep(cfg, sw.console_progress()))
            results[-1].preemptions = replica_preemptions(replica.url)
    paths = sw.write_outputs(
        results,
        out,
        title=f"Ceiling sweep: straight at a replica, then through kvgate ({profile.name})",
    )
    print()
    print(points_table(results))
    print(f"\nreport: {paths['report.md']}  (logs in {workdir})")
    return 0


def wait_ok(url: str, proc, limit_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    """Wait for `url` to answer 200 (the process must stay alive meanwhile)."""
    import requests

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise SystemExit(f"{proc.name} exited with status {proc.popen.returncode}")
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} did not answer 200 within {limit_s:.0f} s")


def replica_preemptions(url: str) -> float:
    """The replica's own preemption counters (vLLM and SGLang names), summed."""
    import requests

    try:
        text = requests.get(url + "/metrics", timeout=5).text
    except requests.RequestException:
        return float("nan")
    pattern = (
        r"^(?:vllm:num_preemptions_total|sglang:num_retracted_reqs_total)(?:\{[^}]*\})?\s+(\S+)"
    )
    return sum(float(v) for v in re.findall(pattern, text, re.MULTILINE))


if __name__ == "__main__":
    sys.exit(main())
