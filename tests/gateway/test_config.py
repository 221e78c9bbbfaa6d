"""Config loading: validation that names the field, environment overrides, the CLI."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.config import (
    REMOVED_SETTINGS,
    ConfigError,
    GatewayConfig,
    _model_in,
    config_from_mapping,
    load_config,
)

GOOD = """
listen: {host: 127.0.0.1, port: 9000}
replicas:
  - name: a
    url: http://127.0.0.1:8001/
    engine: vllm
  - name: b
    url: http://127.0.0.1:8002
    engine: openai
    pool_tokens: 65536
    block_size: 32
    max_running: 8
    labels: {speculative: true, zone: 3}
admission:
  headroom: 0.1
  queue_timeout_s: 5
upstream: {connect_s: 1, first_byte_s: 10, idle_s: 5, total_s: 60}
limits: {max_body_bytes: 1048576}
auth:
  api_keys: {sk-1: team-a}
  admin_token: file-token
discovery: {refresh_interval_s: 1.5}
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "kvgate.yaml"
    p.write_text(text)
    return p


def test_good_config_parses(tmp_path):
    cfg = load_config(write(tmp_path, GOOD), env={})
    assert cfg.listen.port == 9000
    a, b = cfg.replicas
    assert a.url == "http://127.0.0.1:8001"  # trailing slash dropped
    assert b.pool_tokens == 65536 and b.block_size == 32 and b.max_running == 8
    assert b.labels == {"speculative": "true", "zone": "3"}
    assert cfg.admission.headroom == 0.1
    assert cfg.upstream.first_byte_s == 10
    assert cfg.auth.api_keys == {"sk-1": "team-a"}
    assert cfg.discovery.refresh_interval_s == 1.5


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("replicas:\n  - {name: a, url: http://x, engine: tgi}\n", "replicas.0.engine"),
        ("replicas:\n  - {name: a, url: ftp://x}\n", "replicas.0.url"),
        ("replicas:\n  - {name: a, url: http://x, pool_tokens: -1}\n", "replicas.0.pool_tokens"),
        ("replicas:\n  - {name: a, url: http://x, colour: red}\n", "replicas.0.colour"),
        ("admission: {headrom: 0.1}\n", "admission.headrom"),
        ("admission: {headroom: 2}\n", "admission.headroom"),
        ("upstream: {idle_s: 0}\n", "upstream.idle_s"),
        ("discovery: {refresh_intreval_s: 1}\n", "discovery.refresh_intreval_s"),
        ("listen: {port: 70000}\n", "listen.port"),
        ("bogus: 1\n", "bogus"),
    ],
)
def test_invalid_field_is_named(tmp_path, text, field):
    with pytest.raises(ConfigError) as ei:
        load_config(write(tmp_path, text), env={})
    assert field in str(ei.value)


def test_duplicate_replica_names_rejected():
    with pytest.raises(ConfigError, match="duplicate replica name"):
        config_from_mapping(
            {"replicas": [{"name": "a", "url": "http://x"}, {"name": "a", "url": "http://y"}]},
            env={},
        )


def test_not_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "replicas: [\n"), env={})
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "absent.yaml", env={})
    with pytest.raises(ConfigError, match="top level"):
        load_config(write(tmp_path, "- 1\n- 2\n"), env={})


def test_environment_overrides(tmp_path):
    env = {
        "KVGATE_LISTEN": "0.0.0.0:7777",
        "KVGATE_ADMIN_TOKEN": "env-token",
        "KVGATE_API_KEYS": "sk-x:tenant-x, sk-y",
        "KVGATE_LOG_LEVEL": "WARNING",
    }
    cfg = load_config(write(tmp_path, GOOD), env=env)
    assert (cfg.listen.host, cfg.listen.port) == ("0.0.0.0", 7777)
    assert cfg.auth.admin_token == "env-token"
    assert cfg.auth.api_keys == {"sk-x": "tenant-x", "sk-y": "default"}
    assert cfg.logging.level == "warning"
    # Only the port: host stays from the file.
    cfg = load_config(write(tmp_path, GOOD), env={"KVGATE_LISTEN": ":7000"})
    assert (cfg.listen.host, cfg.listen.port) == ("127.0.0.1", 7000)


