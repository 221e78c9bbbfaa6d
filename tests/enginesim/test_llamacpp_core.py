"""The llama.cpp core on virtual time: slots, deferral, per-slot vs unified KV, no preemption.

llamacpp-tiny: 4 slots over n_ctx 4,096 cells; per slot (default) each slot owns 1,024,
unified all four share 4,096 and each may use all of it.
"""

from __future__ import annotations

import random

import pytest

from enginesim.llamacpp import CONTEXT_EXCEEDED, SLOT_PROMPT_SIMILARITY, LlamaCppCore
from enginesim.profiles import load_profile
from enginesim.types import EngineEvent, EventKind, SimRequest

FAR = 1 << 20  # max_tokens past any context


def _core(unified: bool = False, seed: int = 0) -> LlamaCppCore:
    return LlamaCppCore(load_profile("llamacpp-tiny"), seed=seed, kv_unified=unified)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(300, 100_000) for _ in range(n)]


def _req(rid: str, prompt: list[int], max_tokens: int = FAR, **kw: object) -> SimRequest:
    return SimRequest(rid, prompt, max_tokens=max_tokens, ignore_eos=True, **kw)  # type: ignore[arg-type]


def _run(
    core: LlamaCppCore, now: float = 0.0, until: float | None = None
) -> tuple[float, list[EngineEvent]]:
    """Step (checking invariants) until idle, or until virtual time `until`."""
    events: list[EngineEvent] = []
    for _ in range(200_000):
        if not core.has_work() or (until is not None and now >= until):
            return now, events
        res = core.step(now)
        core.check_invariants()
        assert core.stats().num_preemptions == 0  # llama.cpp never preempts
        events.extend(res.events)
        now = res.end
    raise AssertionError("engine did not drain")


def _by_id(events: list[EngineEvent], kind: EventKind) -> dict[str, EngineEvent]:
    return {e.request_id: e for e in events if e.kind is kind}


def _tokens(events: list[EngineEvent], rid: str) -> int:
    return sum(len(e.token_ids) for e in events if e.request_id == rid)


# -- per slot ---------------------------------------------------------------------------------


def test_per_slot_generation_stops_at_the_slot_context() -> None:
    core = _core()
    assert core.slot_n_ctx == 1024 and core.n_slots == 4 and not core.kv_unified
    rng = random.Random(1)
    core.add_request(_req("a", _prompt(rng, 700)), 0.0)
    _, events = _run(core)
    done = _by_id(events, EventKind.FINISHED)["a"]
    # Generation stops once the slot's cells would be full: 700 + 324 = 1,024 tokens, the
    # last one sampled but never decoded.
    assert (done.finish_reason, done.completion_tokens) == ("length", 324)
    assert not _by_id(events, EventKind.FAILED)
    assert core.stats().n_tokens_max == 1023


def test_prompt_that_does_not_fit_its_slot_fails_when_a_slot_starts_it() -> None:
    core = _core()
    rng = random.Random(2)
    for i in range(4):  # occupy every slot for a while
        core.add_request(_req(f"busy{i}", _prompt(rng, 100), max_tokens=50), 0.0)
    core.add_request(_req("big", _prompt(rng, 1024)), 0.0)
    core.add_request(_req("edge", _prompt(rng, 1023)), 0.0)
    now, events = _run(core, until=1e-9)
    assert core.stats().num_waiting == 2  # deferred, not refused on arrival
    now, events = _run(core, now)
    failed = _by_id(events, EventKind.FAILED)["big"]
    err = failed.error
    assert err is not None
    assert (err.status, err.type, err.n_prompt_tokens, err.n_ctx) == (
        400, "exceed_context_size_error", 1024, 1024
    )  # fmt: skip
    assert err.message == (
        "request (1024 tokens) exceeds the available context size (1024 tokens), try increasing it"
    )
    first_release = min(e.time for e in events if e.kind is EventKind.FINISHED)
    assert failed.time == pytest.approx(first_release)  # only once a slot was free
    # One cell short of the context is accepted, and yields a single token.
    edge = _by_id(events, EventKind.FINISHED)["edge"]
    assert (edge.completion_tokens, edge.finish_reason) == (1, "length")
    assert core.stats().num_failed == 1


