"""Retry memory, and the queue order it feeds (virtual time)."""

from __future__ import annotations

from admission.config import AdmissionConfig
from admission.controller import AdmissionController
from admission.retries import RetryMemory, identify
from admission.types import AdmissionRequest, Admit, AttemptEnd, Queued
from routing.scheduler import default_profile
from routing.types import ReplicaState


def first_arrival(mem: RetryMemory, key: object, now: float) -> float | None:
    got = mem.recall(key, now)
    return None if got is None else got.arrival


def test_remembers_first_arrival_until_ttl() -> None:
    mem = RetryMemory(ttl_s=10.0, max_entries=100)
    assert first_arrival(mem, "k", now=0.0) is None
    mem.remember("k", arrival=1.0, now=2.0)
    assert first_arrival(mem, "k", now=5.0) == 1.0
    # Shed again later: the first arrival stands, the expiry moves.
    mem.remember("k", arrival=7.0, now=8.0)
    assert first_arrival(mem, "k", now=17.0) == 1.0
    assert first_arrival(mem, "k", now=18.0) is None  # 8 + 10
    assert len(mem) == 0


def test_forget_and_bounds() -> None:
    mem = RetryMemory(ttl_s=10.0, max_entries=3)
    for i in range(5):
        mem.remember(i, arrival=float(i), now=float(i))
    assert len(mem) == 3
    assert first_arrival(mem, 0, now=5.0) is None and first_arrival(mem, 1, now=5.0) is None
    assert first_arrival(mem, 4, now=5.0) == 4.0
    mem.forget(4)
    assert first_arrival(mem, 4, now=5.0) is None
    # Expired entries are dropped when new ones come in.
    mem.remember("late", arrival=30.0, now=30.0)
    assert len(mem) == 1
    disabled = RetryMemory(ttl_s=0.0, max_entries=3)
    disabled.remember("k", 1.0, 1.0)
    assert first_arrival(disabled, "k", 1.0) is None


def test_an_older_arrival_is_queued_and_admitted_first() -> None:
    ctrl = AdmissionController(
        AdmissionConfig(headroom=0.0, queue_timeout_s=100.0), default_profile(seed=1), seed=1
    )
    ctrl.upsert_replica(
        ReplicaState(
            name="r",
            base_url="",
            ready=True,
            models=["m"],
            capacity_tokens=1000,
            block_size=1,
            max_running=1,
        ),
        now=0.0,
    )

    def req(rid: str, arrival: float) -> AdmissionRequest:
        return AdmissionRequest(
            rid, "m", prompt_tokens=10, expected_output=10, max_tokens=10, arrival=arrival
        )

    assert isinstance(ctrl.submit(req("running", 0.0), now=0.0).verdict, Admit)
    newer = ctrl.submit(req("newer", 5.0), now=5.0).verdict
    retry = ctrl.submit(req("retry", 1.0), now=6.0).verdict  # a retry that first arrived at t=1
    assert isinstance(newer, Queued) and isinstance(retry, Queued)
    assert retry.position == 0  # ahead of the newer arrival
    admitted = ctrl.release("running", now=7.0)
    assert [a.request_id for a in admitted] == ["retry"]
    assert [a.request_id for a in ctrl.release("retry", now=8.0)] == ["newer"]
    ctrl.release("newer", now=9.0)
    assert ctrl.report.reserved_tokens() == 0


def shed_and_see(mem: RetryMemory, key: object, unserved: int, back: bool, now: float) -> float:
    """Shed `key` `unserved` times, each coming back in time; after the last it comes back
    (`back`) or is never seen again. Returns the time after its last outcome was due."""
    for i in range(unserved):
        if i:
            assert mem.recall(key, now) is not None  # back after its Retry-After
        mem.remember(key, arrival=0.0, now=now, retry_after=1.0)
        now += 1.0
    if back:
        assert mem.recall(key, now) is not None
        mem.forget(key)  # it got in
    return now + 10.0


