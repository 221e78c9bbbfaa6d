"""The prompt's token ids, chained in blocks, for the precise prefix index
(routing.kvindex): only for a model some replica of which publishes its KV events.

The chain must be of exactly the ids the engine hashes, chat template included, which
kvgate does not render; so the ids come from the engine itself: vLLM's ``POST
/tokenize`` with the chat request's ``messages``, ``tools`` and template options (or the
completion's ``prompt``), remembered per digest of that body. A completions prompt of
token ids is its own answer. Any failure leaves the request without a chain: routing
then uses the approximate index, never an error.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict
from typing import Any

import aiohttp

from gateway.config import GatewayConfig, expand_data_parallel
from gateway.context import RequestContext
from gateway.counting import TEMPLATE_FIELDS
from gateway.fleet.discovery import Discovery
from gateway.schemas import CompletionRequest
from routing.kvindex import KVIndex, token_block_hashes

log = logging.getLogger("kvgate.kvtokens")

CACHE_ENTRIES = 2048


class PromptTokenIds:
    """Fills ``ctx.req.token_hashes`` / ``token_block_size`` (module docstring)."""

    def __init__(
        self,
        config: GatewayConfig,
        discovery: Discovery,
        session: aiohttp.ClientSession,
        kv: KVIndex,
    ) -> None:
        self._discovery = discovery
        self._session = session
        self._kv = kv
        self._timeout = aiohttp.ClientTimeout(total=config.upstream.tokenize_timeout_s)
        served = expand_data_parallel(config.replicas)
        self._names = [rc.name for rc in served if rc.kv_events is not None]
        self._cache: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._turn = 0
        self.asked = self.failed = 0

    async def fill(self, ctx: RequestContext) -> None:
        watchers = self._discovery.watchers
        names = [
            n
            for n in self._names
            if n in watchers
            and watchers[n].state.ready
            and ctx.req.model in watchers[n].state.models
        ]
        sizes = self._kv.block_sizes(names)
        if not sizes:
            return
        ids = await self._ids(ctx, names)
        if ids:
            size = min(sizes)
            ctx.req.token_hashes = token_block_hashes(ids, size)
            ctx.req.token_block_size = size

    async def _ids(self, ctx: RequestContext, names: list[str]) -> tuple[int, ...] | None:
        body: dict[str, Any] = ctx.body or {}
        prompt = body.get("prompt")
        if isinstance(ctx.parsed, CompletionRequest):
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return tuple(prompt)
            if not isinstance(prompt, str):
                return None  # batched prompts: no single chain
            out: dict[str, Any] = {"model": ctx.req.model, "prompt": prompt}
        else:
            out = {"model": ctx.req.model, "messages": body.get("messages", [])}
            if body.get("tools"):
                out["tools"] = body["tools"]
            for k in TEMPLATE_FIELDS:
                if k in body:
                    out[k] = body[k]
        data = json.dumps(out).encode()
        key = hashlib.blake2b(data, digest_size=16).digest()
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        self._turn += 1
        w = self._discovery.watchers[names[self._turn % len(names)]]
        headers = {"Content-Type": "application/json"}
        if w.config.api_key:
            headers["Authorization"] = f"Bearer {w.config.api_key}"
        self.asked += 1
        try:
            async with self._session.post(
                w.config.url + "/tokenize", data=data, headers=headers, timeout=self._timeout
            ) as r:
                answer = await r.json(content_type=None) if r.status == 200 else None
            tokens = answer.get("tokens") if isinstance(answer, dict) else None
            if not isinstance(tokens, list):
                raise ValueError("no tokens in the answer")
            ids = tuple(int(t) for t in tokens)
        except (aiohttp.ClientError, TimeoutError, ValueError, TypeError):
            self.failed += 1
            return None
        self._cache[key] = ids
        if len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return ids
