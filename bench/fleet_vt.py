"""Many gateways in front of many replicas, in virtual time, on the gateway's own code
(issue 50 item 1).

Each gateway is what ``kvgate serve`` runs for admission and sharing: an
`AdmissionController` behind its `AdmissionDoor` (on a `VirtualLoop`, as bench/vtime.py
drives it) and a `StateSync` lease loop, asked at each of its ticks whether a renewal is
due (`StateSync.renewal_due`: the interval's, or an early one for requests queued behind
a slice), as its task does.
They share one `MemoryBackend`: its lease arithmetic is lease.lua's (`admission.lease.grant`;
tests/state/test_contract.py holds the two equal on a real Redis), on the same clock.

The replicas are pools, not engines: a request holds what admission reserved for it from
its admission until its service ends (its prompt at ``PREFILL_TPS``, then its output at
one token per ``TPOT_S``), so the questions asked are the leases' own: how much of a
pool stays idle while requests wait behind another gateway's slice, and whether the
gateways together ever hold more of a pool than it has. Half the replicas are twice as
large as the other half. The learned running limit is off (``learn_limit: false``): with
no engine signals it would only hold replicas at its start; the pools bound admission.

Load: open-loop Poisson arrivals at ``--load`` of the fleet's KV capacity (token-seconds
a request holds, on average), prompts of 200-4,000 tokens and outputs of 20-400, each
stating a 20 s timeout (admission sheds what cannot start in it); a shed client comes
back after its Retry-After, twice at most, as the openai SDKs do, saying which attempt it
sends: each gateway's own retry memory (admission/retries.py) knows a retry it shed, and
a retry the balancer sends to another gateway is new there. A client leaves at its first
arrival's deadline, wherever its attempt then is (queued, or served too late). A load
balancer's hashing spreads them unevenly (gateway g gets a share in proportion to
1/(g+1)), and the spread turns around halfway. With more than one gateway, gateway 0 is
killed at a third of the run (its requests in flight and queued die with it, and their
clients send them again through the balancer with what is left of their timeouts; its
leases stay until their TTL) and a new process takes its place 5 s later.

With ``--engines PROFILE`` the replicas are enginesim's engines instead (`EngineCore`,
what `enginesim serve` runs, stepped on this clock at ``--speed`` times it) and the
requests seed 001's (`seed2_workload`, prompts as token ids) at ``--load`` of the fleet's
best requests/s, each stating seed 001's 45 s (engine seconds) as its timeout: the cells
of bench/fleet_real.py, which runs the same on real processes. The gateways then run the
configuration a new user writes (the learned running limit on), fed what the gateway
feeds it: each engine's counters at every discovery round (``refresh_interval_s``, 2 s,
staggered over the gateways) and every completion, a client that gave up at its timeout
as a failure (gateway/accounting.py); a client that gives up has its request aborted in
the engine. Preemptions are counted.

Reported per cell (gateways x replicas): goodput (requests served in their timeout, of
those offered) and its ratio to one gateway on the same arrivals; the pool left idle
while requests waited (the mean free share of the fleet's pool over the instants a
request was queued, against one gateway's); the most any replica was overcommitted
(what all gateways held on it past its pool; target never); the wait from a request's
first arrival to its admission (p50, p90), and a served one's from first arrival to its
end (p50, p90); requests lost (refused, or
shed past their retries or timeout); backend round trips and lease records written per second (one
renewal is one script call: one Redis round trip); one decision's cost (``submit``,
wall clock, p50 and p99). The requests a kill made their clients send again are counted
apart.

    PYTHONPATH=. .venv/bin/python bench/fleet_vt.py [--gateways 1 2 5 10 20] \\
        [--replicas 10 100 1000] [--seconds 30] [--load 0.8] [--seed 1] \\
        [--engines seed2-8b-16gb [--speed 5]] [--renew-interval 0.5]
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from admission.config import AdmissionConfig
from admission.controller import AdmissionController
from admission.retries import identify
from admission.types import AdmissionRequest, Admit, Queued, RequestEnd, Shed
from bench.vtime import VirtualLoop
from enginesim.core import EngineCore
from enginesim.profiles import load_profile
from enginesim.simulate import run_closed_loop
from enginesim.types import EventKind, SimRequest, StepResult
from enginesim.workloads import WorkItem, seed2_workload
from gateway.accounting import attempt_end, completion
from gateway.config import StateConfig
from gateway.context import RequestContext
from gateway.door import AdmissionDoor
from gateway.outcome import CLIENT_DISCONNECT, OK, Outcome
from gateway.outcome import shed as shed_outcome
from gateway.state import MemoryBackend
from gateway.state.sharing import StateSync
from routing.scheduler import default_profile
from routing.types import ReplicaState

MODEL = "m"
SMALL_POOL = 16_384  # tokens; the large replicas have twice this
MAX_RUNNING = 64
PREFILL_TPS = 8_000.0
TPOT_S = 0.015
TIMEOUT_S = 20.0
RESTART_AFTER_S = 5.0
SDK_RETRIES = 2  # the openai SDKs' default max_retries
SAMPLE_S = 0.1
RENEW_S = 0.5  # state.renew_interval_s's default (its lease_ttl_s, 3 s, is kept)
REFRESH_S = 2.0  # replicas.refresh_interval_s's default: a gateway's discovery rounds


@dataclass
class Work:
    at: float
    prompt: int
    output: int
    ids: list[int] | None = None  # the prompt's tokens, for an engine
    n: int = 0  # its index in the run: its body, as the retry memory hashes it

    @property
    def body(self) -> bytes:
        return b"w%d" % self.n

    @property
    def service_s(self) -> float:
        return self.prompt / PREFILL_TPS + self.output * TPOT_S


@dataclass(frozen=True)
class Engines:
    """Replicas that are enginesim engines (`EngineCore`, what `enginesim serve` runs)
    of `profile`, their clocks `speed` times the gateways': bench/fleet_real.py's
    replicas, for its cells' virtual-time counterpart. The requests are then seed 001's
    (`seed2_workload`), stating seed 001's client timeout in the engine's seconds."""

    profile: str = "seed2-8b-16gb"
    speed: float = 5.0
    timeout_s: float = 45.0  # engine seconds: seed 001's client (kvgate_demo.demo)

    def capacity_rps(self, seed: int) -> float:
        """One replica's best requests/s on these requests, in the engine's seconds."""
        items = seed2_workload(200, seed=seed + 1000)
        best = 0.0
        for c in (4, 8, 12, 16, 24):
            r = run_closed_loop(self.profile, items, c, self.timeout_s)
            best = max(best, r.completed / r.wall_time)
        return best

    def arrivals(
        self, seconds: float, replicas: int, load: float, seed: int
    ) -> list[tuple[float, WorkItem]]:
        """Poisson arrival times (gateway seconds) at `load` of the fleet's best
        requests/s, each with its request (bench/fleet_real.py sends the same)."""
        rate = load * self.capacity_rps(seed) * self.speed * replicas
        rng = random.Random(seed)
        at, t = [], 0.0
        while True:
            t += rng.expovariate(rate)
            if t >= seconds:
                break
            at.append(t)
        return list(zip(at, seed2_workload(len(at), seed=seed), strict=True))

    def workload(self, seconds: float, replicas: int, load: float, seed: int) -> list[Work]:
        return [
            Work(t, len(it.prompt_token_ids), it.output_tokens, it.prompt_token_ids)
            for t, it in self.arrivals(seconds, replicas, load, seed)
        ]


def workload(seconds: float, capacity: int, load: float, rng: random.Random) -> list[Work]:
    """Poisson arrivals whose mean KV occupancy is `load` of `capacity`."""
    mean_tokens = 2_100 + 210  # the means of the two uniform draws below
    mean_hold = 2_100 / PREFILL_TPS + 210 * TPOT_S
    rate = load * capacity / (mean_tokens * mean_hold)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        out.append(Work(t, rng.randint(200, 4_000), rng.randint(20, 400)))


def spread(gateways: int, t: float, seconds: float) -> list[float]:
    """The load balancer's weights at `t`: gateway g in proportion to 1/(g+1), as
    hashing spreads clients unevenly, turned around at half of `seconds`."""
    w = [1.0 / (i + 1) for i in range(gateways)]
    return w if t < seconds / 2 else w[::-1]


@dataclass
class Gateway:
    door: AdmissionDoor
    sync: StateSync | None
    alive: bool = True
    inflight: dict[str, tuple[str, int, Work]] = field(default_factory=dict)  # admitted
    queued: dict[str, Work] = field(default_factory=dict)
    # Each attempt's context while its handler holds it, as the pipeline keeps it.
    ctxs: dict[str, RequestContext] = field(default_factory=dict)


@dataclass
class Result:
    gateways: int
    replicas: int
    offered: int
    served: int
    lost: int
    killed: int
    goodput: float
    idle_while_waiting: float
    max_overcommit_tokens: int
    round_trips_per_s: float
    records_per_s: float
    wait_p50_s: float
    wait_p90_s: float
    decision_us_p50: float
    decision_us_p99: float
    wall_s: float
    preemptions: int = 0
    latency_p50_s: float = 0.0
    latency_p90_s: float = 0.0
    lost_by: dict[str, int] = field(default_factory=dict)
    # The first lost requests: when each arrived and was lost (s), why, its attempt (0:
    # the first; None: timed out while served), its tokens and the gateway that lost it.
    lost_detail: list[dict[str, object]] = field(default_factory=list)
    # Retries sent (after a shed), and of them those their gateway knew for retries
    # (its retry memory recalled their first arrival): a retry another gateway shed is new.
    retries: int = 0
    retries_known: int = 0
    goodput_vs_one: float | None = None
    idle_vs_one: float | None = None


def _quantile(xs: list[float], q: float) -> float:
    return sorted(xs)[int(q * (len(xs) - 1))] if xs else 0.0


def _finish(coro: object) -> None:
    """Run a coroutine that never waits (the memory backend answers at once) to its end."""
    try:
        coro.send(None)  # type: ignore[attr-defined]
    except StopIteration:
        return
    raise RuntimeError("a renewal waited: the memory backend should answer at once")


def run_cell(
    n_gw: int,
    n_rep: int,
    seconds: float,
    load: float,
    seed: int,
    kill: bool = True,
    engines: Engines | None = None,
    renew_s: float = RENEW_S,
) -> Result:
    rng = random.Random(seed)
    cores: dict[str, EngineCore] = {}
    if engines is None:
        pools = {f"r{k}": SMALL_POOL * (2 if k % 2 else 1) for k in range(n_rep)}
        max_running = MAX_RUNNING
        work = workload(seconds, sum(pools.values()), load, rng)
        timeout = TIMEOUT_S
    else:
        profile = load_profile(engines.profile)
        cores = {f"r{k}": EngineCore(profile, seed=k) for k in range(n_rep)}
        pools = {r: (c.num_gpu_blocks - c.null_blocks) * c.block_size for r, c in cores.items()}
        max_running = profile.max_num_seqs
        work = engines.workload(seconds, n_rep, load, seed)
        timeout = engines.timeout_s / engines.speed
    for n, w in enumerate(work):
        w.n = n
    sharing = StateConfig(backend="memory", lease_ttl_s=3.0, renew_interval_s=renew_s)
    clock = [0.0]
    loop = VirtualLoop(lambda: clock[0])
    backend = MemoryBackend(clock=lambda: clock[0])
    renew_calls, records = 0, 0
    # With engines, the configuration a new user writes (the learned limit on), fed what
    # the gateway feeds it: the engines' counters each discovery round, and completions.
    config = AdmissionConfig(learn_limit=False) if engines is None else AdmissionConfig()

    def probe(door: AdmissionDoor) -> None:
        """A discovery round: what the vLLM adapter reads of each engine."""
        for rep, core in cores.items():
            st = core.stats()
            state = ReplicaState(
                rep,
                "",
                ready=True,
                models=[MODEL],
                capacity_tokens=pools[rep],
                shares_prefix=True,
                engine_running=st.num_running,
                engine_waiting=st.num_waiting,
                kv_usage=st.kv_usage,
                preemptions_total=float(st.num_preemptions),
            )
            door.upsert_replica(state)

    def new_gateway(name: str) -> Gateway:
        # Seeded: its Retry-After jitter is random, and a cell is exact for its seed.
        ctrl = AdmissionController(config, default_profile(seed=seed), seed=seed + len(gws))
        door = AdmissionDoor(ctrl, loop)
        if engines is not None:
            probe(door)
        for rep, pool in pools.items() if engines is None else ():
            state = ReplicaState(
                rep, "", ready=True, models=[MODEL], capacity_tokens=pool, max_running=max_running
            )
            door.upsert_replica(state, pinned_capacity=pool, max_running=max_running)
        sync = None
        if n_gw > 1:
            sync = StateSync(sharing, backend, door, holder=name, workers_hint=n_gw, loop=loop)
        return Gateway(door, sync)

    gws: list[Gateway] = []
    gws.extend(new_gateway(f"g{i}") for i in range(n_gw))
    first_sync = gws[0].sync
    tick_s = first_sync.tick_s if first_sync is not None else math.inf  # its loop's wake-ups
    held = dict.fromkeys(pools, 0)  # what all gateways hold on each replica, as it is
    ends: list[tuple[float, int, str, int]] = []  # (end, seq, rid, gateway)
    # Engines: the step each is running (its end on the gateways' clock), and the
    # instants admitted requests' clients give up on them.
    stepping: dict[str, StepResult] = {}
    steps: list[tuple[float, int, str]] = []  # (end, seq, replica)
    # Each attempt's client leaves at its first arrival's deadline, wherever it is then.
    give_ups: list[tuple[float, int, str, int]] = []  # (deadline, seq, rid, gateway)
    owner: dict[str, int] = {}  # rid -> gateway, while an engine has it
    probes: list[tuple[float, int]] = []  # (when, gateway): its next discovery round
    if engines is not None:
        probes = [(REFRESH_S * (g + 1) / n_gw, g) for g in range(n_gw)]
        heapq.heapify(probes)
    preemptions = 0
    lost_by: dict[str, int] = {}  # why: a shed's reason, or its client's timeout
    lost_detail: list[dict[str, object]] = []

    def lose(why: str, w: Work, attempt: int | None, g: int) -> None:
        nonlocal lost
        lost += 1
        lost_by[why] = lost_by.get(why, 0) + 1
        if len(lost_detail) < 20:
            lost_detail.append(
                {
                    "arrived_s": round(w.at, 3),
                    "lost_s": round(clock[0], 3),
                    "why": why,
                    "attempt": attempt,
                    "tokens": w.prompt + w.output,
                    "gateway": g,
                }
            )

    retries: list[tuple[float, int, Work, str, int]] = []  # (when, seq, work, rid, attempt)
    served = lost = killed = 0
    retried = known = 0  # retries sent, and those their gateway knew for retries
    decisions: list[float] = []
    waits: list[float] = []  # from a request's first arrival to its admission
    latencies: list[float] = []  # from a served request's first arrival to its end
    free_when_waiting: list[float] = []
    max_over = 0
    total_pool = sum(pools.values())
    seq = 0

    def admitted(g: int, rid: str, verdict: Admit, w: Work) -> None:
        nonlocal seq, max_over
        waits.append(clock[0] - w.at)
        gws[g].inflight[rid] = (verdict.replica, verdict.reserved_tokens, w)
        ctx = gws[g].ctxs[rid]
        ctx.admitted(verdict, clock[0])
        ctx.latency_budget = verdict.latency_budget
        held[verdict.replica] += verdict.reserved_tokens
        max_over = max(max_over, held[verdict.replica] - pools[verdict.replica])
        seq += 1
        if engines is None:
            heapq.heappush(ends, (clock[0] + w.service_s, seq, rid, g))
            return
        assert w.ids is not None
        core = cores[verdict.replica]
        core.add_request(
            SimRequest(rid, w.ids, w.output, ignore_eos=True), clock[0] * engines.speed
        )
        owner[rid] = g
        kick(verdict.replica)

    def kick(rep: str) -> None:
        """Start the replica's next step if it is idle and has work."""
        nonlocal seq
        assert engines is not None
        if rep in stepping or not cores[rep].has_work():
            return
        res = cores[rep].step(clock[0] * engines.speed)
        if res.duration == 0.0:
            return  # nothing it can schedule until something ends
        stepping[rep] = res
        seq += 1
        heapq.heappush(steps, (clock[0] + res.duration / engines.speed, seq, rep))

    def release(g: int, rid: str, outcome: Outcome, teach: bool = True) -> None:
        """The attempt's end as the pipeline's `release` tells it: what its client did
        (gateway/accounting.py's `attempt_end`), then its admission given back with what
        it says of its replica (`completion`; the pools' say nothing: `teach` false)."""
        gw = gws[g]
        ctx = gw.ctxs.pop(rid)
        ctx.outcome = outcome
        if outcome == CLIENT_DISCONNECT:
            ctx.left_at = clock[0]
            ctx.left_unanswered = True  # a whole answer: none of it had begun
        gw.door.attempt_ended(attempt_end(ctx, clock[0]))
        gw.door.withdraw(rid)  # a queued one's waiter is gone with its handler
        done = completion(ctx, clock[0]) if teach else None
        gw.door.request_ended(RequestEnd(rid, done))
        settle()

    def ended(rid: str, g: int, in_time: bool) -> None:
        """An engine's request's end: served, or its client gave up at its deadline."""
        nonlocal served
        gw = gws[g]
        rep, tokens, w = gw.inflight.pop(rid)
        held[rep] -= tokens
        owner.pop(rid, None)
        if in_time:
            served += 1
            latencies.append(clock[0] - w.at)
            ctx = gw.ctxs[rid]
            ctx.usage_prompt, ctx.usage_completion = w.prompt, w.output
        else:
            lose("timeout", w, None, g)
            assert engines is not None  # only an engine's request ends here
            cores[rep].abort(rid, clock[0] * engines.speed)
            kick(rep)
        release(g, rid, OK if in_time else CLIENT_DISCONNECT)

    def shed(w: Work, rid: str, verdict: object, attempt: int, g: int) -> None:
        """A shed client comes back after its Retry-After, as the openai SDKs do (twice),
        while its timeout allows; a refusal, or a shed past that, is a request lost."""
        nonlocal seq
        after = verdict.retry_after if isinstance(verdict, Shed) else math.inf
        why = verdict.reason if isinstance(verdict, Shed) else type(verdict).__name__
        release(g, rid, shed_outcome(why))
        if attempt < SDK_RETRIES and clock[0] + after < w.at + timeout:
            seq += 1
            heapq.heappush(retries, (clock[0] + after, seq, w, rid, attempt + 1))
        else:
            why += "" if attempt < SDK_RETRIES else " (last retry)"
            lose(why, w, attempt, g)

    def send(w: Work, rid: str, attempt: int = 0) -> None:
        """One attempt through a live gateway the balancer picks (by this moment's
        spread), as an openai SDK client sends it: stating its timeout (the whole of it,
        on every attempt) and which retry it is (``x-stainless-retry-count``), which the
        gateway's own retry memory reads (admission/retries.py). The client leaves at
        its first arrival's deadline, wherever its attempt then is."""
        nonlocal seq, retried, known
        alive = [g for g in range(n_gw) if gws[g].alive]
        ws = spread(n_gw, clock[0], seconds)
        g = rng.choices(alive, [ws[a] for a in alive])[0]
        # What the pipeline builds of it (gateway/pipeline.py, gateway/stated.py).
        req = AdmissionRequest(
            rid,
            MODEL,
            prompt_tokens=w.prompt,
            expected_output=w.output,
            max_tokens=w.output,
            arrival=clock[0],
            latency_budget=timeout,
            last_retry=attempt >= SDK_RETRIES,
        )
        ctx = RequestContext(rid, "chat", "/v1/chat/completions", arrival=clock[0], req=req)
        ctx.patience_stated = True
        ctx.admission_id = rid
        gws[g].ctxs[rid] = ctx
        seq += 1
        heapq.heappush(give_ups, (w.at + timeout, seq, rid, g))
        ident = identify("default", MODEL, w.body, attempt)
        t0 = time.perf_counter()
        verdict = gws[g].door.submit(req, identity=ident, said=True)
        decisions.append(time.perf_counter() - t0)
        if attempt > 0:
            retried += 1
            known += req.recalled
        if not isinstance(verdict, Queued):
            gws[g].door.answered(req, verdict)  # as `AdmissionDoor.admit` tells it
        if isinstance(verdict, Admit):
            admitted(g, rid, verdict, w)
        elif isinstance(verdict, Queued):
            gws[g].queued[rid] = w

            # A killed gateway's door is never driven again: its waiters never fire.
            def done(fut: asyncio.Future, gw: Gateway = gws[g], g: int = g) -> None:
                gw.queued.pop(rid, None)
                v = fut.result()
                gw.door.answered(req, v)
                if isinstance(v, Admit):
                    admitted(g, rid, v, w)
                else:
                    shed(w, rid, v, attempt, g)

            gws[g].door.expect(rid).add_done_callback(done)
        else:
            shed(w, rid, verdict, attempt, g)

    def settle() -> None:
        loop.drain()

    def renew_due(force: bool = False) -> None:
        """Each live gateway's lease loop at its tick: a renewal where `renewal_due` says
        (or `force`: a process's first), the interval's with client patience, as the
        loop's task renews (`StateSync._run`)."""
        nonlocal renew_calls, records
        for gw in gws:
            if gw.alive and gw.sync is not None:
                due = True if force else gw.sync.renewal_due(clock[0])
                if due is not None:
                    _finish(gw.sync.renew(patience=due))
                    renew_calls += 1
                    records += 2 * n_rep
        settle()

    kill_at = seconds / 3 if n_gw > 1 and kill else math.inf
    restart_at = kill_at + RESTART_AFTER_S
    next_renew = 0.0
    next_sample = 0.0
    i = 0
    wall = time.perf_counter()
    while True:
        deadlines = [gw.door.next_deadline() for gw in gws if gw.alive]
        nxt = min(
            min((d for d in deadlines if d is not None), default=math.inf),
            work[i].at if i < len(work) else math.inf,
            retries[0][0] if retries else math.inf,
            ends[0][0] if ends else math.inf,
            steps[0][0] if steps else math.inf,
            probes[0][0] if probes else math.inf,
            give_ups[0][0] if give_ups else math.inf,
            next_renew if n_gw > 1 else math.inf,
            next_sample,
            kill_at,
            restart_at,
        )
        clock[0] = nxt
        for gw in gws:
            due = gw.door.next_deadline() if gw.alive else None
            if due is not None and due <= nxt:
                gw.door.advance()  # expiries: queued requests whose time ran out
        settle()
        if nxt == kill_at:
            gw = gws[0]
            gw.alive = False
            # Its clients' connections drop: the engines abort their requests, and each
            # client sends its request again through the balancer, to a live gateway.
            again = [w for _, _, w in gw.inflight.values()] + list(gw.queued.values())
            for rid, (rep, tokens, _) in gw.inflight.items():
                held[rep] -= tokens
                if owner.pop(rid, None) is not None:
                    assert engines is not None
                    cores[rep].abort(rid, clock[0] * engines.speed)
                    kick(rep)
            gw.inflight.clear()
            gw.queued.clear()
            gw.ctxs.clear()
            killed += len(again)
            kill_at = math.inf
            for k, w in enumerate(again):
                send(w, f"again{k}")
            settle()
            continue
        if nxt == restart_at:
            gws[0] = new_gateway("g0-restarted")
            restart_at = math.inf
            renew_due(force=True)
            continue
        if n_gw > 1 and nxt == next_renew:
            renew_due(force=next_renew == 0.0)
            next_renew += tick_s
            continue
        if nxt == next_sample:
            if any(gw.alive and gw.door.report.queue_depth() for gw in gws):
                free_when_waiting.append(1 - sum(held.values()) / total_pool)
            next_sample += SAMPLE_S
            waiting = any(gw.alive and gw.door.report.queue_depth() for gw in gws)
            if i >= len(work) and not ends and not waiting and not retries and not owner:
                probes.clear()
                break
            continue
        if steps and nxt == steps[0][0]:
            _, _, rep = heapq.heappop(steps)
            res = stepping.pop(rep)
            for ev in res.events:
                if ev.kind is EventKind.PREEMPTED:
                    preemptions += 1
                elif ev.kind is EventKind.FINISHED and ev.request_id in owner:
                    ended(ev.request_id, owner[ev.request_id], True)
            kick(rep)
            continue
        if probes and nxt == probes[0][0]:
            _, g = heapq.heappop(probes)
            if gws[g].alive:
                probe(gws[g].door)
                settle()
            heapq.heappush(probes, (nxt + REFRESH_S, g))
            continue
        if give_ups and nxt == give_ups[0][0]:
            _, _, rid, g = heapq.heappop(give_ups)
            gw = gws[g]
            if rid in gw.queued:  # it left while it waited
                lose("timeout (queued)", gw.queued.pop(rid), None, g)
                release(g, rid, CLIENT_DISCONNECT)
            elif rid in gw.inflight and engines is not None:
                ended(rid, g, False)
            elif rid in gw.inflight:  # a pool's: its reservation returns as it leaves
                rep, tokens, w = gw.inflight.pop(rid)
                held[rep] -= tokens
                lose("timeout", w, None, g)
                release(g, rid, CLIENT_DISCONNECT, teach=False)
            continue
        if ends and nxt == ends[0][0]:
            _, _, rid, g = heapq.heappop(ends)
            gw = gws[g]
            if rid not in gw.inflight:
                continue  # died with its gateway
            rep, tokens, w = gw.inflight.pop(rid)
            held[rep] -= tokens
            served += 1
            latencies.append(clock[0] - w.at)
            release(g, rid, OK, teach=False)
            continue
        if retries and nxt == retries[0][0]:
            _, _, w, rid, attempt = heapq.heappop(retries)
            send(w, f"{rid}.{attempt}", attempt)
            continue
        if i >= len(work) or nxt != work[i].at:
            continue  # a queued request's deadline: the doors' expiries above were it
        w = work[i]
        i += 1
        send(w, f"q{i}")
    wall = time.perf_counter() - wall
    offered = len(work)
    decisions.sort()
    return Result(
        gateways=n_gw,
        replicas=n_rep,
        offered=offered,
        served=served,
        lost=lost,
        killed=killed,
        goodput=served / offered if offered else 0.0,
        idle_while_waiting=statistics.fmean(free_when_waiting) if free_when_waiting else 0.0,
        max_overcommit_tokens=max(0, max_over),
        round_trips_per_s=renew_calls / seconds,
        records_per_s=records / seconds,
        wait_p50_s=_quantile(waits, 0.5),
        wait_p90_s=_quantile(waits, 0.9),
        decision_us_p50=1e6 * decisions[len(decisions) // 2],
        decision_us_p99=1e6 * decisions[int(len(decisions) * 0.99)],
        wall_s=wall,
        preemptions=preemptions,
        latency_p50_s=_quantile(latencies, 0.5),
        latency_p90_s=_quantile(latencies, 0.9),
        lost_by=lost_by,
        lost_detail=lost_detail,
        retries=retried,
        retries_known=known,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gateways", type=int, nargs="+", default=[1, 2, 5, 10, 20])
    ap.add_argument("--replicas", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-kill", action="store_true", help="no gateway is killed")
    ap.add_argument(
        "--engines",
        metavar="PROFILE",
        help="replicas are enginesim engines of this profile on seed 001's requests "
        "(bench/fleet_real.py's cells)",
    )
    ap.add_argument("--speed", type=float, default=5.0, help="with --engines: their clock")
    ap.add_argument(
        "--renew-interval",
        type=float,
        default=RENEW_S,
        help="state.renew_interval_s (lease_ttl_s stays 3 s)",
    )
    ap.add_argument("--out", default="bench/results/fleet_vt.json")
    args = ap.parse_args()
    results: list[Result] = []
    for n_rep in args.replicas:
        one: Result | None = None
        for n_gw in sorted(set(args.gateways) | {1}):
            engines = Engines(args.engines, args.speed) if args.engines else None
            r = run_cell(
                n_gw,
                n_rep,
                args.seconds,
                args.load,
                args.seed,
                not args.no_kill,
                engines,
                args.renew_interval,
            )
            if n_gw == 1:
                one = r
            assert one is not None
            r.goodput_vs_one = r.goodput / one.goodput if one.goodput else None
            r.idle_vs_one = r.idle_while_waiting - one.idle_while_waiting
            if n_gw in args.gateways:
                results.append(r)
            print(
                f"{n_gw:>3} gw x {n_rep:>5} rep: {r.offered} offered, {r.served} served, "
                f"goodput {r.goodput:.3f} "
                f"({r.goodput_vs_one:.3f}x one), idle while waiting "
                f"{r.idle_while_waiting:.3f} (one: {one.idle_while_waiting:.3f}), "
                f"wait p50/p90 {r.wait_p50_s:.2f}/{r.wait_p90_s:.2f} s, "
                f"latency p50/p90 {r.latency_p50_s:.2f}/{r.latency_p90_s:.2f} s, "
                f"overcommit {r.max_overcommit_tokens}, lost {r.lost} {r.lost_by or ''}, "
                f"killed {r.killed}, retries {r.retries} ({r.retries_known} known), "
                f"{r.round_trips_per_s:.0f} round trips/s, {r.records_per_s:.0f} records/s, "
                f"submit p50/p99 {r.decision_us_p50:.0f}/{r.decision_us_p99:.0f} us, "
                f"preemptions {r.preemptions} "
                f"[{r.wall_s:.0f} s]",
                flush=True,
            )
    Path(args.out).write_text(json.dumps([asdict(r) for r in results], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
