"""The request pipeline for ``/v1/chat/completions`` and ``/v1/completions``.

Like an Envoy filter chain, a request passes through small stages, each with one job,
in the order `Pipeline.handle` shows in one place:

    authenticate -> parse and validate -> estimate tokens -> classify -> tenant limits
    -> admit (queue or shed) -> route -> relay -> account -> release

A stage either fills in the `RequestContext` or raises `ApiError`, which becomes an
OpenAI error object. Account and release run in ``finally`` on every path, including
cancellation when the client disconnects, so a reservation can never leak.

Retry: when the chosen replica refuses the connection (it crashed) or answers 5xx
before any byte reached the client, the request is re-admitted once to another replica,
queueing at its first arrival's place within its own queue deadline when none can take
it at once; shed from there, the original error is answered: the engine's own (its
status and message, as an OpenAI error object), else 502.
A connection refusal also marks the replica unready until discovery sees it healthy.
A stream with no first event within ``upstream.first_byte_s`` (a hung or stalled
replica) is retried the same way: its upstream connection is closed first, so the
engine aborts it and no replica does the work twice. A non-stream request's only bound
is ``upstream.total_s``: past it, the answer is 504, not a retry.

Outlier ejection (`admission.health.OutlierDetector`, config ``outlier``): refused
connections, 5xx answers and timeouts before the first byte, in a row, eject a replica
from admission for a doubling, capped time; requests already reserved there run on and
release as they end. A timer returns it to service.

Graceful shutdown (`Pipeline.begin_shutdown`, `Pipeline.cut_running`): new requests and
queued ones are answered 503 ``shutting_down`` with Retry-After; running ones are cut
only when the shell's grace runs out: a stream ends with an error event, a non-stream
request gets the 503.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import os
from collections.abc import Callable

import orjson
from aiohttp import web

from admission.estimate import TokenEstimator
from admission.health import OutlierDetector
from admission.retries import RetryMemory
from admission.tenants import TenantLimiter, TenantState, go_duration
from admission.types import AdmissionRequest, Admit, Completion, Queued, Refuse, Shed
from gateway.config import GatewayConfig
from gateway.context import Kind, RequestContext
from gateway.counting import PromptCounter
from gateway.discovery import Discovery
from gateway.door import AdmissionDoor
from gateway.errors import ApiError, invalid_request
from gateway.logging import access_log_enabled, log_access
from gateway.metrics import GatewayMetrics
from gateway.relay import Relay
from gateway.schemas import (
    MAX_TOKENS_CEILING,
    BodyError,
    ChatCompletionRequest,
    CompletionRequest,
)
from gateway.upstream import UpstreamFailure
from routing.classify import classify_workload
from routing.prefix import block_hashes

log = logging.getLogger("kvgate.pipeline")

# The authenticated tenant of a request (for the rate-limit headers of its answer).
TENANT_KEY = web.RequestKey("kvgate_tenant", str)

UPSTREAM_PATHS: dict[Kind, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
_SCHEMAS: dict[Kind, type[ChatCompletionRequest] | type[CompletionRequest]] = {
    "chat": ChatCompletionRequest,
    "completion": CompletionRequest,
}

# Client headers kvgate reads (documented in the README).
H_QUEUE_TIMEOUT = "x-kvgate-queue-timeout"  # seconds the client is willing to wait in queue
H_PRIORITY = "x-kvgate-priority"  # integer, higher is admitted first
H_SESSION = "x-session-id"  # session affinity key (else the body's `user`)
H_WORKLOAD = "x-workload"  # coding | agentic | chat, overrides the classifier
# Sent by the official openai SDKs on every request: their read timeout in seconds, and
# which retry this is (0 for the first attempt; the SDKs retry twice by default).
H_READ_TIMEOUT = "x-stainless-read-timeout"
H_RETRY_COUNT = "x-stainless-retry-count"
SDK_DEFAULT_MAX_RETRIES = 2
# Upstream failures that say the replica could not serve its load: the learned limit
# hears of them (a refused connection or a dropped one says the replica is down, not full).
_LOAD_FAILURES = frozenset({"timeout", "stream_error", "status_5xx"})
# Upstream failures (raised before any byte reached the client) that count towards
# outlier ejection: a refused connection, a 5xx answer, no first byte in time.
_OUTLIER_FAILURES = frozenset({"connect", "status_5xx", "timeout"})
# The most characters per token seen in whole prompts, times this, bounds a block's
# characters per token for the shared-prefix credit (denser stretches than any prompt's
# average: a system prompt of prose next to JSON schemas).
_SHARED_CHARS_MARGIN = 1.25


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def _loads(raw: bytes) -> object:
    """The body's JSON: orjson, and the standard library for what orjson refuses but
    JSON parsers commonly accept (a lone surrogate escape, a byte-order mark), so the
    faster parser changes no answer. Invalid JSON is a 400, and so are NaN and Infinity
    (not JSON, RFC 8259: an engine would choke on them) and nesting past the parser's
    depth (orjson stops at 1024 levels; the standard library's recursion limit)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise invalid_request("Request body is nested too deeply.", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid_request(f"Request body is not valid JSON: {e}", code="invalid_json") from None


class Pipeline:
    """Owns the stages and the objects they share. One instance per app."""

    def __init__(
        self,
        config: GatewayConfig,
        estimator: TokenEstimator,
        bridge: AdmissionDoor,
        discovery: Discovery,
        relay: Relay,
        metrics: GatewayMetrics,
        *,
        counter: PromptCounter | None = None,
        tenants: TenantLimiter | None = None,
    ) -> None:
        self.config = config
        self.report = bridge.report
        self.estimator = estimator
        self.bridge = bridge
        self.discovery = discovery
        self.relay = relay
        self.metrics = metrics
        # Without a session (no counter given) prompts are estimated and counted locally only.
        self.counter = counter or PromptCounter(config, estimator, discovery, metrics)
        # Tenants: hashed keys, policies, rate limits (admission/tenants.py). The plain
        # legacy keys are hashed here and not kept.
        self.tenants = tenants or TenantLimiter.from_config(config.tenants, config.auth.api_keys)
        metrics.set_tenant_names(self.tenants.tenants)
        # Set by the app when shared state is configured fail-closed (gateway/sharing.py):
        # returns the 503 new requests get while Redis is unreachable, else None.
        self.state_gate: Callable[[], ApiError | None] | None = None
        self._max_body = config.limits.max_body_bytes
        self._body_timeout = config.limits.body_timeout_s
        self._queue_timeout = config.admission.queue_timeout_s
        self._retry_once = config.upstream.retry_once
        self._retries = RetryMemory(
            config.admission.retry_memory_s, config.admission.retry_memory_entries
        )
        # Per-replica constants, computed once: URL and the headers sent upstream.
        self._urls = {rc.name: rc.url for rc in config.replicas}
        self._same_server = {
            rc.name: [o.name for o in config.replicas if o.url == rc.url] for rc in config.replicas
        }
        self._headers: dict[str, dict[str, str]] = {}
        for rc in config.replicas:
            h = {"Content-Type": "application/json"}
            if rc.api_key:
                h["Authorization"] = f"Bearer {rc.api_key}"
            if rc.dp_rank is not None:  # pinned to the engine rank whose ledger admitted it
                h["X-data-parallel-rank"] = str(rc.dp_rank)
            self._headers[rc.name] = h
        # Prefix block hashes are computed once per request, only when a routing profile
        # reads them or a replica of the model counts shared prefixes once
        # (admission.prefixshare).
        routing = config.routing
        self._route_prefix = bool(getattr(bridge.router, "needs_prefix", False))
        self._prefix = (
            (routing.block_chars, routing.max_prefix_blocks)
            if self._route_prefix or config.admission.share_prefix
            else None
        )
        self._ids = itertools.count(1)
        self._id_prefix = "kvg-" + os.urandom(4).hex()
        self._loop = asyncio.get_running_loop()
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        oc = config.outlier
        self.outliers: OutlierDetector | None = None
        if oc.enabled:
            self.outliers = OutlierDetector(
                consecutive_failures=oc.consecutive_failures,
                base_ejection_s=oc.base_ejection_s,
                max_ejection_s=oc.max_ejection_s,
                max_ejection_percent=oc.max_ejection_percent,
            )
            for rc in config.replicas:
                self.outliers.add(rc.name)
        self._eject_timers: dict[str, asyncio.TimerHandle] = {}
        self.draining = False
        self._active: dict[asyncio.Task[object], RequestContext] = {}

    # ================================================================== lifecycle
    def begin_shutdown(self) -> int:
        """Refuse new requests and shed the queued ones (503, Retry-After); returns how
        many were shed. Running requests go on."""
        self.draining = True
        return self.bridge.shed_all("shutdown", self._shutdown_retry_after())

    def cut_running(self) -> int:
        """Cut every running request (the shutdown grace is over); returns how many."""
        n = 0
        for task, ctx in list(self._active.items()):
            if not ctx.cut and not task.done():
                ctx.cut = True
                task.cancel("kvgate shutdown")
                n += 1
        return n

    def close(self) -> None:
        for h in self._eject_timers.values():
            h.cancel()
        self._eject_timers.clear()

    def _shutdown_retry_after(self) -> float:
        return max(1.0, self.config.admission.min_retry_after_s)

    def _shutting_down(self) -> ApiError:
        return ApiError(
            503,
            "kvgate is shutting down; retry the request.",
            code="shutting_down",
            retry_after=self._shutdown_retry_after(),
            outcome="shed_shutdown",
        )

    async def _cut(self, ctx: RequestContext) -> web.StreamResponse:
        """The answer of a request cut at shutdown: an error event on a started stream,
        else a 503."""
        ctx.status = 503
        ctx.outcome = "shutdown_cut"
        err = self._shutting_down()
        resp = ctx.client_stream
        if resp is not None and resp.prepared:
            try:
                await resp.write(err.sse_event())
                await resp.write_eof()
            except ConnectionError:
                pass
            return resp
        return err.response({"x-request-id": ctx.request_id})

    # ================================================================== outliers
    def _outlier_failure(self, replica: str, kind: str) -> None:
        if self.outliers is None or kind not in _OUTLIER_FAILURES:
            return
        now = self._loop.time()
        until = self.outliers.failure(replica, now)
        if until is None:
            return
        self.metrics.ejections.labels(replica).inc()
        log.warning(
            "replica %s ejected for %.1f s after consecutive failures",
            replica,
            until - now,
            extra={"fields": {"replica": replica, "ejected_s": round(until - now, 3)}},
        )
        self.bridge.set_ejected(replica, True, now)
        self._eject_timers[replica] = self._loop.call_at(until, self._end_ejection, replica, until)

    def _end_ejection(self, replica: str, until: float) -> None:
        self._eject_timers.pop(replica, None)
        assert self.outliers is not None
        now = max(self._loop.time(), until)
        for name in self.outliers.expire(now):
            log.info("replica %s returns from ejection", name, extra={"fields": {"replica": name}})
            self.bridge.set_ejected(name, False, now)

    # ================================================================== the chain
    async def handle(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        now = self._loop.time()
        ctx = RequestContext(
            request_id=f"{self._id_prefix}-{next(self._ids)}",
            kind=kind,
            upstream_path=UPSTREAM_PATHS[kind],
            arrival=now,
        )
        self.inflight += 1
        self.idle.clear()
        task = asyncio.current_task()
        if task is not None:
            self._active[task] = ctx
        try:
            if self.draining:
                raise self._shutting_down()
            self.authenticate(request, ctx)
            await self.parse(request, ctx)
            text = await self.estimate(ctx)
            self.classify(request, ctx, text)
            self.tenant_limits(request, ctx)
            await self.admit(request, ctx)
            return await self.route_and_relay(request, ctx)
        except ApiError as e:
            ctx.status = e.status
            ctx.outcome = e.outcome
            return e.response({"x-request-id": ctx.request_id})
        except asyncio.CancelledError:
            if ctx.cut and task is not None:
                # Shutdown cut it (not the client): answer it cleanly.
                task.uncancel()
                return await self._cut(ctx)
            # Client went away (aiohttp cancels the handler). Upstream is closed by the
            # relay's own finally; the reservation by ours.
            ctx.status = 499
            ctx.outcome = "client_disconnect"
            raise
        except Exception:
            log.exception("unhandled error in request %s", ctx.request_id)
            ctx.status = 500
            ctx.outcome = "internal_error"
            return ApiError(500, "internal error in kvgate", code="internal_error").response(
                {"x-request-id": ctx.request_id}
            )
        finally:
            try:
                self.account(ctx)
            finally:
                self.release(ctx)
                if task is not None:
                    self._active.pop(task, None)
                self.inflight -= 1
                if self.inflight == 0:
                    self.idle.set()

    # ================================================================== stages
    def authenticate(self, request: web.Request, ctx: RequestContext) -> None:
        """API key -> tenant (by its SHA-256 digest, compared in constant time). Without
        configured keys every request is tenant default. Only the key decides the tenant:
        no header can name another."""
        limiter = self.tenants
        key = ""
        if limiter.auth_required:
            auth = request.headers.get("Authorization", "")
            key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        tenant = limiter.authenticate(key)
        if tenant is None:
            raise ApiError(
                401,
                "Incorrect API key provided."
                if key
                else "Missing API key: send Authorization: Bearer <key>.",
                code="invalid_api_key",
                outcome="unauthorized",
            )
        ctx.tenant = tenant
        policy = limiter.get(tenant)
        ctx.tenant_default_workload = policy.default_workload
        request[TENANT_KEY] = tenant  # rate-limit headers on whatever answer follows

    async def parse(self, request: web.Request, ctx: RequestContext) -> None:
        """Read the body within the size limit and validate it."""
        length = request.content_length
        if length is not None and length > self._max_body:
            raise _too_large(self._max_body)
        try:
            if request.content.is_eof():  # the whole body came with the head
                raw = await request.read()
            else:  # a slow body holds a connection and a handler: bound it
                async with asyncio.timeout(self._body_timeout):
                    raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _too_large(self._max_body) from None
        except TimeoutError:
            raise ApiError(
                408,
                f"The request body did not arrive within {self._body_timeout:g} s.",
                code="body_timeout",
            ) from None
        if len(raw) > self._max_body:
            raise _too_large(self._max_body)
        body = _loads(raw)
        if not isinstance(body, dict):
            raise invalid_request("Request body must be a JSON object.")
        try:
            parsed = _SCHEMAS[ctx.kind](body)
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
        ctx.model = parsed.model
        ctx.stream = parsed.stream
        ctx.client_wants_usage = parsed.wants_usage

    async def estimate(self, ctx: RequestContext) -> str:
        """Prompt tokens, output tokens to reserve. Returns the prompt text for the
        classifier (kept out of the context and logs).

        The prompt is estimated from its characters, or counted exactly where that is
        free (token ids, a local tokenizer). Only a request the estimate puts near a limit
        costs one call to a replica's tokenize endpoint (gateway/counting.py): admission
        may refuse an exact count, never an estimate."""
        counter = self.counter
        measured = counter.measure(ctx)
        self._bound_output(ctx)
        if counter.near_limit(ctx, measured) and await counter.count_on_replica(ctx, measured):
            self._bound_output(ctx)
        counter.settle(ctx, measured)
        return measured.text

    def _bound_output(self, ctx: RequestContext) -> None:
        """Output tokens to reserve, from history, within the context the prompt leaves."""
        assert ctx.parsed is not None
        bound = ctx.parsed.output_bound
        max_len = self.discovery.max_model_len(ctx.model)
        limit = max(1, (max_len - ctx.prompt_tokens) if max_len else MAX_TOKENS_CEILING)
        ctx.expected_output = self.estimator.expected_output(ctx.model, bound, limit)
        # Without a client bound the engine may generate up to the context; admission's
        # never-fits check then uses what we reserve, and an engine that does not preempt
        # is reserved its whole context.
        ctx.max_tokens = bound if bound is not None else ctx.expected_output
        ctx.max_tokens_given = ctx.parsed.bounds_output

    def classify(self, request: web.Request, ctx: RequestContext, text: str) -> None:
        """Workload class, and what routing reads of the prompt: its block hash chain
        (when a profile needs it) and the session key (``x-session-id``, else ``user``)."""
        if self._prefix is not None and (
            self._route_prefix or self.report.shares_prefix(ctx.model)
        ):
            ctx.prefix_hashes = block_hashes(text, *self._prefix)
            if ctx.prefix_hashes and self.config.admission.share_prefix:
                # A lower bound on the tokens of a block: the most characters per token
                # seen, with a margin for text denser than any whole prompt seen.
                most = self.estimator.most_chars_per_token(ctx.model)
                if most is not None:
                    ctx.prefix_block_tokens = int(self._prefix[0] / (most * _SHARED_CHARS_MARGIN))
        session = request.headers.get(H_SESSION)
        if not session and ctx.body is not None:
            user = ctx.body.get("user")
            session = user if isinstance(user, str) and user else None
        ctx.session = session
        parsed = ctx.parsed
        has_tools = False
        if isinstance(parsed, ChatCompletionRequest):
            has_tools = bool(parsed.tools) or any(
                m.role in ("tool", "function") for m in parsed.messages
            )
        ctx.workload = classify_workload(
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
        policy = limiter.get(ctx.tenant)
        if not policy.may_use(ctx.model):
            raise ApiError(
                404,
                f"The model `{ctx.model}` does not exist or you do not have access to it.",
                code="model_not_found",
                param="model",
                outcome="model_not_found",
            )
        asked: int | None = None
        if (p := request.headers.get(H_PRIORITY)) is not None:
            try:
                asked = int(p)
            except ValueError:
                raise invalid_request(
                    f"{H_PRIORITY} must be an integer.", param=H_PRIORITY
                ) from None
        ctx.priority = policy.clamp_priority(asked)
        if policy.rpm is None and policy.tpm is None:
            return
        now = self._loop.time()
        tokens = ctx.prompt_tokens + ctx.expected_output
        verdict = limiter.check(ctx.tenant, tokens, now)
        if verdict.limit is not None:
            self.metrics.tenant_rate_limited(ctx.tenant, verdict.limit)
            raise _rate_limited(policy, verdict.limit, tokens, verdict.retry_after, now)
        ctx.rate_charge = limiter.charge(ctx.tenant, tokens, now)

    async def admit(self, request: web.Request, ctx: RequestContext) -> None:
        """Admit now, wait in the queue, or answer shed/refuse.

        The queue deadline comes from, in this order: ``x-kvgate-queue-timeout`` (capped
        by the configured queue timeout); the client's own read timeout
        (``x-stainless-read-timeout``, which the openai SDKs send), less the predicted
        service, or for a stream the predicted time to first token (the controller
        predicts it); else the configured queue timeout.
        """
        if self.state_gate is not None and (closed := self.state_gate()) is not None:
            raise closed
        now = self._loop.time()
        deadline = math.inf
        hdr = request.headers.get(H_QUEUE_TIMEOUT)
        if hdr is not None:
            cap = self.tenants.get(ctx.tenant).queue_timeout_s or self._queue_timeout
            deadline = now + min(cap, _seconds(hdr, H_QUEUE_TIMEOUT))
        if (read := request.headers.get(H_READ_TIMEOUT)) is not None:
            ctx.latency_budget = _seconds(read, H_READ_TIMEOUT) or None
        if (count := request.headers.get(H_RETRY_COUNT)) is not None:
            try:
                ctx.last_retry = int(count) >= SDK_DEFAULT_MAX_RETRIES
            except ValueError:
                raise invalid_request(
                    f"{H_RETRY_COUNT} must be an integer.", param=H_RETRY_COUNT
                ) from None
        priority = ctx.priority  # clamped to the tenant's range by tenant_limits
        ctx.deadline = deadline
        ctx.admission_id = ctx.request_id
        # A retry of a request kvgate shed keeps its first arrival, i.e. its place in line
        # (admission/retries.py). The key is a digest: the memory never holds bodies.
        retry_key = ctx.retry_key = hash((ctx.tenant, ctx.model, ctx.raw))
        first = self._retries.first_arrival(retry_key, now, ctx.tenant)
        req = _admission_request(
            ctx,
            ctx.request_id,
            arrival=now if first is None else first,
            deadline=ctx.deadline,
            priority=priority,
            targets=self.tenants.tenants.get(ctx.tenant),
        )
        verdict, _queued = await self.bridge.admit(req)
        if isinstance(verdict, Admit):
            if first is not None:
                self._retries.forget(retry_key, ctx.tenant)
            self._admitted(ctx, verdict)
            self.metrics.queue_wait.observe(ctx.admitted_at - ctx.arrival)  # type: ignore[operator]
            self.metrics.tenant_queue_wait(ctx.tenant, ctx.admitted_at - ctx.arrival)  # type: ignore[operator]
            return
        if isinstance(verdict, Shed):
            if verdict.reason == "shutdown":
                raise self._shutting_down()
            self._retries.remember(retry_key, req.arrival, self._loop.time(), ctx.tenant)
            self.metrics.shed.labels(verdict.reason).inc()
            if verdict.status == 429:
                policy = self.tenants.get(ctx.tenant)
                if verdict.reason == "tenant_concurrency":
                    limit = "concurrency"
                    what = (
                        f"Concurrency limit reached for tenant {ctx.tenant}: "
                        f"{policy.max_concurrent} requests running (max_concurrent) and "
                        f"{policy.max_queued} queued (max_queued)."
                    )
                else:
                    limit = "queue"
                    what = (
                        f"Queue limit reached for tenant {ctx.tenant}: {policy.max_queued} "
                        "requests already waiting (max_queued)."
                    )
                self.metrics.tenant_rate_limited(ctx.tenant, limit)
                raise ApiError(
                    429,
                    f"{what} Please try again in {_go(verdict.retry_after)}.",
                    code="rate_limit_exceeded",
                    retry_after=verdict.retry_after,
                    outcome=f"shed_{verdict.reason}",
                )
            raise ApiError(
                verdict.status,
                f"All replicas serving {ctx.model} are at KV capacity ({verdict.reason}); "
                f"retry after {max(1, math.ceil(verdict.retry_after))} s.",
                code="overloaded",
                retry_after=verdict.retry_after,
                outcome=f"shed_{verdict.reason}",
            )
        assert isinstance(verdict, Refuse)
        raise ApiError(
            verdict.status,
            verdict.message,
            code=verdict.code,
            param="model"
            if verdict.code == "model_not_found"
            else ("messages" if ctx.kind == "chat" else "prompt"),
            outcome=verdict.code,
        )

    def _admitted(self, ctx: RequestContext, a: Admit) -> None:
        ctx.admission_id = a.request_id
        ctx.replica = a.replica
        ctx.reserved = a.reserved_tokens
        ctx.topup_at = a.reserved_tokens
        ctx.admitted_at = self._loop.time()

    async def route_and_relay(
        self, request: web.Request, ctx: RequestContext
    ) -> web.StreamResponse:
        """Send to the admitted replica; on a retryable failure, once more elsewhere."""
        data = self.relay.upstream_body(ctx)
        while True:
            replica = ctx.replica
            assert replica is not None
            headers = {**self._headers[replica], "X-Request-Id": ctx.request_id}
            try:
                resp = await self.relay.forward(request, ctx, self._urls[replica], headers, data)
                if ctx.upstream_error is not None:  # failed after the stream had started
                    self.metrics.upstream_errors.labels(replica, ctx.upstream_error).inc()
                    log.warning(
                        "upstream %s failed %s mid-stream (%s)",
                        replica,
                        ctx.request_id,
                        ctx.upstream_error,
                        extra={
                            "fields": {
                                "replica": replica,
                                "kind": ctx.upstream_error,
                                "request_id": ctx.request_id,
                            }
                        },
                    )
                elif self.outliers is not None:
                    self.outliers.success(replica)
                return resp
            except UpstreamFailure as f:
                self.metrics.upstream_errors.labels(replica, f.kind).inc()
                self._outlier_failure(replica, f.kind)
                log.warning(
                    "upstream %s failed for %s: %s",
                    replica,
                    ctx.request_id,
                    f.message,
                    extra={
                        "fields": {"replica": replica, "kind": f.kind, "request_id": ctx.request_id}
                    },
                )
                if f.kind == "connect":
                    # Every replica entry of that server (the engine ranks of a vLLM
                    # data-parallel server share its URL) is down with it.
                    for name in self._same_server[replica]:
                        self.bridge.mark_unready(name, self._loop.time())
                        self.discovery.mark_down(name)
                if (
                    f.retryable
                    and self._retry_once
                    and ctx.attempts == 0
                    and await self._readmit(ctx, replica, f.kind)
                ):
                    continue
                ctx.upstream_error = f.kind
                if f.answer is not None:
                    # The engine's own error, with its status and message; an overloaded
                    # engine's 503 (or 429) says when to come back, as kvgate's own do.
                    answer = f.answer
                    answer.outcome = f"upstream_{f.kind}"
                    if answer.status in (429, 503) and answer.retry_after is None:
                        answer.retry_after = self.report.retry_after(
                            ctx.model, ctx.reserved or ctx.prompt_tokens, self._loop.time()
                        )
                    raise answer from None
                if f.kind == "timeout":
                    raise ApiError(
                        504,
                        f"Replica {replica} timed out.",
                        code="upstream_timeout",
                        outcome="upstream_timeout",
                    ) from None
                raise ApiError(
                    502,
                    f"Replica {replica} failed: {f.client_message}.",
                    code=f"upstream_{f.kind}",
                    outcome=f"upstream_{f.kind}",
                ) from None

    async def _readmit(self, ctx: RequestContext, failed: str, kind: str) -> bool:
        """Release the failed admission and admit the request once more, elsewhere.

        The failed replica is excluded from this one decision by marking it unready;
        after a 5xx it is reinstated at once (discovery decides its health, not one
        answer), after a refused connection it stays out until discovery sees it up.
        When no replica can take it at once (the others are at their limits, as they are
        under load when one replica dies), the retry waits in the queue at its first
        arrival's place, within the request's own queue deadline: a request that had no
        byte yet is retried to completion rather than answered 502 because the healthy
        replicas were busy at that instant. Shed from the queue, it gets the original
        error.
        """
        ctx.attempts += 1
        self.release(ctx)
        now = self._loop.time()
        self.bridge.mark_unready(failed, now)
        rid = f"{ctx.request_id}.{ctx.attempts}"
        ctx.admission_id = rid
        waiter = None
        try:
            verdict = self.bridge.submit(
                # First arrival: ahead of the requests that came after it.
                _admission_request(
                    ctx,
                    rid,
                    arrival=ctx.arrival,
                    deadline=ctx.deadline,
                    priority=ctx.priority,
                    targets=self.tenants.tenants.get(ctx.tenant),
                ),
                now,
            )
            if isinstance(verdict, Queued):
                # Before the reinstatement below: it may admit this very entry.
                waiter = self.bridge.expect(rid)
        finally:
            if kind != "connect":
                self.discovery.reinstate(failed)
        if waiter is not None:
            verdict = await self.bridge.wait_queued(rid, waiter)
        if isinstance(verdict, Shed) and verdict.reason == "shutdown":
            raise self._shutting_down()
        if isinstance(verdict, Admit):
            self._admitted(ctx, verdict)
            self.metrics.retries.labels(failed, kind).inc()
            return True
        self.release(ctx)
        return False

    def on_progress(self, ctx: RequestContext) -> None:
        """A stream outgrew its reservation: ask for more (never cuts the stream)."""
        total = ctx.prompt_tokens + ctx.generated
        want = total + max(16, total // 8)
        if ctx.admission_id and self.bridge.top_up(ctx.admission_id, want, self._loop.time()):
            res = self.report.reservation(ctx.admission_id)
            ctx.reserved = res.reserved_tokens if res else want
        ctx.topup_at = max(ctx.reserved, want)

    def account(self, ctx: RequestContext) -> None:
        """Learn from the engine's usage, count the outcome, write the access line."""
        model_label = ctx.model if ctx.model in self.discovery.known_models else "_unknown"
        if ctx.outcome == "ok":
            if ctx.usage_prompt is not None:
                self.metrics.observe_prompt_estimate(
                    ctx.prompt_tokens, ctx.usage_prompt, ctx.prompt_exact
                )
            if (
                ctx.usage_prompt is not None
                and not ctx.prompt_exact
                and ctx.prompt_chars
                and ctx.prompt_countable
            ):
                self.estimator.observe_prompt(
                    ctx.model, ctx.prompt_chars, ctx.num_messages, ctx.usage_prompt
                )
            if ctx.usage_completion is not None:
                self.estimator.observe_output(ctx.model, ctx.usage_completion)
        self._account_tenant(ctx)
        m = self.metrics
        m.count_request(model_label, ctx.outcome)
        m.count_workload(ctx.workload, ctx.outcome)
        ttft = None
        if ctx.first_byte_at is not None:
            ttft = ctx.first_byte_at - ctx.arrival
            m.ttft.observe(ttft)
            m.observe_workload_ttft(ctx.workload, ttft)
            if ctx.events > 1 and ctx.last_event_at is not None:
                m.itl.observe((ctx.last_event_at - ctx.first_byte_at) / (ctx.events - 1))
        if access_log_enabled():  # the line is built only when someone reads it
            log_access(self._access_fields(ctx, ttft))

    def _account_tenant(self, ctx: RequestContext) -> None:
        """Settle the rate charge (the engine's usage, or a refund if never admitted) and
        count the tenant's outcome, tokens and SLO attainment."""
        now = self._loop.time()
        charge = ctx.rate_charge
        if charge is not None:
            if ctx.admitted_at is None:
                self.tenants.refund(charge, now)
            elif ctx.usage_prompt is not None or ctx.usage_completion is not None:
                true = (ctx.usage_prompt or 0) + (ctx.usage_completion or 0)
                self.tenants.correct(charge, true, now)
        m = self.metrics
        tenant = ctx.tenant
        m.tenant_request(tenant, ctx.outcome)
        if ctx.usage_prompt is not None:
            m.tenant_tokens(tenant, "prompt", ctx.usage_prompt)
        completion = ctx.usage_completion if ctx.usage_completion is not None else ctx.generated
        if completion:
            m.tenant_tokens(tenant, "completion", completion)
        policy = self.tenants.tenants.get(tenant)
        if policy is None or (
            policy.ttft_s is None and policy.itl_s is None and policy.e2e_s is None
        ):
            return
        ok = ctx.outcome == "ok"
        if not ok and ctx.status < 500:
            return  # the client's own error or limit: not a latency the gateway missed
        _slo(m, policy, ctx, ok, now)

    def _access_fields(self, ctx: RequestContext, ttft: float | None) -> dict[str, object]:
        completion = ctx.usage_completion if ctx.usage_completion is not None else ctx.generated
        return {
            "request_id": ctx.request_id,
            "tenant": ctx.tenant,
            "model": ctx.model or None,
            "kind": ctx.kind,
            "stream": ctx.stream,
            "workload": ctx.workload,
            "replica": ctx.replica,
            "outcome": ctx.outcome,
            "status": ctx.status,
            "prompt_tokens": ctx.usage_prompt,
            "prompt_tokens_est": ctx.prompt_tokens or None,
            "completion_tokens": completion or None,
            "reserved_tokens": ctx.reserved or None,
            "queue_wait_s": round(ctx.admitted_at - ctx.arrival, 6) if ctx.admitted_at else None,
            "ttft_s": round(ttft, 6) if ttft is not None else None,
            "duration_s": round(self._loop.time() - ctx.arrival, 6),
            "attempts": ctx.attempts + 1,
        }

    def release(self, ctx: RequestContext) -> None:
        """Free the reservation or queue entry (idempotent; always runs), telling
        admission what the request measured about its replica.

        A non-stream request kvgate stopped waiting for while the engine had it (client
        gone, upstream timeout) may still be generating: its reservation is held until
        the engine's running gauge says it stopped, or ``abandoned_hold_s`` passes. A
        stream needs no hold: closing its connection stops the engine at its next write.
        """
        if ctx.admission_id is None:
            return
        if ctx.upstream_abandoned and ctx.replica is not None:
            ctx.upstream_abandoned = False
            self.bridge.abandon(ctx.admission_id, self._completion(ctx))
        else:
            self.bridge.release(ctx.admission_id, self._completion(ctx))

    def _completion(self, ctx: RequestContext) -> Completion | None:
        """What an ended request says about its replica's load, or None when it says
        nothing (never admitted, client gone, errors that are not about load)."""
        if ctx.admitted_at is None:
            return None
        if ctx.outcome != "ok":
            if ctx.upstream_error in _LOAD_FAILURES or ctx.outcome == "upstream_timeout":
                # The replica failed it: slow, or (llama.cpp) out of KV mid-stream.
                return Completion(ok=False, latency_budget=ctx.latency_budget)
            budget = ctx.latency_budget
            if (
                ctx.outcome == "client_disconnect"
                and budget is not None
                and self._loop.time() - ctx.arrival >= 0.9 * budget
            ):
                # The client left at the timeout it declared: the replica failed it.
                return Completion(ok=False, latency_budget=budget)
            return None
        now = self._loop.time()
        ttft = itl = None
        if ctx.stream and ctx.first_byte_at is not None:
            ttft = ctx.first_byte_at - ctx.admitted_at
            if ctx.events > 1 and ctx.last_event_at is not None:
                itl = (ctx.last_event_at - ctx.first_byte_at) / (ctx.events - 1)
        return Completion(
            ok=True,
            service_s=now - ctx.admitted_at,
            ttft_s=ttft,
            itl_s=itl,
            prompt_tokens=ctx.usage_prompt if ctx.usage_prompt is not None else ctx.prompt_tokens,
            completion_tokens=ctx.usage_completion
            if ctx.usage_completion is not None
            else ctx.generated,
            latency_budget=ctx.latency_budget,
        )


def _admission_request(
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
        session=ctx.session,
        ttft_target_s=ttft_target,
        itl_target_s=itl_target,
    )


def _go(seconds: float) -> str:
    return go_duration(seconds)


def _rate_limited(
    policy: TenantState, limit: str, tokens: int, wait: float, now: float
) -> ApiError:
    """The 429 of a requests- or tokens-per-minute limit, worded as OpenAI words it."""
    g = policy.rpm if limit == "requests" else policy.tpm
    assert g is not None
    label = "requests per min (RPM)" if limit == "requests" else "tokens per min (TPM)"
    cap = math.floor(g.limit)
    requested = 1 if limit == "requests" else tokens
    if not math.isfinite(wait):
        return ApiError(
            429,
            f"Request too large for tenant {policy.name} on {label}: Limit {cap}, "
            f"Requested {requested}. Reduce the prompt or max_tokens.",
            code="rate_limit_exceeded",
            param=None,
            outcome=f"rate_limited_{limit}",
        )
    used = cap - g.remaining(now)
    return ApiError(
        429,
        f"Rate limit reached for tenant {policy.name} on {label}: Limit {cap}, Used "
        f"{used}, Requested {requested}. Please try again in {_go(wait)}.",
        code="rate_limit_exceeded",
        retry_after=wait,
        outcome=f"rate_limited_{limit}",
    )


def _slo(m: GatewayMetrics, policy: TenantState, ctx: RequestContext, ok: bool, now: float) -> None:
    """Count the request against each of its tenant's targets it can be judged on (TTFT
    and ITL: streams; end to end: all): a failed request (5xx, shed) misses them."""
    tenant = ctx.tenant
    if policy.e2e_s is not None:
        m.tenant_slo(tenant, "e2e", ok and now - ctx.arrival <= policy.e2e_s)
    if policy.ttft_s is not None and ctx.stream:
        ttft = ctx.first_byte_at - ctx.arrival if ctx.first_byte_at is not None else None
        m.tenant_slo(tenant, "ttft", ok and ttft is not None and ttft <= policy.ttft_s)
    if policy.itl_s is not None and ctx.stream:
        itl = None
        if ctx.events > 1 and ctx.first_byte_at is not None and ctx.last_event_at is not None:
            itl = (ctx.last_event_at - ctx.first_byte_at) / (ctx.events - 1)
        if ok and itl is None:
            return  # one event: no gap to judge
        m.tenant_slo(tenant, "itl", ok and itl is not None and itl <= policy.itl_s)


def _seconds(value: str, header: str) -> float:
    """A header's non-negative number of seconds, or a 400 naming the header."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise invalid_request(f"{header} must be a non-negative number of seconds.", param=header)
    return seconds


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"Request body exceeds the limit of {limit} bytes.",
        code="request_too_large",
        outcome="too_large",
    )
