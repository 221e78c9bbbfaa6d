"""EngineCore invariants on virtual time: pool bound, lifecycle, preemption, prefix hits."""

from __future__ import annotations

import random

import pytest

from enginesim.core import EngineCore
from enginesim.profiles import Profile, load_profile
from enginesim.roofline import Roofline, StepShape
from enginesim.spec import acceptance_rate
from enginesim.types import EngineEvent, EventKind, Flavor, SimRequest, Workload


def _tiny(**engine: object) -> Profile:
    p = load_profile("tiny")
    if engine:
        p = p.model_copy(update={"engine": p.engine.model_copy(update=engine)})
    return p


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(300, 100_000) for _ in range(n)]


def _drain(
    core: EngineCore, now: float = 0.0, check: bool = True
) -> tuple[float, list[EngineEvent]]:
    events: list[EngineEvent] = []
    for _ in range(100_000):
        if not core.has_work():
            return now, events
        res = core.step(now)
        assert res.duration > 0
        if check:
            core.check_invariants()
        events.extend(res.events)
        now = res.end
    raise AssertionError("engine did not drain")


@pytest.mark.parametrize("flavor", [Flavor.VLLM, Flavor.SGLANG])
def test_randomized_run_holds_invariants(flavor: Flavor) -> None:
    """Random arrivals, lengths and aborts: never over the pool; every request ends."""
    rng = random.Random(7)
    core = EngineCore(_tiny(), flavor=flavor, seed=3)
    shared = _prompt(rng, 300)
    ids = [f"r{i}" for i in range(120)]
    finished: set[str] = set()
    aborted: set[str] = set()
    now = 0.0
    nxt = 0
    peak = 0
    while nxt < len(ids) or core.has_work():
        for _ in range(rng.randrange(0, 3)):
            if nxt < len(ids):
                p = (shared if rng.random() < 0.4 else []) + _prompt(rng, rng.randrange(5, 900))
                core.add_request(
                    SimRequest(
                        ids[nxt],
                        p,
                        max_tokens=rng.randrange(1, 600),
                        workload=rng.choice(list(Workload)),
                    ),
                    now,
                )
                nxt += 1
        if rng.random() < 0.05 and core.request_ids():
            victim = rng.choice(sorted(core.request_ids()))
            assert core.abort(victim, now)
            aborted.add(victim)
        res = core.step(now)
        core.check_invariants()
        st = core.stats()
        assert st.blocks_in_use <= st.num_gpu_blocks
        peak = max(peak, st.blocks_in_use)
        for ev in res.events:
            if ev.kind is EventKind.FINISHED:
                finished.add(ev.request_id)
        now = res.end if res.duration else now + 0.01
    assert finished | aborted == set(ids)
    assert not finished & aborted
    st = core.stats()
    assert st.blocks_in_use == 0 and st.num_running == 0 and st.num_waiting == 0
    assert st.num_finished == len(finished) and st.num_aborted == len(aborted)
    assert peak > 0.9 * st.num_gpu_blocks  # the run did press on the pool
    assert st.num_preemptions > 0


def test_preempted_request_recomputes_its_tokens() -> None:
    """Without prefix caching, preemption makes prefill work exceed the prompts."""
    core = EngineCore(_tiny(enable_prefix_caching=False), seed=0)
    rng = random.Random(1)
    prompts = {f"p{i}": _prompt(rng, 900) for i in range(4)}
    for rid, p in prompts.items():
        core.add_request(SimRequest(rid, p, max_tokens=1100, ignore_eos=True), 0.0)
    _, events = _drain(core)
    preempted = {e.request_id for e in events if e.kind is EventKind.PREEMPTED}
    st = core.stats()
    assert st.num_preemptions > 0 and preempted
    assert core.total_prefill_tokens > sum(len(p) for p in prompts.values())
    # Each preemption re-prefills the prompt (prompt tokens counted once per prefill).
    assert st.prompt_tokens == sum(len(p) for p in prompts.values()) + sum(
        len(prompts[e.request_id]) for e in events if e.kind is EventKind.PREEMPTED
    )
    done = {e.request_id: e for e in events if e.kind is EventKind.FINISHED}
    assert all(done[r].completion_tokens == 1100 for r in prompts)


