"""The OpenAI error objects of the requests kvgate turns away before sending them on:
a tenant's rate limit, a shed (429 for the tenant's own concurrency or queue cap, else
503 with the capacity wording), and admission's refusals.

429s are worded as OpenAI words its own (``rate_limit_exceeded``, the limit, what was
used and requested, "Please try again in" a Go duration) so clients that parse them work.
"""

from __future__ import annotations

import math

from admission.tenants import TenantState
from admission.types import Refuse, Shed
from gateway import outcome as ends
from gateway.context import RequestContext
from gateway.errors import ApiError
from gateway.ratelimit import go_duration


def model_not_found(model: str) -> ApiError:
    """The 404 of a model the key may not use or no replica serves, as OpenAI words it."""
    return ApiError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        code="model_not_found",
        param="model",
        outcome=ends.denied("model_not_found"),
    )


def rate_limited(policy: TenantState, limit: str, tokens: int, wait: float, now: float) -> ApiError:
    """The 429 of a requests- or tokens-per-minute limit, worded as OpenAI words it."""
    g = policy.rpm if limit == "requests" else policy.tpm
    assert g is not None
    label = "requests per min (RPM)" if limit == "requests" else "tokens per min (TPM)"
    cap = g.total  # the tenant's limit, across every gateway process (gateway.ratelimit)
    requested = 1 if limit == "requests" else tokens
    if not math.isfinite(wait):
        return ApiError(
            429,
            f"Request too large for tenant {policy.name} on {label}: Limit {cap}, "
            f"Requested {requested}. Reduce the prompt or max_tokens.",
            code="rate_limit_exceeded",
            param=None,
            outcome=ends.rate_limited(limit),
        )
    left = g.fleet_remaining(now)
    shared = ""
    if left >= requested:  # the tenant has room, but not this process's leased share
        shared = (
            f" The budget is shared by several gateway processes and this one's share "
            f"({math.floor(g.limit)}) is in use until its lease grows."
        )
    return ApiError(
        429,
        f"Rate limit reached for tenant {policy.name} on {label}: Limit {cap}, Used "
        f"{cap - left}, Requested {requested}.{shared} Please try again in "
        f"{go_duration(wait)}.",
        code="rate_limit_exceeded",
        retry_after=wait,
        outcome=ends.rate_limited(limit),
    )


# Which ceiling keeps a shed request out (admission.binding), in words.
_BINDS = {
    "kv_pool": "are at KV capacity",
    "kv_share": "are at KV capacity for this gateway process (its leased slice of the pool)",
    "running_learned": (
        "are at the running limit kvgate learned for them (their KV pool has room)"
    ),
    "running_cap": "are at their running-request cap (max_running; their KV pool has room)",
    "running_share": (
        "are at this gateway process's leased share of their running limit (their KV pool has room)"
    ),
    "running_deadlines": (
        "are running requests that one more would slow past their clients' deadlines"
    ),
    "tenant_concurrency": "are busy with as many of this tenant's requests as it may run",
    "queue": "have a queue ahead longer than this request can wait for",
    "no_replica": "are not ready",
}


# Sheds that say a replica is down or not yet known, not full (a 503 all the same).
_NOT_READY = {
    "no_replica_ready": "No replica serving `{model}` is ready (down, starting or ejected)",
    "models_unknown": (
        "The model `{model}` is not served by any replica known so far, and some replica "
        "has not answered its first probe yet"
    ),
}


def tenant_limit(shed: Shed) -> str:
    """Which of its tenant's caps a 429 shed hit (the ``limit`` label of its metric)."""
    return "concurrency" if shed.reason == "tenant_concurrency" else "queue"


def shed_error(shed: Shed, ctx: RequestContext, policy: TenantState) -> ApiError:
    """The answer of a shed request: a 429 naming the tenant's cap, else a 503."""
    if shed.status == 429:
        tenant = ctx.req.tenant
        if tenant_limit(shed) == "concurrency":
            what = (
                f"Concurrency limit reached for tenant {tenant}: "
                f"{policy.max_concurrent} requests running (max_concurrent) and "
                f"{policy.max_queued} queued (max_queued)."
            )
        else:
            what = (
                f"Queue limit reached for tenant {tenant}: {policy.max_queued} "
                "requests already waiting (max_queued)."
            )
        return ApiError(
            429,
            f"{what} Please try again in {go_duration(shed.retry_after)}.",
            code="rate_limit_exceeded",
            retry_after=shed.retry_after,
            outcome=ends.shed(shed.reason),
        )
    if shed.reason in _NOT_READY:
        return ApiError(
            shed.status,
            f"{_NOT_READY[shed.reason].format(model=ctx.req.model)}; "
            f"retry after {max(1, math.ceil(shed.retry_after))} s.",
            code=shed.reason,
            retry_after=shed.retry_after,
            outcome=ends.shed(shed.reason),
        )
    why = _BINDS.get(shed.binds, "are at capacity")
    return ApiError(
        shed.status,
        f"All replicas serving {ctx.req.model} {why} ({shed.reason}); "
        f"retry after {max(1, math.ceil(shed.retry_after))} s.",
        code="overloaded",
        retry_after=shed.retry_after,
        outcome=ends.shed(shed.reason),
    )


def refusal_message(r: Refuse) -> str:
    """A refusal in words, as OpenAI and vLLM put them (clients match on them)."""
    if r.reason == "unknown_model":
        return f"The model `{r.model}` does not exist."
    if r.reason == "no_room_to_generate":
        return (
            f"This model's maximum context length is {r.limit} tokens. However, "
            f"your prompt has {r.prompt_tokens} tokens, which leaves no room for "
            "the completion. Please reduce the length of the prompt."
        )
    if r.reason == "over_context":
        return (
            f"This model's maximum context length is {r.limit} tokens. However, "
            f"you requested {r.prompt_tokens + r.max_tokens} tokens ({r.prompt_tokens} in "
            f"the messages, {r.max_tokens} in the completion). Please reduce the length of "
            "the messages or completion."
        )
    need = max(1, r.prompt_tokens) + max(0, r.expected_output)  # as the ledger counts it
    return (
        f"This request needs about {need} tokens of KV cache ({r.prompt_tokens} "
        f"prompt + {r.expected_output} output), more than the largest replica "
        f"pool serving `{r.model}` admits ({r.limit} tokens)."
    )


# The body field that holds a prompt, per endpoint.
_PROMPT_PARAM = {
    "chat": "messages",
    "messages": "messages",
    "responses": "input",
    "completion": "prompt",
}


def refused_error(refuse: Refuse, ctx: RequestContext) -> ApiError:
    """The answer of a request admission refused (it can never fit, no such model)."""
    return ApiError(
        refuse.status,
        refusal_message(refuse),
        code=refuse.code,
        param="model" if refuse.code == "model_not_found" else _PROMPT_PARAM[ctx.kind],
        outcome=ends.denied(refuse.code),
    )
