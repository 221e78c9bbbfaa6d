"""The coding agents' APIs through kvgate: the Responses API and Anthropic's Messages API
are admitted like chat, and each answers in its own dialect (errors, overload, keys).

Over real loopback HTTP with enginesim as the replica and the official SDKs as clients.
"""

from __future__ import annotations

import asyncio

import aiohttp
import anthropic
import openai
import pytest

from admission.tenants import hash_key
from tests.gateway.conftest import MODEL
from tests.gateway.test_queue import hold_pool

KEY = "sk-agent-test-key"
TENANTS = [{"name": "agents", "keys_sha256": [hash_key(KEY)]}]


def assert_anthropic_error(body: dict, etype: str) -> str:
    assert body["type"] == "error"
    assert set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == etype
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]["message"]


BAD_MESSAGES = [
    # (name, raw body, what the message names)
    ("malformed json", b'{"model": "tiny-llm", "messages": [', None),
    ("missing max_tokens", b'{"model": "tiny-llm", "messages": [{"role": "user", "content": "x"}]}', "max_tokens"),
    ("empty messages", b'{"model": "tiny-llm", "max_tokens": 5, "messages": []}', "messages"),
    ("role wrong type", b'{"model": "tiny-llm", "max_tokens": 5, "messages": [{"role": 1, "content": "x"}]}', "messages.0.role"),
    ("content wrong type", b'{"model": "tiny-llm", "max_tokens": 5, "messages": [{"role": "user", "content": 7}]}', "messages.0.content"),
    ("max_tokens wrong type", b'{"model": "tiny-llm", "max_tokens": "5", "messages": [{"role": "user", "content": "x"}]}', "max_tokens"),
]  # fmt: skip


@pytest.mark.parametrize("name,raw,names", BAD_MESSAGES, ids=[c[0] for c in BAD_MESSAGES])
async def test_bad_messages_are_anthropic_400s(replica, gateway, name, raw, names):
    gw = await gateway(await replica())
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            gw.url + "/v1/messages", data=raw, headers={"content-type": "application/json"}
        ) as r,
    ):
        assert r.status == 400
        message = assert_anthropic_error(await r.json(), "invalid_request_error")
        assert r.headers["request-id"] == r.headers["x-request-id"]
    if names:
        assert names in message
    assert gw.report.reserved_tokens() == 0


BAD_RESPONSES = [
    ("missing input", b'{"model": "tiny-llm"}', "input"),
    ("input wrong type", b'{"model": "tiny-llm", "input": 3}', "input"),
    ("item without role", b'{"model": "tiny-llm", "input": [{"type": "message", "content": "x"}]}', "input"),
    ("max_output_tokens zero", b'{"model": "tiny-llm", "input": "x", "max_output_tokens": 0}', "max_output_tokens"),
]  # fmt: skip


@pytest.mark.parametrize("name,raw,param", BAD_RESPONSES, ids=[c[0] for c in BAD_RESPONSES])
async def test_bad_responses_requests_are_openai_400s(replica, gateway, name, raw, param):
    gw = await gateway(await replica())
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            gw.url + "/v1/responses", data=raw, headers={"content-type": "application/json"}
        ) as r,
    ):
        assert r.status == 400
        err = (await r.json())["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param


async def test_keys_arrive_as_x_api_key_or_bearer_and_401_is_anthropic_on_messages(
    replica, gateway
):
    gw = await gateway(await replica(), tenants=TENANTS)
    bad = anthropic.AsyncAnthropic(base_url=gw.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as ei:
        await bad.messages.create(
            model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}]
        )
    assert ei.value.body["error"]["type"] == "authentication_error"
    # An Anthropic client's x-api-key names the tenant on every endpoint.
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            gw.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
            headers={"x-api-key": KEY},
        ) as r,
    ):
        assert r.status == 200, await r.text()
    # The Responses API's 401 stays OpenAI's.
    oa = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as eo:
        await oa.responses.create(model=MODEL, input="hi")
    assert eo.value.code == "invalid_api_key"


