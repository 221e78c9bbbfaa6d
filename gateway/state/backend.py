"""The shared-state interface: what a backend keeping leases must do (the policy: this
package's docstring; the arithmetic: `admission.lease`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from admission.lease import HolderRecord, LeaseRequest, RenewResult, SharedLimit, SharedPatience


class StateUnavailable(Exception):
    """The backend could not be reached (or answered with an error); the caller applies
    its ``on_unreachable`` policy."""


class StateBackend(ABC):
    """Leases of shared resources, process heartbeats, shared learned limits and client
    patience.

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

    @abstractmethod
    async def publish_patience(self, population: str, seconds: float, whole: bool) -> int:
        """Publish a population's learned client patience; returns its version
        (increasing)."""

    @abstractmethod
    async def patiences(self) -> dict[str, SharedPatience]:
        """The latest published patience of every population."""

    @abstractmethod
    async def put_response(self, response_id: str, replica: str, tokens: int, ttl_s: float) -> None:
        """Remember for `ttl_s` which replica stored a response (the Responses API's
        state), with the tokens of its conversation (gateway/stored_responses.py)."""

    @abstractmethod
    async def response(self, response_id: str) -> tuple[str, int] | None:
        """(replica, tokens) of a stored response any process remembered, or None."""
