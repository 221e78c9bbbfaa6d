"""``GET /v1/models`` and ``GET /v1/models/{id}``, as OpenAI answers them.

Both ask for the API key as the completions endpoints do (401 ``invalid_api_key``
without a valid one, once any key is configured) and list only what the key's tenant
may use (``tenants[].models``) among the models a replica serves. A model outside that
list is ``404 model_not_found``, the answer a completion for it gets.
"""

from __future__ import annotations

from collections.abc import Callable

import orjson
from aiohttp import web

from admission.tenants import TenantLimiter
from gateway.apikey import tenant_of
from gateway.errors import ApiError


def _model(m: str) -> dict[str, object]:
    return {"id": m, "object": "model", "created": 0, "owned_by": "kvgate"}


def _json(data: object) -> web.Response:
    return web.Response(body=orjson.dumps(data), content_type="application/json")


class ModelsApi:
    def __init__(
        self, tenants: Callable[[], TenantLimiter], served: Callable[[], set[str]]
    ) -> None:
        self._tenants = tenants  # a getter: a live reload replaces the limiter
        self._served = served

    def _visible(self, request: web.Request) -> list[str]:
        limiter = self._tenants()
        tenant = tenant_of(limiter, request)
        policy = limiter.get(tenant)
        return sorted(m for m in self._served() if policy.may_use(m))

    async def list(self, request: web.Request) -> web.Response:
        try:
            models = self._visible(request)
        except ApiError as e:
            return e.response()
        return _json({"object": "list", "data": [_model(m) for m in models]})

    async def get(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        try:
            models = self._visible(request)
        except ApiError as e:
            return e.response()
        if model not in models:
            return ApiError(
                404,
                f"The model `{model}` does not exist or you do not have access to it.",
                code="model_not_found",
                param="model",
            ).response()
        return _json(_model(model))
