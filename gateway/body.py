"""Reading a request body: within its size limit and its time limit, then as JSON.

A body over ``limits.max_body_bytes`` is a 413, whether its Content-Length says so or
its bytes do; a body that has not arrived within ``limits.body_timeout_s`` is a 408 (a
slow body holds a connection and a handler). JSON that is not valid is a 400.
"""

from __future__ import annotations

import asyncio
import json

import orjson
from aiohttp import web

from gateway.errors import ApiError, invalid_request


async def read_body(request: web.Request, max_bytes: int, timeout_s: float) -> bytes:
    """The request's body, or the 413 or 408 that says why not."""
    length = request.content_length
    if length is not None and length > max_bytes:
        raise _too_large(max_bytes)
    try:
        if request.content.is_eof():  # the whole body came with the head
            raw = await request.read()
        else:
            async with asyncio.timeout(timeout_s):
                raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(max_bytes) from None
    except TimeoutError:
        raise ApiError(
            408,
            f"The request body did not arrive within {timeout_s:g} s.",
            code="body_timeout",
        ) from None
    if len(raw) > max_bytes:
        raise _too_large(max_bytes)
    return raw


def loads(raw: bytes) -> object:
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


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"Request body exceeds the limit of {limit} bytes.",
        code="request_too_large",
        outcome="too_large",
    )
