"""The routing pipeline: each scorer, the prefix index, session affinity, profiles from
config (bad names are errors naming the field) and the placement hooks."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from routing.config import RoutingConfig
from routing.pickers.max_score import MaxScorePicker
from routing.plugin import PluginEnv
from routing.prefix import PrefixIndex, block_hashes
from routing.registry import build
from routing.scheduler import Profile, build_router
from routing.scorers.kv_headroom import KVHeadroomScorer
from routing.scorers.prefix_cache import PrefixCacheScorer
from routing.scorers.session_affinity import SessionAffinityScorer
from routing.types import Candidate, ReplicaState, RouteRequest


def cand(name: str, free: int = 500, cap: int = 1000, **kw: object) -> Candidate:
    """A candidate; keyword arguments that name an engine gauge go to its engine view."""
    engine = ReplicaState(name, "http://127.0.0.1")
    own = Candidate.__dataclass_fields__
    for key in [k for k in kw if k in ReplicaState.__dataclass_fields__ and k not in own]:
        setattr(engine, key, kw.pop(key))
    running, max_running = kw.pop("running", 0), kw.pop("max_running", None)
    return Candidate(name, free, cap, running, max_running, engine=engine, **kw)  # type: ignore[arg-type]


def req(
    text: str = "", session: str | None = None, now: float = 0.0, rid: str = "r"
) -> RouteRequest:
    return RouteRequest(
        rid, "m", 10, prefix_hashes=block_hashes(text, 8, 512), session=session, now=now
    )


def scorer(name: str, **params: object) -> object:
    return build("scorer", name, params, PluginEnv(block_chars=8))


# ------------------------------------------------------------------ scorers
def test_load_scorers_map_into_unit_interval() -> None:
    r = req()
    kv = scorer("kv_headroom")
    assert kv.score(r, cand("a", 250, 1000)) == pytest.approx(0.25)  # type: ignore[attr-defined]
    assert kv.score(r, cand("a", -5, 1000)) == 0.0  # type: ignore[attr-defined]
    running = scorer("running_headroom")
    assert running.score(r, cand("a", running=3, max_running=4)) == pytest.approx(0.25)  # type: ignore[attr-defined]
    assert running.score(r, cand("a", running=1)) == pytest.approx(0.5)  # type: ignore[attr-defined]
    queue = scorer("engine_queue")
    assert queue.score(r, cand("a", engine_waiting=3)) == pytest.approx(0.25)  # type: ignore[attr-defined]
    usage = scorer("engine_kv_usage")
    assert usage.score(r, cand("a", kv_usage=0.8)) == pytest.approx(0.2)  # type: ignore[attr-defined]


def test_stale_view_lowers_the_score_but_never_adds_room() -> None:
    router = build_router(
        RoutingConfig.model_validate({"default_profile": {"scorers": [{"name": "engine_queue"}]}}),
        discovery_interval_s=1.0,
        seed=0,
    )
    fresh = cand("fresh", engine_waiting=1)  # 0.5
    stale = cand("stale", engine_waiting=0, view_age_s=10.0)  # 1.0, halved
    profile = router.default
    assert profile.score(req(), stale) == pytest.approx(0.5)
    assert profile.score(req(), fresh) == pytest.approx(0.5)
    stale.view_age_s = 2.9  # within 3 intervals
    assert profile.score(req(), stale) == pytest.approx(1.0)
    assert router.pick(req(), [fresh, stale]) is stale


# ------------------------------------------------------------------ prefix index
def test_block_hashes_chain_covers_the_parent() -> None:
    a = block_hashes("x" * 8 + "y" * 8 + "z" * 5, 8, 512)
    assert len(a) == 2  # only full blocks
    b = block_hashes("w" * 8 + "y" * 8, 8, 512)
    assert a[1] != b[1]  # same block, different parent
    assert block_hashes("x" * 8 + "y" * 8 + "q" * 8, 8, 512)[:2] == a
    assert len(block_hashes("a" * 800, 8, max_blocks=10)) == 10


_TEXTS = st.one_of(st.text(st.characters(max_codepoint=127), max_size=400), st.text(max_size=400))


@given(_TEXTS, st.integers(1, 40), st.integers(0, 30))
@settings(max_examples=200, deadline=None)
def test_block_hashes_are_the_same_whatever_the_text(text: str, block: int, most: int) -> None:
    """The one-encoding path for ASCII text gives the chain of hashing each block's
    characters, as any other text gets."""
    import xxhash

    expect = []
    parent = 0
    for i in range(min(len(text) // block, most)):
        chunk = text[i * block : (i + 1) * block].encode("utf-8", "replace")
        parent = xxhash.xxh3_64_intdigest(chunk, parent)
        expect.append(parent)
    assert block_hashes(text, block, most) == tuple(expect)


def test_prefix_index_walk_stops_at_first_miss() -> None:
    idx = PrefixIndex(100)
    chain = block_hashes("abcdefgh" * 4, 8, 512)
    idx.insert(chain[:2])
    idx.insert(chain[3:])  # block 3 present, block 2 missing
    assert idx.match(chain) == 2
    assert idx.match(()) == 0
    assert idx.match(block_hashes("zzzzzzzz" * 4, 8, 512)) == 0


def test_prefix_index_is_lru_bounded_and_evicts_leaves_first() -> None:
    idx = PrefixIndex(4)
    old = block_hashes("o" * 8 * 3, 8, 512)
    new = block_hashes("n" * 8 * 3, 8, 512)
    idx.insert(old)
    idx.insert(new)
    assert len(idx) == 4
    assert idx.match(new) == 3
    assert idx.match(old) == 1  # the old chain kept its root, lost its leaves
    idx.resize(2)
    assert len(idx) == 2


def test_prefix_scorer_fraction_and_pool_sized_index() -> None:
    s = scorer("prefix_cache", chars_per_token=1.0, max_blocks_per_replica=1000)
    assert isinstance(s, PrefixCacheScorer)
    text = "turn one of a long agentic session" * 4
    r = req(text)
    a, b = cand("a", cap=200), cand("b", cap=200)
    assert s.score(r, a) == 0.0
    s.placed(r, a, 0.0)
    assert s.score(r, a) == 1.0 and s.score(r, b) == 0.0
    longer = req(text + "and the next turn" * 4)
    assert 0.5 < s.score(longer, a) < 1.0
    # 200 tokens x 1 char / 8 chars per block: at most 25 blocks for this replica
    assert s.index("a").capacity == 25  # type: ignore[union-attr]
    assert s.indexed_blocks() == 17
    s.placed(req("another session entirely " * 20), a, 1.0)
    assert s.indexed_blocks() == 25  # bounded by the pool


def test_prefix_with_load_term_does_not_pile_onto_the_warm_replica() -> None:
    cfg = RoutingConfig.model_validate(
        {
            "block_chars": 8,
            "default_profile": {
                "scorers": [
                    {"name": "prefix_cache", "weight": 1.0},
                    {"name": "running_headroom", "weight": 2.0},
                ]
            },
        }
    )
    router = build_router(cfg, seed=1)
    assert router.needs_prefix
    r = req("shared system prompt " * 8)
    warm, cold = cand("warm", max_running=4), cand("cold", max_running=4)
    router.placed(r, warm, 0.0)
    assert router.pick(r, [warm, cold]) is warm
    warm.running = 1  # 1 + 2 x 3/4 against 2
    assert router.pick(r, [warm, cold]) is warm
    warm.running = 3  # near its limit: the cold one wins
    assert router.pick(r, [warm, cold]) is cold


# ------------------------------------------------------------------ session affinity
def test_session_affinity_with_ttl() -> None:
    s = scorer("session_affinity", ttl_s=10.0, max_sessions=2)
    assert isinstance(s, SessionAffinityScorer)
    a, b = cand("a"), cand("b")
    s.placed(req(session="s1", now=0.0), a, 0.0)
    assert s.score(req(session="s1", now=5.0), a) == 1.0
    assert s.score(req(session="s1", now=5.0), b) == 0.0
    assert s.score(req(session=None, now=5.0), a) == 0.0
    assert s.score(req(session="s1", now=10.0), a) == 0.0  # expired
    s.placed(req(session="s2", now=11.0), b, 11.0)
    assert s.replica_of("s1", 11.0) is None and len(s) == 1  # expired entries pruned
    s.placed(req(session="s3", now=12.0), a, 12.0)
    s.placed(req(session="s4", now=12.0), a, 12.0)
    assert len(s) == 2 and s.replica_of("s2", 12.0) is None  # bounded


# ------------------------------------------------------------------ profiles from config
def test_default_profile_reproduces_most_headroom_with_seeded_ties() -> None:
    router = build_router(seed=42)
    legacy = Profile("legacy", [], [(KVHeadroomScorer(), 1.0)], MaxScorePicker(seed=42))
    tied = [cand(n, 500) for n in "abcd"]
    ours = [router.pick(req(), tied).name for _ in range(200)]  # type: ignore[union-attr]
    theirs = [legacy.pick(req(), tied).name for _ in range(200)]  # type: ignore[union-attr]
    assert ours == theirs
    assert set(Counter(ours)) == set("abcd")
    assert router.pick(req(), [cand("a", 100), cand("b", 900)]).name == "b"  # type: ignore[union-attr]


def test_per_model_profile_and_label_filter() -> None:
    cfg = RoutingConfig.model_validate(
        {"profiles": {"coder": {"filters": [{"name": "label", "params": {"speculative": "true"}}]}}}
    )
    router = build_router(cfg, seed=0)
    spec = cand("spec", 100, labels={"speculative": "true"})
    plain = cand("plain", 900)
    coder = RouteRequest("r", "coder", 10)
    assert router.pick(coder, [spec, plain]) is spec
    assert router.pick(coder, [plain]) is None  # every candidate rejected
    assert router.pick(RouteRequest("r", "chat", 10), [spec, plain]) is plain


@pytest.mark.parametrize(
    ("data", "where"),
    [
        ({"default_profile": {"scorers": [{"name": "nope"}]}}, "default_profile.scorers.0.name"),
        (
            {"default_profile": {"filters": [{"name": "kv_headroom"}]}},
            "default_profile.filters.0.name",
        ),
        ({"profiles": {"m": {"picker": {"name": "best"}}}}, "profiles.m.picker.name"),
        (
            {"default_profile": {"scorers": [{"name": "prefix_cache", "params": {"x": 1}}]}},
            "default_profile.scorers.0",
        ),
        (
            {"default_profile": {"scorers": [{"name": "kv_headroom", "weight": -1}]}},
            "default_profile.scorers.0.weight",
        ),
    ],
)
def test_bad_profile_is_an_error_naming_the_field(data: dict, where: str) -> None:
    with pytest.raises(ValidationError) as err:
        RoutingConfig.model_validate(data)
    locs = [".".join(str(p) for p in e["loc"]) for e in err.value.errors()]
    assert where in locs, locs


def test_gateway_config_error_names_the_routing_field() -> None:
    from gateway.config import ConfigError, config_from_mapping

    with pytest.raises(ConfigError) as err:
        config_from_mapping(
            {"routing": {"default_profile": {"scorers": [{"name": "nope"}]}}}, env={}
        )
    assert "routing.default_profile.scorers.0.name" in str(err.value)
    assert "unknown scorer 'nope'" in str(err.value)


def test_release_hook_reaches_the_plugin_that_saw_the_placement() -> None:
    from routing.registry import register

    seen: list[tuple[str, str]] = []

    class Tracker:
        name = "test_tracker"

        def score(self, req: RouteRequest, candidate: Candidate) -> float:
            return 0.0

        def placed(self, req: RouteRequest, candidate: Candidate, now: float) -> None:
            seen.append(("placed", candidate.name))

        def released(self, request_id: str, replica: str, now: float) -> None:
            seen.append(("released", replica))

    register("scorer", "test_tracker")(lambda params, env: Tracker())
    cfg = RoutingConfig.model_validate({"default_profile": {"scorers": [{"name": "test_tracker"}]}})
    router = build_router(cfg, seed=0)
    router.placed(req(rid="x"), cand("a"), 1.0)
    router.released("x", "a", 2.0)
    router.released("x", "a", 2.0)  # once only
    assert seen == [("placed", "a"), ("released", "a")]


def test_holders_map_stays_exact_under_eviction_and_hints_find_the_warmest() -> None:
    s = scorer("prefix_cache", chars_per_token=1.0, max_blocks_per_replica=6)
    assert isinstance(s, PrefixCacheScorer)
    shared = "system prompt!" * 4  # 56 chars: 7 blocks of 8
    deep = req(shared + "session A turn one two three")
    s.placed(deep, cand("a"), 0.0)  # a holds the leaf-most 6 blocks it can
    s.placed(req(shared[:24]), cand("b"), 0.0)  # b holds the first 3 blocks
    # Every hash is listed under exactly the replicas whose index holds it.
    for name in ("a", "b"):
        idx = s.index(name)
        assert idx is not None and len(idx) <= 6
    for h, names in s._holders.items():
        for n in names:
            assert s.index(n).match([h]) == 1  # type: ignore[union-attr]
    assert sum(len(v) for v in s._holders.values()) == len(s.index("a")) + len(s.index("b"))  # type: ignore[arg-type]
    # The deepest holder comes first, then the root's other holders.
    hinted = s.hints(deep)
    assert hinted[0] in ("a", "b") and set(hinted) <= {"a", "b"}
    assert s.hints(req("nothing like it at all, nothing")) == []
    # warm(): cached tokens per replica, warmest first.
    warm = s.warm(RouteRequest("w", "m", 10, prefix_hashes=deep.prefix_hashes, prompt_tokens=80))
    assert warm == sorted(warm, key=lambda x: -x[1]) and all(t > 0 for _, t in warm)


def test_session_hint_names_the_sessions_replica() -> None:
    s = scorer("session_affinity", ttl_s=10.0)
    assert isinstance(s, SessionAffinityScorer)
    s.placed(req(session="x"), cand("b"), 0.0)
    assert s.hints(req(session="x", now=5.0)) == ["b"]
    assert s.hints(req(session="x", now=11.0)) == []
    assert s.hints(req(session=None)) == []
