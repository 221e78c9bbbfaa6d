"""Clients that count the wait they were told (issue 47, item 3): a wait estimate sheds
only with a Retry-After the population was seen to come back after, and a population
whose retries leave at their timeout counted from the first attempt has its retries'
deadlines counted from there (admission/learned/toldwait.py)."""

from __future__ import annotations

import math

import pytest

from admission.learned.toldwait import MIN_VOTES, ToldWaits
from admission.retries import RetryMemory, identify
from admission.types import Admit, Queued, Shed
from bench.matrix import CLIENTS, calibrate, workload
from bench.vtime import run
from tests.admission.helpers import controller, filled, replica, request, sheds


def test_how_long_clients_come_back_after_is_the_longest_told_wait_seen_returned() -> None:
    told = ToldWaits(populations=8)
    assert told.returns_after("t", False) == 0.0  # none seen: no wait is told on an estimate
    told.came_back("t", False, 1.5, past_budget=False)
    told.came_back("t", False, 0.5, past_budget=False)
    assert told.returns_after("t", False) == 1.5
    assert told.returns_after("u", False) == 0.0
    # Clients that say which attempt they send (the SDKs) are believed per attempt until
    # their retries show a whole call's clock.
    assert told.returns_after("t", True) == math.inf
    # One back after its whole budget ran out: an attempt's clock, any wait may be told.
    told.came_back("t", False, 6.0, past_budget=True)
    assert told.returns_after("t", False) == math.inf


def test_retries_that_leave_at_their_timeout_from_the_first_attempt_vote_for_a_whole_call() -> None:
    """Timeout 4 s, first attempt at 0, shed and back at 1.5 s: leaving at 4.0 s (2.5 s
    into its attempt) is a whole call's clock; still there at 5 s, an attempt's."""
    told = ToldWaits(populations=8)
    for i in range(MIN_VOTES - 1):
        told.retry_ended("t", True, 4.0, 10.0 * i, 10.0 * i + 1.5, True, 10.0 * i + 4.0)
    assert told.clock("t", True) is None
    told.retry_ended("t", True, 4.0, 100.0, 101.5, True, 104.0)
    assert told.clock("t", True) == "call"
    # A retry back almost at once says nothing: its attempt had all the timeout too.
    quick = ToldWaits(populations=8)
    for i in range(2 * MIN_VOTES):
        quick.retry_ended("t", True, 4.0, 10.0 * i, 10.0 * i + 0.1, True, 10.0 * i + 4.1)
    assert quick.clock("t", True) is None
    # Clients still there past their whole budget outvote them: an attempt's clock, and
    # any wait may be told.
    for i in range(MIN_VOTES):
        told.retry_ended("t", True, 4.0, 200.0 + 10 * i, 201.5 + 10 * i, False, 205.0 + 10 * i)
    assert told.clock("t", True) == "attempt"
    assert told.returns_after("t", True) == math.inf


def test_a_wait_past_what_its_clients_come_back_after_queues_instead_of_shedding() -> None:
    """A full replica, a request that may queue 0.1 s and is estimated to wait ~0.4 s:
    told nothing came back yet, it queues until its deadline and is shed there; once its
    clients were seen back after 2 s, the same request is shed at once with its wait."""
    ctrl = controller()
    now = filled(ctrl)
    late = request("late", 100, 100, deadline=now + 0.1, latency_budget=10.0)
    late.returns_after_s = 0.0
    assert isinstance(ctrl.submit(late, now).verdict, Queued)
    (shed,) = sheds(ctrl.advance(now + 0.1))
    assert shed.request_id == "late" and shed.reason == "queue_timeout"

    ctrl = controller()
    now = filled(ctrl)
    known = request("known", 100, 100, deadline=now + 0.1, latency_budget=10.0)
    known.returns_after_s = 2.0
    verdict = ctrl.submit(known, now).verdict
    assert isinstance(verdict, Shed) and verdict.reason == "deadline"
    assert 0.0 < verdict.retry_after <= 2.0


def test_the_memory_learns_returns_and_clocks_and_marks_the_requests() -> None:
    """Clients with a 4 s timeout, shed at once and told 1.5 s: back then, they teach
    that waits of 1.5 s are come back after; leaving at 4 s from their first attempts,
    three of them show a whole call's clock, and the next retry is timed from its first
    attempt. One back after its whole budget ran out shows an attempt's clock instead."""
    memory = RetryMemory(ttl_s=60.0, max_entries=100)
    for n in range(MIN_VOTES + 1):
        t0, body = 10.0 * n, f"q{n}".encode()
        first = request(f"q{n}#0", latency_budget=4.0)
        memory.arrived(first, identify("default", "m", body, 0), t0, count_stated=True)
        called = n == MIN_VOTES  # three retries showed a whole call's clock by then
        assert not first.recalled and first.returns_after_s == (1.5 if called else math.inf)
        memory.unserved(first, t0, retry_after=1.5)
        retry = request(f"q{n}#1", latency_budget=4.0)
        memory.arrived(retry, identify("default", "m", body, 1), t0 + 1.5, count_stated=True)
        assert retry.recalled and retry.arrival == t0
        assert retry.returns_after_s == (1.5 if called else math.inf)
        assert retry.budget_from_first == called
        memory.ended(retry, t0 + 1.5, left=True, now=t0 + 4.0)
    memory = RetryMemory(ttl_s=60.0, max_entries=100)
    late = request("late#0", latency_budget=4.0)
    memory.arrived(late, identify("default", "m", b"late", 0), 100.0, count_stated=True)
    memory.unserved(late, 100.0, retry_after=6.0)
    back = request("late#1", latency_budget=4.0)
    memory.arrived(back, identify("default", "m", b"late", 1), 106.0, count_stated=True)
    assert back.recalled and not back.budget_from_first
    assert back.returns_after_s == math.inf


def test_a_retry_of_a_whole_call_client_queues_until_its_first_attempts_budget_runs_out() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica(capacity=1000), 0.0)
    assert isinstance(ctrl.submit(request("hog", 500, 500), 10.0).verdict, Admit)
    retry = request("r", 100, 100, latency_budget=4.0)
    retry.arrival, retry.recalled, retry.budget_from_first = 9.0, True, True
    assert isinstance(ctrl.submit(retry, 10.0).verdict, Queued)
    # Nothing served yet: half its budget, from its first attempt at 9 s (not from 10 s).
    assert ctrl.next_deadline() == 11.0
    (shed,) = sheds(ctrl.advance(11.0))
    assert shed.request_id == "r"


@pytest.mark.slow
def test_clients_whose_timeout_counts_the_wait_they_are_told_get_the_fixed_proxys_share() -> None:
    """32 plain clients whose timeout (stated nowhere) bounds the whole call, the
    Retry-After they wait included, read in whole seconds (told a longer wait than they
    have left, they give up), on the real vLLM's regime in virtual time (the matrix's
    `plain-told-wait` at 32, seed 65562): shed with Retry-Afters past what they had left
    once their patience was learned, 21 of 300 were served where a fixed proxy of 4 in
    front of the replica serves 96 from its queue."""
    items = workload("vllm-cpu-tiny", 65562)
    timeout, _ = calibrate("vllm-cpu-tiny", 65562)
    client = dict(CLIENTS["plain-told-wait"], concurrency=32, timeout_s=timeout, max_retries=2)
    fixed = run("vllm-cpu-tiny", items, straight=True, fixed=4, **client)
    kvgate = run("vllm-cpu-tiny", items, **client)
    assert kvgate.completed >= fixed.completed > 0, (kvgate.completed, fixed.completed)
    assert kvgate.preemptions == 0
