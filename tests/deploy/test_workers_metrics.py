"""`kvgate serve --workers 2` (the compose stack's setting) scraped as Prometheus would:
the workers share one port, so each scrape reaches one of them; every sample carries its
worker's `worker` label, so each worker's counters stay monotonic series and their sum
is the gateway's total."""

from __future__ import annotations

import asyncio
import os
import sys

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.live import Stack, free_port, wait_ok

# `kvgate serve --workers 2` and a replica as processes.
pytestmark = pytest.mark.slow

MODEL = "tiny-llm"


async def test_each_worker_labels_its_samples_and_they_add_up(tmp_path) -> None:
    redis_url = os.environ.get("KVGATE_REDIS_URL")
    if not redis_url:
        pytest.fail("KVGATE_REDIS_URL is not set (scripts/test.sh starts a Redis)")
    st = Stack(tmp_path)
    try:
        port = free_port()
        sim = f"http://127.0.0.1:{port}"
        argv = ["-m", "enginesim", "serve", "--profile", "tiny", "--port", str(port)]
        p = st.start([sys.executable, *argv, "--speed", "20"], "replica", sim)
        await wait_ok(sim + "/v1/models", p)
        gport = free_port()
        cfg = {
            "listen": {"host": "127.0.0.1", "port": gport},
            "replicas": [{"name": "r0", "url": sim}],
            "state": {"backend": "redis", "redis_url": redis_url, "key_prefix": f"kvw-{gport}"},
            "logging": {"access_log": False},
            "shutdown": {"listen_grace_s": 0.0},  # stop at once (the default holds 2 s)
        }
        (tmp_path / "kvgate.yaml").write_text(yaml.safe_dump(cfg))
        gw = f"http://127.0.0.1:{gport}"
        argv = ["-m", "gateway.cli", "serve", "--config", str(tmp_path / "kvgate.yaml")]
        p = st.start([sys.executable, *argv, "--workers", "2"], "kvgate", gw)
        await wait_ok(gw + "/ready", p)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        sent = 24
        latest: dict[str, float] = {}
        async with aiohttp.ClientSession() as s:

            async def scrape_worker() -> tuple[str, str]:
                async with s.get(gw + "/metrics", headers={"Connection": "close"}) as r:
                    text = await r.text()
                seen = {
                    smp.labels.get("worker", "")
                    for fam in text_string_to_metric_families(text)
                    for smp in fam.samples
                }
                assert len(seen) == 1, seen  # one scrape, one worker, every sample labelled
                return seen.pop(), text

            # /ready answered once one worker listened: wait until both do (bounded).
            up = set()
            for _ in range(200):
                up.add((await scrape_worker())[0])
                if len(up) == 2:
                    break
                await asyncio.sleep(0.05)
            assert up == {"0", "1"}
            for _ in range(sent):  # a new connection each: the kernel spreads them
                async with s.post(
                    gw + "/v1/chat/completions", json=body, headers={"Connection": "close"}
                ) as r:
                    assert r.status == 200
                    await r.read()
            for _ in range(200):  # bounded: stop once both workers answered a scrape
                worker, text = await scrape_worker()
                for fam in text_string_to_metric_families(text):
                    for smp in fam.samples:
                        if smp.name == "kvgate_requests_total" and smp.labels["outcome"] == "ok":
                            latest[worker] = smp.value
                if len(latest) == 2:
                    break
                await asyncio.sleep(0.05)
        assert set(latest) == {"0", "1"}
        assert sum(latest.values()) == sent  # sum without (worker): the gateway's total
    finally:
        st.stop()
