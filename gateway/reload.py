"""Live reload: a new config taken on SIGHUP, or when the file changes, without a restart.

The file is watched by polling what its path points at (the real path, inode, size and
mtime): a Kubernetes ConfigMap volume replaces the file by swapping a symlink, which
inotify on the file itself misses. A new config is validated exactly as ``serve`` does
(gateway/checks.py); an invalid one is refused with the field named, logged at error
level, and the running config keeps serving. Both outcomes count in
``kvgate_config_reloads_total{result}`` (``ok`` | ``invalid``).

What a reload changes, from its moment on, without dropping or double-counting a
request:

- ``replicas``: a removed one is retired (no new request; its running ones finish and
  it leaves the ledger after them), a new one is probed and joins, a changed one is
  probed again under its new settings and keeps its reservations (same name);
- ``replica_groups`` and ``dns``: groups added, removed or changed as above;
- ``tenants`` and ``auth``: keys, limits (a tenant's spent rate is kept where its limit
  is unchanged), the admin token;
- ``admission`` and ``routing``: the settings of decisions from now on, the routing
  profiles (routing's memory of running requests starts afresh);
- ``logging.level``.

Other sections (``listen``, ``state``, ``limits``, ``upstream``, ``counting``,
``tokenizers``, ``discovery``, ``outlier``, ``shutdown``) are read once at start: a
change to one is logged as needing a restart, and the rest of the reload applies.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter

from gateway.checks import serve_problems
from gateway.config import ConfigError, GatewayConfig, load_config
from gateway.tasks import cancel_all

log = logging.getLogger("kvgate.reload")

RESTART_ONLY = (
    "listen",
    "state",
    "limits",
    "upstream",
    "counting",
    "tokenizers",
    "discovery",
    "outlier",
    "shutdown",
)
POLL_S = 1.0  # how often the file's identity is looked at (a stat call)


def file_identity(path: Path) -> tuple[object, ...] | None:
    """What changes when the file is rewritten or its symlink swapped."""
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return None
    return (real, st.st_ino, st.st_size, st.st_mtime_ns)


class Reloader:
    def __init__(
        self,
        apply: Callable[[GatewayConfig], Awaitable[None]],
        path: str | Path,
        registry: CollectorRegistry,
        *,
        workers: int = 1,
        poll_s: float = POLL_S,
    ) -> None:
        self._apply = apply  # makes a valid config the running one (GatewayState.apply)
        self.path = Path(path)
        reloads = Counter(
            "kvgate_config_reloads_total",
            "Config reloads (SIGHUP or a changed file), by result: ok, or invalid (refused, "
            "the running config kept)",
            ["result"],
            registry=registry,
        )
        for result in ("ok", "invalid"):
            reloads.labels(result)
        self._count = lambda result: reloads.labels(result).inc()
        self._workers = workers
        self.poll_s = poll_s  # public: tests shorten it
        self._lock = asyncio.Lock()
        self._seen = file_identity(self.path)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="kvgate-reload")

    async def stop(self) -> None:
        await cancel_all([self._task])
        self._task = None

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            seen = file_identity(self.path)
            if seen is not None and seen != self._seen:
                self._seen = seen
                await self.reload("file changed")

    async def reload(self, why: str = "SIGHUP") -> bool:
        """Read, validate and apply the file; False (and the old config kept) if invalid."""
        async with self._lock:  # one at a time: a signal during a file change waits
            try:
                new = load_config(self.path)
                problems = serve_problems(new, self._workers)
                if problems:
                    raise ConfigError(
                        f"{self.path}: invalid configuration:\n  " + "\n  ".join(problems)
                    )
            except ConfigError as e:
                self._count("invalid")
                log.error(
                    "config reload (%s) refused, the running config goes on: %s",
                    why,
                    e,
                    extra={"fields": {"error": str(e)}},
                )
                return False
            await self._apply(new)
            self._count("ok")
            log.info("config reloaded (%s)", why, extra={"fields": {"path": str(self.path)}})
            return True
