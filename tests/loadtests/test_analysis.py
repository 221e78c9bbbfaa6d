"""Reading a sweep on made-up numbers: the three points, the ceiling, the outputs."""

from __future__ import annotations

import math

import pytest

from loadtests.analysis import Record, Step, find_failure, find_plateau, read, summarize
from loadtests.report import SweepResult, load_json, markdown, render, write_csv, write_json


def step(c: int, tok_s: float, *, ok: int = 100, ended: int = 100, per_user: float = 20.0,
         p50: float = 10.0, mx: float = 20.0, limit: float = math.nan) -> Step:  # fmt: skip
    return Step(
        concurrency=c, measured_s=100.0, ended=ended, completed=ok, timed_out=ended - ok,
        output_tok_s=tok_s, per_user_tok_s=per_user, latency_p50=p50, latency_max=mx,
        limit_min=limit, limit_max=limit,
    )  # fmt: skip


# Seed 001's straight sweep (docs/benchmarks.md, tokens/s and latencies): flat from 8, gone at 32.
SEED2 = [
    step(1, 700, p50=3.5, mx=7.6, per_user=36),
    step(2, 983, p50=4.9, mx=13.0, per_user=30),
    step(4, 1263, p50=7.6, mx=23.5, per_user=22),
    step(8, 1372, p50=13.9, mx=39.1, per_user=12),
    step(16, 1402, ok=684, ended=738, p50=24.7, mx=44.9, per_user=7),
    step(32, 69, ok=27, ended=738, p50=41.6, mx=44.8, per_user=2),
]


def test_seed_001s_sweep_reads_as_seed_001_found_it() -> None:
    rd = read(SEED2, gain=0.10, slo_floor=10.0, min_valid=0.95)
    assert rd.plateau is not None and rd.plateau.concurrency == 8
    assert rd.slo is not None and rd.slo.concurrency == 16
    assert rd.failure is not None and rd.failure.concurrency == 16
    # The spread holds (2.2x -> 2.8x at c=8; c=16 and up are cut off by timeouts): the
    # T4's compute-bound prefill, as docs/benchmarks.md says.
    assert rd.kind == "compute" and rd.spread_at == 8
    assert "compute ceiling" in rd.sentence()


def test_the_plateau_ignores_a_noisy_dip_and_needs_a_later_step() -> None:
    steps = [step(1, 100), step(2, 190), step(4, 200), step(8, 180), step(16, 215)]
    assert find_plateau(steps).concurrency == 4  # 215 is within 10% of 200
    assert find_plateau(steps, gain=0.05) is None  # under a 5% rule c=16 still gains 7.5%
    assert find_plateau([step(1, 100), step(2, 200)]) is None  # still climbing
    assert find_plateau([step(1, 100)]) is None


def test_a_widening_spread_reads_as_capacity() -> None:
    steps = [
        step(1, 100, p50=1.0, mx=1.3),
        step(2, 200, p50=1.0, mx=1.4),
        step(4, 390, p50=1.1, mx=1.6),
        step(8, 400, p50=2.0, mx=6.0),
        step(16, 405, p50=4.0, mx=14.0),
    ]
    rd = read(steps)
    assert (rd.plateau.concurrency, rd.kind, rd.spread_at) == (4, "capacity", 16)
    assert rd.failure is None and rd.slo is None
    assert "capacity ceiling" in rd.sentence()


def test_no_plateau_no_reading() -> None:
    rd = read([step(1, 100), step(2, 200), step(4, 400)])
    assert rd.kind == "none" and "still climbs" in rd.sentence()


def test_failure_point_counts_every_ended_request() -> None:
    assert (
        find_failure([step(1, 1, ok=96, ended=100), step(2, 1, ok=94, ended=100)]).concurrency == 2
    )
    assert find_failure([step(1, 1, ok=0, ended=0)]) is None  # nothing ended: no verdict


def test_summarize_converts_to_the_targets_clock() -> None:
    recs = [
        Record(end=1, ok=True, latency=0.1, ttft=0.02, itl=0.001, per_user_tps=1000,
               output_tokens=50, prompt_tokens=500),
        Record(end=2, ok=True, latency=0.3, ttft=0.04, itl=0.002, per_user_tps=500,
               output_tokens=50, prompt_tokens=500),
        Record(end=3, ok=False, failure="timeout"),
        Record(end=4, ok=False, failure="shed"),
        Record(end=5, ok=False, failure="error"),
    ]  # fmt: skip
    s = summarize(4, recs, retries=3, window_s=2.0, speed=10.0, limits=[3, 5, 4])
    assert (s.ended, s.completed, s.timed_out, s.shed_failed, s.errors, s.retries) == (
        5, 2, 1, 1, 1, 3,
    )  # fmt: skip
    assert s.measured_s == 20.0 and s.output_tok_s == 5.0 and s.total_tok_s == 55.0
    assert (s.prompt_tokens_mean, s.output_tokens_mean) == (500, 50)
    assert s.latency_p50 == 1.0 and math.isclose(s.latency_max, 3.0)
    assert s.ttft_p50 == 0.2 and s.itl_p99 == 0.02 and s.per_user_tok_s == 50.0
    assert (s.limit_min, s.limit_max) == (3, 5) and s.valid_fraction == 0.4


def result(label: str, steps: list[Step]) -> SweepResult:
    return SweepResult(
        label=label, target="http://t", workload="batch-json", model="m", speed=25.0,
        timeout_s=45.0, hold_s=600.0, warmup=0.25, max_retries=2, steps=steps,
    )  # fmt: skip


def test_outputs_round_trip_and_name_the_points(tmp_path) -> None:
    straight = result("straight", SEED2)
    through = result(
        "through kvgate",
        [step(s.concurrency, min(s.output_tok_s, 1370) if s.concurrency < 32 else 1350,
              limit=6) for s in SEED2],
    )  # fmt: skip
    assert through.limit_range() == (6, 6)  # where clients outnumber it
    write_csv(straight, tmp_path / "s.csv")
    lines = (tmp_path / "s.csv").read_text().splitlines()
    assert len(lines) == 1 + len(SEED2) and lines[0].startswith("concurrency,")
    write_json([straight, through], tmp_path / "sweep.json")
    back = load_json(tmp_path / "sweep.json")
    assert [str(s.row()) for s in back[0].steps] == [str(s.row()) for s in straight.steps]
    assert back[1].label == "through kvgate" and back[1].limit_range() == (6, 6)
    assert "NaN" not in (tmp_path / "sweep.json").read_text()  # strict JSON: null
    md = markdown([straight, through], ["throughput.png"])
    assert "| failure point (valid < 95%) | c=16, 684/738 valid | none |" in md
    assert "| kvgate learned limit | - | 6 |" in md
    assert "![throughput](throughput.png)" in md


@pytest.mark.slow  # draws the plots (matplotlib)
def test_a_sweep_renders_again_from_its_json(tmp_path) -> None:
    straight = result("straight", SEED2)
    straight.preemptions = 16
    write_json([straight], tmp_path / "sweep.json")
    render(tmp_path, "Title")
    for name in ("throughput.png", "latency.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# Title") and "| replica preemptions | 16 |" in md
