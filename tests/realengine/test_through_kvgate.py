"""kvgate in front of the real llama-server, per-slot and unified: what it discovers, the
openai client through it, KV pressure straight and through a fresh kvgate, over-context
answers, client disconnects, and the metrics afterwards.

The same behaviours on the simulator, cheaper: tests/gateway/test_llamacpp.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import Gateway
from tests.realengine.conftest import ADMIN_TOKEN
from tests.realengine.llama import MODEL_ALIAS, N_CTX, N_SLOTS, LlamaServer

SLOT_CTX = {"per_slot": N_CTX // N_SLOTS, "unified": N_CTX}
TIMEOUT = aiohttp.ClientTimeout(total=60)


def chat(text: str, max_tokens: int | None, *, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL_ALIAS,
        "messages": [{"role": "user", "content": text}],
        "ignore_eos": True,  # the random model never ends by itself anyway
        "stream": stream,
    }
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


def the(n: int, tag: int = 0) -> str:
    """About n tokens ("the" is one token, " the" another), distinct per tag."""
    return f"{tag} " + " ".join(["the"] * n)


async def call(base: str, body: dict[str, Any]) -> tuple[int, list[Any], dict[str, str]]:
    """(status, payloads, headers): a stream's data events (JSON or "[DONE]"), else the
    one JSON body."""
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as s,
        s.post(base + "/v1/chat/completions", json=body) as r,
    ):
        raw = await r.read()
        headers = dict(r.headers)
        status = r.status
    if not headers.get("Content-Type", "").startswith("text/event-stream"):
        return status, [json.loads(raw)], headers
    events: list[Any] = []
    for part in raw.split(b"\n\n"):
        if part.startswith(b"data: "):
            data = part[len(b"data: ") :]
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return status, events, headers


async def admin(gw: Gateway) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as s,
        s.get(gw.url + "/admin/replicas", headers=headers) as r,
    ):
        assert r.status == 200
        (replica,) = (await r.json())["replicas"]
        return replica


async def counters(gw: Gateway, family: str) -> dict[tuple[tuple[str, str], ...], float]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.get(gw.url + "/metrics") as r:
        text = await r.text()
    return {
        tuple(sorted(smp.labels.items())): smp.value
        for fam in text_string_to_metric_families(text)
        if fam.name == family
        for smp in fam.samples
        if smp.name.endswith("_total")
    }


async def until(predicate: Any, within: float = 15.0, step: float = 0.02) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while not predicate():
        if loop.time() > end:
            return False
        await asyncio.sleep(step)
    return True


# ---------------------------------------------------------------------------- discovery
@pytest.mark.parametrize("layout", ["configured", "auto"])
async def test_discovery_reports_pool_cap_and_context(
    engine: LlamaServer, kvgate: Any, layout: str
) -> None:
    gw = await kvgate(engine, kv_layout=engine.name if layout == "configured" else "auto")
    r = await admin(gw)
    assert r["ready"] is True and r["engine"] == "llamacpp"
    assert (r["max_running"], r["block_size"], r["preempts"]) == (N_SLOTS, 1, False)
    assert r["max_model_len"] == SLOT_CTX[engine.name]
    if engine.name == "unified":  # one pool of 4,096, all of it: exact counts keep no margin
        assert (r["capacity_tokens"], r["effective_capacity_tokens"]) == (4096, 4096)
        assert r["private_slots"] is False
    elif layout == "configured":  # 4 private slots of 1,024: no headroom needed
        assert (r["capacity_tokens"], r["effective_capacity_tokens"]) == (4096, 4096)
        assert r["private_slots"] is True
    else:  # auto on the session's per-slot server, whose slots earlier tests filled
        assert r["capacity_tokens"] in (1024, 4096)


async def test_auto_reads_a_fresh_per_slot_server_safely_then_from_its_slots(
    fresh_per_slot: LlamaServer, kvgate: Any
) -> None:
    """Nothing over HTTP tells the layouts apart; auto starts with one 1,024-token pool
    (never over-stating a unified one) until the slots hold more than 1,024 together."""
    gw = await kvgate(fresh_per_slot, discovery={"refresh_interval_s": 0.3})
    r = await admin(gw)
    assert (r["capacity_tokens"], r["max_model_len"], r["private_slots"]) == (1024, 1024, False)
    for i in range(3):  # one after another: each lands on a slot the others left alone
        status, _, _ = await call(gw.url, chat(the(580, i), 4))
        assert status == 200
    assert await until(lambda: gw.report.replica_usage()[0].capacity_tokens == 4096, 5.0)
    r = await admin(gw)
    assert (r["capacity_tokens"], r["effective_capacity_tokens"]) == (4096, 4096)
    assert (r["max_model_len"], r["max_running"], r["private_slots"]) == (1024, 4, True)


# ---------------------------------------------------------------------------- openai client
async def test_openai_client_through_kvgate(engine: LlamaServer, kvgate: Any) -> None:
    gw = await kvgate(engine, kv_layout=engine.name)
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as c:
        assert [m.id async for m in c.models.list()] == [MODEL_ALIAS]
        out = await c.chat.completions.create(
            model=MODEL_ALIAS, messages=[{"role": "user", "content": "hi"}], max_tokens=8
        )
        assert out.choices[0].finish_reason == "length"
        assert out.usage is not None and out.usage.completion_tokens == 8
        # Streamed with usage: the engine's chunk, usage and timings.
        chunks = [
            ch
            async for ch in await c.chat.completions.create(
                model=MODEL_ALIAS,
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=8,
                stream=True,
                stream_options={"include_usage": True},
            )
        ]
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 8
        # Without: kvgate asked for usage and takes it off again; llama.cpp's timings stay.
        chunks = [
            ch
            async for ch in await c.chat.completions.create(
                model=MODEL_ALIAS,
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=8,
                stream=True,
            )
        ]
        assert all(ch.usage is None for ch in chunks)
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
        assert chunks[-1].choices == [] and (chunks[-1].model_extra or {}).get("timings")
        done = await c.completions.create(model=MODEL_ALIAS, prompt="the replica", max_tokens=4)
        assert done.usage is not None and done.usage.completion_tokens == 4
        # A prompt over the slot's context: kvgate counts it on the engine and refuses it.
        long = [{"role": "user", "content": the(SLOT_CTX[engine.name])}]
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as err:
                await c.chat.completions.create(
                    model=MODEL_ALIAS, messages=long, max_tokens=4, stream=stream
                )
            assert err.value.status_code == 400
            assert err.value.code == "context_length_exceeded"


# ---------------------------------------------------------------------------- KV pressure
def pressure(n: int, first: int) -> list[dict[str, Any]]:
    """`n` streams of ~800 prompt tokens generating 250 each: four at once (the slots)
    need 4,200 cells, more than a unified pool of 4,096; a per-slot one stops each at its
    slot's 1,024 with finish reason "length"."""
    return [chat(the(800, first + i), 250, stream=True) for i in range(n)]


