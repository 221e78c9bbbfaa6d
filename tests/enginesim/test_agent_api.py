"""The agent APIs of the simulated vLLM (Responses, Anthropic Messages, embeddings) over
real loopback HTTP, and through the official `openai` and `anthropic` SDKs."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import aiohttp
import pytest

from tests.enginesim.helpers import (
    CHAT,
    cancel_frees_the_core,
    chat_body,
    holds_kv_while_running,
    scrape,
    wait_until,
)

RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
EMBEDDINGS = "/v1/embeddings"


@pytest.fixture
async def server(enginesim_server):
    return await enginesim_server("tiny", speed=50.0)


def parse_named_sse(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of an `event: X\\ndata: {...}\\n\\n` stream; no `[DONE]`."""
    assert b"[DONE]" not in raw
    parts = raw.split(b"\n\n")
    assert parts[-1] == b""
    out = []
    for part in parts[:-1]:
        head, data = part.split(b"\n")
        assert head.startswith(b"event: ") and data.startswith(b"data: "), part
        name, payload = head[len(b"event: ") :].decode(), json.loads(data[len(b"data: ") :])
        assert payload["type"] == name
        out.append((name, payload))
    return out


async def post_json(session, url: str, body: dict, status: int = 200) -> dict:
    async with session.post(url, json=body) as resp:
        assert resp.status == status, await resp.text()
        assert resp.content_type == "application/json"
        return await resp.json()


async def post_sse(session, url: str, body: dict) -> list[tuple[str, dict[str, Any]]]:
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.content_type == "text/event-stream"
        return parse_named_sse(await resp.read())


# -- Responses API ---------------------------------------------------------------------------


