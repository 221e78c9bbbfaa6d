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
    # Live load as the engine reports it.
    engine_running: int = 0
    engine_waiting: int = 0
    kv_usage: float = 0.0
    preemptions_total: float = 0.0
    updated_at: float = 0.0


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
