"""Admission calls routing (a Router with hooks) and is not blocked by its rejections."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from admission.config import AdmissionConfig
from admission.controller import AdmissionController
from admission.types import Admit, Queued
from routing.scheduler import build_router
from routing.types import Candidate, Router, RouteRequest
from tests.admission.helpers import replica, request


class RejectsOne(Router):
    """Rejects every replica for request ids starting with "bad"; records the hooks."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []
        self.seen: list[Candidate] = []

    def pick(self, req: RouteRequest, candidates: Sequence[Candidate]) -> Candidate | None:
        self.seen = list(candidates)
        if req.request_id.startswith("bad"):
            return None
        return max(candidates, key=lambda c: c.free_tokens)

    def placed(self, req: RouteRequest, candidate: Candidate, now: float) -> None:
        self.events.append(("placed", req.request_id, candidate.name))

    def released(self, request_id: str, replica: str, now: float) -> None:
        self.events.append(("released", request_id, replica))


def make(router: Router) -> AdmissionController:
    cfg = AdmissionConfig(headroom=0.0, learn_limit=False, retry_jitter=0.0)
    return AdmissionController(cfg, router)


def test_a_request_every_filter_rejects_does_not_block_the_queue() -> None:
    router = RejectsOne()
    ctl = make(router)
    ctl.upsert_replica(replica("r1", 1000), 0.0)
    # Rejected at submit: queued, and later requests still go straight in.
    assert isinstance(ctl.submit(request("bad-1", 100, 100), 1.0).verdict, Queued)
    assert isinstance(ctl.submit(request("ok-1", 400, 400), 1.0).verdict, Admit)
    # Behind a full replica: the rejected head does not hold up the one behind it.
    assert isinstance(ctl.submit(request("ok-2", 300, 300), 2.0).verdict, Queued)
    assert ctl.report.queue_depth("m") == 2
    admits = ctl.release("ok-1", 3.0)
    assert [a.request_id for a in admits] == ["ok-2"]
    assert ctl.report.queue_depth("m") == 1  # bad-1 still waits for routing's say
    ctl.release("ok-2", 4.0)
    ctl.release("bad-1", 5.0)  # leaves the queue
    assert ctl.report.queue_depth() == 0 and ctl.report.reserved_tokens() == 0


def test_hooks_on_placement_and_release_and_the_live_view() -> None:
    router = RejectsOne()
    ctl = make(router)
    state = replica("r1", 1000, max_running=4)
    state.engine_waiting = 2
    state.kv_usage = 0.3
    state.prefix_cache_hits_total = 50.0
    state.updated_at = 10.0
    ctl.upsert_replica(state, 10.0)
    ctl.submit(request("ok-1", 100, 100), 16.0)
    (c,) = router.seen
    assert (c.free_tokens, c.effective_capacity, c.running, c.max_running) == (1000, 1000, 0, 4)
    assert (c.engine.engine_waiting, c.engine.kv_usage, c.engine.prefix_cache_hits_total) == (
        2,
        0.3,
        50.0,
    )
    assert c.engine is state  # referenced, not copied
    assert c.view_age_s == 6.0
    ctl.submit(request("ok-2", 100, 100), 16.0)
    assert router.seen[0].free_tokens == 800 and router.seen[0].running == 1
    ctl.release("ok-1", 17.0)
    assert router.events == [
        ("placed", "ok-1", "r1"),
        ("placed", "ok-2", "r1"),
        ("released", "ok-1", "r1"),
    ]
    ctl.release("ok-2", 18.0)


def test_scheduling_router_places_sessions_through_admission() -> None:
    from routing.config import RoutingConfig

    cfg = RoutingConfig.model_validate(
        {
            "default_profile": {
                "scorers": [
                    {"name": "session_affinity", "weight": 2.0},
                    {"name": "kv_headroom", "weight": 1.0},
                ]
            }
        }
    )
    ctl = make(build_router(cfg, seed=3))
    for name in ("a", "b"):
        ctl.upsert_replica(replica(name, 10_000), 0.0)
    first = ctl.submit(request("s-1", 100, 100), 1.0).verdict
    assert isinstance(first, Admit)
    for i in range(2, 6):
        r = request(f"s-{i}", 100, 100)
        r.session = "sess"
        if i == 2:
            ctl.release("s-1", 1.5)
        got = ctl.submit(r, float(i)).verdict
        assert isinstance(got, Admit)
        if i == 2:
            home = got.replica
        assert got.replica == home  # affinity beats the emptier replica