def test_the_retry_budget_of_clients_that_do_not_say_is_learned_from_who_comes_back() -> None:
    """Cold, an attempt after two sheds is taken for a last one (the openai SDK's default
    budget). Clients that retry a 503 three times come back after three sheds: that drops
    the prior, and once three were never seen after four sheds, an attempt after three
    is their last."""
    mem = RetryMemory(ttl_s=120.0, max_entries=1000)
    now = 0.0
    assert mem.last_attempt("default", 2) and not mem.last_attempt("default", 1)
    for i in range(9):
        now = shed_and_see(mem, ("back", i), unserved=1 + i % 3, back=True, now=now)
    mem.recall("poke", now)  # outcomes due by now are counted on the next call
    assert mem.budget.attempts("default") is None  # three came back after three sheds
    assert not mem.last_attempt("default", 2)
    for i in range(2):
        now = shed_and_see(mem, ("gone", i), unserved=4, back=False, now=now)
    mem.recall("poke", now)
    assert mem.budget.attempts("default") is None  # two departures are not yet a budget
    now = shed_and_see(mem, ("gone", 2), unserved=4, back=False, now=now)
    mem.recall("poke", now)
    assert mem.budget.attempts("default") == 4
    assert mem.last_attempt("default", 3) and not mem.last_attempt("default", 2)
    (reading,) = mem.budget.readings()
    assert (reading.attempts, reading.gave_up) == (4, 3) and reading.came_back >= 18
    # Another tenant has seen nothing: the prior.
    assert mem.last_attempt("other", 2)


def test_a_population_that_keeps_coming_back_shows_no_budget() -> None:
    """Clients that retry without end, and a few that give up at various counts (a
    client that also retried its own timeouts spends attempts the memory never saw):
    no count of sheds is one most of them gave up after."""
    mem = RetryMemory(ttl_s=120.0, max_entries=1000)
    now = 0.0
    for i in range(30):
        now = shed_and_see(mem, ("back", i), unserved=1 + i % 4, back=True, now=now)
    for i in range(10):
        now = shed_and_see(mem, ("gone", i), unserved=2 + i % 2, back=False, now=now)
    mem.recall("poke", now)
    assert mem.budget.attempts("default") is None
    assert not mem.last_attempt("default", 3) and not mem.last_attempt("default", 5)


def test_a_retry_is_known_by_what_its_client_says() -> None:
    body = b'{"model":"m","messages":[]}'
    first = identify("t", "m", body, retry_count=0)
    again = identify("t", "m", body, retry_count=1)
    # The SDK's count: a first attempt is nobody's retry; its retry has the same key.
    assert first.said and first.first and not again.first and again.key == first.key
    # The same body from another tenant or for another model is another request.
    assert identify("u", "m", body, 1).key != again.key
    assert identify("t", "n", body, 1).key != again.key
    # An idempotency key names the request whatever its body (and whatever the count).
    a = identify("t", "m", body, 0, "req-7")
    b = identify("t", "m", b"{}", None, "req-7")
    assert a.key == b.key and a.said and not a.first
    assert identify("t", "m", body, None, "req-8").key != a.key
    plain = identify("t", "m", body)
    assert not plain.said and not plain.first and plain.key == first.key


def test_a_client_that_says_nothing_is_recalled_only_while_due_back() -> None:
    mem = RetryMemory(ttl_s=120.0, max_entries=100)
    # Shed with Retry-After 2 s at t=10: due back by 10 + 2 x 2 + the 5 s grace = 19.
    mem.remember("plain", arrival=9.0, now=10.0, retry_after=2.0, said=False)
    mem.remember("sdk", arrival=9.0, now=10.0, retry_after=2.0, tenant="s", said=True)
    assert first_arrival(mem, "plain", now=18.0) == 9.0  # back in time: its retry
    mem.remember("plain", arrival=9.0, now=18.5, retry_after=2.0, said=False)
    # An identical body past that is another request, though the memory's ttl runs on;
    # a client that said which attempt it sends is known for the whole ttl.
    assert first_arrival(mem, "plain", now=40.0) is None
    assert mem.recall("sdk", now=40.0, tenant="s") == (9.0, 1)
    # The plain one came back once, then not: the retry budget learned both outcomes.
    plain = next(r for r in mem.budget.readings() if r.tenant == "default")
    assert (plain.came_back, plain.gave_up) == (1, 1)


def test_a_reload_sets_how_long_a_request_left_unserved_is_remembered() -> None:
    ctrl = AdmissionController(AdmissionConfig(retry_memory_s=60.0), default_profile(seed=1))
    body = b'{"model":"m","messages":[]}'

    def attempt(rid: str, now: float) -> AdmissionRequest:
        req = AdmissionRequest(rid, "m", prompt_tokens=10, expected_output=10, max_tokens=10)
        ctrl.arrived(req, identify("t", "m", body, retry_count=1), now, True)
        return req

    ctrl.attempt_ended(AttemptEnd(attempt("a", 0.0), 0.0, unanswered=True), now=1.0)
    assert attempt("b", 30.0).arrival == 0.0  # its retry keeps its first arrival
    ctrl.reconfigure(AdmissionConfig(retry_memory_s=10.0), None, now=31.0)
    ctrl.attempt_ended(AttemptEnd(attempt("c", 40.0), 40.0, unanswered=True), now=41.0)
    assert attempt("d", 55.0).arrival == 55.0  # 14 s later: forgotten under the new 10 s
