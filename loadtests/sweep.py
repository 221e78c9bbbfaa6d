"""`kvgate sweep`: seed 001's ceiling-finding procedure, headless, with Locust as a library.

    kvgate sweep --target http://127.0.0.1:8080 --workload batch-json \\
        --steps 1,2,4,8,16,32,64 --hold 120 --timeout 45 --out sweep-out

Runs the staircase (the same users as ``loadtests/locustfile.py``, the same
`StaircaseShape` schedule): `hold` seconds at each concurrency, the first `warmup` of each
left out of its numbers. For every step it records completions, timeouts and errors,
aggregate and per-user output tokens/s, TTFT and ITL p50/p90/p99, and p50 and max
latency; from the steps it names the plateau, the SLO crossing and the failure point,
and reads the p50-to-max spread as a capacity or a compute ceiling
(`loadtests.analysis`). When the target is kvgate, its learned limit
(``kvgate_replica_limit`` on its ``/metrics``, summed over replicas) is recorded too.

Writes to `--out`: ``steps.csv``, ``sweep.json`` (everything, to re-render from),
``throughput.png``, ``latency.png`` and ``report.md``.

Against a simulated replica whose clock runs `--speed` times faster than the wall
clock, `--hold` and `--timeout` are in the replica's seconds and so is every number
reported. Importing this module patches the process with gevent (Locust does).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import gevent
import locust  # noqa: F401  (first: Locust patches the process before requests loads ssl)
import requests
from locust.env import Environment

from loadtests.analysis import Record, Step, summarize
from loadtests.report import (
    SweepResult,
    markdown,
    plot_latency,
    plot_throughput,
    write_csv,
    write_json,
)
from loadtests.shapes import StaircaseShape, parse_steps
from loadtests.users import USER_CLASSES, discover_model
from loadtests.workloads import Dist, LoadConfig

WORKLOAD_NAMES = [*USER_CLASSES, "mixed"]


@dataclass(slots=True)
class SweepConfig:
    target: str
    workload: str = "batch-json"
    steps: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    hold_s: float = 120.0  # target seconds
    warmup: float = 0.25
    timeout_s: float = 60.0  # target seconds
    speed: float = 1.0
    label: str = ""
    load: LoadConfig = field(default_factory=LoadConfig)  # timeout_s there is set from ours
    gain: float = 0.10
    slo_floor: float = 10.0
    min_valid: float = 0.95
    widen: float = 1.5
    poll_limit_s: float = 0.5  # wall seconds between reads of the target's /metrics


_LIMIT_RE = re.compile(r"^kvgate_replica_limit\{[^}]*\}\s+(\S+)\s*$", re.MULTILINE)


def read_limit(target: str) -> float | None:
    """kvgate's learned limit summed over its replicas, or None when the target does
    not export it (an engine, or no /metrics)."""
    try:
        r = requests.get(target.rstrip("/") + "/metrics", timeout=5)
    except requests.RequestException:
        return None
    if r.status_code != 200:
        return None
    values = [float(v) for v in _LIMIT_RE.findall(r.text)]
    return sum(values) if values else None


def run_sweep(cfg: SweepConfig, progress: Callable[[str, bool], None] | None = None) -> SweepResult:
    """Run the staircase against `cfg.target` and return every step's numbers.
    `progress(line, final)` is called about once a second and once per finished step."""
    speed = cfg.speed
    load = dataclasses.replace(cfg.load, timeout_s=cfg.timeout_s / speed)
    if not load.model:
        load.model = discover_model(cfg.target, load)
    classes = (
        list(USER_CLASSES.values()) if cfg.workload == "mixed" else [USER_CLASSES[cfg.workload]]
    )
    env = Environment(user_classes=classes, host=cfg.target)
    env.kvgate_load = load  # type: ignore[attr-defined]
    hold = cfg.hold_s / speed
    shape = StaircaseShape(cfg.steps, hold)

    records: list[Record] = []
    retries: list[float] = []

    def on_request(
        request_type: str, context: dict, exception: Exception | None, **_: object
    ) -> None:
        now = time.perf_counter()
        if request_type == "RETRY":
            retries.append(now)
        elif request_type == "POST":
            if exception is None:
                records.append(
                    Record(
                        end=now,
                        ok=True,
                        latency=context["latency"],
                        ttft=context["ttft"],
                        itl=context["itl"],
                        per_user_tps=context["per_user_tps"],
                        output_tokens=context["output_tokens"],
                        prompt_tokens=context["prompt_tokens"],
                    )
                )
            else:
                records.append(Record(end=now, ok=False, failure=context.get("failure", "error")))

    env.events.request.add_listener(on_request)

    limits: list[tuple[float, float]] = []
    t0 = time.perf_counter()

    def poll_limits() -> None:
        while True:
            value = read_limit(cfg.target)
            if value is None and not limits:
                return  # not kvgate: nothing to watch
            if value is not None:
                limits.append((time.perf_counter(), value))
            gevent.sleep(cfg.poll_limit_s)

    label = cfg.label or cfg.target
    result = SweepResult(
        label=label,
        target=cfg.target,
        workload=cfg.workload,
        model=load.model,
        speed=speed,
        timeout_s=cfg.timeout_s,
        hold_s=cfg.hold_s,
        warmup=cfg.warmup,
        max_retries=load.max_retries,
        gain=cfg.gain,
        slo_floor=cfg.slo_floor,
        min_valid=cfg.min_valid,
        widen=cfg.widen,
        started=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    runner = env.create_local_runner()
    poller = gevent.spawn(poll_limits)
    schedule = shape.schedule()
    try:
        for i, (users, start_at, end_at) in enumerate(schedule):
            step_start = t0 + start_at
            step_end = t0 + end_at
            runner.start(users, spawn_rate=float(min(100, max(users, 1))))
            measure_from = step_start + cfg.warmup * hold
            while (now := time.perf_counter()) < step_end:
                if progress is not None:
                    progress(
                        _progress_line(
                            label,
                            i,
                            len(schedule),
                            users,
                            now - step_start,
                            hold,
                            speed,
                            records,
                            step_start,
                            now < measure_from,
                            limits,
                        ),
                        False,
                    )
                gevent.sleep(min(1.0, step_end - now))
            window = [r for r in records if measure_from <= r.end < step_end]
            honoured = sum(1 for t in retries if measure_from <= t < step_end)
            seen = [v for t, v in limits if measure_from <= t < step_end]
            step = summarize(
                users, window, honoured, step_end - measure_from, speed=speed, limits=seen
            )
            result.steps.append(step)
            if progress is not None:
                progress(_step_line(label, i, len(schedule), step), True)
    finally:
        poller.kill()
        runner.quit()
    result.limits = [((t - t0) * speed, v) for t, v in limits]
    result.wall_s = time.perf_counter() - t0
    return result


def _progress_line(
    label: str,
    i: int,
    n: int,
    users: int,
    elapsed: float,
    hold: float,
    speed: float,
    records: Sequence[Record],
    since: float,
    warming: bool,
    limits: Sequence[tuple[float, float]],
) -> str:
    recent = [r for r in records if r.end >= since]
    ok = sum(1 for r in recent if r.ok)
    timeouts = sum(1 for r in recent if r.failure == "timeout")
    errors = len(recent) - ok - timeouts
    phase = " (warm-up)" if warming else ""
    lim = f" | kvgate limit {limits[-1][1]:.0f}" if limits else ""
    return (
        f"[{label}] step {i + 1}/{n} c={users} {elapsed * speed:5.0f}/{hold * speed:.0f} s{phase}"
        f" | {ok} ok, {timeouts} timed out, {errors} errors{lim}"
    )


def _step_line(label: str, i: int, n: int, s: Step) -> str:
    return (
        f"[{label}] step {i + 1}/{n} c={s.concurrency}: {s.completed}/{s.ended} valid, "
        f"{s.timed_out} timed out, {s.errors + s.shed_failed} errors, "
        f"{s.output_tok_s:,.0f} out tok/s, {_num(s.per_user_tok_s, '.1f')} tok/s per user, "
        f"p50 {_num(s.latency_p50, '.1f')} s, max {_num(s.latency_max, '.1f')} s"
        + ("" if math.isnan(s.limit_max) else f", kvgate limit {s.limit_min:.0f}-{s.limit_max:.0f}")
    )


def _num(v: float, fmt: str) -> str:
    return "-" if math.isnan(v) else format(v, fmt)


def console_progress(stream=None) -> Callable[[str, bool], None]:  # type: ignore[no-untyped-def]
    """One progress line rewritten in place on a terminal; on a pipe, only each finished
    step's line (so logs stay short)."""
    out = stream or sys.stderr
    tty = out.isatty()

    def show(line: str, final: bool) -> None:
        if tty:
            out.write("\r\033[K" + line + ("\n" if final else ""))
            out.flush()
        elif final:
            out.write(line + "\n")
            out.flush()

    return show


