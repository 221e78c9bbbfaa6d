"""TokenEstimator and DrainMeter: learning from usage while staying conservative."""

from __future__ import annotations

import math
import random

import pytest

from admission.config import AdmissionConfig
from admission.learned import estimate
from admission.learned.drain import DrainMeter
from admission.learned.estimate import TokenEstimator


def test_prompt_estimate_starts_conservative() -> None:
    est = TokenEstimator(
        AdmissionConfig(initial_chars_per_token=3.0, per_message_overhead_tokens=8)
    )
    # 4 chars/token is typical English BPE; 3.0 over-estimates on purpose.
    assert est.prompt_tokens("m", 3000, messages=2) == 1000 + 16
    assert est.prompt_tokens("m", 0, messages=0) == 1


def test_prompt_learning_converges_to_a_low_quantile_and_rises_slowly() -> None:
    cfg = AdmissionConfig(initial_chars_per_token=3.0, per_message_overhead_tokens=4)
    est = TokenEstimator(cfg)
    rng = random.Random(1)
    history = []
    for _ in range(200):
        chars = rng.randint(500, 5000)
        cpt = rng.uniform(3.8, 4.4)  # true chars per token of this traffic
        actual = math.ceil(chars / cpt) + 2 * 4
        est.observe_prompt("m", chars, 2, actual)
        history.append(est.chars_per_token("m"))
    # Never a jump of more than the allowed growth per observation.
    for a, b in zip(history, history[1:], strict=False):
        assert b <= a * (1 + estimate.MAX_CHARS_PER_TOKEN_GROWTH) + 1e-12
    learned = est.chars_per_token("m")
    assert 3.8 <= learned <= 3.95  # about the 10th percentile: most prompts over-estimated
    over = 0
    for _ in range(500):
        chars = rng.randint(500, 5000)
        actual = math.ceil(chars / rng.uniform(3.8, 4.4)) + 8
        over += est.prompt_tokens("m", chars, 2) >= actual
    assert over / 500 >= 0.85
    # Other models are unaffected.
    assert est.chars_per_token("other") == 3.0


def test_denser_text_makes_the_estimate_conservative_at_once() -> None:
    assert estimate.MIN_PROMPT_SAMPLES == 5
    est = TokenEstimator(AdmissionConfig(per_message_overhead_tokens=0))
    for _ in range(50):
        est.observe_prompt("m", 4000, 1, 1000)  # 4 chars/token
    assert est.chars_per_token("m") == pytest.approx(4.0)
    for _ in range(60):
        est.observe_prompt("m", 2000, 1, 1000)  # suddenly 2 chars/token (code, CJK)
    assert est.chars_per_token("m") == pytest.approx(2.0)


def test_exact_tokenizer_hook_is_used_when_configured() -> None:
    est = TokenEstimator(AdmissionConfig(), tokenizer_for=lambda m: len if m == "exact" else None)
    assert est.prompt_tokens_for_text("exact", "abcdef", 0) == 6
    # Chat: exact text plus the template's per-message overhead (not in a tokenizer file).
    assert est.prompt_tokens_for_text("exact", "abcdef", 2) == 6 + 2 * 8
    assert est.prompt_tokens_for_text("other", "abcdef", 1) == est.prompt_tokens("other", 6, 1)


def test_expected_output_before_and_after_learning() -> None:
    assert estimate.MIN_OUTPUT_SAMPLES == 20
    cfg = AdmissionConfig(output_quantile=0.9, default_output_tokens=512)
    est = TokenEstimator(cfg)
    assert est.expected_output("m", 2000, limit=4000) == 2000  # max_tokens before learning
    assert est.expected_output("m", None, limit=4000) == 512  # configured default
    assert est.expected_output("m", None, limit=300) == 300  # capped by the context left
    for n in range(1, 101):  # completions of 1..100 tokens
        est.observe_output("m", n)
    assert est.learned_output("m") == 90
    assert est.expected_output("m", 2000, limit=4000) == 90
    assert est.expected_output("m", 50, limit=4000) == 50  # never above max_tokens
    assert est.expected_output("m", None, limit=60) == 60
    assert est.expected_output("m", None, limit=4000) == 90
    assert est.expected_output("other", None, limit=4000) == 512


