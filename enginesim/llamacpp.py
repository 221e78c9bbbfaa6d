"""llama.cpp's llama-server as a sans-IO core on the virtual clock.

llama-server has no block pool, no shared prefix cache and no preemption. It has
`n_parallel` slots (the profile's `max_num_seqs`) and a context of `n_ctx` KV cells (the
profile's pool, one cell per token). What this core imitates, read from llama.cpp's
`tools/server/server-context.cpp`:

* Slots. A request takes a free slot or is deferred; deferred requests are served first
  come, first served as slots are released. A free slot is picked as llama-server picks
  it: the idle slot whose cached tokens share the longest common prefix with the prompt,
  if that prefix is more than `SLOT_PROMPT_SIMILARITY` of the prompt; otherwise the least
  recently used slot (the highest id among equals, so a fresh server starts at the last).
* KV layout, as `--kv-unified` chooses. Per slot (llama-server's default when the slot
  count is given): `n_ctx` is split evenly and each slot owns `n_ctx / n_slots` cells.
  Unified: one pool of `n_ctx` cells that every slot may fill alone. A slot's context is
  also capped by the model's trained context (the profile's `max_model_len`).
* Prompt cache. A slot keeps the tokens of its last request (prompt and generation but
  the last sampled token, whose KV is never computed). The next request in that slot
  reuses the longest common prefix with its prompt and computes the rest, always at
  least one token. Behind the slots sits llama-server's host-RAM prompt cache
  (`--cache-ram`, 8,192 MiB by default; the profile's `cache_ram_mib`, 0 turns it off):
  a slot taken by least-recent use (or by a weak match) first saves its tokens there,
  then restores the cached prompt that matches the new one best, so a session finds its
  history even after its slot served others. Whenever a request starts, every idle slot
  is saved there too and, in the unified layout, cleared, which gives its cells back to
  the pool. Entries are sized at the model's KV bytes per token; the oldest go first.
* Limits, checked when a slot starts the request (not on arrival, so a deferred request
  learns it late): a prompt of at least the slot's context fails with HTTP 400
  `exceed_context_size_error`. A generation that fills its slot's context stops with
  finish reason "length" (context shift is off by default), as does one that reaches
  `max_tokens`; there is no up-front check of prompt + max_tokens.
* No preemption. In the unified layout the slots together can outgrow the pool. When a
  step's batch needs more cells than are free, the idle slots' caches are purged; if that
  is not enough, the batch is decoded as far as the cells last and then every request
  being processed fails with HTTP 500 `server_error` "Context size has been exceeded."
  and its slot's cache is dropped. That is llama-server's decode-failure path: it halves
  the batch down to a single token before it gives up, and then terminates all active
  slots, not only the one that outgrew the pool. (Tokens sampled from the sub-batches
  that fit before the failure are not delivered here; the requests fail either way.)
  Per slot, no request can outgrow its own cells, so nothing fails mid-flight.
* Steps. One decode per step, `n_batch` (the profile's `max_num_batched_tokens`) tokens:
  one for each generating slot, then prompt tokens of the slots processing prompts, in
  slot order. Step time comes from the roofline model. No speculative decoding.

Metrics are llama.cpp's `server_metrics`: prompt tokens computed and reused, seconds
spent on prompts and on generation, decode calls, busy slots per decode, the largest
sequence held, and two throughput buckets that each `/metrics` scrape resets.
"""

from __future__ import annotations

import math
import random
import zlib
from collections import deque
from dataclasses import dataclass, field

from enginesim import tokenizer
from enginesim.profiles import Profile
from enginesim.roofline import Roofline, StepShape
from enginesim.types import (
    EngineError,
    EngineEvent,
    EventKind,
    LlamaCppStats,
    SimRequest,
    SlotTimings,
    StepResult,
    Workload,
)

# llama-server's --slot-prompt-similarity default.
SLOT_PROMPT_SIMILARITY = 0.1
# The host-RAM prompt cache keeps no entry that would lose more than this of its length.
PROMPT_CACHE_MIN_KEEP = 0.25
# n_predict of a request without max_tokens: generate until EOS or the slot's context ends.
UNLIMITED = -1
CONTEXT_EXCEEDED = "Context size has been exceeded."


