"""Exact counts of conversation prefixes (gateway/prefixcount.py): the digest chain
without IO, then multi-turn conversations over real loopback HTTP on enginesim replicas
(which count at /tokenize and report usage).

The prompts are six-letter words, one token each for enginesim's tokenizer (7
characters a token): a fresh kvgate's estimate (3 characters a token) is 2.3x the
real count, so every token the gateway reserves beyond the engine's count shows.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from admission.learned.estimate import TokenEstimator
from admission.tenants import TenantLimiter
from gateway.accounting import Accounting
from gateway.config import config_from_mapping
from gateway.context import RequestContext
from gateway.counting import INLINE_COUNT_TOKENS
from gateway.metrics import GatewayMetrics
from gateway.outcome import OK
from gateway.prefixcount import PrefixCounts, prompt_chain
from gateway.prompt import chat_shape
from gateway.schemas import ChatCompletionRequest, MessagesRequest, ResponsesRequest
from tests.gateway.conftest import MODEL
from tests.gateway.test_exact_count import CountingReplica, engine_count, post, samples

FIELDS = ("chat_template_kwargs",)
SYSTEM = "You are an agent. " + " ".join(["abcdef"] * 400)  # ~400 tokens, estimated ~950
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


def chat(messages: list[dict], **extra: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest({"model": "m", "messages": messages, **extra})


def user(i: int, words: int = 30) -> dict[str, str]:
    return {"role": "user", "content": f"step {i}: " + " ".join(["ghijkl"] * words)}


# ---------------------------------------------------------------------- the chain
def test_a_turn_chain_extends_the_previous_turn_chain() -> None:
    turn1 = [{"role": "system", "content": SYSTEM}, user(1)]
    turn2 = [*turn1, {"role": "assistant", "content": "done"}, user(2)]
    c1 = prompt_chain(chat(turn1, tools=TOOLS), "chat", FIELDS)
    c2 = prompt_chain(chat(turn2, tools=TOOLS), "chat", FIELDS)
    assert c1 is not None and c2 is not None
    assert len(c1) == 3 and len(c2) == 5 and c2[:3] == c1
    # Key order does not matter (canonical JSON); content, tools and template options do.
    reordered = [{"content": m["content"], "role": m["role"]} for m in turn1]
    assert prompt_chain(chat(reordered, tools=TOOLS), "chat", FIELDS) == c1
    assert prompt_chain(chat(turn1), "chat", FIELDS)[0] != c1[0]  # type: ignore[index]
    opts = chat(turn1, tools=TOOLS, chat_template_kwargs={"enable_thinking": False})
    assert prompt_chain(opts, "chat", FIELDS)[0] != c1[0]  # type: ignore[index]
    assert prompt_chain(chat(turn1, tools=TOOLS), "messages", FIELDS)[0] != c1[0]  # type: ignore[index]


def test_the_longest_counted_prefix_and_what_it_leaves_to_estimate() -> None:
    msgs = [{"role": "system", "content": SYSTEM}, user(1), {"role": "assistant", "content": "ok"}]
    chain = prompt_chain(chat(msgs), "chat", FIELDS)
    assert chain is not None
    store = PrefixCounts(16)
    sizes = [len(SYSTEM), 40, 2]
    p = store.lookup("m", chain, sizes)
    assert (p.counted, p.tokens, p.tail_messages) == (0, 0, 3) and not p.whole
    store.put("m", chain[1], 420)
    store.put("m", chain[2], 470)
    p = store.lookup("m", chain, sizes)
    assert (p.counted, p.tokens, p.tail_chars, p.tail_messages) == (2, 470, 3, 1)
    assert store.lookup("other-model", chain, sizes).counted == 0
    p.learn(480)  # the engine's usage of the whole prompt
    whole = store.lookup("m", chain, sizes)
    assert whole.whole and whole.tokens == 480 and whole.tail_messages == 0


def test_responses_and_messages_chain_their_chat_view() -> None:
    responses = ResponsesRequest(
        {"model": "m", "instructions": SYSTEM, "input": "hello there", "tools": []}
    )
    messages = MessagesRequest(
        {"model": "m", "system": SYSTEM, "max_tokens": 8, "messages": [user(1)]}
    )
    r = prompt_chain(responses, "responses", FIELDS)
    m = prompt_chain(messages, "messages", FIELDS)
    assert r is not None and len(r) == len(responses.messages) + 1
    assert m is not None and len(m) == len(messages.messages) + 1
    # A continued stored response: the engine prepends history the request does not carry.
    cont = ResponsesRequest({"model": "m", "input": "and then?", "previous_response_id": "r1"})
    assert prompt_chain(cont, "responses", FIELDS) is None


def test_the_account_stage_stores_the_usage_and_teaches_the_tail_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine's usage is stored as the count of the whole prompt (whatever the
    outcome), and the estimator learns the characters per token of the part it estimated:
    the tail after the counted prefix, not the prompt it did not estimate."""
    monkeypatch.setattr("admission.learned.estimate.MIN_PROMPT_SAMPLES", 1)
    cfg = config_from_mapping({}, env={})
    est = TokenEstimator(cfg.admission)
    metrics = GatewayMetrics(lambda: [], lambda: {}, lambda: 0)
    accounting = Accounting(est, TenantLimiter.from_config([], {}), metrics, {"m"})
    msgs = [{"role": "system", "content": SYSTEM}, user(1), {"role": "assistant", "content": "ok"}]
    req = chat(msgs)
    chain = prompt_chain(req, "chat", FIELDS)
    assert chain is not None
    store = PrefixCounts(8)
    store.put("m", chain[2], 450)
    shape = chat_shape(req)
    p = store.lookup("m", chain, shape.message_chars)
    ctx = RequestContext("r1", "chat", "/", 0.0, parsed=req, prefix=p, outcome=OK)
    ctx.req.model = "m"
    ctx.prompt_chars, ctx.num_messages = shape.chars, shape.messages
    ctx.req.prompt_tokens = 450 + est.prompt_tokens("m", p.tail_chars, p.tail_messages)
    ctx.usage_prompt, ctx.usage_completion = 462, 3
    accounting.account(ctx, 1.0)
    assert store.get("m", chain[3]) == 462
    overhead = cfg.admission.per_message_overhead_tokens
    assert est.chars_per_token("m") == pytest.approx(p.tail_chars / (462 - 450 - overhead))


