"""Where each stored response lives: the Responses API's state is the engine's.

A response created with ``store`` (the API's default) is kept by the replica that made
it; a follow-up that names it (``previous_response_id``), ``GET /v1/responses/{id}``
and ``POST /v1/responses/{id}/cancel`` only work there. kvgate remembers, per response
id, the replica and the tokens of the conversation so far (the follow-up's prompt is
rebuilt from them by the engine, so its KV need counts them). With shared state
(`state.backend: redis`) the map is shared: a process that did not relay a response
asks the backend, so a follow-up reaches the right replica through any gateway process
(a backend that cannot be reached leaves each process with what it saw). Entries expire
after the
retention kvgate assumes of an engine (vLLM keeps stored responses in memory until it
restarts; a restarted replica is a new one to discovery) and the oldest go first past
`max_entries`: the map holds ids and names, never bodies.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Mapping
from typing import NamedTuple

from gateway.context import RequestContext
from gateway.errors import ApiError
from gateway.fleet.discovery import ReplicaWatcher
from gateway.schemas import ResponsesRequest
from gateway.state.backend import StateBackend, StateUnavailable

log = logging.getLogger("kvgate.responses")

# An engine's stored response outlives no restart and kvgate's memory of it need not
# outlive a day of idleness: a follow-up a day later is rare and then answered 404.
RETENTION_S = 86_400.0
MAX_ENTRIES = 100_000


class Stored(NamedTuple):
    replica: str
    tokens: int  # prompt + output of the conversation up to this response
    expires: float


class StoredResponses:
    """Response id -> the replica that stored it (sans-IO: `now` is an argument)."""

    def __init__(self, retention_s: float = RETENTION_S, max_entries: int = MAX_ENTRIES) -> None:
        self._retention = retention_s
        self._max = max_entries
        self._map: OrderedDict[str, Stored] = OrderedDict()
        self._shared: StateBackend | None = None
        self._writes: set[asyncio.Task[None]] = set()

    def share(self, backend: StateBackend) -> None:
        """Share the map with the other gateway processes through `backend`."""
        self._shared = backend

    def __len__(self) -> int:
        return len(self._map)

    def remember(self, response_id: str, replica: str, tokens: int, now: float) -> None:
        self._map[response_id] = Stored(replica, tokens, now + self._retention)
        self._map.move_to_end(response_id)
        while len(self._map) > self._max:
            self._map.popitem(last=False)
        if self._shared is not None:  # written behind the answer, never in its way
            task = asyncio.ensure_future(self._publish(response_id, replica, tokens))
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)

    async def _publish(self, response_id: str, replica: str, tokens: int) -> None:
        assert self._shared is not None
        try:
            await self._shared.put_response(response_id, replica, tokens, self._retention)
        except StateUnavailable as e:
            log.debug("stored response %s not shared: %s", response_id, e)

    async def lookup(self, response_id: str, now: float) -> Stored | None:
        """`holder`, else what another process shared."""
        hit = self.holder(response_id, now)
        if hit is not None or self._shared is None:
            return hit
        try:
            shared = await self._shared.response(response_id)
        except StateUnavailable as e:
            log.debug("stored response %s not looked up: %s", response_id, e)
            return None
        if shared is None:
            return None
        self._map[response_id] = hit = Stored(shared[0], shared[1], now + self._retention)
        return hit

    def holder(self, response_id: str, now: float) -> Stored | None:
        hit = self._map.get(response_id)
        if hit is None:
            return None
        if hit.expires <= now:
            del self._map[response_id]
            return None
        return hit

    def forget(self, response_id: str) -> None:
        self._map.pop(response_id, None)


async def follow_up(
    stored: StoredResponses,
    watchers: Mapping[str, ReplicaWatcher],
    ctx: RequestContext,
    now: float,
) -> None:
    """A follow-up (``previous_response_id``) goes to the replica that stored that
    response (every other replica is avoided), and its prompt counts the conversation
    the engine rebuilds from it. An id kvgate never saw goes where routing puts it (the
    engine answers for it); one whose replica is gone is a 404 that says so."""
    parsed = ctx.parsed
    if not isinstance(parsed, ResponsesRequest) or parsed.previous_response_id is None:
        return
    held = await stored.lookup(parsed.previous_response_id, now)
    if held is None:
        return
    holder = watchers.get(held.replica)
    if holder is None or not holder.state.ready:
        raise ApiError(
            404,
            f"Previous response with id '{parsed.previous_response_id}' not found: the "
            f"replica that stored it ({held.replica}) is "
            + ("gone." if holder is None else "not ready."),
            code="previous_response_not_found",
            param="previous_response_id",
        )
    ctx.req.avoid = frozenset(name for name in watchers if name != held.replica)
    ctx.req.prompt_tokens += held.tokens


def remember_answer(stored: StoredResponses, ctx: RequestContext, replica: str, now: float) -> None:
    """Remember where a completed response is stored (unless the client said ``store``
    false), with the tokens of its conversation so far."""
    if ctx.response_id is None or (ctx.body or {}).get("store") is False:
        return
    tokens = (ctx.usage_prompt or ctx.req.prompt_tokens) + (ctx.usage_completion or 0)
    stored.remember(ctx.response_id, replica, tokens, now)
