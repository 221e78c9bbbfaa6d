"""Every "not ready" explained (issue 22, item 3): the probe's cause in words, at warning
level once per change, on /admin/replicas with wall-clock times, and honest 503s while
replicas are down or not yet probed."""

from __future__ import annotations

import logging
import re
import socket
from typing import Any

import aiohttp
import pytest

from tests.gateway.conftest import MODEL, wait_for

ADMIN = {"Authorization": "Bearer admin-t"}
ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: connection refused
    return port


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def discovery_log() -> Any:
    lines = Lines()
    logger = logging.getLogger("kvgate.discovery")
    logger.addHandler(lines)
    try:
        yield lines
    finally:
        logger.removeHandler(lines)


async def admin_replicas(gw: Any) -> dict[str, dict[str, Any]]:
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/admin/replicas", headers=ADMIN) as r:
            assert r.status == 200
            return {x["name"]: x for x in (await r.json())["replicas"]}


@pytest.mark.slow
async def test_each_cause_is_named_on_admin_and_logged_once_at_warning(
    replica, gateway, discovery_log
) -> None:
    vllm = await replica()
    sglang = await replica(flavor="sglang")
    gw = await gateway(
        replicas=[
            {"name": "ok", "url": vllm.url},
            {"name": "slash-v1", "url": vllm.url + "/v1"},
            {"name": "refused", "url": f"http://127.0.0.1:{closed_port()}"},
            {"name": "not-vllm", "url": sglang.url, "engine": "vllm"},
            {"name": "not-sglang", "url": vllm.url, "engine": "sglang"},
        ],
        auth={"admin_token": "admin-t"},
    )
    rounds = 4
    await wait_for(lambda: False, within=rounds * 0.2)  # several discovery rounds
    reps = await admin_replicas(gw)
    assert reps["ok"]["ready"] and reps["ok"]["error"] is None
    assert ISO.match(reps["ok"]["last_ok"]) and ISO.match(reps["ok"]["updated_at"])
    want = {
        "slash-v1": "the URL ends in /v1: give the server's root (" + vllm.url + ")",
        "refused": "connection refused",
        "not-vllm": "no vllm:cache_config_info in /metrics: is this vLLM?",
        "not-sglang": "/server_info answered HTTP 404: is this SGLang? (engine: sglang)",
    }
    for name, words in want.items():
        r = reps[name]
        assert not r["ready"], name
        assert words in (r["error"] or ""), (name, r["error"])
        assert r["last_error"] == r["error"] and ISO.match(r["last_error_at"]), name
        assert r["last_ok"] is None, name
    # One warning per replica and cause, however many rounds repeated it.
    for name in want:
        mine = [
            x
            for x in discovery_log.records
            if x.levelno == logging.WARNING and x.fields.get("replica") == name  # type: ignore[attr-defined]
        ]
        assert len(mine) == 1, (name, [x.getMessage() for x in mine])
        assert want[name] in mine[0].getMessage()


async def test_a_stopped_replica_is_down_not_full(replica, gateway, discovery_log) -> None:
    srv = await replica()
    gw = await gateway(srv, auth={"admin_token": "admin-t"}, discovery={"fail_threshold": 1})
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    await srv.stop()
    assert await wait_for(lambda: not any(u.ready for u in gw.report.replica_usage()))
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 503
            err = (await r.json())["error"]
            assert err["code"] == "no_replica_ready"
            assert "KV capacity" not in err["message"] and "is ready" in err["message"]
            assert int(r.headers["Retry-After"]) >= 1
    rep = (await admin_replicas(gw))["r0"]
    assert "connection refused" in rep["error"] and ISO.match(rep["last_ok"])
    went = [x for x in discovery_log.records if "is not ready" in x.getMessage()]
    assert (
        went and went[0].levelno == logging.WARNING and "connection refused" in went[0].getMessage()
    )


async def test_an_unknown_model_is_503_while_a_replica_is_unprobed_then_404(
    replica, gateway
) -> None:
    srv = await replica()
    body = {"model": "not-yet-listed", "prompt": "hi", "max_tokens": 4}
    gw = await gateway(
        replicas=[
            {"name": "up", "url": srv.url},
            {"name": "starting", "url": f"http://127.0.0.1:{closed_port()}"},
        ]
    )
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/completions", json=body) as r:
            assert r.status == 503
            assert (await r.json())["error"]["code"] == "models_unknown"
            assert int(r.headers["Retry-After"]) >= 1
    alone = await gateway(srv)
    async with aiohttp.ClientSession() as s:
        async with s.post(alone.url + "/v1/completions", json=body) as r:
            assert r.status == 404
            assert (await r.json())["error"]["code"] == "model_not_found"