def write_outputs(
    results: Sequence[SweepResult], out: Path, title: str = "Ceiling sweep"
) -> dict[str, Path]:
    """CSV per run, sweep.json, the two plots and report.md; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for r in results:
        name = "steps.csv" if len(results) == 1 else f"steps-{_slug(r.label)}.csv"
        paths[name] = out / name
        write_csv(r, out / name)
    paths["sweep.json"] = out / "sweep.json"
    write_json(results, out / "sweep.json")
    paths["throughput.png"] = out / "throughput.png"
    plot_throughput(results, out / "throughput.png")
    paths["latency.png"] = out / "latency.png"
    plot_latency(results, out / "latency.png")
    paths["report.md"] = out / "report.md"
    (out / "report.md").write_text(markdown(results, ["throughput.png", "latency.png"], title))
    return paths


def _slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-") or "run"


def build_parser(prog: str = "kvgate sweep") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--target", required=True, help="base URL of an OpenAI-compatible server")
    ap.add_argument("--workload", default="batch-json", choices=WORKLOAD_NAMES)
    add_sweep_arguments(ap)
    ap.add_argument("--label", default="", help="name of this run in the report")
    ap.add_argument("--out", default="", help="output folder (default: sweep-<time>)")
    return ap


def add_sweep_arguments(ap: argparse.ArgumentParser) -> None:
    """The staircase, client and reading options (shared with the showcase)."""
    ap.add_argument(
        "--steps", default="1,2,4,8,16,32,64", help="users per step: 1,2,4,8 or x64 (doubling)"
    )
    ap.add_argument("--hold", type=float, default=120.0, help="seconds at each step")
    ap.add_argument(
        "--warmup", type=float, default=0.25, help="fraction of each step left out of its numbers"
    )
    ap.add_argument(
        "--timeout", type=float, default=60.0, help="client read timeout in seconds (as the SDK's)"
    )
    ap.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="the target's clock over the wall clock (enginesim --speed); hold, timeout and "
        "every reported number are in the target's seconds",
    )
    ap.add_argument("--model", default="", help="model (default: the first of /v1/models)")
    ap.add_argument("--api-key", default="")
    ap.add_argument("--max-retries", type=int, default=2, help="429/503 retries (SDK: 2)")
    ap.add_argument(
        "--prompt-tokens",
        default="",
        help="fixed:N | uniform:LO,HI | lognormal:MEDIAN,SIGMA[,LO,HI]",
    )
    ap.add_argument("--output-tokens", default="", help="same forms")
    ap.add_argument("--prompt-file", default="", help="JSONL of real requests (docs/loadtests.md)")
    ap.add_argument("--system-tokens", type=int, default=3000, help="agentic: shared system prompt")
    ap.add_argument("--max-context", type=int, default=8192, help="agentic: longest history")
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts")
    ap.add_argument(
        "--plateau-gain",
        type=float,
        default=0.10,
        help="the plateau is the first step no later step beats by more than this",
    )
    ap.add_argument("--slo-tokens-per-s", type=float, default=10.0, help="per-user tokens/s floor")
    ap.add_argument(
        "--min-valid",
        type=float,
        default=0.95,
        help="the failure point is the first step with fewer valid completions than this",
    )
    ap.add_argument(
        "--widen", type=float, default=1.5, help="spread growth that reads as a capacity ceiling"
    )


def config_from_args(args: argparse.Namespace, target: str, label: str) -> SweepConfig:
    load = LoadConfig(
        model=args.model or None,
        max_retries=args.max_retries,
        api_key=args.api_key or None,
        prompt_tokens=Dist.parse(args.prompt_tokens) if args.prompt_tokens else None,
        output_tokens=Dist.parse(args.output_tokens) if args.output_tokens else None,
        prompt_file=args.prompt_file or None,
        system_tokens=args.system_tokens,
        max_context=args.max_context,
        seed=args.seed,
    )
    return SweepConfig(
        target=target,
        workload=getattr(args, "workload", "batch-json"),
        steps=parse_steps(args.steps),
        hold_s=args.hold,
        warmup=args.warmup,
        timeout_s=args.timeout,
        speed=args.speed,
        label=label,
        load=load,
        gain=args.plateau_gain,
        slo_floor=args.slo_tokens_per_s,
        min_valid=args.min_valid,
        widen=args.widen,
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(list(argv) if argv is not None else None)
    try:
        cfg = config_from_args(args, args.target, args.label or args.target)
    except ValueError as e:
        ap.error(str(e))
    if not 0 <= cfg.warmup < 1:
        ap.error("--warmup is a fraction in [0, 1)")
    out = Path(args.out or datetime.now().strftime("sweep-%Y%m%d-%H%M%S"))
    wall = sum(1 for _ in cfg.steps) * cfg.hold_s / cfg.speed
    print(
        f"kvgate sweep: {cfg.workload} at {cfg.target}, steps {args.steps}, "
        f"{cfg.hold_s:g} s each (about {wall / 60:.1f} min)",
        file=sys.stderr,
    )
    try:
        result = run_sweep(cfg, console_progress())
    except requests.RequestException as e:
        print(f"kvgate sweep: {cfg.target}: {e}", file=sys.stderr)
        return 1
    paths = write_outputs([result], out)
    rd = result.reading
    print(
        f"plateau: {_at(rd.plateau)}; SLO crossing: {_at(rd.slo)}; "
        f"failure point: {_at(rd.failure)}; {rd.sentence()}"
    )
    print(f"report: {paths['report.md']}")
    return 0


def _at(step: Step | None) -> str:
    return "-" if step is None else f"c={step.concurrency}"


if __name__ == "__main__":
    sys.exit(main())
