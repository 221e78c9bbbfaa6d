"""Reservations per engine behaviour (preempting or not), pools of private slots, and
abandoned requests held until the engine stops them, on virtual time."""

from __future__ import annotations

from dataclasses import replace

from admission.controller import AdmissionController
from admission.types import Admit, Completion, Queued, Refuse
from gateway.denials import refusal_message
from routing.types import ReplicaState
from tests.admission.helpers import controller, replica, request


def llama(
    capacity: int = 4096,
    max_model_len: int = 4096,
    *,
    private: bool = False,
    slots: int = 4,
    name: str = "r1",
) -> ReplicaState:
    """A replica that does not preempt (llama.cpp): unified by default."""
    state = replica(name, capacity, max_model_len=max_model_len, max_running=slots)
    state.preempts = False
    state.private_slots = private
    return state


def test_preempting_engine_reserves_the_learned_output() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica(capacity=4096, max_model_len=4096), 0.0)
    # expected_output (a learned quantile) 8, max_tokens 1500: 108 reserved.
    assert ctrl.submit(request("a", 100, 8, max_tokens=1500), 0.0).verdict == Admit("a", "r1", 108)


def test_non_preempting_engine_reserves_prompt_plus_max_tokens() -> None:
    ctrl = controller()
    ctrl.upsert_replica(llama(), 0.0)
    assert ctrl.submit(request("a", 1500, 8, max_tokens=300), 0.0).verdict == Admit("a", "r1", 1800)
    assert ctrl.submit(request("b", 1500, 8, max_tokens=300), 0.0).verdict == Admit("b", "r1", 1800)
    # A third would overrun the shared 4,096 cells (5,400 > 4,096): it waits.
    assert isinstance(ctrl.submit(request("c", 1500, 8, max_tokens=300), 0.0).verdict, Queued)


def test_non_preempting_without_max_tokens_reserves_the_slot_context() -> None:
    ctrl = controller()
    ctrl.upsert_replica(llama(capacity=4096, max_model_len=1024, private=True), 0.0)
    req = replace(request("a", 100, 8, max_tokens=8), max_tokens_given=False)
    assert ctrl.submit(req, 0.0).verdict == Admit("a", "r1", 1024)


def test_non_preempting_request_larger_than_the_pool_runs_alone() -> None:
    """Unified 4,096 with 5% headroom: an unbounded request whose prompt was counted from
    its characters may fill the slot (4,096), grown by the margin to more than the pool
    (4,312). It takes all of the pool instead of being refused."""
    ctrl = controller(headroom=0.05)
    ctrl.upsert_replica(llama(), 0.0)
    unbounded = replace(
        request("a", 100, 8, max_tokens=8), max_tokens_given=False, prompt_exact=False
    )
    assert ctrl.submit(unbounded, 0.0).verdict == Admit("a", "r1", 4096)
    assert isinstance(ctrl.submit(request("b", 10, 1, max_tokens=1), 0.0).verdict, Queued)
    assert ctrl.release("a", 1.0) == [Admit("b", "r1", 11)]


def test_non_preempting_refuses_only_a_prompt_that_fills_the_slot() -> None:
    """llama.cpp serves max_tokens past the context (it stops at the slot's end with
    "length"), so kvgate admits that with the whole slot reserved; it refuses only a
    prompt of the slot's context or more, which the engine refuses too."""
    ctrl = controller()
    ctrl.upsert_replica(llama(capacity=4096, max_model_len=1024, private=True), 0.0)
    assert ctrl.submit(request("a", 1000, 8, max_tokens=100), 0.0).verdict == Admit("a", "r1", 1024)
    assert ctrl.submit(request("b", 1023, 8, max_tokens=100), 0.0).verdict == Admit("b", "r1", 1024)
    verdict = ctrl.submit(request("c", 1024, 8, max_tokens=1), 0.0).verdict
    assert isinstance(verdict, Refuse) and verdict.code == "context_length_exceeded"
    assert refusal_message(verdict).startswith(
        "This model's maximum context length is 1024 tokens."
    )
    assert "your prompt has 1024 tokens" in refusal_message(verdict)


def test_private_slots_keep_no_headroom() -> None:
    """Per-slot KV: 4 slots of 1,024 cannot be overrun, so all four run at full size."""
    ctrl = controller(headroom=0.05)
    ctrl.upsert_replica(llama(capacity=4096, max_model_len=1024, private=True), 0.0)
    (usage,) = ctrl.report.replica_usage()
    assert usage.effective_capacity_tokens == 4096
    for i in range(4):
        req = replace(request(f"s{i}", 200, 8, max_tokens=8), max_tokens_given=False)
        assert ctrl.submit(req, 0.0).verdict == Admit(f"s{i}", "r1", 1024)
    assert isinstance(ctrl.submit(request("s4", 10, 1), 0.0).verdict, Queued)  # 4 slots busy


