"""The first wave's trade, in virtual time: the demo's losses against the openai SDK's.

Two regimes pull a queued request's fate in opposite directions, and every change to how
the queue judges a request before its model's service is well known (the cold share of
a budget, how many completions make a prediction trusted, how samples are tagged with
their load) moves both. This bench measures both for the tree it runs in:

- ``demo``: `kvgate demo`'s job (seed 001's 738 requests, 32 clients that retry every
  shed, a 45 s timeout per attempt, `seed2-8b-16gb`) over many workload seeds; what is
  lost is mostly the first wave, started late in its budget on a service that grew
  while slow start raised the load (a steep engine: predictions from the first few
  completions run short).
- ``vllm``: the real vLLM's regime (`vllm-cpu-tiny`, pool 8,192, 300 requests of
  600-1,800 prompt and 40-200 output tokens), 32 clients as the openai SDK (stated
  timeout, two retries) and as a plain client (nothing stated, whole-second
  Retry-After), T = 1.5x the worst latency straight at 8, the engine then run 25% slow
  (as the real one is with kvgate's process beside it on 2 cores): a flat engine, where
  early predictions run long and shedding on them costs the SDK the attempts it needed.

Nothing here is given to kvgate: it runs with `AdmissionConfig()`'s defaults.

    PYTHONPATH=$PWD .venv/bin/python bench/first_wave_vt.py demo --seeds 41 141
    PYTHONPATH=$PWD .venv/bin/python bench/first_wave_vt.py vllm --seeds 0 30

Prints one line per seed with a loss and the totals; 1-2 CPU s per seed (6-8 on a slow
machine of this kind). Run two trees side by side on the same seeds (results quoted in
docs/admission.md, "What is left of the demo's losses").
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.closed_loop import PLAIN_BACKOFF_S  # noqa: E402
from bench.enginesim_vs_vllm import token_ids  # noqa: E402
from bench.parity_sweep import TIMEOUT_FACTOR  # noqa: E402
from bench.parity_vtime import CLIENTS  # noqa: E402
from bench.vtime import run  # noqa: E402
from enginesim.types import Workload  # noqa: E402
from enginesim.workloads import WorkItem, seed2_workload  # noqa: E402

SLOW = 1.25  # the real engine's pace beside kvgate, against its calibration alone
DEMO_REQUESTS = 738  # `kvgate demo`'s job


def demo(seed: int) -> tuple[int, list]:
    r = run("seed2-8b-16gb", seed2_workload(DEMO_REQUESTS, seed=seed), concurrency=32, timeout_s=45.0,
            seed=seed)  # fmt: skip
    return r.requests - r.completed, r.timeouts


def vllm_items(seed: int, n: int = 300) -> list[WorkItem]:
    rng = random.Random(seed)
    return [
        WorkItem(
            f"v{seed}-{i}",
            [],
            "",
            token_ids(rng, rng.randint(600, 1800)),
            rng.randint(40, 200),
            Workload.CHAT,
        )
        for i in range(n)
    ]


def vllm(seed: int) -> dict[str, int]:
    items = vllm_items(seed)
    # parity_vtime's calibration (the worst latency straight at 8), on this regime's pool
    cal = run("vllm-cpu-tiny", items, concurrency=8, timeout_s=1e9, straight=True,
              pool_tokens=8192, seed=seed)  # fmt: skip
    timeout = TIMEOUT_FACTOR * max(cal.latencies)
    lost = {}
    for kind, client in CLIENTS.items():
        r = run("vllm-cpu-tiny", items, concurrency=32, timeout_s=timeout, max_retries=2,
                timeout_backoff_s=PLAIN_BACKOFF_S, slow=lambda _t: SLOW, pool_tokens=8192,
                seed=seed, **client)  # fmt: skip
        lost[kind] = r.requests - r.completed
    return lost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("regime", choices=("demo", "vllm"))
    ap.add_argument("--seeds", type=int, nargs=2, default=(0, 20), metavar=("FROM", "TO"))
    args = ap.parse_args()
    seeds = range(*args.seeds)
    if args.regime == "demo":
        total = with_loss = first_wave = 0
        for s in seeds:
            lost, timeouts = demo(s)
            if lost:
                with_loss += 1
                first_wave += sum(1 for _t, retries, _w in timeouts if retries == 0)
                print(f"seed {s}: lost {lost}; timeouts (t, retries, queued s): {timeouts}")
            total += lost
        print(f"demo: lost {total} of {DEMO_REQUESTS * len(seeds)} in {with_loss} of {len(seeds)} "
              f"seeds; {first_wave} timeouts of a first attempt")  # fmt: skip
    else:
        sums = dict.fromkeys(CLIENTS, 0)
        for s in seeds:
            lost = vllm(s)
            if any(lost.values()):
                print(f"seed {s}: lost {lost}")
            for k, v in lost.items():
                sums[k] += v
        n = 300 * len(seeds)
        print(f"vllm x{SLOW}: lost " + ", ".join(f"{k} {v} of {n}" for k, v in sums.items()))


if __name__ == "__main__":
    main()
