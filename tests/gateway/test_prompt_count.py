"""Prompt counting without IO: what a chat template renders, media allowances, limits,
and the count-near-a-limit decision when the character estimate is 2x off."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from admission.config import AdmissionConfig
from admission.controller import AdmissionController
from admission.fit import FitLimits
from admission.learned.estimate import TokenEstimator
from admission.types import AdmissionRequest, Admit, Refuse
from gateway.config import GatewayConfig, ReplicaConfig, config_from_mapping
from gateway.context import RequestContext
from gateway.counting import Limits, PromptCounter
from gateway.metrics import GatewayMetrics
from gateway.prompt import chat_shape
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.tokenizers import load_token_counters
from routing.scheduler import default_profile
from routing.types import ReplicaState

CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
AGENT_TURNS = [
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
]


def chat(messages: list[dict], **extra: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **extra})


def test_tool_calls_tool_messages_and_tool_schemas_are_counted() -> None:
    shape = chat(AGENT_TURNS, tools=TOOLS)
    s = chat_shape(shape)
    call_text = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    schemas = json.dumps(TOOLS, separators=(",", ":"))
    assert s.pieces == ["weather in Paris?", "18 degrees and sunny", call_text, schemas]
    # The classifier still reads only the messages' text.
    assert s.text == "weather in Paris?\n18 degrees and sunny"
    assert s.chars == len(s.text) + len(call_text) + len(schemas)
    assert s.messages == 3 and s.countable
    # The legacy function_call is a call too.
    legacy = chat_shape(
        chat([{"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}])
    )
    assert legacy.pieces == ['{"name": "f", "arguments": {}}']
    # The estimate grows with what the template renders, not only with the messages' text.
    est = TokenEstimator(AdmissionConfig(initial_chars_per_token=3.0))
    bare = chat_shape(chat([{"role": "user", "content": "weather in Paris?"}]))
    assert (
        est.prompt_tokens("m", s.chars, s.messages)
        - est.prompt_tokens("m", bare.chars, bare.messages)
        >= (len(call_text) + len(schemas) + len("18 degrees and sunny")) // 3 + 2 * 8
    )


def test_a_local_tokenizer_counts_tool_calls_and_tool_messages(tmp_path: Path) -> None:
    """Word-level tokenizer: every whitespace-separated word is one token."""
    tok = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    cfg = config_from_mapping({"tokenizers": {"m": str(path)}}, env={})
    est = TokenEstimator(cfg.admission, tokenizer_for=load_token_counters(cfg.tokenizers).get)
    counter = _counter(cfg, est, [])
    ctx = _ctx(chat(AGENT_TURNS))
    m = counter.measure(ctx)
    words = (
        3
        + 4
        + len('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'.split())
    )
    assert m.floor == words
    assert ctx.req.prompt_tokens == words + 3 * cfg.admission.per_message_overhead_tokens
    counter.settle(ctx, m)
    assert ctx.req.prompt_exact  # no limit known: the overhead guess cannot change a verdict


def test_media_parts_get_an_allowance_and_are_not_countable() -> None:
    parts = [
        {"type": "text", "text": "what is in these?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "image_url", "image_url": {"url": "https://example.invalid/b.png"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "video_url", "video_url": {"url": "https://example.invalid/c.mp4"}},
    ]
    s = chat_shape(chat([{"role": "user", "content": parts}]))
    assert (s.images, s.audios, s.others) == (2, 1, 1)
    assert not s.countable
    assert s.text == "what is in these?" and s.chars == len(s.text)
    assert s.media_tokens(1000, 750) == 3 * 1000 + 750
    # Counted into the reservation, and the prompt is never marked exact on an allowance.
    cfg = config_from_mapping({}, env={})
    counter = _counter(cfg, TokenEstimator(cfg.admission), [_replica(2048, 100_000)])
    ctx = _ctx(chat([{"role": "user", "content": parts}]))
    m = counter.measure(ctx)
    assert ctx.req.prompt_tokens >= 3750 and not ctx.prompt_countable
    counter.settle(ctx, m)
    assert not ctx.req.prompt_exact


def test_limits_near_and_fits_follow_admission() -> None:
    limits = Limits.of((FitLimits(2048, 3891, 16), FitLimits(1024, None, 16)))
    # near: within 10% of the smallest context, or of the largest pool.
    assert not limits.near(800, 100, 100, 0.1)
    assert limits.near(850, 100, 100, 0.1)  # 950 >= 0.9 * 1024
    assert limits.fits(1900, 100, 100) and not limits.fits(2000, 100, 100)
    pool_only = Limits.of((FitLimits(None, 1000, 16),))
    assert pool_only.near(880, 0, 20, 0.1) and not pool_only.near(700, 0, 100, 0.1)
    # The KV need is rounded up to whole blocks, as admission does: 980 -> 992, 1010 -> 1024.
    assert pool_only.fits(880, 10_000, 100) and not pool_only.fits(990, 0, 20)
    assert Limits().fits(10**9, 10**9, 10**9) and not Limits().near(10**9, 0, 0, 0.1)


def test_limits_are_recomputed_when_discovery_applies_a_round() -> None:
    cfg = config_from_mapping({}, env={})
    replica = _replica(2048, 4096)
    ctrl = AdmissionController(cfg.admission, default_profile(seed=1), seed=1)
    counter = _counter(cfg, TokenEstimator(cfg.admission), [replica], ctrl)
    body = {"model": "m", "prompt": "x", "max_tokens": 1800}
    ctx = _ctx(CompletionRequest.model_validate(body))
    ctx.req.max_tokens = ctx.req.expected_output = 1800
    assert counter.near_limit(ctx, counter.measure(ctx)) is False  # 1,801 < 0.9 x 2,048
    replica.state.max_model_len = 1900  # a redeploy with a shorter context...
    assert counter.near_limit(ctx, counter.measure(ctx)) is False  # ...not yet applied
    replica.state.updated_at = 1.0  # the adapter applied the round, and admission has it
    ctrl.upsert_replica(replica.state, 1.0)
    assert counter.near_limit(ctx, counter.measure(ctx)) is True


@pytest.mark.parametrize("guess_error", [0.5, 2.0], ids=["guess-2x-low", "guess-2x-high"])
@pytest.mark.parametrize("exact_available", [True, False], ids=["exact", "no-exact"])
def test_estimate_wrong_by_2x_either_way_refuses_nothing_wrongly(
    guess_error: float, exact_available: bool
) -> None:
    """Text of 4 chars/token, guessed at 2x or 0.5x that. Whatever the guess, a request
    that truly fits is never refused; one that truly does not is refused only on an
    exact count (else the engine decides). With an exact count near the limit, every
    truly-too-long request the estimate puts near the limit is refused at once."""
    true_cpt = 4.0
    max_tokens = 64
    cfg = config_from_mapping({"admission": {"initial_chars_per_token": true_cpt * guess_error}})
    est = TokenEstimator(cfg.admission)
    counter = _counter(cfg, est, [_replica(2048, 4096)])
    ctrl = AdmissionController(cfg.admission, default_profile(seed=1), seed=1)
    ctrl.upsert_replica(
        ReplicaState(
            "r0", "http://r0", models=["m"], ready=True, capacity_tokens=4096, max_model_len=2048
        ),
        0.0,
    )
    refused_truly_over = 0
    for i, true_tokens in enumerate(range(50, 4000, 37)):
        prompt = "abc " * true_tokens  # 4 chars a token by construction
        ctx = _ctx(CompletionRequest.model_validate({"model": "m", "prompt": prompt}))
        m = counter.measure(ctx)
        ctx.req.max_tokens = ctx.req.expected_output = max_tokens
        if counter.near_limit(ctx, m) and exact_available:
            ctx.req.prompt_tokens, ctx.req.prompt_exact = true_tokens, True  # the replica's count
        counter.settle(ctx, m)
        rid = f"q{i}"
        verdict = ctrl.submit(
            AdmissionRequest(
                request_id=rid,
                model="m",
                prompt_tokens=ctx.req.prompt_tokens,
                expected_output=ctx.req.expected_output,
                max_tokens=ctx.req.max_tokens,
                prompt_exact=ctx.req.prompt_exact,
            ),
            0.0,
        ).verdict
        truly_fits = true_tokens + max_tokens <= 2048
        if isinstance(verdict, Refuse):
            assert not truly_fits, f"{true_tokens} tokens refused on a guess of {guess_error}x"
            assert ctx.req.prompt_exact
            refused_truly_over += 1
        else:
            assert isinstance(verdict, Admit), verdict
            assert verdict.reserved_tokens <= 4096
        ctrl.release(rid, 0.0)
    assert ctrl.report.reserved_tokens() == 0
    over = len([t for t in range(50, 4000, 37) if t + max_tokens > 2048])
    if exact_available and guess_error == 0.5:
        assert refused_truly_over == over  # the high guess puts them all near the limit
    if not exact_available:
        assert refused_truly_over == 0


# ---------------------------------------------------------------------- helpers
def _metrics() -> GatewayMetrics:
    return GatewayMetrics(lambda: [], lambda: {}, lambda: 0)


def _replica(max_model_len: int | None, pool: int | None) -> SimpleNamespace:
    rc = ReplicaConfig(name="r0", url="http://r0")
    state = ReplicaState(
        "r0",
        "http://r0",
        models=["m"],
        ready=True,
        capacity_tokens=pool,
        max_model_len=max_model_len,
    )
    return SimpleNamespace(config=rc, state=state)


def _counter(
    cfg: GatewayConfig,
    est: TokenEstimator,
    watchers: list[SimpleNamespace],
    ctrl: AdmissionController | None = None,
) -> PromptCounter:
    """A counter whose limits are admission's view of `watchers` (as discovery feeds it)."""
    if ctrl is None:
        ctrl = AdmissionController(cfg.admission, default_profile(seed=1), seed=1)
    for w in watchers:
        ctrl.upsert_replica(w.state, 0.0)
    return PromptCounter(cfg, est, _discovery(watchers), ctrl.report, _metrics())


