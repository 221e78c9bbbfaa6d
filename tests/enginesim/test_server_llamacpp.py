"""The llamacpp flavor over real loopback HTTP: llama-server's endpoints, shapes and errors."""

from __future__ import annotations

import asyncio
import json
import re
import signal
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.enginesim.helpers import CHAT, COMPLETIONS, chat_body, parse_sse, wait_until
from tests.enginesim.test_server_cli import _spawn

ID = re.compile(r"^chatcmpl-[A-Za-z0-9]{32}$")
METRICS = (
    "prompt_tokens_total", "prompt_tokens_cached_total", "prompt_seconds_total",
    "tokens_predicted_total", "tokens_predicted_seconds_total", "n_decode_total",
    "n_tokens_max", "prompt_tokens_seconds", "predicted_tokens_seconds",
    "requests_processing", "requests_deferred", "n_busy_slots_per_decode",
)  # fmt: skip


@pytest.fixture
async def server(enginesim_server):
    return await enginesim_server("llamacpp-tiny", speed=50.0)


@pytest.fixture
async def unified(enginesim_server):
    return await enginesim_server("llamacpp-tiny", speed=50.0, kv_unified=True)


def _events(raw: bytes) -> list[Any]:
    """SSE `data:` payloads, [DONE] included, without requiring it."""
    out: list[Any] = []
    for part in raw.split(b"\n\n"):
        if part:
            assert part.startswith(b"data: "), part
            payload = part[len(b"data: ") :]
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


async def _metrics(session: aiohttp.ClientSession, url: str) -> tuple[str, dict[str, float]]:
    async with session.get(url + "/metrics") as r:
        assert r.status == 200
        assert r.headers["Content-Type"] == "text/plain; version=0.0.4"
        text = await r.text()
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return text, values


def _words(n: int) -> str:
    return " word" * n  # one token each


# -- plain endpoints ------------------------------------------------------------------------


async def test_health_props_models(server, unified, session):
    async with session.get(server.url + "/health") as r:
        assert (r.status, await r.json()) == (200, {"status": "ok"})
    for srv, n_ctx in ((server, 1024), (unified, 4096)):
        async with session.get(srv.url + "/props") as r:
            props = await r.json()
        assert props["default_generation_settings"]["n_ctx"] == n_ctx
        assert props["total_slots"] == 4
        assert props["default_generation_settings"]["params"]["n_predict"] == -1
        assert props["model_alias"] == srv.model_name and props["is_sleeping"] is False
        assert {"chat_template", "bos_token", "eos_token", "build_info"} <= set(props)
    async with session.get(server.url + "/v1/models") as r:
        models = await r.json()
    (card,) = models["data"]
    assert card["id"] == server.model_name and card["owned_by"] == "llamacpp"
    assert card["meta"]["n_ctx"] == 1024 and card["meta"]["n_ctx_train"] == 4096
    assert models["models"][0]["model"] == server.model_name


async def test_slots_show_processing_and_fail_on_no_slot(server, session):
    async with session.get(server.url + "/slots") as r:
        slots = await r.json()
    assert [s["id"] for s in slots] == [0, 1, 2, 3]
    assert all(s == {"id": s["id"], "n_ctx": 1024, "speculative": False,
                     "is_processing": False} for s in slots)  # fmt: skip
    # Five long requests: four slots busy, one deferred.
    body = {"prompt": _words(20), "max_tokens": 900, "ignore_eos": True, "stream": True}
    resps = [await session.post(server.url + COMPLETIONS, json=body) for _ in range(4)]
    fifth = asyncio.create_task(session.post(server.url + COMPLETIONS, json=body))
    await wait_until(lambda: server.core.stats().num_waiting == 1)
    async with session.get(server.url + "/slots") as r:
        slots = await r.json()
    assert all(s["is_processing"] for s in slots)
    busy = slots[3]
    assert busy["n_prompt_tokens"] >= 20 and busy["params"]["n_predict"] == 900
    assert busy["next_token"][0]["has_next_token"] is True
    async with session.get(server.url + "/slots?fail_on_no_slot=1") as r:
        assert r.status == 503
        assert await r.json() == {
            "error": {"code": 503, "message": "no slot available", "type": "unavailable_error"}
        }
    _, m = await _metrics(session, server.url)
    assert (m["llamacpp:requests_processing"], m["llamacpp:requests_deferred"]) == (4, 1)
    for resp in resps:
        resp.close()
    (await fifth).close()
    await wait_until(lambda: not server.core.has_work())
    # A released slot keeps its cache and last parameters; its request figures reset.
    async with session.get(server.url + "/slots") as r:
        idle = (await r.json())[3]
    assert idle["is_processing"] is False and idle["n_prompt_tokens"] > 20
    assert idle["n_prompt_tokens_processed"] == idle["n_prompt_tokens_cache"] == 0
    assert idle["next_token"] == [
        {"has_next_token": False, "has_new_line": False, "n_remain": -1, "n_decoded": 0}
    ]


