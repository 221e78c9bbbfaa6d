"""Replicas found by DNS (``replica_groups``), as Envoy's strict-DNS clusters and
Kubernetes headless Services work.

Each group's name is resolved every ``resolve_interval_s`` with a real DNS client
(dnspython, asking ``dns.servers`` or the system's resolvers; never a cache): every
A/AAAA address, with the group's port, or every SRV target's address with the record's
port, is one replica named ``<group>-<address>:<port>``. What changed between two
answers is applied to discovery (gateway/fleet/discovery.py):

- a new address is probed at once and joins admission when a probe finds it ready;
- a vanished address takes no new request from that moment (`Discovery.retire`), its
  running requests finish, and the ledger forgets it once the last is released.

A name that does not exist (NXDOMAIN) or has no records of the type is an empty group:
scaled to zero. A resolution that fails (timeout, SERVFAIL) keeps the last answer, as
Envoy does: a DNS outage must not empty a fleet of healthy replicas. A change of the
failure's cause is logged once, at warning level.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from typing import TYPE_CHECKING, cast

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.rdata
import dns.rdatatype
import dns.resolver

if TYPE_CHECKING:  # what the records of each type are, for `cast` below
    import dns.rdtypes.IN.A
    import dns.rdtypes.IN.AAAA
    import dns.rdtypes.IN.SRV

from gateway.config import DnsConfig, ReplicaConfig, ReplicaGroupConfig
from gateway.fleet.discovery import Discovery
from gateway.tasks import cancel_all

log = logging.getLogger("kvgate.discovery")

Address = tuple[str, int]  # (IP, port)


class ResolveFailed(Exception):
    """The name could not be resolved now (not: it has no addresses)."""


def make_resolver(cfg: DnsConfig) -> dns.asyncresolver.Resolver:
    """A resolver asking `cfg.servers` (``host`` or ``host:port``), else the system's."""
    resolver = dns.asyncresolver.Resolver(configure=not cfg.servers)
    if cfg.servers:
        servers: list[dns.nameserver.Nameserver] = []
        for item in cfg.servers:
            host, port = _host_port(item)
            servers.append(dns.nameserver.Do53Nameserver(host, port))
        resolver.nameservers = servers
    resolver.lifetime = cfg.timeout_s
    resolver.cache = None
    return resolver


def _host_port(item: str) -> tuple[str, int]:
    if item.startswith("["):  # [v6]:port
        host, _, rest = item[1:].partition("]")
        return host, int(rest.lstrip(":") or 53)
    if item.count(":") == 1:
        host, _, port = item.partition(":")
        return host, int(port)
    return item, 53


async def _query(
    resolver: dns.asyncresolver.Resolver, name: str, rdtype: str
) -> list[dns.rdata.Rdata]:
    try:
        answer = await resolver.resolve(name, rdtype, search=False)
    except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
        return []  # the name says it has none: an empty group
    except (dns.exception.DNSException, OSError) as e:
        raise ResolveFailed(f"{rdtype} {name}: {type(e).__name__}: {e}") from None
    return list(answer)


async def _addresses(resolver: dns.asyncresolver.Resolver, name: str, rdtype: str) -> list[str]:
    """The addresses an A or AAAA query answers."""
    # dnspython types an answer's records as the base Rdata: an A query's are A records,
    # an AAAA query's AAAA records (resolve_group casts an SRV query's the same way).
    records = await _query(resolver, name, rdtype)
    return [r.address for r in cast("list[dns.rdtypes.IN.A.A | dns.rdtypes.IN.AAAA.AAAA]", records)]


async def resolve_group(
    resolver: dns.asyncresolver.Resolver, g: ReplicaGroupConfig
) -> set[Address]:
    """Every (address, port) of the group now; raises ResolveFailed."""
    if g.record != "SRV":
        assert g.port is not None  # the config requires it without SRV
        return {(a, g.port) for a in await _addresses(resolver, g.host, g.record)}
    out: set[Address] = set()
    srvs = cast("list[dns.rdtypes.IN.SRV.SRV]", await _query(resolver, g.host, "SRV"))
    for srv in srvs:
        target = str(srv.target).rstrip(".")
        port = int(srv.port)
        # One address per target: a dual-stack pod is one replica, not two.
        found = await _addresses(resolver, target, "A")
        if not found:
            found = await _addresses(resolver, target, "AAAA")
        out.update((a, port) for a in found)
    return out


