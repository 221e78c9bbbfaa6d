"""Calibration against the seeds: each figure fails outside its tolerance.

These run the same functions as `python -m enginesim.calibrate` (virtual time, about a
second of CPU in all).
"""

from __future__ import annotations

import functools

import pytest

from enginesim import calibrate
from enginesim.profiles import load_profile
from enginesim.simulate import run_closed_loop
from enginesim.workloads import seed2_workload


@functools.cache
def _rows(group: str) -> list[calibrate.Row]:
    return {"moe": calibrate.moe_rows, "seed2": calibrate.seed2_rows, "spec": calibrate.spec_rows}[
        group
    ]()


@pytest.mark.parametrize(("group", "index"), [("moe", i) for i in range(4)])
def test_moe_seed000(group: str, index: int) -> None:
    row = _rows(group)[index]
    assert row.ok, row


@pytest.mark.slow  # a calibration run of the simulator (cached for the other parameters)
@pytest.mark.parametrize(("group", "index"), [("seed2", i) for i in range(4)])
def test_8b_16gb_seed001(group: str, index: int) -> None:
    row = _rows(group)[index]
    assert row.ok, row


@pytest.mark.parametrize(("group", "index"), [("spec", i) for i in range(3)])
def test_speculation_seed000(group: str, index: int) -> None:
    row = _rows(group)[index]
    assert row.ok, row


def test_collapse_is_a_cliff_and_wastes_work() -> None:
    """c=32 loses most requests because their work is thrown away, not only slowed."""
    r8, r32 = calibrate.seed2_run(8), calibrate.seed2_run(32)
    assert r32.tokens_per_s < 0.2 * r8.tokens_per_s  # goodput collapses
    assert r32.useful_prefill_fraction < 0.2  # most prefill work belonged to timed-out requests
    assert r8.max_latency < calibrate.SEED2_TIMEOUT_S
    assert r32.p50_latency > r8.p99_latency


def test_collapse_holds_for_other_workload_draws() -> None:
    r = run_closed_loop(
        load_profile(calibrate.SEED2_PROFILE),
        seed2_workload(738, seed=2),
        32,
        calibrate.SEED2_TIMEOUT_S,
    )
    assert r.timed_out / r.requests >= 0.9


def test_closed_loop_invariants_with_checks() -> None:
    """Every request ends exactly once; the pool holds after every step."""
    items = seed2_workload(120, seed=5)
    r = run_closed_loop(load_profile(calibrate.SEED2_PROFILE), items, 32, 20.0, check=True)
    assert r.completed + r.timed_out == 120
