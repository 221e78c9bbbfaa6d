"""Count, do not guess, before saying no: prompt token counts for admission.

Admission sizes a request's KV reservation, and refuses what can never fit, from its
prompt token count. The count comes from the cheapest source that is good enough:

1. **Token ids** (a completions prompt of ids): exact, free.
2. **The engine's count of a prefix** (chat, `gateway.prefixcount`): a conversation
   resends its history, and the engine counted the last turn's whole prompt (its
   ``usage.prompt_tokens``, stored by the account stage under the turn's digest chain)
   or a replica's tokenize endpoint counted it. A prompt whose every message a count
   covers is exact (a client's retry, a repeated prompt); one that extends a counted
   prefix is that count plus the estimate of the messages after it (3), not exact but
   wrong by at most the tail's error.
3. **A local tokenizer** (``tokenizers:`` in the config): the text is counted exactly,
   in process. Long texts (a shared system prompt, the earlier turns of a growing
   conversation) are counted once and remembered per (model, digest of that text).
4. **The estimate**: characters / the learned chars-per-token, plus the template's
   per-message overhead, plus a fixed allowance per media part (`gateway.prompt`).
   A short prompt, or a short tail after a counted prefix, costs no more than this: no
   network call.
5. **The replica's own count** (`should_count`), when what no count covers is estimated
   at ``INLINE_COUNT_TOKENS`` (512) or more and at 1/8 of the prompt or more (a first
   turn, a long new document: the estimate's error would be hundreds of tokens of KV,
   over 5% of the prompt; chat and completions, not the pooling endpoints, whose
   batches of inputs hold no KV past their prefill), or the request is *near a limit*
   (prompt + max_tokens within ``NEAR_LIMIT_MARGIN`` of the smallest ``max_model_len``
   serving the model, or its KV need within that margin of the largest pool): one call,
   bounded by ``upstream.tokenize_timeout_s``, to the tokenize endpoint of one ready
   replica serving the model, taken in turn:

   - vLLM (and enginesim): ``POST /tokenize`` with the chat request's ``messages``,
     ``tools`` and template options (the engine applies its chat template), or with the
     completion ``prompt``; the answer's ``count`` is exactly what the engine will count.
   - llama.cpp: ``POST /apply-template`` (chat) then ``POST /tokenize`` with
     ``add_special`` (two loopback calls under the same bound).
   - SGLang serves ``/tokenize`` for a plain ``prompt`` only (no chat template): exact
     for completions; for chat it counts the rendered text, a lower bound (see 6).
   - ``openai`` engines have no tokenize endpoint: nothing is asked.

   For a model served by an engine that does not preempt (llama.cpp), every request
   counts as near a limit: admission reserves the worst case there and an overrun fails
   every running request, so the estimate (which may be low: the starting 3.0 characters
   per token is not conservative for every tokenizer) is never trusted.

   Requests with media parts are not sent: the engine would fetch and process the
   media just to count. Answers are remembered per (engine, model, digest of the
   request), so a client's retry of a request kvgate shed is not counted twice. A
   replica that answers 404/405/501 (or in another shape) is not asked again for five
   minutes; one that answers 5xx, times out or refuses the connection, for ten seconds;
   another 4xx refuses only that request. A failed count is never retried: the request
   goes on with its estimate.

6. **A text count without the template** (a local tokenizer or SGLang, for chat): the
   text's tokens are exact but the template's overhead is the configured guess. Such a
   count is treated as exact (refusable) when the guess cannot change the verdict: the
   request fits with the overhead counted, or is over every limit with no overhead at
   all. In between, and whenever media allowances are part of the count, it is not.

Only an exact count may be refused (invariant 4). An estimate over every limit is
forwarded with its reservation clamped to what fits, and the engine's own 400 answers
(see `admission.controller`).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
from dataclasses import dataclass
from typing import Any, NamedTuple

import aiohttp

from admission.fit import FitLimits, can_ever_fit, reservation
from admission.learned.estimate import TokenEstimator
from admission.report import AdmissionReport
from gateway.config import GatewayConfig
from gateway.context import RequestContext
from gateway.fleet.discovery import Discovery, ReplicaWatcher
from gateway.metrics import GatewayMetrics
from gateway.prefixcount import Lru, PrefixCounts, prompt_chain
from gateway.prompt import PromptShape, chat_shape
from gateway.schemas import (
    AudioRequest,
    ChatCompletionRequest,
    CompletionRequest,
    PoolingRequest,
)

log = logging.getLogger("kvgate.counting")

# Engines whose servers count prompts for us (the endpoints are in the module docstring).
TOKENIZE_ENGINES = frozenset({"vllm", "sglang", "llamacpp"})
# Chat-completion fields that change what vLLM's chat template renders.
TEMPLATE_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
)
_UNSUPPORTED = frozenset({404, 405, 501})
_UNSUPPORTED_PAUSE_S = 300.0
_FAILURE_PAUSE_S = 10.0
_LOCAL_CACHE_MIN_CHARS = 512  # shorter texts are cheaper to count than to hash
# Chat prompts of fewer characters are not chained (gateway/prefixcount.py): their
# estimate's error is a few tokens, less than the hashing is worth.
_CHAIN_MIN_CHARS = 512
# A prompt is counted on a replica before admission (inline) when the part of it no count
# covers is estimated at INLINE_COUNT_TOKENS or more and at INLINE_COUNT_SHARE of the
# prompt or more. The estimate overstates text by its characters-per-token error, taken
# here as 40% of the estimate (the cold 3.0 on seed 2's text; measured: docs/counting.md),
# so an uncounted part under 1/8 of the prompt keeps the prompt's count within 5% of
# exact, and one under 512 tokens wastes at most ~200 tokens of KV.
INLINE_COUNT_TOKENS = 512
INLINE_COUNT_SHARE = 1 / 8
# A request whose estimate comes within this share of a limit (the smallest max_model_len
# serving its model, the largest pool) is counted exactly: an estimate's usual miss could
# turn the verdict there, and farther off counting costs a call for nothing.
NEAR_LIMIT_MARGIN = 0.1
# What else changes the count of the same messages: the chain's first digest covers them.
_CHAIN_FIELDS = (*TEMPLATE_FIELDS, "truncate_prompt_tokens")


def _pause_after(e: Exception) -> float:
    """How long not to ask a replica again after a failed count: long when it does not
    serve the endpoint (404, 405, 501) or answers in another shape; short when it is in
    trouble (5xx, timeout, connection); not at all when it refused this one request
    (another 4xx), which says nothing about the next."""
    if isinstance(e, _Failed):
        if e.status in _UNSUPPORTED:
            return _UNSUPPORTED_PAUSE_S
        return _FAILURE_PAUSE_S if e.status is None or e.status >= 500 else 0.0
    if isinstance(e, ValueError | KeyError | TypeError):
        return _UNSUPPORTED_PAUSE_S
    return _FAILURE_PAUSE_S


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


# ====================================================================== limits (pure)
class Limits(NamedTuple):
    """The known limits of the replicas serving one model (build with `Limits.of`)."""

    replicas: tuple[FitLimits, ...] = ()
    shortest: int | None = None  # the smallest max_model_len
    largest: int | None = None  # the largest effective pool
    always: bool = False  # some replica does not preempt: count every prompt exactly

    @classmethod
    def of(cls, replicas: tuple[FitLimits, ...]) -> Limits:
        lens = [r.max_model_len for r in replicas if r.max_model_len is not None]
        pools = [r.pool for r in replicas if r.pool is not None]
        always = any(not r.preempts for r in replicas)
        return cls(replicas, min(lens, default=None), max(pools, default=None), always)

    def fits(self, prompt: int, max_tokens: int, output: int) -> bool:
        """Some replica can ever hold it (True when no limit is known)."""
        return not self.replicas or any(
            can_ever_fit(r, prompt, max_tokens, reservation(r, prompt, output, max_tokens, True))
            for r in self.replicas
        )

    def near(self, prompt: int, max_tokens: int, output: int, margin: float) -> bool:
        """Within `margin` of (or over) the smallest context or the largest pool; always
        when a replica serving the model does not preempt."""
        if self.always:
            return True
        keep = 1.0 - margin
        if self.shortest is not None and prompt + max_tokens >= keep * self.shortest:
            return True
        return self.largest is not None and max(1, prompt) + output >= keep * self.largest


def limits_for(report: AdmissionReport, model: str) -> Limits:
    """The limits of every replica that lists `model`, as admission holds them (the
    measured pool, private slots and headroom included: `admission.fit`)."""
    return Limits.of(report.fit_limits(model))


# ====================================================================== the counter
@dataclass(slots=True)
class Measured:
    """What `PromptCounter.measure` learned of a request's prompt."""

    text: str  # for the classifier
    limits: Limits
    shape: PromptShape | None = None  # chat requests
    media_tokens: int = 0
    # Exact tokens of the rendered text without the chat template (a lower bound of what
    # the engine counts), when a tokenizer counted the text but not the template.
    floor: int | None = None
    # Estimated tokens of the part of the prompt no count covers (all of it without a
    # counted prefix; the tail after one; 0 when counted): what an inline count fixes.
    uncounted: int = 0


