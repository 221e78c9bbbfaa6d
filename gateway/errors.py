"""Errors in the dialect of the API a client speaks.

Every error kvgate answers on the OpenAI surface (chat, completions, the Responses API,
embeddings...) is an OpenAI error object ``{"error": {"message", "type", "param",
"code"}}``; on Anthropic's Messages API it is Anthropic's ``{"type": "error", "error":
{"type", "message"}, "request_id"}``, with overload as 529 ``overloaded_error`` (a shed
request: the anthropic SDKs and Claude Code retry it, reading ``retry-after``). Clients
written against either SDK raise typed exceptions from exactly these fields and statuses,
so they behave the same in front of kvgate as in front of the API they were written for.
Pipeline stages raise `ApiError`; the handler renders it in the request's dialect in one
place.
"""

from __future__ import annotations

import json
import math
from typing import Literal

from aiohttp import web

from gateway.outcome import Outcome, denied, upstream

# OpenAI's `type` values, keyed by the status they go with.
_TYPE_FOR_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "upstream_error",
    503: "overloaded_error",
    504: "timeout_error",
}


# Anthropic's error `type` for a status (its API's documented set); 503, kvgate's
# "come back later", is Anthropic's 529 overloaded_error.
_ANTHROPIC_TYPE_FOR_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}

Dialect = Literal["openai", "anthropic"]


def anthropic_status(status: int) -> int:
    """The status an Anthropic client expects for one of kvgate's (503 is 529 there)."""
    return 529 if status == 503 else status


def anthropic_error_body(
    message: str, status: int, request_id: str | None = None
) -> dict[str, object]:
    """Anthropic's error object for `status`."""
    etype = _ANTHROPIC_TYPE_FOR_STATUS.get(
        status, "api_error" if status >= 500 else "invalid_request_error"
    )
    body: dict[str, object] = {"type": "error", "error": {"type": etype, "message": message}}
    if request_id is not None:
        body["request_id"] = request_id
    return body


def error_body(
    message: str, *, type: str, param: str | None = None, code: str | None = None
) -> dict[str, dict[str, str | None]]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def retry_after_headers(seconds: float) -> dict[str, str]:
    """Retry-After as an integer number of seconds (RFC 9110 allows no fractions), plus
    ``retry-after-ms``, which the OpenAI SDKs read first, so a client retries at the
    honest moment rather than a whole second late."""
    seconds = max(0.0, seconds)
    return {
        "Retry-After": str(max(1, math.ceil(seconds))),
        "retry-after-ms": str(max(1, math.ceil(seconds * 1000))),
    }


# Set on a response whose connection ends with it (gateway.http closes it once written).
CLOSE_AFTER = web.ResponseKey("kvgate_close_after", bool)