# ---------------------------------------------------------------------- over HTTP
@pytest.fixture
async def counting() -> AsyncIterator[Callable[..., Awaitable[CountingReplica]]]:
    """Tiny-profile enginesim replicas that count the calls they receive."""
    made: list[CountingReplica] = []

    async def factory(**kwargs: Any) -> CountingReplica:
        srv = CountingReplica("tiny", speed=50.0, **kwargs)
        await srv.start()
        made.append(srv)
        return srv

    yield factory
    for srv in reversed(made):
        await srv.stop()


async def turn(url: str, messages: list[dict], max_tokens: int = 8) -> tuple[int, dict]:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "tools": TOOLS}
    return await post(url + "/v1/chat/completions", body)


async def test_a_conversation_is_counted_once_then_extends_the_engine_count(counting, gateway):
    srv: CountingReplica = await counting()
    gw = await gateway(srv)
    url = gw.url
    counter = gw.state.pipeline.counter
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, user(1)]
    # Turn 1: nothing counted, estimated far above INLINE_COUNT_TOKENS: counted inline.
    status, data = await turn(url, messages)
    assert status == 200, data
    assert srv.hits == Counter(tokenize=1, chat=1)
    assert len(counter.prefixes) == 1
    # Turns 2-4: the history, the reply and a short new message: the engine's usage of the
    # last turn is the prefix's exact count; only the tail (~90 tokens estimated) is
    # estimated, and no call is made.
    for i in range(2, 5):
        messages = [*messages, {"role": "assistant", "content": data["choices"][0]["message"]["content"]}, user(i)]  # fmt: skip
        exact = await engine_count(srv, {"model": MODEL, "messages": messages, "tools": TOOLS})
        status, data = await turn(url, messages)
        assert status == 200, data
        assert data["usage"]["prompt_tokens"] == exact
        assert srv.hits["tokenize"] == 1 + (i - 1)  # only the test's own engine_count calls
    ratio = await samples(gw, "kvgate_prompt_estimate_ratio")
    # Three turns on a counted prefix: over by less than the tail's estimate, never under.
    n = ratio[("kvgate_prompt_estimate_ratio_count", (("exact", "false"),))]
    total = ratio[("kvgate_prompt_estimate_ratio_sum", (("exact", "false"),))]
    assert n == 3 and 3.0 <= total <= 3 * 1.15
    counts = await samples(gw, "kvgate_prompt_counts")
    assert counts[("kvgate_prompt_counts_total", (("how", "prefix"),))] == 3
    assert counts[("kvgate_prompt_counts_total", (("how", "replica"),))] == 1
    # The same last turn again (a retry): the engine's usage counted it, exact, no call.
    status, _ = await turn(url, messages)
    assert status == 200 and srv.hits["tokenize"] == 4
    counts = await samples(gw, "kvgate_prompt_counts")
    assert counts[("kvgate_prompt_counts_total", (("how", "cache"),))] == 1
    ratio = await samples(gw, "kvgate_prompt_estimate_ratio")
    assert ratio[("kvgate_prompt_estimate_ratio_sum", (("exact", "true"),))] == 2.0


