"""Reading a request body: within its size limit and its time limit, then as JSON.

A body over ``limits.max_body_bytes`` is a 413, whether its Content-Length says so or
its bytes do; a body that has not arrived within ``limits.body_timeout_s`` is a 408 (a
slow body holds a connection and a handler). JSON that is not valid is a 400, and so
is valid JSON with a string that is not Unicode text (a lone surrogate escape such as
``"\ud800"``): no engine can encode it, and sent on, it would come back as the engine's
500 and count against a replica that did nothing wrong (invariant 8, docs/principles.md).
"""

from __future__ import annotations

import asyncio
import json

import orjson
from aiohttp import web

from gateway.errors import ApiError, invalid_request
from gateway.outcome import denied


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
            close=True,  # the rest of the body is not awaited (gateway.http)
        ) from None
    if len(raw) > max_bytes:
        raise _too_large(max_bytes)
    return raw


_JSON_SPACE = b" \t\r\n"


def with_member(raw: bytes, member: bytes) -> bytes | None:
    """`raw` (a JSON object) with `member` (``"name":value``) first, every byte the client
    sent kept as it was; None where something other than whitespace comes before the
    opening brace (a BOM): the caller re-serialises."""
    i, n = 0, len(raw)
    while i < n and raw[i] in _JSON_SPACE:
        i += 1
    if i >= n or raw[i] != 0x7B:  # "{"
        return None
    j = i + 1
    while j < n and raw[j] in _JSON_SPACE:
        j += 1
    comma = b"," if j < n and raw[j] != 0x7D else b""  # "}": an empty object
    return raw[: i + 1] + member + comma + raw[i + 1 :]


def loads(raw: bytes) -> object:
    """The body's JSON: orjson, and the standard library for what orjson refuses but
    JSON parsers commonly accept (a lone surrogate escape, a byte-order mark), so the
    faster parser changes no answer. Invalid JSON is a 400, and so are NaN and Infinity
    (not JSON, RFC 8259: an engine would choke on them) and nesting past the parser's
    depth (orjson stops at 1024 levels; the standard library's recursion limit). A
    string with a lone surrogate is a 400 naming where it is: orjson refuses every such
    body, so only the fallback's documents are searched and the common path pays nothing."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    try:
        doc = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise invalid_request("Request body is nested too deeply.", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid_request(f"Request body is not valid JSON: {e}", code="invalid_json") from None
    where = _not_text(doc)
    if where is not None:
        loc = ".".join(where) or "body"
        raise invalid_request(
            f"{loc}: the string holds a lone surrogate (a \\ud800-\\udfff escape without "
            "its pair), which is not Unicode text and cannot be tokenized.",
            param=where[0] if where else None,
            code="invalid_unicode",
        )
    return doc


def _not_text(doc: object) -> list[str] | None:
    """The path (keys and list indexes) to a string in `doc`, a member name or
    a value, that does not encode as UTF-8; None when every one does. A loop, not
    recursion: the document may be nested as deep as the parser allowed."""
    stack: list[tuple[object, list[str]]] = [(doc, [])]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not _is_text(value):
                return path
        elif isinstance(value, dict):
            for key, item in value.items():
                if not _is_text(key):
                    return [*path, key.encode("utf-8", "backslashreplace").decode()]
                stack.append((item, [*path, key]))
        elif isinstance(value, list):
            stack.extend((item, [*path, str(i)]) for i, item in enumerate(value))
    return None


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"Request body exceeds the limit of {limit} bytes.",
        code="request_too_large",
        outcome=denied("too_large"),
    )
