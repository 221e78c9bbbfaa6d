"""A profile's filter -> weighted score -> pick, and the max-score picker's seeded
random tie-break."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest

from routing.pickers.max_score import MaxScorePicker
from routing.scheduler import Profile, default_profile
from routing.scorers.kv_headroom import KVHeadroomScorer
from routing.types import Candidate, RouteRequest

REQ = RouteRequest(request_id="r", model="m", need_tokens=100)


def cand(name: str, free: int, cap: int = 1000, **labels: str) -> Candidate:
    return Candidate(
        name=name,
        free_tokens=free,
        effective_capacity=cap,
        running=0,
        max_running=None,
        labels=labels,
    )


def test_most_headroom_wins_as_a_fraction_of_the_pool() -> None:
    picker = default_profile(seed=1)
    # b has fewer free tokens but a larger free fraction.
    chosen = picker.pick(REQ, [cand("a", 600, 1000), cand("b", 500, 500), cand("c", 100, 1000)])
    assert chosen is not None and chosen.name == "b"
    assert picker.pick(REQ, []) is None


def test_ties_are_broken_randomly_but_deterministically_per_seed() -> None:
    tied = [cand(n, 500) for n in "abcd"]
    runs = []
    for _ in range(2):
        picker = default_profile(seed=42)
        runs.append([picker.pick(REQ, tied).name for _ in range(200)])  # type: ignore[union-attr]
    assert runs[0] == runs[1]
    counts = Counter(runs[0])
    assert set(counts) == set("abcd")
    assert min(counts.values()) > 20  # spread, not always the first
    other = default_profile(seed=43)
    assert [other.pick(REQ, tied).name for _ in range(200)] != runs[0]  # type: ignore[union-attr]


def test_filters_and_weighted_scorers() -> None:
    class Speculative:
        name = "speculative"

        def score(self, req: RouteRequest, candidate: Candidate) -> float:
            return 1.0 if candidate.labels.get("speculative") == "true" else 0.0

    class NotBanned:
        def filter(self, req: RouteRequest, cands: Sequence[Candidate]) -> list[Candidate]:
            return [c for c in cands if c.name != "banned"]

    picker = Profile(
        "p",
        [NotBanned()],
        [(KVHeadroomScorer(), 1.0), (Speculative(), 2.0)],
        MaxScorePicker(seed=0),
    )
    cands = [cand("banned", 1000), cand("roomy", 900), cand("spec", 300, speculative="true")]
    chosen = picker.pick(REQ, cands)
    assert chosen is not None and chosen.name == "spec"
    assert picker.score(REQ, cands[1]) == pytest.approx(0.9)
    assert picker.pick(REQ, [cand("banned", 1000)]) is None


def test_headroom_score_is_clamped_to_unit_interval() -> None:
    scorer = KVHeadroomScorer()
    assert scorer.score(REQ, cand("a", -50, 1000)) == 0.0
    assert scorer.score(REQ, cand("a", 10, 0)) == 0.0
    assert scorer.score(REQ, cand("a", 2000, 1000)) == 1.0


def test_a_factory_that_builds_no_scorer_is_a_config_error() -> None:
    from pydantic import ValidationError

    from routing.config import RoutingConfig
    from routing.registry import register

    class NoScore:
        def rank(self, req: RouteRequest, candidate: Candidate) -> float:
            return 1.0

    register("scorer", "test_no_score")(lambda params, env: NoScore())
    with pytest.raises(ValidationError, match="NoScore is no Scorer"):
        RoutingConfig.model_validate({"default_profile": {"scorers": [{"name": "test_no_score"}]}})