async def test_response_non_stream(server, session):
    body = {"input": "hello there", "max_output_tokens": 6, "ignore_eos": True, "store": False}
    data = await post_json(session, server.url + RESPONSES, body)
    assert data["id"].startswith("resp_") and data["object"] == "response"
    assert data["model"] == server.model_name and isinstance(data["created_at"], int)
    assert data["status"] == "incomplete"  # cut by max_output_tokens
    assert data["incomplete_details"] == {"reason": "max_output_tokens"}
    assert data["max_output_tokens"] == 6 and data["tool_choice"] == "none"
    (item,) = data["output"]
    assert item["type"] == "message" and item["id"].startswith("msg_")
    assert item["role"] == "assistant" and item["status"] == "completed"
    (part,) = item["content"]
    assert part["type"] == "output_text" and part["text"] and part["annotations"] == []
    usage = data["usage"]
    assert usage["output_tokens"] == 6 and usage["input_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + 6
    assert usage["input_tokens_details"]["cached_tokens"] == 0
    assert usage["output_tokens_details"]["reasoning_tokens"] == 0

    natural = await post_json(session, server.url + RESPONSES, {"input": "hi", "store": False})
    assert natural["status"] == "completed" and natural["incomplete_details"] is None


async def test_response_stream_event_sequence(server, session):
    body = {"input": "stream me", "max_output_tokens": 5, "ignore_eos": True, "stream": True}
    events = await post_sse(session, server.url + RESPONSES, body)
    names = [n for n, _ in events]
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 5,  # one per generated token
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    created = events[0][1]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    assert created["usage"] is None
    item_id = events[2][1]["item"]["id"]
    deltas = [d for n, d in events if n == "response.output_text.delta"]
    assert all(d["item_id"] == item_id and d["output_index"] == 0 for d in deltas)
    text = "".join(d["delta"] for d in deltas)
    assert events[-4][1]["text"] == text
    final = events[-1][1]["response"]
    assert final["id"] == created["id"] and final["status"] == "incomplete"
    assert final["output"][0]["id"] == item_id
    assert final["output"][0]["content"][0]["text"] == text
    assert final["usage"]["output_tokens"] == 5


async def test_stored_responses_and_previous_response_id(server, session):
    url = server.url + RESPONSES
    first = await post_json(
        session,
        url,
        {"input": "remember: the code is 42. " * 8, "max_output_tokens": 20, "ignore_eos": True},
    )
    got = await post_json_get(session, f"{url}/{first['id']}")
    assert got == first

    follow = {"input": "what was the code?", "previous_response_id": first["id"]}
    second = await post_json(
        session, url, {**follow, "max_output_tokens": 4, "ignore_eos": True, "stream": False}
    )
    assert second["previous_response_id"] == first["id"]
    u1, u2 = first["usage"], second["usage"]
    # The stored conversation (input + output) is in the prompt, and its KV is reused.
    assert u2["input_tokens"] > u1["input_tokens"] + u1["output_tokens"]
    assert u2["input_tokens_details"]["cached_tokens"] >= u1["input_tokens"] // 2
    bs = server.profile.block_size
    details = u1["input_tokens_details"]
    assert details["cache_write_tokens"] == u1["input_tokens"] // bs * bs

    # Streamed responses are stored too, and chain the same way.
    events = await post_sse(
        session, url, {**follow, "previous_response_id": second["id"], "stream": True}
    )
    third = events[-1][1]["response"]
    assert (await post_json_get(session, f"{url}/{third['id']}"))["usage"] == third["usage"]
    assert third["usage"]["input_tokens"] > u2["input_tokens"]

    # An unknown previous response, retrieval and cancel: vLLM's error objects.
    missing = await post_json(
        session, url, {"input": "x", "previous_response_id": "resp_nope"}, status=404
    )
    assert missing == {
        "error": {
            "message": "Response with id 'resp_nope' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 404,
        }
    }
    assert (await post_json_get(session, f"{url}/resp_nope", 404))["error"]["code"] == 404
    cancel = await post_json(session, f"{url}/{first['id']}/cancel", {}, status=400)
    assert cancel["error"]["message"] == "Cannot cancel a synchronous response."
    await post_json(session, f"{url}/resp_nope/cancel", {}, status=404)
    async with session.delete(f"{url}/{first['id']}") as resp:
        assert resp.status == 405  # vLLM has no DELETE route

    unstored = await post_json(session, url, {"input": "x", "max_output_tokens": 2, "store": False})
    await post_json_get(session, f"{url}/{unstored['id']}", 404)


async def post_json_get(session, url: str, status: int = 200) -> dict:
    async with session.get(url) as resp:
        assert resp.status == status, await resp.text()
        return await resp.json()


async def test_response_input_items_and_tools(server, session, monkeypatch):
    seen: list[tuple[str, int]] = []
    add = server.core.add_request

    def spy(req, now):
        seen.append((str(req.workload), len(req.prompt_token_ids)))
        add(req, now)

    monkeypatch.setattr(server.core, "add_request", spy)
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "list the files"}]},
        {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": '{"path": "."}'},
        {"type": "function_call_output", "call_id": "c1", "output": "a.py b.py"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "two files"}]},
        {"type": "message", "role": "user", "content": "thanks"},
    ]
    tools = [{"type": "function", "name": "ls", "parameters": {"type": "object"}}]
    body = {"input": items, "tools": tools, "instructions": "be brief", "max_output_tokens": 3}
    data = await post_json(session, server.url + RESPONSES, body)
    assert data["tool_choice"] == "auto"
    (echoed,) = data["tools"]  # as vLLM echoes a function tool: every field, unset null
    assert echoed["name"] == "ls" and echoed["strict"] is None and echoed["description"] is None
    assert data["instructions"] == "be brief"
    plain = await post_json(session, server.url + RESPONSES, {"input": "thanks"})
    assert data["usage"]["input_tokens"] > plain["usage"]["input_tokens"] + 20
    assert seen[0][0] == "agentic"

    bad = {"input": [{"type": "no_such_item"}]}
    err = await post_json(session, server.url + RESPONSES, bad, status=400)
    assert err["error"]["param"] == "input"
    await post_json(session, server.url + RESPONSES, {"model": "nope", "input": "x"}, status=404)
    limit = server.profile.max_model_len
    too_long = {"input": "x", "max_output_tokens": limit}
    err = await post_json(session, server.url + RESPONSES, too_long, status=400)
    assert err["error"]["param"] == "max_output_tokens"


# -- Anthropic Messages API ------------------------------------------------------------------


def _msg_body(server, **extra: Any) -> dict[str, Any]:
    return {
        "model": server.model_name,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 5,
        **extra,
    }


async def test_message_non_stream(server, session):
    data = await post_json(
        session,
        server.url + MESSAGES,
        _msg_body(server, ignore_eos=True, system=[{"type": "text", "text": "be kind"}]),
    )
    assert data["type"] == "message" and data["role"] == "assistant"
    assert data["id"].startswith("chatcmpl-")  # vLLM answers with the chat completion's id
    assert data["model"] == server.model_name
    (block,) = data["content"]
    assert block["type"] == "text" and block["text"]
    assert data["stop_reason"] == "max_tokens"
    assert data["usage"]["output_tokens"] == 5 and data["usage"]["input_tokens"] > 0

    roomy = server.profile.max_model_len - 100  # above any natural length
    natural = await post_json(session, server.url + MESSAGES, _msg_body(server, max_tokens=roomy))
    assert natural["stop_reason"] == "end_turn"


