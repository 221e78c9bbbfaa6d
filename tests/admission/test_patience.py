"""Learned patience of clients that state no timeout (admission/learned/patience.py), in virtual
time: what a population teaches, and what admission does with it."""

from __future__ import annotations

import random

import pytest

from admission.learned.patience import (
    MIN_COHORT,
    MIN_EVENTS,
    REFRESH_STAYS,
    WINDOW,
    Budget,
    ClientEnd,
    ClientPatience,
    Patience,
    km_quantile,
    stream_end,
)
from admission.types import Admit, Completion, Queued, Shed
from tests.admission.helpers import controller, replica, request


def _full(ctrl, now: float = 0.0) -> None:
    """One replica of 1,000 tokens, held full by a running request."""
    ctrl.upsert_replica(replica("r1", 1000), now)
    assert isinstance(ctrl.submit(request("hog", 500, 500), now).verdict, Admit)


def _leaves_queued(ctrl, rid: str, now: float, after: float) -> None:
    """`rid` queues at `now` (the replica is full) and its client leaves `after` later."""
    assert isinstance(ctrl.submit(request(rid), now).verdict, Queued)
    ctrl.release(rid, now + after)
    ctrl.client_ended("default", "m", False, ClientEnd(after, True), now + after)


def test_a_population_that_leaves_at_3s_is_served_or_shed_within_3s() -> None:
    ctrl = controller(queue_timeout_s=30.0)
    _full(ctrl)
    now = 0.0
    for i in range(MIN_EVENTS - 1):
        # Waits that differ (3 to 4 s): no one timeout shows (see the next test).
        _leaves_queued(ctrl, f"gone{i}", now, 3.0 + 0.5 * (i % 3))
        now += 3.0
    # Nine departures are not yet evidence: the configured default still applies.
    assert ctrl.report.patience("default", "m") is None
    assert isinstance(ctrl.submit(request("ninth"), now).verdict, Queued)
    assert ctrl.next_deadline() == pytest.approx(now + 30.0)
    ctrl.release("ninth", now + 3.0)
    ctrl.client_ended("default", "m", False, ClientEnd(3.0, True), now + 3.0)
    now += 3.0
    assert ctrl.report.patience("default", "m") == pytest.approx(3.0)
    # The eleventh waits only while it can still be served in time, then is shed with a
    # Retry-After, before its client would have left.
    t0 = now
    assert isinstance(ctrl.submit(request("next"), t0).verdict, Queued)
    due = ctrl.next_deadline()
    assert due is not None and due < t0 + 3.0
    (shed,) = ctrl.advance(due)
    assert isinstance(shed, Shed) and shed.request_id == "next"
    assert shed.retry_after >= ctrl.config.min_retry_after_s
    # One that fits is served at once, under the learned budget.
    ctrl.release("hog", now + 1.0)
    admit = ctrl.submit(request("fits"), now + 1.0).verdict
    assert isinstance(admit, Admit) and admit.latency_budget == pytest.approx(3.0)


def test_clients_with_one_configured_timeout_are_learned_from_three_departures() -> None:
    """A plain HTTP client with a total timeout T leaves at T, all of its instances at
    the same wait: three such departures show the timeout (waiting for ten, at 32
    clients of seed 001's card, held the rest of a 60-request run to the 30 s default).
    Two are not yet evidence, nor are three after waits that differ."""
    ctrl = controller(queue_timeout_s=30.0)
    _full(ctrl)
    now = 0.0
    for i in range(MIN_COHORT - 1):
        _leaves_queued(ctrl, f"gone{i}", now, 37.4)
        now += 1.0
    assert ctrl.report.patience("default", "m") is None
    _leaves_queued(ctrl, "third", now, 37.41)
    assert ctrl.report.patience("default", "m") == pytest.approx(37.4)
    other = controller()
    for i, waited in enumerate((2.0, 3.0, 5.0)):
        other.client_ended("default", "m", False, ClientEnd(waited, True), float(i))
    assert other.report.patience("default", "m") is None


