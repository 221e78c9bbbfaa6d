"""The simulated replica's OpenAI API over real loopback HTTP (tiny profile, fast clock)."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest

from tests.enginesim.helpers import (
    CHAT,
    COMPLETIONS,
    cancel_frees_the_core,
    chat_body,
    parse_sse,
    wait_until,
)


@pytest.fixture
async def server(enginesim_server):
    return await enginesim_server("tiny", speed=50.0)


def _assert_usage(usage: dict, completion_tokens: int) -> None:
    assert usage["completion_tokens"] == completion_tokens
    assert usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert 0 <= cached <= usage["prompt_tokens"]


# -- non-stream ----------------------------------------------------------------------------


async def test_chat_non_stream(server, session):
    body = chat_body(max_tokens=7, ignore_eos=True, temperature=0.7, top_p=0.9, seed=3)
    async with session.post(server.url + CHAT, json=body) as resp:
        assert resp.status == 200
        assert resp.content_type == "application/json"
        data = await resp.json()
    assert data["object"] == "chat.completion"
    assert data["id"].startswith("chatcmpl-")
    assert data["model"] == server.model_name
    assert isinstance(data["created"], int)
    (choice,) = data["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"]
    assert choice["finish_reason"] == "length"
    _assert_usage(data["usage"], 7)
    # Prompt tokens are the chat template's, as /tokenize counts them.
    async with session.post(server.url + "/tokenize", json={"messages": body["messages"]}) as r:
        assert data["usage"]["prompt_tokens"] == (await r.json())["count"]
    assert server.core.stats().blocks_in_use == 0


async def test_completion_non_stream(server, session):
    body = {
        "model": server.model_name,
        "prompt": "def add(a, b):",
        "max_tokens": 5,
        "ignore_eos": True,
    }
    async with session.post(server.url + COMPLETIONS, json=body) as resp:
        assert resp.status == 200
        data = await resp.json()
    assert data["object"] == "text_completion"
    assert data["id"].startswith("cmpl-")
    (choice,) = data["choices"]
    assert isinstance(choice["text"], str) and choice["text"]
    assert choice["finish_reason"] == "length"
    _assert_usage(data["usage"], 5)


async def test_natural_finish_is_stop(server, session):
    # Without ignore_eos the model stops at its own length, which is below this budget
    # (tiny's natural lengths are short next to max_model_len) or at it ("length").
    body = chat_body(max_tokens=server.profile.max_model_len // 2)
    async with session.post(server.url + CHAT, json=body) as resp:
        data = await resp.json()
    choice = data["choices"][0]
    assert choice["finish_reason"] in ("stop", "length")
    n = data["usage"]["completion_tokens"]
    assert 1 <= n <= body["max_tokens"]
    assert (choice["finish_reason"] == "length") == (n == body["max_tokens"])


async def test_token_id_prompt_and_default_max_tokens(server, session):
    limit = server.profile.max_model_len
    prompt = list(range(1000, 1000 + limit - 6))  # 6 tokens of room left
    body = {"prompt": prompt, "ignore_eos": True}  # no max_tokens: limit - prompt
    async with session.post(server.url + COMPLETIONS, json=body) as resp:
        assert resp.status == 200, await resp.text()
        data = await resp.json()
    assert data["usage"]["prompt_tokens"] == limit - 6
    assert data["usage"]["completion_tokens"] == 6
    assert data["choices"][0]["finish_reason"] == "length"


async def test_max_completion_tokens_and_extensions(server, session):
    body = chat_body(
        max_completion_tokens=4,
        min_tokens=4,
        priority=-1,
        ignore_eos=False,
        logit_bias={"12": 1},
        frequency_penalty=0.1,
        top_k=5,
        unknown_future_field={"x": 1},
    )
    async with session.post(server.url + CHAT, json=body, headers={"x-workload": "coding"}) as r:
        assert r.status == 200, await r.text()
        data = await r.json()
    # min_tokens == max tokens: exactly 4 tokens whatever the natural length.
    assert data["usage"]["completion_tokens"] == 4


# -- stream --------------------------------------------------------------------------------


async def test_chat_stream_sse_format(server, session):
    body = chat_body(max_tokens=9, ignore_eos=True, stream=True)
    async with session.post(server.url + CHAT, json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = await resp.read()
    events = parse_sse(raw)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert all(c["model"] == server.model_name for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text
    assert not any("usage" in c for c in chunks)  # not asked for


async def test_completion_stream_include_usage(server, session):
    body = {
        "prompt": "Once upon a time",
        "max_tokens": 11,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with session.post(server.url + COMPLETIONS, json=body) as resp:
        events = parse_sse(await resp.read())
    *chunks, usage_chunk, done = events
    assert done == "[DONE]"
    assert usage_chunk["choices"] == []
    assert usage_chunk["object"] == "text_completion"
    _assert_usage(usage_chunk["usage"], 11)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks)


async def test_chat_stream_include_usage_counts_streamed_text(server, session):
    body = chat_body(
        max_tokens=12, ignore_eos=True, stream=True, stream_options={"include_usage": True}
    )
    async with session.post(server.url + CHAT, json=body) as resp:
        events = parse_sse(await resp.read())
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 12
    assert server.core.stats().blocks_in_use == 0


async def test_concurrent_streams_share_the_engine(server, session):
    async def one(i: int) -> int:
        body = chat_body(f"request {i}", max_tokens=6, ignore_eos=True, stream=True,
                         stream_options={"include_usage": True})  # fmt: skip
        async with session.post(server.url + CHAT, json=body) as resp:
            events = parse_sse(await resp.read())
        return events[-2]["usage"]["completion_tokens"]

    results = await asyncio.gather(*(one(i) for i in range(8)))
    assert results == [6] * 8
    stats = server.core.stats()
    assert stats.blocks_in_use == 0 and stats.num_running == 0


# -- multi-turn prefix caching ---------------------------------------------------------------


async def _answer(session, url: str, path: str, body: dict) -> tuple[str, dict]:
    """The generated text and usage of one request, streamed or not."""
    if not body.get("stream"):
        async with session.post(url + path, json=body) as resp:
            data = await resp.json()
        choice = data["choices"][0]
        return choice["message"]["content"] if path == CHAT else choice["text"], data["usage"]
    body = {**body, "stream_options": {"include_usage": True}}
    async with session.post(url + path, json=body) as resp:
        *chunks, usage_chunk, _ = parse_sse(await resp.read())
    key = (lambda c: c["delta"].get("content", "")) if path == CHAT else (lambda c: c["text"])
    return "".join(key(c["choices"][0]) for c in chunks), usage_chunk["usage"]


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_second_turn_hits_the_first_answer(server, session, stream):
    """A session that resends its history hits the blocks its first answer filled."""
    bs = server.profile.block_size
    turn1 = [{"role": "user", "content": "Tell me how a prefix cache works."}]
    body = {"messages": turn1, "max_tokens": 60, "ignore_eos": True, "stream": stream}
    answer, usage1 = await _answer(session, server.url, CHAT, body)
    p1 = usage1["prompt_tokens"]
    hits = server.core.stats().prefix_cache_hits
    turn2 = [*turn1, {"role": "assistant", "content": answer},
             {"role": "user", "content": "And when it is full?"}]  # fmt: skip
    _, usage2 = await _answer(session, server.url, CHAT, {"messages": turn2, "max_tokens": 4})
    expected = (p1 + 60 - 1) // bs * bs  # every full block but the one the last token fills
    assert expected > p1  # the answer's blocks, not only the first prompt's
    assert usage2["prompt_tokens_details"]["cached_tokens"] == expected
    assert server.core.stats().prefix_cache_hits - hits == expected
    # /tokenize agrees: turn 2 starts with turn 1's prompt ids.
    async with session.post(server.url + "/tokenize", json={"messages": turn1}) as r:
        ids1 = (await r.json())["tokens"]
    async with session.post(server.url + "/tokenize", json={"messages": turn2}) as r:
        ids2 = (await r.json())["tokens"]
    assert ids2[: len(ids1)] == ids1 and len(ids2) == usage2["prompt_tokens"]


async def test_completion_continuation_hits_the_generated_blocks(server, session):
    bs = server.profile.block_size
    prompt = "def add(a, b):"
    body = {"prompt": prompt, "max_tokens": 50, "ignore_eos": True}
    text, usage1 = await _answer(session, server.url, COMPLETIONS, body)
    body2 = {"prompt": prompt + text + "\nprint(add(1, 2))", "max_tokens": 3}
    _, usage2 = await _answer(session, server.url, COMPLETIONS, body2)
    expected = (usage1["prompt_tokens"] + 50 - 1) // bs * bs
    assert usage2["prompt_tokens_details"]["cached_tokens"] == expected


# -- other endpoints -----------------------------------------------------------------------


async def test_models_health_version(server, session):
    async with session.get(server.url + "/v1/models") as r:
        data = await r.json()
    (card,) = data["data"]
    assert data["object"] == "list"
    assert card["id"] == server.model_name
    assert card["max_model_len"] == server.profile.max_model_len
    async with session.get(server.url + "/health") as r:
        assert r.status == 200
        assert await r.read() == b""
    async with session.get(server.url + "/version") as r:
        assert "version" in await r.json()


async def test_tokenize(server, session):
    async with session.post(
        server.url + "/tokenize", json={"model": server.model_name, "prompt": "hello world"}
    ) as r:
        data = await r.json()
    assert data["count"] == len(data["tokens"]) == 2
    assert data["max_model_len"] == server.profile.max_model_len
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    async with session.post(server.url + "/tokenize", json={"messages": msgs}) as r:
        chat = await r.json()
    assert chat["count"] > data["count"]


# -- bad input -----------------------------------------------------------------------------

_BAD_CHAT = [
    b"{",
    b"\xff\xfe",
    b"[]",
    b'"a string"',
    json.dumps({}).encode(),
    json.dumps({"messages": "hello"}).encode(),
    json.dumps({"messages": []}).encode(),
    json.dumps({"messages": [{"content": "no role"}]}).encode(),
    json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(),
    json.dumps(chat_body(max_tokens="many")).encode(),
    json.dumps(chat_body(max_tokens=0)).encode(),
    json.dumps(chat_body(max_tokens=-3)).encode(),
    json.dumps(chat_body(max_tokens=2.5)).encode(),
    json.dumps(chat_body(n=2)).encode(),
    json.dumps(chat_body(stream={"x": 1})).encode(),
    json.dumps(chat_body(stream_options={"include_usage": True})).encode(),  # without stream
    json.dumps(chat_body(min_tokens=-1)).encode(),
    json.dumps(chat_body(max_tokens=3, min_tokens=5)).encode(),
    json.dumps(chat_body(priority="high")).encode(),
    json.dumps(chat_body(model=["x"])).encode(),
]

_BAD_COMPLETION = [
    json.dumps({"max_tokens": 3}).encode(),
    json.dumps({"prompt": {"text": "x"}}).encode(),
    json.dumps({"prompt": ""}).encode(),
    json.dumps({"prompt": ["one", "two"]}).encode(),
    json.dumps({"prompt": [1, -5]}).encode(),
    json.dumps({"prompt": [1, 10**9]}).encode(),
    json.dumps({"prompt": None}).encode(),
]


@pytest.mark.parametrize("raw", _BAD_CHAT, ids=range(len(_BAD_CHAT)))
async def test_bad_chat_input_is_400(server, session, raw):
    async with session.post(
        server.url + CHAT, data=raw, headers={"Content-Type": "application/json"}
    ) as r:
        assert r.status == 400, await r.text()
        err = (await r.json())["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400
    assert isinstance(err["message"], str) and err["message"]
    assert set(err) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("raw", _BAD_COMPLETION, ids=range(len(_BAD_COMPLETION)))
async def test_bad_completion_input_is_400(server, session, raw):
    async with session.post(server.url + COMPLETIONS, data=raw) as r:
        assert r.status == 400, await r.text()
        assert (await r.json())["error"]["code"] == 400


async def test_bad_tokenize_input_is_400(server, session):
    for raw in (
        b"nope",
        b"{}",
        json.dumps({"prompt": 3}).encode(),
        json.dumps({"messages": []}).encode(),
    ):
        async with session.post(server.url + "/tokenize", data=raw) as r:
            assert r.status == 400, (raw, await r.text())
            assert (await r.json())["error"]["type"] == "BadRequestError"


async def test_unknown_model_is_404(server, session):
    async with session.post(server.url + CHAT, json=chat_body(model="gpt-17")) as r:
        assert r.status == 404
        err = (await r.json())["error"]
    assert err["type"] == "NotFoundError" and err["code"] == 404
    assert "gpt-17" in err["message"]


async def test_unknown_route_and_method_are_error_objects(server, session):
    async with session.get(server.url + "/v1/nothing") as r:
        assert r.status == 404
        assert (await r.json())["error"]["code"] == 404
    async with session.get(server.url + CHAT) as r:
        assert r.status == 405
        assert (await r.json())["error"]["code"] == 405


async def test_prompt_over_max_model_len_is_400(server, session):
    limit = server.profile.max_model_len
    async with session.post(server.url + COMPLETIONS, json={"prompt": [7] * limit}) as r:
        assert r.status == 400
        err = (await r.json())["error"]
    assert str(limit) in err["message"] and err["type"] == "BadRequestError"
    assert server.driver.num_in_flight == 0


async def test_prompt_plus_max_tokens_over_limit_is_400(server, session):
    limit = server.profile.max_model_len
    body = {"prompt": [7] * 10, "max_tokens": limit - 9}
    async with session.post(server.url + COMPLETIONS, json=body) as r:
        assert r.status == 400
        msg = (await r.json())["error"]["message"]
    assert str(limit) in msg and str(limit - 9) in msg and "10 input tokens" in msg
    # Exactly at the limit is fine.
    body["max_tokens"] = limit - 10
    body["ignore_eos"] = False
    async with session.post(server.url + COMPLETIONS, json=body) as r:
        assert r.status == 200


# -- disconnects ---------------------------------------------------------------------------


async def test_stream_disconnect_frees_blocks(enginesim_server, session):
    server = await enginesim_server("tiny", speed=5.0)
    limit = server.profile.max_model_len
    body = {"prompt": "x " * 40, "max_tokens": limit - 200, "ignore_eos": True, "stream": True}
    resp = await session.post(server.url + COMPLETIONS, json=body)
    assert resp.status == 200
    await resp.content.readuntil(b"\n\n")  # first token arrived: the request holds blocks
    assert server.core.stats().blocks_in_use > 0
    resp.close()  # drop the connection mid-stream
    await wait_until(lambda: server.core.stats().blocks_in_use == 0)
    stats = server.core.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert server.driver.num_in_flight == 0


async def test_non_stream_disconnect_frees_blocks(enginesim_server, session):
    server = await enginesim_server("tiny", speed=5.0)
    limit = server.profile.max_model_len
    body = {"prompt": "y " * 40, "max_tokens": limit - 200, "ignore_eos": True}
    task = asyncio.create_task(session.post(server.url + COMPLETIONS, json=body))
    await wait_until(lambda: server.core.stats().num_running == 1)
    await wait_until(lambda: server.core.stats().blocks_in_use > 0)
    await cancel_frees_the_core(server, task)


# -- the official client -------------------------------------------------------------------


async def test_openai_client_stream_and_non_stream(server):
    openai = pytest.importorskip("openai")
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    try:
        done = await client.chat.completions.create(
            model=server.model_name,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=5,
            extra_body={"ignore_eos": True},
        )
        assert done.choices[0].message.content
        assert done.usage is not None and done.usage.completion_tokens == 5

        stream = await client.completions.create(
            model=server.model_name,
            prompt="count:",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        texts, usage = [], None
        async for chunk in stream:
            if chunk.choices:
                texts.append(chunk.choices[0].text)
            if chunk.usage is not None:
                usage = chunk.usage
        assert "".join(texts)
        assert usage is not None and usage.completion_tokens == 6

        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(
                model=server.model_name,
                messages=[{"role": "user", "content": "x"}],
                max_tokens=server.profile.max_model_len * 2,
            )
    finally:
        await client.close()


# -- workload classification -----------------------------------------------------------------


async def test_workload_from_header_tools_and_text(server, session, monkeypatch):
    seen: list[str] = []
    add = server.core.add_request

    def spy(req, now):
        seen.append(str(req.workload))
        add(req, now)

    monkeypatch.setattr(server.core, "add_request", spy)
    tools = [{"type": "function", "function": {"name": "search", "parameters": {}}}]
    bodies = [
        ({"x-workload": "agentic"}, chat_body("plain words", max_tokens=2)),
        ({}, chat_body("plain words", max_tokens=2)),
        ({}, chat_body("```python\ndef f(x):\n    return x\n```", max_tokens=2)),
        ({}, chat_body("find the weather", max_tokens=2, tools=tools)),
    ]
    for headers, body in bodies:
        async with session.post(server.url + CHAT, json=body, headers=headers) as r:
            assert r.status == 200
    assert seen == ["agentic", "chat", "coding", "agentic"]
    # Tool definitions are part of the prompt, as a chat template renders them.
    plain = {"messages": bodies[3][1]["messages"]}
    async with session.post(server.url + "/tokenize", json=plain) as r:
        without = (await r.json())["count"]
    async with session.post(server.url + "/tokenize", json={**plain, "tools": tools}) as r:
        assert (await r.json())["count"] > without


async def test_stream_disconnects_are_quiet_aborts(enginesim_server, session, caplog):
    """A client gone mid-stream is an abort, not an error: no "Cannot write to closing
    transport" traceback in the log (at a fast clock the write races the disconnect)."""
    caplog.set_level(logging.DEBUG)
    server = await enginesim_server("tiny", speed=50.0)
    body = {"prompt": "z " * 20, "max_tokens": 500, "ignore_eos": True, "stream": True}
    before = server.core.stats().num_aborted
    for _ in range(5):
        resp = await session.post(server.url + COMPLETIONS, json=body)
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")
        resp.close()
        await wait_until(lambda: server.core.stats().blocks_in_use == 0)
    await wait_until(lambda: server.driver.num_in_flight == 0)
    assert server.core.stats().num_aborted - before == 5
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not loud, [r.getMessage() for r in loud]
    assert not [r for r in caplog.records if r.name == "aiohttp.server" or r.exc_info]


async def test_write_to_a_closed_client_ends_the_handler_quietly(enginesim_server, caplog):
    """The error middleware turns a write to a gone client into a quiet cancellation."""
    from aiohttp.test_utils import make_mocked_request

    caplog.set_level(logging.DEBUG)
    server = await enginesim_server("tiny")

    async def handler(request):
        raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")

    with pytest.raises(asyncio.CancelledError):
        await server._error_middleware(make_mocked_request("POST", COMPLETIONS), handler)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
