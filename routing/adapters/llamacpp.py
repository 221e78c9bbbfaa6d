"""llama.cpp server adapter: ``/props`` for context and slots, ``/v1/models`` for ids.

llama.cpp holds one KV cache of ``n_ctx`` cells shared by ``total_slots`` parallel slots,
so the pool is ``n_ctx`` tokens and the running cap is the slot count. ``/props`` reports
the context a slot may use as ``default_generation_settings.n_ctx`` (the request limit);
some builds also report the whole cache as a top-level ``n_ctx``, which then wins as the
pool. When only the per-slot figure is given it is taken as the pool: that is exact for
current builds, whose slots share one unified cache (a slot may use all of it), and it
under-states, never over-states, the pool of older builds that split ``n_ctx`` evenly
across slots (pin the pool in config for those). Cells are per token: block size 1.
"""

from __future__ import annotations

from routing.adapters._common import Responses, apply_models, as_int, ok_body, parse_json
from routing.types import ReplicaState


class LlamaCppAdapter:
    engine = "llamacpp"
    probe_paths: tuple[str, ...] = ("/props", "/v1/models")

    def apply(self, state: ReplicaState, responses: Responses, now: float) -> None:
        state.updated_at = now
        models_ok = apply_models(state, ok_body(responses, "/v1/models"))
        props = parse_json(ok_body(responses, "/props"))
        props_ok = isinstance(props, dict)
        if isinstance(props, dict):
            slots = as_int(props.get("total_slots")) or 1
            settings = props.get("default_generation_settings")
            per_slot = as_int(settings.get("n_ctx")) if isinstance(settings, dict) else None
            whole = as_int(props.get("n_ctx"))
            pool = whole if whole is not None else per_slot
            if pool is not None:
                state.capacity_tokens = pool
                state.max_model_len = per_slot if per_slot is not None else pool
            state.max_running = slots
            state.block_size = 1
        state.ready = models_ok and props_ok and state.capacity_tokens is not None
