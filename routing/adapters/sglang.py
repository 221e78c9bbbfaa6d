"""SGLang adapter: ``/server_info`` for pool and limits, ``/metrics`` for load, ``/v1/models``.

``/server_info`` merges the server arguments (``context_length``, ``page_size``,
``max_running_requests``: often null when left to the engine) with the scheduler's
figures (``max_total_num_tokens``, the token pool). Recent releases also nest scheduler
state under ``internal_states``; both places are read. ``sglang:max_total_num_tokens``
in ``/metrics`` is a fallback for the pool size.

Reservations: SGLang preempts (``preempts`` True): its scheduler reserves by
``new_token_ratio`` and retracts running requests when decode runs out of room, so, as
with vLLM, admission may reserve a learned quantile of the output with top-ups, and the
learned running limit watches the retractions (``sglang:num_retracted_reqs_total``).

Speculation: ``/server_info`` carries the server arguments ``speculative_algorithm``
(null when off; EAGLE, EAGLE3, NEXTN, STANDALONE... when on) and
``speculative_num_draft_tokens`` (positions verified per step: drafts + 1); ``sglang:spec_accept_length`` in ``/metrics`` is the
mean tokens emitted per verification step (0 before any).
"""

from __future__ import annotations

from typing import Any

from routing.adapters._common import (
    LoadMetrics,
    Responses,
    apply_load,
    apply_models,
    as_int,
    ok_body,
    parse_json,
    parse_prometheus,
    total,
)
from routing.types import ReplicaState


def _lookup(info: dict[str, Any], key: str) -> int | None:
    value = as_int(info.get(key))
    if value is not None:
        return value
    states = info.get("internal_states")
    if isinstance(states, list):
        for inner in states:
            if isinstance(inner, dict) and (value := as_int(inner.get(key))) is not None:
                return value
    return None


_LOAD = LoadMetrics(
    running=("sglang:num_running_reqs",),
    waiting=("sglang:num_queue_reqs",),
    usage=("sglang:token_usage",),
    preemptions=("sglang:num_retracted_reqs_total",),
    itl=("sglang:inter_token_latency_seconds",),
)
_ACCEPT_LENGTH = "sglang:spec_accept_length"
_POOL_TOKENS = "sglang:max_total_num_tokens"
# Every sample this adapter reads: the rest of /metrics is not parsed.
_READ = _LOAD.read(_ACCEPT_LENGTH, _POOL_TOKENS)


class SGLangAdapter:
    engine = "sglang"
    probe_paths: tuple[str, ...] = ("/server_info", "/metrics", "/v1/models")
    missing_capacity = (
        "no max_total_num_tokens in /server_info or /metrics: is this SGLang? (engine: sglang)"
    )

    def apply(self, state: ReplicaState, responses: Responses, now: float) -> None:
        state.updated_at = now
        state.preempts = True
        models_ok = apply_models(state, ok_body(responses, "/v1/models"))
        info = parse_json(ok_body(responses, "/server_info"))
        info_ok = isinstance(info, dict)
        if isinstance(info, dict):
            pool = _lookup(info, "max_total_num_tokens")
            if pool is not None:
                state.capacity_tokens = pool
            running_cap = _lookup(info, "max_running_requests")
            if running_cap is not None:
                state.max_running = running_cap
            page = _lookup(info, "page_size")
            state.block_size = page if page is not None else 1
            context = _lookup(info, "context_length")
            if context is not None:
                state.max_model_len = context
            # The radix cache shares a common prefix between running requests, unless
            # the server runs with --disable-radix-cache.
            state.shares_prefix = info.get("disable_radix_cache") is False
            algo = info.get("speculative_algorithm")
            state.speculative = isinstance(algo, str) and algo.upper() not in ("", "NONE")
            # SGLang counts the positions verified per step (drafts + the bonus token).
            verified = _lookup(info, "speculative_num_draft_tokens")
            state.spec_num_draft_tokens = (
                verified - 1
                if state.speculative and verified is not None and verified > 1
                else None
            )
        samples = parse_prometheus(ok_body(responses, "/metrics"), _READ)
        metrics_ok = samples is not None
        if samples is not None:
            if state.capacity_tokens is None:
                pool_metric = total(samples, _POOL_TOKENS)
                if pool_metric:
                    state.capacity_tokens = int(pool_metric)
            apply_load(state, samples, _LOAD)
            accept = total(samples, _ACCEPT_LENGTH)
            state.spec_accept_length = accept if accept is not None and accept >= 1.0 else None
        state.ready = models_ok and info_ok and metrics_ok and state.capacity_tokens is not None
