"""The lease loop (`gateway.state.sharing.StateSync`) over two admission controllers, as two
gateway processes would run it, on both backends: slices follow demand and never sum
past the pool; learned limits are shared; an unreachable backend cuts each slice to 1/N
(fail-open) or closes the gate (fail-closed); a backend that comes back is rebuilt from
each process's own holdings."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence

import pytest

from admission.config import AdmissionConfig
from admission.controller import AdmissionController
from admission.learned.patience import ClientEnd
from admission.lease import HolderRecord, LeaseRequest, RenewResult, SharedLimit, SharedPatience
from admission.tenants import TenantConfig, TenantLimiter
from admission.types import AdmissionRequest, Admit, AttemptEnd, RequestEnd, Shed
from gateway.config import StateConfig
from gateway.door import AdmissionDoor
from gateway.state import MemoryBackend, StateBackend, StateUnavailable
from gateway.state.redis import RedisBackend
from gateway.state.sharing import StateSync
from routing.scheduler import default_profile
from tests.admission.helpers import replica, request
from tests.state.conftest import RedisServer, free_port

POOL = 1000


def ctrl(**overrides: object) -> AdmissionController:
    settings: dict[str, object] = {"headroom": 0.0, "learn_limit": False}
    settings.update(overrides)
    c = AdmissionController(AdmissionConfig(**settings), default_profile(seed=3), seed=3)
    c.upsert_replica(replica("r1", POOL, max_running=10), 0.0)
    return c


@pytest.fixture(params=["memory", "redis"])
async def backend(request: pytest.FixtureRequest, prefix: str) -> AsyncIterator[StateBackend]:
    if request.param == "memory":
        yield MemoryBackend()
        return
    b = RedisBackend(request.getfixturevalue("redis_url"), prefix=prefix)
    try:
        yield b
    finally:
        await b.close()


def sync(
    backend: StateBackend,
    c: AdmissionController,
    name: str,
    tenants: TenantLimiter | None = None,
    **cfg: object,
) -> StateSync:
    config = StateConfig(lease_ttl_s=5.0, renew_interval_s=0.5, **cfg)  # type: ignore[arg-type]
    return StateSync(config, backend, AdmissionDoor(c), holder=name, tenants=tenants)


async def queue(s: StateSync, req: AdmissionRequest) -> asyncio.Task[object]:
    """Submit through the process's door, as a request handler does; the task ends with
    the verdict once the request leaves the queue."""
    task = asyncio.create_task(s.door.admit(req))
    await asyncio.sleep(0)
    assert s.report.queue_depth() > 0
    return task  # type: ignore[return-value]


def shares(*cs: AdmissionController) -> list[int | None]:
    out = []
    for c in cs:
        d = c.report.pool_demand("r1")
        assert d is not None
        out.append(d.share_tokens)
    return out


async def test_slices_follow_demand_and_never_sum_past_the_pool(backend: StateBackend) -> None:
    a, b = ctrl(), ctrl()
    sa, sb = sync(backend, a, "a"), sync(backend, b, "b")
    await sa.renew()
    assert shares(a) == [POOL]  # alone: the whole pool
    await sb.renew()
    await sa.renew()
    await sb.renew()
    assert shares(a, b) == [500, 500]  # both idle: an equal split
    # a gets busy: 400 admitted, 600 more queued behind its slice.
    assert isinstance(sa.door.submit(request("x", 200, 200), 0.0), Admit)
    y = await queue(sa, request("y", 300, 300))
    await sa.renew()
    await sb.renew()
    await sa.renew()
    sa_share, sb_share = shares(a, b)
    assert sa_share is not None and sb_share is not None
    assert sa_share + sb_share <= POOL
    assert sa_share == POOL  # b wants nothing: a may use the whole pool
    assert isinstance((await y)[0], Admit)  # admitted by the grown slice
    # b gets a request while a still runs: b waits, as a's running requests hold it all...
    z = await queue(sb, request("z", 200, 200))
    for s in (sb, sa, sb):
        await s.renew()
        assert sum(s or 0 for s in shares(a, b)) <= POOL
    assert not z.done()
    # ...and once they end, the slices rebalance within a renewal each.
    sa.door.request_ended(RequestEnd("x"))
    sa.door.request_ended(RequestEnd("y"))
    for s in (sa, sb):
        await s.renew()
    assert isinstance((await z)[0], Admit)
    assert sum(s or 0 for s in shares(a, b)) <= POOL
    sb.door.request_ended(RequestEnd("z"))


async def test_learned_limits_are_shared(backend: StateBackend) -> None:
    a = ctrl(learn_limit=True, initial_limit=2)
    b = ctrl(learn_limit=True, initial_limit=2)
    sa, sb = sync(backend, a, "a"), sync(backend, b, "b")
    await sa.renew()
    await sb.renew()
    la, lb = a.report.limit_of("r1"), b.report.limit_of("r1")
    assert la is not None and lb is not None
    la.adopt(6.0, 1.0, "probe")  # as if a learned it
    await sa.renew()  # publishes
    await sb.renew()  # adopts
    assert (lb.value, lb.reason) == (6.0, "probe")
    c = ctrl(learn_limit=True, initial_limit=2)  # a new process seeds from the shared
    sc = sync(backend, c, "c")
    await sc.renew()
    lc = c.report.limit_of("r1")
    assert lc is not None and lc.value == 6.0
    # The learned limit is the fleet's, not sliced (only the cap of 10 is): a process
    # may run what the others left of it at their last renewal.
    for i in range(4):
        assert isinstance(a.submit(request(f"a{i}", 10, 10), 2.0).verdict, Admit)
    await sa.renew()
    await sb.renew()
    assert sb.snapshot()["replicas"]["r1"]["others_running"] == 4  # type: ignore[index]
    verdicts = [b.submit(request(f"b{i}", 10, 10), 2.0).verdict for i in range(3)]
    assert [isinstance(v, Admit) for v in verdicts] == [True, True, False]
    b.release("b2", 2.0)  # out of the queue
    for x, ids in ((a, ["a0", "a1", "a2", "a3"]), (b, ["b0", "b1"])):
        for rid in ids:
            x.release(rid, 3.0)


def leave_at(s: StateSync, waited: float, n: int = 3) -> None:
    """`n` clients that stated no timeout, of tenant "default" and model "m", left
    together after `waited` seconds (one configured timeout: admission/learned/patience.py)."""
    for i in range(n):
        gone = AttemptEnd(request(f"gone{i}"), 0.0, patience=ClientEnd(waited, True))
        s.door.attempt_ended(gone)


@pytest.mark.slow  # a queued request shed by a learned patience, in real time
async def test_learned_patience_is_shared_and_outlives_the_process(
    backend: StateBackend,
) -> None:
    """Process a learns that its clients leave at 2 s; process b, which saw none leave,
    takes it at its next round: its queued request that stated nothing is shed within
    the learned budget instead of waiting out the 30 s default queue timeout. A process
    started later (a restart, a worker added) starts from it. What a process learned
    itself wins over the fleet's, and the fleet's is dropped where clients are seen
    waiting longer."""
    a, b = ctrl(), ctrl()
    sa, sb = sync(backend, a, "a"), sync(backend, b, "b")
    for _ in range(2):  # the first holder's whole pool is split at the second round
        await sa.renew()
        await sb.renew()
    # Each holds most of its half of the pool, so b's next request waits whatever the
    # leases grant.
    assert isinstance(sa.door.submit(request("hog-a", 350, 100)), Admit)
    assert isinstance(sb.door.submit(request("hog-b", 350, 100)), Admit)
    sb.door.start()  # deadlines act in time
    waiting = await queue(sb, request("silent", 300, 100))  # states nothing
    leave_at(sa, 2.0)
    assert [r.patience_s for r in a.report.patience_readings()] == [pytest.approx(2.0)]
    await sa.renew()  # publishes
    await sb.renew()  # adopts
    (seen,) = b.report.patience_readings()
    assert (seen.patience_s, seen.shared) == (pytest.approx(2.0), True)
    try:
        verdict, _ = await asyncio.wait_for(waiting, timeout=5.0)  # not the 30 s default
    finally:
        await sb.door.stop()
    assert isinstance(verdict, Shed)
    assert 0 < verdict.retry_after <= 2.0

    c = ctrl()  # a process started later
    sc = sync(backend, c, "c")
    await sc.renew()
    (seen,) = c.report.patience_readings()
    assert (seen.patience_s, seen.shared) == (pytest.approx(2.0), True)

    leave_at(sc, 5.0)  # c's own clients wait longer: its own estimate wins there
    assert [r.patience_s for r in c.report.patience_readings()] == [pytest.approx(5.0)]
    await sc.renew()
    assert [r.patience_s for r in c.report.patience_readings()] == [pytest.approx(5.0)]

    # b's own clients are seen staying far past the fleet's 2 s: b drops it, as it
    # would drop a budget it had learned itself.
    for i in range(10):
        stayed = AttemptEnd(request(f"stayed{i}"), 0.0, patience=ClientEnd(20.0, False))
        sb.door.attempt_ended(stayed)
    (seen,) = b.report.patience_readings()
    assert (seen.patience_s, seen.shared, seen.observed) == (None, False, 10)


async def three_with_one_busy(
    server: RedisServer, prefix: str
) -> tuple[list[RedisBackend], list[AdmissionController], list[StateSync]]:
    """Three processes on `server`'s Redis, p0 running 350 of the pool (two requests, the
    second admitted once a renewal grew its slice)."""
    backends = [RedisBackend(server.url, prefix=prefix, timeout_s=0.3) for _ in range(3)]
    cs = [ctrl() for _ in range(3)]
    syncs = [sync(b, c, f"p{i}") for i, (b, c) in enumerate(zip(backends, cs, strict=True))]
    for _ in range(2):
        for s in syncs:
            await s.renew()
    assert all(s.up and s.processes == 3 for s in syncs)
    assert isinstance(syncs[0].door.submit(request("busy", 150, 150), 0.0), Admit)
    more = await queue(syncs[0], request("more", 200, 200))
    for _ in range(2):
        for s in syncs:
            await s.renew()
    assert isinstance((await more)[0], Admit)
    return backends, cs, syncs


async def test_fail_open_cuts_each_slice_to_one_nth(prefix: str) -> None:
    server = RedisServer()
    server.start()
    try:
        backends, cs, syncs = await three_with_one_busy(server, prefix)  # p0 holds most
        server.stop()
        for s in syncs:
            await s.renew()
        assert not any(s.up for s in syncs)
        assert all(s.errors == 1 for s in syncs)
        got = shares(*cs)
        assert all(g is not None and g <= POOL // 3 for g in got)
        assert sum(g or 0 for g in got) <= POOL
        # What p0 already runs stays; nothing more is admitted there meanwhile.
        late = await queue(syncs[0], request("late", 10, 10))
        # Redis returns empty: leases are rebuilt from each process's holdings.
        server.start()
        syncs[0].door.request_ended(RequestEnd("busy"))
        for _ in range(2):
            for s in syncs:
                await s.renew()
        assert all(s.up for s in syncs)
        await syncs[0].renew()  # reports what the last renewal admitted
        held = await backends[1].holders("pool:r1")
        assert sorted(held) == ["p0", "p1", "p2"]
        assert held["p0"].used == cs[0].report.reserved_tokens("r1")
        assert sum(max(h.granted, h.used) for h in held.values()) <= POOL
        assert isinstance((await late)[0], Admit)
        for rid in ("more", "late"):
            syncs[0].door.request_ended(RequestEnd(rid))
        for b in backends:
            await b.close()
    finally:
        server.stop()


async def test_fail_closed_answers_503_until_redis_answers(prefix: str) -> None:
    port = free_port()
    c = ctrl()
    s = sync(
        RedisBackend(f"redis://127.0.0.1:{port}/0", prefix=prefix, timeout_s=0.3),
        c,
        "a",
        on_unreachable="fail-closed",
    )
    await s.renew()
    err = s.gate()
    assert err is not None and err.status == 503 and err.retry_after is not None
    assert shares(c) == [None]  # fail-closed leaves the slices alone: nothing is admitted
    server = RedisServer(port)
    server.start()
    try:
        await s.renew()
        assert s.up and s.gate() is None
        await s.stop()
    finally:
        server.stop()


async def test_fail_open_never_seen_uses_the_workers_hint(prefix: str) -> None:
    c = ctrl()
    config = StateConfig(lease_ttl_s=5.0, renew_interval_s=0.5)
    s = StateSync(
        config,
        RedisBackend(f"redis://127.0.0.1:{free_port()}/0", prefix=prefix, timeout_s=0.3),
        AdmissionDoor(c),
        workers_hint=4,
    )
    await s.renew()
    assert s.gate() is None
    assert shares(c) == [POOL // 4]
    d = c.report.pool_demand("r1")
    assert d is not None and d.share_running == 10 // 4


async def test_tenant_fractions_follow_demand_and_sum_to_at_most_one(
    backend: StateBackend,
) -> None:
    cfg = [TenantConfig(name="t", rpm=600)]
    limiters = [TenantLimiter.from_config(cfg) for _ in range(3)]
    cs = [ctrl() for _ in range(3)]
    syncs = [
        sync(backend, c, f"p{i}", lim) for i, (c, lim) in enumerate(zip(cs, limiters, strict=True))
    ]
    for _ in range(5):
        for s in syncs:
            await s.renew()
    fractions = [lim.get("t").share for lim in limiters]
    assert sum(fractions) <= 1.0 + 1e-9
    assert all(abs(f - 1 / 3) < 0.01 for f in fractions), fractions  # idle: an equal split
    # p0 spends its whole fraction: its lease grows, the idle ones' shrink.
    loop = asyncio.get_running_loop()
    for _ in range(6):
        st = limiters[0].get("t")
        assert st.rpm is not None
        while st.rpm.wait(1, loop.time()) == 0:
            limiters[0].charge("t", 0, loop.time())
        for s in syncs:
            await s.renew()
        fractions = [lim.get("t").share for lim in limiters]
        assert sum(fractions) <= 1.0 + 1e-9
        assert all(f > 0 for f in fractions), fractions
    assert fractions[0] > 0.6 and all(f >= 1 / 12 - 0.01 for f in fractions[1:]), fractions


async def test_a_tenant_concurrency_in_use_draws_its_fraction(backend: StateBackend) -> None:
    cfg = [TenantConfig(name="t", max_concurrent=8)]
    limiters = [TenantLimiter.from_config(cfg) for _ in range(2)]
    cs = []
    for lim in limiters:
        c = AdmissionController(
            AdmissionConfig(headroom=0.0, learn_limit=False),
            default_profile(seed=3),
            seed=3,
            tenants=lim.tenants.get,
        )
        c.upsert_replica(replica("r1", 100_000, max_running=100), 0.0)
        cs.append(c)
    syncs = [
        sync(backend, c, f"p{i}", lim) for i, (c, lim) in enumerate(zip(cs, limiters, strict=True))
    ]
    for _ in range(3):
        for s in syncs:
            await s.renew()
    assert [lim.get("t").max_concurrent for lim in limiters] == [4, 4]
    # p0 runs its four; more wait: its fraction grows, p1's (idle) shrinks.
    for i in range(4):
        req = dataclasses.replace(request(f"a{i}", 10, 10), tenant="t")
        assert isinstance(syncs[0].door.submit(req, 0.0), Admit)
    for _ in range(4):
        for s in syncs:
            await s.renew()
    got = [lim.get("t").max_concurrent for lim in limiters]
    assert got[0] is not None and got[1] is not None
    assert got[0] > 4 and got[0] + got[1] <= 8, got
    for i in range(4):
        syncs[0].door.request_ended(RequestEnd(f"a{i}"))


async def test_a_request_larger_than_an_idle_split_grows_its_share(backend: StateBackend) -> None:
    """Three idle processes split a tenant's tpm equally; a request larger than one third
    (but within the total) is refused here for the share alone, with a wait of a couple
    of renewals, not a minute: its cost is demand, the next renewals grow this process's
    share to hold it, and then it passes. The shares never sum past the total."""
    cfg = [TenantConfig(name="t", tpm=3000)]
    limiters = [TenantLimiter.from_config(cfg) for _ in range(3)]
    cs = [ctrl() for _ in range(3)]
    syncs = [
        sync(backend, c, f"p{i}", lim) for i, (c, lim) in enumerate(zip(cs, limiters, strict=True))
    ]
    for _ in range(5):
        for s in syncs:
            await s.renew()
    split = [lim.get("t").share for lim in limiters]
    assert all(abs(f - 1 / 3) < 0.01 for f in split), split  # idle: an equal split
    loop = asyncio.get_running_loop()
    st = limiters[0].get("t")
    assert st.tpm is not None
    wait = st.tpm.wait(1500, loop.time())  # half the total: over a third
    assert 0 < wait <= 1.0  # two renewals of 0.5 s, not the 60 s window
    assert st.tpm.wait(1500, loop.time()) > 0
    for _ in range(3):
        for s in syncs:
            await s.renew()
    fractions = [lim.get("t").share for lim in limiters]
    assert sum(fractions) <= 1.0 + 1e-9, fractions
    assert fractions[0] >= 0.5, fractions
    assert st.tpm.wait(1500, loop.time()) == 0  # it passes now
    # The demand lasts while the client is expected back, then goes.
    assert st.tpm.demand(loop.time()) == 0.5
    assert st.tpm.demand(loop.time() + 60.0) == 0.0


class _SwallowsOneCancel(MemoryBackend):
    """A backend whose renewal, once armed, loses the cancellation that lands in it (as a
    client library's timeout handling can) and then answers."""

    def __init__(self, then_hang: bool = False) -> None:
        super().__init__()
        self.armed = False
        self.then_hang = then_hang  # after losing it, wait for ever (an answer never comes)
        self.stuck: asyncio.Task[object] | None = None
        self.in_renew = asyncio.Event()
        self.swallowed = False
        self.released = False
        self.renewals_after_release = 0

    async def renew(
        self, holder: str, requests: Sequence[LeaseRequest], ttl_s: float
    ) -> RenewResult:
        if self.released:
            self.renewals_after_release += 1
        if self.armed and not self.in_renew.is_set():
            self.in_renew.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.swallowed = True  # lost: the caller goes on as if nothing happened
            if self.then_hang:
                self.stuck = asyncio.current_task()
                await asyncio.Event().wait()
        return await super().renew(holder, requests, ttl_s)

    async def release(self, holder: str, resources: Sequence[str] | None = None) -> None:
        self.released = True
        await super().release(holder, resources)


@pytest.mark.slow  # a stop bounded in real time
async def test_a_stop_whose_cancellation_is_lost_still_ends_the_loop_and_returns_the_leases() -> (
    None
):
    backend = _SwallowsOneCancel()
    s = sync(backend, ctrl(), "a", timeout_s=0.2)
    await s.start()
    assert await backend.holders("pool:r1")
    backend.armed = True
    await asyncio.wait_for(backend.in_renew.wait(), 5)  # the loop's next round is in renew
    stopping = asyncio.create_task(s.stop())
    done, _ = await asyncio.wait({stopping}, timeout=5)  # not wait_for: its cancel ends it
    assert done, "the stop hangs on a lease loop that lost its cancellation"
    assert backend.swallowed and backend.released
    assert await backend.holders("pool:r1") == {}
    await asyncio.sleep(0.6)  # the loop, had it gone on, would have renewed by now
    assert backend.renewals_after_release == 0
    assert await backend.holders("pool:r1") == {}


@pytest.mark.slow  # a stop bounded in real time
async def test_a_stop_whose_lease_loop_never_answers_is_bounded() -> None:
    """Issue 19 item 4: the lease loop lost its cancellation and its renewal never
    answers. The stop waits for it at most two backend timeouts, then returns the leases."""
    backend = _SwallowsOneCancel(then_hang=True)
    s = sync(backend, ctrl(), "a", timeout_s=0.2)
    await s.start()
    backend.armed = True
    await asyncio.wait_for(backend.in_renew.wait(), 5)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    stopping = asyncio.create_task(s.stop())
    done, _ = await asyncio.wait({stopping}, timeout=5)
    assert done, "the stop hangs on a lease loop whose renewal never answers"
    assert loop.time() - t0 < 1.0  # two backend timeouts (0.4 s) and the release
    assert backend.swallowed and backend.released
    assert await backend.holders("pool:r1") == {}
    assert backend.stuck is not None and not backend.stuck.done()
    backend.stuck.cancel()  # the test's own cleanup: this cancellation is not lost
    await asyncio.wait({backend.stuck}, timeout=1)


class LateAnswers(StateBackend):
    """A real backend whose renewals, once `late`, are applied and then time out at the
    caller (a loaded process, a slow network): the caller cannot tell what it was granted."""

    name = "late"

    def __init__(self, inner: StateBackend) -> None:
        self.inner = inner
        self.late = False

    async def renew(
        self, holder: str, requests: Sequence[LeaseRequest], ttl_s: float
    ) -> RenewResult:
        result = await self.inner.renew(holder, requests, ttl_s)
        if self.late:
            raise StateUnavailable("timed out")
        return result

    async def release(self, holder: str, resources: Sequence[str] | None = None) -> None:
        await self.inner.release(holder, resources)

    async def holders(self, resource: str) -> dict[str, HolderRecord]:
        return await self.inner.holders(resource)

    async def publish_limit(self, replica: str, value: float, reason: str) -> int:
        return await self.inner.publish_limit(replica, value, reason)

    async def limits(self) -> dict[str, SharedLimit]:
        return await self.inner.limits()

    async def publish_patience(self, population: str, seconds: float, whole: bool) -> int:
        return await self.inner.publish_patience(population, seconds, whole)

    async def patiences(self) -> dict[str, SharedPatience]:
        return await self.inner.patiences()

    async def put_response(self, response_id: str, replica: str, tokens: int, ttl_s: float) -> None:
        await self.inner.put_response(response_id, replica, tokens, ttl_s)

    async def response(self, response_id: str) -> tuple[str, int] | None:
        return await self.inner.response(response_id)


class SlowAnswers(LateAnswers):
    """A real backend whose renewals, while `gate` is closed, are applied at once and
    answered only when it opens (a round trip under way)."""

    def __init__(self, inner: StateBackend) -> None:
        super().__init__(inner)
        self.gate: asyncio.Event | None = None

    async def renew(
        self, holder: str, requests: Sequence[LeaseRequest], ttl_s: float
    ) -> RenewResult:
        result = await self.inner.renew(holder, requests, ttl_s)
        if self.gate is not None:
            await self.gate.wait()
        return result


async def test_a_renewal_under_way_admits_only_what_it_reported(backend: StateBackend) -> None:
    """The backend grants the others what a renewal does not report held, before its
    answer is back: a request admitted under the old slice meanwhile could take what they
    were just granted (a cap of 4 ran 5 in tests/state/test_processes.py). It waits for
    the answer instead."""
    slow = SlowAnswers(backend)
    a, b = ctrl(), ctrl()
    sa, sb = sync(slow, a, "a"), sync(backend, b, "b")
    for s in (sa, sb, sa, sb):
        await s.renew()
    assert shares(a, b) == [500, 500]
    assert isinstance(sa.door.submit(request("x", 100, 100), 0.0), Admit)
    z = await queue(sb, request("z", 350, 350))  # 700: past b's slice
    await sb.renew()  # b asks for it; a's grant shrinks at its next renewal
    slow.gate = asyncio.Event()
    renewal = asyncio.create_task(sa.renew())  # reports a's 200 held
    await asyncio.sleep(0.01)
    assert not renewal.done()
    assert shares(a) == [200]
    y = await queue(sa, request("y", 150, 150))  # 300: within a's old slice of 500
    await sb.renew()  # b is granted what a did not report: 800
    assert isinstance((await z)[0], Admit)
    assert not y.done()  # admitted, a and b would hold 1,200 of 1,000
    slow.gate.set()
    await renewal
    held = [c.report.pool_demand("r1").reserved for c in (a, b)]  # type: ignore[union-attr]
    assert sum(held) <= POOL, held
    b.release("z", 1.0)
    for s in (sb, sa):
        await s.renew()
    assert isinstance((await y)[0], Admit)
    for rid in ("x", "y"):
        a.release(rid, 1.0)


async def test_a_late_renewal_lets_nothing_past_the_running_cap(
    redis_url: str, prefix: str
) -> None:
    """Three processes, the replica's cap of 10 all leased to a busy one. A renewal of an
    idle one that Redis applied but whose answer came too late is no outage: its
    records still stand, so it admits nothing the others may hold (before: fail-open's
    floor of one request, 11 running against a cap of 10)."""
    backends = [LateAnswers(RedisBackend(redis_url, prefix=prefix)) for _ in range(3)]
    cs = [ctrl() for _ in range(3)]
    syncs = [sync(b, c, f"p{i}") for i, (b, c) in enumerate(zip(backends, cs, strict=True))]
    try:
        for _ in range(2):
            for s in syncs:
                await s.renew()
        busy = [
            asyncio.create_task(syncs[0].door.admit(request(f"b{i}", 10, 10))) for i in range(10)
        ]
        await asyncio.sleep(0)
        for _ in range(2):
            for s in syncs:
                await s.renew()
        assert all(isinstance(v[0], Admit) for v in await asyncio.gather(*busy))
        assert [c.report.pool_demand("r1").share_running for c in cs] == [10, 0, 0]  # type: ignore[union-attr]
        backends[1].late = True
        waiting = await queue(syncs[1], request("late", 10, 10))
        await syncs[1].renew()
        await asyncio.sleep(0)
        assert not syncs[1].up
        running = [c.report.pool_demand("r1").running for c in cs]  # type: ignore[union-attr]
        assert sum(running) <= 10, running
        assert not waiting.done()
        # Its answers come back: the request is admitted once the busy one's slice frees.
        backends[1].late = False
        for i in range(10):
            syncs[0].door.request_ended(RequestEnd(f"b{i}"))
        for s in (syncs[0], syncs[1], syncs[0], syncs[1]):
            await s.renew()
        assert syncs[1].up and isinstance((await waiting)[0], Admit)
        syncs[1].door.request_ended(RequestEnd("late"))
    finally:
        for s in syncs:
            await s.stop()


def test_a_shared_limit_grows_on_the_fleets_evidence() -> None:
    """Two processes share a replica half and half (the lease loop reports the other's
    running as `others`). Each sees half the replica's completions, so each closes a
    window on half the evidence one process alone would need: the shared limit grows as
    fast as a lone process's (before, each needed a whole window of its own: a fleet of
    two took twice the completions per doubling, and the shared_pool bench's warm-up ran
    at half the concurrency)."""
    from admission.learned.limit import LimitSettings, RunningLimit

    def completions_to_grow(others: int) -> int:
        lim = RunningLimit(LimitSettings(initial=8, window=16))
        lim.others = others
        lim.running_changed(8 - others, 0.0)
        for n in range(1, 100):
            # Past half the latency aim: slow start adds nothing for them, and its first
            # window (half a window of evidence) ends it and probes.
            lim.completed(n, n - 0.5, ok=True, ratio=(0.6, None), cap=None)
            if lim.value > 8:
                return n
        raise AssertionError("the limit never grew")

    alone = completions_to_grow(0)
    assert alone == 9  # slow start's half window of 8 completions, and one more
    assert completions_to_grow(4) <= (alone + 1) // 2 + 1  # half the load, half the evidence


async def test_a_restarted_redis_costs_no_failed_renewal(prefix: str) -> None:
    """The pool's connections to a Redis that restarted are stale: each failed once on
    its first use, so a process logged the outage again after 'reachable again' (the
    fail-open restart test counted two). A stale connection is retried once, at once."""
    server = RedisServer()
    server.start()
    backend = RedisBackend(server.url, prefix=prefix, timeout_s=0.5)
    try:
        # Two pooled connections: two calls at once.
        await asyncio.gather(backend.renew("a", [], 3.0), backend.holders("pool:r1"))
        server.stop()
        server.start()
        for _ in range(3):  # every pooled connection is used again
            await asyncio.gather(backend.renew("a", [], 3.0), backend.holders("pool:r1"))
    finally:
        await backend.close()
        server.stop()


async def test_a_redis_that_restarted_between_two_renewals_is_rebuilt_within_one_nth(
    prefix: str,
) -> None:
    """No renewal failed, so nothing said 'outage': the first process back on the empty
    Redis saw no other holder and took the whole pool while p0 still ran 350 of it."""
    server = RedisServer()
    server.start()
    try:
        backends, cs, syncs = await three_with_one_busy(server, prefix)
        server.stop()
        server.start()  # empty, and back before any renewal noticed
        for s in reversed(syncs):  # the idle ones first
            await s.renew()
        assert all(s.up and s.errors == 0 for s in syncs)
        got = shares(*cs)
        assert all(g is not None and g <= POOL // 3 for g in got), got
        assert cs[0].report.reserved_tokens("r1") + sum(g or 0 for g in got[1:]) <= POOL
        held = await backends[1].holders("pool:r1")
        assert sorted(held) == ["p0", "p1", "p2"]
        for rid in ("busy", "more"):
            syncs[0].door.request_ended(RequestEnd(rid))
        for b in backends:
            await b.close()
    finally:
        server.stop()


def four_processes_on_eight_replicas(
    max_running: int,
) -> tuple[list[AdmissionController], list[StateSync]]:
    """Four processes on one backend, each with eight replicas of 1,000 tokens."""
    backend = MemoryBackend()
    cs = []
    for _ in range(4):
        c = AdmissionController(
            AdmissionConfig(headroom=0.0, learn_limit=False), default_profile(seed=3), seed=3
        )
        for k in range(8):
            c.upsert_replica(replica(f"r{k}", 1000, max_running=max_running), 0.0)
        cs.append(c)
    return cs, [sync(backend, c, f"p{i}") for i, c in enumerate(cs)]


async def each_starts_one_of_400(syncs: list[StateSync]) -> None:
    """A request of 400 queued in each process starts within three renewal rounds (the
    others' slices there shrink as each renews)."""
    waiting = [await queue(s, request(f"q{i}", 300, 100)) for i, s in enumerate(syncs)]
    for _ in range(3):
        for s in syncs:
            await s.renew()
    await asyncio.sleep(0)  # the admitted requests' handlers take their verdicts
    verdicts = [t.result()[0] if t.done() else None for t in waiting]
    assert all(isinstance(v, Admit) for v in verdicts), verdicts
    for i, s in enumerate(syncs):
        s.door.request_ended(RequestEnd(f"q{i}"))


async def test_queues_are_asked_of_some_replicas_not_split_over_all() -> None:
    """Four processes, eight replicas of 1,000 tokens, one request of 400 queued in each.
    Each asked every replica for its whole queue: every pool went four ways, in slices of
    250 that held no request, and nothing started (bench/fleet_vt.py at ten gateways)."""
    cs, syncs = four_processes_on_eight_replicas(max_running=10)
    for _ in range(2):  # idle: each holds a quarter of every pool
        for s in syncs:
            await s.renew()
    assert shares(*cs) == [250] * 4
    await each_starts_one_of_400(syncs)


async def test_a_running_limit_smaller_than_the_processes_is_asked_where_the_queue_is() -> None:
    """Four processes, eight replicas of 1,000 tokens running at most two each, one
    request of 400 queued in each process. Each asked every replica for a running slot
    per queued request while it asked its tokens of some: every limit went to the same
    two processes by the grant's tie order, and the other two held pool slices where they
    had no slot and started nothing (bench/fleet_vt.py with engines at twenty gateways).
    Asked where its tokens are asked, each process starts its request."""
    cs, syncs = four_processes_on_eight_replicas(max_running=2)
    for _ in range(2):  # idle: two slots four ways, none each
        for s in syncs:
            await s.renew()
    await each_starts_one_of_400(syncs)


async def test_a_queued_request_is_asked_whole_of_one_free_room_not_in_pieces() -> None:
    """Another process holds 700 of r0's 1,000 tokens and 500 of r1's; a request of 450
    queues here. Spread over the free rooms in this process's order (r0 first), it was
    asked 300 of r0 and 150 of r1, and neither slice grew to hold it (fleet_vt at 20
    gateways x 10 replicas: a request queued 10 s until its client left). Asked whole of
    r1, whose free 500 holds it, it starts at the next renewal."""
    backend = MemoryBackend()
    held = [LeaseRequest("pool:r0", 1000, 700, 700), LeaseRequest("pool:r1", 1000, 500, 500)]
    await backend.renew("other", held, 60.0)
    c = AdmissionController(
        AdmissionConfig(headroom=0.0, learn_limit=False), default_profile(seed=3), seed=3
    )
    for name in ("r0", "r1"):
        c.upsert_replica(replica(name, 1000, max_running=10), 0.0)
    here = next(
        s
        for k in range(100)
        if (s := sync(backend, c, f"p{k}"))._rank("r0") < s._rank("r1")  # r0 asked first
    )
    await here.renew()  # idle: learns what the other process uses
    waiting = await queue(here, request("q", 300, 150))
    for _ in range(3):  # the other process renews too: its slice gives way to what is asked
        await here.renew()
        await backend.renew("other", held, 60.0)
    await here.renew()
    await asyncio.sleep(0)
    assert waiting.done() and isinstance(waiting.result()[0], Admit)
    here.door.request_ended(RequestEnd("q"))


async def test_where_an_equal_split_holds_no_queued_request_the_heads_start_in_turn(
    backend: StateBackend,
) -> None:
    """Three processes on one replica of 1,000 tokens with requests of 400 queued (one in
    the first, two in the others): split three ways (333 each) the pool held none of
    them, and nothing started while it stood empty. Each names the request it has due
    first as its head: the two due first of all start, whole, and when one ends the next
    due of all starts (the third process's, before the second's second)."""
    cs = [ctrl() for _ in range(3)]
    syncs = [sync(backend, c, f"p{i}") for i, c in enumerate(cs)]
    for _ in range(2):
        for s in syncs:
            await s.renew()
    now = asyncio.get_running_loop().time()
    due = {"q00": 100.0, "q10": 110.0, "q20": 120.0, "q11": 140.0, "q21": 150.0}
    waiting = {}
    for rid, d in due.items():
        waiting[rid] = await queue(syncs[int(rid[1])], request(rid, 300, 100, deadline=now + d))

    async def rounds() -> list[str]:
        for _ in range(3):
            for s in syncs:
                await s.renew()
        await asyncio.sleep(0)
        return sorted(
            r for r, t in waiting.items() if t.done() and isinstance(t.result()[0], Admit)
        )

    assert await rounds() == ["q00", "q10"]
    assert sum(shares(*cs)) <= POOL  # type: ignore[arg-type]
    syncs[0].door.request_ended(RequestEnd("q00"))
    assert await rounds() == ["q00", "q10", "q20"]  # q20 is due before q11
    for rid in ("q10", "q20"):
        syncs[int(rid[1])].door.request_ended(RequestEnd(rid))
    for rid in ("q11", "q21"):
        waiting[rid].cancel()


class _Clock:
    """A loop whose time is set by the test (StateSync reads only `time`)."""

    def __init__(self) -> None:
        self.now = 0.0

    def time(self) -> float:
        return self.now


async def test_patience_is_shared_once_an_interval_while_a_queue_stands() -> None:
    """A standing queue brings a renewal every 50 ms; the interval's rounds (which share
    client patience) still come every interval. Timed from the last round of any kind,
    no interval ever passed and patience went unshared under overload."""
    c = ctrl()
    clock = _Clock()
    s = StateSync(
        StateConfig(lease_ttl_s=5.0, renew_interval_s=0.5),
        MemoryBackend(clock=clock.time),
        AdmissionDoor(c),
        holder="p",
        loop=clock,  # type: ignore[arg-type]
    )
    assert isinstance(c.submit(request("big", 800, 100), 0.0).verdict, Admit)
    c.submit(request("waits", 800, 100), 0.0)
    assert c.report.queue_depth() == 1
    rounds: list[tuple[float, bool]] = []
    for k in range(41):  # two seconds of the loop's 50 ms ticks
        clock.now = k * 0.05
        due = s.renewal_due(clock.now)
        if due is not None:
            await s.renew(patience=due)
            rounds.append((clock.now, due))
    interval = [round(t, 2) for t, due in rounds if due]
    assert interval == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert len(rounds) - len(interval) >= 20  # and the early ones between them
    c.release("big", 2.0)
    c.release("waits", 2.0)
