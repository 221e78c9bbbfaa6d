"""The speculation scorer: coding to speculating replicas below the crossover, spill past
it; the crossover from configuration, from measured acceptance, and from measured
acceptance and step time."""

from __future__ import annotations

import pytest

from routing.config import RoutingConfig
from routing.plugin import PluginEnv
from routing.registry import build
from routing.scheduler import build_router
from routing.scorers.speculation import SpeculationScorer, gain_factor
from routing.types import Candidate, RouteRequest


def cand(name: str, *, spec: bool, running: int = 0, engine_running: int = 0) -> Candidate:
    c = Candidate(name, 10_000, 10_000, running, 64)
    c.speculative = spec
    c.engine.engine_running = engine_running
    return c


def req(workload: str) -> RouteRequest:
    return RouteRequest("q", "m", 100, workload=workload)


def test_coding_prefers_speculating_replicas_below_the_crossover_and_spills_past_it() -> None:
    s = SpeculationScorer(crossover_batch=8)
    assert s.score(req("coding"), cand("s", spec=True, running=3)) == 1.0
    assert s.score(req("coding"), cand("p", spec=False)) == 0.5
    # batch with the request: 8 fits, 9 does not; the engine's own count is read too.
    assert s.score(req("coding"), cand("s", spec=True, running=7)) == 1.0
    assert s.score(req("coding"), cand("s", spec=True, running=8)) == 0.0
    assert s.score(req("coding"), cand("s", spec=True, running=1, engine_running=9)) == 0.0


def test_other_workloads_use_speculating_replicas_only_while_their_batch_is_small() -> None:
    s = SpeculationScorer(crossover_batch=16, others_share=0.25)  # chat up to batch 4
    assert s.score(req("chat"), cand("s", spec=True, running=3)) == 1.0
    assert s.score(req("chat"), cand("s", spec=True, running=4)) == 0.0
    assert s.score(req("chat"), cand("p", spec=False, running=9)) == 1.0
    never = SpeculationScorer(others_share=0.0)
    assert never.score(req("chat"), cand("s", spec=True)) == 0.0


def test_crossover_scales_with_measured_acceptance() -> None:
    s = SpeculationScorer(crossover_batch=32, reference_acceptance=4.73, num_draft_tokens=5)
    c = cand("s", spec=True)
    assert s.crossover(c) == 32  # nothing measured
    c.engine.spec_accept_length = 2.61  # SGLang's gauge: creative writing accepts less
    s.score(req("coding"), c)
    expected = 32 * gain_factor(2.61, 5) / gain_factor(4.73, 5)
    assert s.crossover(c) == pytest.approx(expected)
    assert s.crossover(c) < 8


def test_vllm_acceptance_over_the_window_between_rounds() -> None:
    s = SpeculationScorer(crossover_batch=32)
    c = cand("s", spec=True)
    c.engine.spec_drafts_total, c.engine.spec_accepted_tokens_total = 1000.0, 5000.0
    s.score(req("coding"), c)  # first sight: no window yet
    assert s.crossover(c) == 32
    c.engine.spec_drafts_total, c.engine.spec_accepted_tokens_total = 1100.0, 5161.0  # 1 + 161/100
    s.score(req("coding"), c)
    assert s.crossover(c) == pytest.approx(32 * gain_factor(2.61, 5) / gain_factor(4.73, 5))


def test_crossover_from_acceptance_and_measured_step_time() -> None:
    # Step time s(b) = 10 ms + 2 ms x b measured at three batch sizes (ITL x acceptance):
    # b* = (s0 / s1) (a - 1) / (1 - a / (k + 1)).
    s = SpeculationScorer(crossover_batch=32, min_window_tokens=10)
    c = cand("s", spec=True)
    c.engine.spec_accept_length = 4.0
    c.engine.itl_sum_s, c.engine.itl_count = 0.0, 0.0
    s.score(req("coding"), c)
    total_s, total_n = 0.0, 0.0
    for batch in (2, 6, 12):
        step = 0.010 + 0.002 * batch
        total_s += 100 * step / 4.0
        total_n += 100
        c.engine.engine_running = batch
        c.engine.itl_sum_s, c.engine.itl_count = total_s, total_n
        s.score(req("coding"), c)
    assert s.crossover(c) == pytest.approx(5.0 * gain_factor(4.0, 5))


