"""Tenants: API keys, per-tenant policies and rate limits (sans-IO).

A gateway in front of shared GPUs serves many teams; each gets its own limits, its own
share of the capacity under contention and its own latency targets. This module holds
everything about a tenant that is decided before the admission queue; the queue's fair
order between tenants is `admission.fairqueue`.

Keys
    API keys are stored as SHA-256 digests only (``keys_sha256`` in config; the legacy
    plain ``auth.api_keys`` and ``KVGATE_API_KEYS`` are hashed when the index is built,
    and the plain text is kept nowhere else). A presented key is hashed, looked up by
    its digest, and the stored digest is compared with ``hmac.compare_digest``: the time
    taken depends on the digest, which says nothing about any stored key. A key of
    high entropy (``kvgate hash-key`` makes one) needs no slow hash: SHA-256 of a
    256-bit random key cannot be brute-forced from the digest.

Rate limits (GCRA)
    Requests per minute and tokens per minute are each a generic cell rate algorithm
    (equivalent to a token bucket of ``limit`` cells refilled at ``limit / 60`` per
    second, kept as one number: the theoretical arrival time ``tat`` at which the bucket
    is full again). A request costing ``n`` passes when ``max(tat, now) + n * T - now <=
    60 s`` (``T = 60 / limit``); its exact wait otherwise is that excess, which is what
    a 429's Retry-After says. A request is charged its estimate (prompt + the output
    admission reserves) when it passes, and corrected to the engine's usage when that
    arrives (``correct``); a request that is never admitted (shed, refused) is refunded,
    so a 503 does not also cost the client its budget. A request larger than the whole
    token budget can never pass: a 429 that says so, with no Retry-After.

    What is left now (whole cells) and when a bucket is full again are read by the
    gateway, which words them as OpenAI's rate-limit headers (`gateway.ratelimit`).

Per tenant besides: the most concurrent (admitted) and queued requests (enforced by the
admission controller from `TenantState`), a priority range the ``x-kvgate-priority``
header is clamped to (default range ``[0, 0]``: a client cannot jump the queue unless
its tenant is granted priorities), a weight for fair sharing, the models it may use
(others answer 404 as OpenAI does for a model the key cannot see), a default workload
class, a queue timeout, and SLO targets (TTFT and ITL feed placement; all three are
measured as attainment).

Shares
    ``set_share(tenant, fraction)`` scales this process's rpm, tpm and concurrency to a
    fraction of the tenant's configured totals (default 1.0), for several gateway
    processes that lease slices of one tenant's budget (the Redis state backend).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from admission.config import LatencyTargets

DEFAULT_TENANT = "default"
_WINDOW_S = 60.0  # rpm and tpm are per minute
_WANTED_S = 10.0  # how long a refused request's share stays demand (at least)
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


# ---------------------------------------------------------------------- config
class PriorityRange(BaseModel):
    """The ``x-kvgate-priority`` values a tenant may use (clamped into [min, max])."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min: int = 0
    max: int = 0
    default: int = 0

    @model_validator(mode="after")
    def _ordered(self) -> PriorityRange:
        if not self.min <= self.default <= self.max:
            raise ValueError(
                f"priority: need min <= default <= max, got {self.min}, {self.default}, {self.max}"
            )
        return self


class TenantConfig(BaseModel):
    """One tenant (``tenants:`` in the YAML)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    keys_sha256: list[str] = Field(
        default_factory=list,
        description="Hex SHA-256 digests of the tenant's API keys (`kvgate hash-key`).",
    )
    rpm: int | None = Field(None, gt=0, description="Requests per minute (None: no limit).")
    tpm: int | None = Field(None, gt=0, description="Tokens per minute (None: no limit).")
    max_concurrent: int | None = Field(None, ge=1, description="Most admitted at once.")
    max_queued: int | None = Field(None, ge=0, description="Most waiting in the queue.")
    priority: PriorityRange = Field(default_factory=PriorityRange)
    weight: float = Field(1.0, gt=0.0, description="Share of contended capacity, in tokens.")
    models: list[str] | None = Field(None, description="Models it may use (None: all).")
    default_workload: Literal["coding", "agentic", "chat"] | None = None
    queue_timeout_s: float | None = Field(
        None, gt=0.0, description="Queue timeout (replaces admission.queue_timeout_s)."
    )
    slo: LatencyTargets = Field(default_factory=LatencyTargets)

    @field_validator("keys_sha256")
    @classmethod
    def _hex(cls, v: list[str]) -> list[str]:
        out = []
        for i, d in enumerate(v):
            d = d.strip().lower()
            if not _HEX64.match(d):
                raise ValueError(
                    f"entry {i} is not a hex SHA-256 digest (64 hex digits); "
                    "`kvgate hash-key` prints one"
                )
            out.append(d)
        return out


def hash_key(key: str) -> str:
    """The hex SHA-256 digest of an API key, as ``keys_sha256`` stores it."""
    return hashlib.sha256(key.encode()).hexdigest()


# ---------------------------------------------------------------------- keys
class KeyIndex:
    """API key digest -> tenant. Holds digests only."""

    __slots__ = ("_by_digest",)

    def __init__(self) -> None:
        self._by_digest: dict[bytes, tuple[bytes, str]] = {}

    def add_digest(self, hex_digest: str, tenant: str) -> None:
        d = bytes.fromhex(hex_digest)
        known = self._by_digest.get(d)
        if known is not None and known[1] != tenant:
            raise ValueError(f"one API key is given to two tenants ({known[1]!r}, {tenant!r})")
        self._by_digest[d] = (d, tenant)

    def add_plain(self, key: str, tenant: str) -> None:
        self.add_digest(hash_key(key), tenant)

    def __len__(self) -> int:
        return len(self._by_digest)

    def lookup(self, key: str) -> str | None:
        """The tenant of `key`, or None. Constant time in the key's content."""
        d = hashlib.sha256(key.encode()).digest()
        got = self._by_digest.get(d)
        if got is None:
            return None
        return got[1] if hmac.compare_digest(got[0], d) else None


