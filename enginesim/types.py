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


class EventKind(enum.StrEnum):
    TOKENS = "tokens"  # one or more new tokens for a request (more than one with speculation)
    FINISHED = "finished"  # request completed (finish_reason "stop" or "length")
    PREEMPTED = "preempted"  # request lost its KV blocks and went back to waiting
    ABORTED = "aborted"  # request removed by abort()


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
    block_size: int = 16
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
    num_finished: int = 0
    num_aborted: int = 0

    @property
    def kv_usage(self) -> float:
        return self.blocks_in_use / self.num_gpu_blocks if self.num_gpu_blocks else 0.0