def mid_stream_failures(results: list[tuple[int, list[Any], dict[str, str]]]) -> int:
    return sum(
        1
        for status, events, _ in results
        if status == 200 and (events[-1] != "[DONE]" or any("error" in e for e in events[:-1]))
    )


async def test_kv_pressure_straight_and_through_a_fresh_kvgate(
    engine: LlamaServer, kvgate: Any
) -> None:
    straight = await asyncio.gather(*(call(engine.url, b) for b in pressure(6, 0)))
    if engine.name == "unified":  # the four running overrun the shared cells and fail
        assert mid_stream_failures(straight) >= 4
    else:  # each slot owns its 1,024 cells: nothing to overrun
        assert mid_stream_failures(straight) == 0

    gw = await kvgate(engine)  # fresh, kv_layout auto: nothing learned, nothing configured
    through = await asyncio.gather(*(call(gw.url, b) for b in pressure(6, 100)))
    assert mid_stream_failures(through) == 0
    for status, events, headers in through:
        assert status in (200, 503), (status, events)
        if status == 503:
            assert int(headers["Retry-After"]) >= 1
        else:
            assert events[-1] == "[DONE]"
    assert await counters(gw, "kvgate_upstream_errors") == {}
    completed = sum(1 for status, _, _ in through if status == 200)
    outcomes = await counters(gw, "kvgate_requests")
    assert outcomes[(("model", MODEL_ALIAS), ("outcome", "ok"))] == completed
    assert gw.report.top_up_failures == 0


