"""The in-process backend: the default for a single gateway process (no Redis).

It keeps the same records as the Redis backend, so a process sharing nothing gets the
whole of every resource (it is the only holder), and tests can share one instance
between gateways in one process to exercise the policy without a server.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from admission.lease import (
    HolderRecord,
    Lease,
    LeaseRequest,
    RenewResult,
    SharedLimit,
    SharedPatience,
    grant,
)
from gateway.state.backend import StateBackend


class MemoryBackend(StateBackend):
    name = "memory"

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # resource -> holder -> [granted, want, used, expires_at, head, its deadline]
        self._leases: dict[str, dict[str, list[float]]] = {}
        self._procs: dict[str, float] = {}
        self._limits: dict[str, SharedLimit] = {}
        self._patience: dict[str, SharedPatience] = {}
        self._responses: dict[str, tuple[str, int, float]] = {}  # id -> replica, tokens, expiry
        self._version = 0

    def _live(self, resource: str, now: float) -> dict[str, list[float]]:
        records = self._leases.setdefault(resource, {})
        for h in [h for h, r in records.items() if r[3] <= now]:
            del records[h]
        return records

    async def renew(
        self, holder: str, requests: Sequence[LeaseRequest], ttl_s: float
    ) -> RenewResult:
        now = self._clock()
        known = self._procs.get(holder, -math.inf) > now
        self._procs[holder] = now + ttl_s
        for h in [h for h, exp in self._procs.items() if exp <= now]:
            del self._procs[h]
        leases = []
        for req in requests:
            records = self._live(req.resource, now)
            others = [
                (h, int(r[0]), int(r[1]), int(r[2])) for h, r in records.items() if h != holder
            ]
            mine = records.get(holder)
            heads = {h: (int(r[4]), r[5]) for h, r in records.items() if r[4] > 0}
            heads.pop(holder, None)
            due = now + req.slack  # on this backend's clock, as Redis's TIME for lease.lua
            if req.head > 0:
                heads[holder] = (req.head, due)
            granted, n, others_used, rate = grant(
                req.total, req.want, others, holder, req.used, int(mine[0]) if mine else 0, heads
            )
            records[holder] = [
                granted,
                max(0, req.want),
                max(0, req.used),
                now + ttl_s,
                max(0, req.head),
                due,
            ]
            leases.append(Lease(req.resource, granted, n, others_used, rate))
        return RenewResult(len(self._procs), leases, known)

    async def release(self, holder: str, resources: Sequence[str] | None = None) -> None:
        names = list(self._leases) if resources is None else resources
        for name in names:
            self._leases.get(name, {}).pop(holder, None)
        if resources is None:
            self._procs.pop(holder, None)

    async def holders(self, resource: str) -> dict[str, HolderRecord]:
        now = self._clock()
        return {
            h: HolderRecord(int(r[0]), int(r[1]), int(r[2]), r[3] - now)
            for h, r in self._live(resource, now).items()
        }

    async def publish_limit(self, replica: str, value: float, reason: str) -> int:
        self._version += 1
        self._limits[replica] = SharedLimit(value, self._version, reason)
        return self._version

    async def limits(self) -> dict[str, SharedLimit]:
        return dict(self._limits)

    async def publish_patience(self, population: str, seconds: float, whole: bool) -> int:
        self._version += 1
        self._patience[population] = SharedPatience(seconds, whole, self._version)
        return self._version

    async def patiences(self) -> dict[str, SharedPatience]:
        return dict(self._patience)

    async def put_response(self, response_id: str, replica: str, tokens: int, ttl_s: float) -> None:
        self._responses[response_id] = (replica, tokens, self._clock() + ttl_s)

    async def response(self, response_id: str) -> tuple[str, int] | None:
        hit = self._responses.get(response_id)
        if hit is None or hit[2] <= self._clock():
            self._responses.pop(response_id, None)
            return None
        return hit[0], hit[1]
