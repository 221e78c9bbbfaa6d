"""Decision cost: admit + route for one request, p50 / p99, at 4, 64 and 256 replicas.

Sans-IO, in process: an `AdmissionController` with N ready replicas of one model (large
pools, so every request is admitted) and a router built from config, either the default
profile (most KV headroom) or a prefix profile (``prefix_cache`` + ``session_affinity`` +
``running_headroom``) whose indexes hold 100k block hashes in all before timing starts.
Each decision is one `submit` (the ledger checks, the candidates' live view, the routing
pipeline, the reservation and the ``placed`` hook), timed with `time.perf_counter_ns`;
the request is then released (not timed). Requests carry a 32-block chain drawn from 512
sessions whose first 16 blocks are shared per tenant (16 tenants), so lookups walk real
partial matches.

Each run first makes ``--warmup`` (200) untimed decisions (the same loop: the first
decisions pay for cold caches and the first dict growths), then times ``--decisions``.
Each configuration runs ``--runs`` times; the medians of the per-run p50 and p99 are
reported, with ratios to 4 replicas side by side. ``--label`` tags the rows (e.g. the
commit measured) and ``--out`` names the result file, so a before / after pair can be
measured with this same script over two checkouts. ``--in-flight K`` keeps K requests
running (the oldest released after each decision) and ``--share`` has the replicas count
shared prefixes once, so fit checks walk the chains the running requests pin. Results go to
``bench/results/decision_cost.json`` and a Markdown table on stdout.

``--callgrind`` counts machine instructions per decision instead (repeatable where wall
time is not: a loaded machine moves p50 by tens of percent): the script runs itself
under ``valgrind --tool=callgrind`` with collection off, switched on around each timed
``submit`` only (a three-line C library built with ``cc`` and valgrind's headers, called
through ctypes); the switch's own cost, measured around nothing, is taken off.
``--part module.Class.method`` (repeatable) counts, per decision, only the instructions
inside that function's calls made by the timed decisions (the switch wraps the method;
its cost is taken off once per call), so a decision's cost can be split by stage.
``--in-flight`` and ``--with-release`` apply to it as to the timed runs.

    .venv/bin/python bench/decision_cost.py [--runs 5] [--decisions 3000]
    .venv/bin/python bench/decision_cost.py --callgrind --replicas 64 --decisions 500
    .venv/bin/python bench/decision_cost.py --callgrind --replicas 64 --profiles precise \
        --part routing.scheduler.SchedulingRouter.pick --part admission.ledger.Ledger.fits_now
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import importlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# This checkout's code, whatever the venv's editable install points at.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from admission.config import AdmissionConfig  # noqa: E402
from admission.controller import AdmissionController  # noqa: E402
from admission.types import AdmissionRequest, Admit  # noqa: E402
from routing.config import RoutingConfig  # noqa: E402
from routing.kvevents import Stored  # noqa: E402
from routing.kvindex import KVIndex, token_block_hashes  # noqa: E402
from routing.plugin import PluginEnv  # noqa: E402
from routing.prefix import block_hashes  # noqa: E402
from routing.scheduler import build_router  # noqa: E402
from routing.types import Candidate, ReplicaState, RouteRequest  # noqa: E402

PROFILES = {
    "default": RoutingConfig(),
    "prefix": RoutingConfig.model_validate(
        {
            "default_profile": {
                "scorers": [
                    {"name": "prefix_cache", "weight": 2.0},
                    {"name": "session_affinity", "weight": 1.0},
                    {"name": "running_headroom", "weight": 1.0},
                ]
            }
        }
    ),
}
# "precise": no routing section (workload-aware), agentic requests, and the engines' own
# blocks from KV events (routing.kvindex) holding 100k blocks in all.
PROFILES["precise"] = RoutingConfig()
INDEXED_BLOCKS = 100_000
TOKEN_BLOCK = 16


def token_ids(seed: int) -> list[list[int]]:
    """512 sessions' prompts in token ids: 16 blocks shared per tenant, then 16 own."""
    rng = random.Random(seed)
    tenants = [[rng.randrange(32000) for _ in range(16 * TOKEN_BLOCK)] for _ in range(16)]
    return [
        tenants[s % 16] + [rng.randrange(32000) for _ in range(16 * TOKEN_BLOCK)]
        for s in range(512)
    ]


