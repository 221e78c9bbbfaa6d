"""kvgate in front of a llama.cpp replica (enginesim's llamacpp flavor, virtual time): the
pool per KV layout, worst-case reservations where the engine does not preempt, its error
events as upstream errors, its error shapes as OpenAI's, abandoned non-stream requests
held until the slot stops, and `timings` kept when kvgate strips the usage it asked for.

The same behaviours against the real llama-server: tests/realengine/test_through_kvgate.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from admission.types import Completion, RequestEnd
from tests.gateway.conftest import wait_for

MODEL = "tiny-llama"
ADMIN = {"admin_token": "t"}


@pytest.fixture
async def llama(enginesim_server):
    """``srv = await llama(kv_unified=False)``: llama-server 4 slots x 1,024 (or 4,096
    shared), its clock 50x wall time."""

    async def factory(**kwargs: Any) -> Any:
        kwargs.setdefault("speed", 50.0)
        return await enginesim_server("llamacpp-tiny", **kwargs)

    return factory


def body(content: str, max_tokens: int | None, *, stream: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "ignore_eos": True,
        "stream": stream,
    }
    if max_tokens is not None:
        out["max_tokens"] = max_tokens
    return out


def words(n: int, tag: int = 0) -> str:
    return f"{tag}" + " word" * n  # one token a word


async def replicas(gw: Any) -> dict[str, dict[str, Any]]:
    headers = {"Authorization": "Bearer t"}
    async with (
        aiohttp.ClientSession() as s,
        s.get(gw.url + "/admin/replicas", headers=headers) as r,
    ):
        assert r.status == 200
        return {x["name"]: x for x in (await r.json())["replicas"]}


async def metric(gw: Any, family: str) -> dict[tuple[tuple[str, str], ...], float]:
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
        text = await r.text()
    return {
        tuple(sorted(smp.labels.items())): smp.value
        for fam in text_string_to_metric_families(text)
        if fam.name == family
        for smp in fam.samples
        if smp.name.endswith("_total")
    }


async def stream_events(url: str, payload: dict[str, Any]) -> tuple[int, list[Any], dict[str, str]]:
    """(status, data payloads as JSON or "[DONE]", headers) of one request."""
    async with aiohttp.ClientSession() as s, s.post(url, json=payload) as r:
        raw = await r.read()
        headers = dict(r.headers)
        if not r.headers.get("Content-Type", "").startswith("text/event-stream"):
            return r.status, [json.loads(raw)], headers
    events: list[Any] = []
    for part in raw.split(b"\n\n"):
        if part.startswith(b"data: "):
            data = part[len(b"data: ") :]
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return r.status, events, headers


# ---------------------------------------------------------------------------- discovery
async def test_per_slot_server_is_read_as_one_slot_until_its_slots_prove_more(llama, gateway):
    srv = await llama()
    gw = await gateway(srv, engine="llamacpp", auth=ADMIN)
    r0 = (await replicas(gw))["r0"]
    assert (r0["capacity_tokens"], r0["max_model_len"], r0["max_running"]) == (1024, 1024, 4)
    assert (r0["preempts"], r0["private_slots"]) == (False, False)
    # Requests of ~600 tokens, one after another, land on different slots, whose caches
    # then hold more than 1,024 tokens together: not a unified pool of 1,024.
    url = gw.url + "/v1/chat/completions"
    for i in range(3):
        status, _, _ = await stream_events(url, body(words(580, i), 8))
        assert status == 200
    assert await wait_for(lambda: gw.report.replica_usage()[0].capacity_tokens == 4096)
    r0 = (await replicas(gw))["r0"]
    assert (r0["capacity_tokens"], r0["effective_capacity_tokens"]) == (4096, 4096)
    assert (r0["max_model_len"], r0["private_slots"]) == (1024, True)


@pytest.mark.parametrize(
    ("unified", "layout", "pool", "effective", "max_len"),
    [
        (False, "per_slot", 4096, 4096, 1024),
        (True, "unified", 4096, 4096, 4096),  # headroom is the estimates' margin, not the pool's
        (True, "auto", 4096, 4096, 4096),  # the unified reading is exact here
    ],
)
async def test_configured_layouts(llama, gateway, unified, layout, pool, effective, max_len):
    srv = await llama(kv_unified=unified)
    gw = await gateway(srv, engine="llamacpp", kv_layout=layout, auth=ADMIN)
    r0 = (await replicas(gw))["r0"]
    assert (r0["capacity_tokens"], r0["effective_capacity_tokens"]) == (pool, effective)
    assert (r0["max_model_len"], r0["max_running"]) == (max_len, 4)


async def test_a_pinned_pool_wins_over_the_layout(llama, gateway):
    srv = await llama()
    gw = await gateway(srv, engine="llamacpp", kv_layout="per_slot", pool_tokens=2048)
    assert gw.report.replica_usage()[0].capacity_tokens == 2048


# ---------------------------------------------------------------------------- KV pressure
def pressure(n: int) -> list[dict[str, Any]]:
    """`n` streams of ~700 prompt tokens that each generate 900: two fit 4,096 cells."""
    return [body(words(700, i), 900, stream=True) for i in range(n)]


@pytest.mark.slow
async def test_kv_pressure_straight_fails_mid_stream_through_kvgate_completes(llama, gateway):
    srv = await llama(kv_unified=True)
    straight = await asyncio.gather(
        *(stream_events(srv.url + "/v1/chat/completions", b) for b in pressure(4))
    )
    assert all(status == 200 and "error" in ev[-1] for status, ev, _ in straight)

    gw = await gateway(srv, engine="llamacpp")  # fresh: nothing learned yet
    through = await asyncio.gather(
        *(stream_events(gw.url + "/v1/chat/completions", b) for b in pressure(8))
    )
    for status, events, _ in through:
        assert status == 200
        assert events[-1] == "[DONE]"
        chunks = [e for e in events if isinstance(e, dict)]
        assert not any("error" in e for e in chunks)
        assert [c for c in chunks if c["choices"]][-1]["choices"][0]["finish_reason"] == "length"
    # Reserved prompt + max_tokens, exactly counted: never more than two at once.
    assert srv.core.stats().n_tokens_max <= 1610
    errors = await metric(gw, "kvgate_upstream_errors")
    assert errors == {}
    assert gw.report.top_up_failures == 0


# ---------------------------------------------------------------------------- error events
async def test_error_event_is_an_upstream_error_everywhere(llama, gateway, monkeypatch):
    """A pool pinned four times too large lets kvgate over-admit a unified server: the
    overrun's error events reach the client as OpenAI errors, count as upstream errors and
    tell the learned limit the replica failed."""
    srv = await llama(kv_unified=True)
    gw = await gateway(
        srv,
        engine="llamacpp",
        pool_tokens=16384,
        admission={"learn_limit": False},  # all four at once, as the slots allow
    )
    told: list[Completion | None] = []
    door = gw.state.door
    request_ended = door.request_ended

    def spy(end: RequestEnd) -> None:
        told.append(end.completion)
        request_ended(end)

    monkeypatch.setattr(door, "request_ended", spy)
    results = await asyncio.gather(
        *(stream_events(gw.url + "/v1/chat/completions", b) for b in pressure(4))
    )
    for status, events, _ in results:
        assert status == 200
        assert events[-1] == {
            "error": {
                "message": "Context size has been exceeded.",
                "type": "server_error",
                "param": None,
                "code": "500",
            }
        }
    assert (await metric(gw, "kvgate_upstream_errors")) == {
        (("kind", "stream_error"), ("replica", "r0")): 4.0
    }
    outcomes = await metric(gw, "kvgate_requests")
    assert outcomes == {(("model", MODEL), ("outcome", "upstream_stream_error")): 4.0}
    assert [c.ok if c else None for c in told] == [False] * 4


# ---------------------------------------------------------------------------- over context
async def test_over_context_is_a_400_openai_error(llama, gateway):
    srv = await llama()
    gw = await gateway(srv, engine="llamacpp", kv_layout="per_slot")
    # Counted exactly on the replica (/apply-template, /tokenize): kvgate refuses it.
    status, (err,), _ = await stream_events(gw.url + "/v1/chat/completions", body(words(1100), 4))
    assert status == 400
    assert err["error"]["code"] == "context_length_exceeded"
    assert set(err["error"]) == {"message", "type", "param", "code"}
    # Without the replica's count the estimate lets it through; the engine's own 400 comes
    # back in OpenAI's shape, its message kept, for a stream too (refused before it starts).
    estimated = await gateway(
        srv, engine="llamacpp", kv_layout="per_slot", counting={"replica_tokenize": False}
    )
    text = " a" * 1100  # 2 characters a token: the estimate (3 a token) says ~740
    status, (err,), _ = await stream_events(
        estimated.url + "/v1/chat/completions", body(text, 4, stream=True)
    )
    assert status == 400
    assert err == {
        "error": {
            "message": "request (1107 tokens) exceeds the available context size (1024 "
            "tokens), try increasing it",
            "type": "invalid_request_error",
            "param": None,
            "code": "context_length_exceeded",
        }
    }


# ---------------------------------------------------------------------------- disconnects
async def abandon(url: str, payload: dict[str, Any], started: Any) -> None:
    """Send a non-stream request and hang up once `started()` holds."""

    async def call() -> None:
        async with aiohttp.ClientSession() as s, s.post(url, json=payload) as r:
            await r.read()

    task = asyncio.create_task(call())
    assert await wait_for(started)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_abandoned_non_stream_request_is_held_until_its_slot_stops(llama, gateway):
    srv = await llama(kv_unified=True)
    gw = await gateway(srv, engine="llamacpp", discovery={"refresh_interval_s": 0.5})
    core = srv.core
    await abandon(
        gw.url + "/v1/chat/completions",
        body("hi", 3500),
        lambda: core.stats().num_running == 1,
    )
    assert await wait_for(lambda: gw.report.held() == 1)
    assert gw.report.reserved_tokens() > 0
    released_while_running: list[int] = []

    def released() -> bool:
        if gw.report.held():
            return False
        released_while_running.append(core.stats().num_running)
        return True

    assert await wait_for(released, step=0.002)
    assert released_while_running == [0]  # never before the engine let it go
    assert gw.report.reserved_tokens() == 0


@pytest.mark.slow
async def test_abandoned_request_on_a_busy_server_is_held_while_it_generates(llama, gateway):
    """Another stream's tokens keep llama-server from noticing the hang-up: the abandoned
    request generates to its end, and its reservation is held that long."""
    srv = await llama(kv_unified=True, speed=8.0)
    gw = await gateway(
        srv,
        engine="llamacpp",
        kv_layout="unified",
        discovery={"refresh_interval_s": 0.3},
        admission={"abandoned_hold_s": 30.0},
    )
    core = srv.core
    url = gw.url + "/v1/chat/completions"
    busy = asyncio.create_task(stream_events(url, body("busy", 1900, stream=True)))
    assert await wait_for(lambda: core.stats().num_running == 1)
    await abandon(url, body("abandoned", 1800), lambda: core.stats().num_running == 2)
    assert await wait_for(lambda: gw.report.held() == 1)
    # The engine goes on with both for a while (rounds of discovery see it); the hold
    # lasts as long, and ends when the abandoned one has generated to its end.
    seen_held = 0
    while core.stats().num_running == 2:
        assert gw.report.held() == 1
        seen_held += 1
        await asyncio.sleep(0.05)
    assert seen_held >= 10  # over half a second, past discovery rounds
    assert await wait_for(lambda: gw.report.held() == 0, within=10.0)
    assert core.stats().num_running <= 1
    status, events, _ = await busy
    assert status == 200 and events[-1] == "[DONE]"


async def test_stream_disconnect_releases_at_once(llama, gateway):
    srv = await llama(kv_unified=True, speed=5.0)
    gw = await gateway(srv, engine="llamacpp")
    async with aiohttp.ClientSession() as s:
        resp = await s.post(gw.url + "/v1/chat/completions", json=body("hi", 3000, stream=True))
        assert resp.status == 200
        await resp.content.readany()
        resp.close()
    assert await wait_for(lambda: gw.report.reserved_tokens() == 0)
    assert gw.report.held() == 0
    assert await wait_for(lambda: srv.core.stats().num_running == 0)


# ---------------------------------------------------------------------------- usage
async def test_stripped_usage_keeps_llamacpps_timings(llama, gateway):
    srv = await llama()
    gw = await gateway(srv, engine="llamacpp")
    status, events, _ = await stream_events(
        gw.url + "/v1/chat/completions", body("hi", 4, stream=True)
    )
    assert status == 200 and events[-1] == "[DONE]"
    chunks = events[:-1]
    assert not any("usage" in c for c in chunks)
    last = chunks[-1]
    assert last["choices"] == [] and "timings" in last
    assert last["timings"]["predicted_n"] == 4
    # Asked for, the usage is there as the engine sent it.
    payload = {**body("hi", 4, stream=True), "stream_options": {"include_usage": True}}
    _, events, _ = await stream_events(gw.url + "/v1/chat/completions", payload)
    assert events[-2]["usage"]["completion_tokens"] == 4 and "timings" in events[-2]
