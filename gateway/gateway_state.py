"""What a running gateway owns: its configuration, the admission door (the only holder
of the controller), tenants, the token estimator, discovery, the pipeline, metrics and
the shared-state loop. `gateway.app` fills it at start-up; the reloader and the
operations API read and change it."""

from __future__ import annotations

import asyncio
import logging

from admission.controller import AdmissionController
from admission.learned.estimate import TokenEstimator
from admission.tenants import TenantLimiter
from gateway.config import GatewayConfig, expand_data_parallel, routing_with_slo_filter
from gateway.door import AdmissionDoor
from gateway.fleet.discovery import Discovery
from gateway.fleet.dns import DnsGroups
from gateway.fleet.kvevents import KVEventSubscriber
from gateway.metrics import GatewayMetrics
from gateway.pipeline import Pipeline
from gateway.reload import RESTART_ONLY, Reloader
from gateway.state.sharing import StateSync
from gateway.tokenizers import load_token_counters
from routing.kvindex import KVIndex
from routing.plugin import PluginEnv
from routing.scheduler import build_router
from routing.types import Router

log = logging.getLogger("kvgate.reload")


class GatewayState:
    """Everything the app owns at run time; filled by the start-up context."""

    def __init__(self, config: GatewayConfig, picker: Router | None = None) -> None:
        self.config = config
        # The engines' own caches, where a replica publishes its KV events.
        self.kv_index = KVIndex() if any(rc.kv_events for rc in config.replicas) else None
        if picker is None:
            picker = self._router(config)
        # Tenants (admission/tenants.py): the pipeline checks keys and rates, the
        # controller's queue reads weights and caps.
        self.tenants = TenantLimiter.from_config(config.tenants, config.auth.api_keys)
        # The door is the gateway's only holder of the controller: every change goes
        # through it, every read through its report.
        self.door = AdmissionDoor(
            AdmissionController(config.admission, picker, tenants=self.tenants.tenants.get)
        )
        counters = load_token_counters(config.tokenizers)
        self.estimator = TokenEstimator(config.admission, tokenizer_for=counters.get)
        self.discovery: Discovery
        self.dns: DnsGroups  # replicas from DNS (replica_groups)
        self.reloader: Reloader | None = None
        self.pipeline: Pipeline
        self.metrics: GatewayMetrics
        self.sync: StateSync | None = None  # the lease loop (shared state), if any
        self.kv_subscribers: list[KVEventSubscriber] = []

    def set_tenant_share(self, tenant: str, fraction: float, refill: float | None = None) -> None:
        """This process's share of a tenant's rpm, tpm and concurrency (the shared-state
        backend leases it), and the rate its spent rpm and tpm refill at (`Gcra`); a
        larger share may admit waiting requests at once."""
        now = asyncio.get_running_loop().time()
        self.tenants.set_share(tenant, fraction, now, refill)
        self.door.advance(now)

    def queue_depths(self) -> dict[str, int]:
        report = self.door.report
        return {m: report.queue_depth(m) for m in self.discovery.known_models}

    def _router(self, config: GatewayConfig) -> Router:
        """The router `config` describes, over the engines' own caches where replicas
        publish them (the same index at start and after a reload). Discovery's interval
        is read at start only (a restart-only section)."""
        routing = routing_with_slo_filter(config)
        return build_router(
            routing,
            discovery_interval_s=self.config.discovery.refresh_interval_s,
            env=PluginEnv(block_chars=routing.block_chars, kv_index=self.kv_index),
        )

    async def apply(self, new: GatewayConfig) -> None:
        """Make `new` (validated) the running config: what a reload changes
        (gateway/reload.py) from this moment on; the sections read only at start are
        logged as waiting for a restart."""
        old = self.config
        later = [s for s in RESTART_ONLY if getattr(old, s) != getattr(new, s)]
        if later:
            log.warning(
                "config reload: %s changed and take effect at restart",
                ", ".join(later),
                extra={"fields": {"sections": later}},
            )
        loop = asyncio.get_running_loop()
        # Who may send requests first: a removed key stops at once.
        self.tenants.reconfigure(new.tenants, new.auth.api_keys, loop.time())
        self.metrics.set_tenant_names(self.tenants.tenants)
        router = None
        if routing_with_slo_filter(new) != routing_with_slo_filter(old):
            router = self._router(new)
        if new.admission != old.admission or router is not None:
            self.door.reconfigure(new.admission, router)
        if new.logging.level != old.logging.level:
            logging.getLogger("kvgate").setLevel(new.logging.level.upper())
        # Replicas: removed ones retire, new and changed ones are (re)probed.
        before = {rc.name: rc for rc in expand_data_parallel(old.replicas)}
        after = {rc.name: rc for rc in expand_data_parallel(new.replicas)}
        for name in before.keys() - after.keys():
            self.discovery.retire(name)
        changed = [rc for name, rc in after.items() if before.get(name) != rc]
        if changed:
            await self.discovery.add(changed)
        await self.dns.apply(new.replica_groups, new.dns)
        self.discovery.prune()
        self.config = new
