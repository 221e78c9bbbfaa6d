"""Client patience shared between gateway processes (gateway/state), one round at a time.

The clients that state no timeout reach every gateway process behind a load balancer,
so what one process learned of a population's patience (admission/learned/patience.py) holds
for the others. Each lease round (gateway/state/sharing.py) publishes what this process
learned itself and changed since it last published, and adopts for each population the
latest budget another process published (`AdmissionDoor.adopt_patience`), which applies
only while this process has learned none of its own, and only until this process's own
clients are seen staying past it. The shared records outlive the processes (as the
learned limits do): a process that starts, a worker added or the fleet restarted after
a deploy starts from what the fleet learned, instead of holding a first wave under the
default queue timeout until it leaves at its real patience (a fresh kvgate's first wave
timed out on bench/real_vllm.py; measured: docs/shared-state.md).
"""

from __future__ import annotations

from admission.learned.patience import Budget
from admission.lease import SharedPatience
from gateway.door import AdmissionDoor
from gateway.state.backend import StateBackend

_SEP = "\x1f"  # the unit separator: in no tenant or model name a config can hold


def population_key(tenant: str, model: str, stream: bool) -> str:
    """The shared record's name of a population."""
    return _SEP.join((tenant, model, "stream" if stream else "whole"))


def population_of(key: str) -> tuple[str, str, bool] | None:
    """The population a shared record names (None: not one of ours)."""
    parts = key.split(_SEP)
    if len(parts) != 3 or parts[2] not in ("stream", "whole"):
        return None
    return parts[0], parts[1], parts[2] == "stream"


def budget_of(shared: SharedPatience) -> Budget | None:
    """The budget a shared record holds (None: not a usable one)."""
    return Budget(shared.seconds, shared.whole) if shared.seconds > 0 else None


class PatienceSync:
    """Publishes this process's learned patience and adopts the fleet's."""

    def __init__(self, backend: StateBackend, door: AdmissionDoor):
        self.backend = backend
        self.door = door
        self._published: dict[tuple[str, str, bool], Budget] = {}
        self._adopted: dict[str, int] = {}  # record -> the version adopted

    async def sync(self, now: float) -> None:
        """One round: publish what changed here, adopt newer records of others."""
        for population, budget in self.door.report.learned_patience().items():
            # A dropped estimate is not published: the record is the fleet's latest, and
            # another process may still hold what it learned; each adopter drops a stale
            # one as it drops its own (admission/learned/patience.py).
            if budget is None or self._published.get(population) == budget:
                continue
            key = population_key(*population)
            version = await self.backend.publish_patience(key, budget.seconds, budget.whole)
            self._published[population] = budget
            self._adopted[key] = version  # our own: not adopted
        for key, shared in (await self.backend.patiences()).items():
            if shared.version <= self._adopted.get(key, 0):
                continue
            self._adopted[key] = shared.version
            named = population_of(key)
            if named is not None:
                self.door.adopt_patience(*named, budget_of(shared), now)