def test_deferred_requests_start_first_come_first_served() -> None:
    core = _core()
    rng = random.Random(3)
    for i in range(7):
        core.add_request(_req(f"r{i}", _prompt(rng, 64), max_tokens=20 + 10 * i), 0.0)
    now, events = _run(core, until=1e-9)
    started = [e.request_id for e in events if e.kind is EventKind.STARTED]
    assert started == ["r0", "r1", "r2", "r3"]
    st = core.stats()
    assert (st.num_running, st.num_waiting) == (4, 3)
    # A fresh server hands out its slots highest id first (llama-server's LRU tie-break).
    assert [e.slot for e in events if e.kind is EventKind.STARTED] == [3, 2, 1, 0]
    _, events = _run(core, now)
    started = [e.request_id for e in events if e.kind is EventKind.STARTED]
    assert started == ["r4", "r5", "r6"]
    assert len(_by_id(events, EventKind.FINISHED)) == 7


def test_a_slot_reuses_its_cached_prefix_and_is_picked_for_it() -> None:
    core = _core()
    rng = random.Random(4)
    p1 = _prompt(rng, 200)
    core.add_request(_req("t1", p1, max_tokens=40), 0.0)
    now, events = _run(core)
    gen = [t for e in events if e.kind is EventKind.TOKENS for t in e.token_ids]
    slot1 = _by_id(events, EventKind.STARTED)["t1"].slot
    # Another request's prompt lands elsewhere (LRU); the session's next turn (its history
    # and a new turn) goes back to the slot that holds its history.
    core.add_request(_req("other", _prompt(rng, 50), max_tokens=5), now)
    core.add_request(_req("t2", p1 + gen + _prompt(rng, 20), max_tokens=5), now)
    now, events = _run(core, now)
    started = _by_id(events, EventKind.STARTED)
    assert started["t2"].slot == slot1 and started["other"].slot != slot1
    done = _by_id(events, EventKind.FINISHED)
    assert done["t2"].cached_tokens == 200 + 40 - 1  # all but the never-decoded last token
    assert done["other"].cached_tokens == 0
    # The same prompt again: all of it is cached, but one token is always recomputed.
    core.add_request(_req("t3", p1, max_tokens=2), now)
    _, events = _run(core, now)
    done = _by_id(events, EventKind.FINISHED)["t3"]
    assert done.cached_tokens == 199 and done.timings is not None
    assert done.timings.prompt_n == 1


def test_similarity_threshold_decides_between_cache_and_lru() -> None:
    core = _core()
    rng = random.Random(5)
    base = _prompt(rng, 100)
    core.add_request(_req("a", base, max_tokens=3), 0.0)
    now, events = _run(core)
    slot_a = _by_id(events, EventKind.STARTED)["a"].slot
    # 5 shared tokens of 100 is below the 0.1 threshold: the LRU slot is taken instead.
    assert 5 / 100 <= SLOT_PROMPT_SIMILARITY
    core.add_request(_req("b", base[:5] + _prompt(rng, 95), max_tokens=3), now)
    now, events = _run(core, now)
    assert _by_id(events, EventKind.STARTED)["b"].slot != slot_a
    assert _by_id(events, EventKind.FINISHED)["b"].cached_tokens == 0


def test_abort_frees_the_slot_for_a_deferred_request() -> None:
    core = _core()
    rng = random.Random(6)
    for i in range(5):
        core.add_request(_req(f"r{i}", _prompt(rng, 50)), 0.0)
    now, _ = _run(core, until=0.05)
    assert core.stats().num_waiting == 1
    assert core.abort("r0", now) and not core.abort("r0", now)
    assert core.stats().num_aborted == 1
    res = core.step(now)
    assert [e.request_id for e in res.events if e.kind is EventKind.STARTED] == ["r4"]
    for rid in ("r1", "r2", "r3", "r4"):
        core.abort(rid, now)
    assert not core.has_work() and core.stats().blocks_in_use == 0


