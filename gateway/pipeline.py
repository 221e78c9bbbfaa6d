"""The request pipeline for every endpoint that takes KV (gateway/endpoints.py: chat,
completions, the Responses and Messages APIs, the pooling endpoints): one chain of
stages; the endpoint picks the body's schema, the engine's path and the errors' dialect.

Like an Envoy filter chain, a request passes through small stages, each with one job,
in the order `Pipeline.handle` shows in one place:

    authenticate -> parse and validate -> estimate tokens -> classify -> tenant limits
    -> admit (queue or shed) -> route -> relay -> account -> release

A stage either fills in the `RequestContext` or raises `ApiError`, which becomes an
OpenAI error object. Account and release run in ``finally`` on every path, including
cancellation when the client disconnects, so a reservation can never leak.

The stages' neighbours, each in a module of its own: reading the body (gateway/body.py),
retries, failover and outlier ejection (gateway/upstream/failover.py and outliers.py), the
account stage (gateway/accounting.py), the answers of turned-away requests
(gateway/denials.py), and the requests in flight with their graceful shutdown
(gateway/shutdown.py): new and queued requests are answered 503 ``shutting_down`` once
`Pipeline.begin_shutdown` ran, running ones are cut by `Pipeline.cut_running` when the
shell's grace runs out.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Callable

from aiohttp import web

from admission.learned.estimate import TokenEstimator
from admission.retries import RetryIdentity
from admission.tenants import TenantLimiter
from admission.types import Admit, Refuse, RequestEnd, Shed
from gateway.accounting import Accounting, attempt_end, completion
from gateway.apikey import tenant_of
from gateway.body import loads, read_body
from gateway.config import GatewayConfig
from gateway.context import Kind, RequestContext
from gateway.counting import PromptCounter
from gateway.default_model import fill_model
from gateway.denials import model_not_found, rate_limited, refused_error, shed_error, tenant_limit
from gateway.door import AdmissionDoor
from gateway.endpoints import AUDIO, PASSED_HEADERS, POOLING, SCHEMAS, UPSTREAM_PATHS, dialect_of
from gateway.errors import ApiError, invalid_request
from gateway.fleet.discovery import Discovery
from gateway.http import connection_lost_at
from gateway.kvtokens import PromptTokenIds
from gateway.logging import REQUEST_ID
from gateway.metrics import GatewayMetrics
from gateway.outcome import CLIENT_DISCONNECT, INTERNAL_ERROR, OK
from gateway.schemas import (
    MAX_TOKENS_CEILING,
    BodyError,
    ChatCompletionRequest,
    CompletionRequest,
    MessagesRequest,
    PoolingRequest,
    ResponsesRequest,
    audio_form,
)
from gateway.shutdown import InFlight, shutdown_retry_after, shutting_down
from gateway.stated import H_RETRY_COUNT, read_stated, retry_identity
from gateway.stored_responses import StoredResponses, follow_up, remember_answer
from gateway.upstream.failover import Failover
from gateway.upstream.relay import Relay
from gateway.upstream.session import UpstreamFailure
from routing.classify import classify_workload
from routing.prefix import block_hashes

log = logging.getLogger("kvgate.pipeline")

# The authenticated tenant of a request (for the rate-limit headers of its answer).
TENANT_KEY = web.RequestKey("kvgate_tenant", str)

# Client headers kvgate reads (documented in docs/api.md; the deadline's: gateway/stated.py).
H_PRIORITY = "x-kvgate-priority"  # integer, higher is admitted first
H_SESSION = "x-session-id"  # session affinity key (else the body's `user`)
H_WORKLOAD = "x-workload"  # coding | agentic | chat, overrides the classifier
# The most characters per token seen in whole prompts, times this, bounds a block's
# characters per token for the shared-prefix credit (denser stretches than any prompt's
# average: a system prompt of prose next to JSON schemas).
_SHARED_CHARS_MARGIN = 1.25


class Pipeline:
    """Owns the stages and the objects they share. One instance per app."""

    def __init__(
        self,
        config: GatewayConfig,
        estimator: TokenEstimator,
        door: AdmissionDoor,
        discovery: Discovery,
        relay: Relay,
        metrics: GatewayMetrics,
        *,
        counter: PromptCounter | None = None,
        tenants: TenantLimiter | None = None,
    ) -> None:
        self.config = config
        self.report = door.report
        self.estimator = estimator
        self.door = door
        self.discovery = discovery
        self.relay = relay
        self.metrics = metrics
        # Without a session (no counter given) prompts are estimated and counted locally only.
        self.counter = counter or PromptCounter(config, estimator, discovery, door.report, metrics)
        # Tenants: hashed keys, policies, rate limits (admission/tenants.py). The plain
        # legacy keys are hashed here and not kept.
        self.tenants = tenants or TenantLimiter.from_config(config.tenants, config.auth.api_keys)
        metrics.set_tenant_names(self.tenants.tenants)
        # Set by the app when shared state is configured fail-closed (gateway/state/sharing.py):
        # returns the 503 new requests get while Redis is unreachable, else None.
        self.state_gate: Callable[[], ApiError | None] | None = None
        # Set by the app when a replica publishes KV events (gateway/kvtokens.py).
        self.prompt_token_ids: PromptTokenIds | None = None
        self._max_body = config.limits.max_body_bytes
        self._body_timeout = config.limits.body_timeout_s
        self._queue_timeout = config.admission.queue_timeout_s
        # Per-replica URL and headers: discovery's endpoints (replicas come and go).
        self._endpoints = discovery.endpoints
        # Prefix block hashes are computed once per request, only when a routing profile
        # reads them or a replica of the model counts shared prefixes once
        # (admission.prefixshare).
        routing = config.routing
        self._route_prefix = door.router.needs_prefix
        self._prefix = (
            (routing.block_chars, routing.max_prefix_blocks)
            if self._route_prefix or config.admission.share_prefix
            else None
        )
        self._ids = itertools.count(1)
        self._id_prefix = "kvg-" + os.urandom(4).hex()
        self._loop = asyncio.get_running_loop()
        self.in_flight = InFlight(config)
        self.idle = self.in_flight.idle  # set while no request is in flight
        self.accounting = Accounting(
            estimator,
            self.tenants,
            metrics,
            discovery.known_models,
            route_of=lambda rid: door.router.route_of(rid),  # a reload may replace the router
        )
        self.failover = Failover(config, door, discovery, metrics, self.tenants)
        # The outlier detector (None: disabled), read by /admin/replicas.
        self.outliers = self.failover.outliers
        # Which replica holds each stored response (the Responses API's state).
        self.stored = StoredResponses()

    # ================================================================== lifecycle
    def begin_shutdown(self) -> int:
        """Refuse new requests and shed the queued ones (503, Retry-After); returns how
        many were shed. Running requests go on."""
        self.in_flight.draining = True
        return self.door.shed_all("shutdown", shutdown_retry_after(self.config))

    def cut_running(self) -> int:
        """Cut every running request (the shutdown grace is over); returns how many."""
        return self.in_flight.cut_running()

    @property
    def draining(self) -> bool:
        return self.in_flight.draining

    @property
    def inflight(self) -> int:
        return self.in_flight.count

    def close(self) -> None:
        self.failover.close()

    # ================================================================== the chain
    async def handle(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        now = self._loop.time()
        ctx = RequestContext(
            request_id=f"{self._id_prefix}-{next(self._ids)}",
            kind=kind,
            upstream_path=request.path if kind in POOLING else UPSTREAM_PATHS[kind],
            arrival=now,
            dialect=dialect_of(kind),
        )
        task = self.in_flight.enter(ctx)
        bound = REQUEST_ID.set(ctx.request_id)  # on every log line of this request
        try:
            if self.draining:
                raise shutting_down(self.config)
            self.authenticate(request, ctx)
            await self.parse(request, ctx)
            text, tools = await self.estimate(ctx)
            # A Responses API follow-up goes where its conversation is stored.
            await follow_up(self.stored, self.discovery.watchers, ctx, self._loop.time())
            self.classify(request, ctx, text, tools)
            if self.prompt_token_ids is not None:
                await self.prompt_token_ids.fill(ctx)
            self.tenant_limits(request, ctx)
            await self.admit(request, ctx)
            return await self.route_and_relay(request, ctx)
        except ApiError as e:
            ctx.status = e.status
            ctx.outcome = e.outcome
            return e.response({"x-request-id": ctx.request_id}, ctx.dialect)
        except asyncio.CancelledError:
            if ctx.cut and task is not None:
                # Shutdown cut it (not the client): answer it cleanly.
                task.uncancel()
                return await self.in_flight.cut_answer(ctx)
            # Client went away (aiohttp cancels the handler). Upstream is closed by the
            # relay's own finally; the reservation by ours.
            ctx.status = 499
            ctx.outcome = CLIENT_DISCONNECT
            # Left before an answer: its retry keeps its place (admission/retries.py).
            ctx.left_unanswered = ctx.first_byte_at is None
            raise
        except Exception:
            log.exception("unhandled error in request %s", ctx.request_id)
            ctx.status = 500
            ctx.outcome = INTERNAL_ERROR
            return ApiError(500, "internal error in kvgate", code="internal_error").response(
                {"x-request-id": ctx.request_id}, ctx.dialect
            )
        finally:
            if ctx.outcome == CLIENT_DISCONNECT:
                ctx.left_at = connection_lost_at(request)
            try:
                self.accounting.account(ctx, self._loop.time())
            finally:
                self.release(ctx)
                self.in_flight.leave(task)
                REQUEST_ID.reset(bound)

    # ================================================================== stages
    def authenticate(self, request: web.Request, ctx: RequestContext) -> None:
        """API key -> tenant (gateway/apikey.py), and the tenant's defaults."""
        limiter = self.tenants
        tenant = tenant_of(limiter, request)
        ctx.req.tenant = tenant
        policy = limiter.get(tenant)
        ctx.tenant_default_workload = policy.default_workload
        request[TENANT_KEY] = tenant  # rate-limit headers on whatever answer follows

    async def parse(self, request: web.Request, ctx: RequestContext) -> None:
        """Read the body within the size limit and validate it."""
        raw = await read_body(request, self._max_body, self._body_timeout)
        try:  # an audio form's fields (its boundary in the header), else the JSON object
            ctype = request.headers.get("Content-Type", "")
            body = audio_form(raw, ctype) if ctx.kind in AUDIO else loads(raw)
            if not isinstance(body, dict):
                raise invalid_request("Request body must be a JSON object.")
            if ctx.kind != "messages":  # the model of a request that names none
                d = self.discovery
                raw = fill_model(body, raw, ctx.kind not in AUDIO, d.served, d.bases_of)
            parsed = SCHEMAS[ctx.kind](body)
        except BodyError as e:
            raise invalid_request(e.message, param=e.param) from None
        if isinstance(parsed, CompletionRequest) and parsed.batch_size() != 1:
            raise invalid_request(
                "kvgate admits one prompt per request; send batched prompts as separate requests.",
                param="prompt",
            )
        ctx.raw = raw
        ctx.body = body
        ctx.parsed = parsed
        ctx.req.model = parsed.model
        ctx.req.stream = parsed.stream
        ctx.client_wants_usage = parsed.wants_usage

    async def estimate(self, ctx: RequestContext) -> tuple[str, str]:
        """Prompt tokens, output tokens to reserve. Returns the prompt text for the
        classifier and the tools' schemas as rendered ("" without), for routing's prefix
        chain (both kept out of the context and logs).

        The prompt is estimated from its characters, or counted exactly where that is
        free (token ids, a local tokenizer, the engine's count of a prefix). A long uncounted
        part or a limit near costs one call to a replica's tokenize endpoint: admission
        may refuse an exact count, never an estimate."""
        counter = self.counter
        measured = counter.measure(ctx)
        self._bound_output(ctx)
        if counter.should_count(ctx, measured) and await counter.count_on_replica(ctx, measured):
            self._bound_output(ctx)
        counter.settle(ctx, measured)
        return measured.text, measured.shape.tools_text if measured.shape is not None else ""

    def _bound_output(self, ctx: RequestContext) -> None:
        """Output tokens to reserve, from history, within the context the prompt leaves."""
        assert ctx.parsed is not None
        if isinstance(ctx.parsed, PoolingRequest):  # prefill only: no output to reserve
            ctx.req.expected_output = ctx.req.max_tokens = 0
            return
        bound = ctx.parsed.output_bound
        max_len = self.discovery.max_model_len(ctx.req.model)
        limit = max(1, (max_len - ctx.req.prompt_tokens) if max_len else MAX_TOKENS_CEILING)
        # A non-stream request that asks for its whole bound (ignore_eos) or a minimum is
        # reserved, and its service predicted, for that much: a learned p90 would fall
        # short, and unlike a stream (topped up as it grows) it cannot be corrected.
        floor = 0 if ctx.req.stream else ctx.parsed.output_floor
        ctx.req.expected_output = self.estimator.expected_output(ctx.req.model, bound, limit, floor)
        # Without a client bound the engine may generate up to the context; admission's
        # never-fits check then uses what we reserve, and an engine that does not preempt
        # is reserved its whole context.
        ctx.req.max_tokens = bound if bound is not None else ctx.req.expected_output
        ctx.req.max_tokens_given = ctx.parsed.bounds_output
        ctx.req.margin = self.estimator.margin(ctx.req.model)

    def classify(
        self, request: web.Request, ctx: RequestContext, text: str, tools: str = ""
    ) -> None:
        """Workload class, and what routing reads of the prompt: its block hash chain
        (when a profile needs it) and the session key (``x-session-id``, else ``user``).
        The chain starts with the tools' schemas: the engine's template renders them
        into the prompt, and an agent's tools are as shared as its system prompt (left
        out, a warm replica's cached prefix read 1.7k tokens short of the engine's on
        bench/agentic_prefix.py, and the trade against load sent turns cold)."""
        if self._prefix is not None and (
            self._route_prefix or self.report.shares_prefix(ctx.req.model)
        ):
            ctx.req.prefix_hashes = block_hashes(
                f"{tools}\n{text}" if tools else text, *self._prefix
            )
            if ctx.req.prefix_hashes and self.config.admission.share_prefix:
                # A lower bound on the tokens of a block: the most characters per token
                # seen, with a margin for text denser than any whole prompt seen.
                most = self.estimator.most_chars_per_token(ctx.req.model)
                if most is not None:
                    ctx.req.prefix_block_tokens = int(
                        self._prefix[0] / (most * _SHARED_CHARS_MARGIN)
                    )
        session = request.headers.get(H_SESSION)
        if not session and isinstance(ctx.parsed, ResponsesRequest | MessagesRequest):
            session = ctx.parsed.session_key  # prompt_cache_key; Anthropic's user_id
        if not session and ctx.body is not None:
            user = ctx.body.get("user")
            session = user if isinstance(user, str) and user else None
        ctx.req.session = session
        parsed = ctx.parsed
        has_tools = False
        if isinstance(parsed, ChatCompletionRequest):
            has_tools = bool(parsed.tools) or any(
                m.role in ("tool", "function") for m in parsed.messages
            )
        ctx.req.workload = classify_workload(
            request.headers.get(H_WORKLOAD),
            text,
            has_tools=has_tools,
            num_messages=max(1, ctx.num_messages),
            # Set by `authenticate` from the tenant's config (None, or absent: not set).
            tenant_default=getattr(ctx, "tenant_default_workload", None),
        )

    def tenant_limits(self, request: web.Request, ctx: RequestContext) -> None:
        """The tenant's policy: the models it may use (404 as OpenAI answers a model the
        key cannot see), its priority range (``x-kvgate-priority`` clamped into it, its
        default without the header), and its requests and tokens per minute (GCRA): a
        request that would exceed one is answered 429 ``rate_limit_exceeded`` naming the
        limit, with Retry-After and retry-after-ms the exact time until it would pass.
        A passing request is charged its estimate (prompt + reserved output) now; the
        account stage corrects it to the engine's usage, or refunds it if it was never
        admitted. Concurrency and queue caps are admission's (admission.fairqueue)."""
        limiter = self.tenants
        policy = limiter.get(ctx.req.tenant)
        if not policy.may_use(ctx.req.model, self.discovery.bases_of(ctx.req.model)):
            raise model_not_found(ctx.req.model)
        asked: int | None = None
        if (p := request.headers.get(H_PRIORITY)) is not None:
            try:
                asked = int(p)
            except ValueError:
                raise invalid_request(
                    f"{H_PRIORITY} must be an integer.", param=H_PRIORITY
                ) from None
        ctx.req.priority = policy.clamp_priority(asked)
        if policy.rpm is None and policy.tpm is None:
            return
        now = self._loop.time()
        tokens = ctx.req.prompt_tokens + ctx.req.expected_output
        verdict = limiter.check(ctx.req.tenant, tokens, now)
        if verdict.limit is not None:
            self.metrics.tenant_rate_limited(ctx.req.tenant, verdict.limit)
            raise rate_limited(policy, verdict.limit, tokens, verdict.retry_after, now)
        ctx.rate_charge = limiter.charge(ctx.req.tenant, tokens, now)

    async def admit(self, request: web.Request, ctx: RequestContext) -> None:
        """Admit now, wait in the queue, or answer shed/refuse.

        The queue deadline comes from, in this order: ``x-kvgate-queue-timeout`` (capped
        by the configured queue timeout); the client's read timeout (the openai SDKs'
        ``x-stainless-read-timeout``) less the predicted service, or for a stream the
        predicted time to first token; else the patience admission learned of clients
        that say nothing (admission/learned/patience.py), until then the configured timeout, if
        any (none by default: it waits until it starts or its client leaves).
        """
        if self.state_gate is not None and (closed := self.state_gate()) is not None:
            raise closed
        now = self._loop.time()
        req = ctx.req
        cap = self.tenants.get(req.tenant).queue_timeout_s or self._queue_timeout
        req.deadline = read_stated(request, ctx, cap, now)
        ctx.admission_id = ctx.request_id
        # A retry of a request kvgate left unserved keeps its first arrival, i.e. its
        # place in line (admission/retries.py: what makes a request a retry).
        targets = self.tenants.tenants.get(req.tenant)
        req.ttft_target_s = targets.ttft_s if targets is not None else None
        req.itl_target_s = targets.itl_s if targets is not None else None
        said = H_RETRY_COUNT in request.headers
        verdict = await self._admission(ctx, retry_identity(request, ctx), said)
        if isinstance(verdict, Admit):
            assert ctx.admitted_at is not None  # an Admit went through ctx.admitted
            waited = ctx.admitted_at - ctx.arrival
            self.metrics.queue_wait.observe(waited)
            self.metrics.tenant_queue_wait(ctx.req.tenant, waited)
            return
        if isinstance(verdict, Shed):
            if verdict.reason == "shutdown":
                raise shutting_down(self.config)
            self.metrics.shed.labels(verdict.reason).inc()
            if verdict.status == 429:
                self.metrics.tenant_rate_limited(ctx.req.tenant, tenant_limit(verdict))
            raise shed_error(verdict, ctx, self.tenants.get(ctx.req.tenant))
        assert isinstance(verdict, Refuse)
        raise refused_error(verdict, ctx)

    async def _admission(
        self, ctx: RequestContext, identity: RetryIdentity | None = None, said: bool = False
    ) -> Admit | Shed | Refuse:
        """Through the door, a client's attempt (`identity`: how its retries are known)
        or a failover's retry alike: admitted now, or queued until admitted or shed. An
        admitted request is bound to its replica."""
        verdict, _queued = await self.door.admit(ctx.req, identity, said)
        if isinstance(verdict, Admit):
            ctx.admitted(verdict, self._loop.time())
            ctx.latency_budget = verdict.latency_budget  # stated, or learned
        return verdict

    async def _readmit(self, ctx: RequestContext, failed: str, f: UpstreamFailure) -> bool:
        """A failed attempt's admission given back and the request admitted once more,
        elsewhere (Failover.retry); False when it was not (its original error is then
        answered)."""
        self.release(ctx)
        self.failover.retry(ctx, failed, f.kind)
        verdict = await self._admission(ctx)
        if isinstance(verdict, Shed) and verdict.reason == "shutdown":
            raise shutting_down(self.config)
        admitted = isinstance(verdict, Admit)
        if not admitted:
            self.release(ctx)
        self.failover.retried(ctx, failed, f.kind, admitted)
        return admitted

    async def route_and_relay(
        self, request: web.Request, ctx: RequestContext
    ) -> web.StreamResponse:
        """Send to the admitted replica; on a retryable failure, once more elsewhere."""
        data = self.relay.upstream_body(ctx)
        while True:
            replica = ctx.replica
            assert replica is not None
            endpoint = self._endpoints[replica]
            headers = {**endpoint.upstream_headers, "X-Request-Id": ctx.request_id}
            headers.update((n, v) for n in PASSED_HEADERS if (v := request.headers.get(n)))
            try:
                resp = await self.relay.forward(request, ctx, endpoint.url, headers, data)
            except UpstreamFailure as f:
                if self.failover.failed(ctx, replica, f) and await self._readmit(ctx, replica, f):
                    continue  # admitted elsewhere: send it there
                raise self.failover.answer(ctx, replica, f) from None
            self.failover.answered(ctx, replica)
            if ctx.response_id is not None and ctx.outcome == OK:
                remember_answer(self.stored, ctx, replica, self._loop.time())
            return resp

    def release(self, ctx: RequestContext) -> None:
        """Tell admission how the attempt ended (what its client did, its prompt's
        cache: `attempt_end`), then free the reservation or queue entry (idempotent;
        always runs) with what the request measured about its replica. A non-stream request
        kvgate stopped waiting for while the engine had it (client gone, upstream timeout)
        may still be generating: its reservation is held until the engine's running gauge
        says it stopped, or ``abandoned_hold_s`` passes. A stream needs no hold: closing
        its connection stops the engine at its next write."""
        if ctx.admission_id is None:
            return
        self.door.attempt_ended(attempt_end(ctx, self._loop.time()))
        abandoned = ctx.upstream_abandoned and ctx.replica is not None
        if abandoned:
            ctx.upstream_abandoned = False
        done = completion(ctx, self._loop.time())
        self.door.request_ended(RequestEnd(ctx.admission_id, done, abandoned))
