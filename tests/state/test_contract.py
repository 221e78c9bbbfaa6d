"""One contract, two backends: the lease arithmetic, TTL expiry, release, heartbeats and
shared limits behave the same on `MemoryBackend`, on a real Redis (`RedisBackend`) and on
a real Redis Cluster of three nodes.

Expiry is driven by each backend's clock: the memory backend's is advanced by hand, the
Redis server's is real, so the Redis runs use a short TTL and wait for the condition."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
import redis

from admission.lease import grant
from gateway.state import LeaseRequest, MemoryBackend, StateBackend, StateUnavailable
from gateway.state.redis import RedisBackend


@dataclass
class Rig:
    backend: StateBackend
    advance: Callable[[float], Awaitable[None]]  # let at least this much backend time pass


@pytest.fixture(params=["memory", "redis", "cluster"])
async def rig(request: pytest.FixtureRequest, prefix: str) -> AsyncIterator[Rig]:
    if request.param == "memory":
        clock = [1000.0]

        async def advance_mem(s: float) -> None:
            clock[0] += s

        yield Rig(MemoryBackend(clock=lambda: clock[0]), advance_mem)
        return
    if request.param == "cluster":  # three nodes; the prefix's slot on any of them
        url = request.getfixturevalue("redis_cluster").url
        backend = RedisBackend(url, cluster=True, prefix=prefix)
    else:
        backend = RedisBackend(request.getfixturevalue("redis_url"), prefix=prefix)

    async def advance_real(s: float) -> None:
        await asyncio.sleep(s)

    try:
        yield Rig(backend, advance_real)
    finally:
        await backend.close()


TTL = 0.3


def req(total: int, want: int, used: int = 0, resource: str = "pool:r0") -> list[LeaseRequest]:
    return [LeaseRequest(resource, total, want, used)]


async def test_a_lone_holder_gets_the_whole(rig: Rig) -> None:
    b = rig.backend
    r = await b.renew("a", req(1000, 300), 10)
    assert r.processes == 1
    assert (r.leases[0].granted, r.leases[0].holders) == (1000, 1)
    r = await b.renew("a", req(1000, 5000), 10)
    assert r.leases[0].granted == 1000


async def test_what_nobody_wants_is_split_equally(rig: Rig) -> None:
    b = rig.backend
    await b.renew("a", req(1000, 100), 10)  # alone: the whole
    assert (await b.renew("b", req(1000, 100), 10)).leases[0].granted == 0  # a holds it all
    assert (await b.renew("a", req(1000, 100), 10)).leases[0].granted == 500
    assert (await b.renew("b", req(1000, 100), 10)).leases[0].granted == 500


async def test_the_sum_of_grants_never_exceeds_the_total(rig: Rig) -> None:
    b = rig.backend
    total = 1000
    wants = {"a": 900, "b": 700, "c": 50}
    for _ in range(4):  # a few rounds of renewals in turn converge
        for h, w in wants.items():
            await b.renew(h, req(total, w), 10)
            held = await b.holders("pool:r0")
            assert sum(max(x.granted, x.used) for x in held.values()) <= total
    held = await b.holders("pool:r0")
    grants = {h: x.granted for h, x in held.items()}
    # c wants less than an equal split and gets it; a and b split the rest equally.
    assert grants == {"a": 475, "b": 475, "c": 50}


async def test_one_busy_holder_uses_most_of_the_pool_while_others_idle(rig: Rig) -> None:
    b = rig.backend
    for _ in range(2):  # the first idle one held the whole until the others came
        await b.renew("idle1", req(1200, 50), 10)
        await b.renew("idle2", req(1200, 50), 10)
        r = await b.renew("busy", req(1200, 5000), 10)
    assert r.leases[0].granted == 1100
    assert r.leases[0].holders == 3


async def test_a_holder_over_its_share_shrinks_and_the_others_grow(rig: Rig) -> None:
    b = rig.backend
    assert (await b.renew("a", req(1000, 1000), 10)).leases[0].granted == 1000
    # b arrives wanting everything: a holds it all, so b gets nothing yet...
    assert (await b.renew("b", req(1000, 1000), 10)).leases[0].granted == 0
    # ...a renews, still using 200, and shrinks to its fair share...
    assert (await b.renew("a", req(1000, 1000, used=200), 10)).leases[0].granted == 500
    # ...and b grows into what a freed.
    assert (await b.renew("b", req(1000, 1000), 10)).leases[0].granted == 500


async def test_use_above_a_shrunk_grant_still_counts(rig: Rig) -> None:
    b = rig.backend
    await b.renew("a", req(1000, 1000), 10)
    await b.renew("b", req(1000, 1000), 10)
    # a still runs 800 tokens of requests admitted under its old grant.
    r = await b.renew("a", req(1000, 1000, used=800), 10)
    assert r.leases[0].granted == 500
    r = await b.renew("b", req(1000, 1000), 10)
    assert r.leases[0].granted == 200  # what a's running requests leave
    assert r.leases[0].others_used == 800


async def test_a_dead_holders_slice_returns_within_the_ttl(rig: Rig) -> None:
    b = rig.backend
    await b.renew("dead", req(1000, 1000), TTL)
    assert (await b.renew("live", req(1000, 1000), 10)).leases[0].granted == 0
    held = await b.holders("pool:r0")
    assert 0 < held["dead"].expires_in_s <= TTL
    await rig.advance(TTL + 0.05)
    r = await b.renew("live", req(1000, 1000), 10)
    assert r.leases[0].granted == 1000
    assert r.processes == 1
    assert set(await b.holders("pool:r0")) == {"live"}


async def test_release_returns_slices_at_once(rig: Rig) -> None:
    b = rig.backend
    await b.renew("a", req(1000, 600) + req(10, 4, resource="run:r0"), 10)
    await b.release("a", ["pool:r0"])
    assert set(await b.holders("pool:r0")) == set()
    assert set(await b.holders("run:r0")) == {"a"}
    await b.release("a")
    assert await b.holders("run:r0") == {}
    assert (await b.renew("b", req(1000, 1000), 10)).processes == 1


async def test_re_registering_is_idempotent(rig: Rig) -> None:
    """A backend rebuilt from each process's own truth counts every slice once."""
    b = rig.backend
    for _ in range(3):
        await b.renew("a", req(1000, 400, used=300), 10)
    held = await b.holders("pool:r0")
    assert list(held) == ["a"]
    assert (held["a"].granted, held["a"].want, held["a"].used) == (1000, 400, 300)


