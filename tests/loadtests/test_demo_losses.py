"""`kvgate demo` names each request its client gave up on through kvgate, from kvgate's own
access log: a replica and a `kvgate serve` process as the demo starts them, one client
that leaves while its request runs and one that waits for its answer."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from enginesim.profiles import load_profile
from kvgate_demo.demo import (
    client_losses,
    gateway_config,
    start_gateway,
    start_replica,
    stopping,
    wait_http,
)

# A replica and `kvgate serve` as processes, as the demo starts them.
pytestmark = pytest.mark.slow

SPEED = 0.2  # the engine's clock at a fifth of wall time: a request lasts over half a second


async def test_the_demo_reads_who_gave_up_from_kvgates_access_log(tmp_path: Path) -> None:
    profile = load_profile("tiny")
    body = {
        "model": profile.served_model_name,
        "messages": [{"role": "user", "content": "sea oar bow net " * 40}],
        "max_tokens": 48,
        "ignore_eos": True,
    }
    replica = start_replica("tiny", SPEED, log=tmp_path / "replica.log")
    log = tmp_path / "kvgate.log"
    with stopping(replica):
        await wait_http(replica.url + "/health", proc=replica)
        cfg = gateway_config(
            [replica.url], speed=1.0, timeout_s=60.0, engine=str(profile.flavor), access_log=True
        )
        cfg["shutdown"] = {"listen_grace_s": 0.0}  # stop at once (the default holds 2 s)
        gw = start_gateway(cfg, workdir=tmp_path, log=log)
        with stopping(gw):
            await wait_http(gw.url + "/ready", proc=gw)
            url = gw.url + "/v1/chat/completions"
            async with aiohttp.ClientSession() as s:
                with pytest.raises(TimeoutError):  # leaves while its request runs
                    async with s.post(
                        url, json=body, timeout=aiohttp.ClientTimeout(total=0.3)
                    ) as r:
                        await r.read()
                async with s.post(url, json=body) as r:  # waits for its answer
                    assert r.status == 200, await r.text()
    for speed in (1.0, 25.0):  # in the replica's seconds: wall seconds times its clock's speed-up
        lost = client_losses(log, speed)
        assert len(lost) == 1, log.read_text()
        # "kvg-...: queued Q s, then ran R s on replica-0 before its client left"
        words = lost[0].split()
        queued, ran = float(words[2]), float(words[6])
        assert queued < 0.2 * speed
        assert 0.2 * speed <= ran < 1.0 * speed
        assert "replica-0" in lost[0]
