"""The Redis backend (redis-py asyncio): leases and limits shared by every gateway
process that uses the same Redis and key prefix.

One Lua script (``lease.lua``) heartbeats the process and re-leases all its resources
atomically, on the Redis server's clock: one round trip, beside the reads of the shared
limits (every round) and patiences (every interval's) that a renewal makes first. Keys share one hash
tag (``{prefix}``) so the scripts also run on a Redis Cluster. Scripts are sent by SHA
and reloaded by redis-py when a restarted server has forgotten them.

Timeouts are short and redis-py retries only a connection error, once and at once (a
pooled connection to a restarted Redis is stale): a renewal that fails is the lease
loop's business (it applies ``on_unreachable`` and tries again next round), and the
request path never waits on Redis.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from admission.lease import (
    HolderRecord,
    Lease,
    LeaseRequest,
    RenewResult,
    SharedLimit,
    SharedPatience,
)
from gateway.config import SentinelConfig
from gateway.state.backend import StateBackend, StateUnavailable

_LEASE_LUA = (Path(__file__).parent / "lease.lua").read_text(encoding="utf-8")
_PUBLISH_LUA = """
local v = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ' ' .. v .. ' ' .. ARGV[3])
return v
"""
_HOLDERS_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {now}
local flat = redis.call('HGETALL', KEYS[1])
for j = 1, #flat do out[#out + 1] = flat[j] end
return out
"""


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