async def test_a_long_tail_is_counted_and_a_prefix_plus_tail_is_never_refused(counting, gateway):
    """A counted prefix with a tail estimated at INLINE_COUNT_TOKENS or more is counted on
    the replica (exact). Invariant 4: a prefix count plus a tail estimate is not exact,
    so without the replica's count a prompt over the context is forwarded, and the
    engine's own 400 answers; with it, kvgate refuses at once."""
    srv: CountingReplica = await counting()
    gw = await gateway(srv)
    first = [{"role": "system", "content": SYSTEM}, user(1)]
    status, data = await turn(gw.url, first)
    assert status == 200 and srv.hits == Counter(tokenize=1, chat=1)
    reply = {"role": "assistant", "content": data["choices"][0]["message"]["content"]}
    # A long tool result (~1,700 tokens, estimated far above the inline threshold): the
    # whole prompt is over the 2,048-token context. Counted, refused, never sent.
    big = user(2, words=1700)
    assert len(big["content"]) / 3.0 >= INLINE_COUNT_TOKENS
    status, data = await turn(gw.url, [*first, reply, big])
    assert status == 400 and data["error"]["code"] == "context_length_exceeded"
    assert srv.hits == Counter(tokenize=2, chat=1)
    # The replica can no longer count: the same kind of prompt is forwarded on its prefix
    # count plus estimate, and the engine refuses it.
    srv.tokenize_status = 500
    status, data = await turn(gw.url, [*first, reply, user(3, words=1700)])
    assert status == 400 and "maximum context length" in data["error"]["message"]
    assert srv.hits == Counter(tokenize=3, chat=2)


@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_the_agent_apis_count_their_prefix_too(counting, gateway, api):
    srv: CountingReplica = await counting()
    gw = await gateway(srv)
    history: list[dict] = [user(1)]
    for i in range(2, 4):
        if api == "responses":
            path = "/v1/responses"
            body = {"model": MODEL, "instructions": SYSTEM, "input": history,
                    "max_output_tokens": 8, "store": False}  # fmt: skip
        else:
            path = "/v1/messages"
            body = {"model": MODEL, "system": SYSTEM, "messages": history, "max_tokens": 8}
        status, data = await post(gw.url + path, body)
        assert status == 200, data
        history = [*history, {"role": "assistant", "content": "noted"}, user(i)]
    # The first turn was counted on the replica; the second extended the engine's count.
    assert srv.hits["tokenize"] == 1
    counts = await samples(gw, "kvgate_prompt_counts")
    assert counts[("kvgate_prompt_counts_total", (("how", "prefix"),))] == 1


async def test_long_completions_are_counted_inline_but_pooling_inputs_are_not(counting, gateway):
    srv: CountingReplica = await counting()
    gw = await gateway(srv)
    text = " ".join(["abcdef"] * 700)  # 700 tokens, estimated ~1,630: far from every limit
    body = {"model": MODEL, "prompt": text, "max_tokens": 4}
    status, data = await post(gw.url + "/v1/completions", body)
    assert status == 200, data
    assert srv.hits["tokenize"] == 1
    inputs = [text[:2100], text[2100:4200]]  # ~1,400 tokens estimated: far from the limits
    status, data = await post(gw.url + "/v1/embeddings", {"model": MODEL, "input": inputs})
    assert status == 200, data
    assert srv.hits["tokenize"] == 1  # an embeddings batch goes on its estimate