async def test_resources_are_independent(rig: Rig) -> None:
    b = rig.backend
    r = await b.renew(
        "a", req(1000, 2000) + req(8, 3, resource="run:r0") + req(500, 9, resource="pool:r1"), 10
    )
    assert [x.granted for x in r.leases] == [1000, 8, 500]


async def test_a_shrinking_total_grants_nothing_more(rig: Rig) -> None:
    b = rig.backend
    await b.renew("a", req(1000, 600, used=600), 10)
    r = await b.renew("b", req(400, 400), 10)  # b sees a smaller pool than a used
    assert r.leases[0].granted == 0


async def test_shared_limits_carry_the_latest_version(rig: Rig) -> None:
    b = rig.backend
    v1 = await b.publish_limit("r0", 6.5, "probe")
    v2 = await b.publish_limit("r0", 4.0, "latency")
    v3 = await b.publish_limit("r1", 9.0, "latency")
    assert v1 < v2 < v3
    limits = await b.limits()
    assert (limits["r0"].value, limits["r0"].version, limits["r0"].reason) == (4.0, v2, "latency")
    assert limits["r1"].value == 9.0


async def test_shared_patience_carries_the_latest_version_and_its_shape(rig: Rig) -> None:
    """A population's learned client patience: the latest of each, with whether it
    bounds the whole response. Tenant and model names may hold the characters a Redis
    key and a record's text use."""
    b = rig.backend
    key = "team a:b\x1fmeta/llama 3:8b\x1fstream"
    v1 = await b.publish_patience(key, 2.25, True)
    v2 = await b.publish_patience(key, 0.75, False)
    v3 = await b.publish_patience("t\x1fm\x1fwhole", 30.0, True)
    assert v1 < v2 < v3
    shared = await b.patiences()
    assert (shared[key].seconds, shared[key].whole, shared[key].version) == (0.75, False, v2)
    assert (shared["t\x1fm\x1fwhole"].seconds, shared["t\x1fm\x1fwhole"].whole) == (30.0, True)


