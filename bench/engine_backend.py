"""A zero-compute upstream shaped like a real engine's HTTP server, for bench/overhead.py.

vLLM's and SGLang's OpenAI servers are Python (uvicorn/FastAPI) processes that parse the
request body, then answer a completion as one JSON body, or a stream as one SSE event
per engine step, each written as it is produced. This server does the same without a
model: it parses the body (so a malformed request is a 400), answers a fixed completion,
or writes 64 content events, a finish event, the usage event when
``stream_options.include_usage`` asks for it, and ``[DONE]``, one write per event with a
yield to the event loop between them (so a proxy sees the stream in many small reads, as
from an engine, not in one read as from nginx's file). ``/v1/models``, ``/health`` and
``/metrics`` answer as an OpenAI-compatible server's do. A body field ``bench_hold_s``
(passed through by every proxy as an unknown field) holds the stream that long after its
first event, to measure memory per stream in flight.

    python bench/engine_backend.py PORT
"""

from __future__ import annotations

import asyncio
import sys

import orjson
import uvloop
from aiohttp import web

MODEL = "bench-model"
STREAM_CHUNKS = 64
_BASE = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1, "model": MODEL}


def _event(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


_CONTENT = [
    _event(
        {
            **_BASE,
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": " tok"} if i else {"role": "assistant", "content": "tok"},
                    "finish_reason": None,
                }
            ],
        }
    )
    for i in range(STREAM_CHUNKS)
]
_FINISH = _event({**_BASE, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})


def _usage(n: int) -> dict:
    return {"prompt_tokens": 12, "completion_tokens": n, "total_tokens": 12 + n}


async def chat(request: web.Request) -> web.StreamResponse:
    try:
        body = orjson.loads(await request.read())
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            raise ValueError("messages is required")
    except ValueError as e:
        return web.json_response(
            {"error": {"message": str(e), "type": "invalid_request_error", "code": 400}},
            status=400,
        )
    if not body.get("stream"):
        return web.Response(
            body=orjson.dumps(
                {
                    "id": "chatcmpl-bench",
                    "object": "chat.completion",
                    "created": 1,
                    "model": MODEL,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "Hello"},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": _usage(1),
                }
            ),
            content_type="application/json",
        )
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    hold = body.get("bench_hold_s")  # bench/overhead.py's memory probe: a stream in flight
    for chunk in _CONTENT:
        await resp.write(chunk)
        if isinstance(hold, int | float) and hold > 0:
            await asyncio.sleep(min(float(hold), 60.0))
            hold = None
        await asyncio.sleep(0)  # one engine step per event
    await resp.write(_FINISH)
    opts = body.get("stream_options")
    if isinstance(opts, dict) and opts.get("include_usage"):
        await resp.write(_event({**_BASE, "choices": [], "usage": _usage(STREAM_CHUNKS)}))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def models(request: web.Request) -> web.Response:
    return web.json_response(
        {"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 8192}]}
    )


async def ok(request: web.Request) -> web.Response:
    return web.Response(text="")


def app() -> web.Application:
    a = web.Application()
    a.router.add_post("/v1/chat/completions", chat)
    a.router.add_get("/v1/models", models)
    a.router.add_get("/health", ok)
    a.router.add_get("/metrics", ok)
    return a


if __name__ == "__main__":
    uvloop.install()
    web.run_app(app(), host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
