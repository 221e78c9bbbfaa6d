"""Admission that serves what the replica can serve in time (issue 20, items 3 and 4).

Unit rules of the learned limit and the queue deadline, then the openai SDK's behaviour
(a stated per-attempt timeout, two retries after Retry-After) at concurrency 32 in front
of the simulated real vLLM of bench/real_vllm.py, in virtual time (bench/vtime.py)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from admission.learned.limit import LimitSettings, RunningLimit
from admission.types import Admit, Completion, Queued
from bench.parity_sweep import TIMEOUT_FACTOR
from bench.parity_vtime import calibrate, cell
from bench.vtime import run
from enginesim.simulate import run_closed_loop
from enginesim.types import Workload
from enginesim.workloads import seed2_workload, synthetic_items
from tests.admission.helpers import (
    admits,
    controller,
    replica,
    request,
    served_one_by_one,
    sheds,
)

PROFILE = Path(__file__).resolve().parents[2] / "enginesim" / "profiles" / "vllm-cpu-tiny.yaml"


def test_a_cold_replica_doubles_its_limit_in_one_round_of_completions() -> None:
    """A burst on a healthy replica is not queued behind a limit that grows one window at
    a time: each request served in time while the replica is busy adds one (TCP's slow
    start), so 2 -> 4 -> 8 takes two rounds of completions."""
    lim = RunningLimit(LimitSettings(initial=2, window=16))
    now = 0.0
    for expected in (4, 8):
        for _ in range(lim.allowed(None)):
            lim.running_changed(lim.allowed(None), now)
            now += 0.5
            lim.completed(now, now - 1.0, ok=True, ratio=(0.2, None), cap=None)
        assert lim.allowed(None) == expected
    assert lim.reason == "slow_start"


def test_a_client_that_left_after_the_queue_took_its_budget_is_no_evidence_against_the_replica(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request queued for 8 s of its 10 s budget, served for 2 s, then left at its
    timeout: the replica served it for 2 s (a lower bound, 1/3 of its share), so the limit
    is not cut as it is for a request the replica itself failed."""

    monkeypatch.setattr("admission.learned.limit.LIMIT_WINDOW", 4)

    def window(completion: Completion) -> tuple[int | None, str]:
        ctrl = controller(learn_limit=True, initial_limit=8.0)
        ctrl.upsert_replica(replica("r1", 100_000), 0.0)
        now = 0.0
        for i in range(40):
            req = request(f"q{i}")
            verdict = ctrl.submit(req, now).verdict
            assert isinstance(verdict, Admit)
            now += 0.5
            ctrl.release(f"q{i}", now, completion)
        usage = ctrl.report.replica_usage()[0]
        return usage.limit, usage.limit_reason

    queue_spent = Completion(ok=False, service_s=2.0, latency_budget=10.0)
    limit, reason = window(queue_spent)
    assert reason != "latency" and limit is not None and limit >= 8
    # Served for its whole budget: the replica failed it, and the limit is cut.
    limit, reason = window(Completion(ok=False, service_s=9.5, latency_budget=10.0))
    assert reason == "latency" and limit is not None and limit < 8