@pytest.mark.parametrize(
    "total,want,used,others",
    [
        (1000, 300, 0, []),
        (1000, 100, 0, [("o0", 300, 200, 100), ("o1", 100, 50, 50)]),
        (1000, 900, 0, [("o0", 500, 900, 100)]),
        (1000, 100, 0, [("o0", 0, 900, 0), ("o1", 0, 900, 0)]),
        (90, 90, 0, [("o0", 30, 30, 30), ("o1", 10, 60, 40)]),
        (7, 7, 0, [("o0", 2, 7, 2), ("o1", 2, 7, 2), ("o2", 1, 1, 1)]),
        (10, 7, 0, [("o0", 0, 7, 0), ("o1", 0, 7, 0)]),
        (0, 10, 0, [("o0", 0, 5, 0)]),
        # A holder that spent more than its fair part: it refills at what it spent.
        (1000, 1000, 800, [("o0", 100, 1000, 100), ("o1", 100, 1000, 100)]),
        (1000, 1000, 900, [("o0", 300, 1000, 300)]),
    ],
)
async def test_lua_and_python_arithmetic_agree(
    total: int,
    want: int,
    used: int,
    others: list[tuple[str, int, int, int]],
    redis_url: str,
    prefix: str,
) -> None:
    b = RedisBackend(redis_url, prefix=prefix)
    try:
        for i, (_name, g, w, u) in enumerate(others):
            # Write each other holder's record as it stands (granted, want, used).
            key = f"{{{prefix}}}:lease:pool:r0"
            await b._r.hset(key, f"o{i}", f"{g} {w} {u} 99999999999999")
        r = await b.renew("me", req(total, want, used), 10)
        lease = r.leases[0]
        expect = grant(total, want, others, "me", used)
        assert (lease.granted, lease.holders, lease.others_used, lease.rate) == expect
    finally:
        await b.close()


_NAMES = ["a", "b", "mb", "me2", "n", "o1", "o2", "z"]  # on both sides of "me"


_NO_DUE = 2**53  # lease.lua's deadline for a head that has none (ms)


@dataclass
class _Resource:
    """One resource of a random renewal: the ask, the records its hash holds before it,
    the live others and heads as `grant` takes them, and the holder's previous grant."""

    ask: LeaseRequest
    records: dict[str, str]
    others: list[tuple[str, int, int, int]]
    heads: dict[str, tuple[int, float]]
    prev: int


