"""Retries and failover: what the request path does when a replica fails a request.

Retry: when the chosen replica refuses the connection (it crashed), drops it or answers
5xx before any byte reached the client, the request is re-admitted once, never to the
replica that failed it: the retry carries the failed server's replica entries in its
``avoid`` set (as Envoy's previous_hosts retry predicate), and admission keeps it off
them also when the retry waits in the queue and is admitted later. (A connection lost on the
model's only server is retried there: there is nowhere else to go.) The failed replica
stays in service for everyone else; its health is discovery's and outlier ejection's
to judge, not one request's. The retry queues at its first arrival's place within its
own queue deadline when no other replica can take it at once; shed from there, the
original error is answered: the engine's own (its status and message, as an OpenAI
error object), else 502.
A connection refusal also marks the replica, and every replica entry of its server,
unready until discovery sees it healthy.
A stream with no first event within ``upstream.first_byte_s`` (a hung or stalled
replica) is retried the same way: its upstream connection is closed first, so the
engine aborts it and no replica does the work twice. A non-stream request's only bound
is ``upstream.total_s``: past it, the answer is 504, not a retry.

Outlier ejection (gateway/upstream/outliers.py, config ``outlier``) hears of a replica's own
failures before the first byte at once: a refused connection, no first byte in time.
An engine's error *answer* (a 5xx status with its error object) may be the request's
fault, not the replica's (a client's input the engine cannot handle): it is charged to
the replica only when the same request then succeeds on another one. A request that
fails on both is the request's fault (invariant 8, docs/principles.md): neither replica is charged,
and the client gets the engine's answer. Consecutive failures eject the replica from
admission for a doubling, capped time; requests already reserved there run on and
release as they end. Admission hears of each ejection and its end as a subscriber.
"""

from __future__ import annotations

import asyncio
import logging

from admission.health import OutlierDetector
from admission.tenants import TenantLimiter
from gateway.config import GatewayConfig, expand_data_parallel
from gateway.context import RequestContext
from gateway.door import AdmissionDoor
from gateway.errors import ApiError
from gateway.fleet.discovery import Discovery
from gateway.metrics import GatewayMetrics
from gateway.outcome import OK, UPSTREAM_TIMEOUT, upstream
from gateway.upstream.outliers import EjectionChange, OutlierEjection, report_ejections
from gateway.upstream.session import UpstreamFailure

# The request path's logger, as before these lines left gateway/pipeline.py: log
# filters that select it keep working.
log = logging.getLogger("kvgate.pipeline")


