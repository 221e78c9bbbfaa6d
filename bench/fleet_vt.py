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
back after its Retry-After, twice at most, as the openai SDKs do. A load balancer's
hashing spreads them unevenly (gateway g gets a share in proportion to 1/(g+1)), and the
spread turns around halfway. With more than one gateway, gateway 0 is killed at a third
of the run (its requests in flight and queued die with it, and their clients send them
again through the balancer with what is left of their timeouts; its leases stay until
their TTL) and a new process takes its place 5 s later.

Reported per cell (gateways x replicas): goodput (requests served in their timeout, of
those offered) and its ratio to one gateway on the same arrivals; the pool left idle
while requests waited (the mean free share of the fleet's pool over the instants a
request was queued, against one gateway's); the most any replica was overcommitted
(what all gateways held on it past its pool; target never); the wait from a request's
first arrival to its admission (p50, p90); requests lost (refused, or
shed past their retries or timeout); backend round trips and lease records written per second (one
renewal is one script call: one Redis round trip); one decision's cost (``submit``,
wall clock, p50 and p99). The requests a kill made their clients send again are counted
apart.

    PYTHONPATH=. .venv/bin/python bench/fleet_vt.py [--gateways 1 2 5 10 20] \\
        [--replicas 10 100 1000] [--seconds 30] [--load 0.8] [--seed 1]
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
from admission.types import AdmissionRequest, Admit, Queued, Shed
from bench.vtime import VirtualLoop
from gateway.config import StateConfig
from gateway.door import AdmissionDoor
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
STATE = StateConfig(backend="memory", lease_ttl_s=3.0, renew_interval_s=0.5)
TICK_S = 0.05  # StateSync.tick_s with these settings: the lease loop's wake-ups


@dataclass
class Work:
    at: float
    prompt: int
    output: int

    @property
    def service_s(self) -> float:
        return self.prompt / PREFILL_TPS + self.output * TPOT_S


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