def test_a_stream_past_its_private_slot_needs_no_more_of_the_pool() -> None:
    """Seen on llama.cpp per-slot: four streams held the four slots (4 x 1,024) and the
    relay's count of one reached 1,153 tokens (prompt as counted plus every event; the
    server stops a slot at its context); its top-up failed for want of pool, counted as an
    overrun where none is possible: it holds only its slot."""
    ctrl = controller()
    ctrl.upsert_replica(llama(capacity=4096, max_model_len=1024, private=True), 0.0)
    for i in range(4):
        req = replace(request(f"s{i}", 900, 8, max_tokens=250), max_tokens_given=True)
        assert ctrl.submit(req, 0.0).verdict == Admit(f"s{i}", "r1", 1024)
    assert ctrl.top_up("s0", 1153, 1.0) is True
    assert ctrl.report.top_up_failures == 0


def test_estimated_prompt_over_the_slot_is_clamped_and_forwarded() -> None:
    """Invariant 4 for a non-preempting replica: an estimate over the context is not a 400."""
    ctrl = controller()
    ctrl.upsert_replica(llama(capacity=4096, max_model_len=1024, private=True), 0.0)
    req = replace(request("a", 1200, 8, max_tokens=100), prompt_exact=False)
    assert ctrl.submit(req, 0.0).verdict == Admit("a", "r1", 1024)


def test_mixed_fleet_reserves_per_replica() -> None:
    ctrl = controller()
    ctrl.upsert_replica(replica("vllm", 4096, max_model_len=4096), 0.0)
    ctrl.upsert_replica(llama(name="llama"), 0.0)
    ctrl.mark_unready("vllm", 0.0)
    assert ctrl.submit(request("a", 100, 8, max_tokens=500), 0.0).verdict == Admit(
        "a", "llama", 600
    )
    ctrl.upsert_replica(replica("vllm", 4096, max_model_len=4096), 0.0)
    ctrl.mark_unready("llama", 0.0)
    assert ctrl.submit(request("b", 100, 8, max_tokens=500), 0.0).verdict == Admit("b", "vllm", 108)


# ---------------------------------------------------------------------- abandoned requests
def engine_view(state: ReplicaState, running: int, seen: float) -> ReplicaState:
    return replace(state, engine_running=running, running_seen_at=seen, updated_at=seen)


def test_abandoned_reservation_is_held_until_the_engine_stops_it() -> None:
    ctrl = controller()
    state = llama(capacity=1000, max_model_len=1000)
    ctrl.upsert_replica(state, 0.0)
    assert isinstance(ctrl.submit(request("a", 400, 8, max_tokens=400), 0.0).verdict, Admit)
    assert ctrl.abandon("a", 1.0) == []
    assert (ctrl.report.held(), ctrl.report.reserved_tokens()) == (1, 800)
    assert ctrl.report.replica_usage()[0].held == 1
    assert isinstance(ctrl.submit(request("b", 400, 8, max_tokens=400), 1.0).verdict, Queued)
    # A round that began before the abandonment says nothing about it.
    assert ctrl.upsert_replica(engine_view(state, 0, 0.9), 1.1) == []
    # One that began after it and still sees it running: held.
    assert ctrl.upsert_replica(engine_view(state, 1, 1.5), 1.6) == []
    assert ctrl.report.held() == 1
    # The next shows the engine idle: released, and the queue moves.
    assert ctrl.upsert_replica(engine_view(state, 0, 2.5), 2.6) == [Admit("b", "r1", 800)]
    assert ctrl.report.held() == 0
    ctrl.release("b", 3.0)
    assert ctrl.report.reserved_tokens() == 0


def test_held_reservation_counts_live_requests_against_the_gauge() -> None:
    ctrl = controller()
    state = llama(capacity=4000, max_model_len=1000)
    ctrl.upsert_replica(state, 0.0)
    for rid in ("a", "b", "c"):
        assert isinstance(ctrl.submit(request(rid, 100, 8, max_tokens=100), 0.0).verdict, Admit)
    ctrl.abandon("a", 1.0)
    ctrl.abandon("b", 1.2)
    # Engine runs 2: live "c" and one of the held (the older one is released first).
    ctrl.upsert_replica(engine_view(state, 2, 2.0), 2.1)
    assert ctrl.report.held() == 1 and ctrl.report.reservation("a") is None
    # A request admitted after that round cannot be in its count: the view is not reused.
    assert isinstance(ctrl.submit(request("d", 100, 8, max_tokens=100), 2.2).verdict, Admit)
    ctrl.upsert_replica(engine_view(state, 2, 2.0), 2.3)
    assert ctrl.report.held() == 1
    ctrl.upsert_replica(engine_view(state, 2, 3.0), 3.1)  # c and d: b has stopped
    assert ctrl.report.held() == 0
    for rid in ("c", "d"):
        ctrl.release(rid, 4.0)
    assert ctrl.report.reserved_tokens() == 0


