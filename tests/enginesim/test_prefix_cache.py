"""The prefix cache holds generated tokens too, as vLLM's does (virtual time, no IO).

vLLM hashes each full block of a request's tokens, prompt and output alike, chaining each
block's hash from the previous one; a block becomes cached as soon as its last token's KV
has been computed, during decode as during prefill; a finished request's blocks join the
LRU free queue with their hashes kept. So a chat session that resends its history (the
previous prompt, the previous answer, a new user turn) hits the cache for the whole earlier
conversation, up to the last full block whose KV was computed: the final sampled token is
never fed back through the model, so a block it would complete is not cached.
"""

from __future__ import annotations

import random

import pytest

from enginesim.core import EngineCore
from enginesim.kvpool import chain_hashes
from enginesim.profiles import Profile, load_profile
from enginesim.types import EventKind, Flavor, SimRequest

BS = 16


def _tiny(**engine: object) -> Profile:
    p = load_profile("tiny")
    if engine:
        p = p.model_copy(update={"engine": p.engine.model_copy(update=engine)})
    return p


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(300, 100_000) for _ in range(n)]


def _run(core: EngineCore, now: float = 0.0) -> tuple[float, dict[str, list[int]], dict]:
    """Step until idle (checking invariants); generated ids and FINISHED events by id."""
    out: dict[str, list[int]] = {}
    done: dict = {}
    for _ in range(100_000):
        if not core.has_work():
            return now, out, done
        res = core.step(now)
        assert res.duration > 0
        core.check_invariants()
        for ev in res.events:
            if ev.kind is EventKind.TOKENS:
                out.setdefault(ev.request_id, []).extend(ev.token_ids)
            elif ev.kind is EventKind.FINISHED:
                done[ev.request_id] = ev
        now = res.end
    raise AssertionError("engine did not drain")


def _cached_blocks(core: EngineCore, tokens: list[int]) -> int:
    """Leading full blocks of `tokens` the prefix cache holds now (takes no reference)."""
    return len(core.pool.match_prefix(chain_hashes(tokens, BS)))


@pytest.mark.parametrize("flavor", [Flavor.VLLM, Flavor.SGLANG])
@pytest.mark.parametrize(("prompt_len", "out_len"), [(100, 50), (100, 29), (37, 200)])
def test_second_turn_hits_the_generated_blocks(
    flavor: Flavor, prompt_len: int, out_len: int
) -> None:
    core = EngineCore(_tiny(), flavor=flavor, seed=0)
    rng = random.Random(prompt_len + out_len)
    p1 = _prompt(rng, prompt_len)
    core.add_request(SimRequest("t1", p1, max_tokens=out_len, ignore_eos=True), 0.0)
    now, out, _ = _run(core)
    assert len(out["t1"]) == out_len
    history = p1 + out["t1"]
    # Every token but the last sampled one had its KV computed: those full blocks are cached.
    computed = len(history) - 1
    assert _cached_blocks(core, history) == computed // BS
    assert core.stats().cached_free_blocks == computed // BS  # t1 is done: all evictable

    hits_before = core.stats().prefix_cache_hits
    p2 = history + _prompt(rng, 30)  # the resent history plus a new user turn
    core.add_request(SimRequest("t2", p2, max_tokens=5, ignore_eos=True), now)
    _, _, done = _run(core, now)
    assert done["t2"].cached_tokens == computed // BS * BS
    assert done["t2"].cached_tokens > prompt_len // BS * BS  # more than the prompt blocks
    assert core.stats().prefix_cache_hits - hits_before == computed // BS * BS
    assert core.stats().blocks_in_use == 0


def test_partial_last_block_is_not_cached() -> None:
    """100 + 29 tokens: 128 computed = 8 full blocks; block 8 holds only the last sample."""
    core = EngineCore(_tiny(), seed=0)
    rng = random.Random(5)
    p1 = _prompt(rng, 100)
    core.add_request(SimRequest("t1", p1, max_tokens=29, ignore_eos=True), 0.0)
    now, out, _ = _run(core)
    history = p1 + out["t1"]
    assert len(history) == 129
    assert _cached_blocks(core, history + _prompt(rng, 40)) == 8
    # The same history with a different last token would fill block 8 differently: no
    # hit there either way, and nothing past the chain's first divergence.
    other = history[:128] + [history[128] ^ 1] + _prompt(rng, 40)
    assert _cached_blocks(core, other) == 8
    # A resend of exactly the history keeps its last token to compute (for the logits).
    core.add_request(SimRequest("t2", history, max_tokens=1), now)
    _, _, done = _run(core, now)
    assert done["t2"].cached_tokens == 128


