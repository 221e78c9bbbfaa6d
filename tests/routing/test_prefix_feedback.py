"""The approximate prefix index corrected by the engine's answers (routing.prefixfeedback):
against an engine that keeps fewer blocks than kvgate placed (an LRU cache whose
room output blocks share), the index's expected cached tokens follow what the engine
reports, where the uncorrected index keeps expecting every chain it ever placed."""

from __future__ import annotations

import random
from collections import OrderedDict

from routing.config import RoutingConfig
from routing.prefix import block_hashes
from routing.scheduler import build_router
from routing.types import Candidate, ReplicaState, RouteRequest

CHARS = 64  # characters per index block and per engine block (16 tokens at 4 chars each)
TOKENS = 16


class LruEngine:
    """A prefix cache of `blocks` blocks, least recently used evicted first; each request
    also writes `output_blocks` blocks of its own output, which take room as well."""

    def __init__(self, blocks: int, output_blocks: int) -> None:
        self.blocks = blocks
        self.output_blocks = output_blocks
        self._lru: OrderedDict[object, None] = OrderedDict()
        self._n = 0

    def serve(self, chain: tuple[int, ...]) -> int:
        """Cached prompt tokens of this request (its chain is then held, and its output)."""
        hit = 0
        for h in chain:
            if h not in self._lru:
                break
            hit += 1
        for h in (*reversed(chain), *range(self._n, self._n + self.output_blocks)):
            self._lru[h] = None
            self._lru.move_to_end(h)
        self._n += self.output_blocks
        while len(self._lru) > self.blocks:
            self._lru.popitem(last=False)
        return hit * TOKENS


def _prediction_errors(seed: int, *, answers: bool) -> list[int]:
    cfg = RoutingConfig.model_validate(
        {"block_chars": CHARS, "default_profile": {"scorers": [{"name": "prefix_cache"}]}}
    )
    router = build_router(cfg, seed=seed)
    scorer = router.default.scorers[0][0]
    engine = LruEngine(blocks=600, output_blocks=8)
    rng = random.Random(seed)
    system = "tools and rules " * 16  # 4 blocks every prompt shares
    sessions = [system + f"session {s} history {rng.random()} " * 60 for s in range(48)]
    # A skewed reuse: a few hot sessions come back soon, the rest long after the engine
    # evicted them (the index, sized from the pool, keeps them all).
    weights = [1.0 / (1 + s) for s in range(len(sessions))]
    errors = []
    for i in range(600):
        text = rng.choices(sessions, weights)[0]
        chain = block_hashes(text, CHARS, 512)
        tokens = len(text) // 4
        req = RouteRequest(f"q{i}", "m", tokens, prefix_hashes=chain, prompt_tokens=tokens)
        cand = Candidate("r0", 10**7, 10**7, 0, None, engine=ReplicaState("r0", "http://x"))
        expected = scorer.cached_tokens(req, cand)  # type: ignore[attr-defined]
        assert router.pick(req, [cand]) is cand
        router.placed(req, cand, float(i))
        cached = engine.serve(chain)
        if answers:
            report = getattr(router, "prompt_cached", None)  # absent before the feedback
            if report is not None:
                report(req.request_id, cached, len(text) / tokens, float(i))
        router.released(req.request_id, "r0", float(i))
        errors.append(abs(expected - cached))
    return errors


def test_the_engines_answers_bring_the_index_to_what_the_engine_holds() -> None:
    for seed in range(3):
        blind = _prediction_errors(seed, answers=False)[300:]
        taught = _prediction_errors(seed, answers=True)[300:]
        # Uncorrected, the index expects most chains it placed, long evicted.
        assert sum(blind) / len(blind) > 150
        assert sum(taught) < 0.35 * sum(blind), (seed, sum(taught), sum(blind))


def test_an_engine_that_keeps_everything_is_predicted_as_before() -> None:
    """Answers that match the prediction teach nothing: an engine with room for every
    chain is expected to hold every chain, as the uncorrected index does."""
    cfg = RoutingConfig.model_validate(
        {"block_chars": CHARS, "default_profile": {"scorers": [{"name": "prefix_cache"}]}}
    )
    router = build_router(cfg, seed=0)
    scorer = router.default.scorers[0][0]
    engine = LruEngine(blocks=10**6, output_blocks=8)
    texts = [f"session {s} " * 100 for s in range(20)]
    misses = 0
    for i in range(200):
        text = texts[i % 20]
        chain = block_hashes(text, CHARS, 512)
        tokens = len(text) // 4
        req = RouteRequest(f"q{i}", "m", tokens, prefix_hashes=chain, prompt_tokens=tokens)
        cand = Candidate("r0", 10**7, 10**7, 0, None, engine=ReplicaState("r0", "http://x"))
        expected = scorer.cached_tokens(req, cand)  # type: ignore[attr-defined]
        router.placed(req, cand, float(i))
        cached = engine.serve(chain)
        router.prompt_cached(req.request_id, cached, len(text) / tokens, float(i))
        router.released(req.request_id, "r0", float(i))
        misses += expected != cached
    assert misses == 0
    assert scorer.index("r0").horizon == float("inf")  # type: ignore[attr-defined]
