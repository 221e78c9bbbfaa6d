"""Bad input is a 4xx OpenAI error object, never a 500, and never reaches a replica."""

from __future__ import annotations

import aiohttp
import pytest

from tests.gateway.conftest import MODEL

OK_MSG = [{"role": "user", "content": "hi"}]


def assert_error_object(body: dict) -> dict:
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


CASES = [
    # (name, path, raw body, expected status, expected param or None)
    ("malformed json", "/v1/chat/completions", b'{"model": "tiny-llm", "messages": [', 400, None),
    ("not an object", "/v1/chat/completions", b"[1, 2, 3]", 400, None),
    ("empty body", "/v1/chat/completions", b"", 400, None),
    (  # a missing model is the one served, as on vLLM (tests/gateway/test_default_model.py)
        "empty model",
        "/v1/chat/completions",
        b'{"model": "", "messages": [{"role": "user", "content": "x"}]}',
        400,
        "model",
    ),
    (
        "model wrong type",
        "/v1/chat/completions",
        b'{"model": 7, "messages": [{"role": "user", "content": "x"}]}',
        400,
        "model",
    ),
    ("missing messages", "/v1/chat/completions", b'{"model": "tiny-llm"}', 400, "messages"),
    (
        "empty messages",
        "/v1/chat/completions",
        b'{"model": "tiny-llm", "messages": []}',
        400,
        "messages",
    ),
    (
        "message without role",
        "/v1/chat/completions",
        b'{"model": "tiny-llm", "messages": [{"content": "x"}]}',
        400,
        "messages",
    ),
    (
        "stream wrong type",
        "/v1/chat/completions",
        b'{"model": "tiny-llm", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
        400,
        "stream",
    ),
    (
        "max_tokens string",
        "/v1/chat/completions",
        b'{"model": "tiny-llm", "messages": [{"role": "user", "content": "x"}], "max_tokens": "10"}',
        400,
        "max_tokens",
    ),
    (
        "negative max_tokens",
        "/v1/chat/completions",
        b'{"model": "tiny-llm", "messages": [{"role": "user", "content": "x"}], "max_tokens": -5}',
        400,
        "max_tokens",
    ),
    (
        "zero max_tokens",
        "/v1/chat/completions",
        b'{"model": "tiny-llm", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}',
        400,
        "max_tokens",
    ),
    (
        "absurd max_tokens",
        "/v1/chat/completions",
        b'{"model": "tiny-llm", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1000000000000}',
        400,
        "max_tokens",
    ),
    (
        "n > 1",
        "/v1/chat/completions",
        b'{"model": "tiny-llm", "messages": [{"role": "user", "content": "x"}], "n": 3}',
        400,
        "n",
    ),
    ("completions missing prompt", "/v1/completions", b'{"model": "tiny-llm"}', 400, "prompt"),
    (
        "completions batch",
        "/v1/completions",
        b'{"model": "tiny-llm", "prompt": ["a", "b"]}',
        400,
        "prompt",
    ),
    (
        "completions prompt wrong type",
        "/v1/completions",
        b'{"model": "tiny-llm", "prompt": 12}',
        400,
        "prompt",
    ),
]


@pytest.mark.parametrize(
    ("name", "path", "raw", "status", "param"), CASES, ids=[c[0] for c in CASES]
)
async def test_bad_request_bodies(replica, gateway, name, path, raw, status, param):
    srv = await replica()
    gw = await gateway(srv)
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw.url + path, data=raw, headers={"Content-Type": "application/json"}) as r,
    ):
        assert r.status == status, await r.text()
        err = assert_error_object(await r.json())
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param
    assert srv.core.stats().num_finished == 0 and srv.core.stats().num_running == 0


async def test_bad_input_batch_on_one_gateway(replica, gateway):
    """All cases against one gateway in a row: none leaves state behind or breaks it."""
    gw = await gateway(await replica())
    async with aiohttp.ClientSession() as s:
        for _name, path, raw, status, _param in CASES:
            async with s.post(gw.url + path, data=raw) as r:
                assert r.status == status
                assert_error_object(await r.json())
        async with s.post(
            gw.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": OK_MSG, "max_tokens": 2},
        ) as r:
            assert r.status == 200