class Failover:
    """The upstream side of the request path: failures, retries and outlier ejection."""

    def __init__(
        self,
        config: GatewayConfig,
        door: AdmissionDoor,
        discovery: Discovery,
        metrics: GatewayMetrics,
        tenants: TenantLimiter,
    ) -> None:
        self.config = config
        self.door = door
        self.discovery = discovery
        self.metrics = metrics
        self.tenants = tenants
        self._retry_once = config.upstream.retry_once
        self._loop = asyncio.get_running_loop()
        self.ejection = OutlierEjection.from_config(
            config.outlier, [rc.name for rc in expand_data_parallel(config.replicas)]
        )
        self.ejection.subscribe(report_ejections(metrics))
        self.ejection.subscribe(self._tell_admission)

    @property
    def outliers(self) -> OutlierDetector | None:
        """The sans-IO detector (None when ejection is disabled), for admin and tests."""
        return self.ejection.detector

    def close(self) -> None:
        self.ejection.close()

    def _tell_admission(self, change: EjectionChange) -> None:
        self.door.set_ejected(change.replica, change.ejected, change.at)

    def answered(self, ctx: RequestContext, replica: str) -> None:
        """The relay returned from `replica`: a failure after the stream had started is
        counted and logged (too late to retry); any other answer ends its failure run. A
        completed retry convicts the replica whose error answer it was retried after."""
        unjudged, ctx.unjudged = ctx.unjudged, None
        if ctx.upstream_error is None:
            self.ejection.success(replica)
            if unjudged is not None and ctx.outcome == OK:
                self.ejection.failure(*unjudged)
            return
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

    def failed(self, ctx: RequestContext, replica: str, f: UpstreamFailure) -> bool:
        """Count and report `replica`'s failure `f` (no byte reached the client yet);
        True when the request is to be admitted once more, elsewhere (`retry`).

        A failure without an answer (refused, dropped, timed out) is the replica's and goes
        to outlier ejection at once; an error answer waits for the retry's outcome
        (`answered`), and is never charged when there is no retry to judge it."""
        self.metrics.upstream_errors.labels(replica, f.kind).inc()
        if f.answer is None:
            self.ejection.failure(replica, f.kind)
        log.warning(
            "upstream %s failed for %s: %s",
            replica,
            ctx.request_id,
            f.message,
            extra={"fields": {"replica": replica, "kind": f.kind, "request_id": ctx.request_id}},
        )
        if f.kind == "connect":
            for name in self.discovery.same_server(replica):
                self.discovery.mark_down(name)
        if not (f.retryable and self._retry_once and ctx.attempts == 0):
            return False
        if f.answer is not None:
            ctx.unjudged = (replica, f.kind)
        return True

    def answer(self, ctx: RequestContext, replica: str, f: UpstreamFailure) -> ApiError:
        """The error the client gets for a failure that was not retried."""
        ctx.upstream_error = f.kind
        if f.answer is not None:
            # The engine's own error, with its status and message; an overloaded
            # engine's 503 (or 429) says when to come back, as kvgate's own do.
            answer = f.answer
            answer.outcome = upstream(f.kind)
            if answer.status in (429, 503) and answer.retry_after is None:
                answer.retry_after = self.door.report.retry_after(
                    ctx.req.model, ctx.reserved or ctx.req.prompt_tokens, self._loop.time()
                )
            return answer
        if f.kind == "timeout":
            return ApiError(
                504,
                f"Replica {replica} timed out.",
                code="upstream_timeout",
                outcome=UPSTREAM_TIMEOUT,
            )
        return ApiError(
            502,
            f"Replica {replica} failed: {f.client_message}.",
            code=f"upstream_{f.kind}",
            outcome=upstream(f.kind),
        )

    def _serves_elsewhere(self, model: str, avoid: frozenset[str]) -> bool:
        """Whether a replica outside `avoid` serves `model` (ready or not yet)."""
        return any(
            u.name not in avoid and model in u.models for u in self.door.report.replica_usage()
        )

    def retry(self, ctx: RequestContext, failed: str, kind: str) -> None:
        """Make the request a retry of its failed attempt, to go through the admit stage
        again (its failed admission was released).

        The retry avoids every replica entry of the failed server (the ranks of a
        data-parallel engine share its process), for this request alone: nothing is
        marked unready for it, so no other request's placement changes. When no other
        replica can take it at once (the others are at their limits, as they are under
        load when one replica dies), it waits in the queue at its first arrival's place,
        within the request's own queue deadline, and is admitted only to a replica it
        does not avoid: a request that had no byte yet is retried to completion rather
        than answered 502 because the healthy replicas were busy at that instant. Shed
        from the queue, it gets the original error (`answer`).
        """
        ctx.attempts += 1
        avoid = ctx.req.avoid | self.discovery.same_server(failed)
        if kind != "dropped" or self._serves_elsewhere(ctx.req.model, avoid):
            ctx.req.avoid = avoid
        # else a connection lost on the model's only server: the retry goes back to it, as
        # a client's own would (a crashed engine refuses it at once). Refused, timed out
        # or answered with an error, the same server would only fail it again.
        rid = f"{ctx.request_id}.{ctx.attempts}"
        ctx.admission_id = rid
        # The same request object, now under the retry's id; first arrival: ahead of
        # the requests that came after it.
        ctx.req.request_id = rid
        ctx.req.arrival = ctx.arrival

    def retried(self, ctx: RequestContext, failed: str, kind: str, admitted: bool) -> None:
        """The retry's verdict: admitted elsewhere (counted), or not (nothing then
        judges the failed replica's error answer)."""
        if admitted:
            self.metrics.retries.labels(failed, kind).inc()
        else:
            ctx.unjudged = None