@dataclass
class Gateway:
    door: AdmissionDoor
    sync: StateSync | None
    alive: bool = True
    inflight: dict[str, tuple[str, int, Work]] = field(default_factory=dict)  # admitted
    queued: dict[str, Work] = field(default_factory=dict)


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
    n_gw: int, n_rep: int, seconds: float, load: float, seed: int, kill: bool = True
) -> Result:
    rng = random.Random(seed)
    pools = {f"r{k}": SMALL_POOL * (2 if k % 2 else 1) for k in range(n_rep)}
    work = workload(seconds, sum(pools.values()), load, rng)
    clock = [0.0]
    loop = VirtualLoop(lambda: clock[0])
    backend = MemoryBackend(clock=lambda: clock[0])
    renew_calls, records = 0, 0
    config = AdmissionConfig(learn_limit=False)

    def new_gateway(name: str) -> Gateway:
        door = AdmissionDoor(AdmissionController(config, default_profile(seed=seed)), loop)
        for rep, pool in pools.items():
            state = ReplicaState(
                rep, "", ready=True, models=[MODEL], capacity_tokens=pool, max_running=MAX_RUNNING
            )
            door.upsert_replica(state, pinned_capacity=pool, max_running=MAX_RUNNING)
        sync = None
        if n_gw > 1:
            sync = StateSync(STATE, backend, door, holder=name, workers_hint=n_gw, loop=loop)
        return Gateway(door, sync)

    gws = [new_gateway(f"g{i}") for i in range(n_gw)]
    held = dict.fromkeys(pools, 0)  # what all gateways hold on each replica, as it is
    ends: list[tuple[float, int, str, int]] = []  # (end, seq, rid, gateway)
    retries: list[tuple[float, int, Work, str, int]] = []  # (when, seq, work, rid, attempt)
    served = lost = killed = 0
    decisions: list[float] = []
    waits: list[float] = []  # from a request's first arrival to its admission
    free_when_waiting: list[float] = []
    max_over = 0
    total_pool = sum(pools.values())
    seq = 0

    def admitted(g: int, rid: str, verdict: Admit, w: Work) -> None:
        nonlocal seq, max_over
        waits.append(clock[0] - w.at)
        gws[g].inflight[rid] = (verdict.replica, verdict.reserved_tokens, w)
        held[verdict.replica] += verdict.reserved_tokens
        max_over = max(max_over, held[verdict.replica] - pools[verdict.replica])
        seq += 1
        heapq.heappush(ends, (clock[0] + w.service_s, seq, rid, g))

    def shed(w: Work, rid: str, verdict: object, attempt: int) -> None:
        """A shed client comes back after its Retry-After, as the openai SDKs do (twice),
        while its timeout allows; a refusal, or a shed past that, is a request lost."""
        nonlocal lost, seq
        after = verdict.retry_after if isinstance(verdict, Shed) else math.inf
        if attempt < SDK_RETRIES and clock[0] + after < w.at + TIMEOUT_S:
            seq += 1
            heapq.heappush(retries, (clock[0] + after, seq, w, rid, attempt + 1))
        else:
            lost += 1

    def send(w: Work, rid: str, attempt: int = 0) -> None:
        """One attempt through a live gateway the balancer picks (by this moment's
        spread), with the deadline of the request's first arrival."""
        alive = [g for g in range(n_gw) if gws[g].alive]
        ws = weights(clock[0])
        g = rng.choices(alive, [ws[a] for a in alive])[0]
        req = AdmissionRequest(
            rid,
            MODEL,
            prompt_tokens=w.prompt,
            expected_output=w.output,
            max_tokens=w.output,
            arrival=w.at,
            deadline=w.at + TIMEOUT_S,
            latency_budget=TIMEOUT_S,
        )
        t0 = time.perf_counter()
        verdict = gws[g].door.submit(req)
        decisions.append(time.perf_counter() - t0)
        if isinstance(verdict, Admit):
            admitted(g, rid, verdict, w)
        elif isinstance(verdict, Queued):
            gws[g].queued[rid] = w

            # A killed gateway's door is never driven again: its waiters never fire.
            def done(fut: asyncio.Future, gw: Gateway = gws[g], g: int = g) -> None:
                gw.queued.pop(rid, None)
                v = fut.result()
                if isinstance(v, Admit):
                    admitted(g, rid, v, w)
                else:
                    shed(w, rid, v, attempt)

            gws[g].door.expect(rid).add_done_callback(done)
        else:
            shed(w, rid, verdict, attempt)

    def settle() -> None:
        loop.drain()

    def renew_due(force: bool = False) -> None:
        """Each live gateway's lease loop at its tick: a renewal where `renewal_due` says
        (or `force`: a process's first), client patience left out (no client leaves)."""
        nonlocal renew_calls, records
        for gw in gws:
            if gw.alive and gw.sync is not None:
                if force or gw.sync.renewal_due(clock[0]) is not None:
                    _finish(gw.sync.renew(patience=False))
                    renew_calls += 1
                    records += 2 * n_rep
        settle()

    def weights(t: float) -> list[float]:
        w = [1.0 / (i + 1) for i in range(n_gw)]
        return w if t < seconds / 2 else w[::-1]

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
            for rep, tokens, _ in gw.inflight.values():
                held[rep] -= tokens
            gw.inflight.clear()
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
            next_renew += TICK_S
            continue
        if nxt == next_sample:
            if any(gw.alive and gw.door.report.queue_depth() for gw in gws):
                free_when_waiting.append(1 - sum(held.values()) / total_pool)
            next_sample += SAMPLE_S
            waiting = any(gw.alive and gw.door.report.queue_depth() for gw in gws)
            if i >= len(work) and not ends and not waiting and not retries:
                break
            continue
        if ends and nxt == ends[0][0]:
            _, _, rid, g = heapq.heappop(ends)
            gw = gws[g]
            if rid not in gw.inflight:
                continue  # died with its gateway
            rep, tokens, _ = gw.inflight.pop(rid)
            held[rep] -= tokens
            served += 1
            gw.door.release(rid)
            settle()
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
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gateways", type=int, nargs="+", default=[1, 2, 5, 10, 20])
    ap.add_argument("--replicas", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-kill", action="store_true", help="no gateway is killed")
    ap.add_argument("--out", default="bench/results/fleet_vt.json")
    args = ap.parse_args()
    results: list[Result] = []
    for n_rep in args.replicas:
        one: Result | None = None
        for n_gw in sorted(set(args.gateways) | {1}):
            r = run_cell(n_gw, n_rep, args.seconds, args.load, args.seed, not args.no_kill)
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
                f"overcommit {r.max_overcommit_tokens}, lost {r.lost}, killed {r.killed}, "
                f"{r.round_trips_per_s:.0f} round trips/s, {r.records_per_s:.0f} records/s, "
                f"submit p50/p99 {r.decision_us_p50:.0f}/{r.decision_us_p99:.0f} us "
                f"[{r.wall_s:.0f} s]",
                flush=True,
            )
    Path(args.out).write_text(json.dumps([asdict(r) for r in results], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