def test_a_queued_request_waits_as_long_as_its_predicted_service_leaves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The queue takes what service leaves of a stated budget, not a fixed share of it:
    served alone in 2 s, predicted at 4 s with two running (the upper estimate scales
    with the load), a request with a 10 s budget may wait 6 s (was 4 s: 40% of it).
    Where the pool holds only one of what runs, it runs one: 2 s, and it may wait 8 s."""
    monkeypatch.setattr("admission.shedding.MIN_DRAIN_SAMPLES", 1)
    ctrl = controller()
    ctrl.upsert_replica(replica("r1", 1000), 0.0)
    now = 0.0
    for i in range(8):  # service history: 2 s each
        assert isinstance(ctrl.submit(request(f"w{i}", 400, 100), now).verdict, Admit)
        ctrl.release(
            f"w{i}",
            now + 2.0,
            Completion(service_s=2.0, prompt_tokens=400, completion_tokens=100),
        )
        now += 2.0
    for a, b in (("a", "b"), ("c", "d")):  # two of 500 fill the pool: it runs two
        assert isinstance(ctrl.submit(request(a, 400, 100), now).verdict, Admit)
        assert isinstance(ctrl.submit(request(b, 400, 100), now).verdict, Admit)
        req = request(f"late-{a}", 400, 100, latency_budget=10.0)
        assert isinstance(ctrl.submit(req, now).verdict, Queued)
        deadline = ctrl.next_deadline()
        assert deadline is not None
        assert deadline - now == pytest.approx(6.0, abs=0.1)
        for name in (a, b, f"late-{a}"):
            ctrl.release(name, now + 1.0)
        now += 1.0
    big = request("big", 800, 150)  # one of 950 fills the pool: it runs one
    assert isinstance(ctrl.submit(big, now).verdict, Admit)
    assert isinstance(
        ctrl.submit(request("late", 400, 100, latency_budget=10.0), now).verdict, Queued
    )
    deadline = ctrl.next_deadline()
    assert deadline is not None
    assert deadline - now == pytest.approx(8.0, abs=0.1)
    ctrl.release("big", now + 1.0)
    ctrl.release("late", now + 1.0)


@pytest.mark.parametrize("history", [16, 4])
def test_a_queued_request_whose_service_grew_while_it_waited_is_shed_not_started_late(
    history: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seen in the demo (1 of 738 in a third of its runs): a request queued while service
    took 2 s may wait 8 s of its 10; while it waits, a completion of 7 s shows service has
    grown (a probe raised the load, the engine slowed). Started at 7 s it would end near
    14, after its client left: it is shed at once instead, with a Retry-After that gives
    its client a whole budget again. Its deadline was judged once, by the prediction when
    it entered. With only 4 completions seen, the prediction is a guess from a start still
    climbing, and the request starts (shedding on it cost the SDK's clients attempts
    they needed)."""
    monkeypatch.setattr("admission.shedding.MIN_DRAIN_SAMPLES", 1)
    ctrl = controller()
    ctrl.upsert_replica(replica("r1", 1000, max_running=1), 0.0)
    now = served_one_by_one(ctrl, history, 2.0)
    assert isinstance(ctrl.submit(request("slow", 400, 100), now).verdict, Admit)
    queued = ctrl.submit(request("late", 400, 100, latency_budget=10.0), now).verdict
    assert isinstance(queued, Queued)
    deadline = ctrl.next_deadline()
    assert deadline is not None and deadline - now == pytest.approx(8.0, abs=0.1)
    events = ctrl.release("slow", now + 7.0, Completion(service_s=7.0, prompt_tokens=400,
                                                        completion_tokens=100))  # fmt: skip
    if history >= 16:
        assert [e.request_id for e in sheds(events)] == ["late"], events
        assert not admits(events) and ctrl.report.queue_depth() == 0
        # Back at once with its whole budget, it starts on an idle replica.
        again = ctrl.submit(request("late#1", 400, 100, latency_budget=10.0), now + 7.5)
        assert isinstance(again.verdict, Admit)
    else:
        assert [e.request_id for e in admits(events)] == ["late"], events


# ---------------------------------------------------------------- the openai SDK at 32


def real_vllm_items(n: int, seed: int = 1) -> list:
    """bench/real_vllm.py's shape: prompts 600-1,800 tokens, outputs 40-200."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, o = rng.randint(600, 1800), rng.randint(40, 200)
        out.extend(synthetic_items(1, p, o, Workload.CHAT, prefix=f"v{seed}-{i}"))
    return out


def timeout_and_best_fixed(profile: str, items: list) -> tuple[float, float]:
    """bench/real_vllm.py's client timeout (1.5x the worst latency straight at 8) and the
    best wall time of a fixed concurrency (4, 8 or 16) completing every request within it:
    found without admission, never given to it."""
    timeout = 1.5 * run_closed_loop(profile, items, 8, 1e9).max_latency
    best = min(
        r.wall_time
        for r in (run_closed_loop(profile, items, c, timeout) for c in (4, 8, 16))
        if r.completed == len(items)
    )
    return timeout, best


@pytest.fixture(scope="module")
def vllm_8k(tmp_path_factory) -> str:
    """The fitted vllm-cpu-tiny profile with bench/real_vllm.py's 8,192-token pool."""
    text = PROFILE.read_text().replace("pool_tokens: 4096", "pool_tokens: 8192")
    assert "pool_tokens: 8192" in text
    path = tmp_path_factory.mktemp("profiles") / "vllm-cpu-tiny-8k.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.slow
def test_the_sdk_at_32_completes_every_request_near_the_best_fixed_concurrency(vllm_8k) -> None:
    """Issue 20.4 in virtual time: the SDK's defaults (its timeout stated, two retries
    after Retry-After) at concurrency 32 through a fresh admission core complete every
    request, with no preemption, near the best fixed concurrency (found by a sweep, never
    given to admission). Before: 143 of 150, 7 failed after three sheds in the first
    seconds (queued for most of their budget with nothing measured, timed out, and those
    timeouts cut the limit to 2).

    The issue's target is 1.10x of the best fixed wall time; this holds 1.15x. On the
    quiet refit of the profile (a decode step that grows little with the batch) kvgate
    took 1.17x while slow start ended at the first completion past half its latency aim,
    which a 200-token answer reaches at any load (the limit then crept up by probes: 3
    at 0.5 s, 6 at 13.8 s, where the engine serves 8-12 in time). Ended by a window
    whose slowest is past half its aim, it takes 1.115x (1.101x and 1.092x on seeds 2
    and 3): still short of 1.10x, and reported (bench/parity_vtime.py)."""
    items = real_vllm_items(150)
    timeout, best = timeout_and_best_fixed(vllm_8k, items)
    report = run(vllm_8k, items, concurrency=32, timeout_s=timeout, max_retries=2)
    assert report.completed == len(items), (report.timed_out, report.failed)
    assert report.wall_s <= 1.15 * best, (report.wall_s, best, report.limits)
    assert report.preemptions == 0


