"""The rest of the simulated vLLM's serving surface (score, rerank, classify, pooling,
audio transcriptions and translations, detokenize) over real loopback HTTP, and through
the official `openai` SDK where it has the call."""

from __future__ import annotations

import asyncio
import base64
import math
import struct

import aiohttp
import pytest

from enginesim import tokenizer
from enginesim.serving_api import AUDIO_BYTES_PER_TOKEN
from tests.enginesim.helpers import (
    cancel_frees_the_core,
    holds_kv_while_running,
    parse_sse,
    scrape,
    wait_until,
)

TRANSCRIPTIONS = "/v1/audio/transcriptions"
TRANSLATIONS = "/v1/audio/translations"


@pytest.fixture
async def server(enginesim_server):
    return await enginesim_server("tiny", speed=50.0)


async def post_json(session, url: str, body: dict, status: int = 200) -> dict:
    async with session.post(url, json=body) as resp:
        assert resp.status == status, await resp.text()
        assert resp.content_type == "application/json"
        data = await resp.json()
    if status >= 400:
        err = data["error"]
        assert err["code"] == status and err["type"] and err["message"]
    return data


def audio_form(audio: bytes, **fields: str) -> aiohttp.FormData:
    form = aiohttp.FormData()
    form.add_field("file", audio, filename="a.wav", content_type="audio/wav")
    for k, v in fields.items():
        form.add_field(k, v)
    return form


# -- rerank and score ------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
async def test_rerank_shape_and_order(server, session, path):
    docs = ["the cache holds memory", "bananas are yellow", "cache memory and the server"]
    body = {"model": server.model_name, "query": "cache memory", "documents": docs}
    data = await post_json(session, server.url + path, body)
    assert list(data) == ["id", "model", "usage", "results"]
    assert data["id"].startswith("score-") and data["model"] == server.model_name
    results = data["results"]
    assert sorted(r["index"] for r in results) == [0, 1, 2]
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True) and all(0 < s < 1 for s in scores)
    assert results[-1]["index"] == 1  # shares no word with the query
    for r in results:
        assert r["document"] == {"text": docs[r["index"]], "multi_modal": None}
    usage = data["usage"]
    assert usage == {"prompt_tokens": usage["total_tokens"], "total_tokens": usage["total_tokens"]}
    # one cross-encoder pair per document: query, separator, document, separator
    q = len(tokenizer.encode("cache memory"))
    assert usage["total_tokens"] == sum(q + len(tokenizer.encode(d)) + 2 for d in docs)

    again = await post_json(session, server.url + path, {**body, "top_n": 2})
    assert again["results"] == results[:2]  # deterministic scores, cut to top_n
    one = await post_json(session, server.url + path, {"query": "x", "documents": "x y"})
    assert len(one["results"]) == 1


async def test_rerank_and_score_errors(server, session):
    url = server.url
    await post_json(session, url + "/rerank", {"query": "q", "documents": []}, status=400)
    await post_json(session, url + "/rerank", {"documents": ["a"]}, status=400)  # no query
    await post_json(
        session, url + "/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, status=400
    )
    # vLLM's documents are strings or {"content": [...]} parts (multimodal models only)
    mm = {"query": "q", "documents": [{"content": [{"type": "text", "text": "a"}]}]}
    await post_json(session, url + "/rerank", mm, status=400)
    await post_json(
        session, url + "/rerank", {"model": "nope", "query": "q", "documents": ["a"]}, status=404
    )
    err = await post_json(
        session, url + "/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, status=400
    )
    assert err["error"]["message"] == "Input lengths must be either 1:1, 1:N or N:N"
    await post_json(session, url + "/score", {"text_1": "a"}, status=400)
    await post_json(
        session, url + "/score", {"text_1": "a", "text_2": "b", "normalize": True}, status=400
    )


