"""Graceful shutdown: a real ``kvgate serve`` process on loopback, stopped by PID.

SIGTERM: ``/ready`` turns false at once, queued requests are shed with 503 and
Retry-After, running requests get ``shutdown.drain_grace_s``, then streams are cut with
an error event; the process exits 0. A second SIGTERM (or a SIGINT) is fast. The
embedded `Gateway.shutdown` drains a request that ends within the grace.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.gateway.conftest import MODEL, wait_for

LONG = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "tell me a long story"}],
    "max_tokens": 1500,
    "ignore_eos": True,
    "stream": True,
}
SHORT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
ROOT = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _serve(
    tmp_path: Path, srv: Any, grace: float, listen_grace: float = 60.0
) -> tuple[asyncio.subprocess.Process, str]:
    port = _free_port()
    cfg = {
        "listen": {"host": "127.0.0.1", "port": port},
        "replicas": [{"name": "r0", "url": srv.url, "max_running": 1}],
        "admission": {"queue_timeout_s": 30.0},
        "discovery": {"refresh_interval_s": 0.2, "probe_timeout_s": 0.5},
        "shutdown": {"drain_grace_s": grace, "listen_grace_s": listen_grace},
        "logging": {"access_log": False},
    }
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = (tmp_path / "kvgate.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "serve", "-c", str(path),
        cwd=ROOT, stdout=log, stderr=log,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as s:
        for _ in range(300):
            with contextlib.suppress(aiohttp.ClientError):
                async with s.get(url + "/ready") as r:
                    if r.status == 200:
                        return proc, url
            if proc.returncode is not None:
                break
            await asyncio.sleep(0.05)
    proc.kill()
    await proc.wait()
    pytest.fail("kvgate serve did not become ready: " + (tmp_path / "kvgate.log").read_text())


async def _queue_depth(s: aiohttp.ClientSession, url: str) -> float:
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith(f'kvgate_queue_depth{{model="{MODEL}"}}'):
            return float(line.split()[-1])
    return 0.0


async def _exit_code(proc: asyncio.subprocess.Process, within: float) -> int | None:
    try:
        async with asyncio.timeout(within):
            return await proc.wait()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return None


async def _sigterm_scenario(tmp_path: Path, srv: Any, *, grace: float, second: int | None):
    """One long stream running, one request queued behind it, then SIGTERM (and maybe a
    second signal). Returns (queued answer, stream tail, exit code, seconds to exit)."""
    proc, url = await _serve(tmp_path, srv, grace)
    loop = asyncio.get_running_loop()
    try:
        async with aiohttp.ClientSession() as s:
            stream = await s.post(url + "/v1/chat/completions", json=LONG)
            assert stream.status == 200
            await stream.content.readany()
            queued = asyncio.ensure_future(s.post(url + "/v1/chat/completions", json=SHORT))
            for _ in range(200):
                if await _queue_depth(s, url) == 1:
                    break
                await asyncio.sleep(0.02)
            assert await _queue_depth(s, url) == 1
            t0 = loop.time()
            proc.send_signal(signal.SIGTERM)
            # Queued: shed at once with 503 and Retry-After.
            r = await asyncio.wait_for(queued, 5.0)
            shed = (r.status, r.headers.get("Retry-After"), await r.json())
            # /ready is false at once (the listener stays open while running requests drain).
            async with s.get(url + "/ready") as rr:
                ready = (rr.status, await rr.json())
            # A new request is answered at once too.
            async with s.post(url + "/v1/chat/completions", json=SHORT) as rn:
                assert rn.status == 503 and "Retry-After" in rn.headers
                assert (await rn.json())["error"]["code"] == "shutting_down"
            if second is not None:
                proc.send_signal(second)
            tail = (await asyncio.wait_for(stream.read(), 30.0)).decode()
            stream.release()
        code = await _exit_code(proc, 15.0)
        return shed, ready, tail, code, loop.time() - t0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        log = (tmp_path / "kvgate.log").read_text()
        assert "Traceback" not in log, log


def _last_event(tail: str) -> dict[str, Any]:
    events = [e for e in tail.replace("\r\n", "\n").split("\n\n") if e.strip()]
    assert events and events[-1].startswith("data: ")
    return json.loads(events[-1][len("data: ") :])


async def test_sigterm_sheds_queue_drains_then_cuts_and_exits_0(replica, tmp_path):
    srv = await replica(speed=1.0)
    shed, ready, tail, code, took = await _sigterm_scenario(tmp_path, srv, grace=2.0, second=None)
    status, retry_after, body = shed
    assert status == 503 and retry_after is not None and int(retry_after) >= 1
    assert body["error"]["code"] == "shutting_down"
    assert ready == (503, {"ready": False, "draining": True, "replicas": []})
    # The running stream was given the grace, then cut with a clean error event.
    assert "[DONE]" not in tail
    assert _last_event(tail)["error"]["code"] == "shutting_down"
    assert took >= 2.0
    assert code == 0
    # The engine saw the connection close and aborted the request.
    assert await wait_for(lambda: srv.core.stats().blocks_in_use == 0, within=5.0)


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT])
async def test_second_signal_is_fast(replica, tmp_path, second):
    srv = await replica(speed=1.0)
    shed, _ready, tail, code, took = await _sigterm_scenario(
        tmp_path, srv, grace=60.0, second=second
    )
    assert shed[0] == 503
    assert _last_event(tail)["error"]["code"] == "shutting_down"
    assert code == 0 and took < 10.0
    assert await wait_for(lambda: srv.core.stats().blocks_in_use == 0, within=5.0)


async def test_embedded_shutdown_drains_a_request_that_ends_within_the_grace(replica, gateway):
    srv = await replica(speed=5.0)
    gw = await gateway(srv)
    body = {**LONG, "max_tokens": 30}
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            await r.content.readany()
            assert gw.state.pipeline.inflight == 1  # still running when shutdown begins
            done = asyncio.ensure_future(gw.shutdown(10.0))
            tail = (await r.read()).decode()
        result = await asyncio.wait_for(done, 10.0)
    assert tail.rstrip().endswith("data: [DONE]")
    assert result == {"shed": 0, "cut": 0, "drained": True}
    assert gw.report.reserved_tokens() == 0


async def test_a_cleanup_that_hangs_does_not_keep_a_drained_gateway_from_stopping(
    replica, monkeypatch
):
    """Every request answered, a cleanup step that never ends: shutdown gives up on it
    after its bound and returns (the process then exits), having said where it waited."""
    import logging

    import gateway.app as app_module
    from gateway.app import Gateway
    from gateway.config import config_from_mapping

    srv = await replica(speed=5.0)
    monkeypatch.setattr(app_module, "_STUCK_REPORT_S", 0.2)
    monkeypatch.setattr(app_module, "_STOP_LIMIT_S", 0.5)
    cfg = config_from_mapping(
        {
            "replicas": [{"name": "r0", "url": srv.url}],
            "shutdown": {"drain_grace_s": 1.0, "listen_grace_s": 0.0},
            "logging": {"access_log": False},
        },
        env={},
    )
    gw = Gateway(cfg, host="127.0.0.1", port=0)
    hang = asyncio.Event()

    async def stuck(app: Any) -> None:
        await hang.wait()  # never set

    gw.app.on_cleanup.append(stuck)
    await gw.start()
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("kvgate").addHandler(handler)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.url + "/v1/chat/completions", json=SHORT) as r:
                assert r.status == 200
        result = await asyncio.wait_for(gw.shutdown(), 5.0)
    finally:
        logging.getLogger("kvgate").removeHandler(handler)
    assert result["drained"] is True
    assert any("stopping task" in m and "stuck" in m for m in seen), seen
    assert any("exiting without it" in m for m in seen), seen


async def _refused(port: int) -> bool:
    try:
        _r, w = await asyncio.open_connection("127.0.0.1", port)
    except ConnectionRefusedError:
        return True
    w.close()
    return False


async def test_new_connections_are_refused_after_the_listen_grace(replica, tmp_path):
    """After ``shutdown.listen_grace_s`` the listener closes (connections are refused)
    while a running stream goes on; SIGINT then cuts it and the process exits 0."""
    srv = await replica(speed=1.0)
    proc, url = await _serve(tmp_path, srv, grace=60.0, listen_grace=0.5)
    port = int(url.rsplit(":", 1)[1])
    try:
        async with aiohttp.ClientSession() as s:
            stream = await s.post(url + "/v1/chat/completions", json=LONG)
            assert stream.status == 200
            await stream.content.readany()
            assert not await _refused(port)
            proc.send_signal(signal.SIGTERM)
            refused = False
            for _ in range(200):
                if refused := await _refused(port):
                    break
                await asyncio.sleep(0.05)
            assert refused
            # The running stream was not touched by the listener closing.
            assert not stream.content.at_eof()
            await stream.content.readany()
            proc.send_signal(signal.SIGINT)
            tail = (await asyncio.wait_for(stream.read(), 30.0)).decode()
            stream.release()
        assert _last_event(tail)["error"]["code"] == "shutting_down"
        assert await _exit_code(proc, 15.0) == 0
        assert await wait_for(lambda: srv.core.stats().blocks_in_use == 0, within=5.0)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        log = (tmp_path / "kvgate.log").read_text()
        assert "Traceback" not in log, log


async def test_a_retry_waiting_in_the_queue_at_shutdown_is_told_shutting_down(replica, gateway):
    """A request whose replica died before its first byte waits in the queue for a retry
    (the other replica is full); shutdown sheds it as shutting_down, not as the 502."""
    from enginesim.faults import make_fault

    dead = await replica()
    busy = await replica(speed=1.0)
    gw = await gateway(
        replicas=[
            {"name": "dead", "url": dead.url, "pool_tokens": 300},  # too small for the long one
            {"name": "busy", "url": busy.url, "max_running": 1},
        ],
        discovery={"refresh_interval_s": 30.0},
        admission={"learn_limit": False},
    )
    async with aiohttp.ClientSession() as s:
        hold = await s.post(gw.url + "/v1/chat/completions", json={**LONG, "max_tokens": 400})
        assert hold.status == 200
        await hold.content.readany()
        usage = {u.name: u for u in gw.report.replica_usage()}
        assert usage["busy"].running == 1  # the long stream holds the only slot there
        dead.set_fault(make_fault("crash"))
        assert await wait_for(lambda: dead.crashed)
        retry = asyncio.ensure_future(s.post(gw.url + "/v1/chat/completions", json=SHORT))
        assert await wait_for(lambda: gw.report.queue_depth() == 1, within=10.0)
        gw.state.pipeline.begin_shutdown()
        r = await asyncio.wait_for(retry, 10.0)
        assert r.status == 503 and "Retry-After" in r.headers
        assert (await r.json())["error"]["code"] == "shutting_down"
        r.release()
        hold.close()
    assert await wait_for(lambda: gw.report.reserved_tokens() == 0, within=10.0)
