"""Speculation-aware placement: the ``speculation`` scorer.

Why. Speculative decoding is worth 3-4x per request at batch 1 and turns into a loss as
the batch grows (seed 000): verifying k drafts per sequence costs compute that is free
while a step is bound by streaming the weights and paid in full once it is bound by
compute, and rejected drafts are waste. Coding accepts the most drafts (4.73 tokens per
step against 2.61 on creative writing), so coding gains the most. A replica speculates
or not as it was started; the gateway can only choose who goes there.

Policy. For a request of a speculating workload (``workloads``, default ``[coding]``):
a speculating replica whose batch with this request stays within its *crossover* scores
1, one past it 0, a plain replica 0.5: coding goes to speculating replicas while
speculation pays there and spills to plain ones past it. Other requests score a plain
replica 1, and a speculating one 1 while its batch with them stays within
``others_share`` (0.25) of the crossover, 0 past it: at low load chat gains from
speculation too (less than coding: docs/simulator.md), and it leaves the speculating
replicas' batch to coding before it grows (0: other classes never go there by
preference). With a load scorer in the profile (``kv_headroom`` / ``running_headroom``)
the weights decide how far a preference may overload a replica. The batch is the larger
of the ledger's running count (current) and the engine's (other clients; as of its last
round).

Which replicas speculate: the replica's ``speculative`` label, else the engine
(`Candidate.speculative`, from the adapters: vLLM's ``spec_decode_*`` counters, SGLang's
``speculative_algorithm``).

The crossover b*. A speculating step over b sequences verifies b (k + 1) positions: its
time is s(b) = s0 + s1 b. A plain step computes b positions: s0 + s1 b / (k + 1). A
sequence emits `a` tokens per speculating step (the acceptance) and one per plain step,
so speculation pays while a (s0 + s1 b / (k + 1)) > s0 + s1 b, i.e. below

    b* = (s0 / s1) (a - 1) / (1 - a / (k + 1))          (a < k + 1)

- Where the engine exports acceptance (vLLM: accepted / drafts + 1 over the window
  between two rounds; SGLang: ``spec_accept_length``) and its inter-token latency
  histogram, each round with at least ``min_window_tokens`` new observations gives a step
  time at the batch the engine ran: the mean ITL where the engine observes it once a step
  (vLLM, ``itl_per_step``), the mean ITL x acceptance where once a token; a least-squares
  line through the last ``window_rounds`` of them gives s0 and s1, and b* follows.
- k is the engine's drafts per step where it says (vLLM: the positions of its
  per-position counter; SGLang: its server args), else ``num_draft_tokens``.
- With acceptance but too few distinct batches for the line, the configured
  ``crossover_batch`` (stated at ``reference_acceptance`` with ``num_draft_tokens``
  drafts) is scaled by (a - 1) / (1 - a / (k + 1)) at the engine's k over the same at the
  reference's: s0 / s1 is the hardware's, the gain the engine's own.
- With nothing measured, ``crossover_batch`` as configured (default 32: where a pure
  coding batch's gain on enginesim's seed2-8b-16gb-spec has nearly run out; measured:
  docs/benchmarks.md, coding on speculating replicas).

``explain`` names the decision for ``kvgate_routing_decisions_total``: ``speculation``
(a speculating workload placed on a speculating replica), ``spill`` (placed on a plain
one while speculating replicas exist). ``hints`` names up to four known speculating
replicas with the smallest batch, so admission scores them at any fleet size.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Mapping
from typing import Any

from routing.plugin import ExplainHook, HintHook, PlacementHook, PluginEnv, Scorer, params_of
from routing.types import Candidate, RouteRequest

# Verification steps a window needs before its acceptance replaces the last one.
_MIN_WINDOW_STEPS = 8


def gain_factor(acceptance: float, drafts: int) -> float:
    """(a - 1) / (1 - a / (k + 1)): the crossover per unit of s0 / s1 (inf at a >= k+1)."""
    top = drafts + 1
    if acceptance >= top:
        return float("inf")
    return max(0.0, acceptance - 1.0) / (1.0 - acceptance / top)


class _Replica:
    __slots__ = ("drafts", "accepted", "itl_sum", "itl_n", "acceptance", "steps", "batch")

    def __init__(self, window: int) -> None:
        self.drafts: float | None = None
        self.accepted: float | None = None
        self.itl_sum: float | None = None
        self.itl_n: float | None = None
        self.acceptance: float | None = None
        self.steps: deque[tuple[float, float]] = deque(maxlen=window)  # (batch, step time)
        self.batch = 0


class SpeculationScorer(Scorer, PlacementHook, HintHook, ExplainHook):
    """Coding to speculating replicas below their crossover (module docstring)."""

    name = "speculation"

    def __init__(
        self,
        *,
        workloads: tuple[str, ...] = ("coding",),
        crossover_batch: float = 32.0,
        reference_acceptance: float = 4.73,
        num_draft_tokens: int = 5,
        others_share: float = 0.25,
        min_window_tokens: int = 64,
        window_rounds: int = 32,
    ) -> None:
        self.workloads = frozenset(workloads)
        self.crossover_batch = crossover_batch
        self.reference_acceptance = reference_acceptance
        self.num_draft_tokens = num_draft_tokens
        self.others_share = others_share
        self.min_window_tokens = min_window_tokens
        self.window_rounds = window_rounds
        self._reps: dict[str, _Replica] = {}
        self._spec: dict[str, int] = {}  # speculating replica -> last batch seen

    # ----------------------------------------------------------- measurement
    def _observe(self, c: Candidate) -> _Replica:
        rep = self._reps.get(c.name)
        if rep is None:
            rep = self._reps[c.name] = _Replica(self.window_rounds)
        e = c.engine  # the engine's own counters
        batch = max(c.running, e.engine_running)
        rep.batch = batch
        if c.speculative:
            self._spec[c.name] = batch
        else:
            self._spec.pop(c.name, None)
            return rep
        if e.spec_accept_length is not None:
            rep.acceptance = e.spec_accept_length
        elif e.spec_drafts_total is not None and e.spec_accepted_tokens_total is not None:
            if rep.drafts is not None and rep.accepted is not None:
                steps = e.spec_drafts_total - rep.drafts
                if steps >= _MIN_WINDOW_STEPS:
                    rep.acceptance = 1.0 + (e.spec_accepted_tokens_total - rep.accepted) / steps
                    rep.drafts, rep.accepted = e.spec_drafts_total, e.spec_accepted_tokens_total
                elif steps < 0:  # engine restarted
                    rep.drafts, rep.accepted = e.spec_drafts_total, e.spec_accepted_tokens_total
            else:
                rep.drafts, rep.accepted = e.spec_drafts_total, e.spec_accepted_tokens_total
        if e.itl_sum_s is not None and e.itl_count is not None:
            if rep.itl_sum is not None and rep.itl_n is not None:
                n = e.itl_count - rep.itl_n
                if n >= self.min_window_tokens and rep.acceptance and e.engine_running > 0:
                    itl = (e.itl_sum_s - rep.itl_sum) / n
                    step = itl if e.itl_per_step else itl * rep.acceptance
                    rep.steps.append((float(e.engine_running), step))
                    rep.itl_sum, rep.itl_n = e.itl_sum_s, e.itl_count
                elif n < 0:
                    rep.itl_sum, rep.itl_n = e.itl_sum_s, e.itl_count
            else:
                rep.itl_sum, rep.itl_n = e.itl_sum_s, e.itl_count
        return rep

    def crossover(self, c: Candidate) -> float:
        """The batch up to which speculation pays on `c` (module docstring)."""
        rep = self._reps.get(c.name)
        a = rep.acceptance if rep is not None else None
        if a is None:
            return self.crossover_batch
        k = c.engine.spec_num_draft_tokens or self.num_draft_tokens
        g = gain_factor(a, k)
        line = _fit(rep.steps) if rep is not None else None
        if line is not None:
            s0, s1 = line
            if s1 > 0 and s0 > 0:
                return max(1.0, s0 / s1 * g)
        # The reference is stated with its own drafts (num_draft_tokens), not the engine's:
        # 4.73 tokens a step is out of reach of an engine drafting 3 (vLLM's ngram here).
        ref = gain_factor(self.reference_acceptance, self.num_draft_tokens)
        if ref <= 0 or ref == float("inf") or g == float("inf"):
            return self.crossover_batch
        return max(1.0, self.crossover_batch * g / ref)

    # ----------------------------------------------------------- plugin hooks
    def score(self, req: RouteRequest, c: Candidate) -> float:
        rep = self._observe(c)
        if req.workload in self.workloads:
            if not c.speculative:
                return 0.5
            return 1.0 if rep.batch + 1 <= self.crossover(c) else 0.0
        if not c.speculative:
            return 1.0
        return 1.0 if rep.batch + 1 <= self.others_share * self.crossover(c) else 0.0

    def placed(self, req: RouteRequest, c: Candidate, now: float) -> None:
        if c.speculative:
            self._spec[c.name] = max(c.running, c.engine.engine_running) + 1

    def hints(self, req: RouteRequest) -> list[str]:
        if req.workload not in self.workloads or not self._spec:
            return []
        if len(self._spec) <= 4:
            return list(self._spec)
        return heapq.nsmallest(4, self._spec, key=self._spec.__getitem__)

    def explain(self, req: RouteRequest, chosen: Candidate) -> str | None:
        if req.workload not in self.workloads or not self._spec:
            return None
        return "speculation" if chosen.speculative else "spill"


def _fit(points: deque[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares (intercept, slope) of step time on batch; None without two batches."""
    n = len(points)
    if n < 3:
        return None
    mx = sum(b for b, _ in points) / n
    my = sum(t for _, t in points) / n
    sxx = sum((b - mx) ** 2 for b, _ in points)
    if sxx <= 0:
        return None
    slope = sum((b - mx) * (t - my) for b, t in points) / sxx
    return my - slope * mx, slope