class ApiError(Exception):
    """An error answered to the client as an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        retry_after: float | None = None,
        outcome: Outcome | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPE_FOR_STATUS.get(status, "invalid_request_error")
        self.retry_after = retry_after
        # How the request ended (gateway.outcome); an error kvgate answers by default.
        self.outcome = outcome or denied(code or f"http_{status}")
        self.close = close  # the answer ends the connection (Connection: close)

    def body(self) -> dict[str, dict[str, str | None]]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def to_bytes(self, dialect: Dialect = "openai", request_id: str | None = None) -> bytes:
        if dialect == "anthropic":
            return json.dumps(anthropic_error_body(self.message, self.status, request_id)).encode()
        return json.dumps(self.body()).encode()

    def response(
        self, extra_headers: dict[str, str] | None = None, dialect: Dialect = "openai"
    ) -> web.Response:
        headers = {}
        if self.retry_after is not None:
            headers.update(retry_after_headers(self.retry_after))
        if extra_headers:
            headers.update(extra_headers)
        status = self.status
        request_id = None
        if dialect == "anthropic":
            status = anthropic_status(status)
            request_id = headers.get("x-request-id")
            if request_id is not None:
                headers["request-id"] = request_id  # where the anthropic SDKs read it
        resp = web.Response(
            status=status,
            body=self.to_bytes(dialect, request_id),
            content_type="application/json",
            headers=headers,
        )
        if self.close:
            resp.force_close()
            resp[CLOSE_AFTER] = True  # gateway.http closes the connection once it is sent
        return resp

    def sse_event(self, dialect: Dialect = "openai", named: bool = False) -> bytes:
        """The error as one SSE event, for failures after a stream has started (the status
        line is already sent). The OpenAI SDKs raise an APIError on such an event; an
        Anthropic stream ends with ``event: error``, which the anthropic SDKs raise on.
        `named`: the stream's events carry an ``event:`` line (the Responses API's)."""
        if dialect == "anthropic":
            return b"event: error\ndata: " + self.to_bytes(dialect) + b"\n\n"
        if named:
            # The Responses API's error event: its own fields, and the error object a
            # client reading chat-style streams looks for.
            doc = {"type": "error", "code": self.code, "message": self.message,
                   "param": self.param, **self.body()}  # fmt: skip
            return b"event: error\ndata: " + json.dumps(doc).encode() + b"\n\n"
        return b"data: " + self.to_bytes() + b"\n\n"


# Engines' own error types that mean what an OpenAI client knows by another code.
_CODE_FOR_TYPE = {
    "exceed_context_size_error": "context_length_exceeded",  # llama.cpp, prompt over its slot
}
# Messages that say the request is longer than the model's context (vLLM, SGLang).
_CONTEXT_MESSAGES = ("maximum context length", "longer than the model's context length")


# An engine's message that carries a traceback, a source location or an address says
# more about the deployment than a client should learn (an engine's 500 often does); the
# fallback wording stands in for it and the engine's log keeps the details.
_LEAK_MARKERS = ("Traceback (most recent call last)", 'File "', "http://", "https://")


def _leaky(message: str) -> bool:
    return any(m in message for m in _LEAK_MARKERS)


def upstream_error(status: int, body: object, *, fallback: str) -> ApiError:
    """An engine's error answer as an OpenAI error object, keeping its status and message.

    `body` is the engine's parsed JSON (or anything else). Engines answer
    ``{"error": {...}}`` (llama.cpp, recent vLLM) or the fields at the top level
    (``{"object": "error", "message", "type", "code"}``: SGLang, older vLLM), often with
    a numeric ``code``. The ``code`` becomes a string a client can act on: the engine's
    own when it is a word, ``context_length_exceeded`` for a request longer than the
    context, else the number as a string. The ``type`` is OpenAI's for the status; the
    `fallback` message stands in when the engine gave none, or one with a traceback or
    an address in it.
    """
    err: dict[str, object] = {}
    if isinstance(body, dict):
        inner = body.get("error")
        if isinstance(inner, dict):
            err = inner
        elif isinstance(inner, str):
            err = {"message": inner}
        elif "message" in body:
            err = body
    message = err.get("message")
    if not isinstance(message, str) or not message or _leaky(message):
        message = fallback
    raw_code = err.get("code")
    etype = err.get("type")
    code: str | None = None
    if isinstance(raw_code, str) and raw_code and not raw_code.isdigit():
        code = raw_code
    elif isinstance(etype, str) and etype in _CODE_FOR_TYPE:
        code = _CODE_FOR_TYPE[etype]
    elif status == 400 and any(m in message for m in _CONTEXT_MESSAGES):
        code = "context_length_exceeded"
    elif isinstance(raw_code, int | str) and not isinstance(raw_code, bool):
        code = str(raw_code)
    else:
        code = str(status)
    param = err.get("param")
    return ApiError(
        status,
        message,
        code=code,
        param=param if isinstance(param, str) else None,
        type=_TYPE_FOR_STATUS.get(status, "server_error" if status >= 500 else None),
        outcome=upstream(status),
    )


def invalid_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(
        400, message, param=param, code=code or "invalid_request", outcome=denied("bad_request")
    )
