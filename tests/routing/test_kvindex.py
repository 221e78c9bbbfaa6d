"""The precise prefix index (routing.kvindex) fed by vLLM's KV events as vLLM encodes
them (routing.kvevents): stores chain by token ids, removals and clears take blocks
out, sequence gaps are reported and a restarted engine starts empty; and the
prefix_cache scorer trusts it over the approximate index only while it is fresh."""

from __future__ import annotations

import msgpack
import pytest

from routing.kvevents import BadMessage, Cleared, Removed, Stored, decode
from routing.kvindex import APPLIED, DUPLICATE, GAP, RESTARTED, KVIndex, token_block_hashes
from routing.plugin import PluginEnv
from routing.registry import build
from routing.types import Candidate, ReplicaState, RouteRequest

BS = 4


def stored(hashes: list[bytes], parent: bytes | None, tokens: list[int], **kw: object) -> dict:
    """A BlockStored as vLLM 0.32's msgspec encodes it (a map tagged by type)."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        **kw,
    }


def message(seq: int, events: list[object], topic: bytes = b"kv") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), msgpack.packb([1.5, events])]


def h(i: int) -> bytes:
    return bytes([i]) * 32  # the engine's sha256 hashes are 32 bytes


def test_decode_reads_vllms_layout_and_refuses_other_messages() -> None:
    seq, events = decode(
        message(
            7,
            [
                stored([h(1), h(2)], None, list(range(8))),
                {"type": "BlockRemoved", "block_hashes": [h(2)], "medium": "GPU"},
                {"type": "AllBlocksCleared"},
                ["BlockRemoved", [5], "GPU"],  # the array form of older releases
            ],
        )
    )
    assert seq == 7
    assert events[0] == Stored((h(1), h(2)), None, tuple(range(8)), BS, "GPU", False)
    assert events[1:] == [Removed((h(2),), "GPU"), Cleared(), Removed((5,), "GPU")]
    with pytest.raises(BadMessage):
        decode([b"kv", b"\x00" * 8])
    with pytest.raises(BadMessage):
        decode([b"kv", b"\x00" * 8, b"\xc1"])


def test_the_index_holds_what_the_engine_stored_and_drops_what_it_evicted() -> None:
    kv = KVIndex()
    blocks = kv.replica("a")
    prompt = list(range(100, 112))  # three blocks
    chain = token_block_hashes(prompt, BS)
    _, ev = decode(message(0, [stored([h(1), h(2)], None, prompt[:8])]))
    assert blocks.apply(0, ev, 0.0) == APPLIED
    assert blocks.match(chain) == 2
    # A later step stores the third block under its parent's engine hash.
    _, ev = decode(message(1, [stored([h(3)], h(2), prompt[8:12])]))
    blocks.apply(1, ev, 0.1)
    assert blocks.match(chain) == 3 and kv.holders[chain[2]] == ("a",)
    # Eviction of the middle block: the walk stops there.
    _, ev = decode(message(2, [{"type": "BlockRemoved", "block_hashes": [h(2)], "medium": "GPU"}]))
    blocks.apply(2, ev, 0.2)
    assert blocks.match(chain) == 1 and chain[1] not in kv.holders
    # A block stored under a parent never seen cannot be chained; CPU-tier and LoRA
    # blocks are not the GPU pool's token chain.
    _, ev = decode(
        message(
            3,
            [
                stored([h(9)], h(8), prompt[:4]),
                stored([h(10)], None, [1, 2, 3, 4], medium="CPU"),
                stored([h(11)], None, [5, 6, 7, 8], lora_name="adapter"),
            ],
        )
    )
    blocks.apply(3, ev, 0.3)
    assert blocks.unchained == 1 and len(blocks) == 2
    _, ev = decode(message(4, [{"type": "AllBlocksCleared"}]))
    blocks.apply(4, ev, 0.4)
    assert len(blocks) == 0 and kv.holders == {}


def test_gaps_duplicates_and_a_restarted_engine() -> None:
    blocks = KVIndex().replica("a")
    one = list(range(4))
    _, ev = decode(message(0, [stored([h(1)], None, one)]))
    blocks.apply(0, ev, 0.0)
    assert blocks.apply(5, [], 1.0) == GAP and blocks.last_seq == 0  # nothing applied
    assert blocks.apply(0, ev, 1.0, replay=True) == DUPLICATE
    blocks.resync(5, [], 1.0)  # the missing messages are lost: start over from 5
    assert blocks.last_seq == 5 and len(blocks) == 0
    _, ev = decode(message(6, [stored([h(1)], None, one)]))
    blocks.apply(6, ev, 1.1)
    assert len(blocks) == 1
    # The engine restarted: its sequence starts over, and so does what it holds.
    assert blocks.apply(0, [], 2.0) == RESTARTED and len(blocks) == 0


def test_staleness_when_the_engine_serves_prompts_and_no_event_comes() -> None:
    blocks = KVIndex(stale_after_s=10.0).replica("a")
    assert not blocks.usable(0.0, None)  # never heard from
    blocks.apply(0, [], 0.0, queries_total=100.0)
    assert blocks.usable(5.0, 500.0)  # recent
    assert blocks.usable(60.0, 100.0)  # silent, but the engine served nothing either
    assert not blocks.usable(60.0, 500.0)  # the engine served prompts: events are lost
    assert not blocks.usable(1.0, 10.0)  # its counters started over: it restarted
    # A subscription to renew only after a silence while the counter moved; a restart
    # alone is not one (ZMQ reconnects; the sequence starting over clears the index).
    assert not blocks.silent(1.0, 10.0) and not blocks.silent(60.0, 10.0)
    assert not blocks.silent(60.0, 100.0) and not blocks.silent(5.0, 500.0)
    assert blocks.silent(60.0, 500.0)


def cand(name: str, queries: float | None = None) -> Candidate:
    engine = ReplicaState(name, "http://127.0.0.1", prefix_cache_queries_total=queries)
    return Candidate(name, 1000, 1000, 0, None, engine=engine)


def test_the_prefix_scorer_uses_the_engines_blocks_while_they_are_fresh() -> None:
    kv = KVIndex(stale_after_s=10.0)
    scorer = build("scorer", "prefix_cache", {}, PluginEnv(block_chars=8, kv_index=kv))
    prompt = list(range(16))
    chain = token_block_hashes(prompt, BS)
    req = RouteRequest("r", "m", 10, prompt_tokens=16, token_hashes=chain, token_block_size=BS)
    _, ev = decode(message(0, [stored([h(1), h(2), h(3)], None, prompt[:12])]))
    kv.replica("a").apply(0, ev, 0.0, queries_total=0.0)
    kv.replica("b").apply(0, [], 0.0, queries_total=0.0)
    a, b = cand("a", 0.0), cand("b", 0.0)
    assert scorer.score(req, a) == pytest.approx(0.75)  # type: ignore[attr-defined]
    assert scorer.score(req, b) == 0.0  # type: ignore[attr-defined]
    assert scorer.cached_tokens(req, a) == 12  # type: ignore[attr-defined]
    assert scorer.hints(req) == ["a"]  # type: ignore[attr-defined]
    # Stale: the engine served prompts for a minute and no event came.
    late = RouteRequest("r", "m", 10, now=60.0, token_hashes=chain, token_block_size=BS)
    assert scorer.score(late, cand("a", 50.0)) == 0.0  # type: ignore[attr-defined]


def test_live_copies_of_replayed_messages_are_duplicates_not_a_restart() -> None:
    """While a replay runs, the SUB socket queues the same messages live: they must not
    read as an engine whose sequence started over (seen on the real vLLM)."""
    blocks = KVIndex().replica("a")
    _, ev = decode(message(0, [stored([h(1)], None, list(range(4)))]))
    blocks.apply(0, ev, 0.0)
    assert blocks.apply(3, [], 1.0) == GAP
    for seq in (1, 2, 3):  # the replay
        blocks.apply(seq, [], 1.0, replay=True)
    assert blocks.apply(2, [], 1.0) == DUPLICATE  # queued live copies
    assert blocks.apply(3, [], 1.0) == DUPLICATE
    assert blocks.apply(4, [], 1.1) == APPLIED and len(blocks) == 1
    assert blocks.apply(0, [], 2.0) == RESTARTED and len(blocks) == 0


def test_one_walk_of_the_holders_gives_each_replicas_own_match() -> None:
    """`KVIndex.depths` walks a chain once against the holders of every block; it must
    give each replica what its own walk gives (`EngineBlocks.match`), with holes in a
    replica's blocks (a parent evicted before its child) and holders that differ from
    block to block."""
    import random

    rng = random.Random(5)
    kv = KVIndex()
    prompts = [[rng.randrange(50) for _ in range(BS * 12)] for _ in range(3)]
    seqs = dict.fromkeys(range(6), 0)
    engine_hash = iter(range(1, 10**6))
    for _ in range(300):
        r = rng.randrange(6)
        blocks = kv.replica(f"r{r}")
        ids = rng.choice(prompts)[: BS * rng.randint(1, 12)]
        if rng.random() < 0.7:
            ev: object = Stored(tuple(next(engine_hash) for _ in range(len(ids) // BS)), None,
                                tuple(ids), BS)  # fmt: skip
        else:  # evict a random block of that replica's (holes included)
            own = list(blocks._own) or [0]
            ev = Removed((rng.choice(own),))
        blocks.apply(seqs[r], [ev], 0.0)
        seqs[r] += 1
        for p in prompts:
            chain = token_block_hashes(p, BS)
            want = {n: kv.get(n).match(chain) for n in kv.names()}
            assert kv.depths(chain) == {n: d for n, d in want.items() if d}


def test_a_request_asked_again_after_the_engine_changed_is_matched_again() -> None:
    """A decision remembers each candidate's match for its request; an event applied
    (or a placement) in between must not leave the old answer standing."""
    kv = KVIndex(stale_after_s=10.0)
    scorer = build("scorer", "prefix_load", {}, PluginEnv(block_chars=8, kv_index=kv))
    prompt = list(range(16))
    chain = token_block_hashes(prompt, BS)
    req = RouteRequest("r", "m", 10, prompt_tokens=16, token_hashes=chain, token_block_size=BS)
    a = kv.replica("a")
    a.apply(0, [], 0.0, queries_total=0.0)
    assert scorer.cached_tokens(req, cand("a", 0.0)) == 0  # type: ignore[attr-defined]
    _, ev = decode(message(1, [stored([h(1), h(2)], None, prompt[:8])]))
    a.apply(1, ev, 0.1, queries_total=0.0)
    assert scorer.cached_tokens(req, cand("a", 0.0)) == 8  # type: ignore[attr-defined]
    a.apply(2, [Removed((h(2),))], 0.2, queries_total=0.0)
    assert scorer.cached_tokens(req, cand("a", 0.0)) == 4  # type: ignore[attr-defined]
    # The approximate index, for a replica without events, changes at placement.
    text = RouteRequest("t", "m", 10, prompt_tokens=64, prefix_hashes=(1, 2, 3, 4))
    assert scorer.cached_tokens(text, cand("b")) == 0  # type: ignore[attr-defined]
    scorer.placed(text, cand("b"), 0.3)  # type: ignore[attr-defined]
    assert scorer.cached_tokens(text, cand("b")) == 8  # type: ignore[attr-defined]


def test_a_prompt_in_prefill_counts_as_held_where_it_was_placed() -> None:
    """Its engine stores a prompt's blocks as it prefills them: until then the events do
    not show them, and the next request of the same tenant must still see that replica
    warm (the engine shares a prefix once computed), not go cold elsewhere."""
    kv = KVIndex(stale_after_s=10.0)
    scorer = build("scorer", "prefix_load", {}, PluginEnv(block_chars=8, kv_index=kv))
    system = list(range(16))
    chain = token_block_hashes(system + [99] * 8, BS)
    for i, name in enumerate(("a", "b")):  # each engine holds one unrelated block
        other = Stored((h(50 + i),), None, (1000 + i,) * BS, BS)
        kv.replica(name).apply(0, [other], 0.0, queries_total=0.0)
    first = RouteRequest("r1", "m", 24, prompt_tokens=24, prefix_hashes=(1,), token_hashes=chain,
                         token_block_size=BS)  # fmt: skip
    scorer.placed(first, cand("a", 0.0), 0.0)  # type: ignore[attr-defined]
    nxt = token_block_hashes(system + [7] * 8, BS)  # the same system prompt, its own turn
    second = RouteRequest("r2", "m", 24, prompt_tokens=24, token_hashes=nxt, token_block_size=BS)
    assert scorer.cached_tokens(second, cand("a", 0.0)) == 16  # type: ignore[attr-defined]
    assert scorer.cached_tokens(second, cand("b", 0.0)) == 0  # type: ignore[attr-defined]
    scorer.first_token("r1", 0.1)  # type: ignore[attr-defined]
    # Prefilled: what the engine holds is what its events say (none came here).
    assert scorer.cached_tokens(second, cand("a", 0.0)) == 0  # type: ignore[attr-defined]


def test_a_hole_in_a_replicas_chain_is_counted_and_its_match_stops_there() -> None:
    """A block held whose parent is not (the engine evicted the parent first) is a hole:
    the replica's match ends at it, as the engine's own lookup does. `depths` bisects a
    replica without holes, so the index must count them exactly, and forget them when
    the parent is stored again or the child leaves too."""
    kv = KVIndex()
    prompt = list(range(BS * 6))
    chain = token_block_hashes(prompt, BS)
    blocks = kv.replica("a")
    blocks.apply(0, [Stored(tuple(h(i) for i in range(6)), None, tuple(prompt), BS)], 0.0)
    assert blocks.orphans == 0 and kv.depths(chain) == {"a": 6}
    blocks.apply(1, [Removed((h(2),))], 0.0)  # block 2 goes, 3 to 5 stay
    assert blocks.orphans == 1
    assert kv.depths(chain) == {"a": 2} == {"a": blocks.match(chain)}
    blocks.apply(2, [Stored((h(20),), h(1), tuple(prompt[2 * BS : 3 * BS]), BS)], 0.0)
    assert blocks.orphans == 0 and kv.depths(chain) == {"a": 6}  # the parent is back
    blocks.apply(3, [Removed((h(20),)), Removed((h(3), h(4), h(5)))], 0.0)
    assert blocks.orphans == 0 and kv.depths(chain) == {"a": 2}  # the leaves went too
    blocks.apply(4, [Removed((h(0),))], 0.0)
    assert blocks.orphans == 1 and kv.depths(chain) == {}  # the root went: no match
    blocks.apply(5, [Cleared()], 0.0)
    assert blocks.orphans == 0 and len(blocks) == 0


def test_depths_of_many_holders_at_a_few_depths_equal_each_ones_match() -> None:
    """`depths` confirms a holder's depth from the last one found (two probes) before
    bisecting: holders at one shared depth, deeper ones, a whole chain and a replica
    with a hole must each get what its own walk gives."""
    kv = KVIndex()
    prompt = list(range(BS * 8))
    chain = token_block_hashes(prompt, BS)
    engine_hash = iter(range(1, 10**6))
    depth_of = {"a": 3, "b": 3, "c": 6, "d": 3, "e": 8, "f": 6, "g": 1}
    for name, depth in depth_of.items():
        ids = tuple(prompt[: depth * BS])
        kv.replica(name).apply(0, [Stored(tuple(next(engine_hash) for _ in range(depth)), None,
                                          ids, BS)], 0.0)  # fmt: skip
    holed = kv.replica("h")  # holds 5 blocks, then loses the third: a hole
    hashes = tuple(next(engine_hash) for _ in range(5))
    holed.apply(0, [Stored(hashes, None, tuple(prompt[: 5 * BS]), BS)], 0.0)
    holed.apply(1, [Removed((hashes[2],))], 0.0)
    want = {n: kv.get(n).match(chain) for n in kv.names()}
    assert want == {**depth_of, "h": 2}
    assert kv.depths(chain) == want
    assert kv.depths(chain[:4]) == {n: min(d, 4) for n, d in want.items()}


def test_the_chosen_replicas_cached_tokens_equal_the_scoring_pass() -> None:
    """After the scoring, the chosen replica's cached tokens are read from the decision's
    memo (`PrefixMatches.one`): the same number the pass over every candidate gave,
    exact and approximate alike, and walked again once the engine's blocks change."""
    kv = KVIndex(stale_after_s=10.0)
    scorer = build("scorer", "prefix_load", {}, PluginEnv(block_chars=8, kv_index=kv))
    prompt = list(range(16))
    chain = token_block_hashes(prompt, BS)
    _, ev = decode(message(0, [stored([h(1), h(2)], None, prompt[:8])]))
    kv.replica("a").apply(0, ev, 0.0, queries_total=0.0)
    warm = RouteRequest("w", "m", 10, prompt_tokens=64, prefix_hashes=(1, 2))
    scorer.placed(warm, cand("b"), 0.0)  # type: ignore[attr-defined]
    req = RouteRequest("r", "m", 10, prompt_tokens=16, prefix_hashes=(1, 2, 3, 4),
                       token_hashes=chain, token_block_size=BS)  # fmt: skip
    cands = [cand("a", 0.0), cand("b"), cand("c")]
    every = scorer.cached_each(req, cands)  # type: ignore[attr-defined]
    assert every == [8, 4, 0]  # 2 engine blocks of 4 tokens; 2 of 8 chars at 4 per token
    assert [scorer.cached_tokens(req, c) for c in cands] == every  # type: ignore[attr-defined]
    kv.replica("a").apply(1, [Removed((h(2),))], 0.1, queries_total=0.0)
    assert scorer.cached_tokens(req, cands[0]) == 4  # type: ignore[attr-defined]
