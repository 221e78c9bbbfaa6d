"""Closed-loop clients kvgate did not shape, shared by the benches that judge admission
(bench/real_vllm.py, bench/parity_sweep.py).

Two client kinds, the same retries (two) and per-attempt timeout T for both:

sdk
    the official openai SDK, ``AsyncOpenAI(timeout=T, max_retries=2)``, its defaults
    otherwise: it states T in ``x-stainless-read-timeout`` and retries 408/409/429/5xx,
    timeouts and broken connections after Retry-After or its own backoff. For a stream,
    T is httpx's read timeout: it bounds each chunk, not the whole stream.
plain
    aiohttp with a total timeout of T per attempt that it never states (a stream's whole
    response included); 429/503 retried after Retry-After, timeouts, other 5xx and broken
    connections after 0.5 s / 1 s, at most two retries in all.

A request is a chat body (a dict, ``stream`` set for a stream); a completion is valid
when the answer is 200 and whole (a stream: ended by ``[DONE]``, or the SDK's iterator
ran to its end).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
import openai

RETRIES = 2
PLAIN_BACKOFF_S = (0.5, 1.0)  # the openai SDK's first two backoffs, for a plain client


@dataclass
class Outcome:
    """What the clients saw of one contender."""

    requests: int
    completed: int = 0
    timed_out: int = 0  # requests whose last attempt timed out
    failed: int = 0  # requests that ended in any other error
    attempts: int = 0
    attempt_timeouts: int = 0
    shed: int = 0  # 429/503 answers (each retried while retries remain)
    retries: int = 0
    wall_s: float = 0.0
    latencies: list[float] = field(default_factory=list)  # completed: first send to end
    # Seconds from the run's start at which each request that did not complete gave up:
    # a cold start's losses come in the first seconds, a limit held too low's throughout.
    lost_at: list[float] = field(default_factory=list)
    # Seconds from the run's start at which each attempt timed out (the plain client's;
    # the SDK's retries hide theirs): a first wave that waited out a patience kvgate had
    # not yet learned times out together at T, a limit held too low throughout.
    timeout_at: list[float] = field(default_factory=list)
    started: float = 0.0  # the run's start, on time.monotonic()
    errors: list[str] = field(default_factory=list)


class SdkClient:
    """The official openai SDK with its defaults but the timeout. httpx's event hooks see
    every attempt the SDK makes, so its retries and the sheds behind them are counted."""

    def __init__(self, url: str, timeout_s: float, out: Outcome) -> None:
        self.out = out
        self.responses = 0

        async def on_request(_: httpx.Request) -> None:
            out.attempts += 1

        async def on_response(r: httpx.Response) -> None:
            self.responses += 1
            if r.status_code in (429, 503):
                out.shed += 1

        http = openai.DefaultAsyncHttpxClient(
            event_hooks={"request": [on_request], "response": [on_response]}
        )
        self.client = openai.AsyncOpenAI(
            base_url=url + "/v1",
            api_key="bench",
            timeout=timeout_s,
            max_retries=RETRIES,
            http_client=http,
        )

    async def send(self, body: dict[str, Any]) -> bool:
        """Whether the request completed (in any attempt)."""
        known = {"model", "messages", "max_tokens", "stream"}
        extra = {k: v for k, v in body.items() if k not in known}
        try:
            answer = await self.client.chat.completions.create(
                model=body["model"],
                messages=body["messages"],
                max_tokens=body.get("max_tokens", openai.NOT_GIVEN),
                stream=bool(body.get("stream")),
                extra_body=extra or None,
            )
            if body.get("stream"):
                async for _ in answer:  # type: ignore[union-attr]
                    pass
            self.out.completed += 1
            return True
        except (openai.APITimeoutError, httpx.TimeoutException):
            self.out.timed_out += 1  # (a stream's chunk that came too late: httpx's own)
        except (openai.APIError, httpx.HTTPError) as e:
            self.out.failed += 1
            self.out.errors.append(f"{type(e).__name__}: {str(e)[:160]}")
        return False

    async def close(self) -> None:
        await self.client.close()
        self.out.retries = self.out.attempts - self.out.requests
        # An attempt with no answer timed out (or lost its connection: the SDK's errors
        # name which for the last attempt only).
        self.out.attempt_timeouts = self.out.attempts - self.responses


class PlainClient:
    """aiohttp with a total timeout per attempt that it never states."""

    def __init__(self, url: str, timeout_s: float, out: Outcome) -> None:
        self.url, self.out = url, out
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def attempt(self, body: dict[str, Any]) -> tuple[str, float | None]:
        """("done" | "shed" | "timeout" | "error" | "final", seconds to wait before a
        retry)."""
        self.out.attempts += 1
        try:
            async with self.session.post(
                self.url + "/v1/chat/completions", json=body, timeout=self.timeout
            ) as r:
                payload = await r.read()
                if r.status == 200:
                    if body.get("stream") and b"data: [DONE]" not in payload:
                        self.out.errors.append("stream ended without [DONE]")
                        return "error", None
                    return "done", None
                if r.status in (429, 503):
                    self.out.shed += 1
                    return "shed", retry_after_s(r.headers.get("Retry-After"))
                self.out.errors.append(f"HTTP {r.status}: {payload[:160].decode(errors='replace')}")
                return ("error" if r.status >= 500 else "final"), None
        except TimeoutError:
            self.out.attempt_timeouts += 1
            self.out.timeout_at.append(round(time.monotonic() - self.out.started, 2))
            return "timeout", None
        except aiohttp.ClientError as e:
            self.out.errors.append(f"{type(e).__name__}: {e}")
            return "error", None

    async def send(self, body: dict[str, Any]) -> bool:
        """Whether the request completed (in any attempt)."""
        for retry in range(RETRIES + 1):
            kind, wait = await self.attempt(body)
            if kind == "done":
                self.out.completed += 1
                return True
            if kind == "final" or retry == RETRIES:
                break
            self.out.retries += 1
            await asyncio.sleep(wait if wait is not None else PLAIN_BACKOFF_S[retry])
        if kind == "timeout":
            self.out.timed_out += 1
        else:
            self.out.failed += 1
        return False

    async def close(self) -> None:
        await self.session.close()


def retry_after_s(raw: str | None) -> float | None:
    """A plain client reads Retry-After (seconds) and nothing kvgate-specific."""
    try:
        return max(0.0, float(raw)) if raw is not None else None
    except ValueError:
        return None


CLIENTS = {"sdk": SdkClient, "plain": PlainClient}


async def drive(client: Any, bodies: list[dict[str, Any]], concurrency: int, out: Outcome) -> None:
    """A closed loop: `concurrency` workers, each sends its next request when one ends."""
    queue = list(reversed(bodies))
    loop = asyncio.get_running_loop()

    async def worker() -> None:
        while queue:
            body = queue.pop()
            t0 = loop.time()
            # Its own answer, not the shared count: another worker may complete meanwhile.
            if await client.send(body):
                out.latencies.append(loop.time() - t0)
            else:
                out.lost_at.append(round(time.monotonic() - out.started, 2))

    t0 = out.started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    out.wall_s = time.monotonic() - t0