def test_queued_requests_are_judged_by_the_patience_their_wave_teaches() -> None:
    """A wave of clients that state nothing queues under the default timeout; the first
    of them to leave together teach their timeout, and the rest of the wave, queued as
    long, are shed at once with a Retry-After instead of each waiting to leave at it.
    Entries that entered later keep their place until the new deadline."""
    ctrl = controller(queue_timeout_s=30.0)
    _full(ctrl)
    for i in range(8):
        assert isinstance(ctrl.submit(request(f"w{i}"), 0.0).verdict, Queued)
    assert isinstance(ctrl.submit(request("late"), 1.9).verdict, Queued)
    # One that stated a deadline of its own keeps it: the learned patience is not its.
    assert isinstance(ctrl.submit(request("own", deadline=20.0), 0.0).verdict, Queued)
    assert ctrl.next_deadline() == pytest.approx(20.0)
    taught: list = []
    for i in range(MIN_COHORT):
        ctrl.release(f"w{i}", 2.0)
        taught += ctrl.client_ended("default", "m", False, ClientEnd(2.0, True), 2.0)
    assert ctrl.report.patience("default", "m") == pytest.approx(2.0)
    shed = {e.request_id for e in taught if isinstance(e, Shed)}
    assert shed == {f"w{i}" for i in range(MIN_COHORT, 8)}
    assert all(e.retry_after >= ctrl.config.min_retry_after_s for e in taught)
    assert "own" not in shed
    # The late one entered at 1.9 s: it is due before its client leaves at 3.9 s.
    due = ctrl.next_deadline()
    assert due is not None and 1.9 < due < 3.9


def test_a_population_that_never_leaves_keeps_the_default() -> None:
    ctrl = controller(queue_timeout_s=30.0)
    ctrl.upsert_replica(replica("r1", 1000), 0.0)
    for i in range(2 * WINDOW):
        ctrl.client_ended("default", "m", False, ClientEnd(0.5 + (i % 40) * 0.25, False), float(i))
    assert ctrl.report.patience("default", "m") is None
    _full(ctrl, 600.0)
    assert isinstance(ctrl.submit(request("late"), 600.0).verdict, Queued)
    assert ctrl.next_deadline() == pytest.approx(630.0)
    admit = ctrl.submit(request("other", 1, 1, model="m"), 600.0).verdict
    assert not isinstance(admit, Admit) or admit.latency_budget is None


def test_a_mixed_population_is_not_given_its_shortest_patience() -> None:
    ctrl = controller()
    now = 0.0
    for i in range(200):
        # One client in twenty leaves after 1 s; the rest wait 8 s.
        waited = 1.0 if i % 20 == 0 else 8.0
        ctrl.client_ended("default", "m", False, ClientEnd(waited, True), now)
        now += 1.0
    learned = ctrl.report.patience("default", "m")
    assert learned == pytest.approx(8.0)
    # Populations are apart: another tenant and the streams of this one learned nothing.
    assert ctrl.report.patience("other", "m") is None
    assert ctrl.report.patience("default", "m", stream=True) is None


def test_clients_served_quickly_are_censored_not_ignored() -> None:
    # 10 of 110 left at 3 s, 100 were served at 10 s: 9% left by 3 s, so the p10 lies
    # beyond what was seen and the default stays; 12 of 112 is over 10%.
    few = [(3.0, True)] * 10 + [(10.0, False)] * 100
    assert km_quantile(few, 0.1) is None
    assert km_quantile([(3.0, True)] * 12 + [(10.0, False)] * 100, 0.1) == 3.0
    # Served before anyone left: they leave the risk set, the rest decide.
    early = [(1.0, False)] * 100 + [(4.0, True)] * 10 + [(6.0, False)] * 10
    assert km_quantile(early, 0.1) == 4.0


