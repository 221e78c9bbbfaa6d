"""End to end with the official `openai` client: client -> kvgate -> enginesim replicas."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.conftest import MODEL


def client(gw, **kwargs) -> openai.AsyncOpenAI:
    kwargs.setdefault("max_retries", 0)
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", timeout=20.0, **kwargs)


MSG = [{"role": "user", "content": "Say something about queues."}]


async def test_chat_non_stream_usage(replica, gateway):
    gw = await gateway(await replica())
    async with client(gw) as c:
        r = await c.chat.completions.create(
            model=MODEL, messages=MSG, max_tokens=12, extra_body={"ignore_eos": True}
        )
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens > 0
    assert r.choices[0].message.content


async def test_chat_stream_without_usage_hides_usage_chunk(replica, gateway):
    gw = await gateway(await replica())
    async with client(gw) as c:
        stream = await c.chat.completions.create(
            model=MODEL, messages=MSG, max_tokens=10, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = [ch async for ch in stream]
    # kvgate asked the engine for usage; the client did not, so it must not see it.
    assert all(ch.usage is None for ch in chunks)
    assert all(ch.choices for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert text
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_chat_stream_with_usage(replica, gateway):
    gw = await gateway(await replica())
    async with client(gw) as c:
        stream = await c.chat.completions.create(
            model=MODEL,
            messages=MSG,
            max_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [ch async for ch in stream]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 7


async def test_completions_stream_and_non_stream(replica, gateway):
    gw = await gateway(await replica())
    async with client(gw) as c:
        r = await c.completions.create(
            model=MODEL, prompt="def add(a, b):", max_tokens=6, extra_body={"ignore_eos": True}
        )
        assert r.usage is not None and r.usage.completion_tokens == 6
        assert r.choices[0].text
        stream = await c.completions.create(
            model=MODEL,
            prompt=[1, 2, 3, 4, 5],  # token ids: counted exactly, no estimate
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [ch async for ch in stream]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens == 5


async def test_models_lists_union_of_ready_replicas(replica, gateway):
    gw = await gateway(await replica(), await replica())
    async with client(gw) as c:
        models = await c.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_unknown_model_is_404_model_not_found(replica, gateway):
    gw = await gateway(await replica())
    async with client(gw) as c:
        with pytest.raises(openai.NotFoundError) as ei:
            await c.chat.completions.create(model="no-such-model", messages=MSG)
    assert ei.value.code == "model_not_found"


@pytest.mark.slow
async def test_shed_503_is_retried_by_the_sdk_and_succeeds(replica, gateway):
    # One replica at real speed with a pinned pool that a single long request fills.
    srv = await replica(speed=1.0)
    gw = await gateway(srv, pool_tokens=512, admission={"max_retry_after_s": 1.0})
    async with (
        client(gw) as big,
        client(gw, max_retries=3, default_headers={"x-kvgate-queue-timeout": "0"}) as small,
    ):
        stream = await big.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=440,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        first = await anext(aiter(stream))  # admitted and holding most of the pool
        assert first.choices

        async def drain() -> int:
            return sum(1 for _ in [ch async for ch in stream])

        rest = asyncio.create_task(drain())
        # Raw: the shed itself, with an integer Retry-After.
        async with aiohttp.ClientSession() as s:
            async with s.post(
                gw.url + "/v1/chat/completions",
                json={"model": MODEL, "messages": MSG, "max_tokens": 50},
                headers={"x-kvgate-queue-timeout": "0"},
            ) as r:
                assert r.status == 503
                assert r.headers["Retry-After"].isdigit() and int(r.headers["Retry-After"]) >= 1
                body = await r.json()
                assert body["error"]["code"] == "overloaded"
                assert set(body["error"]) == {"message", "type", "param", "code"}
        # The SDK honours Retry-After and succeeds once the big request has finished.
        r2 = await small.chat.completions.create(model=MODEL, messages=MSG, max_tokens=50)
        assert r2.usage is not None and r2.usage.completion_tokens > 0
        assert await rest > 0
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as m:
        text = await m.text()
    sheds = {
        s.labels["reason"]: s.value
        for fam in text_string_to_metric_families(text)
        if fam.name == "kvgate_shed"
        for s in fam.samples
        if s.name == "kvgate_shed_total"
    }
    # The raw request and the SDK's first attempt were shed; its retry was admitted.
    assert sheds.get("deadline", 0) >= 2


async def test_sglang_flavored_replica_is_discovered_and_served(replica, gateway):
    srv = await replica(flavor="sglang")
    gw = await gateway(srv, engine="sglang")
    (usage,) = gw.report.replica_usage()
    assert usage.ready and usage.capacity_tokens == 4096  # discovered, not pinned
    async with client(gw) as c:
        stream = await c.chat.completions.create(
            model=MODEL, messages=MSG, max_tokens=5, stream=True
        )
        chunks = [ch async for ch in stream]
    assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")
