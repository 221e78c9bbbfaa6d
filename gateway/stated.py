"""What a client states about a request in its headers: its queue deadline, its read
timeout and which retry this is (documented in docs/api.md).

A client that states neither a queue timeout nor a read timeout gets the patience
admission learned of clients like it (admission/learned/patience.py), and teaches it.
"""

from __future__ import annotations

import math

from aiohttp import web

from admission.retries import RetryIdentity, identify
from gateway.context import RequestContext
from gateway.errors import invalid_request

H_QUEUE_TIMEOUT = "x-kvgate-queue-timeout"  # seconds the client is willing to wait in queue
# Sent by the official openai SDKs on every request: their read timeout in seconds, and
# which retry this is (0 for the first attempt; the SDKs retry twice by default).
H_READ_TIMEOUT = "x-stainless-read-timeout"
H_RETRY_COUNT = "x-stainless-retry-count"
H_IDEMPOTENCY_KEY = "idempotency-key"
SDK_DEFAULT_MAX_RETRIES = 2


def read_stated(
    request: web.Request, ctx: RequestContext, cap_s: float | None, now: float
) -> float:
    """The queue deadline the client states (``x-kvgate-queue-timeout``, capped at `cap_s`
    where one is configured; else none: inf), with its read timeout, whether it stated
    either, and whether this is its last retry set on `ctx`."""
    deadline = math.inf
    hdr = request.headers.get(H_QUEUE_TIMEOUT)
    if hdr is not None:
        stated = _seconds(hdr, H_QUEUE_TIMEOUT)
        deadline = now + (stated if cap_s is None else min(cap_s, stated))
    if (read := request.headers.get(H_READ_TIMEOUT)) is not None:
        ctx.req.latency_budget = _seconds(read, H_READ_TIMEOUT) or None
    # Said nothing: admission uses its clients' learned patience, and learns from it.
    ctx.patience_stated = hdr is not None or ctx.req.latency_budget is not None
    if (count := request.headers.get(H_RETRY_COUNT)) is not None:
        try:
            ctx.req.last_retry = int(count) >= SDK_DEFAULT_MAX_RETRIES
        except ValueError:
            raise invalid_request(
                f"{H_RETRY_COUNT} must be an integer.", param=H_RETRY_COUNT
            ) from None
    return deadline


def retry_identity(request: web.Request, ctx: RequestContext) -> RetryIdentity:
    """How this request's retries are recognised: by its ``Idempotency-Key``, else by its
    tenant, model and body, a retry only where the SDK's retry count says so or, for a
    client that says nothing, where it comes back when told (admission/retries.py). Call
    after `read_stated`, which checked the retry count."""
    count = request.headers.get(H_RETRY_COUNT)
    return identify(
        ctx.req.tenant,
        ctx.req.model,
        ctx.raw,
        None if count is None else int(count),
        request.headers.get(H_IDEMPOTENCY_KEY),
    )


def _seconds(value: str, header: str) -> float:
    """A header's non-negative number of seconds, or a 400 naming the header."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise invalid_request(f"{header} must be a non-negative number of seconds.", param=header)
    return seconds