@pytest.mark.parametrize(
    "sides",
    [("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2")],
)
async def test_score_shape_and_spellings(server, session, sides):
    a, b = sides
    body = {"model": server.model_name, a: "cache memory", b: ["memory cache", "bananas"]}
    for path in ("/score", "/v1/score"):
        data = await post_json(session, server.url + path, body)
        assert list(data) == ["id", "object", "created", "model", "data", "usage"]
        assert data["id"].startswith("score-") and data["object"] == "list"
        assert [d["index"] for d in data["data"]] == [0, 1]
        assert all(d["object"] == "score" for d in data["data"])
        s0, s1 = (d["score"] for d in data["data"])
        assert 0 < s1 < s0 < 1
        usage = data["usage"]
        assert usage["prompt_tokens"] == usage["total_tokens"] > 0
        assert usage["completion_tokens"] == 0
    n_to_n = await post_json(
        session, server.url + "/score", {a: ["a", "b"], b: ["a", "c"]}
    )  # pairwise
    assert len(n_to_n["data"]) == 2


async def test_request_id_header_names_the_answer(server, session):
    async with session.post(
        server.url + "/score", json={"text_1": "a", "text_2": "b"}, headers={"X-Request-Id": "r1"}
    ) as resp:
        assert (await resp.json())["id"] == "score-r1"


# -- classify and pooling --------------------------------------------------------------------


async def test_classify(server, session):
    url = server.url + "/classify"
    data = await post_json(session, url, {"model": server.model_name, "input": ["good", "bad"]})
    assert list(data) == ["id", "object", "created", "model", "data", "usage"]
    assert data["id"].startswith("classify-") and data["object"] == "list"
    for i, d in enumerate(data["data"]):
        assert d["index"] == i and d["num_classes"] == len(d["probs"]) == 2
        assert math.isclose(sum(d["probs"]), 1.0)
        best = max(range(2), key=d["probs"].__getitem__)
        assert d["label"] == f"LABEL_{best}"
    assert data["usage"]["prompt_tokens"] == 2
    again = await post_json(session, url, {"input": "good"})
    assert again["data"][0]["probs"] == data["data"][0]["probs"]  # deterministic
    chat = await post_json(session, url, {"messages": [{"role": "user", "content": "hi"}]})
    assert len(chat["data"]) == 1 and chat["usage"]["prompt_tokens"] > 1
    ids = await post_json(session, url, {"input": [[5, 6, 7]]})
    assert ids["usage"]["prompt_tokens"] == 3
    await post_json(session, url, {"input": []}, status=400)
    await post_json(session, url, {}, status=400)
    await post_json(session, url, {"input": "x", "normalize": True}, status=400)


