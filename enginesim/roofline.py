"""Step time from first principles: a roofline over one engine step.

    time = overhead + seq_overhead x sequences + max(compute, memory) + comm [+ draft passes]

* seq_overhead is the host's work per sequence in the step (sampling, output processing,
  bookkeeping): what makes a tiny model's step grow with the batch on a CPU, where the
  forward pass itself is a small part of the step.

* compute = FLOPs / (peak FLOPs x efficiency), where FLOPs are 2 x active parameters per
  token in the step, plus attention: 4 x layers x hidden x (context each token attends to)
  (the quadratic prefill term falls out of summing context over a chunk's positions).
* memory = bytes read / (HBM bandwidth x efficiency). A dense model reads all its weights
  once per step whatever the batch. A mixture-of-experts model reads its dense part plus
  every distinct routed expert any token in the step touched: with E experts and k routed
  per token, n tokens touch E x (1 - (1 - k/E)^n) distinct experts per layer in
  expectation (seed 000, mechanism 2), which is why MoE batching amortises so poorly.
  Expert reads run on the expert-parallel ranks and the step waits for the slowest one
  (mechanism 3), a profile-given imbalance factor. Every running sequence's context is
  read from the KV cache once per step.
* comm = collectives per layer x layers x (latency + tokens x bytes per token through
  one GPU's link / link bandwidth) for tensor/expert-parallel deployments. The per-token
  bytes are profile data: ~3 x hidden for a ring all-reduce in bf16, and
  k x hidden x 1.5 / num_gpus for an EP all-to-all (fp8 dispatch + bf16 combine, tokens
  spread over the ranks).

All quantities are per replica (all its GPUs); peaks are multiplied by `num_gpus`.
"""

from __future__ import annotations

from dataclasses import dataclass

from enginesim.profiles import Profile


@dataclass(slots=True)
class StepShape:
    """What one engine step computes, reduced to what the roofline needs."""

    tokens: int  # positions computed this step (prefill chunk tokens + decode/verify positions)
    attended: float  # sum over computed positions of the context length each attends to
    kv_read_tokens: int  # sum over sequences in the step of the context read from the KV cache
    num_seqs: int  # sequences in the step
    draft_passes: int = 0  # speculative draft forward passes (sequential)
    draft_tokens_per_pass: int = 0  # sequences drafting (tokens per draft pass)


@dataclass(slots=True)
class StepCost:
    total: float
    compute: float
    memory: float
    comm: float
    overhead: float
    draft: float


class Roofline:
    """Precomputed constants of one profile; `cost(shape)` is a few float operations."""

    def __init__(self, profile: Profile) -> None:
        hw, m, perf = profile.hardware, profile.model, profile.perf
        self.profile = profile
        g = hw.num_gpus
        self.flops = hw.peak_tflops * 1e12 * g * perf.compute_efficiency
        self.bw = hw.hbm_gbps * 1e9 * g * perf.memory_efficiency
        expert_eff = perf.expert_memory_efficiency or perf.memory_efficiency
        self.expert_bw = hw.hbm_gbps * 1e9 * g * expert_eff / perf.expert_load_imbalance
        self.overhead = perf.step_overhead_ms / 1e3
        self.seq_overhead = perf.seq_overhead_ms / 1e3
        self.active_params = m.active_params
        self.attn_flops_per_ctx = (
            4.0 * m.num_layers * m.hidden_size if perf.attention_flops else 0.0
        )
        self.kv_bytes = m.kv_bytes
        self.dense_bytes = m.dense_params * m.weight_bytes_per_param
        if m.moe is not None:
            self.num_experts = m.moe.num_experts
            self.route_miss = 1.0 - m.moe.experts_per_token / m.moe.num_experts
            self.expert_bytes = (
                m.moe.expert_params_b * 1e9 * m.weight_bytes_per_param / m.moe.num_experts
            )
        else:
            self.num_experts = 0
            self.route_miss = 1.0
            self.expert_bytes = 0.0
        # Collectives: per step latency + per token bytes.
        n_coll = perf.collectives_per_layer * m.num_layers if g > 1 else 0.0
        self.comm_latency = n_coll * hw.collective_latency_us / 1e6
        per_tok = perf.comm_bytes_per_token_per_collective
        if per_tok is None:
            per_tok = m.hidden_size * 2.0
        link = hw.interconnect_gbps * 1e9
        self.comm_per_token = n_coll * per_tok / link if link > 0 else 0.0
        spec = profile.speculative
        if spec is not None:
            self.draft_overhead = spec.draft_overhead_ms / 1e3
            self.draft_flops_per_token = 2.0 * spec.draft_params_b * 1e9
            self.draft_bytes = spec.draft_params_b * 1e9 * spec.draft_weight_bytes_per_param
        else:
            self.draft_overhead = 0.0
            self.draft_flops_per_token = 0.0
            self.draft_bytes = 0.0

    def distinct_experts(self, tokens: int) -> float:
        """Expected distinct routed experts per layer touched by `tokens` tokens."""
        if self.num_experts == 0 or tokens <= 0:
            return 0.0
        return self.num_experts * (1.0 - self.route_miss**tokens)

    def cost(self, s: StepShape) -> StepCost:
        if s.tokens <= 0:
            return StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        compute = (
            2.0 * self.active_params * s.tokens + self.attn_flops_per_ctx * s.attended
        ) / self.flops
        memory = (self.dense_bytes + self.kv_bytes * s.kv_read_tokens) / self.bw
        if self.num_experts:
            memory += self.distinct_experts(s.tokens) * self.expert_bytes / self.expert_bw
        comm = (
            self.comm_latency + self.comm_per_token * s.tokens
            if self.comm_latency or self.comm_per_token
            else 0.0
        )
        draft = 0.0
        if s.draft_passes:
            n = s.draft_tokens_per_pass
            one = max(self.draft_flops_per_token * n / self.flops, self.draft_bytes / self.bw)
            draft = s.draft_passes * (self.draft_overhead + one)
        overhead = self.overhead + self.seq_overhead * s.num_seqs
        total = overhead + max(compute, memory) + comm + draft
        return StepCost(total, compute, memory, comm, overhead, draft)