class _Failed(Exception):
    def __init__(self, status: int | None, reason: str) -> None:
        super().__init__(reason)
        self.status = status


class PromptCounter:
    """Fills a request's prompt count: estimated, counted locally, or asked of a replica."""

    def __init__(
        self,
        config: GatewayConfig,
        estimator: TokenEstimator,
        discovery: Discovery,
        report: AdmissionReport,
        metrics: GatewayMetrics,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        cfg = config.counting
        self._cfg = cfg
        self._estimator = estimator
        self._discovery = discovery
        self._report = report
        self._metrics = metrics
        self._session = session if cfg.replica_tokenize else None
        self._timeout = config.upstream.tokenize_timeout_s
        self._overhead = config.admission.per_message_overhead_tokens
        self._cache = Lru(cfg.cache_entries)
        # Engine counts of conversation prefixes, from usage and tokenize answers.
        self.prefixes = PrefixCounts(cfg.cache_entries)
        self._turn = itertools.count()
        self._paused: dict[str, float] = {}  # replica -> loop time until which it is not asked
        # model -> (the watchers' updated_at when computed, limits): limits change only
        # when an adapter applies a discovery round, which stamps updated_at.
        self._limits: dict[str, tuple[tuple[float, ...], Limits]] = {}

    # ------------------------------------------------------------------ no IO
    def measure(self, ctx: RequestContext) -> Measured:
        """Fill the context's prompt fields from characters, token ids or a local tokenizer."""
        parsed = ctx.parsed
        est = self._estimator
        model = ctx.req.model
        local = est.has_tokenizer(model)
        limits = self._limits_of(model)
        if isinstance(parsed, ChatCompletionRequest):
            shape = chat_shape(parsed)
            cfg = self._cfg
            media = shape.media_tokens(cfg.image_part_tokens, cfg.audio_part_tokens)
            ctx.num_messages = shape.messages
            ctx.prompt_chars = shape.chars
            ctx.prompt_countable = shape.countable
            ctx.req.prompt_exact = False
            m = Measured(shape.text, limits, shape, media)
            prefix = None
            if shape.countable and shape.chars >= _CHAIN_MIN_CHARS:
                chain = prompt_chain(parsed, ctx.kind, _CHAIN_FIELDS)
                if chain is not None:
                    prefix = ctx.prefix = self.prefixes.lookup(model, chain, shape.message_chars)
                    if prefix.whole:  # the engine counted this very prompt before
                        ctx.req.prompt_tokens = max(1, prefix.tokens)
                        ctx.req.prompt_exact = True
                        self._metrics.count_prompt_count("cache")
                        return m
            if local:
                m.floor = sum(self._count_local(model, p) for p in shape.pieces if p)
                ctx.req.prompt_tokens = m.floor + shape.messages * self._overhead + media
            elif prefix is not None and prefix.counted:
                # The counted prefix, and an estimate of the messages after it.
                tail = est.prompt_tokens(model, prefix.tail_chars, prefix.tail_messages)
                ctx.req.prompt_tokens = prefix.tokens + tail
                m.uncounted = tail
                self._metrics.count_prompt_count("prefix")
            else:
                ctx.req.prompt_tokens = (
                    est.prompt_tokens(model, shape.chars, shape.messages) + media
                )
                m.uncounted = ctx.req.prompt_tokens if shape.countable else 0
            return m
        if isinstance(parsed, AudioRequest):  # audio: the allowance, never a text count
            ctx.num_messages = ctx.prompt_chars = 0
            ctx.prompt_countable = ctx.req.prompt_exact = False
            ctx.req.prompt_tokens = self._cfg.audio_part_tokens
            return Measured("", limits, media_tokens=ctx.req.prompt_tokens)
        assert isinstance(parsed, CompletionRequest | PoolingRequest)
        text, ids = parsed.prompt_parts()
        ctx.num_messages = 0
        ctx.prompt_chars = len(text)
        ctx.prompt_countable = True
        if ids is not None:
            ctx.req.prompt_exact = True
            ctx.req.prompt_tokens = max(1, ids)
        elif local:
            ctx.req.prompt_exact = True
            ctx.req.prompt_tokens = max(1, self._count_local(model, text))
        else:
            ctx.req.prompt_exact = False
            ctx.req.prompt_tokens = est.prompt_tokens(model, len(text), 0)
            if isinstance(parsed, CompletionRequest):  # pooling: counted near a limit only
                return Measured(text, limits, uncounted=ctx.req.prompt_tokens)
        return Measured(text, limits)

    def _limits_of(self, model: str) -> Limits:
        stamp = tuple(w.state.updated_at for w in self._discovery.watchers.values())
        hit = self._limits.get(model)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        limits = limits_for(self._report, model)
        if limits.replicas:  # only models some replica serves: clients cannot grow this
            self._limits[model] = (stamp, limits)
        return limits

    def near_limit(self, ctx: RequestContext, m: Measured) -> bool:
        """The count is not exact and the request is near (or over) a limit."""
        return not ctx.req.prompt_exact and m.limits.near(
            ctx.req.prompt_tokens,
            ctx.req.max_tokens,
            ctx.req.expected_output,
            NEAR_LIMIT_MARGIN,
        )

    def should_count(self, ctx: RequestContext, m: Measured) -> bool:
        """Count the prompt on a replica before admission: it is not exact, and it is near
        (or over) a limit, or the part of it no count covers is long enough that the
        estimate's error matters (``INLINE_COUNT_TOKENS``, ``INLINE_COUNT_SHARE``)."""
        if ctx.req.prompt_exact:
            return False
        share = m.uncounted / max(1, ctx.req.prompt_tokens)
        if m.uncounted >= INLINE_COUNT_TOKENS and share >= INLINE_COUNT_SHARE:
            return True
        return self.near_limit(ctx, m)

    def settle(self, ctx: RequestContext, m: Measured) -> None:
        """Decide whether a text count without the template may be refused on (module
        docstring, point 5)."""
        if ctx.req.prompt_exact or m.floor is None:
            return
        limits = m.limits
        if m.media_tokens == 0 and limits.fits(
            ctx.req.prompt_tokens, ctx.req.max_tokens, ctx.req.expected_output
        ):
            ctx.req.prompt_exact = True
        elif not limits.fits(m.floor, ctx.req.max_tokens, ctx.req.expected_output):
            ctx.req.prompt_exact = True

    def _count_local(self, model: str, text: str) -> int:
        est = self._estimator
        if len(text) < _LOCAL_CACHE_MIN_CHARS:
            return est.prompt_tokens_for_text(model, text, 0)
        key = ("local", model, _digest(text.encode("utf-8", "surrogatepass")))
        n = self._cache.get(key)
        if n is None:
            n = est.prompt_tokens_for_text(model, text, 0)
            self._cache.put(key, n)
        return n

    # ------------------------------------------------------------------ one call
    def _target(self, model: str) -> ReplicaWatcher | None:
        now = asyncio.get_running_loop().time()
        eligible = [
            w
            for w in self._discovery.watchers.values()
            if w.state.ready
            and model in w.state.models
            and w.config.engine in TOKENIZE_ENGINES
            and self._paused.get(w.config.name, 0.0) <= now
        ]
        if not eligible:
            return None
        return eligible[next(self._turn) % len(eligible)]

    async def count_on_replica(self, ctx: RequestContext, m: Measured) -> bool:
        """Ask one replica for the prompt's count; True when the context's count changed."""
        if self._session is None:
            return False
        shape = m.shape
        if shape is not None and not shape.countable:
            self._metrics.count_prompt_count("unavailable")
            return False
        w = self._target(ctx.req.model)
        if w is None:
            self._metrics.count_prompt_count("unavailable")
            return False
        engine = w.config.engine
        chat = shape is not None
        if chat and engine == "sglang" and m.floor is not None:
            return False  # SGLang counts the text only, which is already counted
        first = self._request(ctx, m, engine)
        key = (engine, ctx.req.model, _digest(first[1]))
        cached = self._cache.get(key)
        if cached is not None:
            tokens, exact = cached
            self._metrics.count_prompt_count("cache")
        else:
            try:
                async with asyncio.timeout(self._timeout):
                    tokens, exact = await self._ask(w, ctx, engine, chat, first)
            except (
                _Failed,
                aiohttp.ClientError,
                TimeoutError,
                ValueError,
                KeyError,
                TypeError,
            ) as e:
                pause = _pause_after(e)
                if pause:
                    self._paused[w.config.name] = asyncio.get_running_loop().time() + pause
                self._metrics.count_prompt_count("failed")
                log.log(
                    logging.INFO if pause >= _UNSUPPORTED_PAUSE_S else logging.DEBUG,
                    "replica %s could not count a prompt (%s); not asked for %.0f s",
                    w.config.name,
                    e if str(e) else type(e).__name__,
                    pause,
                )
                return False
            self._cache.put(key, (tokens, exact))
            self._metrics.count_prompt_count("replica")
            if exact and ctx.prompt_countable and ctx.prompt_chars:
                # An exact count is as good a sample of the model's text as the engine's
                # usage: it teaches the estimator before any response arrives.
                self._estimator.observe_prompt(
                    ctx.req.model, ctx.prompt_chars, ctx.num_messages, tokens
                )
        if exact:
            ctx.req.prompt_tokens = max(1, tokens)
            ctx.req.prompt_exact = True
            m.uncounted = 0
            if chat and ctx.prefix is not None:
                ctx.prefix.learn(tokens)  # the next turn's prefix
        else:  # the text without its template (SGLang chat)
            m.floor = tokens
            ctx.req.prompt_tokens = tokens + ctx.num_messages * self._overhead + m.media_tokens
        return True

    def _request(self, ctx: RequestContext, m: Measured, engine: str) -> tuple[str, bytes]:
        """The first (path, body) to send to a replica of `engine` for this prompt."""
        body = ctx.body or {}
        if m.shape is None:
            if engine == "llamacpp":
                out: dict[str, Any] = {"content": m.text, "add_special": True}
            else:
                out = {"model": ctx.req.model, "prompt": m.text}
            return "/tokenize", json.dumps(out).encode()
        if engine == "sglang":
            text = "\n".join(p for p in m.shape.pieces if p)
            out = {"model": ctx.req.model, "prompt": text, "add_special_tokens": False}
            return "/tokenize", json.dumps(out).encode()
        if isinstance(ctx.parsed, ChatCompletionRequest):
            body = ctx.parsed.template_body  # the Responses and Messages APIs as chat
        out = {"messages": body.get("messages", [])}
        if body.get("tools"):
            out["tools"] = body["tools"]
        if engine == "llamacpp":
            return "/apply-template", json.dumps(out).encode()
        out["model"] = ctx.req.model
        for k in TEMPLATE_FIELDS:
            if k in body:
                out[k] = body[k]
        return "/tokenize", json.dumps(out).encode()

    async def _ask(
        self,
        w: ReplicaWatcher,
        ctx: RequestContext,
        engine: str,
        chat: bool,
        first: tuple[str, bytes],
    ) -> tuple[int, bool]:
        """(tokens, exact) from the replica; raises on any failure."""
        url = w.config.url
        headers = {
            **self._discovery.endpoints[w.config.name].headers,
            "X-Request-Id": ctx.request_id,
        }
        path, data = first
        answer = await self._post(url + path, data, headers)
        if engine == "llamacpp":
            if chat:
                prompt = answer["prompt"]
                if not isinstance(prompt, str):
                    raise TypeError("apply-template answered without a prompt")
                body = {"content": prompt, "add_special": True}
                answer = await self._post(url + "/tokenize", json.dumps(body).encode(), headers)
            return len(answer["tokens"]), True
        count = answer.get("count")
        if not isinstance(count, int) or isinstance(count, bool):
            count = len(answer["tokens"])
        return count, not (chat and engine == "sglang")

    async def _post(self, url: str, data: bytes, headers: dict[str, str]) -> Any:
        assert self._session is not None
        async with self._session.post(url, data=data, headers=headers) as r:
            raw = await r.read()
            if r.status != 200:
                raise _Failed(r.status, f"HTTP {r.status}")
        answer = json.loads(raw)
        if not isinstance(answer, dict):
            raise TypeError("tokenize answered something other than an object")
        return answer