def _random_resource(rng: random.Random, now_ms: int) -> _Resource:
    """Live, expired and the holder's own previous records, now and then one that is no
    record; heads named by some holders (live or expired, of live holders or not), and
    the holder's own head, whose deadlines lie far apart (the script's clock reads a
    moment after the test's)."""
    mode = rng.choice(["small", "crowd", "large"])
    total = rng.randint(0, 12) if mode != "large" else rng.choice([0, rng.randint(1, 20_000)])
    top = total + 1 if mode == "large" else 4
    crowd = rng.randint(0, 12)  # a want shared by most holders: their order is the ties'

    def v() -> int:
        return rng.randint(0, top)

    def w() -> int:
        return crowd if mode == "crowd" and rng.random() < 0.8 else v()

    def held() -> int:  # little held in a crowd, so that the grant is the entitlement
        return rng.randint(0, 2) if mode == "crowd" else v()

    def due() -> int:  # ms on the server's clock, 1,000 s apart, or none
        return rng.choice([_NO_DUE, now_ms + 10**6 * rng.randint(1, 4)])

    live, expired = str(now_ms + 10**7), rng.choice(["1", str(now_ms - 1000)])
    records: dict[str, str] = {}
    others = []
    heads: dict[str, tuple[int, float]] = {}
    for name in rng.sample(_NAMES, rng.randint(0, len(_NAMES))):
        g, want, u = held(), w(), held()
        alive = rng.random() < 0.8
        records[name] = f"{g} {want} {u} {live if alive else expired}"
        if alive:
            others.append((name, g, want, u))
        if rng.random() < 0.4:  # a head, counted while both it and its holder live
            size, d, head_alive = v(), due(), rng.random() < 0.85
            records["^" + name] = f"{size} {d} {live if head_alive else expired}"
            if alive and head_alive:
                heads[name] = (size, d)
    if rng.random() < 0.1:  # the head of a holder with no record
        records["^gone"] = f"{v()} {due()} {live}"
    prev = 0
    if rng.random() < 0.6:  # the holder's own record from its last renewal
        g, alive = held(), rng.random() < 0.8
        records["me"] = f"{g} {w()} {held()} {live if alive else expired}"
        prev = g if alive else 0
        if rng.random() < 0.5:  # and its last head, replaced or deleted by this renewal
            records["^me"] = f"{v()} {due()} {live}"
    if rng.random() < 0.05:
        records["x"] = "not a record"
    want, used = w(), held()
    if rng.random() < 0.2:  # wants summing to the total, or one either side
        want = max(0, total - sum(max(w, u) for _, _, w, u in others) + rng.choice([-1, 0, 1]))
    head, slack = 0, float("inf")
    if rng.random() < 0.4:
        head = v()
        if rng.random() < 0.7:  # between the others' deadlines, never on one
            slack = 10**3 * rng.randint(0, 4) + 500.0
        if head:
            d = _NO_DUE if slack == float("inf") else now_ms + round(slack * 1000)
            heads["me"] = (head, d)
    ask = LeaseRequest("", total, want, used, head, slack)
    return _Resource(ask, records, others, heads, prev)


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_the_script_is_the_python_arithmetic_on_random_records(
    seed: int, redis_url: str, prefix: str
) -> None:
    """lease.lua and `grant` on random holder sets, with every want fitting the total and
    not, with heads named and not: the expired and malformed records deleted, the live
    others counted, the holder's own previous grant taken from its record, its head
    written (or its old one deleted), and the same four numbers back."""
    rng = random.Random(seed)
    b = RedisBackend(redis_url, prefix=prefix)
    fits = dealt = 0
    try:
        now_ms = int((await b._r.time())[0]) * 1000
        for case in range(150):
            asks, expect, kept = [], [], {}
            for i in range(rng.randint(1, 3)):
                res = _random_resource(rng, now_ms)
                a = res.ask
                ask = LeaseRequest(f"c{case}:{i}", a.total, a.want, a.used, a.head, a.slack)
                if res.records:
                    await b._r.hset(f"{{{prefix}}}:lease:{ask.resource}", mapping=res.records)
                asks.append(ask)
                expect.append(
                    grant(ask.total, ask.want, res.others, "me", ask.used, res.prev, res.heads)
                )
                kept[ask.resource] = {o[0] for o in res.others} | {"me"}
                kept[ask.resource] |= {"^" + h for h in res.heads}
                kept[ask.resource] |= {
                    k
                    for k, rec in res.records.items()
                    if k.startswith("^") and k != "^me" and int(rec.split()[2]) > now_ms
                }
                wanted = ask.want + sum(max(w, u) for _, _, w, u in res.others)
                fits += wanted <= ask.total
                dealt += wanted > ask.total and any(h[0] for h in res.heads.values())
            r = await b.renew("me", asks, 10)
            got = [(x.granted, x.holders, x.others_used, x.rate) for x in r.leases]
            assert got == expect, (case, asks)
            for ask, (granted, *_) in zip(asks, expect, strict=True):
                stored = await b._r.hgetall(f"{{{prefix}}}:lease:{ask.resource}")
                if ask.head == 0:
                    kept[ask.resource].discard("^me")
                assert set(stored) == kept[ask.resource]
                assert stored["me"].split()[:3] == [str(granted), str(ask.want), str(ask.used)]
                if ask.head:
                    assert stored["^me"].split()[0] == str(ask.head)
    finally:
        await b.close()
    assert 50 < fits < 250  # of about 300 resources: both sides of the shortcut
    assert dealt > 20  # and heads dealt where the wants exceed the total