# ---------------------------------------------------------------------- GCRA
class Gcra:
    """A GCRA limit of `limit` cells per minute, scaled by `share` (sans-IO).

    Several processes each hold a `share` of a tenant's budget. Spent cells refill at
    `refill` (a share at least `share`): when a process's share shrank below what it had
    spent, it admits nothing until it is back within its share, while the cells it spent
    refill at the rate it held when it spent them (the lease gives that rate back to the
    others as they refill), so the budget stays in use in the meantime."""

    __slots__ = (
        "total", "share", "refill", "tat", "wanted", "wanted_until", "share_wait_s",
        "others_used", "others_at",
    )  # fmt: skip

    def __init__(self, limit: int) -> None:
        self.total = limit
        self.share = 1.0
        self.refill = 1.0
        self.tat = -math.inf
        # The largest cost (as a fraction of the total) refused because it exceeded this
        # process's share, not the total: demand the share lease must see, or a request
        # larger than an idle split would never pass here (gateway.state.sharing asks for it).
        self.wanted = 0.0
        self.wanted_until = -math.inf  # kept until the client has had time to come back
        # How soon a share can grow: the lease renewal the shell runs (set by it; a
        # minute, the window, when nothing renews shares).
        self.share_wait_s = _WINDOW_S
        # Cells the tenant's other gateway processes had spent and not refilled, as the
        # shared state reported them at this process's last lease renewal (`others_at`).
        self.others_used = 0.0
        self.others_at = -math.inf

    @property
    def limit(self) -> float:
        """Cells per minute this process may use (the share of the total)."""
        return self.total * self.share

    def _interval(self) -> float:
        """Seconds per cell refilled."""
        rate = self.total * self.refill
        return _WINDOW_S / rate if rate > 0 else math.inf

    def _tolerance(self, t: float) -> float:
        """Seconds of refill the bucket holds: the limit's cells at the refill rate."""
        return self.limit * t if math.isfinite(t) else 0.0

    def wait(self, cost: float, now: float) -> float:
        """Seconds until `cost` cells would pass (0: now; inf: never). A cost over this
        process's share but within the configured total is recorded as wanted and waits
        for the share to grow: at the next lease renewal at the soonest
        (`share_wait_s`)."""
        if cost > self.total:
            return math.inf
        if cost > self.limit:
            self.wanted = max(self.demand(now), cost / self.total)
            # Kept while the client retries (after `share_wait_s`), so the share grown for
            # it is still there when it comes back; then it is its use that holds it.
            self.wanted_until = now + max(_WANTED_S, 4 * self.share_wait_s)
            return self.share_wait_s
        t = self._interval()
        if not math.isfinite(t):
            return self.share_wait_s  # nothing refills here until the share grows
        excess = max(self.tat, now) + cost * t - now - self._tolerance(t)
        return max(0.0, excess)

    def demand(self, now: float) -> float:
        """The share a refused request asked for (a fraction of the total), while it is
        expected back; 0 after."""
        if now >= self.wanted_until:
            self.wanted = 0.0
        return self.wanted

    def charge(self, cost: float, now: float) -> None:
        t = self._interval()
        self.tat = max(self.tat, now) + cost * t

    def refund(self, cost: float, now: float) -> None:
        """Give back `cost` cells (negative: take more); never below empty."""
        t = self._interval()
        if math.isfinite(t):
            self.tat = max(self.tat, now) - cost * t

    def used(self, now: float) -> float:
        """Cells spent and not yet refilled (more than the limit while in debt)."""
        t = self._interval()
        return (self.tat - now) / t if self.tat > now and math.isfinite(t) else 0.0

    def remaining(self, now: float) -> int:
        return max(0, math.floor(self.limit - self.used(now) + 1e-9))

    def reset(self, now: float) -> float:
        """Seconds until the bucket is full again."""
        return max(0.0, self.tat - now)

    # The tenant's whole budget across every gateway process (what clients are told):
    # this process's spending now plus the others' as of the last renewal. That part is
    # at most one renewal old (``state.renew_interval_s``, 0.5 s by default): what they
    # spent or refilled since shows at the next one.
    def set_others(self, cells: float, now: float) -> None:
        self.others_used = max(0.0, cells)
        self.others_at = now

    def fleet_used(self, now: float) -> float:
        return self.used(now) + self.others_used

    def fleet_remaining(self, now: float) -> int:
        return max(0, math.floor(self.total - self.fleet_used(now) + 1e-9))

    def fleet_reset(self, now: float) -> float:
        """Seconds until the tenant's whole budget is full again at its configured rate."""
        return max(self.reset(now), self.fleet_used(now) * _WINDOW_S / self.total)

    def set_share(self, fraction: float, now: float, refill: float | None = None) -> None:
        """Scale the limit to `fraction` and the refill to `refill` (at least the
        fraction; by default the fraction); what was spent stays spent (in cells)."""
        used = self.used(now)
        self.share = fraction
        self.refill = max(fraction, fraction if refill is None else refill)
        t = self._interval()
        self.tat = now + used * t if used > 0 and math.isfinite(t) else self.tat


