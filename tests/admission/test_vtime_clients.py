"""The clients and contenders bench/matrix.py adds to the virtual-time harness
(bench/vtime.py): open-loop arrivals, a fixed-concurrency proxy in front of the replica,
and a client whose timeout bounds the whole call, Retry-After waits included."""

from __future__ import annotations

from bench.closed_loop import PLAIN_BACKOFF_S
from bench.matrix import agentic, arrivals, verdict
from bench.vtime import run
from enginesim.types import Workload
from enginesim.workloads import synthetic_items

PROFILE = "vllm-cpu-tiny"


def items(n: int) -> list:
    return synthetic_items(n, 900, 80, Workload.CHAT, prefix="m")


def test_a_fixed_concurrency_proxy_holds_the_rest_in_order() -> None:
    work = items(24)
    capped = run(PROFILE, work, concurrency=24, timeout_s=1e9, straight=True, fixed=2)
    alone = run(PROFILE, work, concurrency=24, timeout_s=1e9, straight=True)
    assert capped.completed == alone.completed == 24
    assert capped.max_running <= 2 < alone.max_running
    # Held in order: the requests it held wait longer than any it started at once.
    assert max(capped.latencies) > 2 * max(alone.latencies[:2])


def test_open_loop_arrivals_are_sent_when_they_arrive() -> None:
    work = items(6)
    spread = [10.0 * i for i in range(6)]  # each long after the last one is done
    r = run(PROFILE, work, concurrency=1, timeout_s=1e9, straight=True, arrivals=spread)
    assert r.completed == 6 and r.max_running == 1
    assert r.wall_s > spread[-1]
    burst = run(PROFILE, work, concurrency=1, timeout_s=1e9, straight=True, arrivals=[0.0] * 6)
    assert burst.max_running == 6 and burst.wall_s < spread[-1]


def test_a_client_whose_timeout_bounds_the_whole_call_loses_what_a_per_attempt_one_retries() -> (
    None
):
    """The same overloaded cell through kvgate: a client that gets a fresh timeout on each
    attempt is served after its sheds; one whose Retry-After waits count in one timeout
    gives up a retry it was told to wait past what it has left."""
    work = items(120)
    kw = {"concurrency": 32, "timeout_s": 4.0, "max_retries": 2,
          "timeout_backoff_s": PLAIN_BACKOFF_S}  # fmt: skip
    per_attempt = run(PROFILE, work, **kw)
    whole_call = run(PROFILE, work, total_timeout=True, **kw)
    assert sum(per_attempt.sheds.values()) > 0
    assert whole_call.completed < per_attempt.completed
    assert whole_call.timed_out > per_attempt.timed_out


def test_a_whole_call_timeout_once_out_is_final() -> None:
    """Past its one timeout the client has given up: it sends no retry (it did, and each
    one timed out again at once, counted as another timeout of the same request)."""
    kw = {"concurrency": 16, "timeout_s": 2.0, "max_retries": 2, "straight": True, "fixed": 2,
          "timeout_backoff_s": PLAIN_BACKOFF_S, "total_timeout": True}  # fmt: skip
    r = run(PROFILE, items(48), **kw)
    assert r.timed_out > 0 and r.retries == 0
    assert r.completed + r.timed_out + r.failed == r.requests


def test_agentic_sessions_open_at_once_and_send_each_turn_once_the_last_is_answered() -> None:
    sessions = agentic("vllm-cpu-tiny", 1)[:4]
    assert all(len(s) == 6 for s in sessions)
    # Each turn's prompt holds the last one's: an engine that caches prefixes holds it.
    first, second = sessions[0][0], sessions[0][1]
    assert second.prompt_token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids
    r = run(PROFILE, [], concurrency=0, timeout_s=1e9, straight=True, sessions=sessions)
    assert r.requests == r.completed == 24
    assert r.max_running == 4  # all four open at once, one turn outstanding each


def test_the_matrix_judges_against_the_better_reference() -> None:
    def row(contender: str, completed: int, wall: float, pre: int = 0) -> dict:
        return {"engine": "e", "seed": 1, "client": "c", "load": "l", "contender": contender,
                "requests": 100, "completed": completed, "preemptions": pre,
                "goodput": completed / wall}  # fmt: skip

    rows = [row("alone", 60, 10.0), row("fixed 2", 100, 20.0), row("fixed 4", 90, 10.0)]
    # fixed 4 completes under 95%: fixed 2 is the best fixed; alone has the most goodput.
    ok = verdict([*rows, row("kvgate", 100, 11.0)])
    assert ok["best_fixed"].startswith("fixed 2") and ok["misses"] == []
    slow = verdict([*rows, row("kvgate", 100, 20.0, pre=3)])
    assert slow["misses"] == ["goodput", "preemptions"] and slow["ratio"] == 0.833
    lossy = verdict([*rows, row("kvgate", 97, 9.0)])
    assert lossy["misses"] == ["lost"] and lossy["lost"] == 3
    assert arrivals("closed-8", 3, 1.0, 1) is None
    assert arrivals("burst", 3, 1.0, 1) == [0.0, 0.0, 0.0]
    times = arrivals("open-2", 400, 1.0, 1)
    assert times is not None and times == sorted(times)
    assert 150 < times[-1] < 250  # 400 arrivals at 2 a second
