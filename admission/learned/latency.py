"""A completion's latency score: measured over target, against its client's own
timeout and against the model's configured targets (sans-IO). `admission/learned/limit.py`
learns the running limit from these scores."""

from __future__ import annotations

from admission.config import LatencyTargets


def latency_ratio(
    *,
    service_s: float | None,
    ttft_s: float | None,
    itl_s: float | None,
    budget_s: float | None,
    budget_fraction: float,
    targets: LatencyTargets | None,
    stream: bool,
    alone_s: float = 0.0,
    waited_s: float | None = None,
) -> tuple[float | None, float | None]:
    """A completion's (client-timeout ratio, worst configured-target ratio), each
    measured / target, None where there is no such target.

    The client's own timeout (`budget_s`) bounds a non-stream request's whole service and
    a stream's time to first token; kvgate aims for `budget_fraction` of it, leaving the
    rest for queueing, unless it waited less than that (`waited_s`, from its first
    attempt; None: the fixed share): then what its wait left. Configured targets are
    TTFT, inter-token and end-to-end times.
    """
    hard = None
    if budget_s is not None and budget_s > 0:
        measured = ttft_s if stream else service_s
        aim = budget_s * budget_fraction
        if not stream and alone_s > 0.0:
            # A request whose own service (`alone_s`) is long leaves the load room to add
            # (1 / budget_fraction - 1) of it, within the timeout: no limit serves it
            # faster than alone, and cutting for it only loses throughput.
            aim = max(aim, min(budget_s, alone_s / budget_fraction))
        if waited_s is not None:
            # The share kept for queueing is the queue's: a request that waited less may
            # be served in what its wait left of the timeout.
            aim = max(aim, budget_s - waited_s)
        if measured is not None:
            hard = measured / aim
    soft = None
    if targets is not None:
        for measured, target in (
            (ttft_s, targets.ttft_s),
            (itl_s, targets.itl_s),
            (service_s, targets.e2e_s),
        ):
            if measured is not None and target is not None and target > 0:
                r = measured / target
                soft = r if soft is None else max(soft, r)
    return hard, soft
