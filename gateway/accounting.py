"""The account stage: what an ended request teaches and counts.

`Accounting.account` runs in the pipeline's ``finally`` on every path: it teaches the
token estimator from the engine's usage, settles the tenant's rate charge (corrected
to the usage, or refunded when the request was never admitted), counts the outcome,
tokens, latencies and the tenant's SLO attainment, and writes the access line.
`completion` is what the ended request says about its replica's load, for the learned
limit (`AdmissionDoor.request_ended`); `attempt_end` what it says of its client.

Latencies are measured on the event loop's clock: TTFT from arrival (what the client
waited) for metrics and SLOs, from admission (what the replica took) for the learned
limit; ITL is `inter_token_latency`, the one formula every reader uses.
"""

from __future__ import annotations

from collections.abc import Callable

from admission.fit import sized_exactly
from admission.learned.estimate import TokenEstimator
from admission.learned.patience import ClientEnd, stream_end
from admission.tenants import TenantLimiter, TenantState
from admission.types import AttemptEnd, Completion
from gateway.context import RequestContext
from gateway.logging import access_log_enabled, log_access
from gateway.metrics import GatewayMetrics
from gateway.outcome import CLIENT_DISCONNECT, OK, UPSTREAM_TIMEOUT

# Upstream failures that say the replica could not serve its load: the learned limit
# hears of them (a refused connection or a dropped one says the replica is down, not full).
_LOAD_FAILURES = frozenset({"timeout", "stream_error", "status_5xx"})
# A client that leaves this close to the timeout it declared left because of it.
_BUDGET_SPENT = 0.9


def inter_token_latency(ctx: RequestContext) -> float | None:
    """The mean gap between a response's events after the first, or None when there is
    no gap to measure (fewer than two events, or no first byte)."""
    first, last = ctx.first_byte_at, ctx.last_event_at
    if ctx.events < 2 or first is None or last is None:
        return None
    return (last - first) / (ctx.events - 1)


def completion(ctx: RequestContext, now: float) -> Completion | None:
    """What an ended request says about its replica's load, or None when it says
    nothing (never admitted, client gone, errors that are not about load)."""
    if ctx.admitted_at is None:
        return None
    budget = ctx.latency_budget
    if ctx.outcome != OK:
        if ctx.upstream_error in _LOAD_FAILURES or ctx.outcome == UPSTREAM_TIMEOUT:
            # The replica failed it: slow, or (llama.cpp) out of KV mid-stream.
            return Completion(ok=False, latency_budget=budget)
        if (
            ctx.outcome == CLIENT_DISCONNECT
            and budget is not None
            and now - ctx.arrival >= _BUDGET_SPENT * budget
        ):
            # The client left at the timeout it declared: the replica failed it, unless
            # the queue took most of it (admission/learning.py reads the service it got).
            return Completion(ok=False, service_s=now - ctx.admitted_at, latency_budget=budget)
        return None
    ttft = itl = None
    if ctx.req.stream and ctx.first_byte_at is not None:
        ttft = ctx.first_byte_at - ctx.admitted_at
        itl = inter_token_latency(ctx)
    return Completion(
        ok=True,
        service_s=now - ctx.admitted_at,
        ttft_s=ttft,
        itl_s=itl,
        prompt_tokens=ctx.usage_prompt if ctx.usage_prompt is not None else ctx.req.prompt_tokens,
        completion_tokens=_completion_tokens(ctx),
        latency_budget=budget,
    )


def client_left(ctx: RequestContext) -> bool | None:
    """Whether an ended request's client left before its answer ended (True) or stayed to
    the end (False); None: it ended in a way that says neither (refused, cut by shutdown,
    a client that stopped reading)."""
    if ctx.cut or ctx.admission_id is None:
        return None
    if ctx.outcome == CLIENT_DISCONNECT:
        return True
    if ctx.outcome.client_stayed:
        return False
    return None


def patience_seen(ctx: RequestContext, now: float) -> ClientEnd | None:
    """What an ended request says of its client's patience (admission/learned/patience.py), or
    None: it stated its timeout, or ended in a way that says nothing of it (refused, cut
    by shutdown, a client that stopped reading)."""
    if ctx.patience_stated:
        return None
    left = client_left(ctx)
    if left is None:
        return None
    # A client that left left when its connection was lost: its handler may learn of it
    # tens of milliseconds later on a busy loop, which is kvgate's wait, not the client's.
    left_at = min(ctx.left_at, now) if left and ctx.left_at is not None else None
    end_at = now if left_at is None else left_at
    waited = end_at - ctx.arrival
    if not ctx.req.stream:
        return ClientEnd(waited, left, left_at=left_at)
    first = None if ctx.first_byte_at is None else ctx.first_byte_at - ctx.arrival
    last = ctx.last_event_at if ctx.last_event_at is not None else ctx.arrival
    quiet = max(0.0, end_at - last)
    return stream_end(waited, left, first, quiet, inter_token_latency(ctx), left_at)