async def test_message_stream_event_sequence(server, session):
    events = await post_sse(
        session, server.url + MESSAGES, _msg_body(server, ignore_eos=True, stream=True)
    )
    names = [n for n, _ in events]
    assert names == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * 5,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["id"].startswith("chatcmpl-") and start["content"] == []
    assert start["usage"]["output_tokens"] == 0 and start["usage"]["input_tokens"] > 0
    assert events[1][1] == {
        "type": "content_block_start",
        "content_block": {"type": "text", "text": ""},
        "index": 0,
    }
    assert all(d["delta"]["type"] == "text_delta" for n, d in events if n == "content_block_delta")
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 5
    assert delta["usage"]["input_tokens"] == start["usage"]["input_tokens"]


async def test_message_tool_blocks_count_tokens_and_errors(server, session):
    url = server.url + MESSAGES
    body = {
        "model": server.model_name,
        "max_tokens": 3,
        "system": "You are a coding agent.",
        "tools": [{"name": "ls", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": "list files"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "ls", "input": {}}],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "a.py"},
                    {"type": "text", "text": "and now?"},
                ],
            },
        ],
    }
    count = await post_json(session, url + "/count_tokens", {**body, "max_tokens": None})
    assert count == {
        "input_tokens": count["input_tokens"],
        "context_management": {"original_input_tokens": count["input_tokens"]},
    }
    u1 = (await post_json(session, url, body))["usage"]
    # Anthropic's input_tokens leave out the prompt tokens written to and read from the
    # prefix cache (vLLM's created_cache_tokens: the prompt's full blocks it computed).
    bs = server.profile.block_size
    n = count["input_tokens"]
    assert n > 30 and u1["cache_read_input_tokens"] == 0
    assert u1["cache_creation_input_tokens"] == n // bs * bs
    assert u1["input_tokens"] == n - n // bs * bs
    u2 = (await post_json(session, url, body))["usage"]
    assert u2["cache_read_input_tokens"] == n // bs * bs and u2["cache_creation_input_tokens"] == 0
    assert u2["input_tokens"] == u1["input_tokens"]

    # Errors after validation are Anthropic-shaped, with vLLM's type names.
    nope = await post_json(session, url, {**body, "model": "nope"}, status=404)
    assert nope == {
        "type": "error",
        "error": {"type": "NotFoundError", "message": "The model `nope` does not exist."},
    }
    long = await post_json(session, url, {**body, "max_tokens": 10**6}, status=400)
    assert long["type"] == "error" and long["error"]["type"] == "BadRequestError"
    # A body that fails validation gets the OpenAI error object (FastAPI's handler).
    missing = await post_json(
        session, url, {k: v for k, v in body.items() if k != "max_tokens"}, 400
    )
    assert missing["error"]["param"] == "max_tokens"
    await post_json(session, url, {**body, "max_tokens": 0}, status=400)


# -- embeddings ------------------------------------------------------------------------------