def test_output_window_forgets_old_traffic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(estimate, "ESTIMATOR_WINDOW", 50)
    monkeypatch.setattr(estimate, "MIN_OUTPUT_SAMPLES", 10)
    est = TokenEstimator(AdmissionConfig())
    for _ in range(50):
        est.observe_output("m", 1000)
    for _ in range(50):
        est.observe_output("m", 10)
    assert est.learned_output("m") == 10


def test_drain_meter_measures_rate_over_busy_time_only() -> None:
    meter = DrainMeter(tau=10.0)
    assert meter.rates(0.0) == (0.0, 0.0)
    now = 0.0
    meter.set_busy(True, now)
    for _ in range(100):
        now += 0.5
        meter.record(50, now)  # 100 tokens/s, 2 requests/s
    tok, req = meter.rates(now)
    assert tok == pytest.approx(100.0, rel=0.05)
    assert req == pytest.approx(2.0, rel=0.05)
    # An idle hour does not decay the rate: nothing was there to drain.
    meter.set_busy(False, now)
    assert meter.rates(now + 3600.0)[0] == pytest.approx(tok)
    # Busy but nothing released: the rate decays.
    meter.set_busy(True, now + 3600.0)
    # (busy clock 50 s -> 60 s: decay e^-1, bias-correction window grows slightly)
    window = (1 - math.exp(-5.0)) / (1 - math.exp(-6.0))
    assert meter.rates(now + 3610.0)[0] == pytest.approx(tok * math.exp(-1.0) * window)


def test_drain_meter_is_unbiased_early() -> None:
    meter = DrainMeter(tau=30.0)
    meter.set_busy(True, 0.0)
    for i in range(1, 5):
        meter.record(100, float(i))  # 100 tokens/s for 4 s, far less than tau
    assert meter.rates(4.0)[0] == pytest.approx(100.0, rel=0.1)


# ---------------------------------------------------------------- the estimates' margin
def test_the_margin_is_the_headroom_until_estimates_were_seen_and_then_what_they_missed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(estimate, "ESTIMATOR_WINDOW", 64)
    est = TokenEstimator(AdmissionConfig(headroom=0.05))
    assert est.margin("m") == 0.05  # nothing seen: the configured headroom
    for _ in range(15):
        est.observe_estimated("m", 1000, 900)  # over-estimated: nothing missed
    assert est.margin("m") == 0.05  # 15 of the 16 it needs
    est.observe_estimated("m", 1000, 950)
    assert est.margin("m") == 0.0  # the estimates held: pack the pool to them
    # Now every request uses 10% more than reserved: mean 100 short, no spread.
    for _ in range(64):
        est.observe_estimated("m", 1000, 1100)
    assert est.margin("m") == pytest.approx(0.10)
    assert est.margin("other") == 0.05  # per model


def test_a_few_large_misses_count_with_their_spread() -> None:
    """One request in ten over by 30%: the mean miss is 3%, the per-request spread 9%:
    the margin covers both (a pool of a few such requests can hold one of the misses)."""
    est = TokenEstimator(AdmissionConfig(headroom=0.05))
    for i in range(100):
        est.observe_estimated("m", 1000, 1300 if i % 10 == 0 else 1000)
    assert est.margin("m") == pytest.approx(0.03 + 0.09)


def test_the_margin_forgets_old_misses_and_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(estimate, "ESTIMATOR_WINDOW", 64)
    est = TokenEstimator(AdmissionConfig(headroom=0.05))
    for _ in range(64):
        est.observe_estimated("m", 100, 400)  # wildly short
    assert est.margin("m") == 0.5  # at most: reserve twice the estimate
    for _ in range(64):
        est.observe_estimated("m", 100, 100)
    assert est.margin("m") == 0.0  # the window holds only the new, exact ones