# ---------------------------------------------------------------------- tenants
@dataclass(slots=True)
class TenantState:
    """One tenant's policy and live limits. The admission controller reads
    ``max_concurrent``, ``max_queued`` and ``weight`` (share-scaled)."""

    name: str
    weight: float = 1.0
    total_concurrent: int | None = None
    total_queued: int | None = None
    max_concurrent: int | None = None  # this process's share of total_concurrent
    max_queued: int | None = None
    prio_min: int = 0
    prio_max: int = 0
    prio_default: int = 0
    models: frozenset[str] | None = None
    default_workload: str | None = None
    queue_timeout_s: float | None = None
    ttft_s: float | None = None
    itl_s: float | None = None
    e2e_s: float | None = None
    rpm: Gcra | None = None
    tpm: Gcra | None = None
    share: float = 1.0
    configured: bool = False

    def clamp_priority(self, asked: int | None) -> int:
        if asked is None:
            return self.prio_default
        return min(self.prio_max, max(self.prio_min, asked))

    def may_use(self, model: str, bases: frozenset[str] = frozenset()) -> bool:
        """`model`, or a LoRA adapter whose `bases` (ModelCatalog.bases_of) all are."""
        return self.models is None or model in self.models or bool(bases) and bases <= self.models


@dataclass(slots=True, frozen=True)
class RateVerdict:
    """The outcome of a rate check: ``limit`` is None when the request passes, else
    ``requests`` or ``tokens``; ``retry_after`` the exact wait (inf: never)."""

    limit: str | None
    retry_after: float = 0.0


@dataclass(slots=True)
class Charge:
    """What a request was charged, to refund or correct later."""

    tenant: str
    tokens: int
    requests: int = 1
    settled: bool = False


def _state_of(cfg: TenantConfig) -> TenantState:
    return TenantState(
        name=cfg.name,
        weight=cfg.weight,
        total_concurrent=cfg.max_concurrent,
        total_queued=cfg.max_queued,
        max_concurrent=cfg.max_concurrent,
        max_queued=cfg.max_queued,
        prio_min=cfg.priority.min,
        prio_max=cfg.priority.max,
        prio_default=cfg.priority.default,
        models=frozenset(cfg.models) if cfg.models is not None else None,
        default_workload=cfg.default_workload,
        queue_timeout_s=cfg.queue_timeout_s,
        ttft_s=cfg.slo.ttft_s,
        itl_s=cfg.slo.itl_s,
        e2e_s=cfg.slo.e2e_s,
        rpm=Gcra(cfg.rpm) if cfg.rpm is not None else None,
        tpm=Gcra(cfg.tpm) if cfg.tpm is not None else None,
        configured=True,
    )


