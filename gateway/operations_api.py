"""The operations endpoints: ``/health``, ``/ready``, ``/metrics``, ``/admin/replicas``
and ``/admin/state``.

``/health`` says the process answers; ``/ready`` says whether any replica is ready
(503 while draining, so a load balancer stops sending); ``/metrics`` is the Prometheus
text; the two admin endpoints ask for the admin token (``auth.admin_token``) and show
the replicas as admission and discovery see them, and the shared state's lease.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Protocol

from aiohttp import web

from gateway.admin import replicas_snapshot, require_admin
from gateway.config import GatewayConfig
from gateway.door import AdmissionDoor
from gateway.errors import ApiError
from gateway.fleet.discovery import Discovery
from gateway.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gateway.metrics import GatewayMetrics
from gateway.pipeline import Pipeline
from gateway.state.sharing import StateSync


class RunningGateway(Protocol):
    """What these endpoints read of the running app (`gateway.gateway_state.GatewayState`)."""

    config: GatewayConfig
    door: AdmissionDoor
    discovery: Discovery
    pipeline: Pipeline
    metrics: GatewayMetrics
    sync: StateSync | None


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        status=status, body=json.dumps(data).encode(), content_type="application/json"
    )


class OperationsApi:
    def __init__(self, st: RunningGateway) -> None:
        self._st = st  # read at each request: the start-up context fills it in

    async def health(self, request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        st = self._st
        if st.pipeline.draining:
            return _json({"ready": False, "draining": True, "replicas": []}, status=503)
        ready = [u.name for u in st.door.report.replica_usage() if u.ready]
        return _json({"ready": bool(ready), "replicas": ready}, status=200 if ready else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self._st.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE}
        )

    def _refused(self, request: web.Request) -> web.Response | None:
        """The 401 answer to a request without the admin token, else None."""
        try:
            require_admin(request, self._st.config.auth.admin_token)
        except ApiError as e:
            return e.response()
        return None

    async def admin_replicas(self, request: web.Request) -> web.Response:
        st = self._st
        if (refused := self._refused(request)) is not None:
            return refused
        return _json(
            replicas_snapshot(
                st.door.report,
                st.discovery,
                st.pipeline.outliers,
                asyncio.get_running_loop().time(),
                retry_budget=st.door.report.retry_budget_readings(),
                told_waits=st.door.report.told_wait_readings(),
            )
        )

    async def admin_state(self, request: web.Request) -> web.Response:
        st = self._st
        if (refused := self._refused(request)) is not None:
            return refused
        if st.sync is None:
            return _json({"backend": st.config.state.backend, "up": True, "shared": False})
        return _json({**st.sync.snapshot(), "shared": True})
