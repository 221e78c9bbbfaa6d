"""The model of a request that names none, as vLLM's own server answers it.

vLLM takes ``model`` as optional on its OpenAI endpoints (chat, completions, the
Responses API, embeddings and the other pooling endpoints, audio, tokenize): a request
without one goes to the model it serves. A client written against one engine may leave
it out, so kvgate does the same where its replicas serve one base model (a LoRA adapter
beside it is not the default, as vLLM's are not); where they serve several, the request
gets a 400 that names them. Anthropic's Messages API requires the field, and kvgate asks
for it there as that API does.

The engine gets the model named: a JSON body gets the member right after its opening
brace, every byte the client sent kept as it was (`gateway.body.with_member`);
an audio form goes as sent, its engine choosing the one model it serves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import orjson

from gateway.body import with_member
from gateway.errors import invalid_request


def default_model(served: Iterable[str], bases_of: Callable[[str], frozenset[str]]) -> str:
    """The one base model the replicas serve; a 400 naming the choice otherwise."""
    bases = sorted(m for m in served if bases_of(m) <= {m})
    if len(bases) == 1:
        return bases[0]
    if not bases:
        raise invalid_request(
            "model: Field required (no replica serves a model yet)", param="model"
        )
    names = ", ".join(bases[:8]) + (", ..." if len(bases) > 8 else "")
    raise invalid_request(
        f"model: Field required (this gateway serves several models: {names})", param="model"
    )


def fill_model(
    body: dict[str, Any],
    raw: bytes,
    json_body: bool,
    served: Callable[[], Iterable[str]],
    bases_of: Callable[[str], frozenset[str]],
) -> bytes:
    """Name the default model in `body` (and in `raw`, when it is JSON) if it names none;
    returns what the engine is sent."""
    if "model" in body:
        return raw
    model = body["model"] = default_model(served(), bases_of)
    if not json_body:
        return raw
    patched = with_member(raw, b'"model":' + orjson.dumps(model))
    return patched if patched is not None else orjson.dumps(body)