def replica_of(g: ReplicaGroupConfig, address: Address) -> ReplicaConfig:
    ip, port = address
    host = f"[{ip}]" if ipaddress.ip_address(ip).version == 6 else ip
    return g.replica(f"{g.name}-{host}:{port}", f"{g.scheme}://{host}:{port}")


class GroupWatcher:
    """Resolves one group and applies the difference to discovery."""

    def __init__(
        self, group: ReplicaGroupConfig, resolver: dns.asyncresolver.Resolver, discovery: Discovery
    ) -> None:
        self.group = group
        self.resolver = resolver
        self._discovery = discovery
        self.members: dict[Address, str] = {}  # address -> replica name
        self.error: str | None = None

    async def resolve_once(self) -> None:
        g = self.group
        try:
            now = await resolve_group(self.resolver, g)
        except ResolveFailed as e:
            if str(e) != self.error:
                log.warning(
                    "replica group %s: cannot resolve %s (keeping its %d replicas)",
                    g.name,
                    e,
                    len(self.members),
                    extra={"fields": {"group": g.name, "error": str(e)}},
                )
            self.error = str(e)
            return
        self.error = None
        gone = [a for a in self.members if a not in now]
        new = sorted(a for a in now if a not in self.members)
        for a in gone:
            self._discovery.retire(self.members.pop(a))
        if new:
            replicas = [replica_of(g, a) for a in new]
            for a, rc in zip(new, replicas, strict=True):
                self.members[a] = rc.name
            await self._discovery.add(replicas, join_when_ready=True)
        if gone or new:
            log.info(
                "replica group %s: %d replicas (+%d -%d)",
                g.name,
                len(self.members),
                len(new),
                len(gone),
                extra={"fields": {"group": g.name, "replicas": sorted(self.members.values())}},
            )
        self._discovery.prune()

    def retire_all(self) -> None:
        for name in self.members.values():
            self._discovery.retire(name)
        self.members.clear()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.group.resolve_interval_s)
            try:
                await self.resolve_once()
            except Exception:  # a bug here must not stop the group's resolution for good
                log.exception("replica group %s: resolution round failed", self.group.name)


class DnsGroups:
    """Every replica group's watcher and its task."""

    def __init__(
        self, groups: list[ReplicaGroupConfig], cfg: DnsConfig, discovery: Discovery
    ) -> None:
        self._discovery = discovery
        self._cfg = cfg
        self._resolver = make_resolver(cfg) if groups else None
        self.groups: dict[str, GroupWatcher] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._pending = list(groups)

    async def start(self) -> None:
        """The first resolution of every group (and its probes) before serving."""
        await self.apply(self._pending, self._cfg)
        self._pending = []

    async def apply(self, groups: list[ReplicaGroupConfig], cfg: DnsConfig) -> None:
        """Make the groups these (a reload): new ones start, removed ones retire their
        replicas, changed ones are replaced; a changed resolver serves every group."""
        if groups and (self._resolver is None or cfg != self._cfg):
            self._resolver = make_resolver(cfg)
            for w in self.groups.values():
                w.resolver = self._resolver
        self._cfg = cfg
        wanted = {g.name: g for g in groups}
        for name in [n for n, w in self.groups.items() if wanted.get(n) != w.group]:
            self._stop(name)
        resolver = self._resolver
        fresh = [g for g in groups if g.name not in self.groups]
        if not fresh or resolver is None:
            return
        watchers = [GroupWatcher(g, resolver, self._discovery) for g in fresh]
        for w in watchers:
            self.groups[w.group.name] = w
        await asyncio.gather(*(w.resolve_once() for w in watchers))
        loop = asyncio.get_running_loop()
        for w in watchers:
            name = w.group.name
            self._tasks[name] = loop.create_task(w.run(), name=f"kvgate-dns-{name}")

    def _stop(self, name: str) -> None:
        task = self._tasks.pop(name, None)
        if task is not None:
            task.cancel()
        w = self.groups.pop(name)
        w.retire_all()

    async def stop(self) -> None:
        await cancel_all(self._tasks.values())
        self._tasks = {}
