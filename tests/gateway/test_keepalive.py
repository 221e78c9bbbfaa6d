"""Pooled connections and the engine's idle close.

Engines' HTTP servers close keep-alive connections idle for 5 s; a request written on such
a connection just as the server closes it is lost (seen in CI in front of a real vLLM,
"Can not write request body": the only replica's request came back as 502). kvgate never
reuses a connection idle that long, and a model's only replica that drops one request's
connection gets the retry, as there is nowhere else to send it.

The engine is a real enginesim replica behind a loopback TCP relay that records how long
each connection was idle before a request reused it and, once armed, closes the next POST
that arrives on a connection that already carried an exchange.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest

from tests.gateway.conftest import MODEL


class IdleCloseRelay:
    """TCP relay to `upstream` that drops `drops` POSTs written on reused connections."""

    def __init__(self, upstream_port: int) -> None:
        self._port = upstream_port
        self.drops = 0
        self.dropped = 0
        self.idle_before_reuse: list[float] = []  # seconds, per request on a used connection
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection("127.0.0.1", self._port)
        answered = asyncio.Event()  # an answer went back on this connection
        last = [0.0]  # when the last answer byte went back
        down = asyncio.create_task(self._down(ur, cw, answered, last))
        self._tasks.add(down)
        try:
            loop = asyncio.get_running_loop()
            while chunk := await cr.read(65536):
                if answered.is_set() and chunk[:4] in (b"POST", b"GET "):
                    self.idle_before_reuse.append(loop.time() - last[0])
                if answered.is_set() and chunk.startswith(b"POST") and self.drops > 0:
                    self.drops -= 1
                    self.dropped += 1
                    break  # closed as the request arrived: the engine never sees it
                uw.write(chunk)
                await uw.drain()
        except ConnectionError:
            pass
        finally:
            down.cancel()
            self._tasks.discard(down)
            for w in (cw, uw):
                with contextlib.suppress(Exception):
                    w.close()

    @staticmethod
    async def _down(
        ur: asyncio.StreamReader,
        cw: asyncio.StreamWriter,
        answered: asyncio.Event,
        last: list[float],
    ) -> None:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            while chunk := await ur.read(65536):
                cw.write(chunk)
                await cw.drain()
                last[0] = loop.time()
                answered.set()


def body(stream: bool) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 8,
        "stream": stream,
    }


async def upstream_errors(gw) -> dict[tuple[str, str], float]:
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
        text = await r.text()
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("kvgate_upstream_errors_total{"):
            labels, value = line.rsplit(" ", 1)
            fields = dict(kv.split("=") for kv in labels[labels.index("{") + 1 : -1].split(","))
            out[(fields["replica"].strip('"'), fields["kind"].strip('"'))] = float(value)
    return out


@pytest.mark.slow
async def test_no_connection_idle_as_long_as_the_engines_close_is_reused(replica, gateway):
    srv = await replica()
    relay = IdleCloseRelay(int(srv.url.rsplit(":", 1)[1]))
    url = await relay.start()
    try:
        # Probes off after the first round: only requests use the pool.
        gw = await gateway(
            replicas=[{"name": "r0", "url": url}], discovery={"refresh_interval_s": 60.0}
        )
        async with aiohttp.ClientSession() as client:
            for pause in (0.0, 4.5):
                await asyncio.sleep(pause)
                async with client.post(gw.url + "/v1/chat/completions", json=body(False)) as r:
                    assert r.status == 200
        # uvicorn (vLLM, SGLang) and llama.cpp close at 5 s idle: nothing near it is reused.
        assert relay.idle_before_reuse and max(relay.idle_before_reuse) < 4.5
    finally:
        await relay.stop()


@pytest.mark.parametrize("stream", [False, True])
async def test_the_only_replica_gets_the_retry_of_a_dropped_connection(replica, gateway, stream):
    srv = await replica()
    relay = IdleCloseRelay(int(srv.url.rsplit(":", 1)[1]))
    url = await relay.start()
    try:
        gw = await gateway(replicas=[{"name": "r0", "url": url}])
        async with aiohttp.ClientSession() as client:
            # Warm kvgate's pool towards the replica, then arm the relay.
            async with client.post(gw.url + "/v1/chat/completions", json=body(False)) as r:
                assert r.status == 200
            relay.drops = 1
            async with client.post(gw.url + "/v1/chat/completions", json=body(stream)) as r:
                text = await r.text()
                assert r.status == 200, text
            if stream:
                assert text.rstrip().endswith("data: [DONE]")
            else:
                assert json.loads(text)["choices"][0]["message"]["content"]
        assert relay.dropped == 1  # the lost connection happened, and was retried
        assert await upstream_errors(gw) == {("r0", "dropped"): 1.0}
        assert gw.report.replica_usage()[0].ready
    finally:
        await relay.stop()
