"""Per-request state carried through the pipeline stages.

Each stage reads what earlier stages filled in and adds its own part; the account and
release stages at the end read all of it. `admission_request` is what admission is told
of a request (at its first admission and at a retry's), `RequestContext.admitted` what
an admission writes back. A plain slotted dataclass: one allocation per
request, attribute access without dict lookups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from admission.tenants import TenantState
from admission.types import AdmissionRequest, Admit
from gateway.schemas import ChatCompletionRequest, CompletionRequest

Kind = Literal["chat", "completion"]


@dataclass(slots=True)
class RequestContext:
    request_id: str
    kind: Kind
    upstream_path: str
    arrival: float
    tenant: str = "default"
    # The tenant's default workload class (tenants[].default_workload), set by
    # authenticate; classify uses it when the request has no x-workload header.
    tenant_default_workload: str | None = None
    priority: int = 0  # x-kvgate-priority clamped to the tenant's range (tenant_limits)
    rate_charge: Any = None  # admission.tenants.Charge: refunded or corrected at the end
    # parse
    raw: bytes = b""
    body: dict[str, Any] | None = None
    parsed: ChatCompletionRequest | CompletionRequest | None = None
    model: str = ""
    stream: bool = False
    client_wants_usage: bool = False
    # estimate
    prompt_chars: int = 0
    num_messages: int = 1
    prompt_exact: bool = False
    # False when the prompt has parts a character count cannot describe (images, audio):
    # its usage must not teach the estimator's chars-per-token.
    prompt_countable: bool = True
    prompt_tokens: int = 0
    max_tokens: int = 0
    max_tokens_given: bool = True  # False: the client set no output bound
    expected_output: int = 0
    # classify
    workload: str = "chat"
    # route (routing.types.RouteRequest): prompt block hash chain, session key
    prefix_hashes: tuple[int, ...] = ()
    prefix_block_tokens: int = 0  # AdmissionRequest.prefix_block_tokens
    token_hashes: tuple[int, ...] = ()  # AdmissionRequest.token_hashes (gateway/kvevents.py)
    token_block_size: int = 0
    session: str | None = None
    # admit
    deadline: float = float("inf")
    # The client's own timeout (x-stainless-read-timeout); once admitted, the budget it
    # was admitted under (that, or its clients' learned patience: admission/patience.py).
    latency_budget: float | None = None
    patience_stated: bool = False  # the client said how long it waits (a header)
    last_retry: bool = False
    retry_key: int | None = None  # digest of (tenant, model, body): the same request retried
    admission_id: str | None = None
    replica: str | None = None
    reserved: int = 0
    admitted_at: float | None = None
    attempts: int = 0
    # The replicas that failed this request: its retry is never placed on them.
    avoid: frozenset[str] = frozenset()
    # (replica, failure kind) of an error answer that awaits the retry's outcome: charged
    # to that replica (outlier ejection) only if another one then completes the request.
    unjudged: tuple[str, str] | None = None
    # relay
    first_byte_at: float | None = None
    last_event_at: float | None = None
    events: int = 0
    generated: int = 0
    topup_at: int = 0
    usage_prompt: int | None = None
    usage_completion: int | None = None
    usage_cached: int | None = None  # prompt_tokens_details.cached_tokens: its prefix hit
    upstream_error: str | None = None  # failure kind once the stream had started
    done_seen: bool = False  # the engine's ``data: [DONE]`` was among the events relayed
    # A non-stream request kvgate stopped waiting for (client gone, timeout) while the
    # engine had it: the engine may still be generating it (its reservation is held).
    upstream_abandoned: bool = False
    # The client stream once the relay has started it (a graceful shutdown ends it with
    # an error event), and whether shutdown cut this request.
    client_stream: Any = None
    cut: bool = False
    # outcome
    status: int = 0
    outcome: str = "unknown"

    def admitted(self, a: Admit, now: float) -> None:
        """Record the admission `a` (the first, or a retry's on another replica)."""
        self.admission_id = a.request_id
        self.replica = a.replica
        self.reserved = a.reserved_tokens
        self.topup_at = a.reserved_tokens
        self.admitted_at = now


def admission_request(
    ctx: RequestContext,
    rid: str,
    *,
    arrival: float,
    deadline: float,
    priority: int = 0,
    targets: TenantState | None = None,
) -> AdmissionRequest:
    """What admission needs to know of a request, from its context."""
    ttft_target = targets.ttft_s if targets is not None else None
    itl_target = targets.itl_s if targets is not None else None
    return AdmissionRequest(
        request_id=rid,
        model=ctx.model,
        prompt_tokens=ctx.prompt_tokens,
        expected_output=ctx.expected_output,
        max_tokens=ctx.max_tokens,
        tenant=ctx.tenant,
        priority=priority,
        arrival=arrival,
        deadline=deadline,
        workload=ctx.workload,
        prompt_exact=ctx.prompt_exact,
        last_retry=ctx.last_retry,
        latency_budget=ctx.latency_budget,
        stream=ctx.stream,
        retry_key=ctx.retry_key,
        max_tokens_given=ctx.max_tokens_given,
        prefix_hashes=ctx.prefix_hashes,
        prefix_block_tokens=ctx.prefix_block_tokens,
        token_hashes=ctx.token_hashes,
        token_block_size=ctx.token_block_size,
        session=ctx.session,
        ttft_target_s=ttft_target,
        itl_target_s=itl_target,
        avoid=ctx.avoid,
    )