def context_size_error(n_prompt: int, n_ctx: int) -> EngineError:
    """llama-server's answer to a prompt that does not fit its slot's context."""
    return EngineError(
        status=400,
        type="exceed_context_size_error",
        message=(
            f"request ({n_prompt} tokens) exceeds the available context size ({n_ctx} "
            "tokens), try increasing it"
        ),
        n_prompt_tokens=n_prompt,
        n_ctx=n_ctx,
    )


@dataclass(slots=True, frozen=True)
class SlotInfo:
    """One slot as `/slots` shows it; task fields are None on a slot never used."""

    id: int
    n_ctx: int
    is_processing: bool
    id_task: int | None = None
    n_prompt_tokens: int = 0  # tokens the slot holds in its cache
    n_prompt_tokens_processed: int = 0
    n_prompt_tokens_cache: int = 0
    n_predict: int = UNLIMITED
    ignore_eos: bool = False
    has_next_token: bool = False
    n_remain: int = UNLIMITED
    n_decoded: int = 0


@dataclass(slots=True, eq=False)
class _Task:
    req: SimRequest
    id_task: int
    arrival: float
    natural: int | None  # EOS after this many tokens; None with ignore_eos
    n_predict: int
    gen_base: int
    slot: _Slot | None = None
    n_past: int = 0  # prompt tokens in the slot's cache (reused + computed)
    n_cached: int = 0  # prompt tokens reused from the slot's cache
    generated: list[int] = field(default_factory=list)
    t_start: float = 0.0
    t_prompt_last: float = 0.0
    t_gen_last: float = 0.0
    done: bool = False

    @property
    def rid(self) -> str:
        return self.req.request_id

    @property
    def prompt(self) -> list[int]:
        return self.req.prompt_token_ids

    @property
    def prefilling(self) -> bool:
        return self.n_past < len(self.req.prompt_token_ids)

    def timings(self) -> SlotTimings:
        prompt_s = self.t_prompt_last - self.t_start if self.t_prompt_last else 0.0
        n = len(self.generated)
        gen_s = max(1e-6, self.t_gen_last - self.t_prompt_last) if n else 0.0
        return SlotTimings(
            cache_n=self.n_cached,
            prompt_n=self.n_past - self.n_cached,
            prompt_ms=prompt_s * 1e3,
            predicted_n=n,
            predicted_ms=gen_s * 1e3,
        )


@dataclass(slots=True, eq=False)
class _Slot:
    id: int
    n_ctx: int
    tokens: list[int] = field(default_factory=list)  # tokens whose KV the slot holds
    task: _Task | None = None
    last: _Task | None = None  # the previous task: /slots keeps showing its figures
    t_last_used: float = -1.0


class _PromptCache:
    """llama-server's host-RAM prompt cache: saved slot states, oldest first."""

    def __init__(self, limit_bytes: int, bytes_per_token: int) -> None:
        self.limit_bytes = limit_bytes  # 0: no limit
        self.bytes_per_token = max(1, bytes_per_token)
        self.states: deque[list[int]] = deque()

    @property
    def n_tokens(self) -> int:
        return sum(len(t) for t in self.states)

    def save(self, tokens: list[int]) -> None:
        if not tokens:
            return
        if any(_common_prefix(st, tokens) == len(tokens) for st in self.states):
            return  # already held (as this prompt or a longer one)
        size = len(tokens) * self.bytes_per_token
        if self.limit_bytes and size > self.limit_bytes:
            return
        # Entries the new one contains are obsolete.
        self.states = deque(st for st in self.states if _common_prefix(st, tokens) < len(st))
        while self.states and self.limit_bytes and (self.n_tokens * self.bytes_per_token + size
                                                    > self.limit_bytes):  # fmt: skip
            self.states.popleft()
        self.states.append(list(tokens))

    def load(self, current: list[int], prompt: list[int]) -> list[int] | None:
        """The cached state better for `prompt` than `current` (taken out), or None."""
        lcp = _common_prefix(current, prompt)
        keep_best = lcp / len(current) if current else -1.0
        sim_best = lcp / len(prompt)
        best = None
        for i, st in enumerate(self.states):
            n = _common_prefix(st, prompt)
            keep, sim = n / len(st), n / len(prompt)
            if keep < PROMPT_CACHE_MIN_KEEP:
                continue  # do not trash a large prompt for a small match
            if keep_best < keep and sim_best < sim:
                keep_best, sim_best, best = keep, sim, i
        if best is None:
            return None
        tokens = self.states[best]
        del self.states[best]
        return tokens