def _discovery(watchers: list[SimpleNamespace]) -> SimpleNamespace:
    """What the counter reads of discovery: its watchers' config and state."""
    return SimpleNamespace(watchers={w.config.name: w for w in watchers})


def _ctx(parsed: ChatCompletionRequest | CompletionRequest) -> RequestContext:
    kind = "chat" if isinstance(parsed, ChatCompletionRequest) else "completion"
    ctx = RequestContext("t", kind, "/", 0.0, parsed=parsed)
    ctx.req.model = parsed.model
    ctx.body = parsed.body
    return ctx


def test_the_counter_reads_the_pool_admission_holds() -> None:
    """One set of fit rules: the counter's limits are admission's own, so a pool of private
    slots keeps no margin and a pool the engine's KV usage measured smaller is the
    smaller one (the counter once restated the rules from config, without either)."""
    cfg = config_from_mapping({"admission": {"headroom": 0.1}}, env={})
    slots = _replica(1024, 4096)
    slots.state.private_slots = True
    slots.state.preempts = False
    shared = _replica(2048, 10_000)
    shared.state.name = shared.config.name = "r1"
    ctrl = AdmissionController(cfg.admission, default_profile(seed=1), seed=1)
    counter = _counter(cfg, TokenEstimator(cfg.admission), [slots, shared], ctrl)
    pools = sorted(lim.pool for lim in counter._limits_of("m").replicas)
    # Both whole: the headroom is the margin of estimated reservations (not of private slots).
    assert pools == [4096, 10_000]
    report = {lim.pool: lim for lim in ctrl.report.fit_limits("m")}
    assert report[4096].private_slots and not report[4096].preempts
    assert report[10_000].margin == 0.1


