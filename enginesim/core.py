"""The sans-IO engine core: KV pool, scheduler and roofline step time on a virtual clock.

`EngineCore` is a synchronous state machine. A driver (the live server, or the
virtual-time simulator) calls `add_request` / `abort` with `now` and then `step(now)`,
which plans one engine step starting at `now`, computes its duration from the roofline
model, applies its effects, and returns the events that happen at `now + duration`.

Two scheduler shapes are modelled:

* vLLM (default, V1-shaped): one token budget per step (`max_num_batched_tokens`) that
  running requests consume first (decodes, and the next chunk of partially prefilled
  prompts), then waiting requests in FCFS order, each admitted only if its prompt's
  blocks fit in the pool (head-of-line blocking, like vLLM). When a running request
  cannot get a block for its next token, the newest running request is preempted by
  recompute: its blocks are freed and it returns to the front of the waiting queue, to be
  prefilled again (prompt and generated tokens) when it is readmitted. No new request is
  admitted in a step that preempted.
* SGLang: prefill and decode run in separate steps, prefill first. A waiting request is
  admitted only if the free pool covers its uncached prompt plus `max_new_tokens x
  new_token_ratio` for itself and every running request; the ratio decays step by step
  and jumps back up when decode runs out of memory and requests are retracted (freed and
  re-queued, like a preemption).

The prefix cache works as vLLM's: each full block of a request's tokens, prompt and output
alike, is published under a hash chained from the previous block's as soon as its KV is
computed (during decode as during prefill; drafts count only once accepted), and a
finished, aborted or preempted request's blocks join the LRU free queue with their hashes
kept. The last sampled token is never fed back, so a block it would complete stays
private. Generated ids come from `tokenizer.next_generated` and re-encode to themselves,
so a chat session that resends its history hits the blocks of its earlier answers.

Nothing here is per token except appending generated token ids: block bookkeeping is per
block, and step cost is a handful of float operations per step.
"""

from __future__ import annotations

import math
import random
import zlib
from collections import deque
from dataclasses import dataclass, field

from enginesim import tokenizer
from enginesim.kvpool import BlockPool, chain_hashes, root_hash
from enginesim.profiles import Profile
from enginesim.roofline import Roofline, StepShape
from enginesim.spec import acceptance_rate, accepted_drafts
from enginesim.types import (
    EngineEvent,
    EngineStats,
    EventKind,
    Flavor,
    SimRequest,
    StepResult,
    Workload,
)

# SGLang's retract heuristic: a retracted batch is assumed to need this many more
# decode steps per request when the new-token ratio is recomputed.
_RETRACT_DECODE_STEPS = 20


@dataclass(slots=True, eq=False)
class _Req:
    req: SimRequest
    tokens: list[int]
    prompt_len: int
    target_len: int  # output tokens this request will produce
    finish_reason: str
    arrival: float
    rng: random.Random
    gen_base: int
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks
    num_registered: int = 0  # leading blocks published in the prefix cache
    prefilling: bool = True  # prompt (or recompute) not yet fully computed
    cached_tokens: int = 0  # prefix-cache hit of the first admission (usage report)
    first_admitted: bool = False
    running: bool = False

    @property
    def rid(self) -> str:
        return self.req.request_id

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len