def attempt_end(ctx: RequestContext, now: float) -> AttemptEnd:
    """What an ended attempt tells admission of its client and its prompt's cache: left
    before an answer began, left or stayed (`client_left`), its clients' patience
    (`patience_seen`), the prompt tokens its engine held cached (its usage)."""
    cached, chars_per_token = None, 0.0
    if ctx.usage_cached is not None and ctx.usage_prompt and ctx.prompt_chars:
        cached, chars_per_token = ctx.usage_cached, ctx.prompt_chars / ctx.usage_prompt
    return AttemptEnd(
        ctx.req,
        ctx.arrival,
        unanswered=ctx.left_unanswered,
        left=client_left(ctx),
        patience=patience_seen(ctx, now),
        cached_tokens=cached,
        chars_per_token=chars_per_token,
    )


def _completion_tokens(ctx: RequestContext) -> int:
    """The engine's count of generated tokens, else the relay's own."""
    return ctx.usage_completion if ctx.usage_completion is not None else ctx.generated


class Accounting:
    """The account stage and what it writes to: the estimator, the tenants' charges and
    SLO counters, the request metrics and the access log."""

    def __init__(
        self,
        estimator: TokenEstimator,
        tenants: TenantLimiter,
        metrics: GatewayMetrics,
        known_models: set[str],
        route_of: Callable[[str], str | None] | None = None,
    ) -> None:
        # How admission's router placed a request ("<workload>/<scoring>/<reason>"),
        # for the access line; read before the release forgets it.
        self.route_of = route_of
        self.estimator = estimator
        self.tenants = tenants
        self.metrics = metrics
        # The models some replica serves (discovery fills the set in place); any other
        # name is counted as "_unknown", so clients cannot grow the label set.
        self.known_models = known_models

    def account(self, ctx: RequestContext, now: float) -> None:
        """Learn from the engine's usage, count the outcome, write the access line."""
        model_label = ctx.req.model if ctx.req.model in self.known_models else "_unknown"
        if ctx.usage_prompt is not None and ctx.prefix is not None:
            # The engine's count of the whole prompt: the next turn's counted prefix
            # (gateway/prefixcount.py).
            ctx.prefix.learn(ctx.usage_prompt)
        if ctx.outcome == OK:
            self._learn(ctx)
        self._account_tenant(ctx, now)
        m = self.metrics
        m.count_request(model_label, ctx.outcome.label, ctx.kind)
        m.count_workload(ctx.req.workload, ctx.outcome.label)
        ttft = None
        if ctx.first_byte_at is not None:
            ttft = ctx.first_byte_at - ctx.arrival
            m.ttft.observe(ttft)
            m.observe_workload_ttft(ctx.req.workload, ttft)
            if (itl := inter_token_latency(ctx)) is not None:
                m.itl.observe(itl)
        if access_log_enabled():  # the line is built only when someone reads it
            fields = _access_fields(ctx, ttft, now)
            if self.route_of is not None and ctx.admission_id is not None:
                fields["route"] = self.route_of(ctx.admission_id)
            log_access(fields)

    def _learn(self, ctx: RequestContext) -> None:
        """Teach the estimator a completed request's true prompt and output tokens, and
        what its reservation, if estimated, missed."""
        r = ctx.req
        estimated_prompt = (
            not r.prompt_exact
            and ctx.prompt_countable
            and bool(ctx.prompt_chars)
            and not self.estimator.has_tokenizer(r.model)
        )
        # The estimated part: the whole prompt, or the messages after a prefix the engine
        # had counted (gateway/prefixcount.py), whose count is known.
        chars, messages, counted = ctx.prompt_chars, ctx.num_messages, 0
        p = ctx.prefix
        if p is not None and p.counted:
            chars, messages, counted = p.tail_chars, p.tail_messages, p.tokens
        # What the estimator would reserve for this prompt now, before it learns from it:
        # a miss of an estimate it has since corrected says nothing of the next
        # reservation, and neither does one made before it learned the model's
        # characters per token (the cold guess, which the cold margin covers).
        learned = self.estimator.most_chars_per_token(r.model) is not None
        prompt = (
            counted + self.estimator.prompt_tokens(r.model, chars, messages)
            if estimated_prompt
            else r.prompt_tokens
        )
        if ctx.usage_prompt is not None:
            self.metrics.observe_prompt_estimate(r.prompt_tokens, ctx.usage_prompt, r.prompt_exact)
            if estimated_prompt and ctx.usage_prompt > counted:
                # It learns what it estimates: a tail's characters per token, when the
                # rest was counted.
                self.estimator.observe_prompt(r.model, chars, messages, ctx.usage_prompt - counted)
        if ctx.usage_completion is not None:
            self.estimator.observe_output(r.model, ctx.usage_completion)
        estimated = not sized_exactly(
            r.prompt_exact, r.expected_output, r.max_tokens, r.max_tokens_given
        )
        if (
            estimated
            and (learned or not estimated_prompt)
            and ctx.usage_prompt is not None
            and ctx.usage_completion is not None
        ):
            # What the estimate reserved against what the engine says was used: the
            # margin estimated reservations keep (admission.learned.margin).
            self.estimator.observe_estimated(
                r.model, prompt + r.expected_output, ctx.usage_prompt + ctx.usage_completion
            )
            self.metrics.set_estimate_margin(r.model, self.estimator.margin(r.model))

    def _account_tenant(self, ctx: RequestContext, now: float) -> None:
        """Settle the rate charge (the engine's usage, or a refund if never admitted) and
        count the tenant's outcome, tokens and SLO attainment."""
        charge = ctx.rate_charge
        if charge is not None:
            if ctx.admitted_at is None:
                self.tenants.refund(charge, now)
            elif ctx.usage_prompt is not None or ctx.usage_completion is not None:
                true = (ctx.usage_prompt or 0) + (ctx.usage_completion or 0)
                self.tenants.correct(charge, true, now)
        m = self.metrics
        tenant = ctx.req.tenant
        m.tenant_request(tenant, ctx.outcome.label)
        if ctx.usage_prompt is not None:
            m.tenant_tokens(tenant, "prompt", ctx.usage_prompt)
        if completion_tokens := _completion_tokens(ctx):
            m.tenant_tokens(tenant, "completion", completion_tokens)
        policy = self.tenants.tenants.get(tenant)
        if policy is None or (
            policy.ttft_s is None and policy.itl_s is None and policy.e2e_s is None
        ):
            return
        ok = ctx.outcome == OK
        if not ok and ctx.status < 500:
            return  # the client's own error or limit: not a latency the gateway missed
        _slo(m, policy, ctx, ok, now)


