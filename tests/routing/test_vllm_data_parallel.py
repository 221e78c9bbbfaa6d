"""vLLM data parallel: one pool per engine rank, read from exposition shaped like vLLM's.

vLLM (V1) with ``--data-parallel-size 2`` exports every ``vllm:`` metric once per engine
core, labelled ``engine="0"`` / ``engine="1"`` next to ``model_name`` (one
``PrometheusStatLogger`` for all engines, ``make_per_engine``), and one
``vllm:cache_config_info`` label set per engine. The text below has that shape, with the
two engines deliberately different so that a mix-up shows.
"""

from __future__ import annotations

import json

import pytest

from gateway.config import ConfigError, config_from_mapping, expand_data_parallel
from routing.adapters import adapter_for
from routing.types import ReplicaState

M = "meta-llama/Llama-3.1-70B-Instruct"


def _cache_info(engine: int, blocks: int) -> str:
    return (
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",'
        'cpu_offload_gb="0",enable_prefix_caching="True",'
        f'engine="{engine}",gpu_memory_utilization="0.9",is_attention_free="False",'
        f'num_cpu_blocks="None",num_gpu_blocks="{blocks}",num_gpu_blocks_override="None",'
        'prefix_caching_hash_algo="sha256",sliding_window="None",swap_space="4",'
        'swap_space_bytes="4294967296"} 1.0'
    )


DP_METRICS = f"""\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{{generation="0"}} 4242.0
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 1.2e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="{M}"}} 5.0
vllm:num_requests_running{{engine="1",model_name="{M}"}} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="{M}"}} 3.0
vllm:num_requests_waiting{{engine="1",model_name="{M}"}} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="{M}"}} 0.9
vllm:kv_cache_usage_perc{{engine="1",model_name="{M}"}} 0.1
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",model_name="{M}"}} 1000.0
vllm:prefix_cache_queries_total{{engine="1",model_name="{M}"}} 400.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{{engine="0",model_name="{M}"}} 1.75e+09
vllm:prefix_cache_queries_created{{engine="1",model_name="{M}"}} 1.75e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",model_name="{M}"}} 600.0
vllm:prefix_cache_hits_total{{engine="1",model_name="{M}"}} 100.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{engine="0",model_name="{M}"}} 7.0
vllm:num_preemptions_total{{engine="1",model_name="{M}"}} 0.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{{engine="0",finished_reason="stop",model_name="{M}"}} 12.0
vllm:request_success_total{{engine="1",finished_reason="stop",model_name="{M}"}} 9.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
{_cache_info(0, 1000)}
{_cache_info(1, 1200)}
"""
MODELS = json.dumps(
    {"object": "list", "data": [{"id": M, "object": "model", "max_model_len": 8192}]}
)


def _apply(rank: int | None) -> ReplicaState:
    st = ReplicaState(name="r", base_url="http://x", engine="vllm", dp_rank=rank)
    adapter_for("vllm").apply(st, {"/metrics": (200, DP_METRICS), "/v1/models": (200, MODELS)}, 1.0)
    return st


def test_each_rank_reads_only_its_own_engine() -> None:
    r0, r1 = _apply(0), _apply(1)
    assert r0.ready and r1.ready
    # Each engine's pool less its null block.
    assert r0.capacity_tokens == 999 * 16 and r1.capacity_tokens == 1199 * 16
    assert (r0.engine_running, r0.engine_waiting) == (5, 3)
    assert (r1.engine_running, r1.engine_waiting) == (2, 0)
    assert r0.kv_usage == pytest.approx(0.9) and r1.kv_usage == pytest.approx(0.1)
    assert r0.preemptions_total == 7 and r1.preemptions_total == 0
    assert (r0.prefix_cache_queries_total, r0.prefix_cache_hits_total) == (1000, 600)
    assert (r1.prefix_cache_queries_total, r1.prefix_cache_hits_total) == (400, 100)
    assert r0.models == [M] and r0.max_model_len == 8192


def test_whole_server_sums_the_engines() -> None:
    st = _apply(None)
    assert st.capacity_tokens == (999 + 1199) * 16
    assert (st.engine_running, st.engine_waiting) == (7, 3)
    assert st.kv_usage == pytest.approx(0.5)


def test_a_rank_the_server_does_not_have_is_not_ready() -> None:
    st = _apply(2)
    assert not st.ready and st.capacity_tokens is None


def test_a_rank_never_reads_unlabelled_figures_as_its_own() -> None:
    """A build without the engine label: a rank entry is not ready (the operator sees
    it), rather than taking the whole server's pool as one engine's."""
    text = DP_METRICS.replace('engine="0",', "").replace('engine="1",', "")
    st = ReplicaState(name="r", base_url="http://x", engine="vllm", dp_rank=0)
    adapter_for("vllm").apply(st, {"/metrics": (200, text), "/v1/models": (200, MODELS)}, 1.0)
    assert not st.ready


def test_a_dp_replica_is_served_as_one_replica_per_rank() -> None:
    cfg = config_from_mapping(
        {
            "replicas": [
                {
                    "name": "big",
                    "url": "http://h:8000",
                    "data_parallel_size": 3,
                    "pool_tokens": 9000,
                },
                {"name": "small", "url": "http://h:9000"},
            ]
        },
        env={},
    )
    # The config keeps the entry as written; the replicas served are one per rank.
    assert [(r.name, r.data_parallel_size) for r in cfg.replicas] == [("big", 3), ("small", 1)]
    served = expand_data_parallel(cfg.replicas)
    names = [(r.name, r.dp_rank, r.url, r.pool_tokens) for r in served]
    assert names == [
        ("big-dp0", 0, "http://h:8000", 9000),
        ("big-dp1", 1, "http://h:8000", 9000),
        ("big-dp2", 2, "http://h:8000", 9000),
        ("small", None, "http://h:9000", None),
    ]


@pytest.mark.parametrize(
    ("replica", "field"),
    [
        ({"engine": "sglang", "data_parallel_size": 2}, "data_parallel_size"),
        ({"dp_rank": 2, "data_parallel_size": 2}, "dp_rank"),
    ],
)
def test_config_errors_name_the_field(replica: dict, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        config_from_mapping({"replicas": [{"name": "a", "url": "http://h", **replica}]}, env={})
    assert field in str(e.value)


def test_expanded_names_must_stay_unique() -> None:
    with pytest.raises(ConfigError) as e:
        config_from_mapping(
            {
                "replicas": [
                    {"name": "a", "url": "http://h", "data_parallel_size": 2},
                    {"name": "a-dp1", "url": "http://h2"},
                ]
            },
            env={},
        )
    assert "duplicate replica name 'a-dp1'" in str(e.value)