# -- unified ------------------------------------------------------------------------------------


def test_unified_slot_may_use_the_whole_pool() -> None:
    core = _core(unified=True)
    assert core.slot_n_ctx == 4096
    rng = random.Random(7)
    core.add_request(_req("long", _prompt(rng, 3000), max_tokens=500), 0.0)
    _, events = _run(core)
    assert _by_id(events, EventKind.FINISHED)["long"].completion_tokens == 500
    per_slot = _core()
    per_slot.add_request(_req("long", _prompt(random.Random(7), 3000), max_tokens=500), 0.0)
    _, events = _run(per_slot)
    assert _by_id(events, EventKind.FAILED)["long"].error.n_ctx == 1024  # type: ignore[union-attr]


def test_unified_overflow_fails_every_active_request_at_that_step() -> None:
    core = _core(unified=True)
    rng = random.Random(8)
    for i in range(4):  # 4 x (600 + 600) = 4,800 cells > 4,096
        core.add_request(_req(f"r{i}", _prompt(rng, 600), max_tokens=600), 0.0)
    core.add_request(_req("later", _prompt(rng, 600), max_tokens=100), 0.0)
    now, events = _run(core)
    failed = _by_id(events, EventKind.FAILED)
    assert set(failed) == {"r0", "r1", "r2", "r3"}
    assert len({e.time for e in failed.values()}) == 1  # all at once
    for e in failed.values():
        assert e.error is not None
        assert (e.error.status, e.error.type, e.error.message) == (
            500, "server_error", CONTEXT_EXCEEDED
        )  # fmt: skip
        assert e.error.n_ctx is None
    # They failed when the pool could not take the next step's tokens: prompts and the
    # tokens decoded so far nearly fill it.
    held = sum(600 + _tokens(events, r) - 1 for r in failed)
    assert 4096 - 4 < held <= 4096
    # Their slots were cleared; the deferred request then ran to completion.
    assert _by_id(events, EventKind.FINISHED)["later"].completion_tokens == 100
    assert core.stats().num_failed == 4 and core.stats().num_preemptions == 0


def test_unified_purges_idle_caches_before_failing() -> None:
    # Without the RAM cache (--cache-ram 0) idle slots keep their cells in the pool until
    # a batch needs them.
    core = LlamaCppCore(load_profile("llamacpp-tiny"), kv_unified=True, cache_ram_mib=0)
    rng = random.Random(9)
    for i in range(3):  # three finished requests leave ~3,000 cells cached in idle slots
        core.add_request(_req(f"old{i}", _prompt(rng, 900), max_tokens=100), 0.0)
    now, _ = _run(core)
    assert core.stats().cached_free_blocks > 2900
    core.add_request(_req("new", _prompt(rng, 1500), max_tokens=1500), now)
    _, events = _run(core, now)
    assert not _by_id(events, EventKind.FAILED)
    assert _by_id(events, EventKind.FINISHED)["new"].completion_tokens == 1500
    assert core.stats().cached_free_blocks == 2999  # only the new request's slot kept its


def test_per_slot_never_fails_mid_flight() -> None:
    """The same overload as the unified overflow test, per slot: all finish with length."""
    core = _core()
    rng = random.Random(8)
    for i in range(5):
        core.add_request(_req(f"r{i}", _prompt(rng, 600), max_tokens=600), 0.0)
    _, events = _run(core)
    done = _by_id(events, EventKind.FINISHED)
    assert len(done) == 5 and not _by_id(events, EventKind.FAILED)
    assert {e.completion_tokens for e in done.values()} == {1024 - 600}


# -- accounting -----------------------------------------------------------------------------------


