"""Slow and stuck clients cannot hold kvgate's connections, handlers or reservations.

- slow headers (slowloris) and a connection that sends nothing: closed after
  ``limits.header_timeout_s``, before any handler runs;
- a slow body: 408 OpenAI error object after ``limits.body_timeout_s``, nothing reserved;
- a client that never reads its stream: once its socket buffers are full, kvgate stops
  reading from the engine (backpressure: the engine's request stays unfinished, nothing
  piles up in kvgate), and after ``limits.client_write_timeout_s`` without progress the
  client is cut, the engine's request aborted and the reservation freed, while the client
  still holds its connection open.

Raw sockets on 127.0.0.1, so the client misbehaves exactly as described.
"""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from tests.gateway.conftest import MODEL, wait_for

# ~100 KB of SSE: past the transport's 64 KiB high-water mark, within what the buffers hold.
END_TOKENS = 550
SLOW = {
    "header_timeout_s": 0.5,
    "body_timeout_s": 0.5,
    "client_write_timeout_s": 0.5,
    "client_send_buffer_bytes": 16384,
}


async def _closed_by_server(reader: asyncio.StreamReader, within: float) -> bool:
    try:
        async with asyncio.timeout(within):
            while await reader.read(4096):
                pass
        return True
    except TimeoutError:
        return False
    except ConnectionError:
        return True


async def test_slow_headers_are_cut(replica, gateway):
    srv = await replica()
    gw = await gateway(srv, limits=SLOW)
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + b"X-Pad: "
        + b"a" * 400
        + b"\r\n\r\n"
    )
    sent = 0
    closed = False
    try:
        for sent in range(1, len(head) + 1):  # one byte every 20 ms: ~9 s for the head
            writer.write(head[sent - 1 : sent])
            await writer.drain()
            await asyncio.sleep(0.02)
            if reader.at_eof():
                closed = True
                break
    except ConnectionError:
        closed = True
    finally:
        writer.close()
    assert closed and sent < len(head), f"head not cut: {sent} of {len(head)} bytes sent"
    assert gw.state.pipeline.inflight == 0


async def test_silent_connection_is_closed(replica, gateway):
    srv = await replica()
    gw = await gateway(srv, limits=SLOW)
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        assert await _closed_by_server(reader, within=10.0)
    finally:
        writer.close()


async def test_slow_body_gets_408(replica, gateway):
    srv = await replica()
    gw = await gateway(srv, limits=SLOW)
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    ).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:10]
        )
        await writer.drain()
        async with asyncio.timeout(10.0):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            payload = await reader.readexactly(length)
    finally:
        writer.close()
    assert head.startswith(b"HTTP/1.1 408"), head
    err = json.loads(payload)["error"]
    assert err["code"] == "body_timeout" and set(err) == {"message", "type", "param", "code"}
    assert gw.report.reserved_tokens() == 0
    assert srv.core.stats().num_finished == 0  # it never reached the engine


async def test_slow_body_connection_is_closed_after_its_408(replica, gateway):
    """The 408 says ``Connection: close``, and the connection closes with it: kvgate does
    not linger (aiohttp's 10 s) reading a body it has already answered."""
    gw = await gateway(await replica(), limits=SLOW)
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"model":'
        )
        await writer.drain()
        async with asyncio.timeout(10.0):
            head = await reader.readuntil(b"\r\n\r\n")
        answered = loop.time()
        assert head.startswith(b"HTTP/1.1 408"), head
        assert b"connection: close" in head.lower(), head
        assert await _closed_by_server(reader, within=5.0), "still open 5 s after the 408"
        closed = loop.time()
    finally:
        writer.close()
    assert closed - answered < 1.0, f"closed {closed - answered:.1f} s after the 408"