class LlamaCppCore:
    """One llama-server. See the module docstring for what is modelled."""

    def __init__(
        self,
        profile: Profile,
        *,
        seed: int = 0,
        kv_unified: bool | None = None,
        cache_ram_mib: int | None = None,
    ) -> None:
        self.profile = profile
        self.seed = seed
        eng = profile.engine
        self.kv_unified = eng.kv_unified if kv_unified is None else bool(kv_unified)
        ram = eng.cache_ram_mib if cache_ram_mib is None else cache_ram_mib
        self.prompt_cache = (
            _PromptCache(max(0, ram) * 1024 * 1024, profile.kv_bytes_per_token) if ram else None
        )
        self.n_ctx = profile.pool_tokens
        self.n_slots = profile.max_num_seqs
        self.n_batch = profile.max_num_batched_tokens
        per_seq = self.n_ctx if self.kv_unified else self.n_ctx // self.n_slots
        self.slot_n_ctx = min(per_seq, profile.max_model_len)
        if self.slot_n_ctx < 2:
            raise ValueError(
                f"a context of {self.n_ctx} cells over {self.n_slots} slots leaves "
                f"{self.slot_n_ctx} per slot"
            )
        self.block_size = 1
        self.max_model_len = self.slot_n_ctx  # the longest sequence a request can reach
        self.roofline = Roofline(profile)
        self.speculative = False
        self._out_median = profile.natural_output.median
        self._out_sigma = profile.natural_output.sigma
        self.slots = [_Slot(i, self.slot_n_ctx) for i in range(self.n_slots)]
        self._tasks: dict[str, _Task] = {}
        self._deferred: deque[_Task] = deque()
        self._next_task_id = 0
        self._stats = LlamaCppStats(
            num_gpu_blocks=self.n_ctx,
            block_size=1,
            num_slots=self.n_slots,
            slot_n_ctx=self.slot_n_ctx,
            kv_unified=self.kv_unified,
        )
        self.total_prefill_tokens = 0
        self.total_steps = 0
        self.busy_time = 0.0

    # -- public API (as EngineCore's) --------------------------------------------------
    def add_request(self, req: SimRequest, now: float) -> None:
        """Queue a request (deferred until a slot takes it). ValueError on bad input."""
        if req.request_id in self._tasks:
            raise ValueError(f"duplicate request_id {req.request_id!r}")
        if not req.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if req.max_tokens != UNLIMITED and req.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {req.max_tokens}")
        rng = random.Random(f"{self.seed}:{req.request_id}")
        natural: int | None = None
        if not req.ignore_eos:
            natural = (
                req.output_len
                if req.output_len is not None
                else self._natural_len(req.workload, rng)
            )
            natural = max(1, natural)
        task = _Task(
            req=req,
            id_task=self._next_task_id,
            arrival=now,
            natural=natural,
            n_predict=req.max_tokens,
            gen_base=zlib.crc32(f"{self.seed}:{req.request_id}".encode()),
        )
        self._next_task_id += 1
        self._tasks[req.request_id] = task
        self._deferred.append(task)

    def abort(self, request_id: str, now: float) -> bool:
        """Cancel a request; its slot is released at once (keeping its cache)."""
        task = self._tasks.pop(request_id, None)
        if task is None:
            return False
        if task.slot is None:
            self._deferred.remove(task)
        else:
            self._release(task.slot, now)
        task.done = True
        self._stats.num_aborted += 1
        return True

    def has_work(self) -> bool:
        return bool(self._deferred) or any(s.task is not None for s in self.slots)

    def request_ids(self) -> set[str]:
        return set(self._tasks)

    def stats(self) -> LlamaCppStats:
        s = self._stats
        s.num_running = sum(1 for sl in self.slots if sl.task is not None)
        s.num_waiting = len(self._deferred)
        s.blocks_in_use = sum(len(sl.tokens) for sl in self.slots if sl.task is not None)
        s.cached_free_blocks = sum(len(sl.tokens) for sl in self.slots if sl.task is None)
        return LlamaCppStats(**{f: getattr(s, f) for f in s.__dataclass_fields__})

    def reset_metrics_bucket(self) -> None:
        """Start a new averaging window for the throughput gauges (each scrape does)."""
        s = self._stats
        s.prompt_bucket_tokens = 0
        s.prompt_bucket_seconds = 0.0
        s.predict_bucket_steps = 0
        s.predict_bucket_seconds = 0.0

    def slot_info(self) -> list[SlotInfo]:
        out = []
        for sl in self.slots:
            t = sl.task or sl.last
            if t is None:
                out.append(SlotInfo(sl.id, sl.n_ctx, False))
                continue
            if sl.task is None:
                # A released slot keeps its cache and its last task's parameters; its
                # per-request figures are reset, as llama-server resets a slot's stats.
                out.append(
                    SlotInfo(
                        id=sl.id,
                        n_ctx=sl.n_ctx,
                        is_processing=False,
                        id_task=t.id_task,
                        n_prompt_tokens=len(sl.tokens),
                        n_predict=t.n_predict,
                        ignore_eos=t.req.ignore_eos,
                    )
                )
                continue
            n = len(t.generated)
            remain = UNLIMITED if t.n_predict == UNLIMITED else t.n_predict - n
            out.append(
                SlotInfo(
                    id=sl.id,
                    n_ctx=sl.n_ctx,
                    is_processing=True,
                    id_task=t.id_task,
                    n_prompt_tokens=len(sl.tokens),
                    n_prompt_tokens_processed=t.n_past - t.n_cached,
                    n_prompt_tokens_cache=t.n_cached,
                    n_predict=t.n_predict,
                    ignore_eos=t.req.ignore_eos,
                    has_next_token=True,
                    n_remain=remain,
                    n_decoded=n,
                )
            )
        return out

    def step(self, now: float) -> StepResult:
        """Launch deferred requests on free slots, then decode one batch from `now`."""
        events: list[EngineEvent] = []
        self._launch(now, events)
        if events:
            # Starts and refusals happen before the decode: a stream's headers go out
            # when its slot starts, as llama-server sends them. The decode is the next call.
            return StepResult(start=now, duration=0.0, events=events, num_running=0)
        batch = self._batch()
        if not batch:
            return StepResult(start=now, duration=0.0, events=events, num_running=0)
        need = sum(n for _, n in batch)
        fits = need
        if self.kv_unified:
            free = self.n_ctx - sum(len(sl.tokens) for sl in self.slots)
            if need > free:
                self._purge_idle()
                free = self.n_ctx - sum(len(sl.tokens) for sl in self.slots)
            fits = min(need, free)
        shape = self._shape(batch, fits)
        duration = self.roofline.cost(shape).total
        end = now + duration
        self.total_steps += 1
        self.busy_time += duration
        if fits < need:
            self._fail_all(end, events)
            return StepResult(
                start=now, duration=duration, events=events, num_running=0, num_prefill_tokens=0
            )
        n_prefill, n_decode = self._apply(batch, now, end, duration, events)
        return StepResult(
            start=now,
            duration=duration,
            events=events,
            num_running=sum(1 for sl in self.slots if sl.task is not None),
            num_prefill_tokens=n_prefill,
            num_decode_tokens=n_decode,
        )

    # -- slots ---------------------------------------------------------------------------
    def _launch(self, now: float, events: list[EngineEvent]) -> None:
        while self._deferred:
            slot = self._pick_slot(self._deferred[0].prompt)
            if slot is None:
                return  # all slots busy: the rest stays deferred
            task = self._deferred.popleft()
            self._cache_idle_slots(busy=slot)
            n_prompt = len(task.prompt)
            if n_prompt >= slot.n_ctx:
                # The slot took the task and refused it: llama-server releases it again
                # (its cache untouched) and answers with the context-size error.
                slot.t_last_used = now
                self._end(task, EventKind.FAILED, now, events, context_size_error(
                    n_prompt, slot.n_ctx
                ))  # fmt: skip
                continue
            lcp = _common_prefix(slot.tokens, task.prompt)
            n_past = min(lcp, n_prompt - 1)  # at least one token to compute, for logits
            del slot.tokens[n_past:]
            task.slot = slot
            task.n_past = task.n_cached = n_past
            task.t_start = now
            slot.task = task
            st = self._stats
            st.prompt_tokens_cached += n_past
            st.prefix_cache_queries += n_prompt
            st.prefix_cache_hits += n_past
            events.append(EngineEvent(EventKind.STARTED, task.rid, now, slot=slot.id))

    def _pick_slot(self, prompt: list[int]) -> _Slot | None:
        best: _Slot | None = None
        best_lcp = 0
        for sl in self.slots:
            if sl.task is not None or not sl.tokens:
                continue
            lcp = _common_prefix(sl.tokens, prompt)
            if lcp > best_lcp and lcp / len(prompt) > SLOT_PROMPT_SIMILARITY:
                best, best_lcp = sl, lcp
        # A slot picked by a weak match (it would lose over half its cache) or by least
        # recent use trades its cache with the RAM cache.
        update_cache = best is not None and best_lcp / len(best.tokens) < 0.5
        if best is None:
            t_last = math.inf
            for sl in self.slots:
                if sl.task is None and (best is None or sl.t_last_used <= t_last):
                    best, t_last = sl, sl.t_last_used
            update_cache = best is not None
        if best is not None and update_cache and self.prompt_cache is not None:
            self.prompt_cache.save(best.tokens)
            restored = self.prompt_cache.load(best.tokens, prompt)
            if restored is not None:
                best.tokens = restored
        return best

    def _cache_idle_slots(self, busy: _Slot) -> None:
        """llama-server's --cache-idle-slots (on with the RAM cache), as a request starts."""
        if self.prompt_cache is None:
            return
        for sl in self.slots:
            if sl.task is None and sl is not busy:
                self.prompt_cache.save(sl.tokens)
                if self.kv_unified:
                    sl.tokens = []

    def _release(self, slot: _Slot, now: float) -> None:
        task = slot.task
        assert task is not None
        slot.task = None
        slot.last = task
        slot.t_last_used = now
        n = len(task.generated)
        if n:
            t = task.timings()
            st = self._stats
            st.tokens_predicted += n
            st.tokens_predicted_seconds += t.predicted_ms / 1e3
            st.predict_bucket_steps += n - 1
            st.predict_bucket_seconds += t.predicted_ms / 1e3

    def _end(
        self,
        task: _Task,
        kind: EventKind,
        now: float,
        events: list[EngineEvent],
        error: EngineError | None = None,
        reason: str | None = None,
    ) -> None:
        slot = task.slot
        if slot is not None and slot.task is task:
            self._release(slot, now)
        task.done = True
        del self._tasks[task.rid]
        if kind is EventKind.FAILED:
            self._stats.num_failed += 1
        else:
            self._stats.num_finished += 1
        events.append(
            EngineEvent(
                kind,
                task.rid,
                now,
                finish_reason=reason,
                prompt_tokens=len(task.prompt),
                completion_tokens=len(task.generated),
                cached_tokens=task.n_cached,
                error=error,
                slot=slot.id if slot is not None else None,
                timings=task.timings() if slot is not None else None,
            )
        )

    def _purge_idle(self) -> None:
        for sl in self.slots:
            if sl.task is None:
                sl.tokens.clear()

    def _fail_all(self, now: float, events: list[EngineEvent]) -> None:
        err = EngineError(status=500, type="server_error", message=CONTEXT_EXCEEDED)
        for sl in self.slots:
            if sl.task is not None:
                task = sl.task
                self._end(task, EventKind.FAILED, now, events, err)
                sl.tokens.clear()

    # -- one decode ------------------------------------------------------------------------
    def _batch(self) -> list[tuple[_Slot, int]]:
        batch: list[tuple[_Slot, int]] = []
        budget = self.n_batch
        for sl in self.slots:
            if sl.task is not None and not sl.task.prefilling and budget > 0:
                batch.append((sl, 1))
                budget -= 1
        for sl in self.slots:
            if sl.task is not None and sl.task.prefilling and budget > 0:
                n = min(len(sl.task.prompt) - sl.task.n_past, budget)
                batch.append((sl, n))
                budget -= n
        return batch

    def _shape(self, batch: list[tuple[_Slot, int]], limit: int) -> StepShape:
        tokens = 0
        attended = 0.0
        kv = 0
        seqs = 0
        for sl, n in batch:
            n = min(n, limit - tokens)
            if n <= 0:
                break
            c = len(sl.tokens)
            tokens += n
            attended += n * c + n * (n + 1) / 2
            kv += c + n
            seqs += 1
        return StepShape(tokens=tokens, attended=attended, kv_read_tokens=kv, num_seqs=seqs)

    def _apply(
        self,
        batch: list[tuple[_Slot, int]],
        start: float,
        end: float,
        duration: float,
        events: list[EngineEvent],
    ) -> tuple[int, int]:
        st = self._stats
        n_prefill = n_decode = 0
        st.n_decode += 1
        st.n_busy_slots += sum(1 for sl in self.slots if sl.task is not None)
        finished: list[tuple[_Task, str]] = []
        for sl, n in batch:
            task = sl.task
            assert task is not None
            if task.prefilling:
                sl.tokens.extend(task.prompt[task.n_past : task.n_past + n])
                task.n_past += n
                n_prefill += n
                if task.prefilling:
                    continue
                task.t_prompt_last = end
                st.prompt_tokens += len(task.prompt)
            else:
                sl.tokens.append(task.generated[-1])
                n_decode += 1
            k = len(task.generated)
            prev = task.generated[-1] if task.generated else task.prompt[-1]
            tok = tokenizer.next_generated(task.gen_base, k, prev)
            task.generated.append(tok)
            task.t_gen_last = end
            st.generation_tokens += 1
            events.append(EngineEvent(EventKind.TOKENS, task.rid, end, token_ids=[tok]))
            # llama-server's order: the context check, then the budget, then EOS (wins).
            n_gen = k + 1
            reason = None
            if len(sl.tokens) + 1 >= sl.n_ctx:
                reason = "length"
            if task.n_predict != UNLIMITED and n_gen >= task.n_predict:
                reason = "length"
            if task.natural is not None and n_gen >= task.natural:
                reason = "stop"
            if reason is not None:
                finished.append((task, reason))
        st.n_tokens_max = max(st.n_tokens_max, max(len(sl.tokens) for sl in self.slots))
        if n_prefill:
            st.prompt_tokens_processed += n_prefill
            st.prompt_seconds += duration
            st.prompt_bucket_tokens += n_prefill
            st.prompt_bucket_seconds += duration
            self.total_prefill_tokens += n_prefill
        for task, reason in finished:
            self._end(task, EventKind.FINISHED, end, events, reason=reason)
        return n_prefill, n_decode

    def _natural_len(self, workload: Workload, rng: random.Random) -> int:
        med = self._out_median.get(workload, 200)
        return max(1, int(round(med * math.exp(self._out_sigma * rng.gauss(0.0, 1.0)))))

    # -- introspection for tests -------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert the cell accounting: per slot within its context, the pool when unified."""
        used = 0
        for sl in self.slots:
            assert len(sl.tokens) < sl.n_ctx or (not sl.tokens and sl.n_ctx == 0)
            used += len(sl.tokens)
            t = sl.task
            if t is not None:
                assert t.slot is sl and not t.done and t.rid in self._tasks
                gen = t.generated[:-1] if t.generated else []
                assert sl.tokens == t.prompt[: t.n_past] + gen
        if self.kv_unified:
            assert used <= self.n_ctx
        assert all(t.slot is None for t in self._deferred)
        running = {sl.task.rid for sl in self.slots if sl.task is not None}
        assert running | {t.rid for t in self._deferred} == set(self._tasks)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
