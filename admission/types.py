"""Public types of the sans-IO admission core.

The gateway shell builds an `AdmissionRequest`, calls `AdmissionController.submit(req, now)`
and acts on the `Decision`: its verdict, and the `Events` it caused for queued requests.
Every call that changes the controller returns what it caused, as h11's `Connection`
does; nothing is handed out later. Every method takes `now` (seconds, any monotonic
origin); the controller never reads a clock, sleeps or does IO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from admission.learned.patience import ClientEnd
from admission.learned.service import Plane
from routing.types import RouteRequest


@dataclass(slots=True, kw_only=True)
class AdmissionRequest(RouteRequest):
    """The request as admission knows it: the `RouteRequest` routing reads (identity,
    model, tenant, workload, prompt length, prefix chains, session, SLO targets), with
    what admission adds. One object: the gateway builds it once and fills it stage by
    stage; admission hands it to routing as it is, with `need_tokens` and `now` set for
    the decision at hand."""

    expected_output: int  # output tokens to reserve: min(max_tokens, learned quantile)
    max_tokens: int  # declared output bound (for the never-fits check)
    priority: int = 0  # higher is served first
    arrival: float = 0.0
    deadline: float = float("inf")  # absolute time by which it must be admitted
    # True when `prompt_tokens` is an exact count (a tokenizer, the engine's /tokenize,
    # token ids). Only an exact count may be refused as too long: an estimate that puts
    # a request over a limit is forwarded with a reservation clamped to the limit, and
    # the engine's own answer decides (invariant 4).
    prompt_exact: bool = True
    # The share a reservation resting on an estimate keeps beyond its size, learned from
    # the model's estimates (admission.learned.margin); None: the configured headroom.
    margin: float | None = None
    # The client's last retry (openai SDKs: x-stainless-retry-count == max_retries):
    # shedding it turns into a user-visible failure, so it is queued ahead of first
    # attempts of the same priority.
    last_retry: bool = False
    # Set on a queued last retry whose time to start ran out: rather than be shed (a
    # certain failure) it may run one over the learned limit there and then, if the pool
    # holds it (admission.shedding, `expire`).
    over_limit: bool = False
    # Seconds the client allows for the whole service once admitted (its read timeout
    # less the time it will have queued, for a non-stream request), or None when unknown.
    # The learned limit keeps service times inside the budgets of the requests it sees.
    latency_budget: float | None = None
    stream: bool = False  # a stream's budget bounds its time to first token only
    # True when `latency_budget` is the learned patience of its clients
    # (admission.learned.patience), not a timeout the client stated.
    budget_learned: bool = False
    # True when the budget bounds a stream's whole response, not only its first token
    # (and gaps): a learned whole-stream deadline (admission.learned.patience). A non-stream
    # request's budget always bounds its whole response.
    budget_whole: bool = False
    # Identifies a request across its retries (admission/retries.py, `identify`): a shed
    # request's key is expected back, and its tokens count as backlog.
    retry_key: int | None = None
    retry_said: bool = False  # its client says which attempt it is (`RetryIdentity.said`)
    recalled: bool = False  # taken as the retry of a request kvgate left unserved
    # The longest Retry-After its clients were seen to come back after (RetryMemory's
    # `returns_after`): a wait estimate past it queues the request instead of shedding it.
    returns_after_s: float = math.inf
    # Its clients' stated timeout bounds the whole call (admission/learned/toldwait.py): a retry's
    # queue deadline counts from its first attempt.
    budget_from_first: bool = False
    # False when the client set no output bound (`max_tokens` is then kvgate's own guess):
    # an engine that does not preempt may generate until the slot's context is full.
    max_tokens_given: bool = True
    # Whole tokens each block of `prefix_hashes` holds at least (a lower bound, from the
    # most characters per token seen for the model): what a prefix shared with running
    # requests saves on a replica that caches prefixes (admission.prefixshare). 0: none.
    prefix_block_tokens: int = 0
    # Replicas this request must not be placed on: those that already failed it (a
    # retry, as Envoy's previous_hosts predicate). Held for this request only, also
    # when it is admitted later from the queue; the replicas stay usable for others.
    avoid: frozenset[str] = frozenset()


@dataclass(slots=True, frozen=True)
class Completion:
    """What a released request tells admission about its replica (all optional).

    ``service_s`` runs from admission to the end of the response; ``ttft_s`` from
    admission to the first streamed token; ``itl_s`` is the stream's mean inter-token
    gap. Token counts are the engine's ``usage``. ``ok`` is False for upstream errors
    and timeouts (which say the replica is struggling); client disconnects are not
    reported as completions at all.
    """

    ok: bool = True
    service_s: float | None = None
    ttft_s: float | None = None
    itl_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    latency_budget: float | None = None


@dataclass(slots=True, frozen=True)
class AttemptEnd:
    """How a client's attempt ended, as the gateway saw it: what its client did, for the
    retry memory (admission/retries.py) and its population's patience
    (admission/learned/patience.py), and how much of its prompt its engine held cached,
    for routing's prefix index (routing/prefixfeedback.py). Each part is told only where
    the attempt says it; `RequestEnd` gives its admission back."""

    req: AdmissionRequest
    arrival: float  # when this attempt arrived (a retry's `req.arrival` is its first's)
    # Its client left before an answer began: its retry keeps its place in line.
    unanswered: bool = False
    # Its client left before its answer ended (True) or stayed to the end (False); None:
    # it ended in a way that says neither (refused, cut by shutdown, stopped reading).
    left: bool | None = None
    # What it shows of the patience of clients that state no timeout; None: it stated
    # its timeout, or says nothing of it.
    patience: ClientEnd | None = None
    # The prompt tokens its engine held cached (its usage), and the prompt's characters
    # per token; None: not reported.
    cached_tokens: int | None = None
    chars_per_token: float = 0.0


@dataclass(slots=True, frozen=True)
class RequestEnd:
    """A request's admission is given back: its reservation freed, or its queue entry
    dropped (idempotent). `completion`: what it measured of its replica (None teaches
    nothing); `abandoned`: kvgate stopped waiting for it while its engine may still be
    generating it, so its reservation is held (admission/ledger.py, Abandoned requests)."""

    request_id: str
    completion: Completion | None = None
    abandoned: bool = False


@dataclass(slots=True, frozen=True)
class Admit:
    request_id: str
    replica: str
    reserved_tokens: int  # block-rounded tokens now held for the request on that replica
    # The latency budget it was admitted under: its client's stated timeout, or its
    # clients' learned patience (admission.learned.patience); None: neither.
    latency_budget: float | None = None


@dataclass(slots=True, frozen=True)
class Queued:
    request_id: str
    position: int
    estimated_wait: float  # seconds


@dataclass(slots=True, frozen=True)
class Shed:
    """Refused for now: 503 (overload) or 429 (tenant limit) with Retry-After."""

    request_id: str
    # queue_full | deadline | queue_timeout | no_replica (none fits) | no_replica_ready |
    # models_unknown (a replica has not listed its models yet) | rate_limited ...
    reason: str
    retry_after: float  # seconds, honest estimate of when capacity frees
    status: int = 503
    binds: str = ""  # the ceiling that keeps it out (admission.binding), when known
    budget: float | None = None  # the client's time it was judged by (stated or learned)


@dataclass(slots=True, frozen=True)
class Refuse:
    """Can never be served: 400 (context_length_exceeded) or 404 (unknown model). The
    facts only; the gateway words them (`gateway.denials.refusal_message`)."""

    request_id: str
    status: int
    code: str  # context_length_exceeded | model_not_found
    # unknown_model | over_context | no_room_to_generate (an engine that does not
    # preempt) | over_pool (the KV need is over every effective pool)
    reason: str
    model: str
    prompt_tokens: int = 0
    max_tokens: int = 0
    limit: int = 0  # the longest context, or the largest effective pool (over_pool)
    expected_output: int = 0


Verdict = Admit | Queued | Shed | Refuse

# Other requests' verdicts settled by one call: queued requests admitted, or shed (expired,
# or given up by a full queue for another tenant's newcomer). Their waiters are answered.
Events = list[Admit | Shed]


@dataclass(slots=True, frozen=True)
class Decision:
    """`submit`'s answer: the request's own verdict and the events it caused."""

    verdict: Verdict
    events: Events = field(default_factory=list)


@dataclass(slots=True)
class ReplicaUsage:
    """Per-replica ledger snapshot for metrics and /admin/replicas."""

    name: str
    ready: bool
    capacity_tokens: int
    effective_capacity_tokens: int
    reserved_tokens: int
    running: int
    max_running: int | None  # configured or engine-reported cap (an upper bound)
    binding_ceiling: (
        # "none" | "kv_capacity" | "running_cap" | "latency" | "deadlines" | "not_ready" |
        # "ejected"
        str
    )
    models: list[str] = field(default_factory=list)
    limit: int | None = None  # the learned running limit in force (None: not learning)
    limit_reason: str = ""  # what last moved the learned limit
    engine_kv_tokens: int | None = None  # the engine's own KV usage, in tokens
    held: int = 0  # abandoned requests whose reservation waits for the engine to stop
    ejected: bool = False  # out of service by outlier detection
    # The queue's upper estimate of a request's service there at the load it runs; None
    # before any sample.
    service_plane: Plane | None = None
    service_samples: int = 0
    # How its service grows with the load (admission.learned.service.ServiceModel.elasticity).
    service_elasticity: float | None = None
