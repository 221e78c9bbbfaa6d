"""The server as the vLLM-flavor route modules see it, and how they run a request on it.

`enginesim.agent_api` and `enginesim.serving_api` serve their routes for an
`enginesim.server.EngineServer`, which builds them. They need only the few members named
by `Host` (this module's protocol), so they import this module and never the server: the
imports point one way, from the server to its route modules to here.

Every generating or pooling request goes through the server's own chat-path steps
(`Host.prepared`, `Host.submitted`, `Host.batches`): it queues, takes KV, streams at the
simulated pace, is aborted in the core when its client goes away, honours the `drop`
fault, and counts in /metrics exactly as a chat completion does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Literal, NoReturn, Protocol

from aiohttp import web

from enginesim.api import ApiError, Prepared, SamplingRequest
from enginesim.driver import RequestHandle
from enginesim.types import EngineEvent, EventKind

if TYPE_CHECKING:
    from enginesim.profiles import Profile

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class Host(Protocol):
    """What the route modules use of the `EngineServer` that serves them."""

    profile: Profile
    core: object  # read for `enable_prefix_caching` (the engine's prefix cache)

    def check_model(self, model: str | None) -> str:
        """The model a request is served as: the base, or a LoRA adapter it names (404
        otherwise)."""
        ...

    def prepared(
        self,
        request: web.Request,
        req: SamplingRequest,
        kind: Literal["chat", "completion"],
        model: str,
        prompt_text: str,
        prompt_ids: list[int],
        max_tokens: int,
        public_id: str | None = None,
    ) -> Prepared:
        """A checked request ready for the core, under `public_id` if given."""
        ...

    def submitted(self, prep: Prepared) -> contextlib.AbstractAsyncContextManager[RequestHandle]:
        """The request in the core for the block's duration; every way out ends it."""
        ...

    def batches(
        self, request: web.Request, prep: Prepared, handle: RequestHandle
    ) -> AsyncIterator[tuple[list[int], EngineEvent | None]]:
        """The request's output step by step: (new token ids, terminal event or None)."""
        ...

    def drop(self, request: web.Request, prep: Prepared) -> NoReturn:
        """The `drop` fault: abort the request and close the connection under the client."""
        ...


async def run_to_end(
    server: Host, request: web.Request, prep: Prepared, handle: RequestHandle
) -> tuple[list[int], EngineEvent]:
    """A non-stream request's output tokens and terminal event."""
    ids: list[int] = []
    final: EngineEvent | None = None
    async for batch, end in server.batches(request, prep, handle):
        ids.extend(batch)
        final = end
    assert final is not None  # noqa: S101
    if final.kind is EventKind.ABORTED:
        raise ApiError(500, "the engine aborted the request")
    return ids, final


async def prefill_together(
    server: Host,
    request: web.Request,
    req: SamplingRequest,
    model: str,
    rid: str,
    prompts: list[tuple[str, list[int]]],
) -> list[Prepared]:
    """Each (text, ids) prompt as a prefill-only core request `<rid>-<i>`, run together."""
    preps: list[Prepared] = []
    for i, (text, ids) in enumerate(prompts):
        prep = server.prepared(request, req, "completion", model, text, ids, 0, f"{rid}-{i}")
        prep.sim.prefill_only = True
        preps.append(prep)
    async with contextlib.AsyncExitStack() as stack:
        handles = [await stack.enter_async_context(server.submitted(p)) for p in preps]
        await asyncio.gather(
            *(run_to_end(server, request, p, h) for p, h in zip(preps, handles, strict=True))
        )
    return preps


async def open_sse(request: web.Request) -> web.StreamResponse:
    """A server-sent-events response, its headers sent."""
    resp = web.StreamResponse(status=200, headers=_SSE_HEADERS)
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    return resp