def fill_engine_blocks(kv: KVIndex, n: int, sessions: list[list[int]]) -> int:
    """Each replica's engine stores synthetic histories (100k blocks in all), and every
    session's first 24 blocks on one replica, as a vLLM's BlockStored events would."""
    seqs = [0] * n
    k = 0
    while sum(len(kv.replica(f"r{i}")) for i in range(n)) < INDEXED_BLOCKS:
        rng = random.Random(k)
        ids = [rng.randrange(32000) for _ in range(64 * TOKEN_BLOCK)]
        i = k % n
        ev = Stored(tuple(range(k * 64, k * 64 + 64)), None, tuple(ids), TOKEN_BLOCK)
        kv.replica(f"r{i}").apply(seqs[i], [ev], 0.0)
        seqs[i] += 1
        k += 1
    for s, ids in enumerate(sessions):
        i = s % n
        hashes = tuple(-(s * 64 + b + 1) for b in range(24))  # distinct engine hashes
        ev = Stored(hashes, None, tuple(ids[: 24 * TOKEN_BLOCK]), TOKEN_BLOCK)
        kv.replica(f"r{i}").apply(seqs[i], [ev], 0.0)
        seqs[i] += 1
    return sum(len(kv.replica(f"r{i}")) for i in range(n))


def chains(seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    out = []
    for s in range(512):
        tenant = f"tenant {s % 16} system prompt and tools " * 40
        session = f"session {s} history {rng.random()} " * 40
        out.append(block_hashes(tenant[:1024] + session, 64, 32))
    return out


def one_run(
    n: int,
    profile: str,
    decisions: int,
    seed: int,
    warmup: int = 200,
    in_flight: int = 0,
    share: bool = False,
    toggle: Callable[[], None] | None = None,
    with_release: bool = False,
) -> tuple[float, float, int]:
    kv = KVIndex() if profile == "precise" else None
    router = build_router(PROFILES[profile], seed=seed, env=PluginEnv(seed=seed, kv_index=kv))
    ctl = AdmissionController(AdmissionConfig(learn_limit=False), router, seed=seed)
    for i in range(n):
        state = ReplicaState(
            name=f"r{i}",
            base_url="http://127.0.0.1",
            ready=True,
            models=["m"],
            capacity_tokens=1_000_000,
            max_running=256,
            updated_at=0.0,
            shares_prefix=share,
        )
        ctl.upsert_replica(state, 0.0)
    sessions = chains(seed)
    ids = token_ids(seed)
    tokens = [token_block_hashes(t, TOKEN_BLOCK) for t in ids]
    rng = random.Random(seed)
    indexed = 0
    if kv is not None:
        indexed = fill_engine_blocks(kv, n, ids)
    if profile == "prefix":
        # Fill the indexes with 100k blocks of synthetic history spread over the replicas.
        prefix = router.default.scorers[0][0]
        k = 0
        while prefix.indexed_blocks() < INDEXED_BLOCKS:
            chain = block_hashes(f"old {k} " * 700, 64, 64)
            name = f"r{k % n}"
            prefix.placed(
                RouteRequest(f"w{k}", "m", 1, prefix_hashes=chain),
                Candidate(name, 1_000_000, 1_000_000, 0, 256),
                0.0,
            )
            k += 1
        indexed = prefix.indexed_blocks()
    times: list[int] = []
    running: list[str] = []
    gc.collect()
    gc.disable()
    try:
        for d in range(-warmup, decisions):
            s = rng.randrange(len(sessions))
            req = AdmissionRequest(
                request_id=f"q{d}",
                model="m",
                prompt_tokens=600,
                expected_output=200,
                max_tokens=400,
                prefix_hashes=sessions[s],
                prefix_block_tokens=10 if share else 0,
                session=f"s{s}",
                workload="agentic" if kv is not None else "chat",
                token_hashes=tokens[s] if kv is not None else (),
                token_block_size=TOKEN_BLOCK if kv is not None else 0,
            )
            now = 1.0 + (d + warmup) * 1e-3
            if toggle is not None and d >= 0:  # counted by callgrind (module docstring)
                toggle()
                verdict = ctl.submit(req, now).verdict
                toggle()
                t0 = t1 = 0
            else:
                t0 = time.perf_counter_ns()
                verdict = ctl.submit(req, now).verdict
                t1 = time.perf_counter_ns()
            assert isinstance(verdict, Admit), verdict
            running.append(req.request_id)
            if len(running) > in_flight:  # the oldest leaves (at once with 0 in flight)
                counted = toggle is not None and with_release and d >= 0
                if counted:
                    toggle()
                t2 = time.perf_counter_ns()
                ctl.release(running.pop(0), now)
                if with_release:  # the decision's cost includes the release it leads to
                    t1 += time.perf_counter_ns() - t2
                if counted:
                    toggle()
            if d >= 0:
                times.append(t1 - t0)
    finally:
        gc.enable()
    times.sort()
    p50 = times[len(times) // 2] / 1000
    p99 = times[int(len(times) * 0.99)] / 1000
    return p50, p99, indexed


_TOGGLE_C = """#include <valgrind/callgrind.h>
void cg_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
void cg_start(void) { CALLGRIND_START_INSTRUMENTATION; }
"""


def callgrind_child(
    profile: str, n: int, decisions: int, seed: int, lib: str, part: str = "", calls: str = ""
) -> None:
    """Under callgrind: switch collection on around each timed decision (or, for
    profile "-", around nothing: the switch's own cost; with `part`, around each call
    of that function within a timed decision, their number written to `calls`).
    Instrumentation starts at the first switch, so the setup runs at native speed."""
    so = ctypes.CDLL(lib)
    switch, start = so.cg_toggle, so.cg_start
    started = False

    def toggle() -> None:
        nonlocal started
        if not started:
            started = True
            start()
        switch()

    if profile == "-":  # the switch alone
        for _ in range(decisions):
            toggle()
            toggle()
        return
    with_release = _WITH_RELEASE in os.environ
    in_flight = int(os.environ.get(_IN_FLIGHT, "0"))
    if not part:
        one_run(
            n, profile, decisions, seed, in_flight=in_flight, toggle=toggle,
            with_release=with_release,
        )  # fmt: skip
        return
    timed = False  # inside a timed decision
    depth = counted = 0

    def decision() -> None:
        nonlocal timed, started
        if not started:
            started = True
            start()
        timed = not timed

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def counted_call(*a: object, **kw: object) -> object:
            nonlocal depth, counted
            if not timed or depth:  # outside the timing, or a nested call: as it is
                return fn(*a, **kw)
            counted += 1
            depth += 1
            switch()
            try:
                return fn(*a, **kw)
            finally:
                switch()
                depth -= 1

        return counted_call

    module, cls, name = part.rsplit(".", 2)
    owner = getattr(importlib.import_module(module), cls)
    fn = owner.__dict__[name]
    if isinstance(fn, staticmethod):
        setattr(owner, name, staticmethod(wrap(fn.__func__)))
    else:
        setattr(owner, name, wrap(fn))
    one_run(
        n, profile, decisions, seed, in_flight=in_flight, toggle=decision,
        with_release=with_release,
    )  # fmt: skip
    Path(calls).write_text(str(counted))


# Set for the callgrind child when each decision's release is counted with it, and to
# the requests it keeps running (`--in-flight`).
_WITH_RELEASE = "DECISION_COST_WITH_RELEASE"
_IN_FLIGHT = "DECISION_COST_IN_FLIGHT"


def _callgrind_instr(
    args: list[str], workdir: str, with_release: bool = False, in_flight: int = 0
) -> int:
    out = os.path.join(workdir, "cg.out")
    subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            "--collect-atstart=no",
            f"--callgrind-out-file={out}",
        ]
        + [sys.executable, __file__, "--callgrind-child", *args],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={
            **{k: v for k, v in os.environ.items() if k not in (_WITH_RELEASE, _IN_FLIGHT)},
            "PYTHONHASHSEED": "0",
            _IN_FLIGHT: str(in_flight),
            **({_WITH_RELEASE: "1"} if with_release else {}),
        },
    )
    text = Path(out).read_text()
    got = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
    if got is None:
        raise RuntimeError("callgrind wrote no totals")
    return int(got.group(1))


