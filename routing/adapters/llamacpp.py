"""llama.cpp server adapter: ``/props`` for slots and context, ``/v1/models`` for ids,
``/slots`` for what the slots are doing and hold.

llama-server does not preempt: ``preempts`` is False. When its slots together need more
KV cells than it has, the request that finds no cell does not wait or get recomputed:
every request being processed fails ("Context size has been exceeded."). Admission
therefore reserves for a llama.cpp replica what a request may use (prompt + max_tokens,
within its slot's context), not a learned estimate of its output.

The KV layout, and so the pool, is set on llama-server's command line, and the server
reports it nowhere over HTTP: ``/props`` (``default_generation_settings.n_ctx``),
``/slots`` (``n_ctx``) and ``/v1/models`` (``meta.n_ctx``) all give the context one slot
may use, ``s``, and ``total_slots`` the slot count ``n``; no endpoint gives
``kv_unified`` or the whole cache (scripts/REAL_ENGINE_NOTES.md). The two layouts:

- *per slot* (``-np N`` without ``--kv-unified``): each slot owns ``s`` cells; the pool is
  ``n x s`` and cannot be overrun (a generation that fills its slot stops with
  ``length``). ``private_slots`` is True: admission keeps no headroom in such a pool.
- *unified* (``--kv-unified``, or no ``-np``): one pool of ``s`` cells that any slot may
  fill alone; the slots together can overrun it.

``kv_layout`` (replica config) says which: ``per_slot``, ``unified``, or ``auto`` (the
default). ``auto`` takes the safe reading, unified (pool ``s``): it is exact for a
unified server and under-states a per-slot one by ``n``, where reading ``n x s`` would
over-state a unified one by ``n`` and an overrun fails every running request. It then
raises the pool only on proof read from ``/slots``: each slot lists the tokens its cache
holds (``n_prompt_tokens``; an idle slot keeps its last request's), and the slots of a
unified pool of ``s`` cells can never hold more than ``s`` tokens together (a unified
server clears idle slots as it starts new work, and only parallel sampling, ``n > 1``,
makes two slots share cells: slots showing the same ``prompt`` are counted once). So when
they hold more than ``s``:

- and ``s`` is below the model's trained context (``meta.n_ctx_train``), nothing but the
  per-slot split (or ``--kv-unified-per-slot``, which sizes its pool ``n x s``) made the
  slots that small: the layout is read as per slot;
- otherwise (the trained context may have capped ``s`` in a larger unified pool) the pool
  is at least what the slots held, and that lower bound is used, up to ``n x s``.

A proof is forgotten when the server restarts (its task ids start again) or stops
answering, and auto falls back to the unified reading. One case auto gets wrong is a
unified server started with both ``-c C`` and ``--kv-unified-per-slot P`` where
``C < n x P``: it is read as ``n x P``; set ``kv_layout: unified`` or pin ``pool_tokens``
for it. Older builds that report the whole cache as a top-level ``n_ctx`` need none of
this: that figure is the pool. A pinned ``pool_tokens`` wins over all of it (discovery).

``/slots`` also gives the running gauge (slots ``is_processing``), which tells admission
when an abandoned request has really stopped. It is optional: a server started with
``--no-slots`` is still served, with the unified reading under ``auto``. Each ``/slots``
call is a task in llama-server's queue and its answer restarts the one-second wait after
which llama-server notices a non-stream client gone, so keep
``discovery.refresh_interval_s`` above one second for llama.cpp replicas (the default
is 2 s). Cells are per token: block size 1.
"""

from __future__ import annotations

from typing import Any, Literal

from routing.adapters._common import Responses, apply_models, as_int, ok_body, parse_json
from routing.types import ReplicaState

KvLayout = Literal["auto", "per_slot", "unified"]


