"""The service model: a plane in prompt and output tokens, an upper estimate of service."""

import random

import pytest

from admission.candidates import PredictMax
from admission.learned.service import ServiceModel

# A replica's step under continuous batching: an output token costs a whole step (50 ms),
# a prompt token a share of a prefill chunk (0.1 ms).
BASE, PER_PROMPT, PER_OUTPUT = 0.2, 1e-4, 0.05


def served(prompt: int, output: int) -> float:
    return BASE + PER_PROMPT * prompt + PER_OUTPUT * output


def seed001_like(rng: random.Random, n: int, noise: float) -> list[tuple[int, int, float]]:
    """Long prompts, short answers, as seed 001's batch job sends them."""
    out = []
    for _ in range(n):
        p, o = rng.randint(1400, 4000), rng.randint(40, 200)
        out.append((p, o, served(p, o) + rng.uniform(0.0, noise)))
    return out


def test_an_output_token_is_priced_apart_from_a_prompt_token():
    model = ServiceModel()
    for p, o, s in seed001_like(random.Random(1), 64, noise=0.0):
        model.add(p, o, s)
    # Exact data: the plane is recovered, so a long prompt with a short answer is
    # predicted fast and a short prompt with a long answer slow, though both have the
    # same token sum (a line in the sum would predict them alike).
    assert model.predict(4000, 40) == pytest.approx(served(4000, 40), rel=1e-6)
    assert model.predict(1440, 200) == pytest.approx(served(1440, 200), rel=1e-6)
    assert model.predict(1440, 200) > 2 * model.predict(4000, 40) - BASE


def test_the_upper_estimate_covers_what_it_saw_and_is_no_looser_than_the_noise():
    rng = random.Random(2)
    model = ServiceModel()
    seen = seed001_like(rng, 64, noise=0.3)
    for p, o, s in seen:
        model.add(p, o, s)
    assert all(model.predict(p, o) >= s - 1e-9 for p, o, s in seen)
    # Held out, from the same replica: covered nearly always, and never by more than the
    # noise's width over the truth (the sum-line's margin was about twice as wide).
    fresh = seed001_like(rng, 400, noise=0.3)
    covered = sum(model.predict(p, o) >= s for p, o, s in fresh)
    assert covered >= 0.95 * len(fresh)
    assert max(model.predict(p, o) - served(p, o) for p, o, _ in fresh) < 0.3 + 0.15


def test_a_slope_the_noise_makes_negative_is_dropped_not_kept():
    model = ServiceModel()
    rng = random.Random(3)
    # Service set by the output alone; long prompts happen to come with short times.
    for _ in range(64):
        p, o = rng.randint(100, 4000), rng.randint(10, 300)
        model.add(p, o, 0.05 * o - 1e-5 * p)
    plane = model.plane()
    assert plane is not None
    assert plane.per_prompt == 0.0
    assert plane.per_output > 0.04
    # So a long prompt is never predicted faster than a short one with the same answer.
    assert model.predict(8000, 100) >= model.predict(100, 100)


def test_time_to_first_token_is_the_same_model_with_no_output():
    model = ServiceModel()
    for p in range(100, 2000, 30):
        model.add(p, 0, 0.01 + 2e-5 * p)
    assert model.predict(1000) == pytest.approx(0.01 + 2e-5 * 1000, rel=1e-6)


def test_a_higher_load_scales_the_prediction_up_never_down():
    model = ServiceModel()
    for p, o, s in seed001_like(random.Random(4), 32, noise=0.0):
        model.add(p, o, s, load=4)
    at4 = model.predict(2000, 100, load=4)
    assert model.predict(2000, 100, load=8) == pytest.approx(2 * at4)
    assert model.predict(2000, 100, load=1) == pytest.approx(at4)


def test_no_samples_predict_nothing():
    model = ServiceModel()
    assert model.predict(1000, 100) == 0.0
    assert model.plane() is None


def test_the_model_views_bound_every_replica_and_follow_a_replica_that_goes():
    fast, slow = ServiceModel(), ServiceModel()
    for p, o, s in seed001_like(random.Random(5), 32, noise=0.0):
        fast.add(p, o, s)
        slow.add(p, o, 3 * s)
    views = PredictMax()
    for name, model in (("fast", fast), ("slow", slow)):
        plane = model.plane()
        assert plane is not None
        views.set(name, *plane)
    assert views.predict(2000, 100) >= slow.predict(2000, 100) - 1e-9
    views.remove("slow")
    assert views.predict(2000, 100) == pytest.approx(fast.predict(2000, 100))
    views.remove("fast")
    assert views.predict(2000, 100) == 0.0


def _served_beside(model: ServiceModel, slope: float, rng: random.Random, n: int = 64) -> None:
    """`n` completions served beside 2-10 others, each taking ``1 + slope * (ran / 6 - 1)``
    times its unloaded service, with 5% noise."""
    for _ in range(n):
        p, o = rng.randint(1400, 4000), rng.randint(40, 200)
        ran = rng.uniform(2, 10)
        seconds = served(p, o) * (1 + slope * (ran / 6 - 1)) * rng.uniform(0.975, 1.025)
        model.add(p, o, seconds, load=6, ran=ran)