def test_metrics_counters_add_up() -> None:
    core = _core()
    rng = random.Random(10)
    prompts = {f"r{i}": _prompt(rng, 150) for i in range(6)}
    for rid, p in prompts.items():
        core.add_request(SimRequest(rid, p, max_tokens=300), 0.0)  # natural lengths
    _, events = _run(core)
    st = core.stats()
    done = _by_id(events, EventKind.FINISHED)
    assert st.prompt_tokens_processed + st.prompt_tokens_cached == 6 * 150
    assert st.tokens_predicted == sum(e.completion_tokens for e in done.values())
    assert st.tokens_predicted == st.generation_tokens
    assert {e.finish_reason for e in done.values()} <= {"stop", "length"}
    assert st.n_decode > 0 and 1 <= st.n_busy_slots / st.n_decode <= 4
    assert st.prompt_seconds > 0 and st.tokens_predicted_seconds > 0
    assert st.prompt_bucket_tokens == st.prompt_tokens_processed
    core.reset_metrics_bucket()
    st = core.stats()
    assert st.prompt_bucket_tokens == st.predict_bucket_steps == 0
    assert st.prompt_tokens_processed + st.prompt_tokens_cached == 900  # counters stay


def test_deterministic_for_a_seed() -> None:
    def trace(seed: int) -> list[tuple[str, str, float, tuple[int, ...]]]:
        core = _core(unified=True, seed=seed)
        rng = random.Random(11)
        for i in range(8):
            core.add_request(
                SimRequest(f"d{i}", _prompt(rng, rng.randrange(20, 900)), max_tokens=700),
                0.0,
            )
        _, events = _run(core)
        return [(e.kind.value, e.request_id, round(e.time, 9), tuple(e.token_ids)) for e in events]

    assert trace(1) == trace(1)
    assert trace(1) != trace(2)


# -- the host-RAM prompt cache (checked against a real llama-server, -np 4 -c 4096) --------------


def _slot_tokens(core: LlamaCppCore) -> list[int]:
    return [i.n_prompt_tokens for i in core.slot_info()]


def test_ram_cache_restores_a_session_whose_slot_served_others() -> None:
    """The real server answered C with cached_tokens 301 and left the slots at
    339/339/330/339; without the RAM cache nothing would be found."""
    a = [500] * 300 + [501]
    for ram, expected in ((None, 301), (0, 0)):
        core = LlamaCppCore(load_profile("llamacpp-tiny"), cache_ram_mib=ram)
        core.add_request(_req("A", a, max_tokens=20), 0.0)
        now, events = _run(core)
        assert _by_id(events, EventKind.STARTED)["A"].slot == 3
        assert _slot_tokens(core) == [0, 0, 0, 320]
        for i in range(4):
            core.add_request(_req(f"B{i}", [600 + i] * 300, max_tokens=40), now)
        now, _ = _run(core, now)
        assert _slot_tokens(core) == [339] * 4  # A's slot went to a B
        core.add_request(_req("C", a + [502] * 10, max_tokens=20), now)
        _, events = _run(core, now)
        assert _by_id(events, EventKind.FINISHED)["C"].cached_tokens == expected
        if ram is None:  # which slot is least recently used among equals is timing
            assert sorted(_slot_tokens(core)) == [330, 339, 339, 339]


def test_unified_idle_slots_are_saved_and_cleared_when_a_request_starts() -> None:
    """Real server, --kv-unified: slots 320 -> (B starts) 319 in slot 2 and slot 3 at 0 ->
    A's session again restored into slot 1 with cached_tokens 301."""
    core = _core(unified=True)
    a = [500] * 300 + [501]
    core.add_request(_req("A", a, max_tokens=20), 0.0)
    now, _ = _run(core)
    assert _slot_tokens(core) == [0, 0, 0, 320]
    core.add_request(_req("B", [600] * 300, max_tokens=20), now)
    now, _ = _run(core, now)
    assert _slot_tokens(core) == [0, 0, 319, 0]  # A's cells went back to the pool
    for _ in range(2):
        core.add_request(_req("A2", a + [7], max_tokens=20), now)
        now, events = _run(core, now)
        assert _by_id(events, EventKind.FINISHED)["A2"].cached_tokens == 301
        assert _slot_tokens(core) == [0, 321, 0, 0]