@pytest.mark.slow
def test_the_sdk_on_an_engine_slower_than_its_timeout_was_set_for_is_not_cut_below_it(
    vllm_8k,
) -> None:
    """The machine slowed after the clients set their timeout (the real-vLLM bench
    calibrates it, then this machine's speed drifts by up to 1.8x): run 25% slow, a long
    answer alone takes more than the 60% of the timeout the learned limit aims at, and
    the limit was cut for what no limit can shorten. Workload seed 7: 1.52x of the best
    fixed concurrency (at full speed) before, 1.30x now; seeds 1-26: median 1.48x, 1.41x,
    and 1.37x with growth that follows the service's slope in the load (seed 2: the
    limit held at 3 for the whole run, 1.92x; now 1.49x; bench/results/real_vllm.stop41.md)."""
    items = real_vllm_items(150, 7)
    timeout, best = timeout_and_best_fixed(vllm_8k, items)
    report = run(vllm_8k, items, concurrency=32, timeout_s=timeout, max_retries=2,
                 slow=lambda _t: 1.25)  # fmt: skip
    assert report.completed == len(items), (report.timed_out, report.failed)
    assert report.wall_s <= 1.4 * best, (report.wall_s, best, report.limits)
    assert report.preemptions == 0


@pytest.mark.parametrize("stream", [False, True])
def test_plain_clients_at_32_lose_only_the_attempts_that_teach_their_patience(
    vllm_8k, stream: bool
) -> None:
    """bench/real_vllm.py's plain client in virtual time: 32 clients that never state their
    timeout T, retrying a shed after the whole-second Retry-After and a timed-out attempt
    after 0.5 s and 1 s. The first wave queues under the 30 s default; once the first of
    it leave together at T, the rest of the wave is shed with a Retry-After, not left to
    time out one by one. Before: 26-28 attempt timeouts (the whole first wave and the
    requests queued behind it); now the few that teach and those started before."""
    items = real_vllm_items(150)
    timeout = 1.5 * run_closed_loop(vllm_8k, items, 8, 1e9).max_latency
    report = run(
        vllm_8k,
        items,
        concurrency=32,
        timeout_s=timeout,
        send_timeout=False,
        retry_after_unit_s=1.0,
        max_retries=2,
        timeout_backoff_s=(0.5, 1.0),
        stream=stream,
    )
    assert report.completed == len(items), (report.timed_out, report.failed)
    assert report.timed_out <= 10, report.timeouts
    # Every attempt that timed out was one of the first wave, before anything was learned.
    assert all(t <= 1.05 * timeout for t, _, _ in report.timeouts), report.timeouts
    assert report.preemptions == 0


def test_a_preemption_cut_is_judged_against_what_ran_not_a_lull() -> None:
    """Seen on the real vLLM: slow start reached 10, the engine preempted, and the next
    discovery round fell in a lull with one request running: the limit was cut to 1 (75%
    of that one), and took the rest of the run to climb back. The engine preempted while
    up to ten ran: the cut is 75% of that."""
    lim = RunningLimit(LimitSettings(initial=10))
    sig = {"cap": None}
    lim.engine_signals(preemptions_total=0, running=0, now=0.0, **sig)
    lim.running_changed(10, 0.5)
    lim.running_changed(1, 1.5)
    lim.engine_signals(preemptions_total=3, running=1, now=2.0, **sig)
    assert lim.reason == "preemption" and lim.value == pytest.approx(7.5)


def test_preemptions_seen_after_the_burst_ended_still_cut() -> None:
    """Seen on the real vLLM: 16 streams ran, the engine preempted, and the burst ended
    before the next discovery round read the counter: with nothing running then, the
    preemptions were nobody's and the limit stayed at 16. They were the peak's."""
    lim = RunningLimit(LimitSettings(initial=16))
    sig = {"cap": None}
    lim.engine_signals(preemptions_total=0, running=0, now=0.0, **sig)
    lim.running_changed(16, 0.1)
    lim.running_changed(0, 1.0)
    lim.engine_signals(preemptions_total=5, running=0, now=1.2, **sig)
    assert lim.reason == "preemption" and lim.value == pytest.approx(12.0)