def _slo(m: GatewayMetrics, policy: TenantState, ctx: RequestContext, ok: bool, now: float) -> None:
    """Count the request against each of its tenant's targets it can be judged on (TTFT
    and ITL: streams; end to end: all): a failed request (5xx, shed) misses them."""
    tenant = ctx.req.tenant
    if policy.e2e_s is not None:
        m.tenant_slo(tenant, "e2e", ok and now - ctx.arrival <= policy.e2e_s)
    if policy.ttft_s is not None and ctx.req.stream:
        ttft = ctx.first_byte_at - ctx.arrival if ctx.first_byte_at is not None else None
        m.tenant_slo(tenant, "ttft", ok and ttft is not None and ttft <= policy.ttft_s)
    if policy.itl_s is not None and ctx.req.stream:
        itl = inter_token_latency(ctx)
        if ok and itl is None:
            return  # one event: no gap to judge
        m.tenant_slo(tenant, "itl", ok and itl is not None and itl <= policy.itl_s)


def _access_fields(ctx: RequestContext, ttft: float | None, now: float) -> dict[str, object]:
    completion_tokens = _completion_tokens(ctx)
    return {
        "request_id": ctx.request_id,
        "tenant": ctx.req.tenant,
        "model": ctx.req.model or None,
        "kind": ctx.kind,
        "stream": ctx.req.stream,
        "workload": ctx.req.workload,
        "replica": ctx.replica,
        "outcome": ctx.outcome.label,
        "status": ctx.status,
        "prompt_tokens": ctx.usage_prompt,
        "prompt_tokens_est": ctx.req.prompt_tokens or None,
        "completion_tokens": completion_tokens or None,
        "reserved_tokens": ctx.reserved or None,
        "queue_wait_s": round(ctx.admitted_at - ctx.arrival, 6) if ctx.admitted_at else None,
        "ttft_s": round(ttft, 6) if ttft is not None else None,
        "duration_s": round(now - ctx.arrival, 6),
        "attempts": ctx.attempts + 1,
    }