async def test_tokenize_detokenize_apply_template(server, session):
    url = server.url
    async with session.post(url + "/tokenize", json={"content": "hello the model"}) as r:
        ids = (await r.json())["tokens"]
    assert len(ids) == 3 and all(isinstance(i, int) for i in ids)
    body = {"content": "hello the model", "with_pieces": True, "add_special": True}
    async with session.post(url + "/tokenize", json=body) as r:
        pieces = (await r.json())["tokens"]
    assert [p["piece"] for p in pieces] == ["<|begin|>", "hello", " the", " model"]
    assert [p["id"] for p in pieces[1:]] == ids
    # Words of the generation vocabulary decode (other ids are one-way hashes).
    async with session.post(url + "/detokenize", json={"tokens": ids}) as r:
        assert await r.json() == {"content": " the model"}
    msgs = [{"role": "user", "content": "hi"}]
    async with session.post(url + "/apply-template", json={"messages": msgs}) as r:
        prompt = (await r.json())["prompt"]
    assert prompt == "<|begin|><|user|>\nhi<|end|>\n<|assistant|>\n"


async def test_metrics_names_and_values(enginesim_server, session):
    server = await enginesim_server("llamacpp-tiny", speed=50.0, kv_cache_metrics=True)
    body = chat_body(max_tokens=6, ignore_eos=True)
    for _ in range(2):  # the second request reuses the first one's slot cache
        async with session.post(server.url + CHAT, json=body) as r:
            assert r.status == 200
    text, m = await _metrics(session, server.url)
    for name in METRICS:  # as llama-server writes them (n_tokens_max: a counter, no _total)
        assert f"# TYPE llamacpp:{name} " in text
        assert re.search(rf"^llamacpp:{name} \S+$", text, re.MULTILINE)
    st = server.core.stats()
    assert m["llamacpp:tokens_predicted_total"] == 12 == st.tokens_predicted
    assert m["llamacpp:prompt_tokens_cached_total"] == st.prompt_tokens_cached > 0
    assert m["llamacpp:prompt_tokens_total"] == st.prompt_tokens_processed
    assert m["llamacpp:predicted_tokens_seconds"] > 0
    assert 0 < m["llamacpp:kv_cache_usage_ratio"] < 1 and m["llamacpp:kv_cache_tokens"] > 0
    _, again = await _metrics(session, server.url)
    assert again["llamacpp:predicted_tokens_seconds"] == 0  # a new window since the scrape
    assert again["llamacpp:tokens_predicted_total"] == 12


async def test_default_metrics_have_no_kv_gauges(server, session):
    text, _ = await _metrics(session, server.url)
    assert "kv_cache" not in text  # removed from llama-server in May 2025


# -- completions ----------------------------------------------------------------------------


