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
from tests.gateway.test_routing import hits

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


async def test_sessions_sharing_only_their_tools_go_where_the_tools_are_cached(replica, gateway):
    """An agent's tool schemas are rendered into every prompt of its sessions (the
    engine's template puts them first): routing's prefix chain starts with them, so a
    new session of the same agent goes where they are cached. Left out of the chain,
    these sessions' messages share nothing and the sessions spread by load alone."""
    servers = [await replica(speed=50.0), await replica(speed=50.0)]
    gw = await gateway(*servers)  # no routing section: agentic requests, prefix_load
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{k}",
                "description": f"Tool {k} of the agent: reads, searches and edits files. " * 3,
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
            },
        }
        for k in range(4)
    ]
    served: list[int] = []
    cached: list[int] = []
    async with aiohttp.ClientSession() as s:
        for i in range(6):
            before = hits(servers)
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Session {i}: " + f"task {i} " * 40}],
                "tools": tools,
                "max_tokens": 4,
                "user": f"session-{i}",
            }
            async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                await r.read()
            after = hits(servers)
            delta = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before, strict=True)]
            served.append(max(range(2), key=lambda k: delta[k][1]))
            cached.append(delta[served[-1]][0])
    assert len(set(served)) == 1, served  # every session where the tools are cached
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
