"""Public data types of the sans-IO engine core.

The core (`enginesim.core.EngineCore`) is a synchronous state machine on a virtual clock.
Drivers (the live aiohttp server, the virtual-time simulator used by calibration and tests)
own time: they call `add_request`/`abort` with `now`, then `step(now)`, which plans one
engine step that starts at `now`, and returns its duration and the events that happen at
its end (`now + duration`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Workload(enum.StrEnum):
    """Workload class of a request; drives speculative acceptance and default lengths."""

    CODING = "coding"
    AGENTIC = "agentic"
    CHAT = "chat"


class Flavor(enum.StrEnum):
    """Which engine's scheduler and metric names the simulator imitates."""

    VLLM = "vllm"
    SGLANG = "sglang"
    LLAMACPP = "llamacpp"


@dataclass(slots=True)
class SimRequest:
    """One request as the engine sees it (already tokenized)."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    workload: Workload = Workload.CHAT
    # Number of tokens the model "wants" to generate before EOS. None: the core draws a
    # natural length for the workload from its seeded RNG. The effective output length is
    # min(max_tokens, output_len) unless ignore_eos, in which case it is max_tokens.
    output_len: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: int = 0
    # The LoRA adapter the request names (None: the base model): its KV blocks are its
    # own, so its prefix cache hash chain is seeded with this name (enginesim.lora).
    lora_name: str | None = None
    # A pooling request (/v1/embeddings): it takes its prompt's KV while prefilled and
    # finishes when the prefill does, generating nothing (`max_tokens` is 0).
    prefill_only: bool = False


class EventKind(enum.StrEnum):
    TOKENS = "tokens"  # one or more new tokens for a request (more than one with speculation)
    FINISHED = "finished"  # request completed (finish_reason "stop" or "length")
    PREEMPTED = "preempted"  # request lost its KV blocks and went back to waiting
    ABORTED = "aborted"  # request removed by abort()
    STARTED = "started"  # llama.cpp: a slot took the request and began its prompt
    FAILED = "failed"  # llama.cpp: the engine ended the request with an error (`error`)


@dataclass(slots=True, frozen=True)
class EngineError:
    """An error the engine answers a request with, in llama.cpp's terms.

    `status` is the HTTP status and the body's numeric `code`; `type` the error type
    string (`exceed_context_size_error`, `server_error`, ...). `n_prompt_tokens` and
    `n_ctx` are set for `exceed_context_size_error` only, as llama.cpp adds them.
    """

    status: int
    type: str
    message: str
    n_prompt_tokens: int | None = None
    n_ctx: int | None = None


@dataclass(slots=True, frozen=True)
class SlotTimings:
    """A request's timings as llama.cpp reports them (`timings` in its responses)."""

    cache_n: int
    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float


@dataclass(slots=True)
class EngineEvent:
    kind: EventKind
    request_id: str
    time: float
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    # Filled on FINISHED (and on ABORTED): the usage the engine would report.
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: EngineError | None = None  # on FAILED
    slot: int | None = None  # llama.cpp: the slot that served the request
    timings: SlotTimings | None = None  # llama.cpp: on FINISHED and FAILED


@dataclass(slots=True)
class StepResult:
    start: float
    duration: float  # seconds of virtual time the step takes; 0.0 when there was nothing to do
    events: list[EngineEvent]
    num_running: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    @property
    def end(self) -> float:
        return self.start + self.duration


@dataclass(slots=True)
class EngineStats:
    """Counters and gauges the metrics endpoint exposes (monotonic counters never reset)."""

    num_running: int = 0
    num_waiting: int = 0
    num_gpu_blocks: int = 0
    null_blocks: int = 0  # never given to a request (vLLM V1 keeps one)
    block_size: int = 16
    enable_prefix_caching: bool = True
    blocks_in_use: int = 0  # blocks referenced by at least one request
    cached_free_blocks: int = 0  # blocks held only by the prefix cache (evictable)
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # tokens found
    prompt_tokens: int = (
        0  # prompt tokens of finished requests' prefills (counted once per prefill)
    )
    generation_tokens: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # accepted drafts by position (0 = the first draft of a step), one entry per draft
    # slot: vLLM's per-position counter, whose positions say how many it drafts
    spec_accepted_per_pos: tuple[int, ...] = ()
    num_finished: int = 0
    num_aborted: int = 0

    @property
    def kv_usage(self) -> float:
        usable = self.num_gpu_blocks - self.null_blocks  # as vLLM divides it
        return self.blocks_in_use / usable if usable > 0 else 0.0


@dataclass(slots=True)
class LlamaCppStats(EngineStats):
    """llama.cpp's server metrics on top of the common stats (block size 1: KV cells).

    `blocks_in_use` counts the cells of slots processing a request, `cached_free_blocks`
    the cells idle slots keep as their prompt cache; `num_waiting` is the deferred tasks.
    Counters follow llama.cpp's `server_metrics` (seconds, not microseconds); the two
    buckets are what the throughput gauges average over, reset at every scrape.
    """

    num_slots: int = 0
    slot_n_ctx: int = 0
    kv_unified: bool = False
    prompt_tokens_processed: int = 0  # prompt tokens computed, cached ones excluded
    prompt_tokens_cached: int = 0  # prompt tokens reused from a slot's cache
    prompt_seconds: float = 0.0
    tokens_predicted: int = 0
    tokens_predicted_seconds: float = 0.0
    n_decode: int = 0
    n_busy_slots: int = 0  # summed over decode calls
    n_tokens_max: int = 0  # largest sequence a slot has held (prompt + generation)
    prompt_bucket_tokens: int = 0
    prompt_bucket_seconds: float = 0.0
    predict_bucket_steps: int = 0
    predict_bucket_seconds: float = 0.0
    num_failed: int = 0
