"""Structured logs: JSON lines on stderr, each stamped ``ts`` in ISO 8601 UTC.

Every line logged while a request is handled carries its ``request_id`` (the
``x-request-id`` the client got), from `REQUEST_ID`, a context variable the pipeline
sets for the request's task: a failover warning, an ejection, a tokenizer failure are
joined to the access line without each call site passing the id.

One access line per request on the ``kvgate.access`` logger with the fields an operator
needs to reconstruct what admission did (request id, tenant, model, replica, outcome,
status, token counts, queue wait, TTFT, duration). Prompt and completion text are never
logged: they are customer data and would make the log a liability.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

ACCESS_LOGGER = "kvgate.access"
access_log = logging.getLogger(ACCESS_LOGGER)
log = logging.getLogger("kvgate")
# The id of the request whose task is running (None outside requests).
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kvgate_request_id", default=None
)


def iso8601(t: float | None) -> str | None:
    """A wall-clock time (``time.time()``) as ISO 8601 UTC to the millisecond."""
    if t is None:
        return None
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object; fields passed as ``extra={"fields": {...}}``
    are merged at the top level."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": iso8601(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if fields:
            out.update(fields)
        if "request_id" not in out and (rid := REQUEST_ID.get()) is not None:
            out["request_id"] = rid
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"), default=str)


def configure_logging(level: str = "info", *, access: bool = True) -> None:
    """Install the JSON handler on the ``kvgate`` logger tree (idempotent)."""
    root = logging.getLogger("kvgate")
    root.setLevel(level.upper())
    root.propagate = False
    for h in list(root.handlers):
        if getattr(h, "_kvgate", False):
            root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    handler._kvgate = True  # type: ignore[attr-defined]  # our mark, found by the getattr above
    root.addHandler(handler)
    access_log.disabled = not access


def access_log_enabled() -> bool:
    return access_log.isEnabledFor(logging.INFO)


def log_access(fields: dict[str, Any]) -> None:
    """Emit the access line (check `access_log_enabled` first to skip building it)."""
    access_log.info("request", extra={"fields": fields})
