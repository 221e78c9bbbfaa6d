"""The OpenAI API as enginesim's servers speak it: error objects, the request schemas,
the chat rendering, and a parsed request ready for the core. Both flavors' routes use
them (`enginesim.server` for vLLM and SGLang, `enginesim.llamacpp_api` for llama.cpp).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from enginesim import tokenizer
from enginesim.types import SimRequest

MAX_BODY_BYTES = 64 * 1024 * 1024  # long-context prompts are large; aiohttp's 1 MiB is not

# --------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestEntityTooLarge",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    501: "NotImplementedError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class ApiError(Exception):
    """An error a handler answers with: HTTP status plus an OpenAI error object.

    `type` overrides the error type string of the flavor's default for the status.
    """

    def __init__(
        self, status: int, message: str, param: str | None = None, type: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type


def error_type(status: int) -> str:
    """vLLM's error type for an HTTP status: the exception class name it raised."""
    return _ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")


def error_response(status: int, message: str, param: str | None = None) -> web.Response:
    err_type = error_type(status)
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return web.json_response(body, status=status)


# --------------------------------------------------------------------------------------
# Request schemas (what vLLM accepts; unknown fields are allowed and ignored)
# --------------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[_ContentPart] | None = None


class _SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None  # optional in vLLM: the served model is the default
    max_tokens: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    priority: int = 0


SamplingRequest = _SamplingRequest  # what any generating request carries to the core


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True


def validation_error(exc: ValidationError) -> ApiError:
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    msg = first.get("msg", "invalid request")
    return ApiError(400, f"{loc}: {msg}" if loc else msg, loc.split(".")[0] if loc else None)


def validated(model: type[BaseModel], body: Any) -> Any:
    """A JSON body as `model`, or the 400 vLLM answers (the agent and serving APIs)."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def hex16() -> str:
    """vLLM's random_uuid(): 16 hex digits."""
    return f"{uuid.uuid4().int & (2**64 - 1):016x}"


def dumps(obj: Any) -> str:
    """Compact JSON, as an SSE event's data."""
    return json.dumps(obj, separators=(",", ":"))


async def read_json(request: web.Request) -> Any:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise ApiError(413, f"request body is larger than {MAX_BODY_BYTES} bytes") from exc
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from exc


def bound_max_tokens(
    limit: int, n_prompt: int, max_tokens: int | None, max_param: str, prompt_param: str
) -> int:
    """vLLM's length checks of a generating request: its output bound, or a 400.

    `limit` is max_model_len; no bound means the rest of the context.
    """
    if n_prompt == 0:
        raise ApiError(400, "The prompt is empty; at least one token is required.", prompt_param)
    if n_prompt >= limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your "
            f"request has {n_prompt} input tokens. Please reduce the length of the "
            "input messages.",
            prompt_param,
        )
    if max_tokens is None:
        return limit - n_prompt
    if max_tokens < 1:
        raise ApiError(400, f"{max_param} must be at least 1, got {max_tokens}.", max_param)
    if n_prompt + max_tokens > limit:
        raise ApiError(
            400,
            f"'{max_param}' is too large: {max_tokens}. This model's maximum context "
            f"length is {limit} tokens and your request has {n_prompt} input tokens "
            f"({max_tokens} > {limit} - {n_prompt}).",
            max_param,
        )
    return max_tokens


def render_chat(messages: list[ChatMessage], tools: Any = None) -> str:
    """The prompt text a chat template would produce, tool definitions and calls included.

    Real templates render `tools` into the system prompt and an assistant turn's
    `tool_calls` as text, so both cost prompt tokens (and they are what marks a request
    as agentic to the workload classifier).
    """
    rendered: list[dict[str, Any]] = []
    if tools:
        rendered.append({"role": "system", "content": json.dumps({"tools": tools})})
    for m in messages:
        msg = m.model_dump()
        calls = msg.get("tool_calls")
        if calls and not msg.get("content"):
            msg["content"] = json.dumps({"tool_calls": calls})
        rendered.append(msg)
    return tokenizer.apply_chat_template(rendered)


# --------------------------------------------------------------------------------------
# A parsed request, ready for the core
# --------------------------------------------------------------------------------------


@dataclass(slots=True)
class Prepared:
    kind: Literal["chat", "completion"]
    public_id: str
    model: str
    created: int
    sim: SimRequest
    stream: bool
    include_usage: bool
    continuous_usage: bool
    drop_after: int | None  # the `drop` fault, captured when the request started