class LlamaCppAdapter:
    engine = "llamacpp"
    probe_paths: tuple[str, ...] = ("/props", "/v1/models", "/slots")
    missing_capacity = "no n_ctx in /props: is this llama.cpp's llama-server? (engine: llamacpp)"

    def __init__(self, kv_layout: KvLayout = "auto") -> None:
        if kv_layout not in ("auto", "per_slot", "unified"):
            raise ValueError(f"kv_layout must be auto, per_slot or unified, not {kv_layout!r}")
        self.kv_layout: KvLayout = kv_layout
        # What /slots has proven under `auto`, for the server as last seen.
        self._shape: tuple[int, int | None] | None = None  # (slots, per-slot context)
        self._held_max = 0  # the most tokens the slots were seen holding at once
        self._task_max = -1  # the highest task id seen (it only grows until a restart)

    def apply(self, state: ReplicaState, responses: Responses, now: float) -> None:
        state.updated_at = now
        state.preempts = False
        state.block_size = 1
        models_body = ok_body(responses, "/v1/models")
        models_ok = apply_models(state, models_body)
        props = parse_json(ok_body(responses, "/props"))
        if not isinstance(props, dict):
            self._forget()
            state.ready = False
            return
        n = as_int(props.get("total_slots")) or 1
        settings = props.get("default_generation_settings")
        slot_ctx = as_int(settings.get("n_ctx")) if isinstance(settings, dict) else None
        whole = as_int(props.get("n_ctx"))  # older builds: the whole cache
        state.max_running = n
        if slot_ctx is None:
            slot_ctx = whole
        if (n, slot_ctx) != self._shape:
            self._forget()  # another server, or the same one relaunched differently
            self._shape = (n, slot_ctx)
        slots = parse_json(ok_body(responses, "/slots"))
        if isinstance(slots, list):
            self._read_slots(state, slots, now)
        if slot_ctx is not None:
            state.max_model_len = slot_ctx
            pool, private = self._pool(n, slot_ctx, whole, _n_ctx_train(models_body))
            state.capacity_tokens = pool
            state.private_slots = private
        state.ready = models_ok and state.capacity_tokens is not None

    # ------------------------------------------------------------------ the pool
    def _pool(self, n: int, s: int, whole: int | None, n_ctx_train: int | None) -> tuple[int, bool]:
        """(pool tokens, private slots) for `n` slots of `s` tokens."""
        if whole is not None and self.kv_layout == "auto":
            return whole, whole >= n * s  # slots capped at s cannot overrun n x s
        if self.kv_layout == "per_slot":
            return n * s, True
        if self.kv_layout == "unified":
            return whole if whole is not None else s, False
        held = self._held_max
        if held <= s:
            return s, False  # the safe reading: unified
        if n_ctx_train is not None and s < n_ctx_train:
            return n * s, True  # per slot (module docstring)
        return min(held, n * s), False  # a proven lower bound of a larger unified pool

    def _read_slots(self, state: ReplicaState, slots: list[Any], now: float) -> None:
        """The running gauge, and under `auto` the tokens the slots hold together."""
        busy = 0
        held: dict[object, int] = {}
        task_max = -1
        for i, slot in enumerate(slots):
            if not isinstance(slot, dict):
                continue
            if slot.get("is_processing") is True:
                busy += 1
            tokens = slot.get("n_prompt_tokens")
            if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0:
                # Slots that show the same prompt may share its cells (parallel sampling).
                prompt = slot.get("prompt")
                key: object = ("prompt", prompt) if isinstance(prompt, str) else ("slot", i)
                held[key] = max(held.get(key, 0), tokens)
            task = slot.get("id_task")
            if isinstance(task, int) and not isinstance(task, bool):
                task_max = max(task_max, task)
        state.engine_running = busy
        state.running_seen_at = now
        if task_max < self._task_max:
            # Task ids started again: a restarted server, perhaps relaunched differently.
            self._held_max = 0
        self._task_max = max(self._task_max, task_max)
        self._held_max = max(self._held_max, sum(held.values()))

    def _forget(self) -> None:
        self._shape = None
        self._held_max = 0
        self._task_max = -1


def _n_ctx_train(body: str | None) -> int | None:
    """The smallest trained context among the listed models (``meta.n_ctx_train``)."""
    doc = parse_json(body)
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        return None
    found = [
        as_int(item["meta"].get("n_ctx_train"))
        for item in doc["data"]
        if isinstance(item, dict) and isinstance(item.get("meta"), dict)
    ]
    values = [v for v in found if v is not None]
    return min(values) if values else None