async def test_oversized_body_is_413(replica, gateway):
    gw = await gateway(await replica(), limits={"max_body_bytes": 2048})
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]}
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/chat/completions", json=big) as r:
            assert r.status == 413
            assert assert_error_object(await r.json())["code"] == "request_too_large"

        # Chunked upload without Content-Length: the limit holds while reading.
        async def gen():
            yield b'{"model": "tiny-llm", "messages": [{"role": "user", "content": "'
            for _ in range(10):
                yield b"y" * 1000
            yield b'"}]}'

        async with s.post(gw.url + "/v1/chat/completions", data=gen()) as r:
            assert r.status == 413
            assert_error_object(await r.json())


async def test_unknown_model_404(replica, gateway):
    gw = await gateway(await replica())
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw.url + "/v1/chat/completions", json={"model": "gpt-9", "messages": OK_MSG}) as r,
    ):
        assert r.status == 404
        err = assert_error_object(await r.json())
    assert err["code"] == "model_not_found" and err["param"] == "model"


async def test_context_length_exceeded_is_400_at_once(replica, gateway):
    srv = await replica()
    gw = await gateway(srv)  # tiny: max_model_len 2048
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            gw.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": OK_MSG, "max_tokens": 100_000},
        ) as r,
    ):
        assert r.status == 400
        err = assert_error_object(await r.json())
    assert err["code"] == "context_length_exceeded"
    assert gw.report.queue_depth() == 0


async def test_bad_headers_and_unknown_paths(replica, gateway):
    gw = await gateway(await replica())
    body = {"model": MODEL, "messages": OK_MSG, "max_tokens": 2}
    async with aiohttp.ClientSession() as s:
        for hdr in (
            {"x-kvgate-queue-timeout": "soon"},
            {"x-kvgate-queue-timeout": "-1"},
            {"x-kvgate-priority": "high"},
        ):
            async with s.post(gw.url + "/v1/chat/completions", json=body, headers=hdr) as r:
                assert r.status == 400
                assert_error_object(await r.json())
        async with s.get(gw.url + "/v1/nothing") as r:
            assert r.status == 404
            assert_error_object(await r.json())
        async with s.get(gw.url + "/v1/chat/completions") as r:
            assert r.status == 405
            assert_error_object(await r.json())


async def test_unknown_fields_are_passed_to_the_engine(replica, gateway):
    srv = await replica()
    gw = await gateway(srv)
    body = {
        "model": MODEL,
        "messages": OK_MSG,
        "max_tokens": 9,
        "ignore_eos": True,  # vLLM extension, unknown to OpenAI and to kvgate's schema
        "top_k": 5,
        "priority": 0,
    }
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw.url + "/v1/chat/completions", json=body) as r,
    ):
        assert r.status == 200
        data = await r.json()
    # Only an engine that saw ignore_eos generates exactly max_tokens every time.
    assert data["usage"]["completion_tokens"] == 9


async def test_api_keys_map_to_tenants(replica, gateway):
    gw = await gateway(await replica(), auth={"api_keys": {"sk-a": "team-a"}})
    body = {"model": MODEL, "messages": OK_MSG, "max_tokens": 2}
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 401
            assert assert_error_object(await r.json())["code"] == "invalid_api_key"
        async with s.post(
            gw.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"}
        ) as r:
            assert r.status == 401
        async with s.post(
            gw.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-a"}
        ) as r:
            assert r.status == 200


@pytest.mark.parametrize("stream", ["true", "false"])
async def test_a_lone_surrogate_is_refused_before_any_replica_sees_it(replica, gateway, stream):
    # Valid JSON, but not Unicode text: no engine can tokenize it. Once it was forwarded
    # and the engine's 500 relayed (and counted against the replica); now kvgate answers
    # 400 naming the field, and nothing is sent on.
    srv = await replica()
    gw = await gateway(srv)
    raw = (
        b'{"model": "tiny-llm", "stream": ' + stream.encode() + b', "max_tokens": 3, '
        b'"messages": [{"role": "user", "content": "odd \\ud800 text"}]}'
    )
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            gw.url + "/v1/chat/completions",
            data=raw,
            headers={"Content-Type": "application/json"},
        ) as r,
    ):
        err = assert_error_object(await r.json())
    assert r.status == 400
    assert err["type"] == "invalid_request_error"
    assert err["param"] == "messages" and err["code"] == "invalid_unicode"
    assert err["message"].startswith("messages.0.content: ")
    assert srv.core.stats().num_finished == 0 and gw.report.reserved_tokens() == 0
