"""The SSE relay forwards the engine's bytes unchanged, whatever the chunking, except the
usage the client did not ask for (taken off, its chunk dropped when nothing else is on it)
and an engine's error event (put in OpenAI's shape); and engines' error answers become
OpenAI error objects."""

from __future__ import annotations

import json
import random

import pytest

from gateway.context import RequestContext
from gateway.upstream.relay import Relay
from gateway.upstream.sse import take_events


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


def ctx(wants_usage: bool) -> RequestContext:
    c = RequestContext(
        request_id="t", kind="chat", upstream_path="/v1/chat/completions", arrival=0.0
    )
    c.req.stream = True
    c.client_wants_usage = wants_usage
    return c


def run(c: RequestContext, pieces: list[bytes]) -> bytes:
    out = b""
    buf = b""
    for p in pieces:
        buf = buf + p if buf else p
        fwd, buf = take_events(c, buf)
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
    assert run(c, pieces) == STREAM
    assert (c.usage_prompt, c.usage_completion) == (11, 5)
    assert c.generated == 5  # four content chunks and the tricky one

    c = ctx(wants_usage=False)
    assert run(c, pieces) == STREAM.replace(USAGE, b"")
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
    c.req.stream = False
    assert Relay.upstream_body(c) is c.raw


def test_failure_classification():
    import aiohttp

    from gateway.upstream.session import classify_client_error

    f = classify_client_error(aiohttp.ConnectionTimeoutError("slow connect"), started=False)
    assert (f.kind, f.retryable) == ("connect", True)
    f = classify_client_error(aiohttp.ServerDisconnectedError(), started=True)
    assert (f.kind, f.retryable) == ("dropped", False)
    f = classify_client_error(aiohttp.ClientPayloadError("truncated"), started=False)
    assert (f.kind, f.retryable) == ("dropped", True)


# llama.cpp's usage chunk carries its `timings` too; so may an engine's own extra field.
LLAMA_USAGE = (
    b'data: {"choices":[],"created":1,"id":"c","model":"m","system_fingerprint":"b0",'
    b'"object":"chat.completion.chunk","usage":{"completion_tokens":5,"prompt_tokens":11,'
    b'"total_tokens":16},"timings":{"prompt_n":11,"predicted_n":5}}\n\n'
)
LLAMA_STREAM = chunk(0, "a") + chunk(1, "b") + LLAMA_USAGE + b"data: [DONE]\n\n"


@pytest.mark.parametrize("seed", range(10))
def test_unrequested_usage_is_taken_off_and_the_engines_other_fields_stay(seed):
    pieces = random_split(LLAMA_STREAM, random.Random(seed))
    c = ctx(wants_usage=False)
    out = run(c, pieces)
    events = [e for e in out.split(b"\n\n") if e]
    assert events[:2] == [chunk(0, "a")[:-2], chunk(1, "b")[:-2]]
    assert events[-1] == b"data: [DONE]"
    kept = json.loads(events[2][len(b"data: ") :])
    assert "usage" not in kept
    assert kept["timings"] == {"prompt_n": 11, "predicted_n": 5}
    assert kept["choices"] == [] and kept["id"] == "c"
    assert (c.usage_prompt, c.usage_completion) == (11, 5)
    c = ctx(wants_usage=True)
    assert run(c, pieces) == LLAMA_STREAM  # asked for: untouched


def test_error_event_is_an_upstream_error_in_openai_shape():
    """llama.cpp's unified pool overrun ends a running stream with one error event."""
    overrun = (
        b'data: {"error":{"code":500,"message":"Context size has been exceeded.",'
        b'"type":"server_error"}}\n\n'
    )
    c = ctx(wants_usage=False)
    out = run(c, [chunk(0, "a") + chunk(1, "b"), overrun])
    events = [e for e in out.split(b"\n\n") if e]
    assert len(events) == 3
    assert json.loads(events[2][len(b"data: ") :]) == {
        "error": {
            "message": "Context size has been exceeded.",
            "type": "server_error",
            "param": None,
            "code": "500",
        }
    }
    assert c.upstream_error == "stream_error"
    assert c.generated == 2  # the error is not a token


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (  # llama.cpp: a prompt over its slot's context
            400,
            {
                "error": {
                    "code": 400,
                    "message": "request (1039 tokens) exceeds the available context size "
                    "(1024 tokens), try increasing it",
                    "type": "exceed_context_size_error",
                    "n_prompt_tokens": 1039,
                    "n_ctx": 1024,
                }
            },
            {
                "message": "request (1039 tokens) exceeds the available context size "
                "(1024 tokens), try increasing it",
                "type": "invalid_request_error",
                "param": None,
                "code": "context_length_exceeded",
            },
        ),
        (  # SGLang and older vLLM: the fields at the top level
            400,
            {
                "object": "error",
                "message": "The input (5000 tokens) is longer than the model's context "
                "length (4096 tokens).",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            },
            {
                "message": "The input (5000 tokens) is longer than the model's context "
                "length (4096 tokens).",
                "type": "invalid_request_error",
                "param": None,
                "code": "context_length_exceeded",
            },
        ),
        (  # an engine's own string code and param are kept
            404,
            {"error": {"message": "no such model", "code": "model_not_found", "param": "model"}},
            {
                "message": "no such model",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            },
        ),
        (  # not JSON at all
            500,
            None,
            {"message": "fallback", "type": "server_error", "param": None, "code": "500"},
        ),
    ],
)
def test_upstream_errors_become_openai_error_objects(status, body, expected):
    from gateway.errors import upstream_error

    err = upstream_error(status, body, fallback="fallback")
    assert err.status == status
    assert err.body() == {"error": expected}


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("eol", [b"\r\n", b"\r"])
def test_crlf_and_cr_framed_streams_are_split_per_event(seed, eol):
    framed = STREAM.replace(b"\n", eol)
    rng = random.Random(seed)
    pieces = random_split(framed, rng)
    c = ctx(wants_usage=True)
    # Event by event, not all at the end: the first content chunk is forwarded as soon
    # as its blank line has arrived.
    first_end = framed.index(eol + eol) + 2 * len(eol)
    buf, out = b"", b""
    for p in pieces:
        buf = buf + p if buf else p
        fwd, buf = take_events(c, buf)
        out += fwd
        if len(out) + len(buf) >= first_end:
            assert len(out) >= first_end
    assert out + buf == framed
    assert (c.usage_prompt, c.usage_completion) == (11, 5)
    assert c.generated == 5
