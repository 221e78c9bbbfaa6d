"""Validated settings of the admission core.

Every knob is a pydantic field so a YAML config is checked at start-up with errors that
name the offending field (``extra="forbid"`` catches typos such as ``headrom``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Settings that were removed with the rule they tuned: a config that still sets one is
# told so by name, rather than with "unknown field".
REMOVED = {
    "knee_efficiency": "the goodput knee is no longer fitted (docs/admission.md)",
}


class LatencyTargets(BaseModel):
    """Latency targets in seconds, any left out: a model's (``admission.latency_targets``,
    which bound its replicas' learned limit) and a tenant's (``tenants[].slo``, measured
    as attainment; its ITL target also places requests)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft_s: float | None = Field(None, gt=0.0, description="Time to first token.")
    itl_s: float | None = Field(
        None,
        gt=0.0,
        description="Mean inter-token latency: 1 / the per-user decode rate (0.2 = 5 tokens/s).",
    )
    e2e_s: float | None = Field(
        None,
        gt=0.0,
        description="The whole request: a model's from its admission, a tenant's from its "
        "arrival, to the end of the answer.",
    )


class AdmissionConfig(BaseModel):
    """Admission policy: pool headroom, the bounded queue, estimators and Retry-After."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _no_removed_settings(cls, data: Any) -> Any:
        removed = sorted(set(data) & set(REMOVED)) if isinstance(data, dict) else []
        if removed:
            name = removed[0]
            raise ValueError(f"{name} was removed: {REMOVED[name]}; delete the setting")
        return data

    headroom: float = Field(
        0.05,
        ge=0.0,
        lt=1.0,
        description=(
            "Margin of a reservation resting on an estimated prompt count or output (it "
            "reserves size / (1 - margin)) until the model's estimates were seen to miss "
            "(admission/learned/margin.py); one of known size keeps none."
        ),
    )
    queue_max_per_model: int = Field(256, ge=0, description="Bounded queue length per model.")
    queue_timeout_s: float | None = Field(
        None,
        gt=0.0,
        description=(
            "Queue deadline of a request whose client states none and whose clients' "
            "patience is not learned yet; also caps x-kvgate-queue-timeout. Unset (the "
            "default): such a request waits until it starts or its client leaves; a "
            "deadline nobody states is not assumed."
        ),
    )
    default_max_running: int | None = Field(
        None,
        ge=1,
        description="Per-replica running-request cap when neither config nor engine gives one.",
    )
    output_quantile: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description="Quantile of observed completion lengths reserved as expected output.",
    )
    initial_chars_per_token: float = Field(
        3.0,
        gt=0.0,
        description="Chars per token assumed before learning; low means tokens are over-estimated.",
    )
    min_drain_samples: int = Field(
        4,
        ge=1,
        description="Releases seen on a model's replicas before the drain rate is trusted.",
    )
    max_retry_after_s: float = Field(60.0, ge=1.0, description="Upper clamp of Retry-After.")
    min_retry_after_s: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Lower clamp of the retry delay, lowered further (never under 10 ms) to "
        "the time between two releases of the model's replicas and to half the client's own "
        "timeout when those are shorter. The Retry-After header is whole seconds (at least "
        "1); retry-after-ms, which the openai SDKs read first, carries the finer value.",
    )
    # --- additions beyond the documented API (all have defaults) ---
    default_output_tokens: int = Field(
        1024,
        ge=1,
        description="Output reserved before any completion was observed when max_tokens is absent.",
    )
    per_message_overhead_tokens: int = Field(
        8, ge=0, description="Chat-template tokens added per message (role markers, separators)."
    )
    min_output_samples: int = Field(
        20,
        ge=1,
        description="Completions observed before the learned quantile replaces max_tokens.",
    )
    min_prompt_samples: int = Field(
        5, ge=1, description="Prompts observed before the learned chars-per-token is used."
    )
    prompt_quantile: float = Field(
        0.1,
        gt=0.0,
        lt=1.0,
        description="Low quantile of observed chars-per-token (low => conservative token counts).",
    )
    max_chars_per_token_growth: float = Field(
        0.1,
        gt=0.0,
        description="Largest relative rise of chars-per-token per observation (no abrupt optimism).",
    )
    estimator_window: int = Field(
        1000, ge=10, description="Recent observations kept per model by the estimators."
    )
    drain_window_s: float = Field(
        20.0, gt=0.0, description="Time constant (busy seconds) of the drain-rate EWMA."
    )
    retry_memory_s: float = Field(
        120.0,
        ge=0.0,
        description="How long an unserved request's first arrival (shed, or its client left "
        "before an answer) is remembered, so its retry "
        "keeps its place in line (0 disables; keep above max_retry_after_s).",
    )
    retry_memory_entries: int = Field(
        100_000, ge=0, description="Most unserved requests remembered at once (oldest dropped)."
    )
    learn_limit: bool = Field(
        True,
        description="Learn each replica's running limit from latency, goodput and the "
        "engine's own signals (admission/learned/limit.py). Caps from config or the engine stay "
        "upper bounds.",
    )
    initial_limit: float = Field(
        2.0, ge=1.0, description="Running limit of a replica before anything was measured."
    )
    limit_window: int = Field(
        16, ge=2, description="Completions (at least the limit) per measurement window."
    )
    latency_budget_fraction: float = Field(
        0.6,
        gt=0.0,
        le=1.0,
        description="Share of a client's timeout (stated, or its learned patience) the "
        "learned limit lets a window's slowest request's service take (aimed at from 15% "
        "inside); a queued request waits while its predicted service still fits the rest.",
    )
    latency_target_quantile: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="Quantile of a window's requests held to the latency targets (0.5: the "
        "median user, as seed 000's per-user decode rate; 0.9 for a p90 SLO).",
    )
    limit_probe_step: float = Field(
        0.15, gt=0.0, le=1.0, description="Relative growth of the limit per busy window."
    )
    latency_targets: dict[str, LatencyTargets] = Field(
        default_factory=dict,
        description="Per-model latency targets; the key '*' applies to models not listed. "
        "Default: none, so only clients' own timeouts and goodput bound the limit.",
    )
    retry_jitter: float = Field(
        0.1,
        ge=0.0,
        lt=1.0,
        description="Retry-After is multiplied by a uniform factor in [1 - j, 1 + j] (before "
        "the clamp) so that a shed crowd does not come back in lockstep.",
    )
    abandoned_hold_s: float = Field(
        5.0,
        ge=0.0,
        description="Longest time a non-stream request kvgate stopped waiting for (client "
        "disconnect, upstream timeout) keeps its reservation while the engine may still be "
        "generating it (llama.cpp notices a gone client only after a quiet second, and on a "
        "busy server not at all). Released earlier once the engine's running gauge shows it "
        "stopped, and on an engine that preempts once twice its predicted service has "
        "passed since its admission. 0 releases at once.",
    )
    share_prefix: bool = Field(
        True,
        description="Count a prompt prefix that running requests share once per replica, "
        "as an engine with prefix caching holds it (vLLM, SGLang; admission/prefixshare.py), "
        "instead of once per request.",
    )
    prefix_settle_s: float = Field(
        2.0,
        ge=0.0,
        description="Until a replica's time to first token is learned: how long after its "
        "admission a request's prompt blocks are taken to be computed and shareable.",
    )
    itl_memory_s: float = Field(
        60.0,
        gt=0.0,
        description="How long a stream's inter-token gap stays evidence for the per-replica "
        "ITL model that places requests with an ITL target (admission/learned/itl.py).",
    )
    cold_retry_after_s: float = Field(
        5.0,
        gt=0.0,
        description="Retry-After / estimated wait used while there is no drain history "
        "(a client that stated its timeout, or whose patience was learned, is told at most "
        "half of it).",
    )
