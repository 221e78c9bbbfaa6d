"""Per-request state carried through the pipeline stages.

Each stage reads what earlier stages filled in and adds its own part; the account and
release stages at the end read all of it. `req` is the one request object admission
and routing are given (the stages fill it; a retry changes its id, deadline and the
replicas it avoids), `RequestContext.admitted` what an admission writes back. Plain
slotted dataclasses: attribute access without dict lookups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from admission.types import AdmissionRequest, Admit
from gateway.errors import Dialect
from gateway.outcome import UNKNOWN, Outcome
from gateway.schemas import ParsedRequest

# The endpoint a request came in on: its body's schema, the engine path it goes to, the
# dialect of its errors and the shape of its event stream.
Kind = Literal[
    "chat",
    "completion",
    "responses",
    "messages",
    "embeddings",
    "rerank",
    "score",
    "classify",
    "pooling",
    "transcription",
    "translation",
]


@dataclass(slots=True)
class RequestContext:
    request_id: str
    kind: Kind
    upstream_path: str
    arrival: float
    # The API whose error objects and overload statuses the client expects.
    dialect: Dialect = "openai"
    # The one request object admission and routing read (admission.types.AdmissionRequest,
    # a routing.types.RouteRequest): the stages fill it in place, nothing copies it.
    req: AdmissionRequest = field(default_factory=lambda: blank_request(""))
    # The tenant's default workload class (tenants[].default_workload), set by
    # authenticate; classify uses it when the request has no x-workload header.
    tenant_default_workload: str | None = None
    rate_charge: Any = None  # admission.tenants.Charge: refunded or corrected at the end
    # parse
    raw: bytes = b""
    body: dict[str, Any] | None = None
    parsed: ParsedRequest | None = None
    client_wants_usage: bool = False
    # estimate
    prompt_chars: int = 0
    num_messages: int = 1
    # False when the prompt has parts a character count cannot describe (images, audio):
    # its usage must not teach the estimator's chars-per-token.
    prompt_countable: bool = True
    # A chat prompt's digest chain and its longest prefix the engine counted
    # (gateway.prefixcount.PrefixCount): the account stage stores the usage under it.
    prefix: Any = None
    # admit: the latency budget it was admitted under (the client's stated timeout, or
    # its clients' learned patience: admission/learned/patience.py).
    latency_budget: float | None = None
    patience_stated: bool = False  # the client said how long it waits (a header)
    admission_id: str | None = None
    replica: str | None = None
    reserved: int = 0
    admitted_at: float | None = None
    attempts: int = 0
    # (replica, failure kind) of an error answer that awaits the retry's outcome: charged
    # to that replica (outlier ejection) only if another one then completes the request.
    unjudged: tuple[str, str] | None = None
    # relay
    first_byte_at: float | None = None
    last_event_at: float | None = None
    events: int = 0
    generated: int = 0
    topup_at: int = 0
    usage_prompt: int | None = None
    usage_completion: int | None = None
    usage_cached: int | None = None  # prompt_tokens_details.cached_tokens: its prefix hit
    upstream_error: str | None = None  # failure kind once the stream had started
    # The stream's end was among the events relayed: chat's ``data: [DONE]``, the
    # Responses API's ``response.completed``, Anthropic's ``message_stop``.
    done_seen: bool = False
    # The engine's id of a stored response (the Responses API): later requests that
    # name it must reach the same replica.
    response_id: str | None = None
    # A non-stream request kvgate stopped waiting for (client gone, timeout) while the
    # engine had it: the engine may still be generating it (its reservation is held).
    upstream_abandoned: bool = False
    # The client stream once the relay has started it (a graceful shutdown ends it with
    # an error event), and whether shutdown cut this request.
    client_stream: Any = None
    cut: bool = False
    # Its client left before an answer began: its retry keeps its place in line
    # (admission/retries.py).
    left_unanswered: bool = False
    # When its client's connection was lost, as the transport saw it (None: not seen):
    # the instant a client that left left, however late its handler learned of it.
    left_at: float | None = None
    # outcome
    status: int = 0
    outcome: Outcome = UNKNOWN

    def __post_init__(self) -> None:
        if not self.req.request_id:
            self.req.request_id = self.request_id

    def admitted(self, a: Admit, now: float) -> None:
        """Record the admission `a` (the first, or a retry's on another replica)."""
        self.admission_id = a.request_id
        self.replica = a.replica
        self.reserved = a.reserved_tokens
        self.topup_at = a.reserved_tokens
        self.admitted_at = now


def blank_request(request_id: str) -> AdmissionRequest:
    """A request before its stages have filled it in (model, counts, class, chains)."""
    return AdmissionRequest(
        request_id=request_id, model="", expected_output=0, max_tokens=0, prompt_exact=False
    )