@pytest.mark.parametrize("slope", [0.0, 0.5, 1.0])
def test_the_service_slope_in_the_load_is_learned_from_its_spread(slope: float) -> None:
    """Past a replica's knee service grows in proportion to what runs beside it (1);
    the real vLLM at seed 001's size serves a 200-token answer about as fast at 4 as at 8
    (0). The estimate is an upper one (two standard errors): it may say more, never
    much less."""
    model = ServiceModel()
    _served_beside(model, slope, random.Random(3))
    assert slope <= model.elasticity() <= slope + 0.15


def test_the_service_slope_is_proportional_until_the_loads_spread_and_kept_when_they_stop():
    model = ServiceModel()
    for p, o, s in seed001_like(random.Random(1), 64, noise=0.01):
        model.add(p, o, s, load=6, ran=6)
    assert model.elasticity() == 1.0  # no spread, no evidence: in proportion
    _served_beside(model, 0.0, random.Random(4))
    assert model.elasticity() < 0.15
    # A limit that holds still (every sample at one load) is no evidence against it.
    for p, o, s in seed001_like(random.Random(2), 64, noise=0.01):
        model.add(p, o, s, load=6, ran=6)
    assert model.elasticity() < 0.15


@pytest.mark.parametrize("slope", [0.0, 0.5, 1.0])
def test_a_requests_service_alone_is_its_service_less_what_the_load_adds(slope: float) -> None:
    """What the learned limit cannot take away: the service with nothing beside it. The
    real vLLM's case (0): as long as at the load; past a knee (1): a sixth of it at six.
    Low rather than high (the elasticity is an upper estimate): an aim it widens
    (admission/learned/latency.py) is never wider than the request's own service allows."""
    model = ServiceModel()
    _served_beside(model, slope, random.Random(3))
    for p, o in ((1400, 40), (4000, 200), (2500, 120)):
        truth = served(p, o) * (1 - slope * 5 / 6)
        assert truth * (1 - 0.15 * 5 / 6) - 0.05 <= model.alone(p, o) <= truth * 1.05 + 0.01
    assert ServiceModel().alone(1000, 100) == 0.0


def _elasticity_two_passes(samples: list[tuple[int, int, float, float]], model: ServiceModel):
    """The elasticity as its docstring defines it, in the plain two passes: relative load
    x against relative service e over the plane less its margin, the slope through the
    origin plus two standard errors of its residuals."""
    plane = model.plane(1.0)
    assert plane is not None
    base = plane.base - model._margin  # the fitted plane less its margin
    mean = sum(s[3] for s in samples) / len(samples)
    pairs = []
    for p, o, y, ran in samples:
        typical = base + plane.per_prompt * p + plane.per_output * o
        if typical > 0:
            pairs.append((ran / mean - 1.0, y / typical - 1.0))
    sxx = sum(x * x for x, _ in pairs)
    k = sum(x * e for x, e in pairs) / sxx
    spread = sum((e - k * x) ** 2 for x, e in pairs) / (len(pairs) - 2)
    return min(1.0, max(0.0, k + 2.0 * (spread / sxx) ** 0.5))


@pytest.mark.parametrize("seed", range(6))
def test_the_one_pass_fit_is_the_two_pass_definition(seed: int) -> None:
    """The refit takes the margin and the elasticity's sums in one pass (it runs per
    completion, on the hot path): the same numbers as the definitions, to rounding."""
    rng = random.Random(seed)
    model = ServiceModel()
    samples = []
    for _ in range(64):
        p, o, ran = rng.randint(100, 4000), rng.randint(1, 400), rng.uniform(1.0, 24.0)
        y = served(p, o) * (1 + rng.uniform(0.0, 1.0) * (ran / 8 - 1)) * rng.uniform(0.9, 1.1)
        model.add(p, o, y, load=ran, ran=ran)
        samples.append((p, o, y, ran))
    plane = model.plane(1.0)
    assert plane is not None
    worst = max(
        y - (plane.base + plane.per_prompt * p + plane.per_output * o) for p, o, y, _ in samples
    )
    assert abs(worst) < 1e-9  # the margin lifts the plane onto its worst sample
    assert model.elasticity() == pytest.approx(_elasticity_two_passes(samples, model), rel=1e-9)


def test_a_column_that_stops_varying_has_no_slope_at_all() -> None:
    """The plane's sums slide with the window: once the prompts that varied have left it,
    the prompt's sums are exactly those of one length, and no slope is fitted to the
    rounding a sliding float sum would leave (a slope of noise over noise)."""
    rng = random.Random(5)
    model = ServiceModel()
    for _ in range(200):
        p, o = rng.randint(100, 40_000), rng.randint(1, 400)
        model.add(p, o, served(p, o) * rng.uniform(0.9, 1.1))
    for _ in range(64):
        o = rng.randint(1, 400)
        model.add(3_000, o, served(3_000, o) * rng.uniform(0.9, 1.1))
    plane = model.plane()
    assert plane is not None
    assert plane.per_prompt == 0.0
    assert plane.per_output == pytest.approx(PER_OUTPUT, rel=0.1)