class WarmOn(Router):
    """Prefers `warm` (holding `cached` prompt tokens) whenever it is a candidate."""

    def __init__(self, warm: str, cached: int) -> None:
        self.warm_name = warm
        self.cached = cached

    def pick(self, req: RouteRequest, candidates: Sequence[Candidate]) -> Candidate | None:
        for c in candidates:
            if c.name == self.warm_name:
                return c
        return candidates[0]

    def hints(self, req: RouteRequest) -> list[str]:
        return [self.warm_name]

    def warm(self, req: RouteRequest) -> list[tuple[str, int]]:
        return [(self.warm_name, self.cached)]


def _teach(ctl: AdmissionController, name: str, now: float, *, ttft_per_token: float) -> float:
    """Run requests on replica `name` alone so it learns a TTFT line and a drain rate."""
    from admission.types import Completion

    for i in range(12):
        rid = f"teach-{name}-{i}"
        prompt = 100 + 50 * i
        admit = ctl.submit(request(rid, prompt, 10), now).verdict
        assert isinstance(admit, Admit) and admit.replica == name
        now += 0.5
        ttft = 0.01 + ttft_per_token * prompt
        ctl.release(rid, now, Completion(ttft_s=ttft, service_s=ttft + 0.1, prompt_tokens=prompt))
    return now


def _two_replicas(cached: int) -> AdmissionController:
    ctl = make(WarmOn("warm", cached))
    ctl.upsert_replica(replica("warm", 2000, max_running=1), 0.0)
    ctl.upsert_replica(replica("cold", 2000, max_running=1), 0.0)
    return ctl


def _req_with_prefix(rid: str, prompt: int):  # type: ignore[no-untyped-def]
    from dataclasses import replace

    return replace(request(rid, prompt, 10), prefix_hashes=(1, 2, 3))


def test_expected_ttft_waits_for_a_warm_replica_when_the_cold_prefill_is_longer() -> None:
    ctl = _two_replicas(cached=1500)
    now = 0.0
    ctl.mark_unready("cold", now)
    now = _teach(ctl, "warm", now, ttft_per_token=0.002)
    ctl.upsert_replica(replica("cold", 2000, max_running=1), now)
    ctl.mark_unready("warm", now)
    now = _teach(ctl, "cold", now, ttft_per_token=0.002)
    ctl.upsert_replica(replica("warm", 2000, max_running=1), now)
    # The warm replica is busy (its one slot taken); the cold one is free.
    assert ctl.submit(request("busy", 100, 10), now).verdict.replica == "warm"  # type: ignore[union-attr]
    # 1600-token prompt, 1500 cached on warm: ~0.2 s there after a short wait, against
    # ~3.2 s of prefill on the cold one: it waits for warm (queued, blocking nobody).
    verdict = ctl.submit(_req_with_prefix("agent", 1600), now).verdict
    assert isinstance(verdict, Queued)
    assert ctl.report.ttft_choices == {"expected_ttft_wait": 1}
    other = ctl.submit(request("other", 100, 10), now).verdict  # the cold replica is not blocked
    assert isinstance(other, Admit) and other.replica == "cold"
    ctl.release("other", now + 0.1)
    admits = ctl.release("busy", now + 0.2)
    assert [(a.request_id, a.replica) for a in admits] == [("agent", "warm")]
    ctl.release("agent", now + 1.0)
    assert ctl.report.reserved_tokens() == 0


def test_expected_ttft_starts_cold_when_little_is_cached() -> None:
    ctl = _two_replicas(cached=100)
    now = 0.0
    ctl.mark_unready("cold", now)
    now = _teach(ctl, "warm", now, ttft_per_token=0.002)
    ctl.upsert_replica(replica("cold", 2000, max_running=1), now)
    ctl.mark_unready("warm", now)
    now = _teach(ctl, "cold", now, ttft_per_token=0.002)
    ctl.upsert_replica(replica("warm", 2000, max_running=1), now)
    assert ctl.submit(request("busy", 1500, 10), now).verdict.replica == "warm"  # type: ignore[union-attr]
    verdict = ctl.submit(_req_with_prefix("agent", 400), now).verdict
    assert isinstance(verdict, Admit) and verdict.replica == "cold"
    assert ctl.report.ttft_choices == {"expected_ttft_cold": 1}
    ctl.release("busy", now + 1.0)
    ctl.release("agent", now + 1.0)


