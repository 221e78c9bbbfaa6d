"""The approximate prefix index corrected by the engine's answers, through kvgate, against
enginesim (which evicts): sessions cycle through a replica whose cache holds fewer of
them than kvgate placed (their outputs take room as well), so the engine misses what the
uncorrected index still expects; with the engine's ``cached_tokens`` fed back, the
index's expectation at each decision follows what the engine then reports."""

from __future__ import annotations

import aiohttp
import pytest

from tests.gateway.conftest import MODEL

PROFILE = {"block_chars": 64, "default_profile": {"scorers": [{"name": "prefix_cache"}]}}
SYSTEM = "You are a careful agent. Read the task, then act with one tool per turn. " * 7


pytestmark = pytest.mark.slow


async def test_the_index_expects_what_the_engine_reports_after_its_answers(replica, gateway):
    srv = await replica(speed=50.0)
    gw = await gateway(srv, routing=PROFILE)
    profile = gw.door.router.default  # type: ignore[attr-defined]
    scorer = profile.scorers[0][0]
    expected: dict[str, int] = {}

    def spy(req, candidate, now):  # the expectation the decision was made on
        expected[req.request_id] = scorer.cached_tokens(req, candidate)

    profile.placed_hooks = (spy, *profile.placed_hooks)
    sessions = [SYSTEM + f"Session {s}: the history of task {s * 7919}. " * 40 for s in range(8)]
    rows: list[tuple[int, int]] = []  # (expected, the engine's cached tokens) per request
    async with aiohttp.ClientSession() as s:
        for turn in range(32):
            expected.clear()
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": sessions[turn % len(sessions)]}],
                "max_tokens": 256,
                "ignore_eos": True,
            }
            async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                usage = (await r.json())["usage"]
            assert len(expected) == 1
            rows.append((expected.popitem()[1], usage["prompt_tokens_details"]["cached_tokens"]))
    # Round robin over more sessions than the engine keeps: after the first round it
    # holds only the shared system prompt, while the index placed every session whole.
    late = rows[16:]
    assert all(cached < 200 for _, cached in late), late
    error = sum(abs(e - c) for e, c in late) / len(late)
    assert error < 100, (error, late)