@pytest.mark.slow
async def test_client_that_never_reads_its_stream_is_cut_and_released(replica, gateway):
    # Slow enough that the whole answer takes several write timeouts even on a loaded
    # machine: the cut must come long before the engine would finish.
    srv = await replica(speed=10.0)
    gw = await gateway(srv, limits=SLOW, upstream={"total_s": 60.0})
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "write forever"}],
            "max_tokens": 2000,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: small window
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", gw.port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=1024)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        await writer.drain()
        # Never read. Wait for kvgate to give up on us.
        assert await wait_for(lambda: gw.state.pipeline.inflight == 1, within=10.0)
        assert await wait_for(lambda: gw.state.pipeline.inflight == 0, within=30.0)
        assert gw.report.reserved_tokens() == 0
        # The engine's request was aborted, not finished: kvgate stopped pulling tokens
        # once the client's buffers were full, so it never buffered the whole answer.
        assert await wait_for(lambda: srv.core.stats().num_aborted == 1, within=5.0)
        assert srv.core.stats().num_finished == 0
        assert srv.core.stats().generation_tokens < 2000
        # The client's connection was dropped (what was buffered for it is gone).
        assert await _closed_by_server(reader, within=10.0)
    finally:
        writer.close()
    text = gw.state.metrics.render().decode()
    assert 'outcome="client_stalled"' in text


async def test_client_that_stops_reading_at_the_end_of_its_stream_is_released(replica, gateway):
    """The whole answer fits the buffers but crosses the transport's high-water mark:
    the engine finishes, and it is the stream's last write that the client never takes.
    That write is bounded too: the reservation is freed, the connection dropped."""
    srv = await replica(speed=50.0)
    gw = await gateway(srv, limits=SLOW, upstream={"total_s": 60.0})
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "write a while"}],
            "max_tokens": END_TOKENS,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", gw.port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=1024)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        await writer.drain()
        assert await wait_for(lambda: gw.state.pipeline.inflight == 1, within=10.0)
        assert await wait_for(lambda: srv.core.stats().num_finished == 1, within=20.0)
        assert await wait_for(lambda: gw.state.pipeline.inflight == 0, within=30.0)
        assert gw.report.reserved_tokens() == 0
        assert await _closed_by_server(reader, within=10.0)
    finally:
        writer.close()
    text = gw.state.metrics.render().decode()
    assert 'outcome="client_stalled"' in text


class TailDelay:
    """A TCP relay in front of a replica that holds what follows an engine's ``[DONE]``
    (the chunked body's end) for `delay_s`: a real engine writes the two apart, and this
    makes the gap between them long enough for a client to close inside it."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        self.target_port = target_port
        self.delay_s = delay_s
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, hold: bool) -> None:
        try:
            while data := await r.read(65536):
                at = data.find(b"data: [DONE]\n\n") if hold else -1
                if at >= 0:
                    cut = at + len(b"data: [DONE]\n\n") + 2  # with the chunk's CRLF
                    w.write(data[:cut])
                    await w.drain()
                    await asyncio.sleep(self.delay_s)
                    data = data[cut:]
                w.write(data)
                await w.drain()
        except ConnectionError:
            pass
        finally:
            w.close()

    async def _conn(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection("127.0.0.1", self.target_port)
        await asyncio.gather(self._pipe(cr, uw, False), self._pipe(ur, cw, True))


async def test_a_stream_closed_right_after_its_done_is_ok(replica, gateway):
    """A client that closes its connection as soon as it reads ``[DONE]`` (before the
    chunked body's last bytes) got its whole answer: the outcome is ``ok``, not a
    disconnect."""
    from tests.gateway.test_ops import scrape

    srv = await replica()
    tail = TailDelay(int(srv.url.rsplit(":", 1)[1]), 0.3)
    await tail.start()
    gw = await gateway(replicas=[{"name": "r0", "url": tail.url}])
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
         "stream": True}
    ).encode()  # fmt: skip
    runs = 3
    for _ in range(runs):
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        await writer.drain()
        seen = b""
        async with asyncio.timeout(10.0):
            while b"data: [DONE]" not in seen:
                got = await reader.read(4096)
                assert got, seen
                seen += got
        writer.transport.abort()  # gone at once, as a client done with its answer is
    assert await wait_for(lambda: gw.state.pipeline.inflight == 0, within=10.0)
    live = await scrape(gw)
    outcomes = {
        dict(labels)["outcome"]: v for (name, labels), v in live.items()
        if name == "kvgate_requests_total"
    }  # fmt: skip
    assert outcomes.get("ok") == runs, outcomes
    assert gw.report.reserved_tokens() == 0
    assert tail.server is not None
    tail.server.close()
