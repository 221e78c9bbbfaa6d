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
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter

from gateway.checks import serve_problems
from gateway.config import ConfigError, GatewayConfig, load_config
from gateway.tasks import cancel_all
from routing.scheduler import build_router

if TYPE_CHECKING:
    from gateway.app import GatewayState

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
        state: GatewayState,
        path: str | Path,
        registry: CollectorRegistry,
        *,
        workers: int = 1,
        poll_s: float = POLL_S,
    ) -> None:
        self._st = state
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
            await self.apply(new)
            self._count("ok")
            log.info("config reloaded (%s)", why, extra={"fields": {"path": str(self.path)}})
            return True

    async def apply(self, new: GatewayConfig) -> None:
        st = self._st
        old = st.config
        later = [s for s in RESTART_ONLY if getattr(old, s) != getattr(new, s)]
        if later:
            log.warning(
                "config reload: %s changed and take effect at restart",
                ", ".join(later),
                extra={"fields": {"sections": later}},
            )
        loop = asyncio.get_running_loop()
        # Who may send requests first: a removed key stops at once.
        st.tenants.reconfigure(new.tenants, new.auth.api_keys, loop.time())
        st.metrics.set_tenant_names(st.tenants.tenants)
        router = None
        if new.routing != old.routing:
            router = build_router(
                new.routing, discovery_interval_s=old.discovery.refresh_interval_s
            )
        if new.admission != old.admission or router is not None:
            st.door.reconfigure(new.admission, router)
        if new.logging.level != old.logging.level:
            logging.getLogger("kvgate").setLevel(new.logging.level.upper())
        # Replicas: removed ones retire, new and changed ones are (re)probed.
        before = {rc.name: rc for rc in old.replicas}
        after = {rc.name: rc for rc in new.replicas}
        for name in before.keys() - after.keys():
            st.discovery.retire(name)
        changed = [rc for name, rc in after.items() if before.get(name) != rc]
        if changed:
            await st.discovery.add(changed)
        await st.dns.apply(new.replica_groups, new.dns)
        st.discovery.prune()
        st.config = new
