"""Learning hooks: what completions and engine gauges teach a replica's models.

A released request's `Completion` feeds its replica's service and TTFT lines (the
predictions a queued request's deadline is judged by), its inter-token gap model
(admission.learned.itl) and its learned running limit (admission.learned.limit); each
discovery round's engine view feeds the limit its preemption and waiting signals. Nothing here admits or
sheds: the ledger, the queue and placement read what it learned.
"""

from __future__ import annotations

from admission.config import AdmissionConfig
from admission.learned.itl import ItlModel
from admission.learned.latency import latency_ratio
from admission.learned.limit import LimitSettings, RunningLimit
from admission.ledger import Reservation
from admission.replica import Replica
from admission.types import Completion
from routing.types import ReplicaState


class Learning:
    """Per-replica learning from completions and engine signals."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self._limit_settings = LimitSettings.from_config(config)
        self._targets = config.latency_targets

    def new_limit(self, now: float) -> RunningLimit | None:
        """A fresh learned running limit for a new replica (None: not learning)."""
        return RunningLimit(self._limit_settings, now) if self.config.learn_limit else None

    def engine_view(self, rep: Replica, state: ReplicaState, fresh: bool, now: float) -> None:
        """Feed a fresh engine view (its preemption counter) to the limit."""
        if rep.limit is not None and fresh:
            rep.signals_at = state.updated_at
            rep.limit.engine_signals(
                preemptions_total=state.preemptions_total,
                running=rep.running,
                now=now,
                cap=rep.cap,
            )

    def stream_gap(
        self, rep: Replica, completion: Completion | None, at_admit: int | None, now: float
    ) -> None:
        """A finished stream's mean inter-token gap at its load: the mean of the running
        counts at its start and end (call before its slot is freed)."""
        if completion is None or not completion.ok or completion.itl_s is None:
            return
        load = (rep.running + (at_admit or rep.running)) / 2
        model = rep.itl
        if model is None:
            model = rep.itl = ItlModel(memory_s=self.config.itl_memory_s)
        model.add(load, completion.itl_s, now)

    def released(
        self,
        rep: Replica,
        res: Reservation,
        completion: Completion | None,
        now: float,
        at_admit: int | None = None,
    ) -> None:
        """After a reservation is freed: learn its completion (None teaches nothing) and
        tell the limit the running count moved. `at_admit`: the replica's running count
        when it was admitted."""
        if completion is not None:
            self._completed(rep, res, completion, now, at_admit)
        if rep.limit is not None:
            rep.limit.running_changed(rep.running, now)

    def _completed(
        self,
        rep: Replica,
        res: Reservation,
        c: Completion,
        now: float,
        at_admit: int | None,
    ) -> None:
        """Feed one completion to the replica's latency history and learned limit."""
        prompt = c.prompt_tokens or 0
        output = c.completion_tokens or 0
        load = rep.serving_load
        # The requests it ran beside: the mean of the running counts at its start and end.
        ran = (rep.running + 1 + at_admit) / 2 if at_admit is not None else None
        if c.ok and c.service_s is not None and prompt + output > 0:
            rep.service.add(prompt, output, c.service_s, load, ran)
        if c.ok and c.ttft_s is not None and prompt > 0:
            rep.ttft.add(prompt, 0, c.ttft_s, load)
        if rep.limit is None:
            return
        targets = self._targets.get(res.model) or self._targets.get("*")
        # The client's stated timeout, else the patience its request was admitted under.
        budget = c.latency_budget if c.latency_budget is not None else res.budget
        ttft = c.ttft_s
        if not c.ok:
            ttft = None  # scored on what it was served for (below), or as a failure
        ratio: tuple[float | None, float | None] = (None, None)
        if c.ok or (c.service_s is not None and _queue_spent(c.service_s, budget)):
            # A failure that brings its service is a client that left after part of its
            # budget went to the queue: the service it got is a lower bound, not proof
            # of a slow replica (the queue's deadline judged it, admission/settling.py).
            # A stream whose budget bounds the whole response is scored on all of it.
            stream = c.ttft_s is not None and not res.budget_whole
            ratio = latency_ratio(
                service_s=c.service_s,
                ttft_s=ttft,
                itl_s=c.itl_s if c.ok else None,
                budget_s=budget,
                budget_fraction=self.config.latency_budget_fraction,
                targets=targets,
                stream=stream,
                # Read only where it is used: a fit of the service's slope per call.
                alone_s=rep.service.alone(prompt, output) if budget and not stream else 0.0,
                # Slow start keeps the fixed share: the first wave waits behind its growth.
                waited_s=None if rep.limit.slow_start else res.waited,
            )
        rep.limit.completed(
            now,
            res.admitted_at,
            ok=c.ok,
            ratio=ratio,
            cap=rep.cap,
            # The load it was served at: the mean of the running counts at its start and
            # its end (before its slot is freed).
            load=ran,
            slope=rep.service.elasticity,  # a fit: read only when a window needs it
        )


_SERVED_WHOLE = 0.9  # a failed request served for this share of its budget: the replica's


def _queue_spent(service_s: float, budget: float | None) -> bool:
    """Whether a failed request's client left while less than `_SERVED_WHOLE` of its
    budget went to its service (the rest was spent queued)."""
    return budget is not None and budget > 0 and service_s < _SERVED_WHOLE * budget
