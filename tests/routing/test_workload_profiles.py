"""Workload-aware routing by default (no ``routing:`` section): each request's class
picks its scoring, a model's own profile still wins, and every decision is counted by
(workload, scoring); and the ``prefix_load`` trade, in which prefill pending on a
replica (tokens placed there and not yet through their first token) spreads cold first
turns instead of piling them onto the warmest replica."""

from __future__ import annotations

import pytest

from routing.config import RoutingConfig
from routing.prefix import block_hashes
from routing.scheduler import build_router
from routing.types import Candidate, ReplicaState, RouteRequest

SYSTEM = "You are an agent. Tools: read(path), write(path, text), run(). " * 40  # 2.5k chars


def cand(name: str, free: int = 100_000, cap: int = 100_000, **kw: object) -> Candidate:
    engine = ReplicaState(name, "http://127.0.0.1")
    speculative = bool(kw.pop("speculative", False))
    return Candidate(
        name, free, cap, int(kw.pop("running", 0)), None, engine=engine, speculative=speculative
    )


def route(rid: str, workload: str, text: str = "", model: str = "m") -> RouteRequest:
    hashes = block_hashes(text, 64, 512) if text else ()
    return RouteRequest(
        rid, model, 100, workload=workload, prefix_hashes=hashes, prompt_tokens=len(text) // 4
    )


def test_without_a_routing_section_each_class_gets_its_own_scoring() -> None:
    router = build_router(seed=1)
    spec, roomy = cand("spec", free=60_000, speculative=True), cand("roomy", free=90_000)
    # Coding goes to the speculating replica while its batch is small, chat to headroom.
    assert router.pick(route("c1", "coding"), [spec, roomy]) is spec
    assert router.pick(route("h1", "chat"), [spec, roomy]) is roomy
    # Agentic: the replica holding the prompt's prefix, though the other has more room
    # (less than the prefill it saves).
    warm, cold = cand("warm", free=99_800), cand("cold", free=100_000)
    first = route("a1", "agentic", SYSTEM + "task one")
    router.placed(first, warm, 0.0)
    router.released("a1", "warm", 1.0)
    assert router.pick(route("a2", "agentic", SYSTEM + "task two"), [warm, cold]) is warm
    assert router.route_decisions == {
        ("coding", "speculation+running_headroom+kv_headroom"): 1,
        ("chat", "kv_headroom"): 1,
        ("agentic", "prefix_load+session_affinity"): 1,
    }


def test_a_model_profile_wins_and_a_named_default_means_every_class() -> None:
    cfg = RoutingConfig.model_validate(
        {"profiles": {"agent-model": {"scorers": [{"name": "kv_headroom"}]}}}
    )
    router = build_router(cfg, seed=1)
    warm, cold = cand("warm", free=70_000), cand("cold", free=100_000)
    router.placed(route("a1", "agentic", SYSTEM, model="agent-model"), warm, 0.0)
    got = router.pick(route("a2", "agentic", SYSTEM + "x", model="agent-model"), [warm, cold])
    assert got is cold  # the model's own profile: headroom alone
    assert router.route_decisions == {("agentic", "kv_headroom"): 1}
    # A config that names a default profile means it for every class.
    named = RoutingConfig.model_validate({"default_profile": {}})
    assert named.workloads == {}
    assert build_router(named).per_workload == {}
    assert set(RoutingConfig().workloads) == {"coding", "agentic", "chat"}
    with pytest.raises(ValueError, match="unknown workload 'batch'"):
        RoutingConfig.model_validate({"workloads": {"batch": {}}})


def test_the_route_of_a_placed_request_is_kept_until_its_release() -> None:
    router = build_router(seed=1)
    a = cand("a")
    req = route("r1", "chat")
    assert router.pick(req, [a]) is a
    router.placed(req, a, 0.0)
    assert router.route_of("r1") == "chat/kv_headroom/score"
    router.released("r1", "a", 1.0)
    assert router.route_of("r1") is None


def test_prefill_pending_spreads_cold_first_turns_and_the_first_token_clears_it() -> None:
    """Four new sessions share a system prompt replica `a` already holds. A prefix score
    alone sends all four there; prefix_load sends them there only while the prefill it
    saves outweighs the prefill already waiting there, and once their first tokens came,
    `a` is the cheap choice again."""
    router = build_router(seed=1)
    a, b = cand("a"), cand("b")
    router.placed(route("seed", "agentic", SYSTEM), a, 0.0)
    router.released("seed", "a", 0.1)
    user = "Please look at this new repository and tell me what it does. " * 60  # 3.7k
    chosen = []
    for i in range(4):
        req = route(f"s{i}", "agentic", SYSTEM + f"session {i}: " + user)
        got = router.pick(req, [a, b])
        assert got is not None
        router.placed(req, got, 1.0)
        chosen.append(got.name)
    assert chosen[0] == "a" and "b" in chosen, chosen
    scorer = router.per_workload["agentic"].scorers[0][0]
    assert scorer.pending.tokens("a") > 0 and scorer.pending.tokens("b") > 0  # type: ignore[attr-defined]
    for i in range(4):
        router.first_token(f"s{i}", 2.0)
    assert scorer.pending.requests() == 0  # type: ignore[attr-defined]
    req = route("s9", "agentic", SYSTEM + "session 9: " + user)
    assert router.pick(req, [a, b]) is a
    for i in range(4):
        router.released(f"s{i}", chosen[i], 3.0)
    assert scorer.pending.requests() == 0  # type: ignore[attr-defined]


def test_a_release_before_any_first_token_clears_the_pending_prefill() -> None:
    router = build_router(seed=1)
    a = cand("a")
    req = route("r", "agentic", SYSTEM)
    router.placed(req, a, 0.0)
    scorer = router.per_workload["agentic"].scorers[0][0]
    assert scorer.pending.tokens("a") == req.prompt_tokens  # type: ignore[attr-defined]
    router.released("r", "a", 1.0)  # a non-stream request, or one that failed
    assert scorer.pending.tokens("a") == 0  # type: ignore[attr-defined]
