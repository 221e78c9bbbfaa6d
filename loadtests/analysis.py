"""Reading a sweep: per-step numbers, and seed 001's and seed 000's points in them.

Pure functions over plain records, no Locust and no IO, so every rule is tested on
made-up numbers. The rules:

- **plateau** (seed 001, step 4): the first step after which aggregate throughput stops
  improving: no later step delivers more than `gain` (10%) above it. It is the practical
  operating point and it comes before the failure point.
- **SLO crossing** (seed 000, ceiling 3): the first step whose per-user token rate (the
  median over completed requests of the decode rate a client sees, output tokens after
  the first over the time from first to last token) is below the floor.
- **failure point** (seed 001, step 5): the first step where valid completions are below
  `min_valid` (95%) of the requests that ended in the step. Throughput on a step that
  dropped most of its requests is a meaningless number, so every step records both.
- **which ceiling** (seed 000, step 4): the p50-to-max latency spread (max / p50 of
  completed requests). When it widens from the first step to the steps at and past the
  plateau (by `widen`, 1.5x), requests are waiting for pool space: a *capacity* ceiling
  (more memory or more replicas). When it holds, every request slows together: a
  *compute* ceiling (more GPUs, better kernels). Steps at or past the failure point are
  left out: timeouts cut off exactly the slow requests that would show the spread.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass


@dataclass(slots=True)
class Record:
    """One request that ended. Times in wall seconds of the client."""

    end: float  # when it ended
    ok: bool
    failure: str = ""  # timeout | shed | error
    latency: float = 0.0  # first attempt to the end
    ttft: float | None = None
    itl: float | None = None
    per_user_tps: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0


@dataclass(slots=True)
class Step:
    """What one step of the staircase measured, in the target's units (with a clock
    `speed`, wall times are multiplied by it and rates divided)."""

    concurrency: int
    measured_s: float  # the window the numbers cover (the hold less its warm-up)
    ended: int = 0
    completed: int = 0
    timed_out: int = 0
    errors: int = 0
    shed_failed: int = 0  # still shed after the last retry
    retries: int = 0  # 429/503 answers honoured
    output_tok_s: float = 0.0  # aggregate, completed requests only
    total_tok_s: float = 0.0  # prompt + output, completed requests only
    prompt_tokens_mean: float = math.nan  # as the engine counted them (usage)
    output_tokens_mean: float = math.nan
    per_user_tok_s: float = math.nan
    ttft_p50: float = math.nan
    ttft_p90: float = math.nan
    ttft_p99: float = math.nan
    itl_p50: float = math.nan
    itl_p90: float = math.nan
    itl_p99: float = math.nan
    latency_p50: float = math.nan
    latency_max: float = math.nan
    limit_min: float = math.nan  # kvgate's learned limit seen during the step, if any
    limit_max: float = math.nan

    @property
    def valid_fraction(self) -> float:
        return self.completed / self.ended if self.ended else math.nan

    @property
    def spread(self) -> float:
        """max / p50 latency of completed requests."""
        if not self.latency_p50 or math.isnan(self.latency_p50):
            return math.nan
        return self.latency_max / self.latency_p50

    def row(self) -> dict[str, float | int]:
        d = asdict(self)
        d["valid_fraction"] = self.valid_fraction
        d["spread"] = self.spread
        return d


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile; NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summarize(
    concurrency: int,
    records: Sequence[Record],
    retries: int,
    window_s: float,
    *,
    speed: float = 1.0,
    limits: Sequence[float] = (),
) -> Step:
    """One step from the requests that ended in its measured window of `window_s` wall
    seconds, and the 429/503 answers honoured in it."""
    done = [r for r in records if r.ok]
    lat = [r.latency * speed for r in done]
    ttft = [r.ttft * speed for r in done if r.ttft is not None]
    itl = [r.itl * speed for r in done if r.itl is not None]
    rates = [r.per_user_tps / speed for r in done if r.per_user_tps is not None]
    sim_window = window_s * speed
    out = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens for r in done)
    return Step(
        concurrency=concurrency,
        measured_s=sim_window,
        ended=len(records),
        completed=len(done),
        timed_out=sum(1 for r in records if r.failure == "timeout"),
        errors=sum(1 for r in records if not r.ok and r.failure not in ("timeout", "shed")),
        shed_failed=sum(1 for r in records if r.failure == "shed"),
        retries=retries,
        output_tok_s=out / sim_window if sim_window > 0 else 0.0,
        total_tok_s=(out + prompt) / sim_window if sim_window > 0 else 0.0,
        prompt_tokens_mean=prompt / len(done) if done else math.nan,
        output_tokens_mean=out / len(done) if done else math.nan,
        per_user_tok_s=quantile(rates, 0.5),
        ttft_p50=quantile(ttft, 0.5),
        ttft_p90=quantile(ttft, 0.9),
        ttft_p99=quantile(ttft, 0.99),
        itl_p50=quantile(itl, 0.5),
        itl_p90=quantile(itl, 0.9),
        itl_p99=quantile(itl, 0.99),
        latency_p50=quantile(lat, 0.5),
        latency_max=max(lat) if lat else math.nan,
        limit_min=min(limits) if limits else math.nan,
        limit_max=max(limits) if limits else math.nan,
    )


def find_plateau(steps: Sequence[Step], gain: float = 0.10) -> Step | None:
    """The first step no later step beats by more than `gain`; None when throughput is
    still climbing at the last step (or nothing completed)."""
    for i, s in enumerate(steps):
        if s.output_tok_s <= 0:
            continue
        later = [t.output_tok_s for t in steps[i + 1 :]]
        if not later:
            return None
        if max(later) <= (1.0 + gain) * s.output_tok_s:
            return s
    return None


def find_slo_crossing(steps: Sequence[Step], floor: float) -> Step | None:
    """The first step whose per-user token rate is below `floor` tokens/s (a step with no
    rate, because nothing completed, counts as below)."""
    for s in steps:
        if math.isnan(s.per_user_tok_s) or s.per_user_tok_s < floor:
            return s
    return None


def find_failure(steps: Sequence[Step], min_valid: float = 0.95) -> Step | None:
    """The first step where valid completions fall below `min_valid` of what ended."""
    for s in steps:
        if s.ended and s.valid_fraction < min_valid:
            return s
    return None


@dataclass(slots=True)
class Reading:
    """The three points and the ceiling they suggest."""

    plateau: Step | None
    slo: Step | None
    failure: Step | None
    kind: str  # capacity | compute | none (no plateau) | unknown (no valid step past it)
    spread_from: float = math.nan
    spread_to: float = math.nan
    spread_at: int = 0  # the concurrency of `spread_to`

    def sentence(self) -> str:
        if self.kind == "none":
            return "no ceiling reached: aggregate throughput still climbs at the top step"
        if self.kind == "unknown":
            return "no step at or past the plateau is valid, so the latency spread cannot be read"
        change = f"{self.spread_from:.1f}x at the first step to {self.spread_to:.1f}x at c={self.spread_at}"
        if self.kind == "capacity":
            return (
                f"a capacity ceiling: the p50-to-max latency spread widened from {change}, "
                "so requests wait for pool space (more KV memory or replicas, not faster compute)"
            )
        return (
            f"a compute ceiling: the p50-to-max latency spread held ({change}), so every "
            "request slows together (faster or more GPUs, not more memory)"
        )


def read(
    steps: Sequence[Step],
    *,
    gain: float = 0.10,
    slo_floor: float = 10.0,
    min_valid: float = 0.95,
    widen: float = 1.5,
) -> Reading:
    plateau = find_plateau(steps, gain)
    slo = find_slo_crossing(steps, slo_floor)
    failure = find_failure(steps, min_valid)
    if plateau is None:
        return Reading(plateau, slo, failure, "none")
    valid = [s for s in steps if failure is None or s.concurrency < failure.concurrency]
    base = next((s for s in valid if not math.isnan(s.spread)), None)
    past = [s for s in valid if s.concurrency >= plateau.concurrency and not math.isnan(s.spread)]
    if base is None or not past:
        return Reading(plateau, slo, failure, "unknown")
    top = max(past, key=lambda s: s.spread)
    kind = "capacity" if top.spread >= widen * base.spread else "compute"
    return Reading(plateau, slo, failure, kind, base.spread, top.spread, top.concurrency)
