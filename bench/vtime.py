"""kvgate's admission core in front of a simulated engine, on one virtual clock.

The same `AdmissionController` the gateway runs, through the gateway's own door
(`gateway.door.AdmissionDoor`: its delivery of verdicts to queued requests' waiters, on a
loop whose clock is the virtual one), driving `enginesim`'s `EngineCore` directly, with
closed-loop clients that behave like the replay client and the openai SDK: each keeps
one request outstanding, sends its own timeout as the read-timeout
header would, honours Retry-After on a shed (up to `max_retries` when given), and gives
up an attempt after `timeout_s` (a disconnect: the engine aborts the request, admission
releases it without a completion sample). The engine's gauges reach admission every
`probe_s`, as discovery would deliver them. No wall clock, no IO: a whole seed-001 run
takes about a CPU second, so tests can assert on the learned limit and benches can sweep.
Of the gateway's own code it runs admission and its door, the account stage
(`gateway.accounting`: what an ended request tells admission) and the retry identity and
memory (`admission.retries`); the pipeline's calls into them are mirrored here, and
tests/admission/test_vtime_drives_the_gateway.py fails when the two drift.

`stoppers`: that many of the clients (the first ones) stop reading each stream after 1-6
token events (seeded), by design: a user pressing stop, an agent that read enough.

`slow` maps virtual time to a slowdown factor of the engine's steps (enginesim's `slow`
fault), for the shift experiments.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import random
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from admission.config import AdmissionConfig
from admission.controller import AdmissionController
from admission.fit import sized_exactly
from admission.learned.estimate import TokenEstimator
from admission.retries import identify
from admission.types import AdmissionRequest, Admit, Completion, Queued, Refuse, RequestEnd, Shed
from enginesim.core import EngineCore
from enginesim.profiles import load_profile
from enginesim.types import EventKind, SimRequest
from enginesim.workloads import WorkItem
from gateway import accounting
from gateway import outcome as ends
from gateway.context import RequestContext
from gateway.door import AdmissionDoor
from gateway.outcome import CLIENT_DISCONNECT, OK, Outcome
from gateway.stated import SDK_DEFAULT_MAX_RETRIES
from gateway.stream_reservation import StreamReservation
from routing.kvindex import token_block_hashes
from routing.scheduler import default_profile
from routing.types import ReplicaState

REPLICA = "r0"


@dataclass
class VtReport:
    requests: int
    completed: int = 0
    timed_out: int = 0  # attempts abandoned at the client timeout (retried or not)
    failed: int = 0  # shed on the last allowed retry, or refused
    retries: int = 0  # attempts sent again: after a shed's Retry-After or a timeout
    wall_s: float = 0.0
    tokens: int = 0  # prompt + completion tokens of completed requests
    latencies: list[float] = field(default_factory=list)  # first attempt to answer
    fail_after: list[float] = field(default_factory=list)  # first attempt to failure
    ttfts: list[float] = field(default_factory=list)
    decode_rates: list[float] = field(default_factory=list)  # per request, tokens/s after first
    preemptions: int = 0
    limits: list[tuple[float, int, str]] = field(default_factory=list)  # (t, limit, reason)
    max_running: int = 0
    underfed_s: float = 0.0  # time the replica ran below its limit with nothing queued
    # per timed-out attempt: (time, retries before it, queue wait before admission or None)
    timeouts: list[tuple[float, int, float | None]] = field(default_factory=list)
    stopped: int = 0  # streams a stopper closed after the events it wanted
    sheds: Counter = field(default_factory=Counter)  # sheds (retried or not) by client

    @property
    def retries_per_completed(self) -> float:
        return self.retries / self.completed if self.completed else float("inf")

    def quantile(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        s = sorted(self.latencies)
        return s[min(len(s) - 1, int(q * len(s)))]

    def limit_at(self, t: float) -> int:
        value = self.limits[0][1] if self.limits else 0
        for at, lim, _ in self.limits:
            if at > t:
                break
            value = lim
        return value


@dataclass
class _Attempt:
    client: int
    item: WorkItem
    first: float  # first attempt's start
    start: float
    retries: int
    rid: str
    admitted_at: float | None = None
    first_token: float | None = None
    done: bool = False
    events: int = 0  # token events received
    stop_after: int | None = None  # a stopper's: it closes the stream after this many
    estimated: int | None = None  # prompt + output reserved, when the output was a guess
    # The request as the gateway's stages fill it in (gateway/context.py): what its
    # account stage reads (`gateway.accounting.completion`, `attempt_end`).
    ctx: RequestContext | None = None


class VirtualLoop(asyncio.AbstractEventLoop):
    """The door's loop in virtual time: its clock is the simulation's, and the callbacks
    of the futures the door resolves run when the simulation drains them (`drain`), in
    the order the door resolved them, as a loop runs the waiters it woke. Nothing else of
    a loop is used."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._ready: deque[tuple[Callable[..., object], tuple[object, ...]]] = deque()
        self._draining = False

    def time(self) -> float:
        return self._clock()

    def get_debug(self) -> bool:
        return False

    def create_future(self) -> asyncio.Future:  # type: ignore[type-arg]
        return asyncio.Future(loop=self)

    def call_soon(self, callback, *args, context=None):  # type: ignore[no-untyped-def,override]
        self._ready.append((callback, args))

    def drain(self) -> None:
        """Run the callbacks due, in order; a callback that drains adds to this pass (as
        on a loop, where a waiter woken by another's doing runs after it, not inside it)."""
        if self._draining:
            return
        self._draining = True
        try:
            while self._ready:
                callback, args = self._ready.popleft()
                callback(*args)
        finally:
            self._draining = False


