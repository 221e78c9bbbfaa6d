"""Hardware x model x engine profiles for the simulator, as validated YAML.

A profile holds the physical numbers the roofline step-time model needs (peak FLOPs,
HBM bandwidth, interconnect, parameter counts, KV bytes per token) and the engine
settings a real deployment would pass on its command line (block size, memory
utilisation, max_model_len, max_num_seqs, max_num_batched_tokens). The KV pool size is
derived from memory the way vLLM derives it at start-up (memory x utilisation - weights
- activation reserve, divided by KV bytes per token), unless a measured value is pinned.

A profile YAML may say `extends: <other profile>`; it is deep-merged over its base, so a
speculation-enabled variant only states what differs. Validation errors name the field
(`engine.block_size: Input should be greater than 0`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from enginesim.types import Flavor, Workload

PROFILE_DIR = Path(__file__).with_name("profiles")
GIB = 1024**3


class ProfileError(ValueError):
    """A profile could not be found, parsed or validated; the message names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HardwareSpec(_Strict):
    """The accelerators of one replica (all GPUs of one engine instance)."""

    name: str
    num_gpus: int = Field(1, ge=1)
    memory_gib: float = Field(gt=0, description="HBM per GPU as the engine sees it, GiB")
    peak_tflops: float = Field(
        gt=0, description="dense tensor-core peak per GPU at the compute dtype"
    )
    hbm_gbps: float = Field(gt=0, description="HBM bandwidth per GPU, GB/s")
    interconnect_gbps: float = Field(0.0, ge=0, description="per-GPU collective bandwidth, GB/s")
    collective_latency_us: float = Field(0.0, ge=0, description="latency of one collective op")


class MoESpec(_Strict):
    num_experts: int = Field(ge=1)
    experts_per_token: int = Field(ge=1)
    expert_params_b: float = Field(
        gt=0, description="routed-expert parameters, all layers, billions"
    )

    @model_validator(mode="after")
    def _k_le_e(self) -> MoESpec:
        if self.experts_per_token > self.num_experts:
            raise ValueError("experts_per_token must not exceed num_experts")
        return self


class ModelSpec(_Strict):
    name: str
    params_b: float = Field(gt=0, description="total parameters, billions")
    num_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    weight_bytes_per_param: float = Field(gt=0, description="average stored bytes per parameter")
    # KV bytes per token: given directly (MLA, exotic layouts) or from the GQA shape.
    kv_bytes_per_token: int | None = Field(None, gt=0)
    num_kv_heads: int | None = Field(None, ge=1)
    head_dim: int | None = Field(None, ge=1)
    kv_dtype_bytes: float = Field(2.0, gt=0)
    moe: MoESpec | None = None

    @model_validator(mode="after")
    def _kv_known(self) -> ModelSpec:
        if self.kv_bytes_per_token is None and (self.num_kv_heads is None or self.head_dim is None):
            raise ValueError("give kv_bytes_per_token or both num_kv_heads and head_dim")
        if self.moe is not None and self.moe.expert_params_b >= self.params_b:
            raise ValueError("moe.expert_params_b must be below params_b")
        return self

    @property
    def kv_bytes(self) -> int:
        if self.kv_bytes_per_token is not None:
            return self.kv_bytes_per_token
        assert self.num_kv_heads is not None and self.head_dim is not None
        return int(2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes)

    @property
    def weight_bytes(self) -> float:
        return self.params_b * 1e9 * self.weight_bytes_per_param

    @property
    def dense_params(self) -> float:
        """Parameters every token uses (all of them for a dense model)."""
        return self.params_b * 1e9 - (self.moe.expert_params_b * 1e9 if self.moe else 0.0)

    @property
    def active_params(self) -> float:
        if self.moe is None:
            return self.params_b * 1e9
        m = self.moe
        return self.dense_params + m.expert_params_b * 1e9 * m.experts_per_token / m.num_experts


class EngineSpec(_Strict):
    """Engine launch settings (vLLM / SGLang / llama.cpp command-line equivalents)."""

    flavor: Flavor = Flavor.VLLM
    block_size: int = Field(16, ge=1, le=1024)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    activation_reserve_gib: float = Field(
        1.0, ge=0, description="per GPU: activations, CUDA graphs, workspace"
    )
    pool_tokens: int | None = Field(None, ge=1, description="pin the measured KV pool (tokens)")
    max_model_len: int = Field(ge=2)
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    enable_prefix_caching: bool = True
    # llama.cpp shape: pool_tokens is n_ctx, max_num_seqs the slot count (n_parallel),
    # max_num_batched_tokens n_batch, max_model_len the model's trained context. Without
    # kv_unified each slot owns n_ctx / slots cells; with it all slots share the pool.
    kv_unified: bool = False
    # llama.cpp's host-RAM prompt cache (--cache-ram, MiB): 0 turns it off, -1 no limit.
    cache_ram_mib: int = Field(8192, ge=-1)
    # SGLang shape: the reservation ratio for max_new_tokens of running requests.
    init_new_token_ratio: float = Field(0.7, gt=0, le=1)
    min_new_token_ratio: float = Field(0.1, gt=0, le=1)
    new_token_ratio_decay_steps: int = Field(600, ge=1)


