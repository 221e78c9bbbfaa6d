"""The endpoints kvgate admits, and what each one means for a request: the schema of
its body, the engine's path, the dialect of its errors.

Generating endpoints (chat, completions, the Responses API, Anthropic's Messages API)
reserve their prompt and their output; pooling endpoints (embeddings, rerank, score,
classify, pooling) prefill their inputs and generate nothing, so they reserve their
prompt only. Endpoints that take no KV at all (count_tokens, tokenize, stored responses)
are forwarded, not admitted (gateway/forward.py).
"""

from __future__ import annotations

from gateway.context import Kind
from gateway.errors import Dialect
from gateway.schemas import (
    AudioRequest,
    ChatCompletionRequest,
    CompletionRequest,
    MessagesRequest,
    ParsedRequest,
    PoolingRequest,
    ResponsesRequest,
)

UPSTREAM_PATHS: dict[Kind, str] = {
    "chat": "/v1/chat/completions",
    "completion": "/v1/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
    "embeddings": "/v1/embeddings",
    "rerank": "/v1/rerank",
    "score": "/v1/score",
    "classify": "/classify",
    "pooling": "/pooling",
    "transcription": "/v1/audio/transcriptions",
    "translation": "/v1/audio/translations",
}
# A pooling path has aliases (vLLM: /rerank, /v1/rerank, /v2/rerank; /score, /v1/score):
# the engine gets the one the client used.
ALIASES: dict[str, Kind] = {"/rerank": "rerank", "/v2/rerank": "rerank", "/score": "score"}
POOLING: frozenset[Kind] = frozenset({"embeddings", "rerank", "score", "classify", "pooling"})
# Audio endpoints take a multipart form (the audio file and its fields), not JSON.
AUDIO: frozenset[Kind] = frozenset({"transcription", "translation"})
SCHEMAS: dict[Kind, type[ParsedRequest]] = {
    "chat": ChatCompletionRequest,
    "completion": CompletionRequest,
    "responses": ResponsesRequest,
    "messages": MessagesRequest,
    **{kind: PoolingRequest for kind in POOLING},
    **{kind: AudioRequest for kind in AUDIO},
}
# Client headers the engine gets as sent: the body's type (a form's boundary), Anthropic's
# API version and betas.
PASSED_HEADERS = ("content-type", "anthropic-version", "anthropic-beta")


def dialect_of(kind: Kind) -> Dialect:
    return "anthropic" if kind == "messages" else "openai"