def test_a_learned_patience_holds_while_few_leave_and_yields_to_clients_who_wait_longer() -> None:
    pop = Patience()
    for _ in range(MIN_EVENTS):
        pop.observe(3.0, True)
    assert pop.estimate() == 3.0
    # Shed in time, clients rarely leave: served within it, they say nothing against it.
    for _ in range(WINDOW):
        pop.observe(2.5, False)
    assert pop.events == 0 and pop.estimate() == 3.0
    # Clients seen staying past it: they wait longer now, back to the default (stays are
    # taken in batches of REFRESH_STAYS). Nine are not yet evidence, ten are.
    for t in [6.0] * (MIN_EVENTS - 1) + [2.5] * (REFRESH_STAYS - MIN_EVENTS + 1):
        pop.observe(t, False)
    assert pop.estimate() == 3.0
    for _ in range(REFRESH_STAYS):
        pop.observe(6.0, False)
    assert pop.estimate() is None


def test_the_learned_limit_scores_completions_against_the_learned_patience(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("admission.learned.limit.LIMIT_WINDOW", 4)
    ctrl = controller(learn_limit=True, initial_limit=8.0)
    ctrl.upsert_replica(replica("r1", 100_000), 0.0)
    for _ in range(MIN_EVENTS):
        ctrl.client_ended("default", "m", False, ClientEnd(2.0, True), 0.0)
    assert ctrl.report.patience("default", "m") == pytest.approx(2.0)
    now = 1.0
    for i in range(20):
        for j in range(8):
            assert isinstance(ctrl.submit(request(f"r{i}-{j}"), now).verdict, Admit)
        now += 1.9  # each served in 1.9 s: inside the client, over 60% of its patience
        for j in range(8):
            ctrl.release(
                f"r{i}-{j}",
                now,
                Completion(service_s=1.9, prompt_tokens=100, completion_tokens=100),
            )
        if ctrl.report.replica_usage()[0].limit_reason == "latency":
            break
    usage = ctrl.report.replica_usage()[0]
    assert usage.limit_reason == "latency" and usage.limit is not None and usage.limit < 8


# A stream its client read to the end in 1 s (its first token after 0.2 s).
SERVED = stream_end(1.0, False, 0.2, 0.0, 0.01)


def _stream_departures(pop: ClientPatience, n: int, *, stalled: bool) -> None:
    for i in range(n):
        if stalled:
            # Per-chunk clients: each leaves after a 2 s stall, whenever it comes.
            pop.observe("t", "m", True, ClientEnd(5.0 + i, True, 2.0, True), 10.0 * i)
        else:
            # Whole-stream clients: each leaves at 4 s, while tokens flow; their short
            # streams end within it.
            pop.observe("t", "m", True, SERVED, 10.0 * i)
            pop.observe("t", "m", True, ClientEnd(4.0, True, 0.02, False), 10.0 * i + 1.0)


def test_a_mass_close_is_one_departure_not_a_patience() -> None:
    """A load generator that stops mid-run closes every stream at one instant, each after
    an ordinary gap (here, a gap ten times the chunks' mean): clients that arrived apart
    and left together ran out of nothing. Seen as patience, they taught a per-chunk
    budget of 6 ms (wrk in front of kvgate) and every later stream was shed."""
    pop = ClientPatience()
    now = 0.0
    for _run in range(2):
        for _ in range(120):  # served streams: first token after ~20 ms
            now += 0.01
            pop.observe("t", "m", True, ClientEnd(0.03, False, 0.02), now)
        for i in range(32):  # the generator stops: every open stream closes at once
            end = ClientEnd(0.002 * (i + 1), True, 0.006, True)
            pop.observe("t", "m", True, end, now + 0.0001 * i)
    assert pop.budget("t", "m", True) is None  # nothing learned: the default applies
    # The same departures spread over time, each after its own 6 ms stall: learned.
    spread = ClientPatience()
    for i in range(MIN_EVENTS * 2):
        spread.observe("t", "m", True, ClientEnd(0.03, False, 0.02), 1.0 * i)
        spread.observe("t", "m", True, ClientEnd(0.001 * (i + 1), True, 0.006, True), i + 0.5)
    assert spread.budget("t", "m", True) == Budget(0.006, whole=False)


def test_a_load_generator_stopping_at_saturation_teaches_nothing() -> None:
    """wrk at concurrency 32 in front of an engine that answers in 5-9 ms: at each round's
    end it closes its 32 connections within a millisecond, each request some way into its
    few milliseconds. Their waits are alike only because every wait is short: they left
    at one moment, not after one wait. Counted, they taught a 7 ms patience and the next
    rounds were shed."""
    rng = random.Random(7)
    pop = ClientPatience()
    now = 0.0
    for _round in range(4):
        for _ in range(2000):  # served: nobody left
            now += 0.0005
            pop.observe("t", "m", False, ClientEnd(rng.uniform(0.005, 0.009), False), now)
        closes = sorted((now + rng.uniform(0, 0.001), rng.uniform(0, 0.007)) for _ in range(32))
        for at, waited in closes:
            pop.observe("t", "m", False, ClientEnd(waited, True), at)
    assert pop.budget("t", "m", False) is None
    assert pop.readings()[0].left <= 2 * 4  # about the first of each close
    # It sent its requests in batches: the 32 it closes all waited 13 ms, as a cohort with
    # one timeout would have, but requests of theirs were served after 20 ms and more.
    batched = ClientPatience()
    now = 0.0
    for _round in range(4):
        for _ in range(2000):
            now += 0.0005
            batched.observe("t", "m", False, ClientEnd(rng.uniform(0.005, 0.03), False), now)
        for i in range(32):
            batched.observe("t", "m", False, ClientEnd(0.013, True), now + 0.00003 * i)
    assert batched.budget("t", "m", False) is None
    assert batched.readings()[0].left == 4


def _wrk_rounds_on_a_busy_gateway(told: bool) -> ClientPatience:
    """wrk -c32 in front of kvgate on two shared cores (bench/overhead.py): served
    requests wait 20-45 ms; at each round's end wrk closes its 32 connections at one
    instant, each request 1-30 ms into its wait (on uvloop's millisecond clock). The
    loop, behind its own work and the machine's, runs their cancelled handlers one every
    12 ms. `told`: each departure carries when its connection was lost (`left_at`)."""
    rng = random.Random(49)
    pop = ClientPatience()
    now = 0.0
    for _round in range(4):
        for _ in range(2000):  # served: nobody left
            now += 0.001
            pop.observe("t", "m", False, ClientEnd(round(rng.uniform(0.02, 0.045), 3), False), now)
        closed = now + 0.0005
        for i in range(32):
            noticed = closed + 0.012 * i
            arrived = closed - round(rng.uniform(0.001, 0.03), 3)
            if told:
                end = ClientEnd(closed - arrived, True, left_at=closed)
            else:
                end = ClientEnd(noticed - arrived, True)
            pop.observe("t", "m", False, end, noticed)
        now = closed + 0.012 * 32
    return pop


def test_a_close_a_busy_gateway_notices_late_is_still_one_departure() -> None:
    """Measured (docs/benchmarks-cost.md): on a loaded machine kvgate's handlers learned
    of wrk's closes over tens to hundreds of milliseconds, each departure timed when its
    handler ran. Spread past TOGETHER_S and lengthened by kvgate's own delay, one close
    counted up to 16 departures and taught a 13-34 ms patience that shed the next
    round's requests with 503s. The instant the transport saw each connection lost is
    when its client left: the close is one departure again."""
    pop = _wrk_rounds_on_a_busy_gateway(told=True)
    assert pop.budget("t", "m", False) is None
    assert pop.readings()[0].left <= 2 * 4  # about the first of each close
    # Timed by when each handler ran, the same closes are a population leaving after
    # 30-400 ms, and a patience is learned from kvgate's own slowness.
    late = _wrk_rounds_on_a_busy_gateway(told=False)
    assert late.readings()[0].left >= MIN_EVENTS
    assert late.budget("t", "m", False) is not None


def test_a_departure_is_timed_from_when_its_connection_was_lost() -> None:
    """`left_at` is the instant the close is judged by; without it, the observation's."""
    pop = ClientPatience()
    pop.observe("t", "m", False, ClientEnd(0.01, True, left_at=5.0), 5.05)
    # 40 ms after by the handlers' clocks, the same instant by the transport's: a close.
    pop.observe("t", "m", False, ClientEnd(0.03, True, left_at=5.0), 5.09)
    assert pop.readings()[0].left == 1
    apart = ClientPatience()
    apart.observe("t", "m", False, ClientEnd(0.01, True), 5.05)
    apart.observe("t", "m", False, ClientEnd(0.03, True), 5.09)
    assert apart.readings()[0].left == 2


@pytest.mark.parametrize("stream", [False, True])
def test_members_of_a_mass_close_counted_before_it_showed_are_taken_back(stream: bool) -> None:
    """Measured on wrk's streams through kvgate on a loaded machine: a close whose first
    9 departures had one wait (11 ms: requests kvgate's loop began in one iteration and
    lost in one, on its millisecond clock) and whose next 7, 3 ms later, waited 1-2 ms.
    The 9 counted as a cohort with one timeout before the 10th showed a mass close, and
    taught an 11 ms patience that shed the next round. Judged whole, the close is one
    departure."""
    rng = random.Random(11)
    pop = ClientPatience()
    now = 0.0
    for _ in range(2000):  # served in 5-12 ms by kvgate's clock
        now += 0.002
        waited = round(rng.uniform(0.005, 0.012), 3)
        pop.observe("t", "m", stream, ClientEnd(waited, False, 0.004, first_s=0.004), now)
    closed = now + 0.001
    for i in range(9):
        pop.observe("t", "m", stream, ClientEnd(0.011, True, 0.011), closed + 0.001 * (i // 6))
    for i in range(7):
        end = ClientEnd(0.001 + 0.001 * (i < 2), True, 0.001)
        pop.observe("t", "m", stream, end, closed + 0.003)
    assert pop.budget("t", "m", stream) is None
    assert pop.learned("t", "m", stream) is None
    assert pop.readings()[0].window_events == 1
    # A cohort with one timeout that nothing else left beside still counts whole.
    cohort = ClientPatience()
    for _ in range(300):
        now += 0.002
        cohort.observe("t", "m", False, ClientEnd(0.008, False), now)
    for i in range(MIN_COHORT):
        cohort.observe("t", "m", False, ClientEnd(0.011, True), now + 0.001 * i)
    assert cohort.budget("t", "m", False) == Budget(0.011)


def test_a_cohort_that_arrived_together_and_leaves_together_counts_whole() -> None:
    pop = ClientPatience()
    for i in range(MIN_EVENTS):  # sent at once with one 3 s timeout: they leave together
        pop.observe("t", "m", False, ClientEnd(3.0 + 0.004 * i, True), 3.0 + 0.001 * i)
    assert pop.budget("t", "m", False) == Budget(3.0)


def test_a_stream_budget_takes_the_shape_of_where_its_clients_leave() -> None:
    whole = ClientPatience()
    _stream_departures(whole, MIN_EVENTS, stalled=False)
    assert whole.budget("t", "m", True) == Budget(4.0, whole=True)
    chunk = ClientPatience()
    _stream_departures(chunk, MIN_EVENTS, stalled=True)
    assert chunk.budget("t", "m", True) == Budget(2.0, whole=False)
    # Departures before the first token say nothing of the shape: a whole-stream
    # deadline is assumed, the stricter one.
    early = ClientPatience()
    early.observe("t", "m", True, SERVED, 0.0)
    for i in range(MIN_EVENTS):
        early.observe("t", "m", True, ClientEnd(3.0, True, 3.0, None), 10.0 * i + 1.0)
    assert early.budget("t", "m", True) == Budget(3.0, whole=True)


def test_a_whole_stream_deadline_no_stream_was_read_within_is_not_learned() -> None:
    """Three readers admitted together stop 1-6 events in and happen to leave after one
    wait (16 ms) though their first tokens came apart: read as a clock, they taught the
    stoppers' gateway test's patient streams a 16 ms deadline from a cold start of 4.
    No stream of the population was ever read to its end that fast: not a deadline."""
    pop = ClientPatience()
    for i in range(5):
        pop.observe("t", "m", True, SERVED, 10.0 * i)  # patient streams, read to the end
    for i, first in enumerate((0.004, 0.009, 0.014)):
        pop.observe("t", "m", True, stream_end(0.016, True, first, 0.001, 0.002), 60.0 + i)
    assert pop.budget("t", "m", True) is None
    # A clock with the same departures whose short streams do end within it is one.
    pop.observe("t", "m", True, stream_end(0.012, False, 0.004, 0.0, 0.001), 70.0)
    got = pop.budget("t", "m", True)
    assert got is not None and got.whole and got.seconds == pytest.approx(0.016)


@pytest.mark.parametrize("stalled", [False, True], ids=["whole-stream", "per-chunk"])
def test_a_stream_is_scored_on_what_its_clients_wait_for(
    stalled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("admission.learned.limit.LIMIT_WINDOW", 4)
    ctrl = controller(learn_limit=True, initial_limit=8.0)
    ctrl.upsert_replica(replica("r1", 100_000), 0.0)
    ctrl.client_ended("default", "m", True, SERVED, 0.0)
    for i in range(MIN_EVENTS):
        end = ClientEnd(5.0 + i, True, 2.0, True) if stalled else ClientEnd(4.0, True, 0.02, False)
        ctrl.client_ended("default", "m", True, end, 10.0 * i + 1.0)
    now = 1.0
    for i in range(6):
        for j in range(8):
            req = request(f"s{i}-{j}")
            req.stream = True
            assert isinstance(ctrl.submit(req, now).verdict, Admit)
        now += 3.5  # first token at once, the whole stream in 3.5 s
        for j in range(8):
            done = Completion(
                service_s=3.5, ttft_s=0.05, itl_s=0.03, prompt_tokens=100, completion_tokens=100
            )
            ctrl.release(f"s{i}-{j}", now, done)
        if ctrl.report.replica_usage()[0].limit_reason == "latency":
            break
    usage = ctrl.report.replica_usage()[0]
    if stalled:
        # A per-chunk client waits for each chunk: a fast first token keeps it.
        assert usage.limit_reason != "latency" and usage.limit is not None and usage.limit >= 8
    else:
        # A whole-stream client waits for all of it: 3.5 s of its 4 s is over the aim.
        assert usage.limit_reason == "latency" and usage.limit is not None and usage.limit < 8


@pytest.mark.slow
def test_clients_that_state_no_timeout_are_not_held_past_it_in_virtual_time() -> None:
    # Seed 001's card and job (tests/admission/test_limit.py), 32 closed-loop clients that
    # give up after 45 s and never say so, retrying sheds twice after Retry-After. Once
    # held for a 30 s queue timeout plus service, 235 of 320 timed out. No deadline is
    # assumed now: the first wave's queued clients leave at 45 s, which teaches the rest.
    from bench.vtime import run
    from enginesim.workloads import seed2_workload
    from tests.admission.test_limit import PROFILE, TIMEOUT_S

    items = seed2_workload(320, seed=3)
    report = run(
        PROFILE, items, concurrency=32, timeout_s=TIMEOUT_S, send_timeout=False, max_retries=2
    )
    # What the cold start costs: the queue that times out while the first ten leave.
    assert report.timed_out <= 40
    assert report.completed >= 0.85 * len(items)
    assert report.preemptions == 0


def _reader(pop: ClientPatience, first: float, events: int, now: float) -> None:
    """A client that stops reading a stream `events` events (20 ms apart) after its first
    token, which came `first` after its arrival: by design, not out of patience."""
    waited = first + 0.02 * (events - 1)
    pop.observe("t", "m", True, stream_end(waited, True, first, 0.0005, 0.02), now)


def test_clients_that_stop_reading_a_stream_teach_no_deadline() -> None:
    """Readers that stop after a few events (a user pressing stop, an agent that read
    enough) leave while tokens flow, as a client with a total timeout does; counted as
    departures they taught the chaos bench's stream population a whole-stream deadline
    of 14 ms, and every patient stream was shed. They leave as spread as their first
    tokens came; a clock leaves at one total time whenever its first token came."""
    rng = random.Random(3)
    pop = ClientPatience()
    now = 0.0
    for _ in range(WINDOW):
        now += 0.5
        pop.observe("t", "m", True, stream_end(rng.uniform(2, 6), False, 0.3, 0.3, 0.02), now)
        _reader(pop, rng.uniform(0.05, 1.2), rng.randint(1, 6), now + 0.25)
    assert pop.budget("t", "m", True) is None
    # Readers of a burst that queued together: first tokens within 25 ms of one another,
    # each gone a few events later. They left together because they began together.
    burst = ClientPatience()
    for i in range(MIN_EVENTS):
        _reader(burst, 0.19 + 0.0025 * i, 1 + i % 3, 0.2 + 0.003 * i)
    assert burst.budget("t", "m", True) is None


def test_a_total_deadline_mid_stream_is_learned_beside_readers() -> None:
    """Clients with a 4 s total timeout, whose first tokens came anywhere from 0.1 to
    2 s, all leave at 4 s: a clock. Readers beside them (a third) do not hide it, and
    do not shorten it."""
    rng = random.Random(4)
    pop = ClientPatience()
    pop.observe("t", "m", True, SERVED, 0.0)
    now = 0.0
    for i in range(3 * MIN_EVENTS):
        now += 1.0
        if i % 3 == 2:
            _reader(pop, rng.uniform(0.05, 1.0), rng.randint(1, 6), now)
        else:
            first = rng.uniform(0.1, 2.0)
            left = stream_end(4.0 + rng.uniform(0, 0.01), True, first, 0.01, 0.02)
            pop.observe("t", "m", True, left, now)
    got = pop.budget("t", "m", True)
    assert got is not None and got.whole and 4.0 <= got.seconds <= 4.01


def test_patient_streams_beside_readers_are_not_shed_in_virtual_time() -> None:
    """Four patient streaming clients that state no timeout, beside four that stop each
    stream after 1-6 events, on one tiny replica: before, the readers taught a deadline
    no stream met and the patient clients were shed 82 times in 400 requests."""
    from bench.vtime import run
    from enginesim.workloads import synthetic_items

    rng = random.Random(5)
    items = synthetic_items(400, 200, 120)
    for item in items:
        item.output_tokens = rng.randint(60, 160)
    report = run(
        "tiny", items, concurrency=8, timeout_s=60.0, send_timeout=False, stream=True, stoppers=4
    )
    assert report.stopped >= 300  # the readers did what they do
    assert report.completed + report.stopped == len(items)
    assert sum(n for client, n in report.sheds.items() if client >= 4) == 0


def test_requests_admitted_before_their_clients_patience_was_learned_are_scored_by_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """64 plain clients on seed 001's card: slow start grew to 24 on completions it could
    not judge (their clients stated nothing and no patience was learned when they were
    admitted), and they timed out while running. Once the population's patience is
    known, the completions of requests admitted before it are scored against it."""

    monkeypatch.setattr("admission.learned.limit.LIMIT_WINDOW", 4)

    def limit_after(learn: bool) -> tuple[int, str]:
        ctrl = controller(learn_limit=True, initial_limit=8)
        ctrl.upsert_replica(replica(capacity=100_000), 0.0)
        for i in range(8):  # their clients state nothing
            assert isinstance(ctrl.submit(request(f"r{i}", 100, 100), 0.0).verdict, Admit)
        if learn:
            ctrl.adopt_patience("default", "m", False, Budget(10.0), 1.0)
        served = Completion(service_s=9.0, prompt_tokens=100, completion_tokens=100)
        for i in range(8):  # each served for 9 s of its clients' 10
            ctrl.release(f"r{i}", 9.0 + i, served)
        # The window's last: a client that states 100 s, served in 1.
        assert isinstance(ctrl.submit(request("last", latency_budget=100.0), 17.0).verdict, Admit)
        ctrl.release("last", 18.0, Completion(service_s=1.0, prompt_tokens=100,
                                              completion_tokens=100, latency_budget=100.0))  # fmt: skip
        (usage,) = ctrl.report.replica_usage()
        assert usage.limit is not None
        return usage.limit, usage.limit_reason

    assert limit_after(learn=False)[0] >= 8  # nothing to judge the eight by
    limit, reason = limit_after(learn=True)
    assert limit < 8 and reason == "latency"
