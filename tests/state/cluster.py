"""Helpers for the multi-process tests: real ``kvgate serve`` processes sharing one
Redis, a load client, and readers of Redis and ``/admin/state``."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import aiohttp
import pytest
import yaml

from gateway.state.redis import RedisBackend
from tests.state.conftest import ROOT, free_port

MODEL = "tiny-llm"
ADMIN = "admin-secret"
BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "count to sixty four"}],
    "max_tokens": 64,
    "ignore_eos": True,
}


@dataclass
class Node:
    proc: asyncio.subprocess.Process
    url: str
    log: Path


def config(
    redis_url: str | None, prefix: str, replicas: list[dict[str, Any]], **state: Any
) -> dict[str, Any]:
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "replicas": replicas,
        "admission": {"queue_timeout_s": 20.0, "learn_limit": False},
        "discovery": {"refresh_interval_s": 0.2, "probe_timeout_s": 0.5},
        "auth": {"admin_token": ADMIN},
        "logging": {"access_log": False},
        # No listen grace: a stop need not keep answering 503 for load balancers (2 s by
        # default; tests/gateway/test_shutdown.py tests it), so a test's processes stop in
        # the time their drain takes.
        "shutdown": {"drain_grace_s": 5.0, "listen_grace_s": 0.0},
        "state": {
            "backend": "redis",
            "redis_url": redis_url,
            "key_prefix": prefix,
            "lease_ttl_s": 1.5,
            "renew_interval_s": 0.25,
            "timeout_s": 0.3,
            **state,
        },
    }


def child_env() -> dict[str, str]:
    """The environment for a ``kvgate serve`` child: without the state overrides that
    scripts/test.sh exports (KVGATE_REDIS_URL would win over the test's own config)."""
    drop = {"KVGATE_REDIS_URL", "KVGATE_REDIS_PASSWORD", "KVGATE_STATE_BACKEND"}
    return {k: v for k, v in os.environ.items() if k not in drop}


async def start(tmp_path: Path, cfg: dict[str, Any], name: str, *extra: str) -> Node:
    port = free_port()
    cfg = {**cfg, "listen": {"host": "127.0.0.1", "port": port}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = tmp_path / f"{name}.log"
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.cli", "serve", "-c", str(path), *extra,
            cwd=ROOT, stdout=out, stderr=out, env=child_env(),
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as s:
        for _ in range(400):
            with contextlib.suppress(aiohttp.ClientError):
                async with s.get(url + "/ready") as r:
                    if r.status == 200:
                        return Node(proc, url, log)
            if proc.returncode is not None:
                break
            await asyncio.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    await proc.wait()
    pytest.fail(f"kvgate serve {name} did not become ready: " + log.read_text())


async def start_all(tmp_path: Path, cfg: dict[str, Any], names: list[str]) -> list[Node]:
    """`start` for each name, all at once (each spends most of a second importing and
    probing the replica); the nodes in the order of `names`. If one fails, the others
    that started are stopped before its error is raised."""
    got = await asyncio.gather(*(start(tmp_path, cfg, n) for n in names), return_exceptions=True)
    nodes = [g for g in got if isinstance(g, Node)]
    failed = [g for g in got if not isinstance(g, Node)]
    if failed:
        await asyncio.gather(*(stop(n) for n in nodes))
        raise failed[0]
    return nodes


async def stop(node: Node) -> int | None:
    if node.proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            node.proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(15):
                return await node.proc.wait()
        except TimeoutError:
            node.proc.kill()
            await node.proc.wait()
            return None
    return node.proc.returncode


async def admin_state(s: aiohttp.ClientSession, node: Node) -> dict[str, Any]:
    async with s.get(node.url + "/admin/state", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
        assert r.status == 200
        return await r.json()


async def states_when(
    s: aiohttp.ClientSession,
    nodes: list[Node],
    ok: Callable[[list[dict[str, Any]]], bool],
    what: str,
    tries: int = 200,
) -> list[dict[str, Any]]:
    """Poll every node's /admin/state until `ok` holds of them all; they are returned.
    AssertionError naming `what` (and the last states) if it never does."""
    states: list[dict[str, Any]] = []
    for _ in range(tries):
        states = [await admin_state(s, n) for n in nodes]
        if ok(states):
            return states
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what}: {states}")


def all_see(count: int) -> Callable[[list[dict[str, Any]]], bool]:
    """`states_when` condition: every node counts `count` live processes."""
    return lambda states: all(st["processes"] == count for st in states)


@dataclass
class RpmPress:
    """Clients of a rate-limited tenant that come back exactly when a 429 says (at most a
    second later), until `until` (or `stop_at`, if sooner); the times of the answers that
    passed, by node, and of the refusals."""

    body: dict[str, Any]
    headers: dict[str, str]
    ok_at: list[float] = field(default_factory=list)
    per_node: dict[str, int] = field(default_factory=dict)
    limited: int = 0
    refused_at: list[tuple[float, str]] = field(default_factory=list)  # (time, node url)
    stop_at: float = math.inf

    async def client(self, s: aiohttp.ClientSession, node: Node, until: float) -> None:
        loop = asyncio.get_running_loop()
        url = node.url + "/v1/chat/completions"
        for _ in range(5000):
            if loop.time() >= min(until, self.stop_at):
                return
            async with s.post(url, json=self.body, headers=self.headers) as r:
                await r.read()
                if r.status == 200:
                    self.ok_at.append(loop.time())
                    self.per_node[node.url] = self.per_node.get(node.url, 0) + 1
                else:
                    assert r.status == 429, r.status
                    assert (await r.json())["error"]["code"] == "rate_limit_exceeded"
                    assert "retry-after-ms" in r.headers, await admin_state(s, node)
                    self.limited += 1
                    self.refused_at.append((loop.time(), node.url))
                    # Back exactly when it would pass, as a well-behaved client is.
                    await asyncio.sleep(min(1.0, int(r.headers["retry-after-ms"]) / 1000))

    async def steady_window(
        self,
        s: aiohttp.ClientSession,
        nodes: list[Node],
        clients: int,
        window: float,
        settle: float = 1.5,
        within: float = 10.0,
    ) -> tuple[float, float]:
        """Press `nodes` with `clients` clients (spread over them in turn) until every node
        has refused one (the burst its bucket held is spent: at most `within` s), then
        `settle` s more, then `window` s; the (start, end) of that steady window.

        The warm-up ends when the burst is spent, however fast this machine spends it,
        not after a fixed time sized for the slowest. If a node never refuses (a limit
        that does not bind), the window starts after `within` s and what it counts shows
        the excess."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        urls = {n.url for n in nodes}
        self.stop_at = math.inf
        tasks = [
            asyncio.create_task(self.client(s, nodes[i % len(nodes)], math.inf))
            for i in range(clients)
        ]
        try:
            while loop.time() < began + within and not any(task.done() for task in tasks):
                if urls <= {url for at, url in self.refused_at if at >= began}:
                    break
                await asyncio.sleep(0.05)
            start = loop.time() + settle
            self.stop_at = start + window
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        return start, start + window

    def within(self, start: float, end: float) -> int:
        return sum(1 for t in self.ok_at if start <= t < end)


@dataclass
class Load:
    """Closed-loop clients spread over the nodes; counts every answer by status."""

    statuses: dict[int, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)  # connection errors, by node
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def client(self, s: aiohttp.ClientSession, node: Node, limit: int) -> None:
        for _ in range(limit):
            if self.stop.is_set():
                return
            try:
                async with s.post(node.url + "/v1/chat/completions", json=BODY) as r:
                    await r.read()
                    self.statuses[r.status] = self.statuses.get(r.status, 0) + 1
                    if r.status == 503:  # shed: back off as told
                        await asyncio.sleep(min(1.0, float(r.headers.get("Retry-After", 1))))
            except (TimeoutError, aiohttp.ClientError):
                self.errors[node.url] = self.errors.get(node.url, 0) + 1
                return  # its node is gone


async def lease_records(redis_url: str, prefix: str, resource: str) -> dict[str, Any]:
    b = RedisBackend(redis_url, prefix=prefix)
    try:
        return await b.holders(resource)
    finally:
        await b.close()


class Sampler:
    """A background task sampling something until the ``with`` block ends (`_run`)."""

    _task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
