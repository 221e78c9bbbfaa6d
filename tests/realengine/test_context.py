"""Where llama-server's context ends: a prompt that does not fit, a generation that runs into
the slot's end, and (unified KV) concurrent requests that overrun the shared pool."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from tests.realengine.llama import N_CTX, N_SLOTS, LlamaServer, Reply, sse_events, user, words


def _prompt_of(server: LlamaServer, n_tokens: int) -> list[dict[str, str]]:
    """Chat messages whose templated prompt is exactly n_tokens long."""
    n_words = n_tokens
    for _ in range(4):
        messages = user(words(n_words))
        counted = server.n_tokens(messages)
        if counted == n_tokens:
            return messages
        n_words += n_tokens - counted
    raise AssertionError(f"no prompt of exactly {n_tokens} tokens")


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_that_fills_the_slot_is_refused_with_400(engine: LlamaServer, stream: bool) -> None:
    """A prompt of n_ctx tokens or more never starts: 400 JSON (not SSE) even for a stream."""
    n_ctx = engine.slot_ctx()
    body = {"messages": _prompt_of(engine, n_ctx), "max_tokens": 4, "stream": stream}
    reply = engine.post("/v1/chat/completions", body)
    assert reply.status == 400
    assert reply.headers["Content-Type"].startswith("application/json")
    assert reply.json() == {
        "error": {
            "code": 400,
            "message": f"request ({n_ctx} tokens) exceeds the available context size "
            f"({n_ctx} tokens), try increasing it",
            "type": "exceed_context_size_error",
            "n_prompt_tokens": n_ctx,
            "n_ctx": n_ctx,
        }
    }


def test_completions_endpoint_refuses_the_same_way(per_slot: LlamaServer) -> None:
    reply = per_slot.post("/v1/completions", {"prompt": words(2000), "max_tokens": 4})
    assert reply.status == 400
    error = reply.json()["error"]
    assert error["type"] == "exceed_context_size_error"
    assert error["n_ctx"] == 1024 and error["n_prompt_tokens"] > 1024


@pytest.mark.parametrize("stream", [False, True])
def test_generation_stops_at_the_slot_end_with_length(engine: LlamaServer, stream: bool) -> None:
    """max_tokens past the context is not refused: the reply is cut at n_ctx total tokens with
    finish_reason "length", and no error."""
    n_ctx = engine.slot_ctx()
    prompt_tokens = n_ctx - 40
    body: dict[str, Any] = {
        "messages": _prompt_of(engine, prompt_tokens),
        "max_tokens": 500,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
        with engine.open_stream(body) as (_, resp):
            assert resp.status == 200
            events = sse_events(resp)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        usage = chunks[-1]["usage"]
    else:
        reply = engine.post("/v1/chat/completions", body)
        assert reply.status == 200
        assert reply.json()["choices"][0]["finish_reason"] == "length"
        usage = reply.json()["usage"]
    assert usage["prompt_tokens"] == prompt_tokens
    assert usage["total_tokens"] == n_ctx
    assert usage["completion_tokens"] == n_ctx - prompt_tokens


def _concurrent(server: LlamaServer, bodies: list[dict[str, Any]]) -> list[tuple[int, Any]]:
    """Send the bodies at once; a stream answers (status, [data payloads]), else (status, json)."""
    results: list[tuple[int, Any]] = [(0, None)] * len(bodies)

    def one(i: int, body: dict[str, Any]) -> None:
        if body.get("stream"):
            with server.open_stream(body) as (_, resp):
                results[i] = (resp.status, sse_events(resp))
        else:
            reply: Reply = server.post("/v1/chat/completions", body, timeout=60)
            results[i] = (reply.status, reply.json())

    threads = [threading.Thread(target=one, args=(i, b)) for i, b in enumerate(bodies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def _four_big_requests() -> list[dict[str, Any]]:
    """Four requests of ~700 prompt tokens that would each generate 900: 4 x 1,600 > 4,096."""
    return [
        {
            "messages": user(words(700 + i)),
            "max_tokens": 900,
            "ignore_eos": True,
            "stream": i < 2,
        }
        for i in range(N_SLOTS)
    ]


def test_per_slot_requests_each_stop_at_their_own_slot_end(per_slot: LlamaServer) -> None:
    """Per-slot KV: each slot owns its 1,024 tokens, so four big requests all finish."""
    for status, result in _concurrent(per_slot, _four_big_requests()):
        assert status == 200
        if isinstance(result, list):  # a stream
            assert result[-1] == "[DONE]"
            assert json.loads(result[-2])["choices"][0]["finish_reason"] == "length"
        else:
            assert result["choices"][0]["finish_reason"] == "length"
            assert result["usage"]["total_tokens"] == N_CTX // N_SLOTS


def test_unified_pool_overrun_fails_every_running_request(unified: LlamaServer) -> None:
    """Unified KV: when the shared pool has no cell for the next decode, every request in
    flight fails at once. Streams already answered 200 and sent tokens; each ends with one
    error event and no [DONE]. Non-stream requests answer 500. The server stays healthy."""
    overrun = {"code": 500, "message": "Context size has been exceeded.", "type": "server_error"}
    results = _concurrent(unified, _four_big_requests())
    for status, result in results:
        if isinstance(result, list):  # a stream: 200, tokens, then the error as the last event
            assert status == 200
            assert json.loads(result[-1]) == {"error": overrun}
            assert "[DONE]" not in result
            tokens = [json.loads(e) for e in result[:-1]]
            assert len(tokens) > 10
            assert all(c["choices"][0]["finish_reason"] is None for c in tokens)
        else:
            assert (status, result) == (500, {"error": overrun})
    assert unified.get("/health").status == 200
    unified.wait_idle()
    after = unified.post("/v1/chat/completions", {"messages": user("hi"), "max_tokens": 2})
    assert after.status == 200
    assert N_CTX == 4096  # the arithmetic above: 4 x (700 + 900) > 4,096
