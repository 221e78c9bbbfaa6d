"""Admission calls routing (a Router with hooks) and is not blocked by its rejections."""

from __future__ import annotations

from collections.abc import Sequence

from admission.config import AdmissionConfig
from admission.controller import AdmissionController
from admission.types import Admit, Queued
from routing.scheduler import build_router
from routing.types import Candidate, RouteRequest
from tests.admission.helpers import replica, request


class RejectsOne:
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


def make(router: object) -> AdmissionController:
    cfg = AdmissionConfig(headroom=0.0, learn_limit=False, retry_jitter=0.0)
    return AdmissionController(cfg, router)  # type: ignore[arg-type]


def test_a_request_every_filter_rejects_does_not_block_the_queue() -> None:
    router = RejectsOne()
    ctl = make(router)
    ctl.upsert_replica(replica("r1", 1000), 0.0)
    # Rejected at submit: queued, and later requests still go straight in.
    assert isinstance(ctl.submit(request("bad-1", 100, 100), 1.0), Queued)
    assert isinstance(ctl.submit(request("ok-1", 400, 400), 1.0), Admit)
    # Behind a full replica: the rejected head does not hold up the one behind it.
    assert isinstance(ctl.submit(request("ok-2", 300, 300), 2.0), Queued)
    assert ctl.queue_depth("m") == 2
    admits = ctl.release("ok-1", 3.0)
    assert [a.request_id for a in admits] == ["ok-2"]
    assert ctl.queue_depth("m") == 1  # bad-1 still waits for routing's say
    ctl.release("ok-2", 4.0)
    ctl.release("bad-1", 5.0)  # leaves the queue
    assert ctl.queue_depth() == 0 and ctl.reserved_tokens() == 0


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
    assert (c.engine_waiting, c.kv_usage, c.prefix_cache_hits_total) == (2, 0.3, 50.0)
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
    first = ctl.submit(request("s-1", 100, 100), 1.0)
    assert isinstance(first, Admit)
    for i in range(2, 6):
        r = request(f"s-{i}", 100, 100)
        r.session = "sess"
        if i == 2:
            ctl.release("s-1", 1.5)
        got = ctl.submit(r, float(i))
        assert isinstance(got, Admit)
        if i == 2:
            home = got.replica
        assert got.replica == home  # affinity beats the emptier replica
