"""The ``tenants:`` config: validation that names the field, the documented example, the
slo_itl filter added when a tenant has an ITL target, and ``kvgate hash-key``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from admission.tenants import TenantLimiter, hash_key
from gateway.config import ConfigError, config_from_mapping, routing_with_slo_filter

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "kvgate.example.yaml"
DIGEST = hash_key("sk-x")


def test_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"tenants\.0\.weight"):
        config_from_mapping({"tenants": [{"name": "a", "weight": 0}]}, env={})
    with pytest.raises(ConfigError, match=r"tenants\.0\.keys_sha256"):
        config_from_mapping({"tenants": [{"name": "a", "keys_sha256": ["sk-x"]}]}, env={})
    with pytest.raises(ConfigError, match="duplicate tenant name"):
        config_from_mapping({"tenants": [{"name": "a"}, {"name": "a"}]}, env={})
    with pytest.raises(ConfigError, match="also 'a''s"):
        config_from_mapping(
            {
                "tenants": [
                    {"name": "a", "keys_sha256": [DIGEST]},
                    {"name": "b", "keys_sha256": [DIGEST]},
                ]
            },
            env={},
        )


def test_the_commented_example_tenant_is_valid() -> None:
    text = EXAMPLE.read_text()
    block = text[text.index("tenants: []") :].splitlines()[1:]
    uncommented = "\n".join(line[2:] for line in block if line.startswith("# "))
    tenants = yaml.safe_load(uncommented)
    cfg = config_from_mapping({"tenants": tenants}, env={})
    t = cfg.tenants[0]
    assert (t.rpm, t.tpm, t.weight, t.slo.itl_s) == (600, 200000, 2.0, 0.1)


def test_an_itl_target_adds_the_slo_filter_to_every_profile() -> None:
    plain = config_from_mapping({"tenants": [{"name": "a"}]}, env={})
    assert routing_with_slo_filter(plain).default_profile.filters == []
    cfg = config_from_mapping(
        {
            "tenants": [{"name": "a", "slo": {"itl_s": 0.1}}],
            "routing": {"profiles": {"m": {"filters": [{"name": "label", "params": {"x": "y"}}]}}},
        },
        env={},
    )
    # The config stays as written; the routing served has the filter in every profile.
    assert cfg.routing.default_profile.filters == []
    served = routing_with_slo_filter(cfg)
    assert [f.name for f in served.default_profile.filters] == ["slo_itl"]
    assert [f.name for f in served.profiles["m"].filters] == ["label", "slo_itl"]
    assert served.workloads
    assert all([f.name for f in p.filters] == ["slo_itl"] for p in served.workloads.values())


def test_env_keys_are_hashed_at_load() -> None:
    cfg = config_from_mapping({}, env={"KVGATE_API_KEYS": "sk-env:team-e"})
    lim = TenantLimiter.from_config(cfg.tenants, cfg.auth.api_keys)
    assert lim.authenticate("sk-env") == "team-e"
    assert "sk-env" not in repr(cfg)


@pytest.mark.slow
def test_hash_key_cli() -> None:
    cmd = [sys.executable, "-m", "gateway.cli", "hash-key"]
    out = subprocess.run(cmd, input="sk-x\n", capture_output=True, text=True, check=True)
    assert out.stdout.strip() == DIGEST
    new = subprocess.run([*cmd, "--new"], capture_output=True, text=True, check=True)
    lines = dict(line.split(": ", 1) for line in new.stdout.splitlines())
    key, digest = lines["key"].strip(), lines["sha256"].strip()
    assert key.startswith("sk-kvg-") and len(key) > 40
    assert digest == hash_key(key)
    empty = subprocess.run(cmd, input="", capture_output=True, text=True)
    assert empty.returncode == 2
