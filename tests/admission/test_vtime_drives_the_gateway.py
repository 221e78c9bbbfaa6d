"""bench/vtime.py runs the gateway's own code (issue 47, item 5): admission through the
gateway's door (`gateway.door.AdmissionDoor`, its verdicts delivered to queued requests'
waiters), and what an ended request tells admission (its `Completion`, its client's
patience) from `gateway.accounting`, not from a copy in the harness that drifts from it
(it once hard-coded 0.9 where the gateway has `_BUDGET_SPENT`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from admission.retries import RetryMemory
from bench.vtime import run
from enginesim.workloads import seed2_workload
from gateway import accounting
from gateway.door import AdmissionDoor
from gateway.outcome import CLIENT_DISCONNECT
from gateway.stream_reservation import StreamReservation


def count_calls(monkeypatch: pytest.MonkeyPatch, cls: type, names: tuple[str, ...]) -> Counter[str]:
    """Count the calls of `cls`'s methods `names` (each still runs)."""
    calls: Counter[str] = Counter()
    for name in names:
        real = getattr(cls, name)

        def counted(self, *args, _real=real, _name=name, **kw):  # type: ignore[no-untyped-def]
            calls[_name] += 1
            return _real(self, *args, **kw)

        monkeypatch.setattr(cls, name, counted)
    return calls


@pytest.mark.parametrize("stated", [True, False], ids=["sdk", "plain"])
def test_virtual_time_reports_what_the_gateways_account_stage_reports(
    monkeypatch: pytest.MonkeyPatch, stated: bool
) -> None:
    calls = {"completion": 0, "patience_seen": 0}
    real_completion, real_patience = accounting.completion, accounting.patience_seen

    def completion(ctx, now):  # type: ignore[no-untyped-def]
        calls["completion"] += 1
        return real_completion(ctx, now)

    def patience_seen(ctx, now):  # type: ignore[no-untyped-def]
        calls["patience_seen"] += 1
        return real_patience(ctx, now)

    monkeypatch.setattr(accounting, "completion", completion)
    monkeypatch.setattr(accounting, "patience_seen", patience_seen)
    items = seed2_workload(40, seed=3)
    report = run("seed2-8b-16gb", items, concurrency=16, timeout_s=45.0, send_timeout=stated)
    # Every completion and every ended attempt went through the gateway's own code.
    assert calls["completion"] >= report.completed > 0
    assert calls["patience_seen"] >= report.completed


def test_a_client_gone_at_its_timeout_is_judged_by_the_gateways_threshold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The threshold at which a client that left is the replica's failure is the
    gateway's: moved there, virtual time follows."""
    real = accounting.completion

    def failures(spent: float) -> list[object]:
        seen: list[object] = []

        def completion(ctx, now):  # type: ignore[no-untyped-def]
            got = real(ctx, now)
            if ctx.outcome == CLIENT_DISCONNECT:
                seen.append(got)
            return got

        monkeypatch.setattr(accounting, "completion", completion)
        monkeypatch.setattr(accounting, "_BUDGET_SPENT", spent)
        items = seed2_workload(60, seed=5)
        run("seed2-8b-16gb", items, concurrency=64, timeout_s=10.0, max_retries=2)
        return seen

    # At the gateway's threshold, clients gone at their 10 s are failures of the replica;
    # past any time they could wait, none is.
    at = failures(accounting._BUDGET_SPENT)
    assert at and all(c is not None and not c.ok for c in at)  # type: ignore[attr-defined]
    never = failures(2.0)
    assert never and all(c is None for c in never)


def test_virtual_time_takes_retries_in_as_the_gateway_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The retry memory's calls the pipeline makes (a request arrives, gets in, is left
    unserved, ends: its client left or stayed) are the ones virtual time makes, once per
    attempt and per outcome."""
    calls = count_calls(monkeypatch, RetryMemory, ("arrived", "admitted", "unserved", "ended"))
    items = seed2_workload(60, seed=5)
    report = run("seed2-8b-16gb", items, concurrency=64, timeout_s=10.0, max_retries=2)
    sheds = sum(report.sheds.values())
    assert sheds > 0 and report.timed_out > 0  # both ways of being left unserved
    assert calls["arrived"] == len(items) + report.retries
    assert calls["unserved"] == sheds + report.timed_out
    assert calls["admitted"] >= report.completed
    assert calls["ended"] == report.completed + sheds + report.timed_out


def test_virtual_time_admits_through_the_gateways_door(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every attempt is decided by the door's `submit`, every queued one waits on a waiter
    the door registered and resolved (a shed or an admission), and every end is the
    door's `request_ended`: the controller is reached only through it, as in the gateway."""
    calls = count_calls(
        monkeypatch, AdmissionDoor, ("submit", "expect", "request_ended", "withdraw", "_resolve")
    )
    items = seed2_workload(60, seed=5)
    report = run("seed2-8b-16gb", items, concurrency=64, timeout_s=10.0, max_retries=2)
    sheds = sum(report.sheds.values())
    assert sheds > 0 and report.timed_out > 0
    assert calls["submit"] == len(items) + report.retries  # every attempt
    assert 0 < calls["expect"] <= calls["submit"]  # the queued ones wait on the door
    assert calls["withdraw"] == report.timed_out  # a client gone takes its waiter along
    assert calls["request_ended"] >= report.completed + report.timed_out
    assert calls["_resolve"] >= calls["request_ended"]  # what each call settled went out


def test_virtual_time_reports_a_streams_tokens_through_the_gateways_hooks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream's first token and its outgrowing its reservation reach admission through
    the relay's hooks (`gateway.stream_reservation.StreamReservation`), as in the gateway:
    once learned short, outputs that run long are topped up, never cut."""
    calls = count_calls(monkeypatch, StreamReservation, ("first_token", "outgrew"))
    tops = count_calls(monkeypatch, AdmissionDoor, ("top_up",))
    items = seed2_workload(40, seed=3)
    # Thirty short answers teach a short output; the last ten run ten times as long.
    items = [replace(it, output_tokens=20 if i < 30 else 200) for i, it in enumerate(items)]
    report = run(
        "seed2-8b-16gb", items, concurrency=4, timeout_s=1e9, stream=True, send_timeout=False
    )
    assert report.completed == len(items)
    assert calls["first_token"] == len(items)  # once per stream
    assert calls["outgrew"] > 0 and tops["top_up"] == calls["outgrew"]