async def test_unknown_model_is_not_found_in_each_dialect(replica, gateway):
    gw = await gateway(await replica())
    a = anthropic.AsyncAnthropic(base_url=gw.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as ea:
        await a.messages.create(
            model="no-such-model", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
        )
    assert ea.value.body["error"]["type"] == "not_found_error"
    o = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as eo:
        await o.responses.create(model="no-such-model", input="hi")
    assert eo.value.code == "model_not_found"


async def test_a_shed_message_is_529_overloaded_with_retry_after(replica, gateway):
    srv = await replica(speed=1.0)
    gw = await gateway(srv, pool_tokens=512, admission={"max_retry_after_s": 1.0})
    async with aiohttp.ClientSession() as s:
        big = await hold_pool(s, gw, 440)
        async with s.post(
            gw.url + "/v1/messages",
            json={
                "model": MODEL,
                "max_tokens": 50,
                "messages": [{"role": "user", "content": "hi"}],
            },
            headers={"x-kvgate-queue-timeout": "0", "anthropic-version": "2023-06-01"},
        ) as r:
            assert r.status == 529
            assert r.headers["Retry-After"].isdigit()
            assert int(r.headers["retry-after-ms"]) >= 1
            assert_anthropic_error(await r.json(), "overloaded_error")
        # The anthropic SDK raises its own overload type on it.
        a = anthropic.AsyncAnthropic(
            base_url=gw.url,
            api_key="x",
            max_retries=0,
            default_headers={"x-kvgate-queue-timeout": "0"},
        )
        with pytest.raises(anthropic.OverloadedError):
            await a.messages.create(
                model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "hi"}]
            )
        big.close()


async def test_paths_kvgate_does_not_serve_are_404_in_the_dialect_of_their_api(replica, gateway):
    gw = await gateway(await replica())
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/messages/batches", json={}) as r:
            assert r.status == 404
            assert_anthropic_error(await r.json(), "not_found_error")
        async with s.get(gw.url + "/v1/messages") as r:
            assert r.status == 405
            assert_anthropic_error(await r.json(), "invalid_request_error")
        async with s.get(gw.url + "/v1/responses/resp_unknown") as r:
            assert r.status == 404
            assert (await r.json())["error"]["code"] == "response_not_found"


# ------------------------------------------------------------ relayed, on enginesim
async def test_responses_through_kvgate_with_the_openai_sdk(replica, gateway):
    gw = await gateway(await replica())
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x") as c:
        r = await c.responses.create(model=MODEL, input="hello there", max_output_tokens=5)
        assert r.usage is not None and r.usage.output_tokens >= 1
        assert gw.state.pipeline.stored.holder(r.id, 0.0) is not None
        got = await c.responses.retrieve(r.id)
        assert got.id == r.id
        follow = await c.responses.create(
            model=MODEL, input="more", previous_response_id=r.id, max_output_tokens=3
        )
        assert follow.usage is not None
        assert follow.usage.input_tokens > r.usage.input_tokens
        async with c.responses.stream(model=MODEL, input="stream it", max_output_tokens=4) as s:
            deltas = [e async for e in s if e.type == "response.output_text.delta"]
            final = await s.get_final_response()
        assert len(deltas) == final.usage.output_tokens
    text = await scrape_text(gw)
    assert 'kvgate_endpoint_requests_total{endpoint="responses",outcome="ok"} 3.0' in text


async def test_a_response_whose_replica_is_gone_is_a_404_that_says_so(replica, gateway):
    gw = await gateway(await replica())
    gw.state.pipeline.stored.remember("resp_gone", "r9", 100, 0.0)
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as c:
        with pytest.raises(openai.NotFoundError) as ei:
            await c.responses.create(model=MODEL, input="x", previous_response_id="resp_gone")
        assert "r9" in ei.value.message and ei.value.code == "previous_response_not_found"
        with pytest.raises(openai.NotFoundError):
            await c.responses.retrieve("resp_gone")


async def test_messages_through_kvgate_with_the_anthropic_sdk(replica, gateway):
    gw = await gateway(await replica())
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="x") as c:
        msg = await c.messages.create(
            model=MODEL,
            max_tokens=6,
            system="brief",
            messages=[{"role": "user", "content": "hello"}],
            metadata={"user_id": "session-7"},
        )
        assert msg.usage.output_tokens >= 1
        async with c.messages.stream(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "go"}]
        ) as s:
            text = [t async for t in s.text_stream]
            final = await s.get_final_message()
        assert len(text) == final.usage.output_tokens
        counted = await c.messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": "count me"}]
        )
        assert counted.input_tokens > 0


