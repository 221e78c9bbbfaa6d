"""Pooling requests' inputs and outputs as vLLM checks and shapes them.

Shared by `/v1/embeddings` (`enginesim.agent_api`) and the pooling routes of
`enginesim.serving_api` (score, rerank, classify, pooling): an `input` as its prompts,
each prompt's length check, the list answer, and the embedding vector (a deterministic
function of the tokens).
"""

from __future__ import annotations

import hashlib
import struct
import time
from typing import Any

from aiohttp import web

from enginesim import tokenizer
from enginesim.api import ApiError

EMBED_DIM = 8  # floats per embedding


def embedding_vector(token_ids: list[int]) -> list[float]:
    """EMBED_DIM floats of unit length, a deterministic function of the tokens."""
    digest = hashlib.blake2b(struct.pack(f"<{len(token_ids)}I", *token_ids)).digest()
    raw = [v / 2**31 - 1.0 for v in struct.unpack(f"<{EMBED_DIM}I", digest[: 4 * EMBED_DIM])]
    norm = sum(v * v for v in raw) ** 0.5 or 1.0
    return [v / norm for v in raw]


def list_answer(
    rid: str, model: str, data: list[dict[str, Any]], usage: dict[str, Any]
) -> web.Response:
    """An answer that is a list of results (embeddings, scores, pooled outputs)."""
    return web.json_response(
        {
            "id": rid,
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": data,
            "usage": usage,
        }
    )


def input_items(value: Any) -> list[str | list[int]]:
    """A pooling `input` as its prompts: a string, a list of token ids, or a list of
    either."""
    if isinstance(value, str):
        return [value]
    if value and isinstance(value[0], int):
        return [value]
    return list(value or [])


def input_prompt(item: str | list[int], limit: int, purpose: str = "") -> tuple[str, list[int]]:
    """One input's text and token ids, checked as vLLM checks them (ids in the
    vocabulary, one to `limit` tokens)."""
    if isinstance(item, str):
        text, ids = item, tokenizer.encode(item)
    else:
        text, ids = "", list(item)
        if any(t < 0 or t >= tokenizer.VOCAB_SIZE for t in ids):
            raise ApiError(400, f"token ids must be in [0, {tokenizer.VOCAB_SIZE})", "input")
    check_prompt_len(ids, limit, "input", purpose)
    return text, ids


def check_prompt_len(ids: list[int], limit: int, param: str, purpose: str = "") -> None:
    if not ids:
        raise ApiError(400, "The prompt is empty; at least one token is required.", param)
    if len(ids) > limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you "
            f"requested {len(ids)} tokens in the input{purpose}. Please reduce the length "
            "of the input.",
            param,
        )
