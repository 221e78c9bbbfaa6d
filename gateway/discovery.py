"""Capacity discovery: keep each replica's `ReplicaState` current from its engine.

One task per replica polls the engine adapter's probe paths (metrics, model list...)
every ``discovery.refresh_interval_s``, lets the adapter map the answers onto the
`ReplicaState` (only adapters know engine metric names), applies the pinned values from
the config, and upserts the state through the admission door. Capacity that grows (a
replica becoming ready, a pool discovered) admits queued requests at once; the door
hands those admissions to their waiters.

The first round runs for all replicas before the gateway starts serving, so ``/ready``
is truthful from the first request.

Readiness has hysteresis (`admission.health.ProbeHysteresis`): a round whose probes fail
or time out (the adapter finds the replica not ready) takes a ready replica out only
after ``discovery.fail_threshold`` such rounds in a row; until then admission keeps the
last good view (its age makes routing treat it as stale). An unready replica returns
after ``discovery.success_threshold`` good rounds in a row. A refused connection on the
request path (`Discovery.mark_down`) takes the replica out at once, and it too returns
only after that many good rounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging

import aiohttp

from admission.health import ProbeHysteresis
from gateway.config import DiscoveryConfig, ReplicaConfig
from gateway.door import AdmissionDoor
from routing.adapters import adapter_for
from routing.types import ReplicaState

log = logging.getLogger("kvgate.discovery")


class ReplicaWatcher:
    """Polls one replica and upserts what it learns."""

    def __init__(
        self,
        rc: ReplicaConfig,
        session: aiohttp.ClientSession,
        door: AdmissionDoor,
        cfg: DiscoveryConfig,
        known_models: set[str],
    ) -> None:
        self.config = rc
        self._known_models = known_models
        self._session = session
        self._door = door
        self._cfg = cfg
        self._adapter = adapter_for(rc.engine, kv_layout=rc.kv_layout)
        self.state = ReplicaState(
            name=rc.name,
            base_url=rc.url,
            engine=rc.engine,
            labels=dict(rc.labels),
            block_size=rc.block_size or 16,
            max_running=rc.max_running,
            dp_rank=rc.dp_rank,
        )
        self._headers = {"Authorization": f"Bearer {rc.api_key}"} if rc.api_key else {}
        self._was_ready: bool | None = None
        self.hysteresis = ProbeHysteresis(cfg.fail_threshold, cfg.success_threshold)

    async def _probe(self, path: str) -> tuple[int, str] | None:
        try:
            async with asyncio.timeout(self._cfg.probe_timeout_s):
                async with self._session.get(self.config.url + path, headers=self._headers) as r:
                    return r.status, await r.text(errors="replace")
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            log.debug("probe %s%s failed: %r", self.config.name, path, e)
            return None

    async def refresh(self) -> None:
        """One discovery round: probe, apply, upsert."""
        paths = tuple(self._adapter.probe_paths)
        loop = asyncio.get_running_loop()
        # The round is stamped with its start: the answers describe the engine at some
        # moment after it (admission compares it with when a request was abandoned).
        now = loop.time()
        answers = await asyncio.gather(*(self._probe(p) for p in paths))
        # Adapters read a missing path as "unreachable".
        results = {p: a for p, a in zip(paths, answers, strict=True) if a is not None}
        state = self.state
        if self.config.pool_tokens is not None and state.capacity_tokens is None:
            # A pinned pool is the capacity for engines that cannot report one (the
            # adapters only call a replica ready once its capacity is known).
            state.capacity_tokens = self.config.pool_tokens
        before = copy.deepcopy(state) if self.hysteresis.ready else None
        self._adapter.apply(state, results, now)
        observed = bool(state.ready)
        ready = self.hysteresis.observe(observed)
        if ready and not observed and before is not None:
            # A failed round within the hysteresis: keep the last good view.
            log.debug("probe round of %s failed; still ready (hysteresis)", state.name)
            state = self.state = before
        elif not ready:
            state.ready = False
        self._known_models.update(state.models)
        if self.config.block_size:
            state.block_size = self.config.block_size
        self.upsert()
        if state.ready != self._was_ready:
            log.info(
                "replica %s is %s",
                state.name,
                "ready" if state.ready else "not ready",
                extra={
                    "fields": {
                        "replica": state.name,
                        "ready": state.ready,
                        "capacity_tokens": self.config.pool_tokens or state.capacity_tokens,
                        "models": list(state.models),
                    }
                },
            )
            self._was_ready = state.ready

    def upsert(self) -> None:
        """Push the current state (with pinned values) into admission."""
        self._door.upsert_replica(
            self.state,
            asyncio.get_running_loop().time(),
            pinned_capacity=self.config.pool_tokens,
            max_running=self.config.max_running,
        )

    async def run(self) -> None:
        """Refresh forever (cancelled at shutdown); a failed round never ends the loop."""
        while True:
            await asyncio.sleep(self._cfg.refresh_interval_s)
            try:
                await self.refresh()
            except Exception:
                log.exception("discovery round for %s failed", self.config.name)


class Discovery:
    """All watchers, plus what the pipeline reads from them."""

    def __init__(
        self,
        replicas: list[ReplicaConfig],
        session: aiohttp.ClientSession,
        door: AdmissionDoor,
        cfg: DiscoveryConfig,
    ) -> None:
        # Every model any replica ever served: bounds the model label of metrics.
        self.known_models: set[str] = set()
        self.watchers = {
            rc.name: ReplicaWatcher(rc, session, door, cfg, self.known_models) for rc in replicas
        }
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        results = await asyncio.gather(
            *(w.refresh() for w in self.watchers.values()), return_exceptions=True
        )
        for name, r in zip(self.watchers, results, strict=True):
            if isinstance(r, Exception):
                log.error("first discovery round for %s failed: %r", name, r)
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(w.run(), name=f"kvgate-discovery-{name}")
            for name, w in self.watchers.items()
        ]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []

    def mark_down(self, name: str) -> None:
        """The request path found `name` down (refused connection): it stays out until
        ``success_threshold`` good probe rounds in a row."""
        w = self.watchers.get(name)
        if w is not None:
            w.hysteresis.force_down()
            w.state.ready = False

    def max_model_len(self, model: str) -> int | None:
        """The longest context any ready replica serving `model` reported."""
        best: int | None = None
        for w in self.watchers.values():
            s = w.state
            if s.ready and s.max_model_len and model in s.models:
                best = s.max_model_len if best is None else max(best, s.max_model_len)
        return best
