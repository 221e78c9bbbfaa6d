"""Replica view and routing types shared by routing, admission and the gateway shell."""

from __future__ import annotations

from collections.abc import Sequence
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
    # The LoRA adapters among `models`, each with the base model it runs on (vLLM lists
    # an adapter in /v1/models with ``parent`` naming its base). An adapter shares its
    # base's KV pool and context (`max_model_len`): it is a model routed by name only.
    adapters: dict[str, str] = field(default_factory=dict)
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
    # Running requests with a common prompt prefix hold one copy of its KV (vLLM prefix
    # caching, SGLang's radix cache): admission counts a shared prefix once.
    shares_prefix: bool = False
    # Live load as the engine reports it.
    engine_running: int = 0
    engine_waiting: int = 0
    kv_usage: float = 0.0
    preemptions_total: float = 0.0
    # Prefix cache and speculation counters (cumulative, in tokens), None where the engine
    # exports none.
    prefix_cache_queries_total: float | None = None
    prefix_cache_hits_total: float | None = None
    spec_draft_tokens_total: float | None = None
    spec_accepted_tokens_total: float | None = None
    # One engine rank of a data-parallel server (vLLM's `engine` metric label): the
    # adapter reads only that rank's metrics. None: the whole server.
    dp_rank: int | None = None
    # Speculative decoding as the engine says (None: the engine does not say): on or off,
    # drafts proposed per step, verification steps so far (vLLM's counter), and the mean
    # tokens emitted per verification step where the engine exports it directly (SGLang).
    speculative: bool | None = None
    spec_num_draft_tokens: int | None = None
    spec_drafts_total: float | None = None
    spec_accept_length: float | None = None
    # The engine's inter-token latency histogram (cumulative sum in seconds and count),
    # None where it exports none: with the acceptance it gives the step time.
    itl_sum_s: float | None = None
    itl_count: float | None = None
    # True where the histogram is observed once per request per engine step, however many
    # tokens the step emitted (vLLM: several when speculating): its mean is then the step
    # time itself. False: once per token (the step time is the mean x the acceptance).
    itl_per_step: bool = False
    # When the discovery round began (the engine's answers describe it after that).
    updated_at: float = 0.0
    # `updated_at` of the last round whose answers included the engine's running gauge
    # (`engine_running`); None for an engine that reports none.
    running_seen_at: float | None = None


@dataclass(slots=True)
class Candidate:
    """A replica that can take the request now: admission's ledger view of it, and a
    reference to the engine's own (`engine`, the adapter's `ReplicaState`, never copied).

    The ledger fields (free_tokens, running, max_running: the learned limit within the
    cap) are admission's own and always current. The engine gauges (``engine.kv_usage``,
    ``engine.engine_waiting``, the prefix and speculation counters) come from the last
    discovery round, ``view_age_s`` seconds old at decision time; routing penalises a
    stale view but never reads it as free room (the ledger decides whether it fits).
    Admission keeps one Candidate per replica and refreshes it in place, so a plugin must
    not keep a reference across calls (keep the name).
    """

    name: str
    free_tokens: int  # effective capacity minus reserved, in tokens
    effective_capacity: int
    running: int
    max_running: int | None  # the learned limit within the cap (None: unbounded)
    labels: dict[str, str] = field(default_factory=dict)
    block_size: int = 16
    # The engine's own view of this replica, as of `view_age_s` ago.
    engine: ReplicaState = field(default_factory=lambda: ReplicaState("", ""))
    # Speculation: the replica's ``speculative`` label ("true"/"false") when configured,
    # else what the engine says (False when it says nothing); see ReplicaState.
    speculative: bool = False
    view_age_s: float = 0.0
    # Admission's prediction of this replica's mean inter-token gap with the request
    # added (seconds), None before it has evidence; an SLO filter holds it against
    # `RouteRequest.itl_target_s`.
    predicted_itl_s: float | None = None


@dataclass(slots=True)
class RouteRequest:
    """What the routing pipeline may know about a request.

    One object per request, built once by the gateway and referenced, never copied:
    admission's `AdmissionRequest` extends it, and admission sets `need_tokens` (the KV
    need on the replicas being weighed) and `now` (the decision time) before each
    decision. A plugin reads it during a call and must not keep it across calls.

    `prefix_hashes` is the prompt's block hash chain (routing.prefix.block_hashes),
    computed once per request by the gateway; `session` the client's session key
    (``x-session-id`` header, else the body's ``user``); `now` the decision time.
    `tenant` is the authenticated tenant; `prompt_tokens` the prompt's (estimated)
    length, for the prefill cost of its uncached part; `ttft_target_s` and
    `itl_target_s` the tenant's SLO targets (None: no target).
    """

    request_id: str
    model: str
    need_tokens: int = 0
    workload: str = "chat"
    prefix_hashes: tuple[int, ...] = ()
    session: str | None = None
    now: float = 0.0
    tenant: str = "default"
    prompt_tokens: int = 0
    ttft_target_s: float | None = None
    itl_target_s: float | None = None
    # The prompt's token ids chained in blocks of `token_block_size` (routing.kvindex),
    # when a replica of the model publishes its KV events; else empty.
    token_hashes: tuple[int, ...] = ()
    token_block_size: int = 0


class Router:
    """Where a request goes, among replicas admission found able to take it now.

    A policy subclasses this and overrides `pick`; every other member is a hook with a
    no-op default, so admission and the gateway call them without asking whether a
    policy has them (`routing.scheduler.SchedulingRouter` is the built-in policy).

    `pick` returns one of `candidates` or None (every candidate rejected: the request
    stays queued without holding anything up). `placed` and `released` are called when
    admission reserves a replica for a request and when it frees that reservation, so a
    policy can keep state (prefix index, session table). `hints` names replicas the
    policy wants among the candidates whatever their headroom (warm prefix, session,
    speculating): admission scores a shortlist of the replicas with the most headroom
    plus these, not the whole fleet. `warm` names replicas expected to hold part of the
    prompt cached, with those tokens, warmest first: admission weighs waiting for a full
    warm replica against a cold start now by expected time to first token. The gateway
    reports a request's first token (`first_token`) and the prompt tokens its engine
    had cached (`prompt_cached`), and reads which profile placed a request (`route_of`)
    and the decision counters it exports (`decision_counts`, `route_decision_counts`).
    """

    # The policy reads the request's prompt prefix block hashes (computed only then).
    needs_prefix: bool = False

    def pick(self, req: RouteRequest, candidates: Sequence[Candidate]) -> Candidate | None:
        raise NotImplementedError

    def placed(self, req: RouteRequest, candidate: Candidate, now: float) -> None:
        return None

    def released(self, request_id: str, replica: str, now: float) -> None:
        return None

    def hints(self, req: RouteRequest) -> list[str]:
        return []

    def warm(self, req: RouteRequest) -> list[tuple[str, int]]:
        return []

    def first_token(self, request_id: str, now: float) -> None:
        return None

    def prompt_cached(
        self, request_id: str, cached: int, chars_per_token: float, now: float
    ) -> None:
        return None

    def route_of(self, request_id: str) -> str | None:
        """The profile that placed a running request (None: not known)."""
        return None

    def decision_counts(self) -> dict[str, int]:
        """Decisions by how they were made (kvgate_routing_decisions_total)."""
        return {}

    def route_decision_counts(self) -> dict[tuple[str, str], int]:
        """Decisions by (workload, the profile's scoring) (kvgate_route_decisions_total)."""
        return {}
