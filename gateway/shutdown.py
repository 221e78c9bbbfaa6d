"""The requests in flight, and their graceful stop.

`InFlight` counts the requests the pipeline is handling and keeps the task of each, so
the shell can wait until none is left (`idle`) and, once its grace has run out, cut the
ones still running (`cut_running`). A cut request is answered, never dropped: a started
stream ends with an error event, anything else gets the 503 ``shutting_down`` that new
and queued requests get from the moment shutdown begins (`draining`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from aiohttp import web

from gateway.config import GatewayConfig
from gateway.context import RequestContext
from gateway.errors import ApiError
from gateway.outcome import SHUTDOWN_CUT, shed

log = logging.getLogger("kvgate")


def shutting_down(config: GatewayConfig) -> ApiError:
    """The 503 of a request that arrives, waits or runs while kvgate stops."""
    return ApiError(
        503,
        "kvgate is shutting down; retry the request.",
        code="shutting_down",
        retry_after=shutdown_retry_after(config),
        outcome=shed("shutdown"),
    )


def shutdown_retry_after(config: GatewayConfig) -> float:
    """Retry-After of a shutdown answer: a second, or the configured least if longer."""
    return max(1.0, config.admission.min_retry_after_s)


class InFlight:
    """The requests being handled now, by task, and whether the gateway is draining."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.draining = False
        self.count = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self._active: dict[asyncio.Task[object], RequestContext] = {}

    def enter(self, ctx: RequestContext) -> asyncio.Task[object] | None:
        """Count a request that starts; returns its task (None outside one)."""
        self.count += 1
        self.idle.clear()
        task = asyncio.current_task()
        if task is not None:
            self._active[task] = ctx
        return task

    def leave(self, task: asyncio.Task[object] | None) -> None:
        if task is not None:
            self._active.pop(task, None)
        self.count -= 1
        if self.count == 0:
            self.idle.set()

    def cut_running(self) -> int:
        """Cut every running request (the shutdown grace is over); returns how many."""
        n = 0
        for task, ctx in list(self._active.items()):
            if not ctx.cut and not task.done():
                ctx.cut = True
                task.cancel("kvgate shutdown")
                n += 1
        return n

    async def cut_answer(self, ctx: RequestContext) -> web.StreamResponse:
        """The answer of a request cut at shutdown: an error event on a started stream,
        else a 503."""
        ctx.status = 503
        ctx.outcome = SHUTDOWN_CUT
        err = shutting_down(self.config)
        resp = ctx.client_stream
        if resp is not None and resp.prepared:
            try:
                await resp.write(err.sse_event(ctx.dialect, ctx.kind == "responses"))
                await resp.write_eof()
            except ConnectionError:
                pass
            return resp
        return err.response({"x-request-id": ctx.request_id}, ctx.dialect)


async def wait_until(when: float, fast: asyncio.Event | None) -> None:
    """Sleep until the loop's clock reads `when`, or until `fast` is set."""
    delay = max(0.0, when - asyncio.get_running_loop().time())
    if fast is None:
        await asyncio.sleep(delay)
        return
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(delay):
            await fast.wait()


def _await_chain(task: asyncio.Task[Any]) -> str:
    """Where `task` waits: its coroutines from the outermost to the innermost (a task's
    own stack shows only the outermost), then what the innermost awaits."""
    out: list[str] = []
    obj: Any = task.get_coro()
    for _ in range(64):
        frame = getattr(obj, "cr_frame", None) or getattr(obj, "gi_frame", None)
        if frame is None:
            out.append(type(obj).__name__)  # a future or a task: it waits on that
            break
        code = frame.f_code
        out.append(f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_name}:{frame.f_lineno}")
        nxt = getattr(obj, "cr_await", None) or getattr(obj, "gi_yieldfrom", None)
        if nxt is None:
            break
        obj = nxt
    return " -> ".join(out)


def log_pending_tasks(current: asyncio.Task[Any] | None) -> None:
    """Where the stopping task waits (its whole await chain), then every other task."""
    tasks = [current] if current is not None else []
    tasks += [t for t in asyncio.all_tasks() if t is not current and not t.done()]
    for task in tasks:
        role = "stopping" if task is current else "pending"
        log.warning("kvgate: %s task %s at %s", role, task.get_name(), _await_chain(task))