async def test_pooling_tasks_and_encodings(server, session):
    url = server.url + "/pooling"
    data = await post_json(session, url, {"model": server.model_name, "input": "hello world"})
    assert list(data) == ["id", "object", "created", "model", "data", "usage"]
    assert data["id"].startswith("pooling-") and data["object"] == "list"
    (item,) = data["data"]
    assert item["index"] == 0 and item["object"] == "pooling"
    vec = item["data"]
    assert len(vec) == 8 and math.isclose(sum(x * x for x in vec), 1.0)
    emb = await post_json(session, server.url + "/v1/embeddings", {"input": "hello world"})
    assert emb["data"][0]["embedding"] == vec  # the embed task is /v1/embeddings' vector
    n = len(tokenizer.encode("hello world"))
    assert data["usage"]["prompt_tokens"] == data["usage"]["total_tokens"] == n

    b64 = await post_json(session, url, {"input": "hello world", "encoding_format": "base64"})
    raw = base64.b64decode(b64["data"][0]["data"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(vec, rel=1e-6)
    cls = await post_json(session, url, {"input": "hello world", "task": "classify"})
    assert math.isclose(sum(cls["data"][0]["data"]), 1.0)
    tok = await post_json(session, url, {"input": "hello world", "task": "token_embed"})
    assert len(tok["data"][0]["data"]) == n and len(tok["data"][0]["data"][0]) == 8

    await post_json(session, url, {"input": "x", "dimensions": 4}, status=400)
    for task in ("score", "encode", "plugin", "nonsense"):
        await post_json(session, url, {"input": "x", "task": task}, status=400)
    await post_json(session, url, {"model": "nope", "input": "x"}, status=404)


@pytest.mark.slow  # a clock slowed to watch the prefill
async def test_pooling_endpoints_are_prefill_only_requests(enginesim_server, session):
    server = await enginesim_server("tiny", speed=0.02)  # slow enough to watch the prefill
    before = await scrape(session, server.url)
    doc = "words " * 300
    data = await holds_kv_while_running(
        server,
        post_json(session, server.url + "/rerank", {"query": "words", "documents": [doc, doc]}),
    )
    stats = server.core.stats()
    assert stats.generation_tokens == 0 and stats.num_finished == 2  # one per pair
    for path, body in (("/classify", {"input": "a b"}), ("/pooling", {"input": "c d"})):
        await post_json(session, server.url + path, body)
    m = await scrape(session, server.url)
    assert m["vllm:request_success_total"] - before["vllm:request_success_total"] == 4
    assert m["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == (
        data["usage"]["prompt_tokens"] + 2 * len(tokenizer.encode("a b"))
    )
    assert m["vllm:generation_tokens_total"] == 0


async def test_pooling_disconnect_aborts_in_the_core(enginesim_server, session):
    server = await enginesim_server("tiny", speed=0.01)
    body = {"input": ["words " * 600, "other " * 600]}
    task = asyncio.create_task(session.post(server.url + "/classify", json=body))
    await wait_until(lambda: server.core.stats().blocks_in_use > 0)
    await cancel_frees_the_core(server, task)
    assert server.core.stats().num_aborted == 2


# -- detokenize ------------------------------------------------------------------------------


async def test_detokenize(server, session):
    gen = [tokenizer.gen_token(i) for i in range(6)]
    data = await post_json(
        session, server.url + "/detokenize", {"model": server.model_name, "tokens": gen}
    )
    assert data == {"prompt": tokenizer.decode(gen)}
    # the text of a completion round-trips through /tokenize and /detokenize
    text = data["prompt"]
    toks = await post_json(session, server.url + "/tokenize", {"prompt": text})
    back = await post_json(session, server.url + "/detokenize", {"tokens": toks["tokens"]})
    assert back["prompt"] == text
    special = await post_json(session, server.url + "/detokenize", {"tokens": [1, 3]})
    assert special["prompt"] == "<|begin|><|user|>"
    await post_json(session, server.url + "/detokenize", {"tokens": [-1]}, status=400)
    await post_json(session, server.url + "/detokenize", {"tokens": [10**9]}, status=400)
    await post_json(session, server.url + "/detokenize", {}, status=400)
    await post_json(session, server.url + "/detokenize", {"model": "x", "tokens": []}, status=404)


# -- audio -----------------------------------------------------------------------------------


async def test_transcription_non_stream(server, session):
    audio = bytes(range(256)) * 125  # 32,000 bytes: one second, 50 audio tokens
    m0 = await scrape(session, server.url)
    form = audio_form(audio, model=server.model_name, max_completion_tokens="5", ignore_eos="1")
    async with session.post(server.url + TRANSCRIPTIONS, data=form) as resp:
        assert resp.status == 200, await resp.text()
        data = await resp.json()
    assert list(data) == ["text", "usage"]
    assert data["text"] and data["usage"] == {"type": "duration", "seconds": 1}
    m = await scrape(session, server.url)
    assert m["vllm:generation_tokens_total"] - m0["vllm:generation_tokens_total"] == 5
    prompt = 32_000 // AUDIO_BYTES_PER_TOKEN
    assert m["vllm:prompt_tokens_total"] - m0["vllm:prompt_tokens_total"] == prompt

    # a text prompt adds its tokens; the same audio decodes the same way
    form = audio_form(audio, prompt="hello there", max_completion_tokens="5", ignore_eos="1")
    async with session.post(server.url + TRANSCRIPTIONS, data=form) as resp:
        assert resp.status == 200
    m2 = await scrape(session, server.url)
    assert m2["vllm:prompt_tokens_total"] - m["vllm:prompt_tokens_total"] == prompt + 2

    # response_format text is still vLLM's JSON object; translations carry no usage
    form = audio_form(audio, response_format="text", max_completion_tokens="3")
    async with session.post(server.url + TRANSLATIONS, data=form) as resp:
        assert resp.status == 200
        data = await resp.json()
    assert list(data) == ["text"]


async def test_transcription_stream(server, session):
    audio = b"\x01\x02" * 3200  # 6,400 bytes: 10 audio tokens, 0.2 s
    form = audio_form(
        audio,
        stream="true",
        stream_include_usage="true",
        max_completion_tokens="6",
        ignore_eos="true",
    )
    async with session.post(server.url + TRANSCRIPTIONS, data=form) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        events = parse_sse(await resp.read())
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert all(c["object"] == "transcription.chunk" for c in events[:-1])
    assert len({c["id"] for c in events[:-1]}) == 1 and chunks[0]["id"].startswith("transcribe-")
    for c in chunks:
        assert list(c) == ["id", "object", "created", "model", "choices"]
        (choice,) = c["choices"]
        assert "index" not in choice and set(choice["delta"]) == {"content"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"][0]["stop_reason"] is None
    assert all("finish_reason" not in c["choices"][0] for c in chunks[:-1])
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 10, "total_tokens": 16, "completion_tokens": 6}

    form = audio_form(audio, stream="true", max_completion_tokens="3")
    async with session.post(server.url + TRANSLATIONS, data=form) as resp:
        events = parse_sse(await resp.read())
    assert events[0]["object"] == "translation.chunk"
    assert events[0]["id"].startswith("translate-")
    assert all("usage" not in e for e in events[:-1])


async def test_audio_form_errors(server, session):
    url = server.url + TRANSCRIPTIONS
    cases = [
        (aiohttp.FormData({"model": server.model_name}), 400),  # no file
        (audio_form(b"", model=server.model_name), 400),  # not audio
        (audio_form(b"ab" * 100, response_format="srt"), 400),
        (audio_form(b"ab" * 100, response_format="verbose_json"), 400),
        (audio_form(b"ab" * 100, stream_include_usage="true"), 400),  # without stream
        (audio_form(b"ab" * 100, model="nope"), 404),
        (audio_form(b"ab" * 100, max_completion_tokens="0"), 400),
        (audio_form(b"\0" * (AUDIO_BYTES_PER_TOKEN * 2100)), 400),  # past the context
    ]
    for form, status in cases:
        async with session.post(url, data=form) as resp:
            assert resp.status == status, await resp.text()
            err = (await resp.json())["error"]
            assert err["code"] == status and err["type"] and err["message"]
    # `file` sent as a plain field: vLLM's 422
    async with session.post(url, data=aiohttp.FormData({"file": "x"})) as resp:
        assert resp.status == 422
    async with session.post(url, json={"model": server.model_name}) as resp:  # not a form
        assert resp.status == 400


async def test_audio_disconnect_aborts_in_the_core(enginesim_server, session):
    server = await enginesim_server("tiny", speed=5.0)
    form = audio_form(b"\x07" * 6400, stream="true", ignore_eos="true")
    resp = await session.post(server.url + TRANSCRIPTIONS, data=form)
    assert resp.status == 200
    await resp.content.readuntil(b"\n\n")
    assert server.core.stats().blocks_in_use > 0
    resp.close()
    await wait_until(lambda: server.core.stats().blocks_in_use == 0)
    assert server.driver.num_in_flight == 0
    assert server.core.stats().num_aborted == 1


# -- the official SDK ------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK marks translations so
async def test_openai_sdk_transcriptions_and_translations(server):
    openai = pytest.importorskip("openai")
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    audio = b"\x10\x20" * 16_000
    try:
        tr = await client.audio.transcriptions.create(
            model=server.model_name,
            file=("a.wav", audio),
            language="en",
            extra_body={"max_completion_tokens": 4, "ignore_eos": True},
        )
        assert tr.text
        assert tr.usage is not None and tr.usage.type == "duration" and tr.usage.seconds == 1
        tl = await client.audio.translations.create(
            model=server.model_name, file=("a.wav", audio), extra_body={"max_completion_tokens": 4}
        )
        assert isinstance(tl.text, str)
        with pytest.raises(openai.BadRequestError):
            await client.audio.transcriptions.create(
                model=server.model_name, file=("a.wav", audio), response_format="srt"
            )
        with pytest.raises(openai.NotFoundError):
            await client.audio.transcriptions.create(model="nope", file=("a.wav", audio))
    finally:
        await client.close()