def test_prefix_hit_skips_prefill_work() -> None:
    core = EngineCore(load_profile("seed2-8b-16gb"), seed=0)
    rng = random.Random(2)
    prompt = _prompt(rng, 3000)
    core.add_request(SimRequest("a", prompt, max_tokens=4), 0.0)
    t, ev = _drain(core)
    cold_prefill = core.total_prefill_tokens
    core.add_request(SimRequest("b", prompt[:2990] + _prompt(rng, 10), max_tokens=4), t)
    first = core.step(t)
    fin = _drain(core, first.end)[1]
    warm_prefill = core.total_prefill_tokens - cold_prefill
    assert cold_prefill == 3000
    assert warm_prefill <= 3000 - 2976 + 16  # all full shared blocks hit
    done = [e for e in fin if e.kind is EventKind.FINISHED][0]
    assert done.cached_tokens == 2976  # 186 full blocks of 16
    st = core.stats()
    assert st.prefix_cache_hits == 2976 and st.prefix_cache_queries == 6000
    assert first.duration < 0.1 * ev[0].time  # the warm prefill step is far shorter


def test_abort_frees_blocks_at_once_and_emits_nothing() -> None:
    core = EngineCore(_tiny(), seed=0)
    rng = random.Random(3)
    core.add_request(SimRequest("x", _prompt(rng, 1000), max_tokens=500), 0.0)
    core.add_request(SimRequest("y", _prompt(rng, 1000), max_tokens=500), 0.0)
    now = 0.0
    for _ in range(5):
        now = core.step(now).end
    assert core.stats().blocks_in_use > 0
    assert core.abort("x", now) and core.abort("y", now)
    assert core.stats().blocks_in_use == 0
    assert not core.has_work() and core.request_ids() == set()
    assert core.abort("x", now) is False
    res = core.step(now)
    assert res.events == [] and res.duration == 0.0


def test_abort_of_a_waiting_request() -> None:
    core = EngineCore(_tiny(), seed=0)
    rng = random.Random(4)
    for i in range(6):
        core.add_request(SimRequest(f"w{i}", _prompt(rng, 1500), max_tokens=300), 0.0)
    core.step(0.0)
    assert core.stats().num_waiting > 0
    waiting = "w5"
    before = core.stats().blocks_in_use
    assert core.abort(waiting, 0.1)
    assert core.stats().blocks_in_use == before
    assert waiting not in core.request_ids()


def test_output_lengths_and_finish_reasons() -> None:
    core = EngineCore(_tiny(), seed=0)
    p = list(range(300, 340))
    core.add_request(SimRequest("eos", p, max_tokens=50, output_len=20), 0.0)
    core.add_request(SimRequest("len", p, max_tokens=30, output_len=200), 0.0)
    core.add_request(SimRequest("ign", p, max_tokens=40, output_len=5, ignore_eos=True), 0.0)
    core.add_request(SimRequest("min", p, max_tokens=40, output_len=3, min_tokens=12), 0.0)
    core.add_request(SimRequest("nat", p, max_tokens=1000, workload=Workload.AGENTIC), 0.0)
    _, events = _drain(core)
    fin = {e.request_id: e for e in events if e.kind is EventKind.FINISHED}
    toks = {
        r: sum(len(e.token_ids) for e in events if e.kind is EventKind.TOKENS and e.request_id == r)
        for r in fin
    }
    assert (fin["eos"].completion_tokens, fin["eos"].finish_reason) == (20, "stop")
    assert (fin["len"].completion_tokens, fin["len"].finish_reason) == (30, "length")
    assert (fin["ign"].completion_tokens, fin["ign"].finish_reason) == (40, "length")
    assert fin["min"].completion_tokens == 12
    assert 1 <= fin["nat"].completion_tokens < 1000
    assert all(toks[r] == fin[r].completion_tokens for r in fin)
    assert all(fin[r].prompt_tokens == 40 for r in fin)
    assert core.stats().generation_tokens == sum(toks.values())


def test_add_request_validation() -> None:
    core = EngineCore(_tiny(), seed=0)
    with pytest.raises(ValueError, match="2048"):
        core.add_request(SimRequest("big", list(range(300, 2300)), max_tokens=100), 0.0)
    with pytest.raises(ValueError):
        core.add_request(SimRequest("empty", [], max_tokens=10), 0.0)
    core.add_request(SimRequest("ok", [400], max_tokens=10), 0.0)
    with pytest.raises(ValueError, match="duplicate"):
        core.add_request(SimRequest("ok", [400], max_tokens=10), 0.0)


