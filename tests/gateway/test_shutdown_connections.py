"""No request is dropped by a stopping gateway's connections (gateway/connections.py).

Before: a connection the kernel had queued when the listener closed was reset under its
request, an idle keep-alive connection stayed open until the very end (to be closed under
a client's next request, its retry refused), and every answer during the drain kept its
connection alive. The chaos bench lost requests to both ("Server disconnected without
sending a response", "Connection reset by peer").
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket

import aiohttp
import pytest
import uvloop

from gateway.app import Gateway
from gateway.config import config_from_mapping
from gateway.connections import close_idle
from tests.gateway.conftest import wait_for
from tests.gateway.test_shutdown import SHORT, _exit_code, _serve

BODY = json.dumps(SHORT).encode()
REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: kvgate\r\nContent-Type: application/json\r\n"
    b"Content-Length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY
)
HEALTH = b"GET /health HTTP/1.1\r\nHost: kvgate\r\n\r\n"


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the gateway sends until it closes the connection (a reset raises)."""
    sock.settimeout(10.0)
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


async def _answers_to_connections_queued_at_listener_close(n: int) -> list[bytes]:
    # No replica is needed: a draining gateway answers before admission.
    cfg = {"replicas": [{"name": "r0", "url": "http://127.0.0.1:9"}], "logging": {}}
    gw = Gateway(config_from_mapping(cfg, env={}), host="127.0.0.1", port=0)
    await gw.start()
    queued = []
    try:
        for _ in range(n):
            # Blocking calls: the kernel completes each handshake; the loop never runs.
            sock = socket.create_connection(("127.0.0.1", gw.port), timeout=5.0)
            sock.sendall(REQUEST)
            queued.append(sock)
        gw.state.pipeline.begin_shutdown()
        await gw._close_listener()
        return await asyncio.gather(*(asyncio.to_thread(_read_until_closed, s) for s in queued))
    finally:
        for s in queued:
            s.close()
        await gw.stop()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])  # kvgate serve runs on uvloop
def test_connections_queued_when_the_listener_closes_are_answered(loop):
    """Connections the kernel accepted while the loop was busy (it has not run since)
    are answered 503 ``shutting_down`` when the listener closes, not reset."""
    run = uvloop.run if loop == "uvloop" else asyncio.run
    answers = run(_answers_to_connections_queued_at_listener_close(4))
    assert len(answers) == 4
    for answer in answers:
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), answer[:200]
        assert b"Retry-After" in head and b"Connection: close" in head
        assert json.loads(body)["error"]["code"] == "shutting_down"


async def test_a_connection_accepted_before_the_listener_closes_gets_its_answer():
    """A client connected just before the listener closed and sends its request after:
    the stop waits for it and answers it, instead of closing the connection under it."""
    cfg = {
        "replicas": [{"name": "r0", "url": "http://127.0.0.1:9"}],
        "shutdown": {"drain_grace_s": 0.0, "listen_grace_s": 0.0},
    }
    gw = Gateway(config_from_mapping(cfg, env={}), host="127.0.0.1", port=0)
    await gw.start()
    sock = socket.create_connection(("127.0.0.1", gw.port), timeout=5.0)
    try:
        assert await wait_for(lambda: len(gw.runner.server.connections) == 1)
        stopping = asyncio.create_task(gw.shutdown())
        assert await wait_for(lambda: gw._site is None)  # the listener is closed
        await asyncio.to_thread(sock.sendall, REQUEST)
        answer = await asyncio.to_thread(_read_until_closed, sock)
        await asyncio.wait_for(stopping, 10.0)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "shutting_down"


@pytest.mark.slow
async def test_drain_closes_idle_keepalive_connections_and_answers_with_connection_close(
    replica, tmp_path
):
    """SIGTERM: an idle keep-alive connection is closed at once, while the listener
    still answers (a client's retry gets a 503 with Retry-After, not a refusal), and
    every answer during the drain says ``Connection: close`` and closes its connection."""
    srv = await replica(speed=1.0)
    proc, url = await _serve(tmp_path, srv, grace=60.0, listen_grace=60.0)
    port = int(url.rsplit(":", 1)[1])
    loop = asyncio.get_running_loop()
    idle = socket.create_connection(("127.0.0.1", port), timeout=5.0)
    idle.setblocking(False)
    try:
        await loop.sock_sendall(idle, HEALTH)
        first = await asyncio.wait_for(loop.sock_recv(idle, 65536), 5.0)
        assert first.startswith(b"HTTP/1.1 200") and b"Connection: close" not in first
        proc.send_signal(signal.SIGTERM)
        # The idle connection is closed by the gateway (EOF), not left to the end.
        assert await asyncio.wait_for(loop.sock_recv(idle, 65536), 5.0) == b""
        async with aiohttp.ClientSession() as s:
            for path, method in (("/ready", "GET"), ("/v1/chat/completions", "POST")):
                payload = SHORT if method == "POST" else None
                async with s.request(method, url + path, json=payload) as r:
                    assert r.status == 503, path
                    assert r.headers.get("Connection") == "close", (path, dict(r.headers))
                    await r.read()
            async with s.post(url + "/v1/chat/completions", json=SHORT) as r:
                assert (await r.json())["error"]["code"] == "shutting_down"
                assert "Retry-After" in r.headers
        proc.send_signal(signal.SIGINT)
        assert await _exit_code(proc, 15.0) == 0
    finally:
        idle.close()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        log = (tmp_path / "kvgate.log").read_text()
        assert "Traceback" not in log, log


async def test_a_request_arriving_as_the_drain_starts_is_answered(replica, gateway):
    """A keep-alive connection whose next request has reached the kernel but not the
    loop is not closed under it: the request gets its 503."""
    srv = await replica()
    gw = await gateway(srv)
    sock = socket.create_connection(("127.0.0.1", gw.port), timeout=5.0)
    try:
        await asyncio.to_thread(sock.sendall, HEALTH)
        first = await asyncio.to_thread(sock.recv, 65536)
        assert first.startswith(b"HTTP/1.1 200")
        # The handler is back waiting for the connection's next request.
        assert await wait_for(lambda: all(c._waiter for c in gw.runner.server.connections))
        sock.sendall(REQUEST)  # blocking: in the kernel's buffer, the loop has not read it
        gw.state.pipeline.begin_shutdown()
        assert close_idle(gw.runner.server) == 0
        answer = await asyncio.to_thread(_read_until_closed, sock)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "shutting_down"
