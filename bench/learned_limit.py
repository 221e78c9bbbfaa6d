"""The learned running limit on workloads it was not tuned on: a replica that slows down
and recovers, and seed 000's MoE card held to a per-user decode-rate target.

Two experiments, each through a real kvgate process in front of a simulated replica on
loopback (no running cap configured anywhere):

shift
    A chat workload of streams (prompts lognormal around 800 tokens, answers around 200)
    at client concurrency 32 against `seed2-8b-16gb`, held to a per-user decode rate of
    10 tokens/s (``itl_s: 0.1``; seed 000: users prefer 8 tokens/s and a quick first
    token to a fast start and 2.7 tokens/s). Clients send their read timeout (45
    simulated seconds, which for a stream bounds the first token and every gap) as the
    openai SDKs do. A third of the way in, the replica is slowed 2x with enginesim's
    ``slow`` fault; two thirds in, it is restored. Target: the learned limit falls while
    slow and rises again after, with zero client timeouts. Plot: the limit over time.

moe
    Seed 000's card (`seed1-moe-h200x16`, SGLang) with a per-user decode-rate target of
    5 tokens/s (``latency_targets: {"*": {itl_s: 0.2}}``). A virtual-time sweep of the
    simulator (`enginesim.simulate.measure_decode`) finds the concurrency at which the
    per-user rate crosses 5 tokens/s; kvgate is told only the target. Target: its learned
    limit (median over the second half of the run) within 20% of the crossing.

    .venv/bin/python bench/learned_limit.py [--speed 25] [--only shift|moe]

Results: bench/results/learned_limit.json, bench/results/learned_limit_shift.png (needs
matplotlib: ``pip install -e '.[bench]'``), and Markdown on stdout.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from admission.config import AdmissionConfig  # noqa: E402
from bench import vtime  # noqa: E402
from enginesim.profiles import load_profile  # noqa: E402
from enginesim.simulate import measure_decode, run_closed_loop  # noqa: E402
from enginesim.types import Workload  # noqa: E402
from enginesim.workloads import WorkItem, synthetic_items  # noqa: E402
from kvgate_demo.demo import run_async, run_phase  # noqa: E402

TIMEOUT_S = 45.0  # simulated seconds


def chat_items(n: int, seed: int, *, prompt_median: int, output_median: int) -> list[WorkItem]:
    """`n` chat requests with lognormal prompt and answer lengths (sigma 0.5)."""
    rng = random.Random(seed)
    items: list[WorkItem] = []
    for i in range(n):
        p = int(
            min(
                4 * prompt_median,
                max(prompt_median // 4, rng.lognormvariate(0, 0.5) * prompt_median),
            )
        )
        o = int(min(4 * output_median, max(16, rng.lognormvariate(0, 0.5) * output_median)))
        (item,) = synthetic_items(1, p, o, Workload.CHAT, prefix=f"chat{seed}-{i}")
        items.append(item)
    return items


def limit_stats(limits: list[tuple[float, int, str]], start: float, end: float) -> dict:
    """Time-weighted mean, min and max of the limit over [start, end) (simulated s)."""
    if not limits:
        return {"mean": None, "min": None, "max": None}
    points = [(t, v) for t, v, _ in limits]
    value = points[0][1]
    for t, v in points:
        if t <= start:
            value = v
    acc = 0.0
    seen = [value]
    last = start
    for t, v in points:
        if t <= start:
            continue
        if t >= end:
            break
        acc += value * (t - last)
        last, value = t, v
        seen.append(v)
    acc += value * (end - last)
    return {"mean": acc / (end - start), "min": min(seen), "max": max(seen)}


async def shift(args: argparse.Namespace, workdir: Path) -> dict:
    profile = load_profile("seed2-8b-16gb")
    items = chat_items(args.shift_requests, 11, prompt_median=800, output_median=200)
    # The straight run at the same concurrency tells how long the job takes; the slow
    # window is placed by it (a third to two thirds of the kvgate run, roughly).
    est_wall = args.shift_wall / args.speed
    slow_at = (est_wall / 3, 2 * est_wall / 3, 2.0)
    row = await run_phase(
        "kvgate shift",
        items,
        profile="seed2-8b-16gb",
        model=profile.served_model_name,
        speed=args.speed,
        timeout_s=TIMEOUT_S,
        concurrency=32,
        through_kvgate=True,
        workdir=workdir,
        time_limit_s=args.time_limit,
        slow_at=slow_at,
        stream=True,
        admission={"latency_targets": {"*": {"itl_s": 0.1 / args.speed}}},
    )
    res = row.result
    sp = args.speed
    limits = [(t * sp, v, why) for t, v, why in row.limits]
    t1, t2 = slow_at[0] * sp, slow_at[1] * sp
    wall = res.wall_s * sp
    settle = 60.0
    phases = {
        "before": limit_stats(limits, min(settle, t1 / 2), t1),
        "slow": limit_stats(limits, min(t1 + settle, (t1 + t2) / 2), t2),
        "after": limit_stats(limits, min(t2 + settle, (t2 + wall) / 2), wall),
    }
    out = {
        "requests": res.requests,
        "completed": res.completed,
        "timed_out": res.timed_out,
        "errors": res.errors + res.gave_up,
        "retries_per_completed": res.retries_per_completed,
        "wall_s": wall,
        "slow_from_s": t1,
        "slow_to_s": t2,
        "ttft_p50_s": statistics.median(res.ttfts) * sp if res.ttfts else None,
        "ttft_max_s": max(res.ttfts) * sp if res.ttfts else None,
        "preemptions": row.preemptions,
        "error_samples": res.error_samples,
        "phases": phases,
        "limits": limits,
    }
    print(
        f"shift: {res.completed}/{res.requests} completed, {res.timed_out} timed out, "
        f"retries/completed {res.retries_per_completed:.2f}, limit before/slow/after "
        + " / ".join(f"{phases[k]['mean']:.1f}" for k in ("before", "slow", "after")),
        flush=True,
    )
    _plot(limits, t1, t2, wall, args.out.with_name("learned_limit_shift.png"))
    return out


def _plot(
    limits: list[tuple[float, int, str]], t1: float, t2: float, wall: float, path: Path
) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot; pip install -e '.[bench]')")
        return
    xs, ys = [], []
    for t, v, _ in limits:
        if xs:
            xs.append(t)
            ys.append(ys[-1])
        xs.append(t)
        ys.append(v)
    xs.append(wall)
    ys.append(ys[-1] if ys else 0)
    fig, ax = plt.subplots(figsize=(8, 3.2), dpi=100)
    ax.axvspan(t1, t2, color="tab:red", alpha=0.12, label="replica slowed 2x")
    ax.plot(xs, ys, color="tab:blue", label="kvgate's learned running limit")
    ax.set_xlabel("simulated seconds")
    ax.set_ylabel("requests running at once")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title("seed2-8b-16gb, chat streams at client concurrency 32")
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot: {path}")


async def moe(args: argparse.Namespace, workdir: Path) -> dict:
    name = "seed1-moe-h200x16"
    profile = load_profile(name)
    target_rate = 5.0
    prompt, output = 1024, 256
    items = chat_items(args.moe_requests, 5, prompt_median=prompt, output_median=output)
    # The simulator's per-user decode rate by concurrency, in virtual time: on the same
    # requests (closed loop, prefills interleaved), and decode alone.
    curve = {c: run_closed_loop(name, items, c, 600.0).mean_decode_tps for c in range(6, 33)}
    decode_only = {
        b: measure_decode(name, b, prompt_tokens=prompt, output_tokens=output).per_user_tps
        for b in range(6, 33)
    }
    crossing = _crossing(curve, target_rate)
    crossing_decode_only = _crossing(decode_only, target_rate)
    vt = vtime.run(
        name,
        items,
        concurrency=64,
        timeout_s=600.0,
        stream=True,
        config=AdmissionConfig(latency_targets={"*": {"itl_s": 1.0 / target_rate}}),
    )
    vt_learned = statistics.median(
        vt.limit_at(vt.wall_s / 2 + (vt.wall_s / 2) * i / 100) for i in range(100)
    )
    row = await run_phase(
        "kvgate moe",
        items,
        profile=name,
        model=profile.served_model_name,
        speed=args.speed,
        timeout_s=600.0,  # the openai SDK's default read timeout
        concurrency=64,
        through_kvgate=True,
        workdir=workdir,
        time_limit_s=args.time_limit,
        stream=True,
        admission={"latency_targets": {"*": {"itl_s": 1.0 / target_rate / args.speed}}},
    )
    res = row.result
    sp = args.speed
    limits = [(t * sp, v, why) for t, v, why in row.limits]
    wall = res.wall_s * sp
    late = limit_stats(limits, wall / 2, wall)
    samples = [
        lim for lim in (_limit_at(limits, wall / 2 + (wall / 2) * i / 100) for i in range(100))
    ]
    learned = statistics.median(samples) if samples else None
    rates = [1.0 / (i * sp) for i in res.itls if i > 0]
    out = {
        "target_tokens_per_s": target_rate,
        "curve": {str(b): round(r, 3) for b, r in curve.items()},
        "crossing": crossing,
        "crossing_decode_only": crossing_decode_only,
        "virtual_time_learned_limit": vt_learned,
        "virtual_time_ratio": vt_learned / crossing if crossing else None,
        "virtual_time_mean_rate": statistics.fmean(vt.decode_rates) if vt.decode_rates else None,
        "learned_limit_median_second_half": learned,
        "learned_limit_second_half": late,
        "ratio": learned / crossing if learned and crossing else None,
        "completed": res.completed,
        "requests": res.requests,
        "timed_out": res.timed_out,
        "per_user_rate_mean": statistics.fmean(rates) if rates else None,
        "wall_s": wall,
        "limits": limits,
    }
    print(
        f"moe: crossing of {target_rate} tok/s at concurrency {crossing:.1f} (decode alone: "
        f"{crossing_decode_only:.1f}); learned limit live {learned} ({out['ratio']:.2f}x, "
        f"mean per-user rate {out['per_user_rate_mean']:.2f} tok/s), in virtual time "
        f"{vt_learned} ({out['virtual_time_ratio']:.2f}x, "
        f"{out['virtual_time_mean_rate']:.2f} tok/s)",
        flush=True,
    )
    return out


def _crossing(curve: dict[int, float], target: float) -> float | None:
    """The concurrency at which a falling per-user rate crosses `target` (interpolated)."""
    keys = sorted(curve)
    for a, b in zip(keys, keys[1:], strict=False):
        if curve[a] >= target > curve[b]:
            return a + (b - a) * (curve[a] - target) / (curve[a] - curve[b])
    return None


def _limit_at(limits: list[tuple[float, int, str]], t: float) -> int | None:
    value = None
    for at, v, _ in limits:
        if at > t:
            break
        value = v
    return value


async def main_async(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-limit-"))
    out: dict = {"speed": args.speed}
    if args.only in (None, "shift"):
        out["shift"] = await shift(args, workdir)
    if args.only in (None, "moe"):
        out["moe"] = await moe(args, workdir)
    verdicts = {}
    if "shift" in out:
        s = out["shift"]
        ph = s["phases"]
        verdicts["shift: zero client timeouts"] = s["timed_out"] == 0
        verdicts["shift: limit lower while slowed"] = ph["slow"]["mean"] < ph["before"]["mean"]
        verdicts["shift: limit higher again after"] = ph["after"]["mean"] > ph["slow"]["mean"]
    if "moe" in out and out["moe"]["ratio"] is not None:
        r = out["moe"]["ratio"]
        verdicts[f"moe: learned limit {r:.2f}x the crossing, within 20%"] = 0.8 <= r <= 1.2
        v = out["moe"]["virtual_time_ratio"]
        verdicts[f"moe (virtual time): learned limit {v:.2f}x the crossing, within 20%"] = (
            0.8 <= v <= 1.2
        )
    print()
    for k, v in verdicts.items():
        print(f"{'PASS' if v else 'MISS'}  {k}")
    out["verdicts"] = verdicts
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.only and args.out.exists():
        merged = json.loads(args.out.read_text())
        merged.update(out)
        out = merged
    args.out.write_text(json.dumps(out, indent=2))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--speed", type=float, default=10.0)
    ap.add_argument("--only", choices=["shift", "moe"], default=None)
    ap.add_argument("--shift-requests", type=int, default=900)
    ap.add_argument("--shift-wall", type=float, default=1100.0, help="expected simulated run time")
    ap.add_argument("--moe-requests", type=int, default=500)
    ap.add_argument("--time-limit", type=float, default=1800.0, help="wall seconds per run")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "learned_limit.json")
    args = ap.parse_args()
    return run_async(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
