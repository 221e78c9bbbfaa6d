"""A sweep's outputs: the CSV of every step, JSON to re-render from, PNG plots
(matplotlib, imported only when plotting) and a short Markdown report.

One `SweepResult` is one staircase against one target; the plots and the report take
several, so the showcase draws "straight at the replica" and "through kvgate" on the
same axes.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from loadtests.analysis import Reading, Step, read

CSV_COLUMNS = [f.name for f in fields(Step)] + ["valid_fraction", "spread"]


@dataclass(slots=True)
class SweepResult:
    """One staircase against one target, in the target's units (see `speed`)."""

    label: str
    target: str
    workload: str
    model: str
    speed: float  # the target's clock over the wall clock (1 for a real engine)
    timeout_s: float  # the client's read timeout, target seconds
    hold_s: float
    warmup: float  # fraction of each hold left out of its numbers
    max_retries: int
    gain: float = 0.10
    slo_floor: float = 10.0
    min_valid: float = 0.95
    widen: float = 1.5
    steps: list[Step] = field(default_factory=list)
    limits: list[tuple[float, float]] = field(default_factory=list)  # (target s, limit)
    started: str = ""
    wall_s: float = 0.0
    preemptions: float | None = None  # the replica's own counter, when the caller knows it

    @property
    def reading(self) -> Reading:
        return read(
            self.steps,
            gain=self.gain,
            slo_floor=self.slo_floor,
            min_valid=self.min_valid,
            widen=self.widen,
        )

    def limit_range(self) -> tuple[float, float] | None:
        """kvgate's learned limit (summed over replicas) over the steps where the clients
        outnumbered it, where it was the binding choice; else over the whole sweep."""
        seen = [s for s in self.steps if not math.isnan(s.limit_max)]
        if not seen:
            return None
        binding = [s for s in seen if s.concurrency > s.limit_max] or seen
        return min(s.limit_min for s in binding), max(s.limit_max for s in binding)

    def to_json(self) -> dict[str, Any]:
        """Strict JSON: a missing number (NaN) is null."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "steps"}
        d["steps"] = [
            {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in asdict(s).items()}
            for s in self.steps
        ]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SweepResult:
        d = dict(d)
        steps = [
            Step(**{k: math.nan if v is None else v for k, v in s.items()}) for s in d.pop("steps")
        ]
        limits = [tuple(x) for x in d.pop("limits", [])]
        return cls(**d, steps=steps, limits=limits)  # type: ignore[arg-type]


def write_csv(result: SweepResult, path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for s in result.steps:
            w.writerow({k: _csv_value(v) for k, v in s.row().items()})


def _csv_value(v: float | int) -> str:
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.6g}"
    return str(v)


def write_json(results: Sequence[SweepResult], path: Path) -> None:
    path.write_text(json.dumps([r.to_json() for r in results], indent=1) + "\n")


def load_json(path: Path) -> list[SweepResult]:
    return [SweepResult.from_json(d) for d in json.loads(path.read_text())]


# --------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------

_COLORS = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e"]


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _concurrency_axis(ax, results: Sequence[SweepResult]) -> None:  # type: ignore[no-untyped-def]
    ticks = sorted({s.concurrency for r in results for s in r.steps})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t) for t in ticks])
    ax.minorticks_off()
    ax.grid(True, alpha=0.3)


def _units(result: SweepResult) -> str:
    return "simulated s" if result.speed != 1 else "s"


def plot_throughput(results: Sequence[SweepResult], path: Path, title: str = "") -> None:
    """Aggregate output tokens/s and per-user tokens/s against client concurrency, with
    the plateau, the SLO crossing, the failure point and kvgate's learned limit marked."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7.5), sharex=True)
    floor = results[0].slo_floor
    for i, r in enumerate(results):
        color = _COLORS[i % len(_COLORS)]
        rd = r.reading
        xs = [s.concurrency for s in r.steps]
        top.plot(xs, [s.output_tok_s for s in r.steps], "o-", color=color, label=r.label, lw=2)
        bottom.plot(
            xs, [s.per_user_tok_s for s in r.steps], "s--", color=color, label=r.label, lw=1.5
        )
        bad = [s for s in r.steps if s.ended and s.valid_fraction < r.min_valid]
        if bad:
            top.plot(
                [s.concurrency for s in bad],
                [s.output_tok_s for s in bad],
                "x",
                color="black",
                ms=11,
                mew=2.5,
                label=f"{r.label}: valid completions < {r.min_valid:.0%}",
            )
            for s in bad:
                top.annotate(
                    f"{s.valid_fraction:.0%} valid",
                    (s.concurrency, s.output_tok_s),
                    textcoords="offset points",
                    xytext=(6, 8),
                    fontsize=8,
                    color=color,
                )
        if rd.plateau is not None:
            top.axvline(rd.plateau.concurrency, color=color, ls=":", lw=1.5)
            top.annotate(
                f"plateau c={rd.plateau.concurrency}",
                (rd.plateau.concurrency, rd.plateau.output_tok_s),
                textcoords="offset points",
                xytext=(-10, -18 - 12 * i),
                ha="right",
                fontsize=8,
                color=color,
            )
        if rd.failure is not None:
            top.axvline(rd.failure.concurrency, color=color, ls="--", lw=1, alpha=0.8)
            top.annotate(
                f"failure point c={rd.failure.concurrency}",
                (rd.failure.concurrency, 0),
                xycoords=("data", "axes fraction"),
                textcoords="offset points",
                xytext=(4, 6 + 12 * i),
                fontsize=8,
                color=color,
            )
        if rd.slo is not None and not math.isnan(rd.slo.per_user_tok_s):
            bottom.plot(
                [rd.slo.concurrency], [rd.slo.per_user_tok_s], "o", mfc="none", ms=12, color=color
            )
        lr = r.limit_range()
        if lr is not None:
            lo, hi = lr
            for ax in (top, bottom):
                ax.axvspan(lo * 0.97, hi * 1.03, color=color, alpha=0.12)
            text = f"{lo:.0f}" if lo == hi else f"{lo:.0f}-{hi:.0f}"
            top.annotate(
                f"kvgate learned limit {text}",
                ((lo * hi) ** 0.5, 1.0),
                xycoords=("data", "axes fraction"),
                textcoords="offset points",
                xytext=(0, -14),
                ha="center",
                fontsize=8,
                color=color,
            )
    bottom.axhline(floor, color="gray", ls="-.", lw=1, label=f"SLO floor {floor:g} tok/s")
    top.set_ylabel(f"aggregate output tokens/s\n(completed requests, per {_units(results[0])})")
    bottom.set_ylabel("per-user tokens/s\n(median decode rate a client sees)")
    bottom.set_xlabel("client concurrency (users)")
    for ax in (top, bottom):
        _concurrency_axis(ax, results)
        ax.set_ylim(bottom=0)
    top.legend(fontsize=8, loc="upper left")
    bottom.legend(fontsize=8, loc="upper right")
    fig.suptitle(title or _title(results))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency(results: Sequence[SweepResult], path: Path, title: str = "") -> None:
    """Latency p50 and max of completed requests against client concurrency."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5))
    for i, r in enumerate(results):
        color = _COLORS[i % len(_COLORS)]
        xs = [s.concurrency for s in r.steps]
        ax.plot(xs, [s.latency_p50 for s in r.steps], "o-", color=color, label=f"{r.label}: p50")
        ax.plot(xs, [s.latency_max for s in r.steps], "^--", color=color, label=f"{r.label}: max")
        rd = r.reading
        if rd.failure is not None:
            ax.axvline(rd.failure.concurrency, color=color, ls="--", lw=1, alpha=0.6)
    timeouts = sorted({r.timeout_s for r in results})
    for t in timeouts:
        ax.axhline(t, color="gray", ls=":", lw=1)
        ax.annotate(
            f"client read timeout {t:g} s",
            (0, t),
            xycoords=("axes fraction", "data"),
            textcoords="offset points",
            xytext=(4, 3),
            fontsize=8,
            color="gray",
        )
    _concurrency_axis(ax, results)
    ax.set_yscale("log")
    ax.set_ylabel(f"latency of completed requests ({_units(results[0])})\nfrom first attempt")
    ax.set_xlabel("client concurrency (users)")
    ax.legend(fontsize=8)
    fig.suptitle(title or _title(results, "latency p50 and max"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _title(results: Sequence[SweepResult], what: str = "throughput") -> str:
    r = results[0]
    return f"{what}: {r.workload} workload, {r.model}"


# --------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------


def _f(v: float, fmt: str = ",.0f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def _point(step: Step | None, what: str) -> str:
    return f"c={step.concurrency}" if step is not None else what


def points_table(results: Sequence[SweepResult]) -> str:
    r0 = results[0]
    rows = [
        "| | " + " | ".join(r.label for r in results) + " |",
        "| --- |" + " ---: |" * len(results),
    ]

    def line(name: str, fn) -> None:  # type: ignore[no-untyped-def]
        rows.append(f"| {name} | " + " | ".join(fn(r) for r in results) + " |")

    line(
        f"plateau (no later step > +{r0.gain:.0%})",
        lambda r: (
            _point(r.reading.plateau, "not reached (still climbing)")
            + (
                f", {_f(r.reading.plateau.output_tok_s)} tok/s"
                if r.reading.plateau is not None
                else ""
            )
        ),
    )
    line(
        f"SLO crossing (per-user < {r0.slo_floor:g} tok/s)",
        lambda r: _point(r.reading.slo, "never below"),
    )
    line(
        f"failure point (valid < {r0.min_valid:.0%})",
        lambda r: (
            _point(r.reading.failure, "none")
            + (
                f", {r.reading.failure.completed}/{r.reading.failure.ended} valid"
                if r.reading.failure is not None
                else ""
            )
        ),
    )
    line(
        "best aggregate output tok/s",
        lambda r: _f(max((s.output_tok_s for s in r.steps), default=math.nan)),
    )
    line(
        "completed / ended, all steps",
        lambda r: f"{sum(s.completed for s in r.steps):,} / {sum(s.ended for s in r.steps):,}",
    )
    line("timed out, all steps", lambda r: f"{sum(s.timed_out for s in r.steps):,}")
    line("429/503 retries honoured", lambda r: f"{sum(s.retries for s in r.steps):,}")

    def limit(r: SweepResult) -> str:
        lr = r.limit_range()
        if lr is None:
            return "-"
        return f"{lr[0]:.0f}" if lr[0] == lr[1] else f"{lr[0]:.0f}-{lr[1]:.0f}"

    line("kvgate learned limit", limit)
    line("ceiling", lambda r: r.reading.kind)
    if any(r.preemptions is not None for r in results):
        line(
            "replica preemptions",
            lambda r: "-" if r.preemptions is None else f"{r.preemptions:,.0f}",
        )
    return "\n".join(rows)


def steps_table(result: SweepResult) -> str:
    u = "s" if result.speed == 1 else "sim s"
    head = (
        f"| c | ended | completed | timed out | errors | shed out | retries | valid | out tok/s "
        f"| per-user tok/s | TTFT p50/p90/p99 ({u}) | ITL p50/p90/p99 (ms) | latency p50 / max ({u}) "
        "| spread | limit |"
    )
    rows = [head, "|" + " ---: |" * 15]
    for s in result.steps:
        lim = (
            "-"
            if math.isnan(s.limit_max)
            else (
                f"{s.limit_min:.0f}"
                if s.limit_min == s.limit_max
                else f"{s.limit_min:.0f}-{s.limit_max:.0f}"
            )
        )
        rows.append(
            f"| {s.concurrency} | {s.ended} | {s.completed} | {s.timed_out} | {s.errors} "
            f"| {s.shed_failed} | {s.retries} | {_f(s.valid_fraction, '.0%')} "
            f"| {_f(s.output_tok_s)} | {_f(s.per_user_tok_s, '.1f')} "
            f"| {_f(s.ttft_p50, '.2f')} / {_f(s.ttft_p90, '.2f')} / {_f(s.ttft_p99, '.2f')} "
            f"| {_f(s.itl_p50 * 1e3, '.0f')} / {_f(s.itl_p90 * 1e3, '.0f')} / {_f(s.itl_p99 * 1e3, '.0f')} "
            f"| {_f(s.latency_p50, '.1f')} / {_f(s.latency_max, '.1f')} | {_f(s.spread, '.1f')}x | {lim} |"
        )
    return "\n".join(rows)


def setup_line(r: SweepResult) -> str:
    clock = (
        f"; the target's clock runs x{r.speed:g} (every time and rate here is in its simulated seconds)"
        if r.speed != 1
        else ""
    )
    return (
        f"`{r.workload}` workload on `{r.model}` at {r.target}; steps "
        f"{', '.join(str(s.concurrency) for s in r.steps)} users, {r.hold_s:g} s each "
        f"(the first {r.warmup:.0%} of each left out); client read timeout {r.timeout_s:g} s, "
        f"429/503 retried up to {r.max_retries} times after Retry-After{clock}."
    )


def markdown(
    results: Sequence[SweepResult], plots: Sequence[str], title: str = "Ceiling sweep"
) -> str:
    out = [f"# {title}", ""]
    for r in results:
        out.append(f"- **{r.label}**: {setup_line(r)}")
    out += ["", points_table(results), ""]
    for r in results:
        out.append(f"- **{r.label}**: {r.reading.sentence()}.")
    out.append("")
    out += [f"![{Path(p).stem}]({p})" for p in plots]
    for r in results:
        out += ["", f"## {r.label}: every step", "", steps_table(r)]
    out += [
        "",
        "Counts are of requests that ended inside each step's measured window; throughput "
        "counts completed requests only; latency and TTFT run from a request's first "
        "attempt, so they include time spent honouring Retry-After; ITL is each request's "
        "mean gap between tokens; per-user tokens/s is the median of each request's decode "
        "rate; spread is max / p50 latency.",
        "",
    ]
    return "\n".join(out)


def render(folder: Path, title: str = "") -> None:
    """Draw the plots and write the report again from a sweep's ``sweep.json``."""
    results = load_json(folder / "sweep.json")
    plot_throughput(results, folder / "throughput.png")
    plot_latency(results, folder / "latency.png")
    old = folder / "report.md"
    if not title and old.exists():
        first = old.read_text().splitlines()[:1]
        title = first[0].removeprefix("# ") if first else ""
    old.write_text(markdown(results, ["throughput.png", "latency.png"], title or "Ceiling sweep"))


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m loadtests.report FOLDER  (re-renders FOLDER/sweep.json)")
    render(Path(sys.argv[1]))
