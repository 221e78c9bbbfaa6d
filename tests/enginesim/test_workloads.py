"""Workload generator (seed 001's job) and the workload classifier."""

from __future__ import annotations

import statistics
import time

from enginesim import tokenizer
from enginesim.types import Workload
from enginesim.workload import classify_workload
from enginesim.workloads import seed2_workload, synthetic_items


def test_seed2_workload_shape_and_speed() -> None:
    t0 = time.perf_counter()
    items = seed2_workload()
    assert time.perf_counter() - t0 < 2.0
    assert len(items) == 738 and len({i.request_id for i in items}) == 738
    lens = [len(i.prompt_token_ids) for i in items]
    outs = [i.output_tokens for i in items]
    assert 2000 <= statistics.mean(lens) <= 3000  # large prompts
    assert (
        min(outs) >= 24 and max(outs) <= 200 and 50 <= statistics.median(outs) <= 100
    )  # small outputs
    # A shared instruction prefix (the same first ~300 tokens), then unique documents.
    first = items[0].prompt_token_ids
    for it in items[1:50]:
        assert it.prompt_token_ids[:300] == first[:300]
    assert len({tuple(i.prompt_token_ids[:420]) for i in items}) == 738


def test_seed2_workload_tokens_match_the_tokenizer() -> None:
    items = seed2_workload(40, seed=3)
    for it in items:
        assert it.prompt_text == tokenizer.apply_chat_template(it.messages)
        assert it.prompt_token_ids == tokenizer.encode(it.prompt_text)
        assert it.workload is Workload.CHAT


def test_seed2_workload_is_deterministic_per_seed() -> None:
    a, b, c = seed2_workload(20, 1), seed2_workload(20, 1), seed2_workload(20, 2)
    assert [i.prompt_token_ids for i in a] == [i.prompt_token_ids for i in b]
    assert [i.output_tokens for i in a] == [i.output_tokens for i in b]
    assert [i.prompt_token_ids for i in a] != [i.prompt_token_ids for i in c]


def test_synthetic_items_exact_lengths() -> None:
    items = synthetic_items(5, 123, 7, Workload.CODING)
    assert all(len(i.prompt_token_ids) == 123 and i.output_tokens == 7 for i in items)
    assert len({tuple(i.prompt_token_ids) for i in items}) == 5


def test_classify_workload() -> None:
    t = tokenizer.apply_chat_template
    assert classify_workload("coding", "hello") is Workload.CODING
    assert classify_workload(" Agentic ", "hello") is Workload.AGENTIC
    assert classify_workload("bogus", "tell me a story") is Workload.CHAT
    assert (
        classify_workload(None, t([{"role": "user", "content": "Write a poem about rain"}]))
        is Workload.CHAT
    )
    code = "Fix this:\n```python\ndef f(x):\n    return x\n```"
    assert classify_workload(None, t([{"role": "user", "content": code}])) is Workload.CODING
    assert classify_workload(None, "import os\nprint(os.getcwd())") is Workload.CODING
    tools = "Thought: I need the weather.\nAction: get_weather\nObservation: 12C"
    assert classify_workload(None, tools) is Workload.AGENTIC
    assert (
        classify_workload(None, '{"tool_calls": [{"function": {"name": "x"}}]}') is Workload.AGENTIC
    )
    turns = [{"role": r, "content": "ok"} for r in ["user", "assistant"] * 5]
    assert (
        classify_workload(None, t(turns + [{"role": "user", "content": "next"}]))
        is Workload.AGENTIC
    )
    assert (
        classify_workload(None, t(turns[:4] + [{"role": "user", "content": "next"}]))
        is Workload.CHAT
    )
