"""Live reload (issue 22, item 2): SIGHUP (`Gateway.reload`, what the signal calls) and a
ConfigMap-style symlink swap of the file; under load, ten reloads that change replicas,
tenants, routing and admission lose no request and leave the ledger consistent; an
invalid config is refused with its field named and the old one keeps serving."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import yaml

from admission.tenants import hash_key
from gateway.app import Gateway
from gateway.config import load_config
from tests.gateway.conftest import MODEL, all_replicas_ready, wait_for
from tests.gateway.test_not_ready import Lines

KEY = "sk-team-a"


pytestmark = pytest.mark.slow


def config(servers: list[Any], **extra: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "replicas": [{"name": f"r{i}", "url": s.url} for i, s in servers],
        "tenants": [{"name": "team-a", "keys_sha256": [hash_key(KEY)]}],
        "auth": {"admin_token": "admin-1"},
        "discovery": {"refresh_interval_s": 0.2, "probe_timeout_s": 0.5},
        "upstream": {"first_byte_s": 10, "idle_s": 10, "total_s": 30},
        "logging": {"access_log": False},
    }
    data.update(extra)
    return data


class ConfigMap:
    """A mounted ConfigMap: kvgate.yaml -> ..data/kvgate.yaml, ..data -> ..<version>,
    replaced by an atomic swap of the ..data symlink (what the kubelet does)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.version = 0
        self.path = root / "kvgate.yaml"

    def write(self, data: dict[str, Any] | str) -> None:
        self.version += 1
        d = self.root / f"..v{self.version}"
        d.mkdir()
        (d / "kvgate.yaml").write_text(data if isinstance(data, str) else yaml.safe_dump(data))
        tmp = self.root / "..data_tmp"
        tmp.symlink_to(d.name)
        os.replace(tmp, self.root / "..data")
        if not self.path.is_symlink():
            self.path.symlink_to("..data/kvgate.yaml")


async def start(cm: ConfigMap) -> Gateway:
    gw = Gateway(load_config(cm.path), config_path=str(cm.path))
    await gw.start()
    assert gw.state.reloader is not None
    gw.state.reloader.poll_s = 0.05
    await all_replicas_ready(gw)
    return gw


async def reloads(gw: Gateway) -> dict[str, float]:
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/metrics") as r:
            text = await r.text()
    out = {}
    for line in text.splitlines():
        if line.startswith("kvgate_config_reloads_total{"):
            result = line.split('result="')[1].split('"')[0]
            out[result] = float(line.rsplit(" ", 1)[1])
    return out