def test_held_reservation_is_released_after_the_grace_and_learns_then() -> None:
    ctrl = controller(abandoned_hold_s=5.0, learn_limit=True)
    state = llama()
    ctrl.upsert_replica(state, 0.0)
    assert isinstance(ctrl.submit(request("a", 100, 8, max_tokens=100), 0.0).verdict, Admit)
    ctrl.abandon("a", 1.0, Completion(ok=False, latency_budget=1.0))
    assert ctrl.next_deadline() == 6.0
    ctrl.upsert_replica(engine_view(state, 1, 2.0), 2.0)  # still running (or someone else)
    assert ctrl.advance(5.9) == [] and ctrl.report.held() == 1
    assert ctrl.advance(6.0) == [] and ctrl.report.held() == 0
    assert ctrl.report.reserved_tokens() == 0 and ctrl.next_deadline() is None
    assert ctrl.abandon("a", 7.0) == []  # idempotent: already gone


def test_release_of_a_held_reservation_and_no_gauge() -> None:
    ctrl = controller()
    ctrl.upsert_replica(llama(), 0.0)  # no running gauge (running_seen_at None)
    assert isinstance(ctrl.submit(request("a", 100, 8, max_tokens=100), 0.0).verdict, Admit)
    ctrl.abandon("a", 1.0)
    ctrl.upsert_replica(llama(), 2.0)
    assert ctrl.report.held() == 1  # only the grace can end it
    ctrl.release("a", 2.5)  # an explicit release always works
    assert (ctrl.report.held(), ctrl.report.reserved_tokens()) == (0, 0)


def served(ctrl: AdmissionController, seconds: float, at: float) -> float:
    """Four completions of 108 tokens of work, each `seconds` long, on the one replica."""
    for i in range(4):
        rid = f"warm{i}"
        assert isinstance(ctrl.submit(request(rid, 100, 8, max_tokens=8), at).verdict, Admit)
        at += seconds
        done = Completion(ok=True, service_s=seconds, prompt_tokens=100, completion_tokens=8)
        ctrl.release(rid, at, done)
    return at


def test_a_hold_ends_when_the_engine_would_have_served_the_request() -> None:
    # A preempting engine with no running gauge and one slot, whose requests of this size
    # take 10 ms: clients that leave while it serves them free the slot by twice that
    # from their admission, not after abandoned_hold_s (5 s), and the queue moves then.
    ctrl = controller(abandoned_hold_s=5.0)
    state = replica(capacity=4096, max_model_len=4096, max_running=1)  # preempts
    ctrl.upsert_replica(state, 0.0)
    now = served(ctrl, 0.010, 1.0)
    assert isinstance(ctrl.submit(request("a", 100, 8, max_tokens=8), now).verdict, Admit)
    assert ctrl.abandon("a", now + 0.005) == []
    assert ctrl.report.held() == 1
    assert isinstance(ctrl.submit(request("b", 100, 8, max_tokens=8), now + 0.006).verdict, Queued)
    ends = ctrl.next_deadline()
    assert ends is not None and now + 0.015 <= ends <= now + 0.025, ends - now
    assert ctrl.advance(ends) == [Admit("b", "r1", 108)]
    assert ctrl.report.held() == 0
    # Abandoned after that time, a request is released at once: the queue moves now.
    assert isinstance(ctrl.submit(request("c", 100, 8, max_tokens=8), ends + 1.0).verdict, Queued)
    assert ctrl.abandon("b", ends + 1.0) == [Admit("c", "r1", 108)]
    ctrl.release("c", ends + 2.0)
    assert ctrl.report.reserved_tokens() == 0


def test_an_engine_that_does_not_preempt_keeps_the_whole_hold() -> None:
    # llama.cpp fails requests past its pool: a ghost it may still generate keeps its
    # reservation until a gauge shows it stopped or the grace ends, however fast it served.
    ctrl = controller(abandoned_hold_s=5.0)
    ctrl.upsert_replica(llama(slots=1), 0.0)
    now = served(ctrl, 0.010, 1.0)
    assert isinstance(ctrl.submit(request("a", 100, 8, max_tokens=8), now).verdict, Admit)
    ctrl.abandon("a", now + 0.005)
    assert ctrl.next_deadline() == now + 0.005 + 5.0
    ctrl.release("a", now + 1.0)


def test_no_hold_when_disabled() -> None:
    ctrl = controller(abandoned_hold_s=0.0)
    ctrl.upsert_replica(llama(), 0.0)
    assert isinstance(ctrl.submit(request("a", 100, 8, max_tokens=100), 0.0).verdict, Admit)
    ctrl.abandon("a", 1.0)
    assert (ctrl.report.held(), ctrl.report.reserved_tokens()) == (0, 0)


def test_a_held_request_waiting_inside_the_engine_is_still_held() -> None:
    """vLLM and SGLang report a waiting queue too: a request there is still the engine's."""
    ctrl = controller()
    state = replica(capacity=4096, max_model_len=4096)
    ctrl.upsert_replica(state, 0.0)
    assert isinstance(ctrl.submit(request("a", 100, 8, max_tokens=100), 0.0).verdict, Admit)
    ctrl.abandon("a", 1.0)
    ctrl.upsert_replica(replace(engine_view(state, 0, 2.0), engine_waiting=1), 2.0)
    assert ctrl.report.held() == 1
    ctrl.upsert_replica(engine_view(state, 0, 3.0), 3.0)
    assert ctrl.report.held() == 0 and ctrl.report.reserved_tokens() == 0