def factory(params: Mapping[str, Any], env: PluginEnv) -> SpeculationScorer:
    params_of(
        params,
        {
            "workloads": list,
            "crossover_batch": (int, float),
            "reference_acceptance": (int, float),
            "num_draft_tokens": int,
            "others_share": (int, float),
            "min_window_tokens": int,
            "window_rounds": int,
        },
    )
    workloads = params.get("workloads", ["coding"])
    if not all(isinstance(w, str) for w in workloads):
        raise ValueError("workloads must be a list of workload names")
    crossover = float(params.get("crossover_batch", 32.0))
    ref = float(params.get("reference_acceptance", 4.73))
    k = int(params.get("num_draft_tokens", 5))
    share = float(params.get("others_share", 0.25))
    if crossover < 1 or k < 1 or not 1.0 < ref < k + 1 or not 0.0 <= share <= 1.0:
        raise ValueError(
            "crossover_batch must be >= 1, num_draft_tokens >= 1, and "
            "reference_acceptance in (1, num_draft_tokens + 1), others_share in [0, 1]"
        )
    return SpeculationScorer(
        workloads=tuple(workloads),
        crossover_batch=crossover,
        reference_acceptance=ref,
        num_draft_tokens=k,
        others_share=share,
        min_window_tokens=max(1, int(params.get("min_window_tokens", 64))),
        window_rounds=max(3, int(params.get("window_rounds", 32))),
    )
