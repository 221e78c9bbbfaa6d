"""Byte-level pass-through against a scripted OpenAI-compatible upstream.

A scripted engine (engine type ``openai``, pinned pool) sends exactly known bytes, in
awkward chunks, and records what kvgate sent it. This checks what enginesim cannot show
precisely: the client-facing stream is byte-identical to the engine's, minus only the
usage chunk the client did not ask for, and the request body reaching the engine is the
client's own, plus ``include_usage`` on streams.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

MODEL = "scripted"
CONTENT = [
    b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
    b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"caf\xc3\xa9 \\"q\\""}}]}\n\n',
    b": ping\n\n",
    b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" ok"},"finish_reason":"stop"}]}\n\n',
]
USAGE = b'data: {"id":"x","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2,"total_tokens":9}}\n\n'
DONE = b"data: [DONE]\n\n"
UNARY = b'{"id":"y","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":7,"completion_tokens":1,"total_tokens":8}}'


@pytest.fixture
async def scripted() -> AsyncIterator[dict[str, Any]]:
    seen: list[bytes] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        seen.append(raw)
        body = json.loads(raw)
        if not body.get("stream"):
            return web.Response(body=UNARY, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        wire = b"".join(CONTENT)
        if (body.get("stream_options") or {}).get("include_usage"):
            wire += USAGE
        wire += DONE
        # Awkward chunking: split inside events and inside a multi-byte character.
        for i in range(0, len(wire), 37):
            await resp.write(wire[i : i + 37])
            await asyncio.sleep(0)
        await resp.write_eof()
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield {"url": f"http://127.0.0.1:{port}", "seen": seen}
    await runner.cleanup()


async def make(gateway, scripted):
    return await gateway(
        replicas=[{"name": "s", "url": scripted["url"], "engine": "openai", "pool_tokens": 100_000}]
    )


REQ = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 5,
    "top_k": 4,
    "priority": -1,
    "chat_template_kwargs": {"enable_thinking": False},
}


async def test_stream_bytes_identical_and_usage_hidden(gateway, scripted):
    gw = await make(gateway, scripted)
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/chat/completions", json={**REQ, "stream": True}) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            got = await r.read()
        assert got == b"".join(CONTENT) + DONE
        sent = json.loads(scripted["seen"][-1])
        assert sent["stream_options"] == {"include_usage": True}
        assert {k: sent[k] for k in REQ} == REQ  # unknown fields reached the engine as sent

        async with s.post(
            gw.url + "/v1/chat/completions",
            json={**REQ, "stream": True, "stream_options": {"include_usage": True}},
        ) as r:
            got = await r.read()
        assert got == b"".join(CONTENT) + USAGE + DONE


async def test_non_stream_body_forwarded_as_sent(gateway, scripted):
    gw = await make(gateway, scripted)
    raw = json.dumps(REQ, indent=3).encode()  # unusual formatting survives: no re-serialising
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            gw.url + "/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"}
        ) as r,
    ):
        assert r.status == 200
        assert await r.read() == UNARY
    assert scripted["seen"][-1] == raw