class EngineCore:
    """One replica's engine. See the module docstring for the scheduling model."""

    def __init__(
        self,
        profile: Profile,
        *,
        flavor: Flavor | None = None,
        seed: int = 0,
        speculative: bool | None = None,
    ) -> None:
        self.profile = profile
        self.flavor = Flavor(flavor) if flavor is not None else profile.flavor
        self.seed = seed
        eng = profile.engine
        self.block_size = profile.block_size
        self.num_gpu_blocks = profile.num_gpu_blocks
        self.max_model_len = profile.max_model_len
        self.max_num_seqs = profile.max_num_seqs
        self.max_num_batched_tokens = profile.max_num_batched_tokens
        self.enable_prefix_caching = eng.enable_prefix_caching
        # vLLM V1's block pool keeps its first block as the null block, never allocated.
        self.null_blocks = 1 if self.flavor is Flavor.VLLM else 0
        self.pool = BlockPool(
            self.num_gpu_blocks - self.null_blocks, self.block_size, eng.enable_prefix_caching
        )
        self.roofline = Roofline(profile)
        spec = profile.speculative
        if speculative is None:
            speculative = spec is not None and spec.enabled
        if speculative and spec is None:
            raise ValueError(f"profile {profile.name!r} has no speculative: section")
        self.speculative = bool(speculative)
        self.num_draft_tokens = spec.num_draft_tokens if (spec and self.speculative) else 0
        self._alpha: dict[Workload, float] = {}
        if spec is not None and self.speculative:
            self._alpha = {
                w: acceptance_rate(spec.acceptance[w], spec.num_draft_tokens) for w in Workload
            }
        self._out_median = profile.natural_output.median
        self._out_sigma = profile.natural_output.sigma
        # SGLang reservation ratio.
        self.new_token_ratio = eng.init_new_token_ratio
        self._ratio_min = eng.min_new_token_ratio
        self._ratio_decay = (
            eng.init_new_token_ratio - eng.min_new_token_ratio
        ) / eng.new_token_ratio_decay_steps
        self._reqs: dict[str, _Req] = {}
        self._waiting: deque[_Req] = deque()
        self._running: list[_Req] = []
        self._stats = EngineStats(
            num_gpu_blocks=self.num_gpu_blocks,
            null_blocks=self.null_blocks,
            block_size=self.block_size,
            enable_prefix_caching=self.enable_prefix_caching,
        )
        self._accepted_per_pos = [0] * self.num_draft_tokens
        # Work accounting beyond the metrics (used by tests and calibration).
        self.total_prefill_tokens = 0  # prefill positions computed (recompute counted again)
        self.total_steps = 0
        self.busy_time = 0.0

    # -- public API ----------------------------------------------------------------------
    def add_request(self, req: SimRequest, now: float) -> None:
        """Queue a request. ValueError if it can never run on this engine."""
        if req.request_id in self._reqs:
            raise ValueError(f"duplicate request_id {req.request_id!r}")
        p = len(req.prompt_token_ids)
        if p == 0:
            raise ValueError("prompt must contain at least one token")
        if req.max_tokens < (0 if req.prefill_only else 1):
            raise ValueError(f"max_tokens must be at least 1, got {req.max_tokens}")
        if p + req.max_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {p + req.max_tokens} tokens ({p} in the messages, "
                f"{req.max_tokens} in the completion). Please reduce the length of the "
                f"messages or completion."
            )
        rng = random.Random(f"{self.seed}:{req.request_id}")
        if req.prefill_only:
            target = 0  # finished by its prefill: no token is sampled
        elif req.ignore_eos:
            target = req.max_tokens
        else:
            natural = (
                req.output_len
                if req.output_len is not None
                else self._natural_len(req.workload, rng)
            )
            target = min(req.max_tokens, max(1, natural))
        target = max(target, min(req.min_tokens, req.max_tokens))
        reason = "length" if target >= req.max_tokens and not req.prefill_only else "stop"
        r = _Req(
            req=req,
            tokens=list(req.prompt_token_ids),
            prompt_len=p,
            target_len=target,
            finish_reason=reason,
            arrival=now,
            rng=rng,
            gen_base=zlib.crc32(f"{self.seed}:{req.request_id}".encode()),
        )
        if self.enable_prefix_caching:
            r.hashes = chain_hashes(r.tokens, self.block_size, root_hash(req.lora_name))
        self._reqs[req.request_id] = r
        self._waiting.append(r)

    def abort(self, request_id: str, now: float) -> bool:
        """Remove a live request and free its blocks at once; emits no event."""
        r = self._reqs.pop(request_id, None)
        if r is None:
            return False
        if r.running:
            self._running.remove(r)
            r.running = False
        else:
            self._waiting.remove(r)
        self._free_blocks(r)
        self._stats.num_aborted += 1
        return True

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def request_ids(self) -> set[str]:
        return set(self._reqs)

    def stats(self) -> EngineStats:
        s = self._stats
        s.num_running = len(self._running)
        s.num_waiting = len(self._waiting)
        s.blocks_in_use = self.pool.num_used
        s.cached_free_blocks = self.pool.num_cached_free
        s.spec_accepted_per_pos = tuple(self._accepted_per_pos)
        return EngineStats(**{f: getattr(s, f) for f in s.__dataclass_fields__})

    def step(self, now: float) -> StepResult:
        """Plan and apply one step starting at `now`; events are stamped at its end."""
        events: list[EngineEvent] = []
        if self.flavor is Flavor.SGLANG:
            sched, spec_seqs = self._schedule_sglang(now, events)
        else:
            sched, spec_seqs = self._schedule_vllm(now, events)
        if not sched:
            return StepResult(
                start=now, duration=0.0, events=events, num_running=len(self._running)
            )
        shape = self._shape(sched, spec_seqs)
        cost = self.roofline.cost(shape)
        end = now + cost.total
        for ev in events:  # preemptions become visible when the step ends
            ev.time = end
        n_prefill, n_decode = self._apply(sched, end, events)
        self.total_steps += 1
        self.busy_time += cost.total
        return StepResult(
            start=now,
            duration=cost.total,
            events=events,
            num_running=len(self._running),
            num_prefill_tokens=n_prefill,
            num_decode_tokens=n_decode,
        )

    # -- scheduling: vLLM shape ------------------------------------------------------------
    def _schedule_vllm(
        self, now: float, events: list[EngineEvent]
    ) -> tuple[list[tuple[_Req, int]], int]:
        budget = self.max_num_batched_tokens
        sched: list[tuple[_Req, int]] = []
        spec_seqs = 0
        running = self._running
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            n = len(r.tokens) - r.num_computed
            drafts = 0
            if not r.prefilling and self.num_draft_tokens:
                drafts = min(self.num_draft_tokens, r.target_len - r.num_output - 1, budget - 1)
                drafts = max(drafts, 0)
            n = min(n + drafts, budget)
            if not self._grow(r, r.num_computed + n):
                # Preempt from the newest end until r fits (or r itself is the victim).
                while True:
                    victim = running.pop()
                    self._preempt(victim, events)
                    preempted = True
                    if victim is r or self._grow(r, r.num_computed + n):
                        break
                if victim is r:
                    break
            sched.append((r, n))
            if drafts:
                spec_seqs += 1
            budget -= n
            i += 1
        if preempted:
            return sched, spec_seqs
        waiting = self._waiting
        while waiting and budget > 0 and len(running) < self.max_num_seqs:
            r = waiting[0]
            if not self._admit(r, need_extra_tokens=0):
                break  # FCFS: the head waits for blocks, nothing overtakes it
            waiting.popleft()
            r.running = True
            running.append(r)
            n = min(len(r.tokens) - r.num_computed, budget)
            sched.append((r, n))
            budget -= n
        return sched, spec_seqs

    # -- scheduling: SGLang shape ----------------------------------------------------------
    def _schedule_sglang(
        self, now: float, events: list[EngineEvent]
    ) -> tuple[list[tuple[_Req, int]], int]:
        budget = self.max_num_batched_tokens
        sched: list[tuple[_Req, int]] = []
        # 1. Prefill batch: continue a chunked prefill, then admit new requests.
        for r in self._running:
            if r.prefilling and budget > 0:
                n = min(len(r.tokens) - r.num_computed, budget)
                sched.append((r, n))
                budget -= n
        if self._waiting and budget > 0 and len(self._running) < self.max_num_seqs:
            ratio = self.new_token_ratio
            reserved = sum(self._remaining_new(r) * ratio for r in self._running)
            while self._waiting and budget > 0 and len(self._running) < self.max_num_seqs:
                r = self._waiting[0]
                extra = int(self._remaining_new(r) * ratio)
                avail = self.pool.num_free * self.block_size - reserved
                if not self._admit(r, need_extra_tokens=extra, avail_tokens=avail):
                    break  # FCFS, as SGLang's default policy without a priority
                self._waiting.popleft()
                r.running = True
                self._running.append(r)
                n = min(len(r.tokens) - r.num_computed, budget)
                sched.append((r, n))
                budget -= n
                reserved += extra
        if sched:
            return sched, 0
        # 2. Decode batch: every running request, retracting under memory pressure.
        decoding = [r for r in self._running if not r.prefilling]
        if not decoding:
            return sched, 0
        k = self.num_draft_tokens
        wants = []
        for r in decoding:
            drafts = max(0, min(k, r.target_len - r.num_output - 1)) if k else 0
            wants.append(1 + drafts)
        need = sum(
            max(0, self.pool.blocks_for(r.num_computed + w) - len(r.blocks))
            for r, w in zip(decoding, wants, strict=True)
        )
        if need > self.pool.num_free:
            order = sorted(decoding, key=lambda r: (r.num_output, -r.prompt_len), reverse=True)
            while need > self.pool.num_free and len(order) > 1:
                victim = order.pop()
                idx = decoding.index(victim)
                need -= max(
                    0, self.pool.blocks_for(victim.num_computed + wants[idx]) - len(victim.blocks)
                )
                decoding.pop(idx)
                wants.pop(idx)
                self._running.remove(victim)
                self._preempt(victim, events)
            total_decoded = sum(r.num_output for r in decoding)
            total_max_new = sum(r.req.max_tokens for r in decoding) or 1
            self.new_token_ratio = min(
                1.0, (total_decoded + _RETRACT_DECODE_STEPS * len(decoding)) / total_max_new
            )
        else:
            self.new_token_ratio = max(self._ratio_min, self.new_token_ratio - self._ratio_decay)
        spec_seqs = 0
        for r, w in zip(decoding, wants, strict=True):
            if not self._grow(r, r.num_computed + w):
                # Only reachable for a lone request the pool cannot extend; retract it.
                self._running.remove(r)
                self._preempt(r, events)
                continue
            sched.append((r, w))
            if w > 1:
                spec_seqs += 1
        return sched, spec_seqs

    def _remaining_new(self, r: _Req) -> int:
        return max(0, r.req.max_tokens - r.num_output)

    # -- block bookkeeping -----------------------------------------------------------------
    def _admit(self, r: _Req, need_extra_tokens: int, avail_tokens: float | None = None) -> bool:
        """Give a waiting request its blocks (prefix hits + new) if they fit; else False."""
        pool = self.pool
        bs = self.block_size
        total_blocks = pool.blocks_for(len(r.tokens))
        hits: list[int] = []
        if self.enable_prefix_caching:
            self._extend_hashes(r, len(r.tokens))
            # Always leave the last token to compute, so the step produces logits.
            max_hit = (len(r.tokens) - 1) // bs
            hits = pool.match_prefix(r.hashes[:max_hit])
        revived = sum(1 for b in hits if pool._ref[b] == 0)
        new = total_blocks - len(hits)
        free_after = pool.num_free - revived
        if new > free_after:
            return False
        if (
            avail_tokens is not None
            and (new * bs + need_extra_tokens) > avail_tokens - revived * bs
        ):
            return False
        pool.acquire(hits)
        r.blocks = hits + pool.allocate(new)
        r.num_registered = len(hits)
        r.num_computed = len(hits) * bs
        if self.enable_prefix_caching:
            self._stats.prefix_cache_queries += len(r.tokens)
            self._stats.prefix_cache_hits += r.num_computed
        if not r.first_admitted:
            r.first_admitted = True
            r.cached_tokens = min(r.num_computed, r.prompt_len)
        return True

    def _grow(self, r: _Req, tokens: int) -> bool:
        """Ensure r holds blocks for `tokens` slots; False if the pool cannot supply them."""
        need = self.pool.blocks_for(tokens) - len(r.blocks)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        r.blocks.extend(self.pool.allocate(need))
        return True

    def _free_blocks(self, r: _Req) -> None:
        if r.blocks:
            self.pool.release(r.blocks)
            r.blocks = []
        r.num_registered = 0

    def _preempt(self, r: _Req, events: list[EngineEvent]) -> None:
        """Recompute preemption: drop the KV, requeue at the front, prefill again later."""
        r.running = False
        self._free_blocks(r)
        r.num_computed = 0
        r.prefilling = True
        self._waiting.appendleft(r)
        self._stats.num_preemptions += 1
        events.append(EngineEvent(EventKind.PREEMPTED, r.rid, 0.0))

    def _extend_hashes(self, r: _Req, upto_tokens: int) -> None:
        have = len(r.hashes)
        full = upto_tokens // self.block_size
        if full > have:
            parent = r.hashes[-1] if have else root_hash(r.req.lora_name)
            r.hashes.extend(
                chain_hashes(r.tokens[: full * self.block_size], self.block_size, parent, have)
            )

    def _register(self, r: _Req) -> None:
        full = min(r.num_computed // self.block_size, len(r.blocks))
        if full <= r.num_registered:
            return
        self._extend_hashes(r, full * self.block_size)
        for b in range(r.num_registered, full):
            self.pool.register(r.blocks[b], r.hashes[b])
        r.num_registered = full

    # -- step cost and effects -------------------------------------------------------------
    def _shape(self, sched: list[tuple[_Req, int]], spec_seqs: int) -> StepShape:
        tokens = 0
        attended = 0.0
        kv = 0
        for r, n in sched:
            c = r.num_computed
            tokens += n
            attended += n * c + n * (n + 1) / 2
            kv += c + n
        passes = self.num_draft_tokens if spec_seqs else 0
        return StepShape(
            tokens=tokens,
            attended=attended,
            kv_read_tokens=kv,
            num_seqs=len(sched),
            draft_passes=passes,
            draft_tokens_per_pass=spec_seqs,
        )

    def _natural_len(self, workload: Workload, rng: random.Random) -> int:
        med = self._out_median.get(workload, 200)
        return max(1, int(round(med * math.exp(self._out_sigma * rng.gauss(0.0, 1.0)))))

    def _accepted(self, r: _Req, drafts: int) -> int:
        """Tokens emitted by one verification step: accepted drafts + 1 (geometric)."""
        acc = accepted_drafts(r.rng, self._alpha.get(r.req.workload, 0.0), drafts)
        st = self._stats
        st.spec_num_drafts += 1
        st.spec_num_draft_tokens += drafts
        st.spec_num_accepted_tokens += acc
        for pos in range(acc):
            self._accepted_per_pos[pos] += 1
        return acc + 1

    def _apply(
        self, sched: list[tuple[_Req, int]], end: float, events: list[EngineEvent]
    ) -> tuple[int, int]:
        st = self._stats
        n_prefill = n_decode = 0
        finished: list[_Req] = []
        for r, n in sched:
            if r.prefilling:
                n_prefill += n
                self.total_prefill_tokens += n
                r.num_computed += n
                if r.num_computed < len(r.tokens):
                    self._register(r)
                    continue  # more chunks to go
                r.prefilling = False
                st.prompt_tokens += r.prompt_len
                emit = 1
            else:
                drafts = n - 1
                n_decode += n
                emit = self._accepted(r, drafts) if drafts > 0 else 1
            emit = min(emit, r.target_len - r.num_output)
            new_ids = []
            prev = r.tokens[-1]
            for j in range(r.num_output, r.num_output + emit):
                prev = tokenizer.next_generated(r.gen_base, j, prev)
                new_ids.append(prev)
            r.tokens.extend(new_ids)
            r.num_computed = len(r.tokens) - 1
            st.generation_tokens += emit
            self._register(r)
            if new_ids:  # none for a prefill-only request
                events.append(EngineEvent(EventKind.TOKENS, r.rid, end, token_ids=new_ids))
            if r.num_output >= r.target_len:
                finished.append(r)
        for r in finished:
            self._running.remove(r)
            r.running = False
            self._free_blocks(r)
            del self._reqs[r.rid]
            st.num_finished += 1
            events.append(
                EngineEvent(
                    EventKind.FINISHED,
                    r.rid,
                    end,
                    finish_reason=r.finish_reason,
                    prompt_tokens=r.prompt_len,
                    completion_tokens=r.num_output,
                    cached_tokens=r.cached_tokens,
                )
            )
        return n_prefill, n_decode

    # -- introspection for tests -------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert pool consistency and that every live block belongs to a running request."""
        self.pool.check()
        assert self.pool.num_used <= self.num_gpu_blocks
        assert all(not r.blocks for r in self._waiting)
        # Each block's reference count is exactly the number of running requests holding
        # it (a shared prefix block once per holder); unreferenced blocks are free.
        holders: dict[int, int] = {}
        for r in self._running:
            assert len(set(r.blocks)) == len(r.blocks)
            for b in r.blocks:
                holders[b] = holders.get(b, 0) + 1
        assert holders == {b: n for b, n in enumerate(self.pool._ref) if n}
        for r in self._running:
            assert len(r.blocks) * self.block_size >= r.num_computed
            assert r.num_registered <= len(r.blocks)
