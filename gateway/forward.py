"""The engine endpoints that take no KV reservation, forwarded as they are.

Two kinds, both behind the tenant's key (``Authorization: Bearer`` or ``x-api-key``) and
each answered in its API's dialect:

- **by model**: Anthropic's ``POST /v1/messages/count_tokens`` and vLLM's ``POST
  /tokenize`` and ``/detokenize`` run the model's tokenizer and template on the replica,
  nothing more: they go to a ready replica serving the body's ``model`` (in turn), for a
  tenant allowed that model. A model no ready replica serves is a 404 (or a 503 while
  some replica has not answered its first probe).
- **stored responses**: ``GET /v1/responses/{id}`` (and ``/input_items``), ``POST
  /v1/responses/{id}/cancel`` and ``DELETE /v1/responses/{id}`` go to the replica that
  stored the response (gateway/stored_responses.py); an id kvgate does not know, or
  whose replica is gone, is a 404 that says which.

Each counts as one request against the tenant's requests per minute (no tokens): over
it, the 429 the admitted endpoints give. The engine's answer (status, body, content
type) is relayed unchanged.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

import aiohttp
import orjson
from aiohttp import web

from admission.tenants import TenantLimiter
from gateway.apikey import tenant_of
from gateway.body import read_body
from gateway.config import GatewayConfig
from gateway.default_model import fill_model
from gateway.denials import model_not_found, rate_limited
from gateway.endpoints import PASSED_HEADERS
from gateway.errors import ApiError, Dialect, invalid_request
from gateway.fleet.discovery import Discovery
from gateway.metrics import GatewayMetrics
from gateway.outcome import denied
from gateway.stored_responses import StoredResponses


class Forwarder:
    def __init__(
        self,
        config: GatewayConfig,
        tenants: Callable[[], TenantLimiter],
        discovery: Discovery,
        session: aiohttp.ClientSession,
        stored: Callable[[], StoredResponses],
        metrics: GatewayMetrics,
    ) -> None:
        self._tenants = tenants
        self._metrics = metrics
        self._discovery = discovery
        self._session = session
        self._stored = stored
        self._max_body = config.limits.max_body_bytes
        self._body_timeout = config.limits.body_timeout_s
        self._timeout = config.upstream.total_s
        self._turn = itertools.count()

    async def by_model(self, request: web.Request, path: str, dialect: Dialect) -> web.Response:
        """Forward ``POST path`` to a replica serving the body's model."""
        try:
            tenant = tenant_of(self._tenants(), request)
            raw = await read_body(request, self._max_body, self._body_timeout)
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError:
                raise invalid_request("Request body is not valid JSON.") from None
            if isinstance(body, dict) and dialect == "openai":  # as vLLM: its one model
                d = self._discovery
                raw = fill_model(body, raw, True, d.served, d.bases_of)
            model = body.get("model") if isinstance(body, dict) else None
            if not isinstance(model, str) or not model:
                raise invalid_request("model: Field required", param="model")
            if not self._tenants().get(tenant).may_use(model, self._discovery.bases_of(model)):
                raise model_not_found(model)
            self._one_request(tenant)
            replica = self._pick(model)
            return await self._send(request, "POST", replica, path, raw)
        except ApiError as e:
            return e.response(None, dialect)

    async def stored_response(self, request: web.Request) -> web.StreamResponse:
        """``/v1/responses/{id}[/cancel|/input_items]``, at the replica that stored it."""
        try:
            self._one_request(tenant_of(self._tenants(), request))
            rid = request.match_info["response_id"]
            held = await self._stored().lookup(rid, asyncio.get_running_loop().time())
            if held is None:
                raise ApiError(
                    404,
                    f"Response with id '{rid}' not found.",
                    code="response_not_found",
                    outcome=denied("response_not_found"),
                )
            w = self._discovery.watchers.get(held.replica)
            if w is None or not w.state.ready:
                raise ApiError(
                    404,
                    f"Response with id '{rid}' not found: the replica that stored it "
                    f"({held.replica}) is {'gone' if w is None else 'not ready'}.",
                    code="response_not_found",
                    outcome=denied("response_not_found"),
                )
            raw = await read_body(request, self._max_body, self._body_timeout)
            resp = await self._send(request, request.method, held.replica, request.path, raw)
            if request.method == "DELETE" and resp.status == 200:
                self._stored().forget(rid)
            return resp
        except ApiError as e:
            return e.response()

    def _one_request(self, tenant: str) -> None:
        """Charge one request to `tenant`'s requests per minute; 429 over it."""
        policy = self._tenants().get(tenant)
        if policy.rpm is None:
            return
        now = asyncio.get_running_loop().time()
        if (wait := policy.rpm.wait(1, now)) > 0:
            self._metrics.tenant_rate_limited(tenant, "requests")  # as the completions'
            raise rate_limited(policy, "requests", 0, wait, now)
        policy.rpm.charge(1, now)

    def _pick(self, model: str) -> str:
        ready = [
            name
            for name, w in self._discovery.watchers.items()
            if w.state.ready and model in w.state.models
        ]
        if not ready:
            if model in self._discovery.known_models:
                raise ApiError(
                    503,
                    f"No replica serving `{model}` is ready (down, starting or ejected).",
                    code="no_replica_ready",
                    retry_after=1.0,
                )
            raise model_not_found(model)
        return ready[next(self._turn) % len(ready)]

    async def _send(
        self, request: web.Request, method: str, replica: str, path: str, raw: bytes
    ) -> web.Response:
        endpoint = self._discovery.endpoints[replica]
        headers = dict(endpoint.upstream_headers)
        headers.update((n, v) for n in PASSED_HEADERS if (v := request.headers.get(n)))
        if raw and "content-type" not in headers:
            headers["content-type"] = "application/json"
        url = endpoint.url + path + (f"?{request.query_string}" if request.query_string else "")
        try:
            async with asyncio.timeout(self._timeout):
                async with self._session.request(
                    method, url, data=raw or None, headers=headers
                ) as up:
                    body = await up.read()
                    ctype = up.headers.get("Content-Type", "application/json")
                    status = up.status
        except (aiohttp.ClientError, TimeoutError):
            raise ApiError(
                502, f"replica {replica} did not answer", code="upstream_unreachable"
            ) from None
        return web.Response(status=status, body=body, headers={"Content-Type": ctype})