class PerfSpec(_Strict):
    """Efficiency factors and fixed costs of the roofline step-time model.

    They stand for how far real kernels sit below the hardware peaks; they are profile
    data, not code, and each profile's YAML comments say where its values come from.
    """

    step_overhead_ms: float = Field(
        2.0, ge=0, description="scheduler, sampling, launch gaps per step"
    )
    seq_overhead_ms: float = Field(
        0.0, ge=0, description="host work per sequence in a step (sampling, output processing)"
    )
    compute_efficiency: float = Field(
        0.5, gt=0, le=1, description="achieved / peak FLOPs for GEMMs"
    )
    memory_efficiency: float = Field(0.8, gt=0, le=1, description="achieved / peak HBM bandwidth")
    expert_memory_efficiency: float | None = Field(
        None, gt=0, le=1, description="effective bandwidth efficiency of routed-expert reads"
    )
    expert_load_imbalance: float = Field(1.0, ge=1, description="slowest EP rank / mean rank")
    collectives_per_layer: float = Field(
        0.0, ge=0, description="TP all-reduce or EP all-to-all ops per layer"
    )
    comm_bytes_per_token_per_collective: float | None = Field(
        None, ge=0, description="default hidden_size*2"
    )
    attention_flops: bool = True


class SpeculativeSpec(_Strict):
    """A draft-and-verify setup (EAGLE-style head or a small draft model)."""

    enabled: bool = True
    num_draft_tokens: int = Field(ge=1, le=16)
    draft_params_b: float = Field(gt=0, description="draft model / head parameters, billions")
    draft_weight_bytes_per_param: float = Field(2.0, gt=0)
    draft_overhead_ms: float = Field(0.3, ge=0, description="fixed cost per draft forward pass")
    # Mean tokens emitted per verification step (accepted drafts + the bonus token).
    acceptance: dict[Workload, float] = Field(
        default_factory=lambda: {Workload.CODING: 4.73, Workload.CHAT: 2.61, Workload.AGENTIC: 3.6}
    )

    @model_validator(mode="after")
    def _acceptance_range(self) -> SpeculativeSpec:
        top = self.num_draft_tokens + 1
        for w in Workload:
            if w not in self.acceptance:
                raise ValueError(f"acceptance missing workload {w.value!r}")
            v = self.acceptance[w]
            if not 1.0 <= v < top:
                raise ValueError(
                    f"acceptance[{w.value}]={v} must be in [1, num_draft_tokens+1={top})"
                )
        return self


class OutputSpec(_Strict):
    """Natural (EOS) output lengths when a request does not state one: lognormal."""

    median: dict[Workload, int] = Field(
        default_factory=lambda: {Workload.CODING: 350, Workload.CHAT: 220, Workload.AGENTIC: 120}
    )
    sigma: float = Field(0.6, gt=0)


class Profile(_Strict):
    name: str
    served_model_name: str
    description: str = ""
    hardware: HardwareSpec
    model: ModelSpec
    engine: EngineSpec
    perf: PerfSpec = PerfSpec()
    speculative: SpeculativeSpec | None = None
    natural_output: OutputSpec = OutputSpec()

    @model_validator(mode="after")
    def _pool_fits(self) -> Profile:
        pool = self.pool_tokens
        if pool < self.engine.block_size:
            raise ValueError(
                f"engine: KV pool of {pool} tokens is below one block; weights "
                f"({self.model.weight_bytes / GIB:.1f} GiB) do not leave room for KV cache"
            )
        if self.engine.max_model_len > pool:
            raise ValueError(
                f"engine.max_model_len ({self.engine.max_model_len}) exceeds the KV pool "
                f"({pool} tokens): one sequence of that length could never run"
            )
        return self

    # -- derived capacity ---------------------------------------------------------------
    @property
    def flavor(self) -> Flavor:
        return self.engine.flavor

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes

    @property
    def pool_tokens(self) -> int:
        """KV pool in tokens, rounded down to whole blocks."""
        e = self.engine
        if e.pool_tokens is not None:
            raw = e.pool_tokens
        else:
            hw = self.hardware
            budget = (
                hw.num_gpus
                * (hw.memory_gib * e.gpu_memory_utilization - e.activation_reserve_gib)
                * GIB
            )
            raw = max(0, math.floor((budget - self.model.weight_bytes) / self.model.kv_bytes))
        return raw // e.block_size * e.block_size

    @property
    def block_size(self) -> int:
        return self.engine.block_size

    @property
    def num_gpu_blocks(self) -> int:
        return self.pool_tokens // self.engine.block_size

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.engine.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        return self.engine.max_num_batched_tokens


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _resolve(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    return PROFILE_DIR / f"{name_or_path}.yaml"


def _load_raw(name_or_path: str, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    path = _resolve(name_or_path)
    if not path.is_file():
        raise ProfileError(
            f"profile {name_or_path!r} not found (bundled: {', '.join(list_profiles())})"
        )
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ProfileError(f"profile {path}: invalid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ProfileError(f"profile {path}: top level must be a mapping")
    base = data.pop("extends", None)
    if base is not None:
        if base in seen:
            raise ProfileError(f"profile {path}: extends: cycle through {base!r}")
        data = _deep_merge(_load_raw(str(base), (*seen, str(base))), data)
    return data


def profile_from_dict(data: dict[str, Any], source: str = "<dict>") -> Profile:
    """Validate a profile mapping; errors name the field (`engine.block_size: ...`)."""
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        msgs = []
        for err in exc.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "<root>"
            msgs.append(f"{loc}: {err['msg']}")
        raise ProfileError(f"profile {source}: " + "; ".join(msgs)) from exc


def load_profile(name_or_path: str) -> Profile:
    """A bundled profile by name (enginesim/profiles/<name>.yaml) or a YAML file path."""
    data = _load_raw(name_or_path)
    data.setdefault("name", Path(name_or_path).stem)
    return profile_from_dict(data, name_or_path)


def list_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))