def test_what_is_counted_inline_the_long_uncounted_parts() -> None:
    """Counted on a replica before admission: a prompt whose uncounted part is estimated
    at INLINE_COUNT_TOKENS or more and at INLINE_COUNT_SHARE of the prompt or more; a
    short tail after a counted prefix, or a short prompt, goes on its estimate (far from
    every limit)."""
    from gateway.counting import INLINE_COUNT_SHARE, INLINE_COUNT_TOKENS
    from gateway.prefixcount import prompt_chain

    cfg = config_from_mapping({}, env={})
    counter = _counter(cfg, TokenEstimator(cfg.admission), [_replica(32768, 1_000_000)])
    system = {"role": "system", "content": "abcdef " * 3000}  # 21,000 chars
    tail = {"role": "user", "content": "ghijkl " * 300}  # 2,100 chars: ~700 estimated
    fields = ("chat_template_kwargs",)

    def decide(messages: list[dict], counted: int | None = None) -> tuple[bool, int]:
        req = chat(messages)
        chain = prompt_chain(req, "chat", fields)
        if counted is not None:
            assert chain is not None
            counter.prefixes.put("m", chain[1], counted)
        ctx = _ctx(req)
        m = counter.measure(ctx)
        ctx.req.max_tokens = ctx.req.expected_output = 64
        return counter.should_count(ctx, m), m.uncounted

    # No count covers it: the whole estimate (7,000+) is uncounted.
    assert decide([system, tail]) == (True, counter.measure(_ctx(chat([system, tail]))).uncounted)
    # The system prompt counted (3,000 tokens): the tail (~700) is a fifth: counted.
    go, uncounted = decide([system, tail], counted=3000)
    assert uncounted >= INLINE_COUNT_TOKENS and go
    # A 9,000-token prefix: the same tail is under an eighth of the prompt: estimated.
    go, uncounted = decide([{"role": "system", "content": "abcdef " * 3001}, tail], counted=9000)
    assert uncounted / (9000 + uncounted) < INLINE_COUNT_SHARE and not go
    # A short prompt, nothing counted: estimated.
    go, uncounted = decide([{"role": "user", "content": "abcdef " * 100}])
    assert uncounted < INLINE_COUNT_TOKENS and not go
