"""`/metrics` (vLLM and SGLang names) and `/server_info` against the core's own state."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.enginesim.helpers import (
    CHAT,
    COMPLETIONS,
    chat_body,
    parse_sse,
    scrape,
    wait_until,
)


async def _run_requests(session: aiohttp.ClientSession, url: str, n: int) -> tuple[int, int]:
    """n finished requests (half streamed); returns (completion, prompt) tokens served."""

    async def one(i: int) -> tuple[int, int]:
        if i % 2:
            body = chat_body(f"question {i}", max_tokens=5 + i, ignore_eos=True, stream=True,
                             stream_options={"include_usage": True})  # fmt: skip
            async with session.post(url + CHAT, json=body) as r:
                usage = parse_sse(await r.read())[-2]["usage"]
        else:
            body = {"prompt": f"prompt number {i} " * 3, "max_tokens": 5 + i, "ignore_eos": True}
            async with session.post(url + COMPLETIONS, json=body) as r:
                usage = (await r.json())["usage"]
        assert usage["completion_tokens"] == 5 + i
        return usage["completion_tokens"], usage["prompt_tokens"]

    done = await asyncio.gather(*(one(i) for i in range(n)))
    return sum(c for c, _ in done), sum(p for _, p in done)


async def test_vllm_metrics_match_core(enginesim_server, session):
    server = await enginesim_server("tiny", speed=50.0)
    before = await scrape(session, server.url)
    assert before["vllm:generation_tokens_total"] == 0
    assert before["vllm:e2e_request_latency_seconds_count"] == 0

    completion, prompt = await _run_requests(session, server.url, 6)
    m = await scrape(session, server.url)
    stats = server.core.stats()
    assert m["vllm:generation_tokens_total"] == completion == stats.generation_tokens
    assert m["vllm:prompt_tokens_total"] == prompt == stats.prompt_tokens
    assert m["vllm:num_requests_running"] == 0
    assert m["vllm:num_requests_waiting"] == 0
    assert 0.0 <= m["vllm:kv_cache_usage_perc"] <= 1.0
    assert m["vllm:num_preemptions_total"] == stats.num_preemptions
    assert m["vllm:prefix_cache_queries_total"] == stats.prefix_cache_queries > 0
    assert m["vllm:prefix_cache_hits_total"] == stats.prefix_cache_hits
    info_key = (
        f"vllm:cache_config_info{{block_size={stats.block_size},cache_dtype=auto,"
        f"enable_prefix_caching=True,engine=0,num_cpu_blocks=None,"
        f"num_gpu_blocks={stats.num_gpu_blocks},prefix_caching_hash_algo=sha256}}"
    )
    assert m[info_key] == 1.0
    labels = f"engine=0,model_name={server.model_name}"
    assert m[f"vllm:num_requests_running{{{labels}}}"] == 0
    # One TTFT and one e2e observation per request, ITL for every later step.
    assert m["vllm:time_to_first_token_seconds_count"] == 6
    assert m["vllm:e2e_request_latency_seconds_count"] == 6
    assert m["vllm:inter_token_latency_seconds_count"] >= completion - 6 - 1
    assert m["vllm:e2e_request_latency_seconds_sum"] > m["vllm:time_to_first_token_seconds_sum"]
    assert (
        m[
            f"vllm:request_success_total{{engine=0,finished_reason=length,model_name={server.model_name}}}"
        ]
        == 6
    )
    # Speculation is off in tiny: vLLM does not publish spec-decode series then.
    assert "vllm:spec_decode_num_drafts_total" not in m


async def test_vllm_gauges_while_busy(enginesim_server, session):
    server = await enginesim_server("tiny", speed=2.0)
    limit = server.profile.max_model_len
    body = {"prompt": "z " * 30, "max_tokens": limit - 100, "ignore_eos": True, "stream": True}
    resp = await session.post(server.url + COMPLETIONS, json=body)
    await resp.content.readuntil(b"\n\n")
    m = await scrape(session, server.url)
    assert m["vllm:num_requests_running"] == 1
    stats = server.core.stats()
    assert m["vllm:kv_cache_usage_perc"] > 0
    assert abs(m["vllm:kv_cache_usage_perc"] - stats.kv_usage) < 0.05
    resp.close()
    await wait_until(lambda: server.core.stats().num_running == 0)
    m = await scrape(session, server.url)
    assert m["vllm:num_requests_running"] == 0
    assert m["vllm:kv_cache_usage_perc"] == 0
    assert (
        m[
            f"vllm:request_success_total{{engine=0,finished_reason=abort,model_name={server.model_name}}}"
        ]
        == 1
    )


async def test_speculative_metrics(enginesim_server, session):
    server = await enginesim_server("tiny", speed=50.0, speculative=True)
    body = {"prompt": "def f(x):\n    return x", "max_tokens": 40, "ignore_eos": True}
    async with session.post(
        server.url + COMPLETIONS, json=body, headers={"x-workload": "coding"}
    ) as r:
        assert (await r.json())["usage"]["completion_tokens"] == 40
    m = await scrape(session, server.url)
    stats = server.core.stats()
    assert m["vllm:spec_decode_num_drafts_total"] == stats.spec_num_drafts > 0
    assert m["vllm:spec_decode_num_draft_tokens_total"] == stats.spec_num_draft_tokens
    assert m["vllm:spec_decode_num_accepted_tokens_total"] == stats.spec_num_accepted_tokens
    assert m["vllm:generation_tokens_total"] == 40
    # vLLM's per-position counter: one position per draft slot (the tiny profile drafts 4),
    # the first draft accepted at least as often as any later one, summing to the accepted
    name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    per_pos = [
        m[f"{name}{{engine=0,model_name={server.model_name},position={i}}}"] for i in range(4)
    ]
    assert f"{name}{{engine=0,model_name={server.model_name},position=4}}" not in m
    assert per_pos == sorted(per_pos, reverse=True)
    assert sum(per_pos) == stats.spec_num_accepted_tokens


async def test_sglang_flavor(enginesim_server, session):
    server = await enginesim_server("tiny", speed=50.0, flavor="sglang", speculative=True)
    p = server.profile
    async with session.get(server.url + "/server_info") as r:
        info = await r.json()
    assert info["max_total_num_tokens"] == p.num_gpu_blocks * p.block_size
    assert info["max_running_requests"] == p.max_num_seqs
    assert info["page_size"] == p.block_size
    assert info["context_length"] == p.max_model_len

    completion, prompt = await _run_requests(session, server.url, 4)
    m = await scrape(session, server.url)
    stats = server.core.stats()
    assert not any(k.startswith("vllm:") for k in m)
    assert m[f"sglang:num_running_reqs{{model_name={server.model_name}}}"] == 0
    assert m["sglang:num_queue_reqs"] == 0
    assert m["sglang:token_usage"] == stats.kv_usage
    assert m["sglang:max_total_num_tokens"] == info["max_total_num_tokens"]
    assert m["sglang:generation_tokens_total"] == completion == stats.generation_tokens
    assert m["sglang:prompt_tokens_total"] == prompt
    assert 0.0 <= m["sglang:cache_hit_rate"] <= 1.0
    expected_accept = 1 + stats.spec_num_accepted_tokens / stats.spec_num_drafts
    assert m["sglang:spec_accept_length"] == pytest.approx(expected_accept)
    assert m["sglang:spec_accept_length"] > 1.0
    assert m["sglang:time_to_first_token_seconds_count"] == 4
    assert m["sglang:e2e_request_latency_seconds_count"] == 4


async def test_vllm_flavor_has_no_server_info(enginesim_server, session):
    server = await enginesim_server("tiny")
    async with session.get(server.url + "/server_info") as r:
        assert r.status == 404


async def test_replicas_in_one_process_keep_separate_metrics(enginesim_server, session):
    a = await enginesim_server("tiny", speed=50.0)
    b = await enginesim_server("tiny", speed=50.0)
    await _run_requests(session, a.url, 2)
    ma, mb = await scrape(session, a.url), await scrape(session, b.url)
    assert ma["vllm:generation_tokens_total"] > 0
    assert mb["vllm:generation_tokens_total"] == 0
