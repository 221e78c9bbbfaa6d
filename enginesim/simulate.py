"""Virtual-time discrete-event drivers of `EngineCore` (no wall clock, no IO).

`run_closed_loop` is the seed-001 experiment: `concurrency` clients each keep one request
outstanding; a client sends its next item when the previous one completes or times out.
A timeout is a client disconnect: the request is aborted in the engine (its blocks are
freed, its work so far is wasted) and counts as failed. Time advances step by step: the
engine runs a step starting at `now`, everything the step produced happens at its end,
and client disconnects that fell inside the step take effect at its end (as an abort
reaches a real engine between steps).

`measure_decode` and `measure_ttft` are the two micro-measurements the seeds quote:
per-user decode rate at batch B, and time to first token on an idle replica.
"""

from __future__ import annotations

import heapq
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from enginesim.core import EngineCore
from enginesim.profiles import Profile, load_profile
from enginesim.types import EventKind, Flavor, SimRequest, Workload
from enginesim.workloads import WorkItem, synthetic_items

DEFAULT_MAX_TOKENS = 512


def _core(
    profile_or_core: Profile | EngineCore | str,
    *,
    seed: int,
    flavor: Flavor | None,
    speculative: bool | None,
) -> EngineCore:
    if isinstance(profile_or_core, EngineCore):
        return profile_or_core
    profile = load_profile(profile_or_core) if isinstance(profile_or_core, str) else profile_or_core
    return EngineCore(profile, flavor=flavor, seed=seed, speculative=speculative)