async def test_embeddings_reserve_their_inputs_and_no_output(replica, gateway):
    srv = await replica()
    gw = await gateway(srv)
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x") as c:
        one = await c.embeddings.create(model=MODEL, input="a sentence to embed")
        many = await c.embeddings.create(model=MODEL, input=["first text", "second text"])
    assert len(one.data) == 1 and len(many.data) == 2
    assert many.usage.prompt_tokens > 0 and one.usage.prompt_tokens > 0
    text = await scrape_text(gw)
    assert 'kvgate_endpoint_requests_total{endpoint="embeddings",outcome="ok"} 2.0' in text


async def scrape_text(gw) -> str:
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
        return await r.text()


async def test_a_follow_up_through_another_process_reaches_the_replica_that_stored_it(
    replica, gateway
):
    """Two gateway processes share stored responses through the state backend: a
    follow-up sent to the second reaches the replica the first put the response on."""
    from gateway.state.memory import MemoryBackend

    r0, r1 = await replica(), await replica()
    shared = MemoryBackend()
    gws = [await gateway(r0, r1) for _ in range(2)]
    for gw in gws:
        gw.state.pipeline.stored.share(shared)
    async with (
        openai.AsyncOpenAI(base_url=gws[0].url + "/v1", api_key="x") as a,
        openai.AsyncOpenAI(base_url=gws[1].url + "/v1", api_key="x") as b,
    ):
        first = await a.responses.create(model=MODEL, input="remember me", max_output_tokens=3)
        held = gws[0].state.pipeline.stored.holder(first.id, 0.0)
        assert held is not None
        for _ in range(50):  # the write is behind the answer
            if await shared.response(first.id) is not None:
                break
            await asyncio.sleep(0.01)
        for _ in range(3):  # routing alone would spread these over both replicas
            follow = await b.responses.create(
                model=MODEL, input="and?", previous_response_id=first.id, max_output_tokens=2
            )
            assert follow.usage is not None
        got = await b.responses.retrieve(first.id)
        assert got.id == first.id
    engines = {"r0": r0, "r1": r1}
    other = engines["r1" if held.replica == "r0" else "r0"]
    assert other.core.stats().num_finished == 0, "a follow-up went to the wrong replica"


async def test_an_audio_request_that_is_not_a_form_with_a_file_is_a_400(replica, gateway):
    gw = await gateway(await replica())
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/audio/transcriptions", json={"model": MODEL}) as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "file"
        form = aiohttp.FormData(default_to_multipart=True)
        form.add_field("model", MODEL)
        async with s.post(gw.url + "/v1/audio/translations", data=form) as r:
            assert r.status == 400
            err = (await r.json())["error"]
            assert err["param"] == "file" and "Field required" in err["message"]
    assert gw.report.reserved_tokens() == 0


@pytest.mark.slow
async def test_a_responses_streams_first_token_is_its_first_output_event(replica, gateway):
    """response.created comes before the prompt is prefilled: kvgate's time to first token
    (its TTFT metric, routing's end-of-prefill signal) is the first output event's."""
    gw = await gateway(await replica(speed=0.03), upstream={"first_byte_s": 8.0})
    loop = asyncio.get_running_loop()
    created_at = first_delta_at = None
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as c:
        async with c.responses.stream(
            model=MODEL, input="a long prompt " * 300, max_output_tokens=3
        ) as s:
            async for e in s:
                if e.type == "response.created":
                    created_at = loop.time()
                elif e.type == "response.output_text.delta" and first_delta_at is None:
                    first_delta_at = loop.time()
            final = await s.get_final_response()
    assert created_at is not None and first_delta_at is not None
    assert first_delta_at - created_at > 0.3  # a prefill long enough to tell them apart
    assert final.usage is not None and final.usage.output_tokens >= 1
    text = await scrape_text(gw)
    (line,) = [x for x in text.splitlines() if x.startswith("kvgate_ttft_seconds_sum")]
    # kvgate's TTFT spans the prefill (it ends at or after the first delta was sent)
    assert float(line.rsplit(" ", 1)[1]) >= 0.9 * (first_delta_at - created_at)


