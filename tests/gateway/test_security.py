"""Security edges: size limits before parsing, no leaks in answers, no secrets in logs.

- A body announced larger than ``limits.max_body_bytes`` is refused 413 from its
  Content-Length alone, before a byte of it is read; a chunked body is cut while read.
- An oversized request head is a 431 OpenAI error object (aiohttp's parser, not plain text).
- Answers about upstream failures (refused connection, dropped stream) name neither the
  replica's address nor an exception's text; no answer carries a traceback.
- API keys (the client's and the replica's) and the admin token never reach the log,
  whatever the outcome (accepted, refused, upstream failure), at debug level.
(The admin token is compared with ``hmac.compare_digest`` in `gateway.admin`, and the
admin API is closed when no token is configured: tests/gateway/test_ops.py.)
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest

from enginesim.faults import make_fault
from gateway.errors import upstream_error
from gateway.logging import JsonFormatter
from tests.gateway.conftest import MODEL, wait_for

SHORT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
CLIENT_KEY = "sk-client-9f8e7d6c5b4a"
REPLICA_KEY = "sk-replica-0a1b2c3d4e5f"
ADMIN_TOKEN = "adm-77c1d2e3f4a5"


async def _raw(port: int, data: bytes) -> tuple[bytes, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(10.0):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            body = await reader.readexactly(length)
    finally:
        writer.close()
    return head, body


def _error(body: bytes) -> dict:
    doc = json.loads(body)
    assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "param", "code"}
    return doc["error"]


async def test_body_over_limit_is_413_from_content_length_alone(replica, gateway):
    gw = await gateway(await replica(), limits={"max_body_bytes": 1000, "body_timeout_s": 30.0})
    # Announce 10 MB and send none of it: the answer comes from the head alone (the
    # body timeout is 30 s; the answer must not wait for it).
    head, body = await _raw(
        gw.port,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\n"
        b"Content-Type: application/json\r\n\r\n",
    )
    assert head.startswith(b"HTTP/1.1 413")
    assert _error(body)["code"] == "request_too_large"
    assert b"Server: kvgate\r\n" in head and b"aiohttp" not in head


async def test_chunked_body_over_limit_is_413(replica, gateway):
    gw = await gateway(await replica(), limits={"max_body_bytes": 1000})
    chunk = b"a" * 600
    one = b"%x\r\n" % len(chunk) + chunk + b"\r\n"
    head, body = await _raw(
        gw.port,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Content-Type: application/json\r\n\r\n" + one + one + one + b"0\r\n\r\n",
    )
    assert head.startswith(b"HTTP/1.1 413")
    assert _error(body)["code"] == "request_too_large"


async def test_oversized_head_is_431_error_object(replica, gateway):
    gw = await gateway(await replica(), limits={"max_header_bytes": 2048, "max_headers": 16})
    long_value = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 5000
    many = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + b"".join(
        b"X-H%d: 1\r\n" % i for i in range(40)
    )
    long_path = b"POST /" + b"a" * 5000 + b" HTTP/1.1\r\nHost: x"
    for head_bytes in (long_value, many, long_path):
        head, body = await _raw(gw.port, head_bytes.rstrip(b"\r\n") + b"\r\n\r\n")
        assert head.split(b" ")[1] == b"431", head
        assert b"application/json" in head
        assert b"Server: kvgate\r\n" in head and b"aiohttp" not in head
        err = _error(body)
        assert err["code"] == "headers_too_large" and "2048" in err["message"]
    assert gw.state.pipeline.inflight == 0


async def test_upstream_failures_leak_no_address(replica, gateway):
    srv = await replica(speed=1.0)
    port = srv.url.rsplit(":", 1)[1]
    gw = await gateway(srv, discovery={"refresh_interval_s": 30.0})
    async with aiohttp.ClientSession() as s:
        # Mid-stream drop: the error event tells what, not where.
        async with s.post(
            gw.url + "/v1/chat/completions",
            json={**SHORT, "max_tokens": 500, "ignore_eos": True, "stream": True},
        ) as r:
            await r.content.readany()
            srv.set_fault(make_fault("crash"))
            tail = (await r.read()).decode()
        assert await wait_for(lambda: srv.crashed)
        # Refused connection before any byte: 502 (the only replica is down).
        async with s.post(gw.url + "/v1/chat/completions", json=SHORT) as r:
            assert r.status == 502
            text = await r.text()
    events = [e for e in tail.split("\n\n") if e.strip()]
    event_err = json.loads(events[-1][len("data: ") :])["error"]
    refused = _error(text.encode())
    for err in (event_err, refused):
        msg = err["message"]
        assert port not in msg and "127.0.0.1" not in msg and "http" not in msg, msg
        assert "Errno" not in msg and "Error" not in msg and "Traceback" not in msg, msg
    assert refused["code"] == "upstream_connect"
    assert event_err["code"] == "upstream_dropped"


async def test_secrets_never_reach_the_log(replica, gateway, caplog):
    caplog.set_level(logging.DEBUG)
    good = await replica()
    gw = await gateway(
        good,
        replicas=[{"name": "r0", "url": good.url, "api_key": REPLICA_KEY}],
        auth={"api_keys": {CLIENT_KEY: "acme"}, "admin_token": ADMIN_TOKEN},
    )
    async with aiohttp.ClientSession() as s:
        for key in (CLIENT_KEY, CLIENT_KEY + "x", ""):
            async with s.post(
                gw.url + "/v1/chat/completions",
                json=SHORT,
                headers={"Authorization": f"Bearer {key}"},
            ) as r:
                assert r.status == (200 if key == CLIENT_KEY else 401)
                text = await r.text()
                assert REPLICA_KEY not in text
        for tok in (ADMIN_TOKEN, "nope"):
            async with s.get(
                gw.url + "/admin/replicas", headers={"Authorization": f"Bearer {tok}"}
            ) as r:
                assert r.status == (200 if tok == ADMIN_TOKEN else 401)
                assert REPLICA_KEY not in await r.text()
        # An upstream failure logs a warning with details: still no key in it.
        good.set_fault(make_fault("error", status=500))
        async with s.post(
            gw.url + "/v1/chat/completions",
            json=SHORT,
            headers={"Authorization": f"Bearer {CLIENT_KEY}"},
        ) as r:
            assert r.status >= 500  # the engine's own 500, relayed
        good.set_fault(make_fault("none"))
    fmt = JsonFormatter()
    logged = "\n".join(fmt.format(rec) for rec in caplog.records)
    assert logged  # the run did log (access log off; warnings and info on)
    for secret in (CLIENT_KEY, REPLICA_KEY, ADMIN_TOKEN):
        assert secret not in logged


@pytest.mark.parametrize(
    "message",
    [
        'Traceback (most recent call last):\n  File "/app/vllm/engine.py", line 3\nRuntimeError',
        'EngineCore failed: File "/usr/lib/python3/site.py", line 1',
        "upstream http://10.0.3.7:8000/v1/chat/completions refused",
        "see https://internal.example/runbook",
    ],
)
def test_engine_messages_with_tracebacks_or_addresses_are_replaced(message):
    err = upstream_error(500, {"error": {"message": message, "code": 500}}, fallback="fallback")
    assert err.message == "fallback" and err.status == 500 and err.code == "500"


def test_engine_messages_without_leaks_are_kept():
    msg = "The input (5000 tokens) is longer than the model's context length (4096 tokens)."
    err = upstream_error(400, {"message": msg, "object": "error", "code": 400}, fallback="f")
    assert err.message == msg and err.code == "context_length_exceeded"
