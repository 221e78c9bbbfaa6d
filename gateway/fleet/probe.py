"""One probe round of one replica, and why it left the replica not ready, in words.

`fetch_round` GETs the adapter's probe paths and keeps, per path, either the answer
(status, body) or what went wrong (refused, timed out, a TLS or DNS error);
`RoundFetcher` does the same round after round for discovery, keeping a late answer.
The adapter reads only the answers; `explain` reads the rest and the state the adapter
left, and names the first cause an operator can act on:

- the URL ends in ``/v1`` (the ``base_url`` habit): kvgate adds ``/v1/...`` itself;
- a path that could not be fetched (``connection refused``, ``timed out after 2 s``);
- a path that answered an HTTP error (404 on an engine's own path: is this that engine?);
- everything answered but the engine's pool or models are missing (the adapter's
  ``missing_capacity`` words it: ``no vllm:cache_config_info in /metrics: is this vLLM?``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp

from routing.adapters import EngineAdapter
from routing.types import ReplicaState

# path -> (status, body) when it answered, else the failure in words
Outcomes = dict[str, tuple[int, str] | str]

_ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "llamacpp": "llama.cpp's llama-server"}


def failure_words(e: BaseException, timeout_s: float) -> str:
    """A fetch failure as an operator reads it (no library class names)."""
    if isinstance(e, TimeoutError):
        return f"timed out after {timeout_s:g} s"
    if isinstance(e, aiohttp.ClientConnectorDNSError):
        return f"cannot resolve the host ({e.os_error.strerror or e.os_error})"
    if isinstance(e, aiohttp.ClientConnectorError):
        err = e.os_error
        if isinstance(err, ConnectionRefusedError):
            return "connection refused"
        return f"cannot connect ({err.strerror or err})"
    if isinstance(e, aiohttp.ServerDisconnectedError):
        return "the server closed the connection without answering"
    if isinstance(e, aiohttp.ClientResponseError):
        return f"bad HTTP answer ({e.message})"
    return str(e) or type(e).__name__


async def fetch_one(
    session: aiohttp.ClientSession, url: str, headers: Mapping[str, str], timeout_s: float
) -> tuple[int, str] | str:
    """GET `url`: its (status, body), or the failure in words; never raises for a
    network failure."""
    try:
        async with asyncio.timeout(timeout_s):
            async with session.get(url, headers=headers) as r:
                return r.status, await r.text(errors="replace")
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        return failure_words(e, timeout_s)


async def fetch_round(
    session: aiohttp.ClientSession,
    url: str,
    paths: tuple[str, ...],
    headers: Mapping[str, str],
    timeout_s: float,
) -> Outcomes:
    """GET every path of one replica at once; never raises for a network failure."""
    answers = await asyncio.gather(
        *(fetch_one(session, url + p, headers, timeout_s) for p in paths)
    )
    return dict(zip(paths, answers, strict=True))


# A probe answer slower than the round's timeout still counts when it comes: an engine
# busy serving answers /metrics late (vLLM's API server on a loaded CPU took seconds:
# scripts/REAL_ENGINE_NOTES.md), and its preemption counter matters most then. Bounded
# by Prometheus' default scrape timeout: an engine its scraper waits for, kvgate waits for.
LATE_ANSWER_S = 10.0


@dataclass(slots=True, frozen=True)
class Round:
    """One round's outcomes; `asked`: the earliest time an answer used was asked for (the
    answers describe the engine at some moment after it); `waiting`: no verdict, only a
    slow path's next answer is still on its way."""

    outcomes: Outcomes
    asked: float
    waiting: bool = False


class RoundFetcher:
    """One replica's probe GETs, round after round. A GET the round's timeout cut is
    not dropped: it runs on (up to ``LATE_ANSWER_S``) and a later round takes its answer
    instead of asking again. A slow engine's answers so arrive a round late, and feed
    the learned limit; a hung one still fails every round at the round's timeout.

    A path whose last answer came late is slow, not dead: a round still waiting on its
    next GET has no verdict (`Round.waiting`), so a steadily slow engine answers every
    other round and is not failed in between (hysteresis would never see two good rounds
    in a row, and one that started unready would never join). A slow engine that then
    hangs fails once that GET is ``LATE_ANSWER_S`` old."""

    def __init__(
        self, session: aiohttp.ClientSession, url: str, headers: Mapping[str, str]
    ) -> None:
        self._session = session
        self._url = url
        self._headers = dict(headers)
        # path -> (when it was asked, the GET still under way)
        self._pending: dict[str, tuple[float, asyncio.Task[tuple[int, str] | str]]] = {}
        self._slow: set[str] = set()  # paths whose last answer came after its round

    async def round(self, paths: tuple[str, ...], timeout_s: float) -> Round:
        """Every path's outcome within `timeout_s`."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        for path in paths:
            if path not in self._pending:
                get = fetch_one(self._session, self._url + path, self._headers, LATE_ANSWER_S)
                self._pending[path] = (now, asyncio.ensure_future(get))
        await asyncio.wait([self._pending[p][1] for p in paths], timeout=timeout_s)
        outcomes: Outcomes = {}
        asked = now
        for path in paths:
            at, task = self._pending[path]
            if task.done():
                del self._pending[path]
                outcomes[path] = answer = task.result()
                asked = min(asked, at)
                if at < now and not isinstance(answer, str):
                    self._slow.add(path)
                else:
                    self._slow.discard(path)
            else:
                outcomes[path] = failure_words(TimeoutError(), timeout_s)
        missing = [p for p, a in outcomes.items() if isinstance(a, str)]
        # No verdict when nothing but a slow path's next answer is missing (a slow path
        # that failed outright left `_slow` above).
        waiting = bool(missing) and all(p in self._slow for p in missing)
        return Round(outcomes, asked, waiting)

    def close(self) -> None:
        """Cancel the GETs still under way."""
        for _, task in self._pending.values():
            task.cancel()
        self._pending.clear()


def answered(outcomes: Outcomes) -> dict[str, tuple[int, str]]:
    """What the adapter reads: the paths that answered (a missing one is unreachable)."""
    return {p: a for p, a in outcomes.items() if not isinstance(a, str)}


def explain(
    url: str,
    engine: str,
    adapter: EngineAdapter,
    outcomes: Outcomes,
    state: ReplicaState,
) -> str | None:
    """Why this round leaves the replica not ready (None: it is ready)."""
    if state.ready and state.capacity_tokens is not None:
        return None
    if url.rstrip("/").endswith("/v1"):
        root = url.rstrip("/")[: -len("/v1")]
        return f"the URL ends in /v1: give the server's root ({root}); kvgate adds /v1/... itself"
    name = _ENGINE_NAMES.get(engine)
    answered: dict[str, tuple[int, str]] = {}
    for path, a in outcomes.items():
        if isinstance(a, str):
            return f"GET {url}{path}: {a}"
        answered[path] = a
    for path, (status, _body) in answered.items():
        if status != 200:
            why = f"GET {url}{path} answered HTTP {status}"
            if status == 404 and name is not None and path != "/v1/models":
                why += f": is this {name}? (engine: {engine})"
            return why
    if not state.models:
        return f"GET {url}/v1/models lists no model"
    if state.capacity_tokens is None:
        hint = getattr(adapter, "missing_capacity", None)
        return hint or f"the engine reports no KV pool: set pool_tokens (engine: {engine})"
    return f"the engine's answers do not make it ready (engine: {engine})"
