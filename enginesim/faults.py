"""Fault injection for the simulated replica.

A gateway is only as good as its behaviour when a replica misbehaves, so the simulator can
imitate the ways real engines fail, as seen from a client:

* ``crash``: the process dies. The CLI server exits; an embedded server aborts every
  connection and stops listening, which is what a dead process looks like from outside.
  With ``after_tokens`` N > 0 the crash happens once the engine has generated N more
  tokens (all requests together), so a test can crash a replica mid-stream. A crash
  cannot be cleared.
* ``hang``: connections are accepted but nothing answers; the engine stops stepping, so
  in-flight streams stall mid-flight. Only ``/admin/faults`` still answers (that is the
  way back).
* ``error``: new requests to every endpoint but ``/metrics`` (``/health`` included) are
  answered with HTTP ``status`` (5xx) and an OpenAI error object, as an engine whose
  background loop died answers; streams already running continue.
* ``drop``: each request started while the fault is active has its connection closed
  after ``after_tokens`` tokens (mid-stream for streams; before any response otherwise).
* ``slow``: every engine step takes ``factor`` times longer than the profile says.
* ``slow_metrics``: ``/metrics`` answers ``delay_s`` seconds late (rendered at the end of
  the wait), while the engine serves as usual, as vLLM's API server on a busy CPU
  answered its scrapes seconds late (measured: scripts/REAL_ENGINE_NOTES.md).
* ``none``: normal operation.

This module is pure data and validation; the server and driver act on it.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any


class FaultMode(enum.StrEnum):
    NONE = "none"
    CRASH = "crash"
    HANG = "hang"
    ERROR = "error"
    DROP = "drop"
    SLOW = "slow"
    SLOW_METRICS = "slow_metrics"


class FaultConfigError(ValueError):
    """A fault specification is invalid; the message names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


DEFAULT_STATUS = 500
DEFAULT_FACTOR = 5.0
DEFAULT_DROP_AFTER_TOKENS = 1
DEFAULT_DELAY_S = 3.5


@dataclass(frozen=True, slots=True)
class FaultConfig:
    """One active fault. Fields that do not apply to `mode` are kept but ignored."""

    mode: FaultMode = FaultMode.NONE
    status: int = DEFAULT_STATUS
    factor: float = DEFAULT_FACTOR
    # drop: tokens sent per request before its connection is closed.
    # crash: tokens generated (server-wide) before the crash; 0 crashes at once.
    after_tokens: int = 0
    # slow_metrics: how late /metrics answers.
    delay_s: float = DEFAULT_DELAY_S

    def __post_init__(self) -> None:
        if not 500 <= self.status <= 599:
            raise FaultConfigError(f"status must be a 5xx HTTP status, got {self.status}", "status")
        if not self.factor >= 1.0:  # also rejects NaN
            raise FaultConfigError(f"factor must be >= 1.0, got {self.factor}", "factor")
        if not self.delay_s >= 0.0:  # also rejects NaN
            raise FaultConfigError(f"delay_s must be >= 0, got {self.delay_s}", "delay_s")
        if self.after_tokens < 0:
            raise FaultConfigError(
                f"after_tokens must be >= 0, got {self.after_tokens}", "after_tokens"
            )

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["mode"] = str(self.mode)
        return out

    @classmethod
    def from_json(cls, body: Any) -> FaultConfig:
        """Parse the body of ``POST /admin/faults``; raises FaultConfigError on bad input."""
        if not isinstance(body, dict):
            raise FaultConfigError("body must be a JSON object", None)
        unknown = set(body) - {"mode", "status", "factor", "after_tokens", "delay_s"}
        if unknown:
            name = sorted(unknown)[0]
            raise FaultConfigError(f"unknown field {name!r}", name)
        if "mode" not in body:
            raise FaultConfigError("field 'mode' is required", "mode")
        return make_fault(
            body["mode"],
            status=body.get("status"),
            factor=body.get("factor"),
            after_tokens=body.get("after_tokens"),
            delay_s=body.get("delay_s"),
        )


def make_fault(
    mode: Any,
    *,
    status: Any = None,
    factor: Any = None,
    after_tokens: Any = None,
    delay_s: Any = None,
) -> FaultConfig:
    """Build a validated FaultConfig from loosely typed input (JSON or CLI)."""
    try:
        fmode = FaultMode(mode)
    except ValueError:
        choices = ", ".join(m.value for m in FaultMode)
        raise FaultConfigError(f"mode must be one of {choices}; got {mode!r}", "mode") from None

    def _int(name: str, value: Any, default: int) -> int:
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise FaultConfigError(f"{name} must be an integer, got {value!r}", name)
        return value

    def _float(name: str, value: Any, default: float) -> float:
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise FaultConfigError(f"{name} must be a number, got {value!r}", name)
        return float(value)

    default_after = DEFAULT_DROP_AFTER_TOKENS if fmode is FaultMode.DROP else 0
    return FaultConfig(
        mode=fmode,
        status=_int("status", status, DEFAULT_STATUS),
        factor=_float("factor", factor, DEFAULT_FACTOR),
        after_tokens=_int("after_tokens", after_tokens, default_after),
        delay_s=_float("delay_s", delay_s, DEFAULT_DELAY_S),
    )


NO_FAULT = FaultConfig()