def test_blocks_are_cached_as_decode_fills_them() -> None:
    """A block is published the step its last token's KV is computed, mid-request."""
    core = EngineCore(_tiny(), seed=0)
    rng = random.Random(6)
    p1 = _prompt(rng, 40)
    core.add_request(SimRequest("a", p1, max_tokens=200, ignore_eos=True), 0.0)
    now = 0.0
    generated: list[int] = []
    while len(generated) < 60:
        res = core.step(now)
        core.check_invariants()
        generated += [t for ev in res.events for t in ev.token_ids]
        now = res.end
        computed = len(p1) + len(generated) - 1
        assert _cached_blocks(core, p1 + generated) == computed // BS
    # A second request on a's history so far shares a's blocks while a still runs.
    snapshot = p1 + generated
    core.add_request(SimRequest("b", snapshot + _prompt(rng, 8), max_tokens=3), now)
    res = core.step(now)
    core.check_invariants()  # shared blocks: reference count 2, one per holder
    shared = core.pool.match_prefix(chain_hashes(snapshot, BS))
    assert len(shared) == (len(snapshot) - 1) // BS
    assert all(core.pool._ref[b] == 2 for b in shared)
    _, _, done = _run(core, res.end)
    assert done["b"].cached_tokens == len(shared) * BS


def test_speculation_caches_only_accepted_tokens() -> None:
    core = EngineCore(_tiny(), seed=2, speculative=True)
    rng = random.Random(7)
    p1 = _prompt(rng, 50)
    core.add_request(SimRequest("t1", p1, max_tokens=120, ignore_eos=True), 0.0)
    now, out, _ = _run(core)
    assert core.stats().spec_num_drafts > 0
    history = p1 + out["t1"]
    assert _cached_blocks(core, history) == (len(history) - 1) // BS
    core.add_request(SimRequest("t2", history + [777], max_tokens=2), now)
    _, _, done = _run(core, now)
    assert done["t2"].cached_tokens == (len(history) - 1) // BS * BS


def test_eviction_stays_lru_with_generated_blocks() -> None:
    """Finished sessions' blocks are evicted least recently freed first, tail first."""
    core = EngineCore(_tiny(pool_tokens=528, max_model_len=512), seed=0)  # 32 blocks + null
    rng = random.Random(8)
    histories = {}
    now = 0.0
    for rid in ("a", "b"):  # a finishes first, then b: a's blocks are older
        p = _prompt(rng, 100)
        core.add_request(SimRequest(rid, p, max_tokens=50, ignore_eos=True), now)
        now, out, _ = _run(core, now)
        histories[rid] = p + out[rid]
        assert _cached_blocks(core, histories[rid]) == 9  # 149 computed tokens
    # Free queue now: 12 never-used blocks, then a's 10 blocks tail first, then b's.
    assert core.pool.num_free == 32 and core.stats().cached_free_blocks == 18
    # A filler of 15 blocks takes the 12 empty blocks and a's last three: its partial
    # block and two full blocks of generated tokens.
    core.add_request(SimRequest("f", _prompt(rng, 239), max_tokens=1), now)
    res = core.step(now)
    assert res.num_prefill_tokens == 239
    assert _cached_blocks(core, histories["a"]) == 7
    assert _cached_blocks(core, histories["b"]) == 9
    now, _, _ = _run(core, res.end)
    # The filler joins the queue behind b. A 10-block request takes the rest of a (its
    # head block last) and then b's last three blocks.
    core.add_request(SimRequest("g", _prompt(rng, 160), max_tokens=1), now)
    _run(core, now)
    assert _cached_blocks(core, histories["a"]) == 0
    assert _cached_blocks(core, histories["b"]) == 7


def test_refcounts_hold_through_preemption_of_shared_history() -> None:
    """Two continuations of one session share its cached blocks; one is preempted and
    recomputed. Reference counts stay exact every step, and all blocks come back."""
    core = EngineCore(_tiny(pool_tokens=528, max_model_len=512), seed=0)  # 32 blocks + null
    rng = random.Random(9)
    p1 = _prompt(rng, 100)
    core.add_request(SimRequest("t1", p1, max_tokens=60, ignore_eos=True), 0.0)
    now, out, _ = _run(core)
    history = p1 + out["t1"]
    shared = (len(history) - 1) // BS  # 9 blocks
    for rid in ("a", "b"):
        core.add_request(
            SimRequest(rid, history + _prompt(rng, 10), max_tokens=250, ignore_eos=True), now
        )
    before = core.stats()
    now, out, done = _run(core, now)  # check_invariants after every step
    st = core.stats()
    assert st.num_preemptions > before.num_preemptions
    assert done["a"].cached_tokens == done["b"].cached_tokens == shared * BS
    assert len(out["a"]) == len(out["b"]) == 250
    assert st.blocks_in_use == 0 and core.pool.num_free == 32
    core.pool.check()
    # The recomputed request found blocks again on readmission (its own output included).
    readmit_hits = st.prefix_cache_hits - before.prefix_cache_hits - 2 * shared * BS
    assert readmit_hits > 0
