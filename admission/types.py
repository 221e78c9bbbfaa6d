"""Public types of the sans-IO admission core.

The gateway shell builds an `AdmissionRequest`, calls `AdmissionController.submit(req, now)`
and acts on the verdict. Every method takes `now` (seconds, any monotonic origin); the
controller never reads a clock, sleeps or does IO.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class AdmissionRequest:
    request_id: str
    model: str
    prompt_tokens: int  # estimated (or exact) prompt tokens
    expected_output: int  # output tokens to reserve: min(max_tokens, learned quantile)
    max_tokens: int  # declared output bound (for the never-fits check)
    tenant: str = "default"
    priority: int = 0  # higher is served first
    arrival: float = 0.0
    deadline: float = float("inf")  # absolute time by which it must be admitted
    workload: str = "chat"


@dataclass(slots=True, frozen=True)
class Admit:
    request_id: str
    replica: str
    reserved_tokens: int  # block-rounded tokens now held for the request on that replica


@dataclass(slots=True, frozen=True)
class Queued:
    request_id: str
    position: int
    estimated_wait: float  # seconds


@dataclass(slots=True, frozen=True)
class Shed:
    """Refused for now: 503 (overload) or 429 (tenant limit) with Retry-After."""

    request_id: str
    reason: str  # queue_full | deadline | queue_timeout | no_replica | rate_limited ...
    retry_after: float  # seconds, honest estimate of when capacity frees
    status: int = 503


@dataclass(slots=True, frozen=True)
class Refuse:
    """Can never be served: 400 (context_length_exceeded) or 404 (unknown model)."""

    request_id: str
    status: int
    code: str  # context_length_exceeded | model_not_found
    message: str


Verdict = Admit | Queued | Shed | Refuse


@dataclass(slots=True)
class ReplicaUsage:
    """Per-replica ledger snapshot for metrics and /admin/replicas."""

    name: str
    ready: bool
    capacity_tokens: int
    effective_capacity_tokens: int
    reserved_tokens: int
    running: int
    max_running: int | None
    binding_ceiling: str  # "none" | "kv_capacity" | "running_cap" | "not_ready"
    models: list[str] = field(default_factory=list)