def test_the_reference_keeps_its_own_drafts_when_the_engine_drafts_fewer() -> None:
    # vLLM's ngram drafting 3 (k from the engine): 4.73 tokens a step at the reference's 5
    # drafts is out of its reach; a low acceptance must still pull the crossover down.
    s = SpeculationScorer(crossover_batch=32, reference_acceptance=4.73, num_draft_tokens=5)
    for accept, expected in ((1.06, 1.0), (3.5, 32 * gain_factor(3.5, 3) / gain_factor(4.73, 5))):
        c = cand(f"s{accept}", spec=True)
        c.engine.spec_num_draft_tokens = 3
        c.engine.spec_accept_length = accept
        s.score(req("coding"), c)
        assert s.crossover(c) == pytest.approx(expected)


def test_step_time_is_the_mean_itl_where_the_engine_observes_it_once_a_step() -> None:
    # vLLM observes its ITL once per request per step (itl_per_step): the mean is the step
    # time. With acceptance moving between rounds, multiplying by it bends the line.
    s = SpeculationScorer(crossover_batch=32, min_window_tokens=10)
    c = cand("s", spec=True)
    c.engine.itl_per_step = True
    c.engine.spec_num_draft_tokens = 3
    c.engine.itl_sum_s, c.engine.itl_count = 0.0, 0.0
    s.score(req("coding"), c)
    total_s, total_n = 0.0, 0.0
    for batch, accept in ((2, 3.5), (6, 2.0), (12, 3.0)):
        c.engine.spec_accept_length = accept
        total_s += 100 * (0.010 + 0.002 * batch)
        total_n += 100
        c.engine.engine_running = batch
        c.engine.itl_sum_s, c.engine.itl_count = total_s, total_n
        s.score(req("coding"), c)
    assert s.crossover(c) == pytest.approx(5.0 * gain_factor(3.0, 3))


def test_explain_and_hints_name_the_decision() -> None:
    s = SpeculationScorer()
    spec, plain = cand("s", spec=True), cand("p", spec=False)
    s.score(req("coding"), spec)
    s.score(req("coding"), plain)
    assert s.hints(req("coding")) == ["s"]
    assert s.hints(req("chat")) == []
    assert s.explain(req("coding"), spec) == "speculation"
    assert s.explain(req("coding"), plain) == "spill"
    assert s.explain(req("chat"), plain) is None


def test_profile_with_speculation_routes_and_counts_reasons() -> None:
    cfg = RoutingConfig.model_validate(
        {
            "default_profile": {
                "scorers": [
                    {"name": "speculation", "weight": 2.0, "params": {"crossover_batch": 4}},
                    {"name": "running_headroom", "weight": 1.0},
                ]
            }
        }
    )
    router = build_router(cfg, seed=1)
    spec, plain = cand("s", spec=True, running=2), cand("p", spec=False, running=0)
    assert router.pick(req("coding"), [spec, plain]) is spec
    assert router.pick(req("chat"), [spec, plain]) is plain
    spec.running = 4  # past the crossover: coding spills
    assert router.pick(req("coding"), [spec, plain]) is plain
    assert router.decisions == {"speculation": 1, "score": 1, "spill": 1}


def test_bad_params_are_rejected() -> None:
    for params in (
        {"crossover_batch": 0},
        {"reference_acceptance": 7.0},
        {"workloads": [1]},
        {"nope": 1},
        {"others_share": 1.5},
    ):
        with pytest.raises((ValueError, TypeError)):
            build("scorer", "speculation", params, PluginEnv())