async def test_an_unreachable_redis_raises_state_unavailable(prefix: str) -> None:
    from tests.state.conftest import free_port

    b = RedisBackend(f"redis://127.0.0.1:{free_port()}/0", prefix=prefix, timeout_s=0.5)
    try:
        with pytest.raises(StateUnavailable):
            await b.renew("a", req(10, 1), 1)
        with pytest.raises(StateUnavailable):
            await b.limits()
    finally:
        await b.close()


async def test_a_limit_smaller_than_the_holders_turns_among_them(rig: Rig) -> None:
    """A running limit of 2 over three busy holders: at every round one of them gets 0.
    The rounding gives the larger parts to those running least, so the one that ran
    nothing gets a turn as soon as a request ends elsewhere (before: by name, the same
    holder lost every round and its queue starved while the others ran)."""
    b = rig.backend

    async def round_(used: dict[str, int]) -> dict[str, int]:
        out = {}
        for h in ("a", "b", "c"):
            out[h] = (await b.renew(h, req(2, 20, used[h], "run:r0"), 10)).leases[0].granted
        return out

    await round_({"a": 0, "b": 0, "c": 0})
    grants = await round_({"a": 0, "b": 0, "c": 0})
    assert sum(grants.values()) == 2
    starved = next(h for h, g in grants.items() if g == 0)
    # The two others run one each; one of them ends its request: the starved one is next.
    running = {h: (0 if h == starved else 1) for h in grants}
    ended = next(h for h in grants if h != starved)
    running[ended] = 0
    for _ in range(2):
        grants = await round_(running)
    assert grants[starved] == 1, grants
    assert sum(max(grants[h], running[h]) for h in grants) <= 2


async def test_a_stored_response_is_shared_until_it_expires(rig: Rig) -> None:
    b = rig.backend
    assert await b.response("resp_1") is None
    await b.put_response("resp_1", "r 2", 1234, TTL)
    await b.put_response("resp_2", "r3", 5, 10)
    assert await b.response("resp_1") == ("r 2", 1234)
    await rig.advance(TTL + 0.05)
    assert await b.response("resp_1") is None
    assert await b.response("resp_2") == ("r3", 5)


async def test_a_renewal_says_whether_the_backend_still_knew_its_holder(rig: Rig) -> None:
    b = rig.backend
    assert not (await b.renew("a", req(1000, 300), TTL)).known  # a first renewal
    assert (await b.renew("a", req(1000, 300), TTL)).known
    await rig.advance(TTL * 1.5)  # its heartbeat lapsed: the backend may have lost it
    assert not (await b.renew("a", req(1000, 300), TTL)).known
    await b.release("a")
    assert not (await b.renew("a", req(1000, 300), TTL)).known  # released: forgotten


async def test_a_cluster_node_sends_each_prefix_to_its_slots_node(redis_cluster: Any) -> None:
    # A prefix whose hash slot lives on another node than the one kvgate is given: that
    # node answers its keys with MOVED, and the backend follows.
    given = redis.Redis(port=redis_cluster.nodes[0].port)
    try:
        for i in range(100):
            prefix = f"kvgate-slot-{i}"
            try:
                given.get("{" + prefix + "}:probe")
            except redis.exceptions.ResponseError as e:
                assert str(e).startswith("MOVED") or type(e).__name__ == "MovedError"
                break
        else:
            raise AssertionError("every prefix's slot on the given node")
    finally:
        given.close()
    b = RedisBackend(redis_cluster.url, cluster=True, prefix=prefix)
    try:
        r = await b.renew("a", req(1000, 300), 10)
        assert r.leases[0].granted == 1000 and not r.known
        assert set(await b.holders("pool:r0")) == {"a"}
        await b.release("a")
        assert await b.holders("pool:r0") == {}
    finally:
        await b.close()
