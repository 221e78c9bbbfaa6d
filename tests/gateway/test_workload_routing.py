"""Workload-aware routing by default, through kvgate over loopback with the official
`openai` client at its defaults (stream and non-stream): with no ``routing:`` section
each class is placed by its own scoring, the access line says how, and
``kvgate_route_decisions_total{workload,scorer}`` counts it; a stream's first token
clears its prefill from the replica's pending count (routing.prefill)."""

from __future__ import annotations

import json
import logging

import aiohttp
import openai

from gateway.logging import ACCESS_LOGGER, JsonFormatter
from tests.gateway.conftest import MODEL, wait_for

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


async def test_default_config_routes_each_class_by_its_own_scoring(replica, gateway, caplog):
    servers = [await replica(speed=50.0), await replica(speed=50.0)]
    gw = await gateway(*servers)  # no routing section
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused")
    system = {"role": "system", "content": "You are a careful agent. " * 40}
    logger = logging.getLogger(ACCESS_LOGGER)
    was_disabled, logger.disabled = logger.disabled, False
    try:
        with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4
            )
            await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Fix:\n```py\ndef f(:\n```"}],
                max_tokens=4,
            )
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=[system, {"role": "user", "content": "list the files"}],
                tools=TOOLS,  # type: ignore[arg-type]
                max_tokens=64,
                stream=True,
            )
            router = gw.state.door.router
            scorer = router.per_workload["agentic"].scorers[0][0]  # type: ignore[attr-defined]
            first = True
            async for _ in stream:
                if first:
                    first = False
                    # The first chunk reached us: its prefill is no longer pending.
                    assert await wait_for(lambda: scorer.pending.requests() == 0, within=2.0)
            await gw.drain(5.0)
    finally:
        logger.disabled = was_disabled
    routes = [
        json.loads(JsonFormatter().format(rec))["route"]
        for rec in caplog.records
        if rec.name == ACCESS_LOGGER
    ]
    assert routes == [
        "chat/kv_headroom/score",
        "coding/speculation+running_headroom+kv_headroom/score",
        "agentic/prefix_load+session_affinity/score",
    ], routes
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
        metrics = await r.text()
    for workload, scorer_name in (
        ("agentic", "prefix_load+session_affinity"),
        ("chat", "kv_headroom"),
        ("coding", "speculation+running_headroom+kv_headroom"),
    ):
        line = f'kvgate_route_decisions_total{{scorer="{scorer_name}",workload="{workload}"}} 1.0'
        assert line in metrics, metrics