async def test_rerank_score_and_audio_through_kvgate(replica, gateway):
    srv = await replica()
    gw = await gateway(srv)
    async with aiohttp.ClientSession() as s:
        for path, body in (
            ("/v1/rerank", {"model": MODEL, "query": "cache", "documents": ["kv cache", "dogs"]}),
            ("/rerank", {"model": MODEL, "query": "cache", "documents": ["a", "b", "c"]}),
            ("/v1/score", {"model": MODEL, "text_1": "cache", "text_2": ["kv cache", "dogs"]}),
            ("/classify", {"model": MODEL, "input": ["one text", "another"]}),
            ("/pooling", {"model": MODEL, "input": "pool me"}),
        ):
            async with s.post(gw.url + path, json=body) as r:
                assert r.status == 200, (path, await r.text())
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x") as c:
        t = await c.audio.transcriptions.create(model=MODEL, file=("a.wav", b"\x00" * 32000))
        assert isinstance(t.text, str)
        tr = await c.audio.translations.create(model=MODEL, file=("a.wav", b"\x00" * 6400))
        assert isinstance(tr.text, str)
    text = await scrape_text(gw)
    for endpoint, n in (("rerank", 2), ("score", 1), ("classify", 1), ("pooling", 1)):
        assert f'kvgate_endpoint_requests_total{{endpoint="{endpoint}",outcome="ok"}} {n}.0' in text
    assert 'kvgate_endpoint_requests_total{endpoint="transcription",outcome="ok"} 1.0' in text
    assert 'kvgate_endpoint_requests_total{endpoint="translation",outcome="ok"} 1.0' in text
    # /detokenize is forwarded to a replica serving the model.
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/detokenize", json={"model": MODEL, "tokens": [1, 2]}) as r:
            assert r.status == 200 and "prompt" in await r.json()
        async with s.post(gw.url + "/tokenize", json={"model": "nope", "prompt": "x"}) as r:
            assert r.status == 404


@pytest.mark.slow
async def test_the_anthropic_sdk_retries_a_529_after_retry_after_and_succeeds(replica, gateway):
    """A shed message is 529 with retry-after; the anthropic SDK's own retries (as
    Claude Code's) wait it out and succeed once the pool has room."""
    srv = await replica(speed=1.0)
    gw = await gateway(srv, pool_tokens=512, admission={"max_retry_after_s": 1.0})
    async with aiohttp.ClientSession() as s:
        big = await hold_pool(s, gw, 440)
        client = anthropic.AsyncAnthropic(
            base_url=gw.url,
            api_key="x",
            max_retries=4,
            default_headers={"x-kvgate-queue-timeout": "0"},
        )
        call = asyncio.create_task(
            client.messages.create(
                model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "hi"}]
            )
        )
        await asyncio.sleep(0.5)  # shed at least once while the big stream holds the pool
        big.close()
        msg = await call
    assert msg.usage.output_tokens >= 1
    text = await scrape_text(gw)
    assert 'kvgate_endpoint_requests_total{endpoint="messages",outcome="ok"} 1.0' in text
    shed = [
        x
        for x in text.splitlines()
        if x.startswith('kvgate_endpoint_requests_total{endpoint="messages",outcome="shed_')
    ]
    assert shed, "the first attempt was not shed"


async def test_a_background_response_keeps_its_reservation_while_the_engine_generates(
    replica, gateway
):
    srv = await replica(speed=1.0)
    gw = await gateway(srv)
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x") as c:
        r = await c.responses.create(
            model=MODEL,
            input="write at length",
            max_output_tokens=200,
            background=True,
            extra_body={"ignore_eos": True},
        )
        assert r.status in ("queued", "in_progress")
        # The answer came back at once; the engine generates on, and its KV stays reserved.
        assert gw.report.reserved_tokens() > 0
        assert srv.core.stats().num_running + srv.core.stats().num_waiting >= 1
        got = await c.responses.retrieve(r.id)  # polled at the replica that holds it
        assert got.id == r.id
        await c.responses.cancel(r.id)