async def test_chat_non_stream_shape(server, session):
    async with session.post(server.url + CHAT, json=chat_body(max_tokens=5)) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("application/json")
        data = await r.json()
    assert ID.match(data["id"]) and data["object"] == "chat.completion"
    assert data["system_fingerprint"] and data["model"] == server.model_name
    (choice,) = data["choices"]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    usage = data["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    # tokenize(apply-template(messages)) is the request's prompt_tokens, as on llama-server.
    msgs = chat_body()["messages"]
    async with session.post(server.url + "/apply-template", json={"messages": msgs}) as r:
        prompt = (await r.json())["prompt"]
    async with session.post(server.url + "/tokenize", json={"content": prompt}) as r:
        assert len((await r.json())["tokens"]) == usage["prompt_tokens"]
    t = data["timings"]
    assert (
        t["prompt_n"] == usage["prompt_tokens"] and t["predicted_n"] == usage["completion_tokens"]
    )
    assert t["cache_n"] == 0 and t["prompt_ms"] > 0


async def test_chat_stream_shape(server, session):
    body = chat_body(max_tokens=4, ignore_eos=True, stream=True,
                     stream_options={"include_usage": True})  # fmt: skip
    async with session.post(server.url + CHAT, json=body) as r:
        assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
        events = parse_sse(await r.read())
    *chunks, usage_chunk, done = events
    assert done == "[DONE]"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    deltas = [c["choices"][0]["delta"] for c in chunks[1:-1]]
    assert len(deltas) == 4 and all(set(d) == {"content"} for d in deltas)
    assert chunks[-1]["choices"] == [{"finish_reason": "length", "index": 0, "delta": {}}]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 4
    assert "timings" in usage_chunk and "timings" not in chunks[-1]
    assert len({c["id"] for c in events[:-1]}) == 1


async def test_completion_stream_ends_with_usage_and_timings(server, session):
    body = {"prompt": "Once upon a time", "max_tokens": 3, "ignore_eos": True, "stream": True}
    async with session.post(server.url + COMPLETIONS, json=body) as r:
        events = parse_sse(await r.read())
    *chunks, final, done = events
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 3
    assert final["choices"][0]["text"] == "" and final["choices"][0]["finish_reason"] == "length"
    assert final["usage"]["completion_tokens"] == 3 and "timings" in final


async def test_generation_stops_at_the_slot_context(server, session):
    body = {"prompt": _words(1000), "ignore_eos": True}  # no max_tokens: until it is full
    async with session.post(server.url + COMPLETIONS, json=body) as r:
        data = await r.json()
    usage = data["usage"]
    assert data["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 1024


async def test_disconnect_releases_the_slot_and_starts_a_deferred_request(server, session):
    body = {"prompt": _words(30), "max_tokens": 900, "ignore_eos": True, "stream": True}
    resps = [await session.post(server.url + COMPLETIONS, json=body) for _ in range(4)]
    for resp in resps:
        await resp.content.readuntil(b"\n\n")  # each slot is generating
    short = {"prompt": "next", "max_tokens": 2}
    waiting = asyncio.create_task(session.post(server.url + COMPLETIONS, json=short))
    await wait_until(lambda: server.core.stats().num_waiting == 1)
    resps[0].close()  # the client goes away: its slot is released at once
    async with await waiting as r:
        assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 2
    for resp in resps[1:]:
        resp.close()
    await wait_until(lambda: server.core.stats().num_running == 0)
    assert server.driver.num_in_flight == 0 and server.core.stats().num_aborted == 4


async def test_chat_second_turn_reuses_the_slot_cache(server, session):
    """A resent history hits everything the slot computed: prompt and answer but its
    last token (llama.cpp's per-slot prompt cache, with the simulator's round trip)."""
    turn1 = [{"role": "user", "content": "Tell me about slots."}]
    body = {"messages": turn1, "max_tokens": 30, "ignore_eos": True}
    async with session.post(server.url + CHAT, json=body) as r:
        data = await r.json()
    p1, answer = data["usage"]["prompt_tokens"], data["choices"][0]["message"]["content"]
    turn2 = [*turn1, {"role": "assistant", "content": answer},
             {"role": "user", "content": "And the cache?"}]  # fmt: skip
    async with session.post(server.url + CHAT, json={"messages": turn2, "max_tokens": 2}) as r:
        data = await r.json()
    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == p1 + 30 - 1
    assert data["timings"]["cache_n"] == p1 + 30 - 1


async def test_abandoned_non_stream_request_lingers_on_a_quiet_server(enginesim_server, session):
    """llama-server sees a non-stream client gone only when its 1 s wait for results
    times out: the request runs on for up to a (virtual) second, then is cancelled."""
    server = await enginesim_server("llamacpp-tiny", speed=5.0)  # 1 s is 200 ms here
    body = {"prompt": _words(30), "max_tokens": 900, "ignore_eos": True}
    task = asyncio.create_task(session.post(server.url + COMPLETIONS, json=body))
    await wait_until(lambda: server.core.stats().num_running == 1)
    gone = server.driver.vnow()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)
    assert server.core.stats().num_running == 1  # still generating
    await wait_until(lambda: server.core.stats().num_running == 0)
    assert 0 < server.driver.vnow() - gone <= 1.5
    st = server.core.stats()
    assert st.num_aborted == 1 and 0 < st.tokens_predicted < 900


async def test_abandoned_non_stream_request_runs_to_its_end_on_a_busy_server(server, session):
    """Another stream's tokens keep restarting the wait: the abandoned request finishes."""
    stream = await session.post(
        server.url + COMPLETIONS,
        json={"prompt": _words(10), "max_tokens": 1000, "ignore_eos": True, "stream": True},
    )
    body = {"prompt": _words(30), "max_tokens": 300, "ignore_eos": True}
    task = asyncio.create_task(session.post(server.url + COMPLETIONS, json=body))
    await wait_until(lambda: server.core.stats().num_running == 2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await stream.read()  # the stream runs on to its end meanwhile
    stream.close()
    await wait_until(lambda: server.core.stats().num_running == 0)
    st = server.core.stats()
    assert st.num_aborted == 0 and st.num_finished == 2
    assert st.tokens_predicted == 300 + 1000


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_prompt_over_the_slot_context_is_400_exceed_context_size(server, session, stream):
    body = {"prompt": _words(1100), "max_tokens": 5, "stream": stream}
    async with session.post(server.url + COMPLETIONS, json=body) as r:
        assert r.status == 400
        assert r.headers["Content-Type"].startswith("application/json")  # not a stream
        err = await r.json()
    n = err["error"]["n_prompt_tokens"]
    assert err == {
        "error": {
            "code": 400,
            "message": f"request ({n} tokens) exceeds the available context size (1024 "
            "tokens), try increasing it",
            "type": "exceed_context_size_error",
            "n_prompt_tokens": n,
            "n_ctx": 1024,
        }
    }
    assert n > 1024 and server.driver.num_in_flight == 0


async def test_unified_overflow_mid_stream_is_an_error_event(unified, session):
    """Four sequences outgrow the shared pool together: every one of them fails."""

    async def one(i: int, stream: bool) -> tuple[int, Any]:
        body = {"prompt": f"session {i}" + _words(600), "max_tokens": 700,
                "ignore_eos": True, "stream": stream}  # fmt: skip
        async with session.post(unified.url + COMPLETIONS, json=body) as r:
            return r.status, (await r.read())

    results = await asyncio.gather(*(one(i, stream=i % 2 == 0) for i in range(4)))
    for i, (status, raw) in enumerate(results):
        expected = {"code": 500, "message": "Context size has been exceeded.",
                    "type": "server_error"}  # fmt: skip
        if i % 2 == 0:  # streams: tokens, then one error event; no [DONE]
            assert status == 200
            events = _events(raw)
            assert events[-1] == {"error": expected} and "[DONE]" not in events
            assert len(events) > 100  # it failed mid-flight, at the point of overflow
        else:
            assert status == 500 and json.loads(raw) == {"error": expected}
    assert unified.core.stats().num_failed == 4
    assert unified.core.stats().num_preemptions == 0


async def test_openai_client_sees_llamacpp_errors(server):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    try:
        ok = await client.chat.completions.create(
            model="anything", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert ok.choices[0].message.content and ok.usage.completion_tokens <= 3
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model="x", prompt=_words(1500), max_tokens=2)
        assert info.value.status_code == 400
        assert info.value.body["type"] == "exceed_context_size_error"  # type: ignore[index]
        assert info.value.body["code"] == 400  # type: ignore[index]
    finally:
        await client.close()


async def test_bad_input_and_unknown_routes(server, session):
    async with session.post(server.url + COMPLETIONS, data=b"{not json") as r:
        assert r.status == 500 and (await r.json())["error"]["type"] == "server_error"
    async with session.post(server.url + CHAT, json={"model": "m"}) as r:
        assert r.status == 400
        err = (await r.json())["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == 400 and "param" not in err
    async with session.get(server.url + "/nope") as r:
        assert r.status == 404
        assert await r.json() == {
            "error": {"message": "File Not Found", "type": "not_found_error", "code": 404}
        }
    fault = {"mode": "error", "status": 503}
    async with session.post(server.url + "/admin/faults", json=fault) as r:
        assert r.status == 200
    async with session.post(server.url + CHAT, json=chat_body()) as r:
        assert r.status == 503
        assert (await r.json())["error"]["type"] == "unavailable_error"


@pytest.mark.slow  # a real `enginesim serve` process
async def test_cli_llamacpp_unified():
    proc, url = await _spawn(
        "--profile", "llamacpp-tiny", "--speed", "20", "--kv-unified", "--cache-ram", "0"
    )  # fmt: skip
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            async with s.get(url + "/props") as r:
                props = await r.json()
            assert props["default_generation_settings"]["n_ctx"] == 4096
            async with s.get(url + "/metrics") as r:
                assert "llamacpp:requests_processing 0" in await r.text()
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
