"""Client-side helpers shared by the enginesim server tests (no tests of its own)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

T = TypeVar("T")


def chat_body(content: str = "Say something short.", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], **extra}


def parse_sse(raw: bytes) -> list[Any]:
    """Events of an SSE body; asserts vLLM's framing (`data: ...\\n\\n`, ending in [DONE])."""
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    parts = raw.split(b"\n\n")
    assert parts[-1] == b""
    events: list[Any] = []
    for part in parts[:-1]:
        assert part.startswith(b"data: "), part
        payload = part[len(b"data: ") :]
        events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    assert events.count("[DONE]") == 1
    return events


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Every sample of /metrics as {name{sorted labels}: value} plus {name: value} sums."""
    async with session.get(url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


async def wait_until(predicate: Callable[[], bool], within: float = 5.0) -> None:
    """Poll `predicate` on every loop turn (bounded); fails the test on timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {within}s")
        await asyncio.sleep(0.005)


async def holds_kv_while_running(server: Any, request: Awaitable[T]) -> T:
    """Await `request` in a task: the core holds KV for it meanwhile, and nothing runs or is
    held once it has answered."""
    task = asyncio.create_task(request)
    await wait_until(lambda: server.core.stats().blocks_in_use > 0)
    answer = await task
    stats = server.core.stats()
    assert stats.blocks_in_use == 0 and stats.num_running == 0
    return answer


async def cancel_frees_the_core(server: Any, task: asyncio.Task[Any]) -> None:
    """The client gives up on `task` (its connection closes): the core frees its KV and the
    driver forgets it."""
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: server.core.stats().blocks_in_use == 0)
    assert server.driver.num_in_flight == 0
