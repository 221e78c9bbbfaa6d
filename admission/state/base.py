"""The shared-state interface (see the package docstring for the policy)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


class StateUnavailable(Exception):
    """The backend could not be reached (or answered with an error); the caller applies
    its ``on_unreachable`` policy."""


@dataclass(frozen=True, slots=True)
class LeaseRequest:
    """Ask for a slice of `resource` (e.g. ``pool:r0``), whose whole is `total`; the process
    holds `used` of it now and wants `want`."""

    resource: str
    total: int
    want: int
    used: int


@dataclass(frozen=True, slots=True)
class Lease:
    """The slice granted, how many processes hold `resource`, and what the others use."""

    resource: str
    granted: int
    holders: int
    others_used: int
    # A rate-limited holder's refill slice (lease.grant): at least `granted`, more while
    # it has spent more than its grant.
    rate: int = -1

    def refill(self) -> int:
        return self.granted if self.rate < 0 else self.rate


@dataclass(frozen=True, slots=True)
class RenewResult:
    processes: int  # processes alive (heartbeat within the TTL), this one included
    leases: list[Lease]


@dataclass(frozen=True, slots=True)
class HolderRecord:
    granted: int
    want: int
    used: int
    expires_in_s: float


@dataclass(frozen=True, slots=True)
class SharedLimit:
    value: float
    version: int
    reason: str


class StateBackend(ABC):
    """Leases of shared resources, process heartbeats and shared learned limits.

    Every method raises `StateUnavailable` when the backend cannot be reached."""

    name: str = "abstract"

    async def connect(self) -> None:  # noqa: B027 - optional hook
        """Open connections (optional); failures surface on first use."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Close connections."""

    @abstractmethod
    async def renew(
        self, holder: str, requests: Sequence[LeaseRequest], ttl_s: float
    ) -> RenewResult:
        """Heartbeat `holder` and (re)lease every resource in `requests`, atomically per
        resource, each for `ttl_s`."""

    @abstractmethod
    async def release(self, holder: str, resources: Sequence[str] | None = None) -> None:
        """Return `holder`'s slices of `resources` (None: all of them) and, with None,
        its heartbeat too."""

    @abstractmethod
    async def holders(self, resource: str) -> dict[str, HolderRecord]:
        """The live holders of `resource` (for the admin endpoint and tests)."""

    @abstractmethod
    async def publish_limit(self, replica: str, value: float, reason: str) -> int:
        """Publish a learned running limit; returns its version (increasing)."""

    @abstractmethod
    async def limits(self) -> dict[str, SharedLimit]:
        """The latest published limit of every replica."""
