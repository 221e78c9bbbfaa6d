"""Generic OpenAI-compatible adapter: only ``/v1/models`` is standard.

Nothing in the OpenAI API reveals a KV pool, so capacity (and any running cap) must be
pinned in the replica's config; the admission controller routes nothing to a replica
whose capacity is unknown. Readiness here means only that the model list answered.

Reservations: what the server does with an over-admitted pool is unknown; ``preempts``
keeps its default (True), so requests are reserved as for vLLM (learned output quantile,
topped up). For a llama.cpp server, use ``engine: llamacpp``, which reserves the worst
case. There is no running gauge, so a request abandoned mid-flight keeps its reservation
for the whole ``admission.abandoned_hold_s``.
"""

from __future__ import annotations

from routing.adapters._common import Responses, apply_models, ok_body
from routing.types import ReplicaState


class OpenAIAdapter:
    engine = "openai"
    probe_paths: tuple[str, ...] = ("/v1/models",)
    missing_capacity = "an openai server reports no KV pool: set pool_tokens"

    def apply(self, state: ReplicaState, responses: Responses, now: float) -> None:
        state.updated_at = now
        state.ready = apply_models(state, ok_body(responses, "/v1/models"))
