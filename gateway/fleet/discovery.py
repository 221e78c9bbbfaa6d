"""Capacity discovery: keep each replica's `ReplicaState` current from its engine.

One task per replica polls the engine adapter's probe paths (metrics, model list...)
every ``discovery.refresh_interval_s``, lets the adapter map the answers onto the
`ReplicaState` (only adapters know engine metric names), applies the pinned values from
the config, and upserts the state through the admission door. Capacity that grows (a
replica becoming ready, a pool discovered) admits queued requests at once; the door
hands those admissions to their waiters.

The first round runs for all replicas before the gateway starts serving, so ``/ready``
is truthful from the first request.

A probe GET slower than ``discovery.probe_timeout_s`` fails its round but is not
dropped (`gateway.fleet.probe.RoundFetcher`): the next round takes its answer, stamped with
when it was asked for. An engine busy serving answers its /metrics late, and that is when
its preemption counter should reach the learned limit.

Readiness has hysteresis (`admission.health.ProbeHysteresis`): a round whose probes fail
or time out (the adapter finds the replica not ready) takes a ready replica out only
after ``discovery.fail_threshold`` such rounds in a row; until then admission keeps the
last good view (its age makes routing treat it as stale). An unready replica returns
after ``discovery.success_threshold`` good rounds in a row. A refused connection on the
request path (`Discovery.mark_down`) takes the replica out at once, and it too returns
only after that many good rounds.

LoRA adapters are models: a replica that lists an adapter in ``/v1/models`` (vLLM: an
entry whose ``parent`` names its base) serves requests for it by name, in its base's
KV pool. `ModelCatalog` keeps which base each served adapter runs on, fleet-wide, for
the tenant check (`TenantState.may_use`: a tenant allowed a base may use its adapters)
and for ``GET /v1/models``.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from dataclasses import dataclass

import aiohttp

from admission.health import ProbeHysteresis
from gateway.config import DiscoveryConfig, ReplicaConfig
from gateway.door import AdmissionDoor
from gateway.fleet.probe import Outcomes, RoundFetcher, answered, explain, fetch_round
from gateway.tasks import cancel_all
from routing.adapters import EngineAdapter, adapter_for
from routing.types import ReplicaState

log = logging.getLogger("kvgate.discovery")


def new_state(rc: ReplicaConfig) -> ReplicaState:
    """A replica's state before its first probe: what its config says."""
    return ReplicaState(
        name=rc.name,
        base_url=rc.url,
        engine=rc.engine,
        labels=dict(rc.labels),
        block_size=rc.block_size or 16,
        max_running=rc.max_running,
        dp_rank=rc.dp_rank,
    )


