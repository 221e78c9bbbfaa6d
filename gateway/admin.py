"""Operator endpoints under ``/admin``, behind ``Authorization: Bearer <admin token>``.

``GET /admin/replicas`` shows, per replica, what admission decides with: the discovered
and effective capacity, what is reserved and running, the queue for the models it
serves, the learned running limit and what last moved it, and which ceiling (KV
capacity, a configured or engine running cap, the learned latency limit, not ready, or
an outlier ejection) currently binds, and each replica's ejections; and beside the
replicas, the patience learned of clients that state no timeout, per tenant, model and
stream (``client_patience``), how many unserved attempts clients that do not say
which retry they send give up after, per tenant (``client_retry_budget``), and whose
clock clients' timeouts are and the longest wait told them (``client_told_waits``).
Without a configured admin token the admin API is closed (401), never open.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Iterable
from typing import Any

from aiohttp import web

from admission.health import OutlierDetector
from admission.learned.retry_budget import BudgetReading
from admission.learned.toldwait import ToldWaitReading
from admission.report import AdmissionReport
from admission.types import ReplicaUsage
from gateway.errors import ApiError
from gateway.fleet.discovery import Discovery
from gateway.logging import iso8601
from gateway.outcome import denied


def replicas_snapshot(
    report: AdmissionReport,
    discovery: Discovery,
    outliers: OutlierDetector | None = None,
    now: float = 0.0,
    wall: float | None = None,
    retry_budget: Iterable[BudgetReading] = (),
    told_waits: Iterable[ToldWaitReading] = (),
) -> dict[str, Any]:
    """`now` is the loop's clock (what admission stamps with), `wall` the same instant
    on the wall clock: times are shown as ISO 8601 UTC."""
    wall = time.time() if wall is None else wall
    usage = {u.name: u for u in report.replica_usage()}
    queue = {m: report.queue_depth(m) for m in sorted(discovery.known_models)}
    out = []
    for name, w in discovery.watchers.items():
        s = w.state
        u = usage.get(name)
        models = list(u.models) if u else list(s.models)
        until = outliers.ejected_until(name) if outliers is not None else None
        limit = report.limit_of(name)
        out.append(
            {
                "name": name,
                "url": s.base_url,
                "engine": s.engine,
                "labels": dict(s.labels),
                "ready": bool(u and u.ready),
                "models": models,
                "capacity_tokens": u.capacity_tokens if u else s.capacity_tokens,
                "capacity_pinned": w.config.pool_tokens is not None,
                "effective_capacity_tokens": u.effective_capacity_tokens if u else 0,
                "reserved_tokens": u.reserved_tokens if u else 0,
                "held": u.held if u else 0,
                "preempts": s.preempts,
                "private_slots": s.private_slots,
                "running": u.running if u else 0,
                "max_running": u.max_running if u else s.max_running,
                "queue": sum(queue.get(m, 0) for m in models),
                "binding_ceiling": u.binding_ceiling if u else "not_ready",
                "ejected": bool(u and u.ejected),
                "ejected_for_s": round(max(0.0, until - now), 3) if until is not None else None,
                "ejections": outliers.ejections(name) if outliers is not None else 0,
                "limit": u.limit if u else None,
                "limit_reason": u.limit_reason if u else "",
                # What moved the limit, and on what evidence (admission/learned/limitlog.py).
                "limit_changes": [
                    {"at": iso8601(wall - (now - c.at)), **c.fields()}
                    for c in (limit.history.changes if limit is not None else ())
                ],
                # What the queue predicts of a request's service here (an upper estimate
                # at the load it runs): seconds = base + per token of prompt and output.
                "service": _service(u) if u else None,
                "block_size": s.block_size,
                "max_model_len": s.max_model_len,
                "engine_running": s.engine_running,
                "engine_waiting": s.engine_waiting,
                "engine_kv_usage": s.kv_usage,
                "updated_at": iso8601(wall - (now - s.updated_at)) if s.updated_at else None,
                # Why the last probe round left it not ready (None: it was ready), the most
                # recent such cause and when it began, and the last round that was good.
                "error": w.error,
                "last_error": w.last_error,
                "last_error_at": iso8601(w.last_error_at),
                "last_ok": iso8601(w.last_ok),
            }
        )
    # What admission learned of clients that state no timeout (admission/learned/patience.py).
    patience = [
        {
            "tenant": r.tenant,
            "model": r.model,
            "stream": r.stream,
            "patience_s": None if r.patience_s is None else round(r.patience_s, 3),
            # True: it bounds the whole response; False: a stream's first token and gaps.
            "whole_response": r.whole,
            # True: another gateway process learned it (shared state); none learned here.
            "shared": r.shared,
            "observed": r.observed,
            "left": r.left,
            "window_departures": r.window_events,
        }
        for r in report.patience_readings()
    ]
    # How many unserved attempts such clients give up after (admission/learned/retry_budget.py;
    # the key's name predates departures counting as unserved).
    retries = [
        {"tenant": r.tenant, "gives_up_after_sheds": r.attempts, "came_back": r.came_back,
         "gave_up": r.gave_up}
        for r in retry_budget
    ]  # fmt: skip
    # Whose clock clients' timeouts are and the longest wait told them on an estimate
    # (admission/learned/toldwait.py; null: any).
    told = [r._asdict() for r in told_waits]
    return {
        "replicas": out,
        "queue": queue,
        "client_patience": patience,
        "client_told_waits": told,
        "client_retry_budget": retries,
    }


def _service(u: ReplicaUsage) -> dict[str, Any] | None:
    plane = u.service_plane
    if plane is None:
        return None
    return {
        "base_s": round(plane.base, 4),
        "per_prompt_token_s": round(plane.per_prompt, 7),
        "per_output_token_s": round(plane.per_output, 6),
        "samples": u.service_samples,
        "load_elasticity": None if u.service_elasticity is None else round(u.service_elasticity, 3),
    }


def check_bearer(request: web.Request, token: str | None) -> bool:
    """Constant-time check of ``Authorization: Bearer <token>``."""
    if not token:
        return False
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() != "bearer ":
        return False
    return hmac.compare_digest(auth[7:].strip().encode(), token.encode())


def require_admin(request: web.Request, token: str | None) -> None:
    if not check_bearer(request, token):
        raise ApiError(
            401,
            "Admin API requires Authorization: Bearer <admin token>"
            + ("" if token else " (no admin token is configured, so it is disabled)")
            + ".",
            code="invalid_admin_token",
            outcome=denied("unauthorized"),
        )
