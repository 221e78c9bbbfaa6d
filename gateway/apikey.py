"""The tenant a request's API key names: the one rule every endpoint shares (a 401
``invalid_api_key`` without a valid key, once any key is configured; without configured
keys every request is tenant ``default``). The key comes as OpenAI's clients send it,
``Authorization: Bearer``, or as Anthropic's, ``x-api-key``."""

from __future__ import annotations

from aiohttp import web

from admission.tenants import TenantLimiter
from gateway.errors import ApiError
from gateway.outcome import denied


def tenant_of(limiter: TenantLimiter, request: web.Request) -> str:
    """The tenant of the request's key (``Authorization: Bearer``, else ``x-api-key``; by
    its SHA-256 digest, compared in constant time), or a 401. Only the key decides: no
    header names another."""
    key = ""
    if limiter.auth_required:
        auth = request.headers.get("Authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if not key:
            key = request.headers.get("x-api-key", "").strip()
    tenant = limiter.authenticate(key)
    if tenant is None:
        raise ApiError(
            401,
            "Incorrect API key provided."
            if key
            else "Missing API key: send Authorization: Bearer <key> (or x-api-key: <key>).",
            code="invalid_api_key",
            outcome=denied("unauthorized"),
        )
    return tenant
