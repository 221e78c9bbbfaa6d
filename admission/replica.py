"""One replica as admission keeps it: its pool, its ceilings, and the fit rules.

Reservation size
    A reservation is rounded up to the replica's block size ``bs`` and sized by what the
    engine does when its pool is over-admitted (``ReplicaState.preempts``, set by its
    adapter):

    - an engine that preempts (vLLM recomputes, SGLang retracts) turns an under-estimate
      into a slowdown, not a failure: the reservation is ``prompt + expected_output``
      (a learned quantile of the model's outputs within ``max_tokens``), topped up as a
      stream outgrows it, and the learned running limit watches the preemptions;
    - an engine that does not preempt (llama.cpp) fails every running request when its
      pool overruns: the reservation is what the request may use, ``prompt + max_tokens``
      within its slot's context (``max_model_len``), or that whole context when the client
      set no ``max_tokens``. A request larger than the effective pool takes all of it: it
      runs alone, which such an engine survives. Such an engine serves a request whose
      ``max_tokens`` runs past the context (it stops at the context's end), so only a
      prompt that leaves no room to generate is refused there.

    A size resting on an estimate (a prompt counted from its characters, an output
    reserved below its bound) is grown by ``1 / (1 - margin)``, the margin learned from
    what the model's estimates missed (`admission.learned.margin`; the headroom until then); one
    that bounds the request (an exact prompt and its whole ``max_tokens``) is not.

Effective pool
    The pinned or engine-reported pool, or the smaller pool the engine's own KV usage
    shows (admission/poolcheck.py): the headroom is kept by the estimated reservations, not
    carved out of the pool, so a pool of exactly sized requests is packed whole. A pool
    of private slots (llama.cpp per-slot KV, ``ReplicaState.private_slots``) cannot be
    overrun and keeps no headroom. When several gateway processes share the replica, this
    process admits only within its leased slice (``share_tokens``, ``share_running``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from admission.config import AdmissionConfig
from admission.fit import FitLimits, can_ever_fit, context_needed, reservation, round_up
from admission.learned.drain import DrainMeter
from admission.learned.itl import ItlModel
from admission.learned.limit import RunningLimit
from admission.learned.service import ServiceModel
from admission.poolcheck import PoolCheck
from admission.prefixshare import SharedPrefixes
from admission.types import AdmissionRequest
from routing.types import Candidate, ReplicaState

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


@dataclass(slots=True)
class Replica:
    name: str
    drain: DrainMeter
    present: bool = True  # False after remove_replica (kept while reservations remain)
    ready: bool = False
    ejected: bool = False  # outlier ejection (set_ejected): out of service, ready or not
    models: frozenset[str] = frozenset()
    capacity: int | None = None
    block_size: int = 16
    max_model_len: int | None = None
    cap: int | None = None  # running-request cap from config or engine (an upper bound)
    limit: RunningLimit | None = None  # the learned running limit (None: not learning)
    labels: dict[str, str] = field(default_factory=dict)
    preempts: bool = True  # see the module docstring, Reservation size
    private_slots: bool = False
    # The prompt prefixes its reservations pin (admission.ledger); None when the engine
    # does not share them. `reserved` includes their tokens.
    prefixes: SharedPrefixes | None = None
    sharing: bool = False  # its engine shares prefixes now (new requests get the credit)
    reserved: int = 0
    running: int = 0  # reservations, held ones included
    held: int = 0  # abandoned reservations waiting for the engine to stop
    judged_at: float | None = None  # `running_seen_at` of the view held ones were judged by
    effective: int = 0
    signals_at: float = -1.0  # `updated_at` of the engine view last fed to the limit
    # The pool as the engine's KV usage shows it, when smaller than the configured one.
    pool_check: PoolCheck = field(default_factory=PoolCheck)
    # Service (and time to first token) against tokens, for the deadline of a queued request.
    service: ServiceModel = field(default_factory=ServiceModel)
    ttft: ServiceModel = field(default_factory=ServiceModel)
    # Mean inter-token gap of streams by the number running (admission.learned.itl): the
    # `Candidate.predicted_itl_s` of a request with an ITL target (None: no evidence).
    itl: ItlModel | None = None
    # This process's lease of the replica when several gateways share it (`set_pool_share`):
    # KV tokens and running requests it may hold; None: the whole replica.
    share_tokens: int | None = None
    share_running: int | None = None
    # What the other processes reserve on the replica (their lease use at the last
    # renewal): the engine's KV usage is the whole fleet's, so the pool check counts it.
    others_reserved: int = 0
    others_running: int = 0  # and the requests they run there
    # What the fit rules read of this replica (`admission.fit`), rebuilt by `refresh`,
    # the only place its fields change.
    fit: FitLimits = field(default_factory=lambda: FitLimits(None, None))
    # The routing view of this replica, refreshed in place (engine gauges at upsert,
    # ledger fields at each decision) instead of rebuilt per call.
    cand: Candidate = field(default_factory=lambda: Candidate("", 0, 0, 0, None))
    view_at: float = 0.0  # `updated_at` of the engine view in `cand`
    # The last `tokens_for` answer, by the request fields it reads (cleared by refresh,
    # which sets everything else it reads): one decision asks it several times.
    memo_key: tuple[int, int, int, bool, bool, float | None] | None = None
    memo_tokens: int = 0
    # The last need of a fit check (request id, time, tokens, shared blocks): the
    # admission that follows in the same decision reuses it (admission.ledger).
    need_memo: tuple[str, float, int, int] | None = None
    # What the per-model views group and filter this replica by; a change rebuilds them
    # (admission.views).
    sig: tuple[object, ...] | None = None
    # Its deadline room (admission/room.py), and whether a change since calls for a new one.
    room: float = math.inf
    room_stale: bool = False

    def shape(self) -> tuple[object, ...]:
        """What the fit checks (`can_ever_fit`, `tokens_for`) read besides the request."""
        return (
            self.capacity is None,
            self.effective,
            self.block_size,
            self.max_model_len,
            self.preempts,
            self.private_slots,
        )

    @property
    def allowed(self) -> int | None:
        """Requests this process may run at once: the learned limit within the hard cap,
        less what the other processes ran there at their last renewal; and within this
        process's leased slice of the cap (gateway/state)."""
        allowed = self.cap
        if self.limit is not None:
            allowed = max(0, self.limit.allowed(self.cap) - self.others_running)
        if self.share_running is not None:
            return self.share_running if allowed is None else min(allowed, self.share_running)
        return allowed

    def allowed_for(self, over_limit: bool) -> int | None:
        """`allowed`, one more for a last retry out of time to start (`over_limit`) where
        the learned limit binds, not a cap or a leased share: shed, it fails for sure,
        and the limit is a latency aim that one more running request only dents."""
        allowed = self.allowed
        if not over_limit or allowed is None or self.limit is None:
            return allowed
        hard = [c for c in (self.cap, self.share_running) if c is not None]
        return allowed + 1 if not hard or allowed < min(hard) else allowed

    @property
    def whole_running(self) -> int:
        """Requests the replica runs for every process: this one's and what the others
        reported at their last renewal (the count its deadline room is held to)."""
        return self.running + self.others_running

    @property
    def serving_load(self) -> int:
        """Requests the replica runs at once, over every process that shares it: the load
        its service is learned and predicted at. The whole allowed count (the learned
        limit within the cap, not this process's part of it: several processes' parts
        move as their running does, while the engine's batch is the whole), or fewer
        where the pool binds first (it holds this many of the requests running now, at
        their mean reservation). The docstring of `admission.learned.service` says why
        a prediction scales with it; the pool's bound keeps a limit above what the pool
        holds from scaling every prediction with it."""
        whole = self.cap if self.limit is None else self.limit.allowed(self.cap)
        running = self.whole_running
        load = running + 1 if whole is None else whole
        reserved = self.reserved + self.others_reserved
        if running > 0 and reserved > 0:
            load = min(load, max(running, self.effective * running // reserved))
        return max(1, load)

    @property
    def usable(self) -> bool:
        """May receive new requests: present, ready, not ejected and with a known pool."""
        return self.present and self.ready and not self.ejected and self.capacity is not None

    @property
    def free(self) -> int:
        if self.share_tokens is not None:  # this process's leased slice of the pool
            return min(self.effective, self.share_tokens) - self.reserved
        return self.effective - self.reserved

    @property
    def slots_beyond_slice(self) -> int:
        """The requests the replica's running limit has room for beyond what every
        process runs there, when this process holds a slice of it (0 otherwise)."""
        if self.share_running is None:
            return 0
        whole = self.cap if self.limit is None else self.limit.allowed(self.cap)
        if whole is None:
            return 0
        return whole - self.whole_running

    @property
    def room_beyond_slice(self) -> int:
        """What the whole pool has free beyond what every process reserves there, when
        this process holds a slice of it (0 otherwise). A dead process's reservations
        stay counted until its lease's TTL: no renewal brings them sooner."""
        if self.share_tokens is None:
            return 0
        return self.effective - self.reserved - self.others_reserved

    def need(self, raw_tokens: int) -> int:
        return round_up(raw_tokens, self.block_size)

    def tokens_for(self, req: AdmissionRequest) -> int:
        """The reservation `req` would hold here (module docstring, Reservation size)."""
        # The request fields `reservation` reads, in its order: the memo's key.
        key = (
            req.prompt_tokens,
            req.expected_output,
            req.max_tokens,
            req.max_tokens_given,
            req.prompt_exact,
            req.margin,
        )
        if key != self.memo_key:
            self.memo_tokens = reservation(self.fit, *key)
            self.memo_key = key
        return self.memo_tokens

    def context_needed(self, req: AdmissionRequest) -> int:
        return context_needed(self.preempts, req.prompt_tokens, req.max_tokens)

    def can_ever_fit(self, req: AdmissionRequest) -> bool:
        return can_ever_fit(self.fit, req.prompt_tokens, req.max_tokens, self.tokens_for(req))

    def refresh(
        self,
        state: ReplicaState,
        config: AdmissionConfig,
        now: float,
        *,
        pinned_capacity: int | None,
        max_running: int | None,
    ) -> bool:
        """Take the adapter's view of the replica: pool, ceilings, engine gauges for
        routing. Returns whether the view is fresh (not the one seen last time)."""
        self.present = True
        self.memo_key = None
        self.room_stale = True  # time moved the running requests' rests and deadlines
        self.models = frozenset(state.models)
        self.capacity = pinned_capacity if pinned_capacity is not None else state.capacity_tokens
        self.ready = bool(state.ready) and self.capacity is not None
        self.block_size = max(1, state.block_size)
        self.max_model_len = state.max_model_len
        if max_running is not None:
            self.cap = max_running
        elif state.max_running is not None:
            self.cap = state.max_running
        else:
            self.cap = config.default_max_running
        self.labels = dict(state.labels)
        c = self.cand
        c.name = self.name
        c.labels = self.labels
        c.block_size = self.block_size
        c.engine = state
        # Speculation: a configured `speculative` label wins over what the engine says.
        label = self.labels.get("speculative", "").strip().lower()
        if label in _TRUE:
            c.speculative = True
        elif label in _FALSE:
            c.speculative = False
        else:
            c.speculative = bool(state.speculative)
        self.view_at = state.updated_at
        self.preempts = state.preempts
        self.private_slots = state.private_slots
        self.sharing = state.shares_prefix and config.share_prefix and not self.private_slots
        if self.sharing and self.prefixes is None:
            self.prefixes = SharedPrefixes()
        elif not self.sharing and self.prefixes is not None and not len(self.prefixes):
            self.prefixes = None  # pins left are released with their reservations
        fresh = state.updated_at != self.signals_at
        if fresh and self.capacity is not None:
            self.pool_check.observe(
                self.capacity, self.reserved, self.others_reserved, state.kv_usage, now
            )
        # The whole pool: the headroom is kept by the reservations that rest on estimates,
        # and by a pool measured from the engine's usage.
        self.effective = self.pool_check.pool(self.capacity or 0, config.headroom)
        self.fit = FitLimits(
            self.max_model_len,
            None if self.capacity is None else self.effective,
            self.block_size,
            self.preempts,
            self.private_slots,
            config.headroom,
        )
        return fresh

    def predicted_itl(self, running_after: int) -> float | None:
        """The expected inter-token gap with `running_after` running (None: no evidence)."""
        return self.itl.predict(running_after) if self.itl is not None else None