class RedisBackend(StateBackend):
    name = "redis"

    def __init__(
        self,
        url: str | None = None,
        *,
        sentinel: SentinelConfig | None = None,
        cluster: bool = False,
        password: str | None = None,
        prefix: str = "kvgate",
        timeout_s: float = 1.0,
    ) -> None:
        """One Redis at `url`, a Redis Cluster that `url` is a node of (`cluster`), or the
        primary that `sentinel`'s sentinels name."""
        self.prefix = prefix
        self._tag = "{" + prefix + "}"
        self._sentinel_pool: SentinelConnectionPool | None = None
        options: dict[str, Any] = {
            "password": password,
            "socket_timeout": timeout_s,
            "socket_connect_timeout": timeout_s,
            # One immediate retry of a connection error only: a pooled connection to a
            # Redis that restarted (or to a primary that failed over) is stale and fails
            # once on first use. Never of a timeout, which the round trip's bound is for.
            "retry": Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            "decode_responses": True,
        }
        if sentinel is not None:
            # Each new connection asks the sentinels where the primary is now; a demoted
            # primary's READONLY answer drops the connection (redis-py's Sentinel pool).
            sentinels = Sentinel(
                [_host_port(a) for a in sentinel.addresses],
                sentinel_kwargs={
                    "password": sentinel.password,
                    "socket_timeout": timeout_s,
                    "socket_connect_timeout": timeout_s,
                },
            )
            self._r = sentinels.master_for(sentinel.master, db=sentinel.db, **options)
            self._sentinel_pool = cast(SentinelConnectionPool, self._r.connection_pool)
        elif cluster:
            # Asks the node for the slot map and sends each command to its slot's node:
            # a prefix's keys share one hash tag, so a script's keys are on one node.
            assert url is not None, "a node of the cluster"
            self._r = RedisCluster.from_url(url, **options)
        else:
            assert url is not None, "a Redis URL or a sentinel configuration"
            self._r = aioredis.from_url(url, **options)
        self._primary: object = None  # where Sentinel last said the primary is
        self._lease = self._r.register_script(_LEASE_LUA)
        self._publish = self._r.register_script(_PUBLISH_LUA)
        self._holders = self._r.register_script(_HOLDERS_LUA)

    def _key(self, *parts: str) -> str:
        return ":".join((self._tag, *parts))

    async def close(self) -> None:
        await self._r.aclose()

    async def ping(self) -> None:
        try:
            await self._r.ping()
        except (RedisError, OSError) as e:
            raise StateUnavailable(str(e)) from e

    async def renew(
        self, holder: str, requests: Sequence[LeaseRequest], ttl_s: float
    ) -> RenewResult:
        keys = [self._key("procs")] + [self._key("lease", r.resource) for r in requests]
        args: list[str | int] = [holder, max(1, round(ttl_s * 1000))]
        for r in requests:
            args += [max(0, int(r.total)), max(0, int(r.want)), max(0, int(r.used))]
            # lease.lua's head: its size, and its slack in ms (-1: no deadline)
            slack = -1 if math.isinf(r.slack) else max(0, round(r.slack * 1000))
            args += [max(0, int(r.head)), slack]
        try:
            out = await self._lease(keys=keys, args=args)
        except (RedisError, OSError) as e:
            raise StateUnavailable(str(e)) from e
        leases = [
            Lease(
                r.resource,
                int(out[1 + 4 * i]),
                int(out[2 + 4 * i]),
                int(out[3 + 4 * i]),
                int(out[4 + 4 * i]),
            )
            for i, r in enumerate(requests)
        ]
        known = int(out[-1]) == 1
        primary = self._sentinel_pool.master_address if self._sentinel_pool else None
        if primary != self._primary:
            # Sentinel moved the primary: what it had not replicated is gone, and other
            # processes' records there may be a renewal old. Rebuild as after a loss.
            known = known and self._primary is None
            self._primary = primary
        return RenewResult(int(out[0]), leases, known=known)

    async def release(self, holder: str, resources: Sequence[str] | None = None) -> None:
        try:
            if resources is None:
                keys = [k async for k in self._r.scan_iter(match=self._key("lease", "*"))]
            else:
                keys = [self._key("lease", r) for r in resources]
            async with self._r.pipeline(transaction=False) as pipe:
                for k in keys:
                    pipe.hdel(k, holder, "^" + holder)  # its record and its head (lease.lua)
                if resources is None:
                    pipe.zrem(self._key("procs"), holder)
                await pipe.execute()
        except (RedisError, OSError) as e:
            raise StateUnavailable(str(e)) from e

    async def holders(self, resource: str) -> dict[str, HolderRecord]:
        try:
            out = await self._holders(keys=[self._key("lease", resource)])
        except (RedisError, OSError) as e:
            raise StateUnavailable(str(e)) from e
        now = int(out[0])
        records: dict[str, HolderRecord] = {}
        for j in range(1, len(out), 2):
            if out[j].startswith("^"):
                continue  # a holder's head (lease.lua), not a holder
            g, w, u, expires = (int(x) for x in out[j + 1].split())
            if expires > now:
                records[out[j]] = HolderRecord(g, w, u, (expires - now) / 1000.0)
        return records

    async def publish_limit(self, replica: str, value: float, reason: str) -> int:
        return await self._publish_record("limits", replica, value, reason or "shared")

    async def limits(self) -> dict[str, SharedLimit]:
        out: dict[str, SharedLimit] = {}
        for replica, (value, version, reason) in (await self._records("limits")).items():
            out[replica] = SharedLimit(float(value), int(version), reason)
        return out

    async def publish_patience(self, population: str, seconds: float, whole: bool) -> int:
        return await self._publish_record("patience", population, seconds, "1" if whole else "0")

    async def patiences(self) -> dict[str, SharedPatience]:
        out: dict[str, SharedPatience] = {}
        for population, (seconds, version, whole) in (await self._records("patience")).items():
            out[population] = SharedPatience(float(seconds), whole == "1", int(version))
        return out

    async def _publish_record(self, name: str, field: str, value: float, tail: str) -> int:
        """Set `field` of the hash `name` to ``value version tail``, with the next version
        of that hash (one script, atomic); returns the version."""
        try:
            return int(
                await self._publish(
                    keys=[self._key(name), self._key(name, "version")],
                    args=[field, repr(float(value)), tail],
                )
            )
        except (RedisError, OSError) as e:
            raise StateUnavailable(str(e)) from e

    async def _records(self, name: str) -> dict[str, tuple[str, str, str]]:
        """Every field of the hash `name` as its (value, version, tail)."""
        try:
            # str keys and values: the client decodes (decode_responses=True), which
            # redis-py's annotations do not follow (they say bytes | str).
            raw = cast(dict[str, str], await self._r.hgetall(self._key(name)))
        except (RedisError, OSError) as e:
            raise StateUnavailable(str(e)) from e
        out: dict[str, tuple[str, str, str]] = {}
        for field, text in raw.items():
            value, version, tail = text.split(" ", 2)
            out[field] = (value, version, tail)
        return out

    async def put_response(self, response_id: str, replica: str, tokens: int, ttl_s: float) -> None:
        try:
            await self._r.set(
                self._key("response", response_id), f"{tokens} {replica}", px=int(ttl_s * 1000)
            )
        except (RedisError, OSError) as e:
            raise StateUnavailable(str(e)) from e

    async def response(self, response_id: str) -> tuple[str, int] | None:
        try:
            raw = await self._r.get(self._key("response", response_id))
        except (RedisError, OSError) as e:
            raise StateUnavailable(str(e)) from e
        if raw is None:
            return None
        tokens, replica = (raw.decode() if isinstance(raw, bytes) else raw).split(" ", 1)
        return replica, int(tokens)
