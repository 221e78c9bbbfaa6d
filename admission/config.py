"""Validated settings of the admission core.

Every setting a user may set is a pydantic field so a YAML config is checked at start-up
with errors that name the offending field (``extra="forbid"`` catches typos such as
``headrom``). The algorithms' internals (windows, sample counts, quantiles, step sizes)
are constants beside the code that uses them.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


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
    queue_max_per_model: int | None = Field(
        None,
        ge=0,
        description=(
            "Bounded queue length per model. Unset (the default): as many requests as the "
            "model's replicas run at once, at least 256 (admission/shedding.py)."
        ),
    )
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
    default_output_tokens: int = Field(
        1024,
        ge=1,
        description="Output reserved before any completion was observed when max_tokens is absent.",
    )
    per_message_overhead_tokens: int = Field(
        8, ge=0, description="Chat-template tokens added per message (role markers, separators)."
    )
    retry_memory_s: float = Field(
        120.0,
        ge=0.0,
        description="How long an unserved request's first arrival (shed, or its client left "
        "before an answer) is remembered, so its retry "
        "keeps its place in line (0 disables; keep above max_retry_after_s).",
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
    itl_memory_s: float = Field(
        60.0,
        gt=0.0,
        description="How long a stream's inter-token gap stays evidence for the per-replica "
        "ITL model that places requests with an ITL target (admission/learned/itl.py).",
    )
