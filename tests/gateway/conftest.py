"""Fixtures for the gateway tests: real kvgate instances on 127.0.0.1 in front of
embedded enginesim replicas (tiny profile, fast virtual clock).

Every gateway a test starts is checked when the test ends (invariant 2 of the design):
once it has drained, no reservation is left in the ledger and nothing waits in the
queue, and every replica that is still alive holds no KV blocks for kvgate's requests
(a disconnect or failure must have aborted them upstream too).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from gateway.app import Gateway
from gateway.config import config_from_mapping
from gateway.context import RequestContext
from gateway.outcome import CLIENT_DISCONNECT

MODEL = "tiny-llm"


async def wait_for(predicate: Callable[[], bool], within: float = 5.0, step: float = 0.01) -> bool:
    """Poll `predicate` until it holds or `within` seconds pass (conditions, not timing)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while True:
        if predicate():
            return True
        if loop.time() >= end:
            return False
        await asyncio.sleep(step)


async def all_replicas_ready(gw: Gateway, within: float = 10.0) -> bool:
    """Wait (bounded) until discovery finds every replica ready: a loaded machine can let
    the first probe time out (0.5 s in these tests) and leave a live replica unready for
    a round, so tests of live replicas start once all are ready."""
    watchers = list(gw.state.discovery.watchers.values())
    return await wait_for(lambda: all(w.state.ready for w in watchers), within=within)


@pytest.fixture
async def replica(enginesim_server: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """``srv = await replica(speed=50)``: a tiny-profile enginesim replica."""

    async def factory(**kwargs: Any) -> Any:
        kwargs.setdefault("speed", 50.0)
        return await enginesim_server("tiny", **kwargs)

    return factory


@pytest.fixture
async def gateway() -> AsyncIterator[Callable[..., Awaitable[Gateway]]]:
    """``gw = await gateway(srv1, srv2, pool_tokens=1024, admission={...})``.

    Replica-level keyword arguments (``pool_tokens``, ``max_running``, ``engine``...) apply
    to every replica; ``replicas=[...]`` gives the list explicitly. Other sections
    (``admission``, ``upstream``, ``auth``, ``limits``, ``discovery``, ``counting``,
    ``routing``, ``tenants``, ``outlier``) are merged over
    test defaults: short upstream timeouts and fast discovery.
    """
    made: list[tuple[Gateway, list[Any]]] = []

    async def factory(
        *servers: Any,
        replicas: list[dict[str, Any]] | None = None,
        admission: dict[str, Any] | None = None,
        upstream: dict[str, Any] | None = None,
        auth: dict[str, Any] | None = None,
        limits: dict[str, Any] | None = None,
        discovery: dict[str, Any] | None = None,
        counting: dict[str, Any] | None = None,
        tokenizers: dict[str, str] | None = None,
        routing: dict[str, Any] | None = None,
        tenants: list[dict[str, Any]] | None = None,
        outlier: dict[str, Any] | None = None,
        replica_groups: list[dict[str, Any]] | None = None,
        dns: dict[str, Any] | None = None,
        **replica_fields: Any,
    ) -> Gateway:
        if replicas is None:
            replicas = [
                {"name": f"r{i}", "url": s.url, **replica_fields} for i, s in enumerate(servers)
            ]
        data = {
            "replicas": replicas,
            "admission": {"queue_timeout_s": 10.0, **(admission or {})},
            "upstream": {
                "connect_s": 1.0,
                "first_byte_s": 5.0,
                "idle_s": 5.0,
                "total_s": 20.0,
                **(upstream or {}),
            },
            "auth": auth or {},
            "limits": limits or {},
            "discovery": {"refresh_interval_s": 0.2, "probe_timeout_s": 0.5, **(discovery or {})},
            "counting": counting or {},
            "logging": {"access_log": False},
            "tokenizers": tokenizers or {},
            "routing": routing or {},
            "tenants": tenants or [],
            "outlier": outlier or {},
            "replica_groups": replica_groups or [],
            "dns": dns or {},
        }
        gw = Gateway(config_from_mapping(data, env={}), host="127.0.0.1", port=0)
        await gw.start()
        made.append((gw, list(servers)))
        if servers:
            await all_replicas_ready(gw)
        return gw

    yield factory

    problems: list[str] = []
    for gw, servers in made:
        drained = await gw.drain(10.0)
        reserved = gw.report.reserved_tokens()
        queued = gw.report.queue_depth()
        waiting = gw.state.door.waiting
        await gw.stop()
        if not drained:
            problems.append(f"{gw.url}: requests still in flight after 10 s")
        if reserved:
            problems.append(f"{gw.url}: {reserved} tokens still reserved after drain")
        if queued or waiting:
            problems.append(f"{gw.url}: {queued} queued / {waiting} waiting after drain")
        for srv in servers:
            if srv.crashed:
                continue
            if not await wait_for(lambda s=srv: s.core.stats().blocks_in_use == 0, within=5.0):
                problems.append(
                    f"replica {srv.url}: {srv.core.stats().blocks_in_use} KV blocks still in use"
                )
    assert not problems, "; ".join(problems)


def left_ctx(arrival: float = 0.0, stream: bool = False, **fields: object) -> RequestContext:
    """An admitted chat request whose client disconnected, as accounting sees it at its
    end, with `fields` set on it."""
    ctx = RequestContext("r", "chat", "/v1/chat/completions", arrival=arrival)
    ctx.req.stream = stream
    ctx.admission_id = "r"
    ctx.outcome = CLIENT_DISCONNECT
    for k, v in fields.items():
        setattr(ctx, k, v)
    return ctx
