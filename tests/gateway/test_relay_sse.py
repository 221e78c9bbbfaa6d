"""The SSE relay forwards the engine's bytes unchanged, whatever the chunking, and only
drops the usage chunk the client did not ask for."""

from __future__ import annotations

import json
import random

import pytest

from gateway.config import UpstreamConfig
from gateway.context import RequestContext
from gateway.relay import Relay


def chunk(i: int, content: str) -> bytes:
    obj = {
        "id": "c",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
    }
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


USAGE = b'data: {"id":"c","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":11,"completion_tokens":5,"total_tokens":16}}\n\n'
# Content that mentions "usage" must not be mistaken for the usage chunk.
TRICKY = chunk(9, 'the "usage": {"x": 1} field')
STREAM = (
    b"".join(chunk(i, f" tok{i}") for i in range(4))
    + TRICKY
    + b": keep-alive comment\n\n"
    + USAGE
    + b"data: [DONE]\n\n"
)


def relay() -> Relay:
    return Relay(None, UpstreamConfig(), lambda ctx: None)  # type: ignore[arg-type]


def ctx(wants_usage: bool) -> RequestContext:
    c = RequestContext(
        request_id="t", kind="chat", upstream_path="/v1/chat/completions", arrival=0.0
    )
    c.stream = True
    c.client_wants_usage = wants_usage
    return c


def run(r: Relay, c: RequestContext, pieces: list[bytes]) -> bytes:
    out = b""
    buf = b""
    for p in pieces:
        buf = buf + p if buf else p
        fwd, buf = r._take_events(c, buf)
        out += fwd
    return out + buf


def random_split(data: bytes, rng: random.Random) -> list[bytes]:
    cuts = sorted(rng.sample(range(1, len(data)), k=min(len(data) - 1, rng.randint(1, 40))))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


@pytest.mark.parametrize("seed", range(25))
def test_forwarded_bytes_identical_except_unrequested_usage(seed):
    rng = random.Random(seed)
    pieces = random_split(STREAM, rng)
    c = ctx(wants_usage=True)
    assert run(relay(), c, pieces) == STREAM
    assert (c.usage_prompt, c.usage_completion) == (11, 5)
    assert c.generated == 5  # four content chunks and the tricky one

    c = ctx(wants_usage=False)
    assert run(relay(), c, pieces) == STREAM.replace(USAGE, b"")
    assert (c.usage_prompt, c.usage_completion) == (11, 5)  # kvgate still learned it


def test_upstream_body_adds_include_usage_only_when_needed():
    c = ctx(wants_usage=False)
    c.body = {
        "model": "m",
        "stream": True,
        "stream_options": {"continuous_usage_stats": False},
        "top_k": 3,
    }
    c.raw = json.dumps(c.body).encode()
    sent = json.loads(Relay.upstream_body(c))
    assert sent["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    assert sent["top_k"] == 3  # everything else untouched
    c.client_wants_usage = True
    assert Relay.upstream_body(c) is c.raw  # forwarded as the client sent it
    c.stream = False
    assert Relay.upstream_body(c) is c.raw


def test_failure_classification():
    import aiohttp

    from gateway.upstream import classify_client_error

    f = classify_client_error(aiohttp.ConnectionTimeoutError("slow connect"), started=False)
    assert (f.kind, f.retryable) == ("connect", True)
    f = classify_client_error(aiohttp.ServerDisconnectedError(), started=True)
    assert (f.kind, f.retryable) == ("dropped", False)
    f = classify_client_error(aiohttp.ClientPayloadError("truncated"), started=False)
    assert (f.kind, f.retryable) == ("dropped", True)
