"""Learning hooks: what completions teach a replica's models.

A released request's `Completion` feeds its replica's service and TTFT planes (the
predictions deadlines are judged by: the queue's, admission/settling.py, and the running
requests', admission/room.py) and its inter-token gap model (admission.itl). Nothing here
admits or sheds: the ledger, the queue and placement read what it learned.
"""

from __future__ import annotations

from admission.config import AdmissionConfig
from admission.itl import ItlModel
from admission.replica import Replica
from admission.types import Completion


class Learning:
    """Per-replica learning from completions."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config

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

    def completed(self, rep: Replica, c: Completion, load: float) -> None:
        """Feed one completion to the replica's service and TTFT planes, at the `load`
        it was served at (the mean number running beside it, itself included)."""
        prompt = c.prompt_tokens or 0
        output = c.completion_tokens or 0
        if c.ok and c.service_s is not None and prompt + output > 0:
            rep.service.add(prompt, output, c.service_s, load)
        if c.ok and c.ttft_s is not None and prompt > 0:
            rep.ttft.add(prompt, 0, c.ttft_s, load)