def probe_headers(rc: ReplicaConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {rc.api_key}"} if rc.api_key else {}


async def probe_once(
    rc: ReplicaConfig,
    adapter: EngineAdapter,
    state: ReplicaState,
    session: aiohttp.ClientSession,
    timeout_s: float,
    now: float,
) -> str | None:
    """Probe `rc` once and apply the answers to `state`; returns why it is not ready."""
    paths = tuple(adapter.probe_paths)
    outcomes = await fetch_round(session, rc.url, paths, probe_headers(rc), timeout_s)
    return apply_round(rc, adapter, state, outcomes, now)


def apply_round(
    rc: ReplicaConfig, adapter: EngineAdapter, state: ReplicaState, outcomes: Outcomes, now: float
) -> str | None:
    """Apply one round's answers to `state`; returns why it is not ready."""
    if rc.pool_tokens is not None and state.capacity_tokens is None:
        # A pinned pool is the capacity for engines that cannot report one (the
        # adapters only call a replica ready once its capacity is known).
        state.capacity_tokens = rc.pool_tokens
    adapter.apply(state, answered(outcomes), now)
    return explain(rc.url, rc.engine, adapter, outcomes, state)


class ModelCatalog:
    """The models the replicas serve, and the base model each LoRA adapter runs on.

    Each replica's last model list counts (a replica out of service keeps its own until
    it is retired), so a request for an adapter whose replicas are all down is still
    known as the adapter it is. `known` only grows: it bounds the model label of metrics.
    """

    def __init__(self) -> None:
        self.known: set[str] = set()
        self._lists: dict[str, tuple[tuple[str, ...], tuple[tuple[str, str], ...]]] = {}
        self._bases: dict[str, frozenset[str]] = {}

    def saw(self, replica: str, state: ReplicaState) -> None:
        """What a round found `replica` serving (rebuilt only when its list changed)."""
        self.known.update(state.models)
        listed = (tuple(state.models), tuple(sorted(state.adapters.items())))
        if self._lists.get(replica) != listed:
            self._lists[replica] = listed
            self._rebuild()

    def forget(self, replica: str) -> None:
        if self._lists.pop(replica, None) is not None:
            self._rebuild()

    def _rebuild(self) -> None:
        bases: dict[str, set[str]] = {}
        for models, adapters in self._lists.values():
            parent = dict(adapters)
            for m in models:
                bases.setdefault(m, set()).add(parent.get(m, m))
        self._bases = {m: frozenset(b) for m, b in bases.items()}

    def served(self) -> frozenset[str]:
        """Every model a replica lists now (adapters included)."""
        return frozenset(self._bases)

    def bases_of(self, model: str) -> frozenset[str]:
        """The models `model` runs on where a replica serves it: its base where it is a
        LoRA adapter, itself where it is a base; empty where no replica serves it. More
        than one where replicas disagree (one name, two bases): the tenant check then
        asks for every one."""
        return self._bases.get(model, frozenset())


class ReplicaWatcher:
    """Polls one replica and upserts what it learns."""

    def __init__(
        self,
        rc: ReplicaConfig,
        session: aiohttp.ClientSession,
        door: AdmissionDoor,
        cfg: DiscoveryConfig,
        catalog: ModelCatalog,
    ) -> None:
        self.config = rc
        self._catalog = catalog
        self._session = session
        self._door = door
        self._cfg = cfg
        self._adapter = adapter_for(rc.engine, kv_layout=rc.kv_layout)
        self._fetcher = RoundFetcher(session, rc.url, probe_headers(rc))
        self.state = new_state(rc)
        self._was_ready: bool | None = None
        self.hysteresis = ProbeHysteresis(cfg.fail_threshold, cfg.success_threshold)
        # Why the last round left it not ready (None: it was ready); the most recent
        # such cause, kept after it clears, and the wall-clock times of the last good
        # round and of that cause's first round (/admin/replicas shows them).
        # True until a probe finds it ready: admission does not hear of it before.
        self.join_when_ready = False
        self.retired = False
        self.error: str | None = None
        self.last_error: str | None = None
        self.last_error_at: float | None = None
        self.last_ok: float | None = None

    async def refresh(self) -> None:
        """One discovery round: probe, apply, upsert."""
        got = await self._fetcher.round(tuple(self._adapter.probe_paths), self._cfg.probe_timeout_s)
        if got.waiting:  # a slow engine's next answer is on its way: no verdict this round
            return
        state = self.state
        before = copy.deepcopy(state) if self.hysteresis.ready else None
        # The round is stamped with when its answers were asked for (a late one: in an
        # earlier round): they describe the engine at some moment after it (admission
        # compares it with when a request was abandoned).
        error = apply_round(self.config, self._adapter, state, got.outcomes, got.asked)
        observed = error is None  # ready, with a known pool
        changed = error is not None and error != self.error
        self._note(error)
        ready = self.hysteresis.observe(observed)
        if ready and not observed and before is not None:
            # A failed round within the hysteresis: keep the last good view.
            state = self.state = before
        elif not ready:
            state.ready = False
        if not self.retired:  # a round under way when it was retired or replaced
            self._catalog.saw(self.config.name, state)
        if self.config.block_size:
            state.block_size = self.config.block_size
        if state.ready:
            self.join_when_ready = False
        if not self.join_when_ready:
            self.upsert()
        if state.ready != self._was_ready:
            self._log_readiness()
        elif changed:
            # Once per change of cause, at warning level: the operator's first clue.
            log.warning(
                "replica %s: %s%s",
                state.name,
                error,
                " (still ready: hysteresis)" if state.ready else "",
                extra={"fields": {"replica": state.name, "ready": state.ready, "error": error}},
            )

    def _log_readiness(self) -> None:
        state = self.state
        why = f": {self.error}" if not state.ready and self.error else ""
        (log.info if state.ready else log.warning)(
            "replica %s is %s%s",
            state.name,
            "ready" if state.ready else "not ready",
            why,
            extra={
                "fields": {
                    "replica": state.name,
                    "ready": state.ready,
                    "error": None if state.ready else self.error,
                    "capacity_tokens": self.config.pool_tokens or state.capacity_tokens,
                    "models": list(state.models),
                    "adapters": dict(state.adapters),
                }
            },
        )
        self._was_ready = state.ready

    def _note(self, error: str | None) -> None:
        """Keep the round's error and the wall-clock times /admin/replicas shows."""
        wall = time.time()
        if error is None:
            self.last_ok = wall
        elif error != self.error:
            self.last_error, self.last_error_at = error, wall
        self.error = error

    def upsert(self) -> None:
        """Push the current state (with pinned values) into admission."""
        if self.retired:  # a round that was under way when it was retired
            return
        self._door.upsert_replica(
            self.state,
            asyncio.get_running_loop().time(),
            pinned_capacity=self.config.pool_tokens,
            max_running=self.config.max_running,
        )

    async def run(self) -> None:
        """Refresh forever (cancelled at shutdown); a failed round never ends the loop."""
        try:
            while True:
                await asyncio.sleep(self._cfg.refresh_interval_s)
                try:
                    await self.refresh()
                except Exception:
                    log.exception("discovery round for %s failed", self.config.name)
        finally:
            self.close()

    def close(self) -> None:
        """Cancel its probe GETs still under way (stopped, retired or replaced)."""
        self._fetcher.close()


@dataclass(slots=True, frozen=True)
class Endpoint:
    """Where a replica's requests go: its URL and the headers sent with them."""

    url: str
    headers: dict[str, str]  # Content-Type and the replica's key (tokenize calls)
    upstream_headers: dict[str, str]  # and the vLLM data-parallel rank it is pinned to

    @classmethod
    def of(cls, rc: ReplicaConfig) -> Endpoint:
        h = {"Content-Type": "application/json"}
        if rc.api_key:
            h["Authorization"] = f"Bearer {rc.api_key}"
        up = dict(h)
        if rc.dp_rank is not None:  # pinned to the engine rank whose ledger admitted it
            up["X-data-parallel-rank"] = str(rc.dp_rank)
        return cls(rc.url, h, up)


class Discovery:
    """All watchers, plus what the pipeline reads from them.

    The set of replicas can change while serving (DNS groups, a reloaded config): `add`
    probes a new replica and starts its watcher; `retire` stops one at once (admission
    takes no new request for it, `AdmissionDoor.remove_replica`) while its running
    requests finish; its `Endpoint` stays readable until the ledger has forgotten it.
    """

    def __init__(
        self,
        replicas: list[ReplicaConfig],
        session: aiohttp.ClientSession,
        door: AdmissionDoor,
        cfg: DiscoveryConfig,
    ) -> None:
        self._session = session
        self._door = door
        self._cfg = cfg
        # What the replicas serve; `known_models`: every model any replica ever served,
        # which bounds the model label of metrics.
        self.catalog = ModelCatalog()
        self.known_models: set[str] = self.catalog.known
        self.watchers: dict[str, ReplicaWatcher] = {}
        self.endpoints: dict[str, Endpoint] = {}
        self._retired: set[str] = set()  # endpoints kept while requests may still use them
        self._tasks: dict[str, asyncio.Task[None]] = {}
        for rc in replicas:
            self._watch(rc)

    def _watch(self, rc: ReplicaConfig, join_when_ready: bool = False) -> ReplicaWatcher:
        w = ReplicaWatcher(rc, self._session, self._door, self._cfg, self.catalog)
        w.join_when_ready = join_when_ready
        self.watchers[rc.name] = w
        self.endpoints[rc.name] = Endpoint.of(rc)
        self._retired.discard(rc.name)
        return w

    async def start(self) -> None:
        await self._first_rounds(list(self.watchers.values()))

    async def _first_rounds(self, watchers: list[ReplicaWatcher]) -> None:
        results = await asyncio.gather(*(w.refresh() for w in watchers), return_exceptions=True)
        for w, r in zip(watchers, results, strict=True):
            if isinstance(r, Exception):
                log.error("first discovery round for %s failed: %r", w.config.name, r)
        loop = asyncio.get_running_loop()
        for w in watchers:
            name = w.config.name
            if self.watchers.get(name) is w and name not in self._tasks:
                self._tasks[name] = loop.create_task(w.run(), name=f"kvgate-discovery-{name}")

    async def add(self, replicas: list[ReplicaConfig], *, join_when_ready: bool = False) -> None:
        """Watch new replicas (a name already watched is replaced); each is probed at
        once. `join_when_ready`: admission hears of one only once a probe finds it ready
        (an address from DNS is nobody's replica until it answers)."""
        for rc in replicas:
            old = self.watchers.get(rc.name)
            if old is not None:  # replaced: admission keeps the replica and its ledger
                old.retired = True
                old.close()
                task = self._tasks.pop(rc.name, None)
                if task is not None:
                    task.cancel()
        await self._first_rounds([self._watch(rc, join_when_ready) for rc in replicas])

    def retire(self, name: str) -> None:
        """Stop watching `name`: no new request goes to it from now on; running ones
        finish, and the ledger forgets it when the last is released."""
        w = self.watchers.pop(name, None)
        if w is None:
            return
        w.retired = True
        w.close()
        task = self._tasks.pop(name, None)
        if task is not None:
            task.cancel()
        self._door.remove_replica(name)
        self.catalog.forget(name)
        self._retired.add(name)
        log.info(
            "replica %s retired", name, extra={"fields": {"replica": name, "url": w.config.url}}
        )

    def prune(self) -> None:
        """Forget the endpoints of retired replicas the ledger no longer holds."""
        if not self._retired:
            return
        held = set(self._door.report.replica_names())
        for name in [n for n in self._retired if n not in held]:
            self._retired.discard(name)
            self.endpoints.pop(name, None)

    def same_server(self, name: str) -> frozenset[str]:
        """The replicas behind `name`'s URL (the ranks of one vLLM data-parallel server):
        a refused connection says every one of them is down."""
        ep = self.endpoints.get(name)
        if ep is None:
            return frozenset({name})
        return frozenset(n for n, w in self.watchers.items() if w.config.url == ep.url) | {name}

    async def stop(self) -> None:
        await cancel_all(self._tasks.values())
        self._tasks = {}

    def mark_down(self, name: str) -> None:
        """The request path found `name` down (refused connection): it stays out until
        ``success_threshold`` good probe rounds in a row. Discovery owns readiness: it
        tells admission, as after a probe round."""
        w = self.watchers.get(name)
        if w is not None:
            w.hysteresis.force_down()
            w.state.ready = False
            w.upsert()

    def served(self) -> frozenset[str]:
        """Every model a replica lists now (`ModelCatalog.served`)."""
        return self.catalog.served()

    def bases_of(self, model: str) -> frozenset[str]:
        """The models `model` runs on (`ModelCatalog.bases_of`): for the tenant check,
        ``policy.may_use(model, discovery.bases_of(model))``."""
        return self.catalog.bases_of(model)

    def max_model_len(self, model: str) -> int | None:
        """The longest context any ready replica serving `model` reported."""
        best: int | None = None
        for w in self.watchers.values():
            s = w.state
            if s.ready and s.max_model_len and model in s.models:
                best = s.max_model_len if best is None else max(best, s.max_model_len)
        return best