@pytest.mark.slow
def test_the_demos_job_with_a_stated_timeout_loses_nothing_to_a_late_start() -> None:
    """The README's demo in virtual time: seed 001's card and batch job (738 requests,
    long prompts, 40-200 token answers sent with ignore_eos), 32 clients that state their
    45 s timeout and retry sheds. A queued request starts only while its predicted
    service still fits; with service a line in prompt + output tokens the prediction
    missed by a whole answer's decode on a few requests, which started and timed out; as
    a plane in prompt and output none did. A queued request whose service grew while it
    waited is shed rather than started late
    (`test_a_queued_request_whose_service_grew_while_it_waited_is_shed_not_started_late`).
    And the limit grows no further than keeps the requests it runs in time
    (`Ledger.room`, admission/room.py): on this card service grows with the load, and slow start, fed
    by short answers served at a light load, took the limit from 6 to 9 while long ones
    admitted late in their budget ran (workload seed 1: a cut judged flat given back;
    11 and 19: slow start, a request started at 7.8 s ran 37 s): one of 738 lost in each
    before; over workload seeds 0-39, 15 lost in 12 seeds before, 6 in 5 now."""
    from enginesim.workloads import seed2_workload

    late = []
    for seed in (1, 11, 19):
        report = run("seed2-8b-16gb", seed2_workload(738, seed=seed), concurrency=32,
                     timeout_s=45.0)  # fmt: skip
        assert report.failed == 0
        assert report.completed + report.timed_out == 738, (seed, report.timeouts)
        late += [(seed, t) for t in report.timeouts]
    assert not late, late


def test_a_request_queued_cold_is_judged_by_the_first_service_seen() -> None:
    """Queued before any service was seen, a request with a 10 s budget may wait half of
    it. When the first completion shows that its service takes about 8 s, it is shed at
    once (its client retries with a whole budget) rather than started 4 s in to time out
    at 12; with that service known from the start it would not have queued so long."""
    ctrl = controller()
    ctrl.upsert_replica(replica("r1", 1000, max_running=1), 0.0)
    first = ctrl.submit(request("a", 100, 100, latency_budget=10.0), 0.0).verdict
    assert isinstance(first, Admit)
    queued = ctrl.submit(request("b", 100, 100, latency_budget=10.0), 0.0).verdict
    assert isinstance(queued, Queued)
    events = ctrl.release("a", 4.0, Completion(ok=True, service_s=8.0, prompt_tokens=100,
                                               completion_tokens=100, latency_budget=10.0))  # fmt: skip
    assert [e.request_id for e in sheds(events)] == ["b"], events
    assert not admits(events)
    assert ctrl.report.queue_depth() == 0


def test_a_request_queued_cold_still_starts_when_the_first_service_leaves_it_time() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica("r1", 1000, max_running=1), 0.0)
    assert isinstance(ctrl.submit(request("a", 100, 100, latency_budget=10.0), 0.0).verdict, Admit)
    assert isinstance(ctrl.submit(request("b", 100, 100, latency_budget=10.0), 0.0).verdict, Queued)
    events = ctrl.release("a", 3.0, Completion(ok=True, service_s=3.0, prompt_tokens=100,
                                               completion_tokens=100, latency_budget=10.0))  # fmt: skip
    assert [e.request_id for e in admits(events)] == ["b"], events


@pytest.mark.parametrize("seed", [5, 6])
def test_sixteen_sdk_clients_a_replica_serves_in_time_are_not_held_below_it(seed: int) -> None:
    """bench/parity_vtime.py's cell (seed 001's card, 150 requests, the SDK non-stream, its
    timeout 1.5x the worst latency straight at 8): 16 clients straight at the replica all
    finish in time, so kvgate's goodput must be at least 0.95x theirs (issue 20.3). The
    limit held at 9-10 while the other clients queued behind it (0.924x and 0.923x of the
    replica on seeds 5 and 6), every window's slowest scored against 60% of the timeout,
    although the requests that started after a short wait had the rest of it."""
    items = seed2_workload(150, seed=seed)
    timeout = TIMEOUT_FACTOR * calibrate("seed2-8b-16gb", items, seed)
    got = {
        contender: cell("seed2-8b-16gb", items, contender=contender, client="sdk",
                        stream=False, concurrency=16, timeout_s=timeout, seed=seed)
        for contender in ("straight", "kvgate")
    }  # fmt: skip
    assert got["straight"]["completed"] == got["kvgate"]["completed"] == len(items)
    ratio = got["kvgate"]["goodput_rps"] / got["straight"]["goodput_rps"]
    assert ratio >= 0.95, (ratio, got["kvgate"]["kvgate_limit"])
    assert got["kvgate"]["preemptions"] == 0
