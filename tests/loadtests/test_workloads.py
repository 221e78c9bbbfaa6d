"""What the Locust users send (no Locust needed: `loadtests.workloads` is plain Python)."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from enginesim import tokenizer
from loadtests.workloads import (
    AGENT_TOOLS,
    AgenticWorkload,
    BatchJsonWorkload,
    Dist,
    LoadConfig,
    estimate_tokens,
    load_prompt_file,
    make_workload,
    prose,
)


def test_distributions_parse_sample_and_print_back() -> None:
    rng = random.Random(1)
    assert Dist.parse("fixed:512").sample(rng) == 512
    u = Dist.parse("uniform:10,20")
    assert all(10 <= u.sample(rng) <= 20 for _ in range(200))
    ln = Dist.parse("lognormal:2000,0.35,600,5000")
    xs = [ln.sample(rng) for _ in range(2000)]
    assert min(xs) >= 600 and max(xs) <= 5000
    assert 1850 < statistics.median(xs) < 2150
    for spec in ("fixed:512", "uniform:10,20", "lognormal:2000,0.35,600,5000"):
        assert str(Dist.parse(spec)) == spec


@pytest.mark.parametrize(
    "bad", ["fixed", "fixed:0", "uniform:5,1", "lognormal:100", "gauss:1,2", "fixed:x"]
)
def test_a_bad_distribution_says_what_is_expected(bad: str) -> None:
    with pytest.raises(ValueError, match="fixed:N|do not parse"):
        Dist.parse(bad)


def test_synthetic_prose_costs_about_what_was_asked() -> None:
    """The client's estimate is within a few percent of a BPE-like count (enginesim's)."""
    rng = random.Random(2)
    for n in (50, 900, 4000):
        text = prose(rng, n, "Request x-1:")
        assert n <= estimate_tokens(text) <= n + 20
        assert abs(len(tokenizer.encode(text)) - n) <= 0.05 * n + 20


def test_batch_json_is_seed_001s_shape() -> None:
    w = BatchJsonWorkload(LoadConfig(), random.Random(3), 1)
    specs = [w.next() for _ in range(120)]
    prompts = [estimate_tokens(s.messages[1]["content"]) for s in specs]
    outputs = [s.max_tokens for s in specs]
    assert 1800 < statistics.median(prompts) < 2250 and max(prompts) <= 5000 + 30
    assert 60 <= statistics.median(outputs) <= 80 and 24 <= min(outputs) <= max(outputs) <= 200
    # One shared instruction, a unique document each time.
    assert len({s.messages[0]["content"] for s in specs}) == 1
    assert len({s.messages[1]["content"][:60] for s in specs}) == 120


def test_agentic_sessions_share_a_prefix_and_resend_their_history() -> None:
    cfg = LoadConfig(system_tokens=1000, turns=Dist("fixed", 4), max_context=100_000)
    a = AgenticWorkload(cfg, random.Random(4), 1)
    b = AgenticWorkload(cfg, random.Random(5), 2)
    assert a.system == b.system and 950 < estimate_tokens(a.system) < 1100
    turns = []
    for _ in range(4):
        spec = a.next()
        assert spec.tools == AGENT_TOOLS
        turns.append(spec)
        a.answered(spec, "some answer")
    sizes = [len(t.messages) for t in turns]
    assert sizes == [2, 4, 6, 8]  # system + task, then assistant call and tool result per turn
    assert turns[3].messages[:4] == turns[2].messages[:4] == turns[1].messages[:4]
    call = turns[1].messages[2]["tool_calls"][0]
    assert turns[1].messages[3] == {**turns[1].messages[3], "tool_call_id": call["id"]}
    assert json.loads(call["function"]["arguments"])
    # A new session after the last turn, and after a failure.
    assert len(a.next().messages) == 2
    a.failed(turns[0])
    assert len(a.next().messages) == 2


def test_an_agentic_session_stops_before_it_outgrows_the_context() -> None:
    cfg = LoadConfig(
        system_tokens=300,
        turns=Dist("fixed", 50),
        max_context=1500,
        prompt_tokens=Dist("fixed", 200),
        output_tokens=Dist("fixed", 100),
    )
    w = AgenticWorkload(cfg, random.Random(6), 1)
    for _ in range(40):
        spec = w.next()
        total = w.tools_tokens + sum(estimate_tokens(json.dumps(m)) + 4 for m in spec.messages)
        assert total + spec.max_tokens <= cfg.max_context
        w.answered(spec, "x " * spec.max_tokens)
    assert w.sessions > 5


def test_prompt_file_replaces_the_synthetic_prompts(tmp_path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        json.dumps({"messages": [{"role": "user", "content": "real one"}], "max_tokens": 7})
        + "\n\n"
        + json.dumps({"prompt": "real two"})
        + "\n"
    )
    items = load_prompt_file(path)
    assert [i.messages[0]["content"] for i in items] == ["real one", "real two"]
    cfg = LoadConfig(prompt_file=str(path), output_tokens=Dist("fixed", 33))
    w = make_workload("coding", cfg, random.Random(7), 1)
    seen = {(s.messages[0]["content"], s.max_tokens) for s in (w.next() for _ in range(50))}
    assert seen == {("real one", 7), ("real two", 33)}
    body = w.next().body("m", ignore_eos=True)
    assert body["stream"] and body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "prompts.jsonl:2:"),
        ('{"messages": []}', "non-empty list"),
        ('{"other": 1}', 'needs "messages" or "prompt"'),
        ('{"prompt": "x", "max_tokens": 0}', "positive integer"),
    ],
)
def test_a_bad_prompt_file_line_is_named(tmp_path, line: str, message: str) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        load_prompt_file(path)