def run(
    profile: str,
    items: Sequence[WorkItem],
    *,
    concurrency: int,
    timeout_s: float,
    config: AdmissionConfig | None = None,
    send_timeout: bool = True,
    max_retries: int | None = None,
    stream: bool = False,
    slow: Callable[[float], float] | None = None,
    probe_s: float = 2.0,
    pool_tokens: int | None = None,
    max_running: int | None = None,
    seed: int = 0,
    time_limit_s: float = 1e6,
    retry_after_unit_s: float | None = None,
    stoppers: int = 0,
    timeout_backoff_s: Sequence[float] | None = None,
    straight: bool = False,
    arrivals: Sequence[float] | None = None,
    total_timeout: bool = False,
    fixed: int | None = None,
    sessions: Sequence[Sequence[WorkItem]] | None = None,
) -> VtReport:
    """Replay `items` through admission into one simulated replica of `profile`.
    `retry_after_unit_s`: clients read only the whole-second ``Retry-After`` header (a
    plain HTTP client; the openai SDKs read ``retry-after-ms``): the delay is rounded up
    to whole units of this many virtual seconds (1.0 at real time, 0.1 at a clock x10).
    `timeout_backoff_s`: a timed-out attempt is sent again after these delays (the n-th
    retry after the n-th), while `max_retries` allows, as bench/closed_loop.py's clients
    do; None: a timed-out attempt is lost.
    `straight`: the engine alone, as clients straight at it see it: every attempt goes to
    the engine at once and admission is never asked (a pass-through config is not that:
    it still measures the pool from the engine's KV usage and holds requests to it).
    `arrivals`: open loop: item i is first sent at ``arrivals[i]`` by a client of its own
    (`concurrency` is then unused). `total_timeout`: the client's `timeout_s` counts from
    its first attempt, the Retry-After waits included (it still states `timeout_s` per
    attempt): a retry told to wait past what is left is given up. `fixed`: with
    `straight`, at most this many attempts at the engine at once, the rest waiting in
    the client side's FIFO (a fixed-concurrency proxy). `sessions`: agentic sessions that
    all open at once, one client each sending its turns in order, each once the last is
    answered (`items` and `concurrency` are then unused)."""
    if sessions is not None:
        items = [item for turn in sessions for item in turn]
    prof = load_profile(profile)
    core = EngineCore(prof, seed=seed)
    cfg = config if config is not None else AdmissionConfig()
    ctrl = AdmissionController(cfg, default_profile(seed=seed), seed=seed)
    loop = VirtualLoop(lambda: now)
    door = AdmissionDoor(ctrl, loop)
    hooks = StreamReservation(door)
    est = TokenEstimator(cfg)
    model = prof.served_model_name
    state = ReplicaState(
        name=REPLICA,
        base_url="sim://" + REPLICA,
        ready=True,
        models=[model],
        capacity_tokens=prof.num_gpu_blocks * prof.block_size,
        block_size=prof.block_size,
        max_model_len=core.max_model_len,
        shares_prefix=core.enable_prefix_caching,  # as the vLLM adapter reads it
    )
    report = VtReport(requests=len(items))
    turns: list[deque[WorkItem]] = [deque(t) for t in sessions] if sessions is not None else []
    pending = [] if sessions is not None else list(reversed(items))
    live: dict[str, _Attempt] = {}
    held: deque[_Attempt] = deque()  # the fixed-concurrency proxy's FIFO
    in_engine = [0]  # attempts at the engine, when `straight`
    heap: list[tuple[float, int, str, object]] = []
    seq = itertools.count()
    now = 0.0
    reading = random.Random(seed)  # how many events each stopper's stream reads
    # The retry memory lives in admission; what clients' attempts do reaches it through
    # the door, as from gateway/pipeline.py: a request shed, or whose client left before
    # an answer began, keeps its first arrival when it comes back, and a plain client's
    # last attempt is known by its budget.

    def push(t: float, kind: str, data: object) -> None:
        heapq.heappush(heap, (t, next(seq), kind, data))

    def note_limit() -> None:
        lim = door.report.limit_of(REPLICA)
        if lim is None:
            return
        value = lim.allowed(max_running)
        if not report.limits or report.limits[-1][1] != value:
            report.limits.append((now, value, lim.reason))

    def start_engine(admits: Sequence[Admit]) -> None:
        for a in admits:
            att = live.get(a.request_id)
            if att is None or att.done:
                door.request_ended(RequestEnd(a.request_id))
                continue
            att.admitted_at = now
            if att.ctx is not None:  # as gateway/pipeline.py records an admission
                att.ctx.admitted(a, now)
                att.ctx.latency_budget = a.latency_budget  # stated, or learned
                door.answered(att.ctx.req, a)
            p = len(att.item.prompt_token_ids)
            core.add_request(
                SimRequest(
                    att.rid,
                    list(att.item.prompt_token_ids),
                    max(1, min(att.item.output_tokens, core.max_model_len - p)),
                    workload=att.item.workload,
                    output_len=att.item.output_tokens,
                ),
                now,
            )
        running = in_engine[0] if straight else door.report.running(REPLICA)
        report.max_running = max(report.max_running, running)

    def settled(fut: asyncio.Future) -> None:  # type: ignore[type-arg]
        """A queued request's waiter got its verdict from the door."""
        e = fut.result()
        if isinstance(e, Admit):
            start_engine([e])
        elif (att := live.get(e.request_id)) is not None:
            shed(att, e)

    def finish(att: _Attempt) -> None:
        att.done = True
        live.pop(att.rid, None)
        if turns and turns[att.client]:  # the session's next turn, once this one ended
            push(now, "send", (att.client, turns[att.client].popleft(), now, 0))
        elif pending and arrivals is None:
            push(now, "send", (att.client, pending.pop(), now, 0))
        elif not live and not any(k == "send" for _, _, k, _ in heap):
            report.wall_s = now

    def engine_freed(att: _Attempt) -> None:
        """The fixed-concurrency proxy starts the next attempt it holds."""
        if not straight or att.admitted_at is None:
            return
        in_engine[0] -= 1
        while held and in_engine[0] < fixed:
            nxt = held.popleft()
            if not nxt.done:
                in_engine[0] += 1
                start_engine([Admit(nxt.rid, REPLICA, 0)])

    def handle_verdict(att: _Attempt, verdict: object) -> None:
        if isinstance(verdict, Admit):
            start_engine([verdict])
        elif isinstance(verdict, Shed):
            shed(att, verdict)
        elif isinstance(verdict, Refuse):
            report.failed += 1
            report.fail_after.append(now - att.first)
            finish(att)
        else:
            assert isinstance(verdict, Queued)

    def shed(att: _Attempt, verdict: Shed) -> None:
        report.sheds[att.client] += 1
        if att.ctx is not None:
            door.answered(att.ctx.req, verdict)
        ended(att, ends.shed(verdict.reason))
        live.pop(att.rid, None)
        att.done = True
        if max_retries is not None and att.retries >= max_retries:
            report.failed += 1
            report.fail_after.append(now - att.first)
            finish(att)
            return
        delay = verdict.retry_after
        if retry_after_unit_s is not None:
            delay = max(1, math.ceil(delay / retry_after_unit_s)) * retry_after_unit_s
        if total_timeout and now + delay >= att.first + timeout_s:
            report.timed_out += 1  # its time ran out while it waited as it was told
            report.fail_after.append(now - att.first)
            finish(att)
            return
        report.retries += 1
        push(
            now + delay,
            "send",
            (att.client, att.item, att.first, att.retries + 1),
        )

    def send(client: int, item: WorkItem, first: float, retries: int) -> None:
        rid = f"{item.request_id}#{retries}"
        att = _Attempt(client, item, first, now, retries, rid)
        if stream and client < stoppers:
            att.stop_after = reading.randint(1, 6)
        live[rid] = att
        push((first if total_timeout else now) + timeout_s, "timeout", rid)
        if straight:
            if fixed is not None and in_engine[0] >= fixed:
                held.append(att)
                return
            in_engine[0] += 1
            start_engine([Admit(rid, REPLICA, 0)])
            return
        p = len(item.prompt_token_ids)
        bound = item.output_tokens
        req = AdmissionRequest(
            request_id=rid,
            model=model,
            prompt_tokens=p,
            # The replay client sends ignore_eos: a non-stream request's floor is its
            # bound, as the gateway reads it (gateway/pipeline.py, `_bound_output`).
            expected_output=est.expected_output(
                model, bound, core.max_model_len - p, floor=0 if stream else bound
            ),
            max_tokens=bound,
            margin=est.margin(model),
            # The prompt's prefix chain, as the gateway hashes it for a replica that shares
            # prefixes (its blocks in tokens here: the ids are what the harness has).
            prefix_hashes=chain(item) if state.shares_prefix else (),
            prefix_block_tokens=core.block_size if state.shares_prefix else 0,
            # Only the openai SDKs say which retry this is (kvgate assumes their default
            # budget); a plain client's last is known once its clients' budget is learned.
            last_retry=send_timeout and retries >= SDK_DEFAULT_MAX_RETRIES,
            latency_budget=timeout_s if send_timeout else None,
            stream=stream,
        )
        # The gateway's retry identity and memory (admission/retries.py): an SDK client
        # says which attempt it sends; a plain one is known when it comes back when told.
        count = retries if send_timeout else None
        ident = identify("default", model, item.request_id.encode(), count)
        if not sized_exactly(True, req.expected_output, bound, True):  # as the gateway
            att.estimated = p + req.expected_output
        att.ctx = RequestContext(rid, "chat", "/v1/chat/completions", arrival=now, req=req)
        att.ctx.patience_stated = send_timeout
        att.ctx.admission_id = rid
        verdict = door.submit(req, identity=ident, said=send_timeout)
        if isinstance(verdict, Queued):
            door.expect(rid).add_done_callback(settled)
        handle_verdict(att, verdict)
        loop.drain()

    chains: dict[str, tuple[int, ...]] = {}  # per item: a retry sends the same prompt

    def chain(item: WorkItem) -> tuple[int, ...]:
        if item.request_id not in chains:
            chains[item.request_id] = token_block_hashes(item.prompt_token_ids, core.block_size)
        return chains[item.request_id]

    def ended(att: _Attempt, outcome: Outcome) -> None:
        """The request ended with `outcome` as the gateway words it: what its account
        stage tells admission of its client (the gateway's own
        `gateway.accounting.attempt_end`)."""
        ctx = att.ctx
        if ctx is None:
            return
        ctx.outcome = outcome
        end = accounting.attempt_end(ctx, now)
        door.attempt_ended(end)
        if end.patience is not None:
            loop.drain()

    def upsert() -> None:
        door.upsert_replica(state, pinned_capacity=pool_tokens, max_running=max_running)
        loop.drain()

    upsert()
    note_limit()
    if arrivals is not None:
        for i, (at, item) in enumerate(zip(arrivals, items, strict=True)):
            push(at, "send", (i, item, at, 0))
        pending.clear()
    for c in range(min(concurrency, len(pending))):
        push(0.0, "send", (c, pending.pop(), 0.0, 0))
    for c, turn in enumerate(turns):  # every session opens at once
        push(0.0, "send", (c, turn.popleft(), 0.0, 0))
    push(probe_s, "probe", None)
    step_end: float | None = None
    step_events: list = []
    while (live or pending or any(k == "send" for _, _, k, _ in heap)) and now < time_limit_s:
        if step_end is None and core.has_work():
            res = core.step(now)
            factor = slow(now) if slow is not None else 1.0
            step_end = now + res.duration * factor
            step_events = res.events
            if res.duration == 0.0 and not res.events:
                step_end = None
        candidates = [heap[0][0]] if heap else []
        if step_end is not None:
            candidates.append(step_end)
        nd = door.next_deadline()
        if nd is not None:
            candidates.append(max(now, nd))
        if not candidates:
            break
        t = min(candidates)
        if t > now and (live or pending) and not straight:
            allowed = door.report.limit_allowed(REPLICA)
            idle = not door.report.queue_depth()
            if allowed is not None and door.report.running(REPLICA) < allowed and idle:
                report.underfed_s += t - now
        now = max(now, t)
        if step_end is not None and step_end <= now:
            step_end = None
            for ev in step_events:
                att = live.get(ev.request_id)
                if att is None:
                    continue
                if ev.kind is EventKind.TOKENS:
                    att.events += 1
                    if att.first_token is None:
                        att.first_token = now
                    if stream and att.ctx is not None:
                        # As the relay counts a stream's events and reports its first
                        # token and its outgrowing the reservation (the gateway's hooks).
                        ctx = att.ctx
                        ctx.events += 1
                        ctx.generated += 1
                        ctx.last_event_at = now
                        if ctx.first_byte_at is None:
                            ctx.first_byte_at = now
                            hooks.first_token(ctx)
                        if ctx.generated + ctx.req.prompt_tokens > ctx.topup_at:
                            hooks.outgrew(ctx)
                    if att.stop_after is not None and att.events >= att.stop_after:
                        # It read what it wanted and closes the stream (not a completion).
                        core.abort(att.rid, now)
                        engine_freed(att)
                        report.stopped += 1
                        ended(att, CLIENT_DISCONNECT)
                        door.request_ended(RequestEnd(att.rid))
                        loop.drain()
                        finish(att)
                        continue
                if ev.kind is EventKind.FINISHED:
                    assert att.admitted_at is not None
                    done: Completion | None = None
                    if att.ctx is not None:  # what the gateway's account stage reports
                        att.ctx.usage_prompt = ev.prompt_tokens
                        att.ctx.usage_completion = ev.completion_tokens
                        ended(att, OK)
                        done = accounting.completion(att.ctx, now)
                    est.observe_output(model, ev.completion_tokens)
                    if att.estimated is not None:
                        used = len(att.item.prompt_token_ids) + ev.completion_tokens
                        est.observe_estimated(model, att.estimated, used)
                    door.request_ended(RequestEnd(att.rid, done))
                    report.completed += 1
                    engine_freed(att)
                    report.tokens += ev.prompt_tokens + ev.completion_tokens
                    report.latencies.append(now - att.first)
                    report.ttfts.append((att.first_token or now) - att.admitted_at)
                    if (
                        att.first_token is not None
                        and ev.completion_tokens > 1
                        and now > att.first_token
                    ):
                        report.decode_rates.append(
                            (ev.completion_tokens - 1) / (now - att.first_token)
                        )
                    finish(att)
                    loop.drain()
                    note_limit()
            continue
        nd = door.next_deadline()
        if nd is not None and nd <= now:
            door.advance()
            loop.drain()
            continue
        _, _, kind, data = heapq.heappop(heap)
        if kind == "send":
            client, item, first, retries = data  # type: ignore[misc]
            send(client, item, first, retries)
        elif kind == "timeout":
            att = live.get(data)  # type: ignore[arg-type]
            # A stream's read timeout bounds its first token (later gaps are short).
            if att is not None and not att.done and not (stream and att.first_token):
                if att.admitted_at is not None:
                    core.abort(att.rid, now)
                    engine_freed(att)
                report.timed_out += 1
                report.timeouts.append(
                    (now, att.retries, att.admitted_at - att.start if att.admitted_at else None)
                )
                att.done = True
                live.pop(att.rid, None)
                # It left before an answer began: the gateway remembers it as unserved.
                if att.ctx is not None:
                    att.ctx.left_unanswered = True
                # What the gateway's account stage makes of a client that left
                # (gateway/accounting.py, `completion` and `attempt_end`).
                ended(att, CLIENT_DISCONNECT)
                gone = accounting.completion(att.ctx, now) if att.ctx is not None else None
                door.withdraw(att.rid)  # its handler's waiter is gone, as in the gateway
                door.request_ended(RequestEnd(att.rid, gone))
                loop.drain()
                if (
                    timeout_backoff_s is not None
                    and not total_timeout  # its whole call's time is out
                    and (max_retries is None or att.retries < max_retries)
                ):
                    report.retries += 1
                    delay = timeout_backoff_s[min(att.retries, len(timeout_backoff_s) - 1)]
                    push(now + delay, "send", (att.client, att.item, att.first, att.retries + 1))
                else:
                    report.fail_after.append(now - att.first)  # it gives up: a failure
                    finish(att)
        elif kind == "probe":
            st = core.stats()
            state.engine_running = st.num_running
            state.engine_waiting = st.num_waiting
            state.kv_usage = st.kv_usage
            state.preemptions_total = float(st.num_preemptions)
            state.updated_at = now
            upsert()
            note_limit()
            if live or pending:
                push(now + probe_s, "probe", None)
    report.wall_s = report.wall_s or now
    report.preemptions = core.stats().num_preemptions
    return report