def _quantile(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    idx = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
    return s[idx]


@dataclass(slots=True)
class RunReport:
    concurrency: int
    timeout_s: float
    requests: int
    completed: int
    timed_out: int
    wall_time: float  # virtual seconds from the first send to the last outcome
    prompt_tokens: int  # prompt tokens of completed requests
    generated_tokens: int  # completion tokens of completed requests
    tokens_per_s: float  # (prompt + generated tokens of completed requests) / wall_time
    generated_tokens_per_s: float
    p50_latency: float
    p99_latency: float
    max_latency: float
    mean_ttft: float
    mean_decode_tps: float  # mean over completed requests of their own decode rate
    preemptions: int
    steps: int
    prefill_tokens_computed: int  # all prefill work, recompute and wasted work included
    # prompt tokens of completed requests / prefill work computed; above 1 when prefix-cache
    # hits served part of the prompts, far below 1 when work was wasted on timed-out requests
    useful_prefill_fraction: float

    @property
    def failed(self) -> int:
        return self.timed_out

    def row(self) -> str:
        return (
            f"c={self.concurrency:<3d} completed={self.completed:<4d} timed_out={self.timed_out:<4d} "
            f"wall={self.wall_time:8.1f}s tok/s={self.tokens_per_s:8.1f} gen/s={self.generated_tokens_per_s:6.1f} "
            f"p50={self.p50_latency:6.1f}s p99={self.p99_latency:6.1f}s max={self.max_latency:6.1f}s "
            f"preempt={self.preemptions} useful_prefill={self.useful_prefill_fraction:.2f}"
        )


def run_closed_loop(
    profile_or_core: Profile | EngineCore | str,
    items: list[WorkItem],
    concurrency: int,
    timeout_s: float,
    *,
    seed: int = 0,
    flavor: Flavor | None = None,
    speculative: bool | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    check: bool = False,
) -> RunReport:
    """Run `items` through one engine with `concurrency` closed-loop clients.

    Each request asks for `max_tokens` (capped to the context left) and stops naturally
    after its item's `output_tokens`. `check=True` asserts the core's invariants after
    every step (slow; for tests).
    """
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    core = _core(profile_or_core, seed=seed, flavor=flavor, speculative=speculative)
    pending = deque(items)
    # request id -> [client start, deadline, prompt tokens, first token time]
    live: dict[str, list[float]] = {}
    deadlines: list[tuple[float, str]] = []
    latencies: list[float] = []
    ttfts: list[float] = []
    decode_rates: list[float] = []
    completed = timed_out = prompt_done = gen_done = 0
    last_outcome = 0.0

    def send(start: float, now: float) -> None:
        item = pending.popleft()
        p = len(item.prompt_token_ids)
        mt = max(1, min(max_tokens, core.max_model_len - p))
        core.add_request(
            SimRequest(
                item.request_id,
                item.prompt_token_ids,
                mt,
                workload=item.workload,
                output_len=item.output_tokens,
            ),
            now,
        )
        live[item.request_id] = [start, start + timeout_s, float(p), -1.0]
        heapq.heappush(deadlines, (start + timeout_s, item.request_id))

    for _ in range(min(concurrency, len(pending))):
        send(0.0, 0.0)
    now = 0.0
    while live:
        if core.has_work():
            res = core.step(now)
            end = res.end
            if res.duration == 0.0 and not res.events:
                # Nothing schedulable (cannot happen with a consistent core); skip to the
                # next timeout rather than spinning.
                end = max(now, deadlines[0][0]) if deadlines else now
        else:
            end = deadlines[0][0] if deadlines else now
            res = None
        if check:
            core.check_invariants()
        finished_ok: list[tuple[str, float]] = []
        if res is not None:
            for ev in res.events:
                st = live.get(ev.request_id)
                if st is None:
                    continue
                if ev.kind is EventKind.TOKENS and st[3] < 0:
                    st[3] = ev.time
                elif ev.kind is EventKind.FINISHED:
                    if ev.time <= st[1]:
                        finished_ok.append((ev.request_id, ev.time))
                        completed += 1
                        prompt_done += ev.prompt_tokens
                        gen_done += ev.completion_tokens
                        latencies.append(ev.time - st[0])
                        ttfts.append(st[3] - st[0])
                        if ev.completion_tokens > 1 and ev.time > st[3]:
                            decode_rates.append((ev.completion_tokens - 1) / (ev.time - st[3]))
                        last_outcome = max(last_outcome, ev.time)
                    else:  # finished after the client had gone
                        timed_out += 1
                        last_outcome = max(last_outcome, st[1])
                        finished_ok.append((ev.request_id, st[1]))
        for rid, t in finished_ok:
            del live[rid]
            if pending:
                send(t, end)
        # Client disconnects up to the end of this step.
        while deadlines and deadlines[0][0] <= end:
            dl, rid = heapq.heappop(deadlines)
            if rid not in live:
                continue
            del live[rid]
            core.abort(rid, end)
            timed_out += 1
            last_outcome = max(last_outcome, dl)
            if pending:
                send(dl, end)
        now = end
    wall = last_outcome
    st = core.stats()
    return RunReport(
        concurrency=concurrency,
        timeout_s=timeout_s,
        requests=len(items),
        completed=completed,
        timed_out=timed_out,
        wall_time=wall,
        prompt_tokens=prompt_done,
        generated_tokens=gen_done,
        tokens_per_s=(prompt_done + gen_done) / wall if wall > 0 else 0.0,
        generated_tokens_per_s=gen_done / wall if wall > 0 else 0.0,
        p50_latency=_quantile(latencies, 0.5),
        p99_latency=_quantile(latencies, 0.99),
        max_latency=max(latencies) if latencies else float("nan"),
        mean_ttft=statistics.fmean(ttfts) if ttfts else float("nan"),
        mean_decode_tps=statistics.fmean(decode_rates) if decode_rates else float("nan"),
        preemptions=st.num_preemptions,
        steps=core.total_steps,
        prefill_tokens_computed=core.total_prefill_tokens,
        useful_prefill_fraction=prompt_done / core.total_prefill_tokens
        if core.total_prefill_tokens
        else 0.0,
    )


@dataclass(slots=True)
class DecodeMeasurement:
    batch: int
    per_user_tps: float  # mean over requests of (tokens after the first) / decode time
    aggregate_tps: float  # batch x per-user rate
    mean_step_s: float


def measure_decode(
    profile_or_core: Profile | EngineCore | str,
    batch: int,
    *,
    prompt_tokens: int = 512,
    output_tokens: int = 256,
    workload: Workload = Workload.CHAT,
    seed: int = 0,
    flavor: Flavor | None = None,
    speculative: bool | None = None,
) -> DecodeMeasurement:
    """Start `batch` identical-length requests at once; measure steady decode rates.

    Outputs are fixed (`ignore_eos`), so all requests decode together after their
    prefill; the rate excludes the first token (TTFT), as per-user ITL-based rates do.
    """
    core = _core(profile_or_core, seed=seed, flavor=flavor, speculative=speculative)
    for it in synthetic_items(batch, prompt_tokens, output_tokens, workload, prefix=f"dec{batch}"):
        core.add_request(
            SimRequest(
                it.request_id,
                it.prompt_token_ids,
                output_tokens,
                workload=workload,
                ignore_eos=True,
            ),
            0.0,
        )
    first: dict[str, float] = {}
    rates: list[float] = []
    now = 0.0
    decode_steps = 0
    decode_time = 0.0
    while core.has_work():
        res = core.step(now)
        if res.num_prefill_tokens == 0:
            decode_steps += 1
            decode_time += res.duration
        for ev in res.events:
            if ev.kind is EventKind.TOKENS:
                first.setdefault(ev.request_id, ev.time)
            elif ev.kind is EventKind.FINISHED and ev.completion_tokens > 1:
                rates.append((ev.completion_tokens - 1) / (ev.time - first[ev.request_id]))
        now = res.end
    per_user = statistics.fmean(rates)
    return DecodeMeasurement(
        batch,
        per_user,
        per_user * batch,
        decode_time / decode_steps if decode_steps else float("nan"),
    )


def measure_ttft(
    profile_or_core: Profile | EngineCore | str,
    prompt_tokens: int = 100,
    *,
    seed: int = 0,
    flavor: Flavor | None = None,
) -> float:
    """Time to first token of one request on an idle replica (prefill of the prompt)."""
    core = _core(profile_or_core, seed=seed, flavor=flavor, speculative=False)
    it = synthetic_items(1, prompt_tokens, 1, prefix="ttft")[0]
    core.add_request(SimRequest(it.request_id, it.prompt_token_ids, 1, ignore_eos=True), 0.0)
    now = 0.0
    while core.has_work():
        res = core.step(now)
        for ev in res.events:
            if ev.kind is EventKind.TOKENS:
                return ev.time
        now = res.end
    raise RuntimeError("request produced no token")
