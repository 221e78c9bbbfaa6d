"""A batch client that replays a fixed request set at a fixed client concurrency.

This is the client of seed 001's bring-up runs: `concurrency` workers each keep one
request in flight and take the next item when the previous one ends. A request that has
not completed after `timeout_s` is abandoned (the connection is closed, which a
well-behaved engine or gateway treats as an abort) and counts as timed out. With
`retry_shed`, a 429 or 503 answer is retried after its `retry-after-ms` / `Retry-After`,
as the openai SDK does but without a retry cap; each attempt gets a fresh timeout, as the SDK's does.

Every attempt carries the headers the official openai SDKs send: its read timeout
(``x-stainless-read-timeout``) and which retry it is (``x-stainless-retry-count``).
With `max_retries` the client behaves like the SDK's defaults (``max_retries=2``): a
429/503 is retried after its Retry-After when that is at most 60 s, else after the
SDK's own backoff, a timeout is retried too, and a request still failing after its
last retry counts as failed (`failed_after` records how long it took to fail).

Client side only: it speaks HTTP to whatever URL it is given.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp


class ReplayItem(Protocol):
    request_id: str
    messages: list[dict]
    output_tokens: int


@dataclass(slots=True)
class ReplayResult:
    """What one replay run did. Times are in wall seconds of this client."""

    concurrency: int
    requests: int
    completed: int = 0
    timed_out: int = 0
    errors: int = 0  # any other non-2xx answer or broken connection
    shed_retries: int = 0  # 429/503 answers that were retried after Retry-After
    retry_wait_s: float = 0.0  # total time spent honouring Retry-After
    retry_waits: list[float] = field(default_factory=list)  # each Retry-After honoured
    wall_s: float = 0.0
    prompt_tokens: int = 0  # of completed requests, from the engine's usage
    completion_tokens: int = 0
    latencies: list[float] = field(
        default_factory=list
    )  # completed requests, first attempt to answer
    error_samples: list[str] = field(default_factory=list)
    gave_up: int = 0  # items not finished when the run's time limit hit
    ttfts: list[float] = field(default_factory=list)  # streams: attempt start to first token
    itls: list[float] = field(default_factory=list)  # streams: mean gap between tokens
    retries: int = 0  # attempts after the first, for any reason
    failed: int = 0  # items that failed on their last allowed retry (with max_retries)
    failed_after: list[float] = field(default_factory=list)  # first attempt to failure

    @property
    def retries_per_completed(self) -> float:
        return self.retries / self.completed if self.completed else float("inf")

    @property
    def lost(self) -> int:
        return self.requests - self.completed

    def quantile(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        s = sorted(self.latencies)
        return s[min(len(s) - 1, int(q * len(s)))]

    @property
    def tokens_per_s(self) -> float:
        """Aggregate prompt + generated tokens of completed requests per wall second."""
        return (self.prompt_tokens + self.completion_tokens) / self.wall_s if self.wall_s else 0.0


def _retry_after(headers: Any, default: float) -> float:
    """Seconds to wait: ``retry-after-ms`` first (as the openai SDK reads it), then the
    integer ``Retry-After``."""
    for name, scale in (("retry-after-ms", 1e-3), ("Retry-After", 1.0)):
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            return max(0.0, float(raw) * scale)
        except ValueError:
            continue
    return default


async def _read_stream(
    resp: aiohttp.ClientResponse,
    result: ReplayResult,
    sent: float,
    loop: asyncio.AbstractEventLoop,
) -> dict:
    """Read an SSE answer to its end; record TTFT and mean inter-token gap; return usage.
    An error event inside the stream raises ClientPayloadError (counted as an error)."""
    first = last = None
    chunks = 0
    usage: dict = {}
    async for line in resp.content:
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        obj = json.loads(data)
        if "error" in obj:
            raise aiohttp.ClientPayloadError(f"error event in stream: {obj['error']}")
        if obj.get("usage"):
            usage = obj["usage"]
        if obj.get("choices"):
            now = loop.time()
            if first is None:
                first = now
            last = now
            chunks += 1
    if first is not None:
        result.ttfts.append(first - sent)
        if chunks > 1 and last is not None:
            result.itls.append((last - first) / (chunks - 1))
    return usage


def _sdk_backoff(attempt: int) -> float:
    """The openai SDK's retry delay without a usable Retry-After: 0.5 s doubling per
    retry, at most 8 s, less up to 25% jitter."""
    return min(0.5 * 2.0**attempt, 8.0) * (1.0 - 0.25 * random.random())


async def replay(
    base_url: str,
    model: str,
    items: Sequence[ReplayItem],
    *,
    concurrency: int,
    timeout_s: float,
    retry_shed: bool = False,
    retry_after_scale: float = 1.0,
    time_limit_s: float = 3600.0,
    extra_body: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    max_retries: int | None = None,
    read_timeout_header: float | None = None,
    stream: bool = False,
) -> ReplayResult:
    """Replay `items` against `base_url` (an OpenAI-compatible server) and tally the outcome.

    `retry_after_scale` multiplies every Retry-After before sleeping (a simulated engine
    run at `--speed X` behind a gateway still speaks real seconds, so it stays 1.0 there).
    The run stops by itself after `time_limit_s`: workers take no new items and
    in-flight requests are cancelled, counted in `gave_up`. `read_timeout_header` is
    the timeout the client declares in ``x-stainless-read-timeout`` (default
    `timeout_s`; a simulated engine's clock may run faster than the client's).
    With `stream`, responses are streamed and `timeout_s` bounds the wait for each
    chunk (as the SDK's read timeout does), not the whole answer.
    """
    declared = timeout_s if read_timeout_header is None else read_timeout_header
    result = ReplayResult(concurrency=concurrency, requests=len(items))
    url = base_url.rstrip("/") + "/v1/chat/completions"
    queue: asyncio.Queue[ReplayItem] = asyncio.Queue()
    for it in items:
        queue.put_nowait(it)
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    connector = aiohttp.TCPConnector(limit=0)
    loop = asyncio.get_running_loop()
    start = loop.time()
    stop_at = start + time_limit_s

    async def run_item(session: aiohttp.ClientSession, item: ReplayItem) -> None:
        body = {
            "model": model,
            "messages": item.messages,
            "max_tokens": item.output_tokens,
            "ignore_eos": True,
            **({"stream": True, "stream_options": {"include_usage": True}} if stream else {}),
            **(extra_body or {}),
        }
        payload = json.dumps(body).encode()
        first_sent = loop.time()
        attempt = 0

        async def again(wait: float) -> bool:
            """Sleep `wait` and retry, or record the item as failed; False to stop."""
            nonlocal attempt
            if max_retries is not None and attempt >= max_retries:
                result.failed += 1
                result.failed_after.append(loop.time() - first_sent)
                return False
            if loop.time() + wait >= stop_at:
                result.gave_up += 1
                return False
            attempt += 1
            result.retries += 1
            await asyncio.sleep(wait)
            return True

        while True:
            attempt_headers = {
                **hdrs,
                "x-stainless-read-timeout": f"{declared:g}",
                "x-stainless-retry-count": str(attempt),
            }
            try:
                sent = loop.time()
                async with session.post(
                    url,
                    data=payload,
                    headers=attempt_headers,
                    timeout=aiohttp.ClientTimeout(sock_read=timeout_s)
                    if stream
                    else aiohttp.ClientTimeout(total=timeout_s),
                ) as resp:
                    if stream and resp.status == 200:
                        usage = await _read_stream(resp, result, sent, loop)
                        result.completed += 1
                        result.prompt_tokens += int(usage.get("prompt_tokens", 0))
                        result.completion_tokens += int(usage.get("completion_tokens", 0))
                        result.latencies.append(loop.time() - first_sent)
                        return
                    data = await resp.read()
                    if resp.status == 200:
                        usage = json.loads(data).get("usage") or {}
                        result.completed += 1
                        result.prompt_tokens += int(usage.get("prompt_tokens", 0))
                        result.completion_tokens += int(usage.get("completion_tokens", 0))
                        result.latencies.append(loop.time() - first_sent)
                        return
                    if retry_shed and resp.status in (429, 503):
                        wait = _retry_after(resp.headers, -1.0) * retry_after_scale
                        if max_retries is not None and not 0 < wait <= 60:
                            wait = _sdk_backoff(attempt)  # the SDK ignores other values
                        elif wait < 0:
                            wait = 1.0 * retry_after_scale
                        result.shed_retries += 1
                        result.retry_wait_s += wait
                        result.retry_waits.append(wait)
                        if await again(wait):
                            continue
                        return
                    result.errors += 1
                    if len(result.error_samples) < 5:
                        result.error_samples.append(f"{resp.status}: {data[:200]!r}")
                    return
            except TimeoutError:
                result.timed_out += 1
                if max_retries is not None and await again(_sdk_backoff(attempt)):
                    continue
                return
            except aiohttp.ClientError as e:
                result.errors += 1
                if len(result.error_samples) < 5:
                    result.error_samples.append(repr(e))
                return

    async def worker(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            item = queue.get_nowait()
            remaining = stop_at - loop.time()
            if remaining <= 0:
                result.gave_up += 1
                continue
            try:
                await asyncio.wait_for(run_item(session, item), remaining)
            except TimeoutError:
                result.gave_up += 1

    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    result.wall_s = loop.time() - start
    return result
