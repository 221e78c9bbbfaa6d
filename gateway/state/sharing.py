"""The lease loop: keeps this process's slices of shared replicas (gateway/state).

Several gateway processes (``--workers N``, or several hosts on one Redis) front the
same replicas. Each holds a lease on a slice of every replica's effective KV pool and of
its running cap, and the admission controller admits from the slice
(`AdmissionController.set_pool_shares`): the request path never waits on Redis.

Renewal
    Every ``renew_interval_s``, and within 50 ms when requests queue here (demand this
    process's slice cannot meet), one script renews every lease: each asks for what
    the process holds and has queued, and reports what it holds (its *truth*); the
    backend's arithmetic (admission/lease.py) decides the slice. Learned running
    limits are shared first: a limit this process changed is published, one another
    process published later is adopted (`RunningLimit.adopt`), and a new process seeds
    its limits from the shared ones. A learned limit is an aim, not a bound: it is not
    sliced, each process runs what the others' reported running leaves of it
    (`Replica.allowed`); a hard cap is sliced as the pool is (a process alone on a
    replica is not capped by its slice between renewals). What the process learned of
    its clients' patience is shared the same way, once per interval
    (gateway/state/patience_sync.py).

Tenant budgets
    A tenant's rpm, tpm and concurrency are leased the same way, as a fraction of the
    tenant's totals (resource ``tenant:<name>``, in units of 1/10,000): a process asks
    for its current fraction scaled by how much of it is in use (the fuller of its rpm
    and tpm buckets, or its running and queued requests against its concurrency), plus
    a quarter for growth (and at least a quarter of an equal split, so that an idle
    process keeps room for its next request), so a busy process's fraction grows while
    an idle one's decays, and the limiter scales this process's limits to the granted
    fraction
    (`TenantLimiter.set_share`). The fractions of all processes sum to at most 1.
    Each process also reports the cells it spent of each kind (``spent:<name>:<kind>``,
    asking for nothing), so its rate-limit headers tell the tenant's whole limit and what
    is left of it fleet-wide (`Gcra.fleet_used`), not its own share.

Redis unreachable (``on_unreachable``)
    A failed renewal may still have been applied (a timeout), so until a TTL after the
    last good renewal was sent, while this process's records still stand, it admits
    within the least it reported since (what the records hold at least): a late answer
    under load lets nothing past the pool or the running cap. Any failed renewal ends
    in the rebuild below once Redis answers (it may have restarted empty meanwhile).
    ``fail-open``: then the process keeps admitting from its slices, each cut to at most
    1/N of the replica's pool and running limit (N: the processes alive at the last good
    renewal, at least ``--workers``; a running slice keeps at least one request). While
    every process is cut off, their slices sum to at most the pool, so nothing is
    over-admitted; a process cut off alone while others still reach Redis can exceed the
    pool by at most its 1/N while its old lease expires (the documented share).
    ``fail-closed``: new requests get 503 with Retry-After until Redis answers again.
    Either way ``kvgate_state_backend_up`` drops to 0, ``kvgate_state_backend_errors_total``
    counts the failed round trips, and one warning is logged per outage (and one line
    when it ends).

Reconnect
    The first good renewal re-registers every lease from the process's own holdings, one
    record per (resource, process): a Redis that restarted empty is rebuilt without
    double counting, and records of processes that died meanwhile expire by TTL. Until
    every process seen before the outage has re-registered (or a TTL has passed: the
    missing ones are dead, or cut off and within their own 1/N), a slice stays within
    the fail-open 1/N: a process that reconnects first must not take what the others
    still run on. The same when a renewal finds that the backend lost this process's
    heartbeat (restarted empty between two renewals) or Sentinel names another primary
    (a failover: the promoted replica lacks what was not yet replicated, and others'
    records there may be a renewal old), for a whole TTL: counting the processes there
    proves nothing.

Shutdown
    The loop stops and the process returns its slices at once (best effort: if Redis is
    unreachable they expire by TTL).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import zlib
from collections.abc import Callable

from admission.lease import PoolShare
from admission.report import PoolDemand
from admission.tenants import Gcra, TenantLimiter, TenantState
from gateway.config import StateConfig
from gateway.door import AdmissionDoor
from gateway.errors import ApiError
from gateway.outcome import shed
from gateway.state import LeaseRequest, StateBackend, StateUnavailable
from gateway.state.patience_sync import PatienceSync

log = logging.getLogger("kvgate.state")

_DEMAND_CHECK_S = 0.05  # how soon a renewal follows requests queueing behind a slice
TENANT_UNITS = 10_000  # a tenant's budget in lease units (a fraction in 1/10,000)
_TENANT_GROWTH = 0.25  # what a tenant lease asks beyond what is in use, of its fraction


_NEVER = 1 << 30  # a process count no rebuild reaches: it lasts its whole TTL


def tenant_usage(st: TenantState, now: float) -> float:
    """How much of this process's fraction of a tenant's budget is in use, in [0, 1]:
    the fuller of its rpm and tpm buckets (cells charged and not yet refilled)."""
    used = 0.0
    for g in (st.rpm, st.tpm):
        if g is not None and g.limit > 0:
            used = max(used, 1.0 - g.remaining(now) / g.limit)
    return min(1.0, max(0.0, used))


def tenant_held(st: TenantState, now: float) -> float:
    """The fraction of a tenant's whole budget this process has spent and not yet
    refilled (the fuller of rpm and tpm). Reported as the lease's use: spent cells are
    spent for every process, so the others are not granted them again before they
    refill (here, at the rate they were granted at: `Lease.rate`)."""
    held = 0.0
    for g in (st.rpm, st.tpm):
        if g is not None and g.total > 0:
            held = max(held, g.used(now) / g.total)
    return min(1.0, held)


def spent(g: Gcra, now: float) -> int:
    """Cells of a tenant's bucket this process spent and has not refilled, reported so
    that every process tells its clients what is left of the whole budget."""
    return math.ceil(g.used(now) - 1e-9)


def _limited(st: TenantState) -> bool:
    return st.rpm is not None or st.tpm is not None or st.total_concurrent is not None


def make_backend(config: StateConfig) -> StateBackend | None:
    """The configured backend, or None for ``memory`` (one process shares nothing, so
    there is nothing to lease)."""
    if config.backend != "redis":
        return None
    from gateway.state.redis import RedisBackend

    return RedisBackend(
        config.redis_url,
        sentinel=config.redis_sentinel,
        cluster=config.redis_cluster,
        password=config.redis_password,
        prefix=config.key_prefix,
        timeout_s=config.timeout_s,
    )


def holder_id() -> str:
    """This process's name in the shared state: host, PID and a random tag (a restarted
    process with a recycled PID is a new holder)."""
    return f"{socket.gethostname()}:{os.getpid()}:{os.urandom(3).hex()}"


class StateSync:
    """Leases this process's slices of every replica and shares learned limits and client
    patience."""

    def __init__(
        self,
        config: StateConfig,
        backend: StateBackend,
        door: AdmissionDoor,
        *,
        holder: str | None = None,
        workers_hint: int = 1,
        tenants: TenantLimiter | None = None,
        set_tenant_share: Callable[[str, float, float], None] | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        """`loop`: the one whose clock it reads (virtual time passes its own:
        bench/fleet_vt.py); else the running loop."""
        self.config = config
        self.tenants = tenants
        # Applies a tenant fraction (GatewayState.set_tenant_share: the limiter, then a
        # settling of the queue); defaults to the limiter alone.
        self._set_tenant_share = set_tenant_share
        self.backend = backend
        self.door = door
        self.report = door.report
        self.holder = holder or holder_id()
        self.workers_hint = max(1, workers_hint)
        self.up = False
        self.errors = 0
        self.renewals = 0
        self.processes = 1
        self._outage_logged = False
        self._ever_up = False
        self._limit_seen: dict[str, tuple[float, int]] = {}  # replica -> (value, version)
        self._patience = PatienceSync(backend, door)  # client patience
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self._loop = loop or asyncio.get_running_loop()
        self._last = -math.inf  # the last round's start
        self._last_round = -math.inf  # the last interval round's (client patience too)
        # After an outage: until when (and until how many processes re-registered) the
        # slices stay within the fail-open 1/N (module docstring, Reconnect).
        self._rebuild_until = -math.inf
        self._rebuild_n = 0
        # When the last good renewal was sent (its records stand in the backend for a
        # TTL from then), and per replica the least (reserved, running) reported since:
        # a failed renewal may have been applied, so the records hold at least that.
        self._ok_sent_at = -math.inf
        self._reported: dict[str, tuple[int, int]] = {}
        self._granted: dict[str, tuple[int | None, int | None]] = {}  # the last good slices
        self._others_used: dict[str, int] = {}  # per replica, the others' use last seen
        self._others_running: dict[str, int] = {}  # and the requests they run there
        self._ranks: dict[str, int] = {}  # per replica, its `_rank` (fixed per holder)

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """One renewal before the app serves (the slices exist from the first request),
        then the background loop."""
        await self.renew()
        self._task = self._loop.create_task(self._run(), name="kvgate-state")

    async def stop(self) -> None:
        """Stop renewing and return this process's leases (idempotent: the shutdown
        returns them before aiohttp's own cleanup, which calls this again)."""
        if self._stopped:
            return
        self._stopped = True
        if self._task is not None:
            task, self._task = self._task, None
            task.cancel()
            # A cancellation that lands inside a client library's own timeout handling can
            # be lost (seen: docs/benchmarks-faults.md): the loop also ends on _stopped, and
            # the stop waits for it no longer than one backend call before returning the
            # leases.
            await asyncio.wait({task}, timeout=self.config.timeout_s * 2)
            if not task.done():
                log.warning("state: the lease loop did not stop in time; returning leases anyway")
        try:
            async with asyncio.timeout(self.config.timeout_s * 2):
                await self.backend.release(self.holder)
        except (StateUnavailable, TimeoutError):
            log.info("state: leases left to expire by TTL (backend unreachable at shutdown)")
        with contextlib.suppress(Exception):
            await self.backend.close()

    def gate(self) -> ApiError | None:
        """The error new requests get while the backend is unreachable under
        ``fail-closed`` (None: admit)."""
        if self.up or self.config.on_unreachable != "fail-closed":
            return None
        return ApiError(
            503,
            "kvgate cannot reach its shared state (Redis) and is configured fail-closed; "
            "retry the request.",
            code="state_unavailable",
            retry_after=max(1.0, self.config.renew_interval_s),
            outcome=shed("state_unavailable"),
        )

    @property
    def tick_s(self) -> float:
        """How often the loop asks `renewal_due`."""
        return min(self.config.renew_interval_s, _DEMAND_CHECK_S)

    def renewal_due(self, now: float) -> bool | None:
        """Whether to renew at `now`: None, not yet; True, the interval's round (client
        patience too); False, a round that requests queued behind a slice bring early."""
        # The interval's rounds are timed from the last of them, not from the last round:
        # early rounds every 50 ms while a queue stands never let an interval pass, and
        # client patience went unshared under the overload it is learned in.
        due = now - self._last_round >= self.config.renew_interval_s
        if due or (self.report.queue_depth() > 0 and now - self._last >= _DEMAND_CHECK_S):
            return due
        return None

    async def _run(self) -> None:
        while not self._stopped:
            await asyncio.sleep(self.tick_s)
            due = self.renewal_due(self._loop.time())
            if due is not None:
                try:
                    await self.renew(patience=due)
                except Exception:  # a bug here must not stop the leases for good
                    log.exception("state: renewal failed")

    # ---------------------------------------------------------------- one round
    def _demands(self) -> list[PoolDemand]:
        out = []
        for name in self.report.replica_names():
            d = self.report.pool_demand(name)
            if d is not None and d.effective > 0:
                out.append(d)
        return out

    def _rank(self, replica: str) -> int:
        """`replica`'s place in this process's own order of replicas (`_asks`)."""
        rank = self._ranks.get(replica)
        if rank is None:
            rank = self._ranks[replica] = zlib.crc32(f"{self.holder}/{replica}".encode())
        return rank

    def _asks(
        self, demands: list[PoolDemand]
    ) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[int, float]]]:
        """How much of its queue this process asks of each replica beyond what it holds
        (tokens of the pool, requests of the running limit), and each replica's head
        (its tokens and deadline).

        Asking every replica for the whole queue made every process with a queue want
        every pool whole: the pools were split evenly among them, in slices smaller than
        the requests once there were ten (bench/fleet_vt.py); the running limit the same
        way, in slices of none, on other replicas than those whose pool a process was
        granted. The queue is spread instead, over each model's replicas in an order of
        this process's own (so processes ask different replicas first). First within the
        room the last renewal showed free (in the pool and the running limit): each
        queued request, the largest first, is asked whole of the first replica whose
        free room holds it, since a request needs all its tokens on one replica (its
        tokens spread over several free rooms, none of them grew to hold it: fleet_vt at
        20 gateways x 10 replicas). What no free room holds is spread in the same order
        over the free room left (asked whole instead, it lost requests where free rooms
        were many and small: 2 gateways x 1,000 replicas), then claimed up to each pool
        and limit (a claim on a fair share of a busy replica, so a process behind a busy
        one still gets its turn), as many requests of a replica as the tokens asked of
        it hold.

        Each replica asked also gets a head (`admission.lease`, heads): the request due
        first among those asked whole of it, or, for the requests no free room holds,
        the one due first, named on the first replica whose pool could hold it (and
        asked whole there); the pools' renewals deal heads whole, the earliest deadline
        first, where an equal split would hold none."""
        order = sorted(demands, key=lambda d: self._rank(d.replica))
        free: dict[str, list[float]] = {}  # replica -> [free tokens, free slots]
        for d in order:
            slots = math.inf if d.running_limit is None else d.running_limit - d.running
            free[d.replica] = [
                d.effective - d.reserved - self._others_used.get(d.replica, 0),
                slots - self._others_running.get(d.replica, 0),
            ]
        asks = {d.replica: [0, 0] for d in demands}
        heads: dict[str, tuple[int, float]] = {}  # replica -> its head (tokens, deadline)
        left: dict[str, list[int]] = {}  # per model, the needs no free room holds
        for m in sorted({m for d in demands for m in d.models}):
            queued = sorted(self.report.queued_needs(m), reverse=True)
            names = [d.replica for d in order if m in d.models]
            left[m], first = _ask_whole(queued, names, free, asks, heads)
            if first is not None:  # named where a pool could hold it, in this process's order
                for d in order:
                    if m in d.models and d.effective - d.reserved >= first[1]:
                        _head(heads, d.replica, first[1], first[0])
                        break
        _spread(order, free, asks, left)
        for name, (need, _) in heads.items():  # a head is asked whole where it is named
            a = asks[name]
            if a[0] < need:
                a[0] = need
                a[1] = max(a[1], 1)
        return {name: (a[0], a[1]) for name, a in asks.items()}, heads

    async def renew(self, patience: bool = True) -> None:
        """One round; `patience`: client patience too (the interval's rounds, not the ones
        demand brings between them)."""
        if self._stopped:  # a renewal after the release would lease the slices again
            return
        sent_at = self._last = self._loop.time()
        if patience:
            self._last_round = sent_at
        demands: list[PoolDemand] = []
        try:
            await self._sync_limits()
            if patience:
                await self._patience.sync(sent_at)
            demands = self._demands()
            asks, heads = self._asks(demands)
            requests: list[LeaseRequest] = []
            for d in demands:
                head = heads.get(d.replica)
                requests.append(
                    LeaseRequest(
                        f"pool:{d.replica}",
                        d.effective,
                        d.reserved + asks[d.replica][0],
                        d.reserved,
                        head[0] if head else 0,
                        max(0.0, head[1] - sent_at) if head else math.inf,
                    )
                )
                if d.running_cap is not None:  # a hard bound: sliced, as the pool
                    requests.append(
                        LeaseRequest(
                            f"run:{d.replica}",
                            d.running_cap,
                            d.running + asks[d.replica][1],
                            d.running,
                        )
                    )
                elif d.running_limit is not None:  # an aim: reported, not sliced
                    requests.append(LeaseRequest(f"run:{d.replica}", d.running_limit, 0, d.running))
            tenants = self._tenant_states()
            now = self._loop.time()
            floor = 1.0 / (4 * max(self.processes, self.workers_hint))
            for st in tenants:
                used = tenant_usage(st, now)
                if st.total_concurrent is not None:  # concurrency: running and queued here
                    held = self.report.tenant_running(st.name)
                    held += self.report.tenant_queued(st.name)
                    used = max(used, min(1.0, held / max(1, st.max_concurrent or 0)))
                want = max(floor, st.share * (used + _TENANT_GROWTH))
                for g in (st.rpm, st.tpm):
                    if g is None:
                        continue
                    # A request refused for this process's share alone: its cost is
                    # demand, and the share can grow within a renewal or two.
                    g.share_wait_s = 2 * self.config.renew_interval_s
                    want = max(want, g.demand(now))
                for kind, g in (("requests", st.rpm), ("tokens", st.tpm)):
                    if g is not None:  # reported only: what the clients' headers tell
                        requests.append(
                            LeaseRequest(f"spent:{st.name}:{kind}", g.total, 0, spent(g, now))
                        )
                requests.append(
                    LeaseRequest(
                        f"tenant:{st.name}",
                        TENANT_UNITS,
                        min(TENANT_UNITS, math.ceil(want * TENANT_UNITS)),
                        min(TENANT_UNITS, math.ceil(tenant_held(st, now) * TENANT_UNITS)),
                    )
                )
            self._hold_reported(demands, now)
            result = await self.backend.renew(self.holder, requests, self.config.lease_ttl_s)
        except StateUnavailable as e:
            for d in demands:
                low = self._reported.get(d.replica, (d.reserved, d.running))
                self._reported[d.replica] = (min(low[0], d.reserved), min(low[1], d.running))
            self._unreachable(e)
            return
        self._ok_sent_at = sent_at
        self._reported.clear()
        leases = {lease.resource: lease for lease in result.leases}
        now = self._loop.time()
        forgotten = self.up and self._ever_up and not result.known
        if forgotten:
            log.warning(
                "state: backend %s had lost this process's records (a restart or a "
                "failover); leases re-registered from local holdings",
                self.backend.name,
            )
        if not self.up and self._ever_up:  # back after failed renewals: rebuild
            self._rebuild_until = now + self.config.lease_ttl_s
            self._rebuild_n = max(self.processes, self.workers_hint)
        if forgotten:
            # Others' heartbeats may have survived with records a renewal old: counting
            # them proves nothing, so the slices stay within 1/N for the whole TTL.
            self._rebuild_until = now + self.config.lease_ttl_s
            self._rebuild_n = _NEVER
        rebuilding = now < self._rebuild_until and result.processes < self._rebuild_n
        n = max(self._rebuild_n, 1)
        shares: list[PoolShare] = []
        for d in demands:
            pool = leases.get(f"pool:{d.replica}")
            run = leases.get(f"run:{d.replica}")
            if pool is not None:
                self._others_used[d.replica] = pool.others_used
            if run is not None:
                self._others_running[d.replica] = run.others_used
            tokens = pool.granted if pool is not None else None
            running = run.granted if run is not None and d.running_cap is not None else None
            if run is not None and run.holders == 1 and not rebuilding:
                # Alone on the replica: its record holds the whole cap, so what it runs
                # may grow between renewals without waiting for one.
                running = None
            if rebuilding:
                tokens = None if tokens is None else min(tokens, d.effective // n)
                if d.running_limit is not None:
                    whole = d.running_limit if running is None else running
                    running = min(whole, max(1, d.running_limit // n))
            self._granted[d.replica] = (tokens, running)
            shares.append(
                PoolShare(
                    d.replica,
                    tokens,
                    running,
                    others_running=run.others_used if run is not None else 0,
                    others_tokens=pool.others_used if pool is not None else 0,
                )
            )
        self.door.set_pool_shares(shares, now)
        for st in tenants:
            for kind, g in (("requests", st.rpm), ("tokens", st.tpm)):
                if g is not None and (spent_lease := leases.get(f"spent:{st.name}:{kind}")):
                    g.set_others(spent_lease.others_used, now)
            lease = leases.get(f"tenant:{st.name}")
            if lease is not None:
                units, refill = lease.granted, lease.refill()
                if rebuilding:
                    units = min(units, TENANT_UNITS // n)
                    refill = min(refill, TENANT_UNITS // n)
                self._tenant_share(st, units / TENANT_UNITS, refill / TENANT_UNITS)
        self.processes = result.processes
        self.renewals += 1
        if not self.up:
            self.up = True
            if self._outage_logged:
                log.warning(
                    "state: backend %s reachable again; leases re-registered from local "
                    "holdings (%d processes)",
                    self.backend.name,
                    self.processes,
                    extra={"fields": {"processes": self.processes}},
                )
            self._outage_logged = False
            self._ever_up = True

    def _tenant_states(self) -> list[TenantState]:
        if self.tenants is None:
            return []
        return [st for st in self.tenants.tenants.values() if _limited(st)]

    def _tenant_share(self, st: TenantState, fraction: float, refill: float | None = None) -> None:
        fraction = min(1.0, max(0.0, fraction))
        refill = fraction if refill is None else min(1.0, max(fraction, refill))
        if fraction == st.share and all(g is None or g.refill == refill for g in (st.rpm, st.tpm)):
            return
        if self._set_tenant_share is not None:
            self._set_tenant_share(st.name, fraction, refill)
        elif self.tenants is not None:
            self.tenants.set_share(st.name, fraction, self._loop.time(), refill)

    async def _sync_limits(self) -> None:
        """Publish the learned limits this process changed; adopt newer ones."""
        shared = await self.backend.limits()
        now = self._loop.time()
        for name in self.report.replica_names():
            lim = self.report.limit_of(name)
            if lim is None:
                continue
            seen = self._limit_seen.get(name)
            remote = shared.get(name)
            if seen is None and remote is not None:  # a new process starts from the shared
                self.door.adopt_limit(name, remote.value, remote.reason, now)
                self._limit_seen[name] = (lim.value, remote.version)
            elif seen is None or lim.value != seen[0]:
                version = await self.backend.publish_limit(name, lim.value, lim.reason)
                self._limit_seen[name] = (lim.value, version)
            elif remote is not None and remote.version > seen[1]:
                self.door.adopt_limit(name, remote.value, remote.reason, now)
                self._limit_seen[name] = (lim.value, remote.version)

    def _hold_reported(self, demands: list[PoolDemand], now: float) -> None:
        """Until this renewal's answer is applied, admit within what it reports held.
        The backend grants the others what this process does not report: an admission
        made under the old slice while the script runs could take what they were just
        granted, past the replica's pool or cap."""
        held: list[PoolShare] = []
        for d in demands:
            tokens, running = d.share_tokens, d.share_running
            if tokens is not None:
                tokens = min(tokens, d.reserved)
            if running is not None:
                running = min(running, d.running)
            if (tokens, running) != (d.share_tokens, d.share_running):
                held.append(
                    PoolShare(
                        d.replica,
                        tokens,
                        running,
                        others_running=self._others_running.get(d.replica, 0),
                        others_tokens=self._others_used.get(d.replica, 0),
                    )
                )
        if held:
            self.door.set_pool_shares(held, now)

    def _unreachable(self, err: Exception) -> None:
        self.errors += 1
        self.up = False
        n = max(self.processes, self.workers_hint, 1)
        policy = self.config.on_unreachable
        now = self._loop.time()
        # Until a TTL after the last good renewal was sent, this process's records stand
        # in the backend: the others are granted nothing it may use, so it stays within
        # them (a late answer under load is not an outage). After, they may have expired.
        standing = now < self._ok_sent_at + self.config.lease_ttl_s
        if not self._outage_logged:
            self._outage_logged = True
            log.warning(
                "state: backend %s unreachable (%s); %s",
                self.backend.name,
                err,
                f"fail-open: each replica's slice cut to at most 1/{n}"
                if policy == "fail-open"
                else "fail-closed: new requests get 503",
                extra={"fields": {"policy": policy, "processes": n}},
            )
        if policy != "fail-open":
            return
        shares: list[PoolShare] = []
        for d in self._demands():
            tokens, run = self._granted.get(d.replica, (None, None))
            pool = d.effective // n
            if tokens is not None:
                pool = min(pool, tokens)
            running = None
            if d.running_limit is not None:
                running = max(1, d.running_limit // n)
                if run is not None:
                    running = min(running, max(1, run))
            if standing and (low := self._reported.get(d.replica)) is not None:
                # A failed renewal may have been applied: its records hold at least what
                # it reported, and may have granted the rest of the slice to the others.
                pool = min(pool, low[0])
                running = None if running is None else min(running, low[1])
            shares.append(PoolShare(d.replica, pool, running))
        self.door.set_pool_shares(shares, now)
        for st in self._tenant_states():
            fraction = 1.0 / n
            if self._ever_up:
                fraction = min(fraction, st.share)
            self._tenant_share(st, fraction)

    # ---------------------------------------------------------------- observation
    def snapshot(self) -> dict[str, object]:
        replicas = {}
        for name in self.report.replica_names():
            d = self.report.pool_demand(name)
            if d is None:
                continue
            replicas[name] = {
                "effective_tokens": d.effective,
                "share_tokens": d.share_tokens,
                "reserved_tokens": d.reserved,
                "running_limit": d.running_limit,
                "share_running": d.share_running,
                "running": d.running,
                "others_running": self._others_running.get(name, 0),
                "queued": d.queued,
                "queued_tokens": d.queued_tokens,
            }
        tenants = {st.name: {"share": st.share} for st in self._tenant_states()}
        return {
            "tenants": tenants,
            "backend": self.backend.name,
            "holder": self.holder,
            "up": self.up,
            "on_unreachable": self.config.on_unreachable,
            "processes": self.processes,
            "errors": self.errors,
            "renewals": self.renewals,
            "replicas": replicas,
        }


def _first_fit(need: int, names: list[str], free: dict[str, list[float]]) -> str | None:
    """The first of `names` whose free room holds `need` tokens and a request (taken
    from it), or None."""
    for name in names:
        f = free[name]
        if f[0] >= need and f[1] >= 1:
            f[0] -= need
            f[1] -= 1
            return name
    return None


def _head(heads: dict[str, tuple[int, float]], replica: str, need: int, deadline: float) -> None:
    """Name the request due first among those asked of `replica` as its head."""
    h = heads.get(replica)
    if h is None or deadline < h[1]:
        heads[replica] = (need, deadline)


def _ask_whole(
    queued: list[tuple[int, float]],
    names: list[str],
    free: dict[str, list[float]],
    asks: dict[str, list[int]],
    heads: dict[str, tuple[int, float]],
) -> tuple[list[int], tuple[float, int] | None]:
    """Ask each queued ``(need, deadline)`` (largest first) whole of the first of `names`
    whose free room holds it, naming heads there; returns the needs no free room holds
    and the one of them due first, ``(deadline, need)``."""
    rest: list[int] = []
    first: tuple[float, int] | None = None
    bound = math.inf  # no free room holds more than this (known after a miss)
    for need, deadline in queued:
        fit = _first_fit(need, names, free) if need <= bound else None
        if fit is not None:
            asks[fit][0] += need
            asks[fit][1] += 1
            _head(heads, fit, need, deadline)
            continue
        rest.append(need)
        if first is None or deadline < first[0]:
            first = (deadline, need)
        if need <= bound:  # searched and missed: the largest free room left
            bound = max((f[0] for r in names if (f := free[r])[1] >= 1), default=0)
    return rest, first


def _spread(
    order: list[PoolDemand],
    free: dict[str, list[float]],
    asks: dict[str, list[int]],
    left: dict[str, list[int]],
) -> None:
    """Spread the needs no free room holds whole (`left`, per model) over the replicas
    in `order`: first over their free room left, then up to each pool and running
    limit, as many requests of a replica as the tokens asked of it hold (at the mean)."""
    tokens = {m: sum(rest) for m, rest in left.items()}
    count = {m: len(rest) for m, rest in left.items()}
    mean = {m: tokens[m] / count[m] for m in left if count[m]}
    for free_only in (True, False):
        for d in order:
            asked, n = asks[d.replica]
            if free_only:
                room, slots = free[d.replica]
            else:
                room = d.effective - d.reserved - asked
                limit = d.running_limit
                slots = math.inf if limit is None else limit - d.running - n
            for m in d.models:
                if tokens.get(m, 0) <= 0 or room <= 0 or slots <= 0:
                    continue
                take = int(min(tokens[m], room, slots * mean[m]))
                k = min(count[m], max(1, math.ceil(take / mean[m])))  # the requests it holds
                asked += take
                n += k
                tokens[m] -= take
                count[m] -= k
                room -= take
                slots -= k
            asks[d.replica] = [asked, n]
