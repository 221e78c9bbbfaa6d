"""How a request ended (`Outcome`): an `End` the code branches on, and the detail that
names it in the access line and in the metrics' ``outcome`` label.

The labels are the ones operators' dashboards and alerts read: ``ok``,
``shed_<reason>``, ``rate_limited_<limit>``, ``upstream_<kind or status>``,
``client_disconnect``, ``client_stalled``, ``shutdown_cut``, ``internal_error``, and an
error's code (``model_not_found``, ``unauthorized``, ``too_large``, a refusal's code).
Code asks `Outcome.end`, never the label's prefix.
"""

from __future__ import annotations

from enum import StrEnum


class End(StrEnum):
    """The ways a request can end."""

    OK = "ok"  # answered in full
    SHED = "shed"  # turned away to come back (Retry-After); detail: the reason
    RATE_LIMITED = "rate_limited"  # over its tenant's limit; detail: which limit
    UPSTREAM = "upstream"  # the replica failed it or answered an error; detail: how
    DENIED = "denied"  # answered with an error before it was sent on; detail: its code
    CLIENT_DISCONNECT = "client_disconnect"  # its client left before the answer ended
    CLIENT_STALLED = "client_stalled"  # its client stopped reading and was cut
    SHUTDOWN_CUT = "shutdown_cut"  # still running when the drain ran out
    INTERNAL_ERROR = "internal_error"
    UNKNOWN = "unknown"  # not ended yet


# The ends whose label is the family and the detail joined ("shed_queue_timeout").
_PREFIXED = frozenset({End.SHED, End.RATE_LIMITED, End.UPSTREAM})


class Outcome:
    """One end and its detail; equal by value, its label computed once."""

    __slots__ = ("end", "detail", "label")

    def __init__(self, end: End, detail: str = "") -> None:
        self.end = end
        self.detail = detail
        if end is End.DENIED:
            self.label = detail
        elif end in _PREFIXED:
            self.label = f"{end.value}_{detail}"
        else:
            self.label = end.value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Outcome) and self.end is other.end and self.detail == other.detail

    def __hash__(self) -> int:
        return hash((self.end, self.detail))

    def __repr__(self) -> str:
        return f"Outcome({self.label})"

    def __str__(self) -> str:
        return self.label

    @property
    def client_stayed(self) -> bool:
        """Its client stayed to the end: served, shed, or failed by the replica."""
        return self.end in _STAYED


_STAYED = frozenset({End.OK, End.SHED, End.UPSTREAM})

OK = Outcome(End.OK)
CLIENT_DISCONNECT = Outcome(End.CLIENT_DISCONNECT)
CLIENT_STALLED = Outcome(End.CLIENT_STALLED)
SHUTDOWN_CUT = Outcome(End.SHUTDOWN_CUT)
INTERNAL_ERROR = Outcome(End.INTERNAL_ERROR)
UNKNOWN = Outcome(End.UNKNOWN)


def shed(reason: str) -> Outcome:
    return Outcome(End.SHED, reason)


def rate_limited(limit: str) -> Outcome:
    return Outcome(End.RATE_LIMITED, limit)


def upstream(kind: str | int) -> Outcome:
    """The replica failed it (`kind`: connect, timeout, dropped, status_5xx,
    stream_error) or answered an error status (`kind`: the status)."""
    return Outcome(End.UPSTREAM, str(kind))


def denied(code: str) -> Outcome:
    return Outcome(End.DENIED, code)


UPSTREAM_TIMEOUT = upstream("timeout")