def test_bad_environment_value_is_named(tmp_path):
    with pytest.raises(ConfigError, match="KVGATE_LISTEN"):
        load_config(write(tmp_path, GOOD), env={"KVGATE_LISTEN": "nohost"})
    with pytest.raises(ConfigError, match="logging.level"):
        load_config(write(tmp_path, GOOD), env={"KVGATE_LOG_LEVEL": "loud"})


def test_cli_invalid_config_exits_non_zero(tmp_path, capsys):
    path = write(tmp_path, "replicas:\n  - {name: a, url: http://x, engine: tgi}\n")
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "replicas.0.engine" in err


def test_cli_check_and_dispatch(tmp_path, capsys, monkeypatch):
    for var in ("KVGATE_LISTEN", "KVGATE_ADMIN_TOKEN", "KVGATE_API_KEYS", "KVGATE_LOG_LEVEL"):
        monkeypatch.delenv(var, raising=False)
    assert main(["serve", "--config", str(write(tmp_path, GOOD)), "--check"]) == 0
    assert "config OK (2 replicas)" in capsys.readouterr().out
    assert main([]) == 2
    with pytest.raises(SystemExit):
        main(["frobnicate"])


def test_console_script_entry_point_runs(tmp_path):
    """`python -m gateway.cli` is the same entry point as the `kvgate` console script."""
    path = write(tmp_path, "upstream: {total_s: -1}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 2
    assert "upstream.total_s" in proc.stderr


def test_kv_layout_is_a_llamacpp_setting() -> None:
    ok = config_from_mapping(
        {
            "replicas": [
                {"name": "l", "url": "http://x", "engine": "llamacpp", "kv_layout": "unified"}
            ]
        },
        env={},
    )
    assert ok.replicas[0].kv_layout == "unified"
    assert (
        config_from_mapping({"replicas": [{"name": "v", "url": "http://x"}]}, env={})
        .replicas[0]
        .kv_layout
        == "auto"
    )
    with pytest.raises(
        ConfigError, match=r"replicas\.0: .*kv_layout: 'per_slot' applies to engine llamacpp only"
    ):
        config_from_mapping(
            {
                "replicas": [
                    {"name": "v", "url": "http://x", "engine": "vllm", "kv_layout": "per_slot"}
                ]
            },
            env={},
        )
    with pytest.raises(ConfigError, match=r"replicas\.0\.kv_layout"):
        config_from_mapping(
            {
                "replicas": [
                    {"name": "l", "url": "http://x", "engine": "llamacpp", "kv_layout": "split"}
                ]
            },
            env={},
        )


def test_a_setting_turned_constant_is_named_with_where_it_went() -> None:
    with pytest.raises(ConfigError) as ei:
        config_from_mapping(
            {"admission": {"limit_window": 16}, "routing": {"stale_score_factor": 0.5}}, env={}
        )
    message = str(ei.value)
    assert (
        "admission: limit_window was removed: an internal of the algorithm, now the constant "
        "LIMIT_WINDOW in admission/learned/limit.py; delete the setting"
    ) in message
    assert "routing: stale_score_factor was removed" in message


@pytest.mark.parametrize("path", sorted(REMOVED_SETTINGS))
def test_each_removed_setting_is_no_field_and_its_constant_exists(path: str) -> None:
    section, name = path.split(".")
    model = _model_in(GatewayConfig.model_fields[section].annotation)
    assert model is not None and name not in model.model_fields
    found = re.search(r"the constant (\w+) in ([\w/]+)\.py$", REMOVED_SETTINGS[path])
    if found:  # a setting that became a constant: it is there, by that name
        module = importlib.import_module(found[2].replace("/", "."))
        assert isinstance(getattr(module, found[1]), int | float)