async def test_ten_reloads_under_load_lose_no_request(replica, tmp_path: Path) -> None:
    servers = [await replica() for _ in range(3)]
    cm = ConfigMap(tmp_path)
    # Each version: another pair of replicas, another routing picker, admission
    # setting and tenant limit (one in two by SIGHUP, the others by the file).
    versions = []
    for k in range(10):
        pair = [(k % 3, servers[k % 3]), ((k + 1) % 3, servers[(k + 1) % 3])]
        versions.append(
            config(
                pair,
                admission={"headroom": 0.05 + 0.01 * (k % 2), "queue_timeout_s": 10 + k},
                routing={
                    "default_profile": {
                        "scorers": [{"name": "kv_headroom"}]
                        + ([{"name": "prefix_cache", "weight": 2.0}] if k % 2 else [])
                    }
                },
                tenants=[{"name": "team-a", "keys_sha256": [hash_key(KEY)], "rpm": 100_000 + k}],
            )
        )
    cm.write(config([(0, servers[0]), (1, servers[1])]))
    gw = await start(cm)
    results: list[str] = []
    stop = asyncio.Event()

    async def plain(s: aiohttp.ClientSession, stream: bool) -> None:
        while not stop.is_set():
            body = {"model": MODEL, "prompt": "count", "max_tokens": 24, "stream": stream}
            async with s.post(
                gw.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
            ) as r:
                text = await r.text()
                ok = r.status == 200 and (not stream or "data: [DONE]" in text)
                results.append("ok" if ok else f"{r.status} {text[:200]}")

    async def sdk(c: openai.AsyncOpenAI, stream: bool) -> None:
        while not stop.is_set():
            try:
                if stream:
                    chunks = await c.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": "hi"}],
                        max_tokens=16,
                        stream=True,
                    )
                    async for _ in chunks:
                        pass
                else:
                    await c.completions.create(model=MODEL, prompt="hi", max_tokens=16)
                results.append("ok")
            except openai.APIError as e:
                results.append(f"sdk {e!r}")

    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)
    load: list[asyncio.Task[None]] = []
    try:
        async with aiohttp.ClientSession() as s:
            load += [asyncio.create_task(plain(s, i % 2 == 0)) for i in range(4)]
            load += [asyncio.create_task(sdk(client, i % 2 == 0)) for i in range(4)]
            for k, data in enumerate(versions):
                await asyncio.sleep(0.3)
                if k % 2:
                    cm.write(data)
                    assert await gw.reload("SIGHUP")  # the same file, reread at once
                else:
                    before = (await reloads(gw)).get("ok", 0)
                    cm.write(data)
                    assert await wait_for(
                        lambda b=before: gw.state.config == load_config(cm.path), within=5
                    )
                    assert (await reloads(gw)).get("ok", 0) > before
                want = {r["name"] for r in data["replicas"]}
                assert await wait_for(
                    lambda w=want: {u.name for u in gw.report.replica_usage() if u.ready} == w
                ), (k, want, [(u.name, u.ready) for u in gw.report.replica_usage()])
            await asyncio.sleep(0.3)
            stop.set()
            await asyncio.gather(*load)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*load, return_exceptions=True), 30)
        await client.close()
        drained = await gw.drain(10.0)
        reserved = gw.report.reserved_tokens()
        names = set(gw.report.replica_names())
        counts = await reloads(gw)
        await gw.stop()
    lost = [r for r in results if r != "ok"]
    assert not lost, lost[:5]
    assert len(results) > 50
    assert drained and reserved == 0
    assert names == {r["name"] for r in versions[-1]["replicas"]}  # retired ones left
    assert counts.get("ok", 0) >= 10 and counts.get("invalid", 0) == 0
    for srv in servers:
        assert await wait_for(lambda s=srv: s.core.stats().blocks_in_use == 0)


async def test_an_invalid_config_is_refused_and_the_old_one_serves(replica, tmp_path: Path) -> None:
    srv = await replica()
    cm = ConfigMap(tmp_path)
    cm.write(config([(0, srv)]))
    gw = await start(cm)
    lines = Lines()
    logging.getLogger("kvgate.reload").addHandler(lines)
    try:
        cm.write(config([(0, srv)], admission={"headrom": 0.1}))
        assert await wait_for(lambda: any(x.levelno == logging.ERROR for x in lines.records))
        assert not await gw.reload("SIGHUP")
        err = [x.getMessage() for x in lines.records if x.levelno == logging.ERROR]
        assert "admission.headrom: unknown field (did you mean 'headroom'?)" in err[0]
        assert (await reloads(gw)) == {"ok": 0.0, "invalid": 2.0}
        async with aiohttp.ClientSession() as s:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
            headers = {"Authorization": f"Bearer {KEY}"}
            async with s.post(gw.url + "/v1/completions", json=body, headers=headers) as r:
                assert r.status == 200
    finally:
        logging.getLogger("kvgate.reload").removeHandler(lines)
        await gw.stop()


async def test_keys_and_admin_token_change_with_the_file(replica, tmp_path: Path) -> None:
    srv = await replica()
    cm = ConfigMap(tmp_path)
    cm.write(config([(0, srv)]))
    gw = await start(cm)
    try:
        cm.write(
            config(
                [(0, srv)],
                tenants=[{"name": "team-b", "keys_sha256": [hash_key("sk-team-b")]}],
                auth={"admin_token": "admin-2"},
            )
        )
        assert await wait_for(lambda: gw.state.config.auth.admin_token == "admin-2", within=5)
        async with aiohttp.ClientSession() as s:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
            for key, status in ((KEY, 401), ("sk-team-b", 200)):
                headers = {"Authorization": f"Bearer {key}"}
                async with s.post(gw.url + "/v1/completions", json=body, headers=headers) as r:
                    assert r.status == status, key
            for token, status in (("admin-1", 401), ("admin-2", 200)):
                headers = {"Authorization": f"Bearer {token}"}
                async with s.get(gw.url + "/admin/replicas", headers=headers) as r:
                    assert r.status == status, token
    finally:
        await gw.stop()