def _trace(
    seed: int, flavor: Flavor = Flavor.VLLM
) -> list[tuple[str, str, float, tuple[int, ...]]]:
    core = EngineCore(_tiny(), flavor=flavor, seed=seed, speculative=True)
    rng = random.Random(11)
    for i in range(12):
        core.add_request(
            SimRequest(
                f"d{i}",
                _prompt(rng, rng.randrange(10, 600)),
                max_tokens=900,
                workload=list(Workload)[i % 3],
            ),
            0.0,
        )
    _, events = _drain(core)
    return [(e.kind.value, e.request_id, round(e.time, 9), tuple(e.token_ids)) for e in events]


@pytest.mark.parametrize("flavor", [Flavor.VLLM, Flavor.SGLANG])
def test_deterministic_for_a_seed(flavor: Flavor) -> None:
    assert _trace(5, flavor) == _trace(5, flavor)
    assert _trace(5, flavor) != _trace(6, flavor)


def test_speculation_is_per_request_and_counted() -> None:
    """A request's accepted-token sequence does not depend on what else is running."""

    def run(others: int) -> list[int]:
        core = EngineCore(_tiny(), seed=1, speculative=True)
        core.add_request(
            SimRequest(
                "me",
                list(range(300, 364)),
                max_tokens=200,
                ignore_eos=True,
                workload=Workload.CODING,
            ),
            0.0,
        )
        for i in range(others):
            core.add_request(
                SimRequest(
                    f"o{i}",
                    list(range(500 + i, 564 + i)),
                    max_tokens=150,
                    ignore_eos=True,
                    workload=Workload.CHAT,
                ),
                0.0,
            )
        _, events = _drain(core)
        st = core.stats()
        assert st.spec_num_drafts > 0
        assert st.spec_num_accepted_tokens <= st.spec_num_draft_tokens
        # Every emitted token is a bonus token (one per verification), an accepted draft,
        # a prefill's first token, or a plain decode of a request's very last token (when
        # no draft fits under max_tokens: at most once per request).
        reqs = 1 + others
        plain = st.generation_tokens - (st.spec_num_drafts + st.spec_num_accepted_tokens + reqs)
        assert 0 <= plain <= reqs
        return [
            len(e.token_ids) for e in events if e.kind is EventKind.TOKENS and e.request_id == "me"
        ]

    alone, crowded = run(0), run(5)
    assert alone == crowded
    assert sum(alone) == 200 and max(alone) > 1


def test_acceptance_rate_solves_the_mean() -> None:
    for mean, k in ((4.73, 5), (2.61, 5), (3.6, 5), (2.0, 3)):
        a = acceptance_rate(mean, k)
        assert abs((1 - a ** (k + 1)) / (1 - a) - mean) < 1e-6
    assert acceptance_rate(1.0, 4) == 0.0


def test_moe_distinct_experts_grow_and_saturate() -> None:
    r = Roofline(load_profile("seed1-moe-h200x16"))
    assert r.distinct_experts(1) == pytest.approx(16)
    vals = [r.distinct_experts(n) for n in (1, 8, 54, 200, 5000)]
    assert vals == sorted(vals) and vals[-1] <= 896
    assert r.distinct_experts(54) == pytest.approx(896 * (1 - (1 - 16 / 896) ** 54))
    dense = Roofline(load_profile("llama3-70b-h100x4"))
    assert dense.distinct_experts(54) == 0.0


def test_step_time_grows_with_work() -> None:
    core = EngineCore(load_profile("seed2-8b-16gb"), seed=0)
    core.add_request(SimRequest("p", list(range(300, 2300)), max_tokens=5, ignore_eos=True), 0.0)
    prefill = core.step(0.0)
    decode = core.step(prefill.end)
    assert prefill.num_prefill_tokens == 2000 and decode.num_decode_tokens == 1
    assert prefill.duration > 10 * decode.duration


def test_seq_overhead_is_paid_per_sequence_in_the_step() -> None:
    profile = load_profile("tiny")
    perf = profile.perf.model_copy(update={"seq_overhead_ms": 0.5})
    with_seq = Roofline(profile.model_copy(update={"perf": perf}))
    base = Roofline(profile)
    one = StepShape(tokens=1, attended=100, kv_read_tokens=100, num_seqs=1)
    eight = StepShape(tokens=8, attended=800, kv_read_tokens=800, num_seqs=8)
    assert with_seq.cost(one).total - base.cost(one).total == pytest.approx(0.5e-3)
    assert with_seq.cost(eight).total - base.cost(eight).total == pytest.approx(4e-3)
    assert with_seq.cost(eight).overhead == pytest.approx(base.overhead + 4e-3)