def callgrind(
    profiles: list[str],
    replicas: list[int],
    decisions: int,
    runs: int,
    parts: list[str],
    with_release: bool = False,
    in_flight: int = 0,
) -> list[dict]:
    """Instructions per decision (module docstring), per profile and replica count, and
    per part (``--part``) when asked; with `with_release`, each decision's release
    counted with it (two switches a decision)."""
    rows = []
    with tempfile.TemporaryDirectory() as d:
        lib = os.path.join(d, "cgtoggle.so")
        src = os.path.join(d, "cgtoggle.c")
        Path(src).write_text(_TOGGLE_C)
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", lib, src], check=True)
        switch = _callgrind_instr(["-", "0", str(decisions), "0", lib], d) / decisions
        for profile in profiles:
            for n in replicas:
                per = [
                    _callgrind_instr(
                        [profile, str(n), str(decisions), str(seed), lib],
                        d,
                        with_release,
                        in_flight,
                    )
                    / decisions
                    - switch * (2 if with_release else 1)
                    for seed in range(runs)
                ]
                rows.append(
                    {
                        "profile": profile,
                        "replicas": n,
                        "instructions_per_decision": statistics.median(per),
                        "instructions_runs": per,
                        "decisions_per_run": decisions,
                        "switch_instructions": switch,
                    }
                )
                print(f"| {profile} | {n} | {statistics.median(per):,.0f} |", flush=True)
                for part in parts:
                    calls = os.path.join(d, "calls")
                    args = [profile, str(n), str(decisions), "0", lib, part, calls]
                    total = _callgrind_instr(args, d, with_release, in_flight)
                    count = int(Path(calls).read_text())
                    rows.append(
                        {
                            "profile": profile,
                            "replicas": n,
                            "part": part,
                            "instructions_per_decision": (total - count * switch) / decisions,
                            "calls_per_decision": count / decisions,
                            "decisions_per_run": decisions,
                            "seed": 0,
                        }
                    )
                    print(
                        f"| {profile} | {n} | {rows[-1]['instructions_per_decision']:,.0f} "
                        f"| {part} ({count / decisions:.2f} calls) |",
                        flush=True,
                    )
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--callgrind-child":
        profile, n, decisions, seed, lib, *part = sys.argv[2:9]
        callgrind_child(profile, int(n), int(decisions), int(seed), lib, *part)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--decisions", type=int, default=3000)
    ap.add_argument("--replicas", type=int, nargs="+", default=[4, 64, 256])
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--label", default="")
    ap.add_argument(
        "--in-flight", type=int, default=0, help="requests kept running (0: each released at once)"
    )
    ap.add_argument(
        "--share",
        action="store_true",
        help="replicas count shared prefixes once (admission.prefixshare): pinned chains "
        "are walked on every fit check",
    )
    ap.add_argument(
        "--with-release",
        action="store_true",
        help="time each decision with the release that follows it (admit + release)",
    )
    ap.add_argument("--out", default="decision_cost.json")
    ap.add_argument("--callgrind", action="store_true", help="instructions per decision (valgrind)")
    ap.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=list(PROFILES))
    ap.add_argument(
        "--part",
        action="append",
        default=[],
        help="with --callgrind: also count inside this function only (module.Class.method)",
    )
    args = ap.parse_args()
    if args.callgrind:
        print("| profile | replicas | instructions / decision |")
        print("| --- | ---: | ---: |")
        rows = callgrind(
            args.profiles,
            args.replicas,
            args.decisions,
            args.runs,
            args.part,
            args.with_release,
            args.in_flight,
        )
        for r in rows:
            r["label"] = args.label
            r["in_flight"] = args.in_flight
        out = Path(__file__).resolve().parent / "results" / args.out
        out.write_text(json.dumps(rows, indent=2) + "\n")
        return
    rows = []
    for profile in args.profiles:
        for n in args.replicas:
            runs = [
                one_run(
                    n,
                    profile,
                    args.decisions,
                    seed,
                    args.warmup,
                    args.in_flight,
                    args.share,
                    with_release=args.with_release,
                )  # fmt: skip
                for seed in range(args.runs)
            ]
            rows.append(
                {
                    "label": args.label,
                    "in_flight": args.in_flight,
                    "share": args.share,
                    "profile": profile,
                    "replicas": n,
                    "indexed_blocks": runs[0][2],
                    "p50_us": statistics.median(r[0] for r in runs),
                    "p99_us": statistics.median(r[1] for r in runs),
                    "runs": args.runs,
                    "decisions_per_run": args.decisions,
                    "warmup": args.warmup,
                    "p50_us_runs": [r[0] for r in runs],
                    "p99_us_runs": [r[1] for r in runs],
                }
            )
    base = {r["profile"]: r for r in rows if r["replicas"] == args.replicas[0]}
    print(
        f"| profile | replicas | indexed blocks | p50 us | p99 us | p50 / {args.replicas[0]} | p99 / {args.replicas[0]} |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        b = base[r["profile"]]
        r["p50_ratio"] = r["p50_us"] / b["p50_us"]
        r["p99_ratio"] = r["p99_us"] / b["p99_us"]
        print(
            f"| {r['profile']} | {r['replicas']} | {r['indexed_blocks']} | {r['p50_us']:.1f} | "
            f"{r['p99_us']:.1f} | {r['p50_ratio']:.1f}x | {r['p99_ratio']:.1f}x |"
        )
    out = Path(__file__).resolve().parent / "results" / args.out
    out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
