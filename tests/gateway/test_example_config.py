"""The example configuration shipped in deploy/ stays valid as the schema evolves."""

from pathlib import Path

from gateway.config import GatewayConfig, load_config

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "kvgate.example.yaml"


def test_example_config_loads_and_matches_defaults() -> None:
    cfg = load_config(EXAMPLE, env={})
    assert [r.engine for r in cfg.replicas] == ["vllm", "sglang", "llamacpp", "openai"]
    assert cfg.replicas[0].max_running == 8
    assert cfg.replicas[3].pool_tokens == 200000
    defaults = GatewayConfig()
    # Every section other than the example replicas and tenants documents the defaults.
    for section in (
        "listen",
        "admission",
        "routing",
        "upstream",
        "counting",
        "limits",
        "auth",
        "discovery",
        "outlier",
        "shutdown",
        "logging",
        "state",
        "replica_groups",
        "dns",
        "tokenizers",
    ):
        if section == "routing":  # its profiles are documented examples, validated here
            assert cfg.routing.model_copy(update={"profiles": {}}) == defaults.routing
            continue
        assert getattr(cfg, section) == getattr(defaults, section), section
    profiles = cfg.routing.profiles
    assert [s.name for s in profiles["agent-model"].scorers] == [
        "prefix_cache",
        "session_affinity",
        "running_headroom",
    ]
    assert [s.name for s in profiles["coder-model"].scorers] == ["speculation", "running_headroom"]
