"""Builders shared by the admission tests."""

from __future__ import annotations

from admission.config import AdmissionConfig
from admission.controller import AdmissionController
from admission.shedding import MIN_DRAIN_SAMPLES
from admission.types import AdmissionRequest, Admit, Completion, Events, Shed
from routing.scheduler import default_profile
from routing.types import ReplicaState


def replica(
    name: str = "r1",
    capacity: int | None = 1000,
    *,
    models: tuple[str, ...] = ("m",),
    ready: bool = True,
    block_size: int = 1,
    max_model_len: int | None = None,
    max_running: int | None = None,
) -> ReplicaState:
    return ReplicaState(
        name=name,
        base_url=f"http://127.0.0.1/{name}",
        ready=ready,
        models=list(models),
        capacity_tokens=capacity,
        block_size=block_size,
        max_model_len=max_model_len,
        max_running=max_running,
    )


def request(
    rid: str,
    prompt: int = 100,
    output: int = 100,
    *,
    model: str = "m",
    max_tokens: int | None = None,
    priority: int = 0,
    deadline: float = float("inf"),
    latency_budget: float | None = None,
) -> AdmissionRequest:
    return AdmissionRequest(
        request_id=rid,
        model=model,
        prompt_tokens=prompt,
        expected_output=output,
        max_tokens=output if max_tokens is None else max_tokens,
        priority=priority,
        deadline=deadline,
        latency_budget=latency_budget,
    )


def sheds(events: Events) -> list[Shed]:
    """The sheds among a call's events."""
    return [e for e in events if isinstance(e, Shed)]


def admits(events: Events) -> list[Admit]:
    """The admissions among a call's events."""
    return [e for e in events if isinstance(e, Admit)]


def controller(**overrides: object) -> AdmissionController:
    # The ledger and queue mechanics, without the learned limit (tests/admission/test_limit.py).
    # Retry-After exactly as computed (jitter has its own test).
    settings: dict[str, object] = {"headroom": 0.0, "learn_limit": False, "retry_jitter": 0.0}
    settings.update(overrides)
    return AdmissionController(AdmissionConfig(**settings), default_profile(seed=7), seed=7)


def warm_drain(ctrl: AdmissionController, tokens: int, rate: float, *, start: float = 0.0) -> float:
    """Admit and release `tokens`-sized requests on the only model "m" at `rate` tokens/s
    until the drain meter has history; returns the time reached. Leaves the ledger empty."""
    now = start
    step = tokens / rate
    for i in range(MIN_DRAIN_SAMPLES + 2):
        verdict = ctrl.submit(request(f"warm{i}", tokens // 2, tokens - tokens // 2), now).verdict
        assert verdict.__class__.__name__ == "Admit", verdict
        now += step
        ctrl.release(f"warm{i}", now)
    return now


def filled(ctrl: AdmissionController) -> float:
    """A 1,000-token replica "r1" with drain history, then full: five 200-token requests
    ("run0".."run4") run, each held ~2 s, releasing ~500 tokens/s (admission/learned/drain.py),
    so a 200-token request waits ~0.4 s. Returns the time reached."""
    ctrl.upsert_replica(replica(capacity=1000), 0.0)
    now = warm_drain(ctrl, 200, rate=100.0)
    for i in range(5):
        ctrl.submit(request(f"run{i}", 100, 100), now)
    return now


def served_one_by_one(ctrl: AdmissionController, n: int, seconds: float) -> float:
    """`n` completions of `seconds` each (400 prompt and 100 output tokens), one after
    another on replica r1: its service model learns them. Returns the time reached."""
    now = 0.0
    for i in range(n):
        assert isinstance(ctrl.submit(request(f"w{i}", 400, 100), now).verdict, Admit)
        ctrl.release(f"w{i}", now + seconds, Completion(service_s=seconds, prompt_tokens=400,
                                                       completion_tokens=100))  # fmt: skip
        now += seconds
    return now