def test_speculative_label_wins_over_the_engine() -> None:
    router = RejectsOne()
    ctl = make(router)
    st = replica("r1", 1000)
    st.speculative = True
    ctl.upsert_replica(st, 0.0)
    ctl.submit(request("ok-1", 10, 10), 0.0)
    assert router.seen[0].speculative is True
    st.labels = {"speculative": "false"}
    ctl.upsert_replica(st, 1.0)
    ctl.submit(request("ok-2", 10, 10), 1.0)
    assert router.seen[0].speculative is False
    st.labels, st.speculative = {"speculative": "true"}, None
    ctl.upsert_replica(st, 2.0)
    ctl.submit(request("ok-3", 10, 10), 2.0)
    assert router.seen[0].speculative is True
    for rid in ("ok-1", "ok-2", "ok-3"):
        ctl.release(rid, 3.0)


def test_shortlist_choice_matches_a_full_scan_and_filters_stay_exact() -> None:
    """With many replicas admission scores a shortlist; the pick is the one a full scan
    of the profile would make, and a filter that rejects the shortlist is asked again
    with every fitting replica."""
    from routing.config import RoutingConfig
    from routing.registry import register

    class KeepLast:
        def filter(self, req: RouteRequest, cands: Sequence[Candidate]) -> list[Candidate]:
            return [c for c in cands if c.name == "r39"]

    register("filter", "test_keep_r39")(lambda params, env: KeepLast())
    router = build_router(RoutingConfig(), seed=3)
    ctl = make(router)
    for i in range(40):
        ctl.upsert_replica(replica(f"r{i}", 1000 + 10 * i), 0.0)
    # Most free fraction first: all empty, so ties; reserve some and check the choice is
    # the replica with the largest free fraction, as a full scan would give.
    for k in range(30):
        admit = ctl.submit(request(f"q{k}", 50 + k, 50), 1.0).verdict
        assert isinstance(admit, Admit)
        usage = {u.name: u for u in ctl.report.replica_usage()}
        chosen = usage[admit.replica]
        before = (
            chosen.effective_capacity_tokens - chosen.reserved_tokens + admit.reserved_tokens
        ) / (chosen.effective_capacity_tokens)
        best = max(
            (u.effective_capacity_tokens - u.reserved_tokens) / u.effective_capacity_tokens
            for u in usage.values()
            if u.name != admit.replica
        )
        assert before >= best - 1e-9
    filtered = build_router(
        RoutingConfig.model_validate({"default_profile": {"filters": [{"name": "test_keep_r39"}]}})
    )
    ctl2 = make(filtered)
    for i in range(40):
        ctl2.upsert_replica(replica(f"r{i}", 1000), 0.0)
    admit = ctl2.submit(request("only", 10, 10), 1.0).verdict
    assert isinstance(admit, Admit) and admit.replica == "r39"
    for k in range(30):
        ctl.release(f"q{k}", 2.0)
    ctl2.release("only", 2.0)
    assert ctl.report.reserved_tokens() == 0 and ctl2.report.reserved_tokens() == 0


def test_candidates_carry_a_predicted_itl_from_the_replicas_streams() -> None:
    """Admission fills `Candidate.predicted_itl_s` from the replica's own streams
    (admission.learned.itl: the mean inter-token gap by the number running) for a request with an
    ITL target, the batch with it added; None before any stream completed there, and None
    for a request without a target (nothing reads it)."""
    from dataclasses import replace

    from admission.types import Completion

    router = RejectsOne()
    ctl = make(router)
    ctl.upsert_replica(replica("r1", 100_000), 0.0)
    ctl.submit(replace(request("first", 10, 10), itl_target_s=0.1), 0.0)
    assert router.seen[0].predicted_itl_s is None
    ctl.release("first", 0.5)
    now = 1.0
    # Streams that ran alone, 15 ms between tokens.
    for i in range(12):
        assert isinstance(ctl.submit(request(f"alone-{i}", 10, 10), now).verdict, Admit)
        ctl.release(f"alone-{i}", now + 1.0, Completion(itl_s=0.015, ttft_s=0.1, prompt_tokens=10))
        now += 2.0
    ctl.submit(replace(request("probe-1", 10, 10), itl_target_s=0.1), now)
    assert router.seen[0].predicted_itl_s == pytest.approx(0.015, abs=1e-6)  # alone
    ctl.submit(request("probe-none", 10, 10), now)
    assert router.seen[0].predicted_itl_s is None  # no target: not computed
    for rid in ["probe-1", "probe-none"]:
        ctl.release(rid, now + 1.0)
    assert ctl.report.reserved_tokens() == 0
