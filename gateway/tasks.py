"""Stopping the gateway's background tasks (discovery, DNS, the reload watcher, the KV
event subscribers, the door's expiry timer): cancel, then wait for each to end."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable


async def cancel_all(tasks: Iterable[asyncio.Task[None] | None]) -> None:
    """Cancel every task, then wait for each: all are cancelled before any is awaited,
    so one slow to end does not hold the others' cancellation back."""
    live = [t for t in tasks if t is not None]
    for t in live:
        t.cancel()
    for t in live:
        with contextlib.suppress(asyncio.CancelledError):
            await t
