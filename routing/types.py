"""Replica view and routing types shared by routing, admission and the gateway shell."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ReplicaState:
    """What kvgate knows of one replica, kept current by an engine adapter.

    Only engine adapters (`routing/adapters/*`) know engine metric names; they map what an
    engine reports onto this structure.
    """

    name: str
    base_url: str
    engine: str = "vllm"  # vllm | sglang | llamacpp | openai
    labels: dict[str, str] = field(default_factory=dict)
    ready: bool = False
    models: list[str] = field(default_factory=list)
    # Capacity as discovered from the engine (None until known); a pinned config value wins.
    capacity_tokens: int | None = None
    block_size: int = 16
    max_model_len: int | None = None
    max_running: int | None = None
    # What the engine does when more is admitted than its pool holds (set by the adapter).
    # True: it preempts (vLLM recomputes, SGLang retracts), so a request may be reserved
    # at a learned estimate of its output and topped up as it grows. False: an
    # over-admitted pool is an error (llama.cpp), so a request is reserved at the most it
    # may use: prompt + max_tokens, within its slot's context (`max_model_len`).
    preempts: bool = True
    # Each running request owns a private slot of `max_model_len` tokens (llama.cpp's
    # per-slot KV): the pool cannot be overrun, so admission keeps no headroom in it.
    private_slots: bool = False
    # Live load as the engine reports it.
    engine_running: int = 0
    engine_waiting: int = 0
    kv_usage: float = 0.0
    preemptions_total: float = 0.0
    # When the discovery round began (the engine's answers describe it after that).
    updated_at: float = 0.0
    # `updated_at` of the last round whose answers included the engine's running gauge
    # (`engine_running`); None for an engine that reports none.
    running_seen_at: float | None = None


@dataclass(slots=True, frozen=True)
class Candidate:
    """A replica that passed the filters for one request, with its current headroom."""

    name: str
    free_tokens: int  # effective capacity minus reserved, in tokens
    effective_capacity: int
    running: int
    max_running: int | None
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class RouteRequest:
    """What the picker may know about a request."""

    request_id: str
    model: str
    need_tokens: int
    workload: str = "chat"
