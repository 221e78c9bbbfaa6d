"""Retries and failover: what the request path does when a replica fails a request.

Retry: when the chosen replica refuses the connection (it crashed) or answers 5xx
before any byte reached the client, the request is re-admitted once to another replica,
queueing at its first arrival's place within its own queue deadline when none can take
it at once; shed from there, the original error is answered: the engine's own (its
status and message, as an OpenAI error object), else 502.
A connection refusal also marks the replica, and every replica entry of its server,
unready until discovery sees it healthy.
A stream with no first event within ``upstream.first_byte_s`` (a hung or stalled
replica) is retried the same way: its upstream connection is closed first, so the
engine aborts it and no replica does the work twice. A non-stream request's only bound
is ``upstream.total_s``: past it, the answer is 504, not a retry.

Every failure before the first byte is also reported to outlier ejection
(gateway/outliers.py, config ``outlier``): consecutive ones eject the replica from
admission for a doubling, capped time; requests already reserved there run on and
release as they end. Admission hears of each ejection and its end as a subscriber.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from admission.controller import AdmissionController
from admission.health import OutlierDetector
from admission.tenants import TenantLimiter
from admission.types import Admit, Queued, Shed
from gateway.admitter import AdmissionBridge
from gateway.config import GatewayConfig
from gateway.context import RequestContext, admission_request
from gateway.discovery import Discovery
from gateway.errors import ApiError
from gateway.metrics import GatewayMetrics
from gateway.outliers import EjectionChange, OutlierEjection, report_ejections
from gateway.shutdown import shutting_down
from gateway.upstream import UpstreamFailure

# The request path's logger, as before these lines left gateway/pipeline.py: log
# filters that select it keep working.
log = logging.getLogger("kvgate.pipeline")


class Failover:
    """The upstream side of the request path: failures, retries and outlier ejection."""

    def __init__(
        self,
        config: GatewayConfig,
        controller: AdmissionController,
        bridge: AdmissionBridge,
        discovery: Discovery,
        metrics: GatewayMetrics,
        tenants: TenantLimiter,
        release: Callable[[RequestContext], None],
    ) -> None:
        self.config = config
        self.controller = controller
        self.bridge = bridge
        self.discovery = discovery
        self.metrics = metrics
        self.tenants = tenants
        # The pipeline's release stage: a retry gives its failed admission back first.
        self._release = release
        self._retry_once = config.upstream.retry_once
        # The engine ranks of a vLLM data-parallel server share its URL: a refused
        # connection says every one of them is down.
        self._same_server = {
            rc.name: [o.name for o in config.replicas if o.url == rc.url] for rc in config.replicas
        }
        self._loop = asyncio.get_running_loop()
        self.ejection = OutlierEjection.from_config(
            config.outlier, [rc.name for rc in config.replicas]
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
        self.bridge.resolve(self.controller.set_ejected(change.replica, change.ejected, change.at))

    def answered(self, ctx: RequestContext, replica: str) -> None:
        """The relay returned from `replica`: a failure after the stream had started is
        counted and logged (too late to retry); any other answer ends its failure run."""
        if ctx.upstream_error is None:
            self.ejection.success(replica)
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

    async def recovered(self, ctx: RequestContext, replica: str, f: UpstreamFailure) -> bool:
        """Count and report `replica`'s failure `f` (no byte reached the client yet);
        True when the request is now admitted to another replica, to be sent again."""
        self.metrics.upstream_errors.labels(replica, f.kind).inc()
        self.ejection.failure(replica, f.kind)
        log.warning(
            "upstream %s failed for %s: %s",
            replica,
            ctx.request_id,
            f.message,
            extra={"fields": {"replica": replica, "kind": f.kind, "request_id": ctx.request_id}},
        )
        if f.kind == "connect":
            for name in self._same_server[replica]:
                self.controller.mark_unready(name, self._loop.time())
                self.discovery.mark_down(name)
        return bool(
            f.retryable
            and self._retry_once
            and ctx.attempts == 0
            and await self._readmit(ctx, replica, f.kind)
        )

    def answer(self, ctx: RequestContext, replica: str, f: UpstreamFailure) -> ApiError:
        """The error the client gets for a failure that was not retried."""
        ctx.upstream_error = f.kind
        if f.answer is not None:
            # The engine's own error, with its status and message; an overloaded
            # engine's 503 (or 429) says when to come back, as kvgate's own do.
            answer = f.answer
            answer.outcome = f"upstream_{f.kind}"
            if answer.status in (429, 503) and answer.retry_after is None:
                answer.retry_after = self.controller.retry_after(
                    ctx.model, ctx.reserved or ctx.prompt_tokens, self._loop.time()
                )
            return answer
        if f.kind == "timeout":
            return ApiError(
                504,
                f"Replica {replica} timed out.",
                code="upstream_timeout",
                outcome="upstream_timeout",
            )
        return ApiError(
            502,
            f"Replica {replica} failed: {f.client_message}.",
            code=f"upstream_{f.kind}",
            outcome=f"upstream_{f.kind}",
        )

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
        self._release(ctx)
        now = self._loop.time()
        ctrl = self.controller
        ctrl.mark_unready(failed, now)
        rid = f"{ctx.request_id}.{ctx.attempts}"
        ctx.admission_id = rid
        waiter = None
        try:
            verdict = ctrl.submit(
                # First arrival: ahead of the requests that came after it.
                admission_request(
                    ctx,
                    rid,
                    arrival=ctx.arrival,
                    deadline=ctx.deadline,
                    priority=ctx.priority,
                    targets=self.tenants.tenants.get(ctx.tenant),
                ),
                now,
            )
            self.bridge.resolve(ctrl.take_displaced())
            if isinstance(verdict, Queued):
                # Before the reinstatement below: it may admit this very entry.
                waiter = self.bridge.expect(rid)
        finally:
            if kind != "connect":
                self.discovery.reinstate(failed)
        if waiter is not None:
            verdict = await self.bridge.wait_queued(rid, waiter)
        if isinstance(verdict, Shed) and verdict.reason == "shutdown":
            raise shutting_down(self.config)
        if isinstance(verdict, Admit):
            ctx.admitted(verdict, self._loop.time())
            self.metrics.retries.labels(failed, kind).inc()
            return True
        self._release(ctx)
        return False