# ---------------------------------------------------------------------------- over context
@pytest.mark.parametrize("stream", [False, True])
async def test_over_context_is_a_400_openai_error(
    engine: LlamaServer, kvgate: Any, stream: bool
) -> None:
    n_ctx = SLOT_CTX[engine.name]
    gw = await kvgate(engine, kv_layout=engine.name)
    # Counted on the engine (/apply-template, /tokenize): kvgate's own refusal.
    status, (body,), _ = await call(gw.url, chat(the(n_ctx), 4, stream=stream))
    assert status == 400
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "context_length_exceeded"
    assert f"maximum context length is {n_ctx} tokens" in body["error"]["message"]
    # Without that count, one character a token looks short to the estimate (3 a token):
    # forwarded, and the engine's own 400 comes back as an OpenAI error object.
    blind = await kvgate(engine, kv_layout=engine.name, counting={"replica_tokenize": False})
    text = "xq zk vj " * (n_ctx // 9 + 10)
    status, (body,), _ = await call(blind.url, chat(text, 4, stream=stream))
    assert status == 400
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "context_length_exceeded"
    assert err["type"] == "invalid_request_error"
    assert err["message"].endswith(
        f"exceeds the available context size ({n_ctx} tokens), try increasing it"
    )


# ---------------------------------------------------------------------------- disconnects
async def test_stream_disconnect_releases_at_once(engine: LlamaServer, kvgate: Any) -> None:
    gw = await kvgate(engine, kv_layout=engine.name)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        resp = await s.post(
            gw.url + "/v1/chat/completions",
            json=chat("hi", SLOT_CTX[engine.name] - 50, stream=True),
        )
        assert resp.status == 200
        await resp.content.readany()
        assert gw.report.reserved_tokens() > 0
        resp.close()
    assert await until(lambda: gw.report.reserved_tokens() == 0, 5.0)
    assert gw.report.held() == 0  # a stream's engine stops at its next write


async def test_non_stream_disconnect_holds_the_reservation_until_the_slot_stops(
    engine: LlamaServer, kvgate: Any
) -> None:
    """llama-server notices a gone non-stream client only after a quiet second; kvgate
    keeps the reservation until /slots shows the slot idle, then releases it."""
    gw = await kvgate(engine, kv_layout=engine.name)
    max_tokens = SLOT_CTX[engine.name] - 50

    async def abandoned() -> None:
        async with (
            aiohttp.ClientSession(timeout=TIMEOUT) as s,
            s.post(gw.url + "/v1/chat/completions", json=chat("hi", max_tokens)) as r,
        ):
            await r.read()

    task = asyncio.create_task(abandoned())
    assert await until(lambda: gw.report.reserved_tokens() > 0, 5.0)
    await asyncio.sleep(0.2)  # the engine is generating
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await until(lambda: gw.report.held() == 1, 2.0)
    reserved = gw.report.reserved_tokens()
    assert reserved > 0  # held: the engine still has it
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert await until(lambda: gw.report.held() == 0, 10.0)
    held_for = loop.time() - t0
    assert gw.report.reserved_tokens() == 0
    # Released because the engine said so (a quiet second, then a discovery round), not
    # at the 5 s grace; and the engine did stop before generating everything.
    assert held_for < 4.5
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.get(engine.url + "/slots") as r:
            slots = await r.json()
    assert not any(slot["is_processing"] for slot in slots)


# ---------------------------------------------------------------------------- metrics after
async def test_metrics_after_an_overrun_kvgate_was_told_to_allow(
    unified: LlamaServer, kvgate: Any
) -> None:
    """A pool pinned four times too large lets kvgate over-admit the unified server: the
    engine's error events are upstream errors in kvgate's outcomes and metrics, and reach
    the client in OpenAI's shape."""
    gw = await kvgate(unified, pool_tokens=16384, admission={"learn_limit": False})
    bodies = [chat(the(700, 200 + i), 900, stream=True) for i in range(N_SLOTS)]
    results = await asyncio.gather(*(call(gw.url, b) for b in bodies))
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
    status, _, _ = await call(gw.url, chat("after", 4))
    assert status == 200
    assert await counters(gw, "kvgate_upstream_errors") == {
        (("kind", "stream_error"), ("replica", "r0")): float(N_SLOTS)
    }
    assert await counters(gw, "kvgate_requests") == {
        (("model", MODEL_ALIAS), ("outcome", "upstream_stream_error")): float(N_SLOTS),
        (("model", MODEL_ALIAS), ("outcome", "ok")): 1.0,
    }
