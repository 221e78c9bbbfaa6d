"""Client-side helpers shared by the enginesim server tests (no tests of its own)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


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