async def test_embeddings_shapes(server, session):
    url = server.url + EMBEDDINGS
    data = await post_json(session, url, {"input": ["hello world", "another text"]})
    assert data["object"] == "list" and data["model"] == server.model_name
    assert [d["index"] for d in data["data"]] == [0, 1]
    vecs = [d["embedding"] for d in data["data"]]
    assert all(d["object"] == "embedding" for d in data["data"])
    assert all(len(v) == 8 and math.isclose(sum(x * x for x in v), 1.0) for v in vecs)
    assert vecs[0] != vecs[1]
    again = await post_json(session, url, {"input": "hello world"})
    assert again["data"][0]["embedding"] == vecs[0]  # deterministic from the text
    usage = data["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] > 0
    ids = await post_json(session, url, {"input": [[1, 2, 3], [4, 5]]})
    assert ids["usage"]["prompt_tokens"] == 5
    one = await post_json(session, url, {"input": [7, 8, 9]})
    assert len(one["data"]) == 1 and one["usage"]["prompt_tokens"] == 3
    await post_json(session, url, {"input": ""}, status=400)
    await post_json(session, url, {"input": "x", "dimensions": 4}, status=400)
    await post_json(session, url, {"model": "nope", "input": "x"}, status=404)


async def test_embeddings_are_prefill_only_requests_on_the_core(enginesim_server, session):
    server = await enginesim_server("tiny", speed=0.02)  # slow enough to watch the prefill
    before = await scrape(session, server.url)
    prompt = "words " * 600
    data = await holds_kv_while_running(
        server, post_json(session, server.url + EMBEDDINGS, {"input": prompt})
    )
    stats = server.core.stats()
    assert stats.generation_tokens == 0 and stats.num_finished == 1
    m = await scrape(session, server.url)
    n = data["usage"]["prompt_tokens"]
    assert m["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == n
    assert m["vllm:generation_tokens_total"] == 0
    assert m["vllm:request_success_total"] - before["vllm:request_success_total"] == 1


# -- the engine core: metrics and disconnects -------------------------------------------------


async def test_agent_requests_count_like_chat_completions(server, session):
    m0 = await scrape(session, server.url)
    await post_json(session, server.url + CHAT, chat_body(max_tokens=4, ignore_eos=True))
    await post_json(
        session, server.url + RESPONSES, {"input": "a", "max_output_tokens": 4, "ignore_eos": True}
    )
    await post_sse(
        session,
        server.url + RESPONSES,
        {"input": "b", "max_output_tokens": 4, "ignore_eos": True, "stream": True},
    )
    await post_json(
        session, server.url + MESSAGES, _msg_body(server, max_tokens=4, ignore_eos=True)
    )
    await post_sse(
        session,
        server.url + MESSAGES,
        _msg_body(server, max_tokens=4, ignore_eos=True, stream=True),
    )
    m = await scrape(session, server.url)
    assert m["vllm:generation_tokens_total"] - m0["vllm:generation_tokens_total"] == 20
    assert m["vllm:request_success_total"] - m0["vllm:request_success_total"] == 5
    assert m["vllm:time_to_first_token_seconds_count"] == 5
    assert server.core.stats().generation_tokens == 20


@pytest.mark.parametrize("path", [RESPONSES, MESSAGES])
async def test_stream_disconnect_aborts_in_the_core(enginesim_server, session, path):
    server = await enginesim_server("tiny", speed=5.0)
    limit = server.profile.max_model_len
    body = (
        {"input": "x " * 40, "max_output_tokens": limit - 200}
        if path == RESPONSES
        else _msg_body(server, max_tokens=limit - 200)
    )
    body.update(ignore_eos=True, stream=True)
    resp = await session.post(server.url + path, json=body)
    assert resp.status == 200
    marker = b"output_text.delta" if path == RESPONSES else b"content_block_delta"
    while marker not in await resp.content.readuntil(b"\n\n"):
        pass
    assert server.core.stats().blocks_in_use > 0
    resp.close()
    await wait_until(lambda: server.core.stats().blocks_in_use == 0)
    assert server.driver.num_in_flight == 0
    assert server.core.stats().num_aborted == 1


async def test_non_stream_disconnect_aborts_in_the_core(enginesim_server, session):
    server = await enginesim_server("tiny", speed=5.0)
    body = {"input": "y " * 40, "max_output_tokens": 2000, "ignore_eos": True}
    task = asyncio.create_task(session.post(server.url + RESPONSES, json=body))
    await wait_until(lambda: server.core.stats().blocks_in_use > 0)
    await cancel_frees_the_core(server, task)


# -- the official SDKs -----------------------------------------------------------------------


async def test_openai_sdk_responses_and_embeddings(server):
    openai = pytest.importorskip("openai")
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    try:
        resp = await client.responses.create(
            model=server.model_name,
            input="hello",
            instructions="be brief",
            max_output_tokens=5,
            extra_body={"ignore_eos": True},
        )
        assert resp.id.startswith("resp_") and resp.status == "incomplete"
        assert resp.output_text and resp.usage is not None and resp.usage.output_tokens == 5
        assert resp.incomplete_details is not None
        follow = await client.responses.create(
            model=server.model_name, input="and?", previous_response_id=resp.id
        )
        assert follow.usage is not None and follow.usage.input_tokens > resp.usage.total_tokens
        assert (await client.responses.retrieve(resp.id)).output_text == resp.output_text

        deltas = []
        async with client.responses.stream(
            model=server.model_name, input="stream", max_output_tokens=4
        ) as stream:
            async for event in stream:
                if event.type == "response.output_text.delta":
                    deltas.append(event.delta)
            final = await stream.get_final_response()
        assert final.output_text == "".join(deltas)
        assert final.usage is not None and final.usage.output_tokens == len(deltas)

        with pytest.raises(openai.NotFoundError):
            await client.responses.create(
                model=server.model_name, input="x", previous_response_id="resp_nope"
            )

        emb = await client.embeddings.create(model=server.model_name, input=["a b", "c"])
        assert [len(d.embedding) for d in emb.data] == [8, 8]  # base64, decoded by the SDK
        floats = await client.embeddings.create(
            model=server.model_name, input="a b", encoding_format="float"
        )
        assert floats.data[0].embedding == pytest.approx(emb.data[0].embedding, rel=1e-6)
        assert emb.usage.prompt_tokens > 0
    finally:
        await client.close()


async def test_anthropic_sdk_messages(server):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.AsyncAnthropic(base_url=server.url, api_key="unused", max_retries=0)
    try:
        msg = await client.messages.create(
            model=server.model_name,
            max_tokens=5,
            system="be brief",
            messages=[{"role": "user", "content": "hello"}],
            extra_body={"ignore_eos": True},
        )
        assert msg.role == "assistant" and msg.stop_reason == "max_tokens"
        assert msg.content[0].type == "text" and msg.content[0].text
        assert msg.usage.output_tokens == 5

        async with client.messages.stream(
            model=server.model_name,
            max_tokens=6,
            messages=[{"role": "user", "content": "stream"}],
            extra_body={"ignore_eos": True},
        ) as stream:
            texts = [t async for t in stream.text_stream]
            final = await stream.get_final_message()
        assert final.content[0].text == "".join(texts) and len(texts) == 6
        assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6

        count = await client.messages.count_tokens(
            model=server.model_name, messages=[{"role": "user", "content": "hello"}]
        )
        assert count.input_tokens > 0

        with pytest.raises(anthropic.NotFoundError) as err:
            await client.messages.create(
                model="nope", max_tokens=5, messages=[{"role": "user", "content": "x"}]
            )
        assert err.value.status_code == 404
    finally:
        await client.close()


async def test_background_response_and_cancel(enginesim_server, session):
    server = await enginesim_server("tiny", speed=1.0)
    url = server.url + RESPONSES
    body = {"input": "work", "background": True, "max_output_tokens": 5, "ignore_eos": True}
    queued = await post_json(session, url, body)
    assert queued["status"] == "queued" and queued["output"] == [] and queued["usage"] is None
    done: dict = {}

    async def poll() -> None:
        while True:
            got = await post_json_get(session, f"{url}/{queued['id']}")
            if got["status"] != "queued":
                done.update(got)
                return
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), 10)
    assert done["status"] == "incomplete" and done["usage"]["output_tokens"] == 5

    long = {**body, "max_output_tokens": server.profile.max_model_len - 100}
    running = await post_json(session, url, long)
    await wait_until(lambda: server.core.stats().blocks_in_use > 0)
    cancelled = await post_json(session, f"{url}/{running['id']}/cancel", {})
    assert cancelled["id"] == running["id"] and cancelled["status"] == "cancelled"
    assert server.core.stats().blocks_in_use == 0 and server.driver.num_in_flight == 0
    assert (await post_json_get(session, f"{url}/{running['id']}"))["status"] == "cancelled"
    await post_json(session, f"{url}/{running['id']}/cancel", {}, status=400)
    await post_json(session, url, {**body, "stream": True}, status=400)


async def test_drop_fault_cuts_agent_streams(enginesim_server, session):
    server = await enginesim_server("tiny", speed=20.0)
    async with session.post(
        server.url + "/admin/faults", json={"mode": "drop", "after_tokens": 3}
    ) as r:
        assert r.status == 200
    bodies = [
        (RESPONSES, {"input": "x", "max_output_tokens": 200, "ignore_eos": True, "stream": True}),
        (MESSAGES, _msg_body(server, max_tokens=200, ignore_eos=True, stream=True)),
    ]
    for path, body in bodies:
        received = b""
        with pytest.raises(aiohttp.ClientPayloadError):
            async with session.post(server.url + path, json=body) as resp:
                async for line in resp.content:
                    received += line
        marker = b"event: response.output_text.delta" if path == RESPONSES else b"text_delta"
        assert received.count(marker) == 3
        await wait_until(lambda: server.core.stats().blocks_in_use == 0)
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await session.post(
            server.url + MESSAGES, json=_msg_body(server, max_tokens=200, ignore_eos=True)
        )
    assert server.driver.num_in_flight == 0
