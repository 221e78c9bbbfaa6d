"""`--check` is `serve`'s validation (issue 22, item 4), `--check --probe` says what each
replica tells kvgate (item 3), `/v1/models` asks for the key and lists the tenant's
models, and a gateway beyond loopback without keys says so at start."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import aiohttp
import pytest

from admission.tenants import hash_key
from gateway.app import Gateway
from gateway.cli import main
from gateway.config import config_from_mapping
from tests.gateway.conftest import MODEL
from tests.gateway.test_not_ready import Lines, closed_port

ENV = ("KVGATE_LISTEN", "KVGATE_ADMIN_TOKEN", "KVGATE_API_KEYS", "KVGATE_LOG_LEVEL")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ENV:
        monkeypatch.delenv(var, raising=False)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["serve", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("replicas: []\n", "replicas: at least one replica"),
        (
            "replicas:\n  - {name: a, url: 'http://127.0.0.1:1', engine: openai}\n",
            "replicas.0: pool_tokens: required with engine openai",
        ),
        (
            "replicas:\n  - {name: a, url: 'http://127.0.0.1:1', pool_tokns: 5}\n",
            "replicas.0.pool_tokns: unknown field (did you mean 'pool_tokens'?)",
        ),
        ("discovery: {refresh_intreval_s: 1}\n", "did you mean 'refresh_interval_s'?"),
        (  # a setting removed with its rule is named as removed, not as unknown
            "replicas:\n  - {name: a, url: 'http://127.0.0.1:1'}\n"
            "admission: {knee_efficiency: 0.1}\n",
            "admission: knee_efficiency was removed: the goodput knee is no longer fitted",
        ),
    ],
)
def test_check_refuses_word_for_word_what_serve_refuses(tmp_path: Path, capsys, text, words):
    path = tmp_path / "kvgate.yaml"
    path.write_text(text)
    checked = run(capsys, "--config", str(path), "--check")
    served = run(capsys, "--config", str(path))
    assert checked[0] == served[0] == 2
    assert words in checked[2] and str(path) in checked[2]
    assert checked[2] == served[2]


def test_check_without_a_config_is_refused_as_serve_refuses_it(capsys):
    checked = run(capsys, "--check")
    assert checked[0] == 2 and "replicas: at least one replica" in checked[2]
    assert checked[2] == run(capsys)[2]


def test_a_yaml_error_names_the_file_and_line(tmp_path: Path, capsys):
    path = tmp_path / "kvgate.yaml"
    path.write_text("listen:\n  host: 127.0.0.1\n  port: [8080\nreplicas: []\n")
    rc, _, err = run(capsys, "--config", str(path), "--check")
    assert rc == 2
    assert f"{path}:4:" in err and "not valid YAML" in err and "<unicode string>" not in err


def test_check_warns_of_a_gateway_beyond_loopback_without_keys(tmp_path: Path, capsys):
    path = tmp_path / "kvgate.yaml"
    base = "replicas:\n  - {name: a, url: 'http://127.0.0.1:1'}\n"
    path.write_text(base + "listen: {host: 0.0.0.0}\n")
    rc, out, err = run(capsys, "--config", str(path), "--check")
    assert rc == 0 and "config OK (1 replicas)" in out
    assert "warning: listen.host 0.0.0.0 is not loopback and no API key" in err
    path.write_text(base + "listen: {host: 127.0.0.1}\n")
    assert "warning" not in run(capsys, "--config", str(path), "--check")[2]
    digest = hash_key("sk-x")
    path.write_text(
        base + f"listen: {{host: 0.0.0.0}}\ntenants:\n  - {{name: t, keys_sha256: [{digest}]}}\n"
    )
    assert "warning" not in run(capsys, "--config", str(path), "--check")[2]


async def test_check_probe_prints_what_each_replica_tells(replica, tmp_path: Path):
    srv = await replica()
    path = tmp_path / "kvgate.yaml"
    path.write_text(
        "replicas:\n"
        f"  - {{name: good, url: '{srv.url}'}}\n"
        f"  - {{name: slash, url: '{srv.url}/v1'}}\n"
        f"  - {{name: gone, url: 'http://127.0.0.1:{closed_port()}'}}\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--config",
        str(path),
        "--check",
        "--probe",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    lines = {ln.split(" ", 1)[0]: ln for ln in out.decode().splitlines()}
    assert proc.returncode == 1
    stats = srv.core.stats()
    pool = (stats.num_gpu_blocks - stats.null_blocks) * stats.block_size  # what it can give
    assert f"ready: models {MODEL}; pool {pool} tokens" in lines["good"]
    assert "NOT READY: the URL ends in /v1" in lines["slash"]
    assert "NOT READY:" in lines["gone"] and "connection refused" in lines["gone"]


async def test_models_ask_for_the_key_and_list_the_tenants_models(replica, gateway):
    srv = await replica()
    tenants = [
        {"name": "all", "keys_sha256": [hash_key("sk-all")]},
        {"name": "none", "keys_sha256": [hash_key("sk-none")], "models": ["other"]},
    ]
    gw = await gateway(srv, tenants=tenants)
    async with aiohttp.ClientSession() as s:

        async def get(path: str, key: str | None) -> tuple[int, dict]:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            async with s.get(gw.url + path, headers=headers) as r:
                return r.status, await r.json()

        assert (await get("/v1/models", "sk-wrong"))[0] == 401
        status, body = await get("/v1/models", None)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert [m["id"] for m in (await get("/v1/models", "sk-all"))[1]["data"]] == [MODEL]
        assert (await get("/v1/models", "sk-none"))[1]["data"] == []
        status, body = await get(f"/v1/models/{MODEL}", "sk-all")
        assert status == 200 and body["id"] == MODEL and body["object"] == "model"
        status, body = await get(f"/v1/models/{MODEL}", "sk-none")
        assert status == 404 and body["error"]["code"] == "model_not_found"
        assert (await get("/v1/models/nope", "sk-all"))[0] == 404
        assert (await get(f"/v1/models/{MODEL}", "sk-wrong"))[0] == 401


async def test_a_gateway_beyond_loopback_without_keys_warns_at_start(replica):
    srv = await replica()
    lines = Lines()
    logger = logging.getLogger("kvgate")
    logger.addHandler(lines)
    try:
        for tenants in ([], [{"name": "t", "keys_sha256": [hash_key("sk-t")]}]):
            cfg = config_from_mapping(
                {"replicas": [{"name": "a", "url": srv.url}], "tenants": tenants}, env={}
            )
            gw = Gateway(cfg, host="0.0.0.0", port=0)
            await gw.start()
            await gw.stop()
    finally:
        logger.removeHandler(lines)
    warned = [x.getMessage() for x in lines.records if "not loopback" in x.getMessage()]
    assert len(warned) == 1 and "0.0.0.0" in warned[0]