@dataclass(slots=True)
class TenantLimiter:
    """The tenants of one gateway process: key lookup, policies, rate limits."""

    tenants: dict[str, TenantState] = field(default_factory=dict)
    keys: KeyIndex = field(default_factory=KeyIndex)

    @classmethod
    def from_config(
        cls, tenants: Iterable[TenantConfig], plain_keys: Mapping[str, str] | None = None
    ) -> TenantLimiter:
        """Tenants from config; `plain_keys` (legacy ``auth.api_keys``: key -> tenant) are
        hashed here. A tenant named only by a legacy key gets no limits."""
        lim = cls()
        for cfg in tenants:
            if cfg.name in lim.tenants:
                raise ValueError(f"tenants: duplicate tenant name {cfg.name!r}")
            lim.tenants[cfg.name] = _state_of(cfg)
            for d in cfg.keys_sha256:
                lim.keys.add_digest(d, cfg.name)
        for key, tenant in (plain_keys or {}).items():
            lim.keys.add_plain(key, tenant)
            lim.tenants.setdefault(tenant, TenantState(name=tenant))
        lim.tenants.setdefault(DEFAULT_TENANT, TenantState(name=DEFAULT_TENANT))
        return lim

    def reconfigure(
        self,
        tenants: Iterable[TenantConfig],
        plain_keys: Mapping[str, str] | None = None,
        now: float = 0.0,
    ) -> None:
        """Take reloaded tenants and keys in place (everything holding this limiter, or
        its ``tenants`` dict, sees them). What a kept tenant spent stays spent where
        its rate is unchanged, and its share of shared limits is kept."""
        new = TenantLimiter.from_config(tenants, plain_keys)
        for name, st in new.tenants.items():
            old = self.tenants.get(name)
            if old is None:
                continue
            if old.rpm is not None and st.rpm is not None and old.rpm.total == st.rpm.total:
                st.rpm = old.rpm
            if old.tpm is not None and st.tpm is not None and old.tpm.total == st.tpm.total:
                st.tpm = old.tpm
            if old.share != 1.0:
                new.set_share(name, old.share, now)
        self.tenants.clear()
        self.tenants.update(new.tenants)
        self.keys = new.keys

    @property
    def auth_required(self) -> bool:
        """True once any key is configured: then every request must carry one."""
        return len(self.keys) > 0

    def get(self, tenant: str) -> TenantState:
        st = self.tenants.get(tenant)
        if st is None:  # not reachable from a request (tenants come from keys)
            st = self.tenants[tenant] = TenantState(name=tenant)
        return st

    def authenticate(self, key: str | None) -> str | None:
        """The tenant of a presented key; None for a missing or unknown key. Without
        any configured key every request is tenant ``default``."""
        if not self.auth_required:
            return DEFAULT_TENANT
        if not key:
            return None
        return self.keys.lookup(key)

    # ------------------------------------------------------------------ rates
    def check(self, tenant: str, tokens: int, now: float) -> RateVerdict:
        """Would a request of `tokens` pass now? (Nothing is charged.)"""
        st = self.get(tenant)
        waits: list[tuple[float, str]] = []
        if st.rpm is not None:
            waits.append((st.rpm.wait(1, now), "requests"))
        if st.tpm is not None:
            waits.append((st.tpm.wait(tokens, now), "tokens"))
        worst = max(waits, default=(0.0, ""))
        if worst[0] <= 0.0:
            return RateVerdict(None)
        return RateVerdict(worst[1], worst[0])

    def charge(self, tenant: str, tokens: int, now: float) -> Charge:
        st = self.get(tenant)
        if st.rpm is not None:
            st.rpm.charge(1, now)
        if st.tpm is not None:
            st.tpm.charge(tokens, now)
        return Charge(tenant, tokens)

    def refund(self, charge: Charge, now: float) -> None:
        """The request was never served: give its request and tokens back."""
        if charge.settled:
            return
        charge.settled = True
        st = self.get(charge.tenant)
        if st.rpm is not None:
            st.rpm.refund(charge.requests, now)
        if st.tpm is not None:
            st.tpm.refund(charge.tokens, now)

    def correct(self, charge: Charge, true_tokens: int, now: float) -> None:
        """The engine's usage arrived: charge the true count instead of the estimate."""
        if charge.settled:
            return
        charge.settled = True
        st = self.get(charge.tenant)
        if st.tpm is not None:
            st.tpm.refund(charge.tokens - true_tokens, now)

    # ------------------------------------------------------------------ shares
    def set_share(
        self, tenant: str, fraction: float, now: float = 0.0, refill: float | None = None
    ) -> None:
        """Scale this process's rpm, tpm and concurrency of `tenant` to `fraction` of
        its configured totals (1.0: all of it), its rpm and tpm refilling at `refill`
        (`Gcra`; by default the fraction). The shell pumps the admission queue
        afterwards (a larger concurrency may admit waiting requests)."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"share must be within [0, 1], got {fraction}")
        st = self.get(tenant)
        st.share = fraction
        for g in (st.rpm, st.tpm):
            if g is not None:
                g.set_share(fraction, now, refill)
        if st.total_concurrent is not None:
            st.max_concurrent = math.floor(st.total_concurrent * fraction)
        if st.total_queued is not None:
            st.max_queued = math.floor(st.total_queued * fraction)
