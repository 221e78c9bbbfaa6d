"""Routing profiles through kvgate against enginesim replicas: a prefix-aware profile
keeps an agentic session on the replica whose cache holds its history, and a request
every filter rejects does not hold up the others."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
import pytest

from routing.plugin import PluginEnv
from routing.registry import register
from routing.types import Candidate, RouteRequest
from tests.gateway.conftest import MODEL, wait_for

PREFIX_PROFILE = {
    "block_chars": 32,
    "default_profile": {
        "scorers": [
            {"name": "prefix_cache", "weight": 2.0},
            {"name": "session_affinity", "weight": 1.0},
            {"name": "running_headroom", "weight": 1.0},
        ]
    },
}

SYSTEM = (
    "You are a coding agent. Tools: read_file(path), write_file(path, text), "
    "run_tests(), search(query). Think step by step and call one tool per turn. "
) * 6


def hits(servers: Sequence[Any]) -> list[tuple[int, int]]:
    """(prefix-cache hit tokens, queried tokens) of each replica, from the engine's stats
    (what its /metrics exports as vllm:prefix_cache_hits / _queries)."""
    out = []
    for srv in servers:
        st = srv.core.stats()
        out.append((st.prefix_cache_hits, st.prefix_cache_queries))
    return out


async def test_prefix_hits_rise_for_an_agentic_session(replica, gateway):
    servers = [await replica(speed=50.0), await replica(speed=50.0)]
    gw = await gateway(*servers, routing=PREFIX_PROFILE)
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    turn_hits: list[tuple[int, int]] = []
    served_by: list[int] = []
    async with aiohttp.ClientSession() as s:
        for turn in range(5):
            messages.append({"role": "user", "content": f"Step {turn}: fix the next failing test."})
            before = hits(servers)
            async with s.post(
                gw.url + "/v1/chat/completions",
                json={"model": MODEL, "messages": messages, "max_tokens": 24},
            ) as r:
                assert r.status == 200, await r.text()
                reply = (await r.json())["choices"][0]["message"]["content"]
            after = hits(servers)
            delta = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before, strict=True)]
            served_by.append(max(range(2), key=lambda i: delta[i][1]))
            turn_hits.append(delta[served_by[-1]])
            messages.append({"role": "assistant", "content": reply})
    # One replica served the whole session, and from the second turn on most of each
    # prompt (system prompt and history, generated blocks included) came from its cache.
    assert len(set(served_by)) == 1, served_by
    assert turn_hits[0][0] == 0
    for got, queried in turn_hits[1:]:
        assert got >= 0.7 * queried, turn_hits
    assert [h for h, _ in turn_hits] == sorted(h for h, _ in turn_hits)  # hits rise
    scorer = gw.door.router.default.scorers[0][0]  # type: ignore[attr-defined]
    assert 0 < scorer.indexed_blocks() <= 2 * scorer.max_blocks_per_replica


class _RejectSession:
    """Test filter: keeps no replica for requests of one session."""

    def __init__(self, session: str) -> None:
        self.session = session

    def filter(self, req: RouteRequest, candidates: Sequence[Candidate]) -> list[Candidate]:
        return [] if req.session == self.session else list(candidates)


@register("filter", "test_reject_session")
def _reject(params: Mapping[str, Any], env: PluginEnv) -> _RejectSession:
    return _RejectSession(str(params.get("session", "")))


@pytest.mark.slow
async def test_a_request_every_filter_rejects_does_not_block_others(replica, gateway):
    srv = await replica(speed=50.0)
    gw = await gateway(
        srv,
        routing={
            "default_profile": {
                "filters": [{"name": "test_reject_session", "params": {"session": "banned"}}]
            }
        },
    )
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    async with aiohttp.ClientSession() as s:
        banned = asyncio.create_task(
            s.post(
                gw.url + "/v1/chat/completions",
                json=body,
                headers={"x-session-id": "banned", "x-kvgate-queue-timeout": "3"},
            )
        )
        # The banned request waits at the head of the queue.
        assert await wait_for(lambda: gw.report.queue_depth() == 1)
        for i in range(3):
            async with s.post(gw.url + "/v1/chat/completions", json={**body, "user": f"u{i}"}) as r:
                assert r.status == 200, await r.text()
        assert gw.report.queue_depth() == 1
        resp = await banned
        assert resp.status == 503
        assert (await resp.json())["error"]["code"]
        resp.release()


async def test_workload_classes_and_routing_reasons_appear_in_metrics(replica, gateway):
    srv = await replica(speed=50.0)
    gw = await gateway(srv, routing=PREFIX_PROFILE)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    code = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Fix this:\n```py\nx = [1, 2\n```"}],
        "max_tokens": 4,
    }
    async with aiohttp.ClientSession() as s:
        for body, headers in ((chat, {}), (code, {}), (chat, {"x-workload": "agentic"})):
            async with s.post(gw.url + "/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
        async with s.get(gw.url + "/metrics") as r:
            text = await r.text()
    for workload in ("chat", "coding", "agentic"):
        line = f'kvgate_workload_requests_total{{outcome="ok",workload="{workload}"}} 1.0'
        assert line in text, text
    decided = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvgate_routing_decisions_total{")
    ]
    assert sum(decided) == 3, text


SPEC_PROFILE = {
    "default_profile": {
        "scorers": [
            {"name": "speculation", "weight": 2.0, "params": {"crossover_batch": 2}},
            {"name": "running_headroom", "weight": 1.0},
        ]
    }
}
CODE = "Fix this function:\n```python\ndef f(x):\n    return x +\n```\n"


def served(servers: Sequence[Any]) -> list[int]:
    """Prompt tokens each replica has processed (its engine's own counter)."""
    return [srv.core.stats().prompt_tokens for srv in servers]


async def test_coding_goes_to_the_speculating_replica_at_low_load_and_spills_at_high(
    replica, gateway
):
    # The gateway learns which replica speculates from the engine (spec_decode metrics).
    spec = await replica(speed=5.0, speculative=True)
    plain = await replica(speed=5.0, speculative=False)
    gw = await gateway(spec, plain, routing=SPEC_PROFILE)
    body = {"model": MODEL, "messages": [{"role": "user", "content": CODE}], "max_tokens": 8}
    headers = {"x-workload": "coding"}
    async with aiohttp.ClientSession() as s:
        # Low load: one coding request at a time, each on the speculating replica.
        for _ in range(3):
            before = served([spec, plain])
            async with s.post(gw.url + "/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
            after = served([spec, plain])
            assert after[0] > before[0] and after[1] == before[1], (before, after)
        # Chat keeps off the speculating replica.
        before = served([spec, plain])
        chat = {**body, "messages": [{"role": "user", "content": "hello there"}]}
        async with s.post(gw.url + "/v1/chat/completions", json=chat) as r:
            assert r.status == 200
        after = served([spec, plain])
        assert after[1] > before[1] and after[0] == before[0]
        # High load: two long coding streams fill the speculating replica's batch up to
        # the crossover; the next coding request spills to the plain replica.
        long = {**body, "max_tokens": 600, "stream": True}
        streams = [
            await s.post(gw.url + "/v1/chat/completions", json=long, headers=headers)
            for _ in range(2)
        ]

        def running_on_spec() -> int:
            usage = {u.name: u.running for u in gw.report.replica_usage()}
            return usage["r0"]

        assert await wait_for(lambda: running_on_spec() == 2)
        before = served([spec, plain])
        async with s.post(gw.url + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
        after = served([spec, plain])
        assert after[1] > before[1] and after[0] == before[0], (before, after)
        for resp in streams:
            await resp.read()
            resp.release()
        async with s.get(gw.url + "/metrics") as r:
            text = await r.text()
    assert 'kvgate_routing_decisions_total{reason="speculation"} 5.0' in text, text
    assert 'kvgate_routing_decisions_total{reason="spill"} 1.0' in text, text
