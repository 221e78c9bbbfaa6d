"""``GET /v1/models`` and ``GET /v1/models/{id}``, as OpenAI answers them.

Both ask for the API key as the completions endpoints do (401 ``invalid_api_key``
without a valid one, once any key is configured) and list only what the key's tenant
may use (``tenants[].models``) among the models a replica serves. A model outside that
list is ``404 model_not_found``, the answer a completion for it gets.

LoRA adapters are models: one a replica lists (vLLM: ``parent`` names its base) is
listed for a tenant allowed its base, or allowed the adapter by name, with ``parent``
naming its base as vLLM's own card does (``bases_of``: discovery's
`ModelCatalog.bases_of`; without it only a model's own name counts).
"""

from __future__ import annotations

from collections.abc import Callable

import orjson
from aiohttp import web

from admission.tenants import TenantLimiter
from gateway.apikey import tenant_of
from gateway.denials import model_not_found
from gateway.errors import ApiError

BasesOf = Callable[[str], frozenset[str]]


def _no_bases(model: str) -> frozenset[str]:
    return frozenset()


def _model(m: str, bases: frozenset[str]) -> dict[str, object]:
    card: dict[str, object] = {"id": m, "object": "model", "created": 0, "owned_by": "kvgate"}
    if bases:  # vLLM's card: `parent` names an adapter's base, null for a base model
        card["parent"] = next(iter(bases)) if len(bases) == 1 and m not in bases else None
    return card


def _json(data: object) -> web.Response:
    return web.Response(body=orjson.dumps(data), content_type="application/json")


class ModelsApi:
    def __init__(
        self,
        tenants: Callable[[], TenantLimiter],
        served: Callable[[], set[str]],
        bases_of: BasesOf = _no_bases,
    ) -> None:
        self._tenants = tenants  # a getter: a live reload replaces the limiter
        self._served = served
        self._bases_of = bases_of

    def _visible(self, request: web.Request) -> list[tuple[str, frozenset[str]]]:
        limiter = self._tenants()
        tenant = tenant_of(limiter, request)
        policy = limiter.get(tenant)
        out = []
        for m in sorted(self._served()):
            bases = self._bases_of(m)
            if policy.may_use(m, bases):
                out.append((m, bases))
        return out

    async def list(self, request: web.Request) -> web.Response:
        try:
            models = self._visible(request)
        except ApiError as e:
            return e.response()
        return _json({"object": "list", "data": [_model(m, b) for m, b in models]})

    async def get(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        try:
            models = dict(self._visible(request))
        except ApiError as e:
            return e.response()
        if model not in models:
            return model_not_found(model).response()
        return _json(_model(model, models[model]))
