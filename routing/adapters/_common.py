"""Parsing helpers shared by the engine adapters (tolerant: bad input yields None)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from routing.types import ReplicaState

Responses = Mapping[str, tuple[int, str]]


@dataclass(slots=True, frozen=True)
class Sample:
    labels: dict[str, str]
    value: float


def ok_body(responses: Responses, path: str) -> str | None:
    """The body of `path` if it answered 200, else None (missing = unreachable)."""
    got = responses.get(path)
    if got is None or got[0] != 200:
        return None
    return got[1]


def parse_json(body: str | None) -> Any:
    if body is None:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return None


def parse_prometheus(
    body: str | None, names: frozenset[str] | None = None
) -> dict[str, list[Sample]] | None:
    """Samples by sample name (e.g. ``vllm:num_preemptions_total``), or None if unparsable.
    `names`: only these samples; the other lines are dropped before parsing (vLLM's
    ``/metrics`` is mostly histogram buckets no adapter reads, parsing it whole costs
    many times what the lines read cost, and discovery parses every replica's every
    round; measured: docs/benchmarks-cost.md)."""
    if body is None:
        return None
    if names is not None:
        body = _only(body, names)
    out: dict[str, list[Sample]] = {}
    try:
        for family in text_string_to_metric_families(body):
            for s in family.samples:
                out.setdefault(s.name, []).append(Sample(dict(s.labels), float(s.value)))
    except (ValueError, TypeError, IndexError):
        return None
    return out


def _only(body: str, names: frozenset[str]) -> str:
    """The sample lines of `body` named in `names` (comments dropped: without its
    ``# TYPE`` a sample parses as untyped under its own name, the key read here)."""
    kept = []
    for line in body.split("\n"):
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(None, 1)[0]  # before the labels or the value
        if name in names:
            kept.append(line)
    kept.append("")
    return "\n".join(kept)


def total(samples: dict[str, list[Sample]], *names: str) -> float | None:
    """Sum of the first metric name present (summed across label sets, e.g. DP engines)."""
    for name in names:
        found = samples.get(name)
        if found:
            values = [s.value for s in found if math.isfinite(s.value)]
            if values:
                return sum(values)
    return None


def mean(samples: dict[str, list[Sample]], *names: str) -> float | None:
    for name in names:
        found = samples.get(name)
        if found:
            values = [s.value for s in found if math.isfinite(s.value)]
            if values:
                return sum(values) / len(values)
    return None


def as_int(value: Any) -> int | None:
    """A positive int from JSON / label text, or None ("None", null, junk, <= 0)."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        number = int(float(value))
    except (TypeError, ValueError, OverflowError):
        return None
    return number if number > 0 else None


def apply_models(state: ReplicaState, body: str | None) -> bool:
    """Update `state.models`, `state.adapters` (and `max_model_len` when listed) from
    ``/v1/models``.

    An entry whose ``parent`` names another model is a LoRA adapter of that base (vLLM:
    ``parent`` the base's served name, ``root`` the adapter's path; a base has ``parent:
    null``). It is a model like any other for routing, and it runs in its base's KV pool
    with its base's context: vLLM lists no ``max_model_len`` for it, and one listed is
    taken as a base's is (the least of them). Returns False when the body is not an
    OpenAI model list.
    """
    doc = parse_json(body)
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        return False
    ids: list[str] = []
    adapters: dict[str, str] = {}
    max_len: int | None = None
    for item in doc["data"]:
        if not isinstance(item, dict) or not isinstance(item.get("id"), str):
            continue
        ids.append(item["id"])
        parent = item.get("parent")
        if isinstance(parent, str) and parent and parent != item["id"]:
            adapters[item["id"]] = parent
        length = as_int(item.get("max_model_len"))
        if length is not None:
            max_len = length if max_len is None else min(max_len, length)
    if not ids:
        return False
    state.models = ids
    state.adapters = adapters
    if max_len is not None:
        state.max_model_len = max_len
    return True


@dataclass(slots=True, frozen=True)
class LoadMetrics:
    """An engine's names for the load `apply_load` reads: each field the sample names
    tried in order (empty: the engine has none)."""

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    usage: tuple[str, ...]
    preemptions: tuple[str, ...]
    prefix_queries: tuple[str, ...] = ()
    prefix_hits: tuple[str, ...] = ()
    spec_draft: tuple[str, ...] = ()
    spec_accepted: tuple[str, ...] = ()
    itl: tuple[str, ...] = ()  # histograms' base names: their _sum and _count are read

    def read(self, *more: str) -> frozenset[str]:
        """Every sample `apply_load` reads with these names, and `more` an adapter reads
        itself: what `parse_prometheus` keeps."""
        return frozenset(
            (
                *self.running,
                *self.waiting,
                *self.usage,
                *self.preemptions,
                *self.prefix_queries,
                *self.prefix_hits,
                *self.spec_draft,
                *self.spec_accepted,
                *(name + suffix for name in self.itl for suffix in ("_sum", "_count")),
                *more,
            )
        )


def apply_load(state: ReplicaState, samples: dict[str, list[Sample]], m: LoadMetrics) -> None:
    """Copy an engine's load gauges onto `state`, each from the first metric name present
    (summed across label sets; KV usage averaged). Absent metrics leave the field as is."""
    if (value := total(samples, *m.running)) is not None:
        state.engine_running = int(value)
        state.running_seen_at = state.updated_at
    if (value := total(samples, *m.waiting)) is not None:
        state.engine_waiting = int(value)
    if (value := mean(samples, *m.usage)) is not None:
        state.kv_usage = value
    if (value := total(samples, *m.preemptions)) is not None:
        state.preemptions_total = value
    if m.prefix_queries and (value := total(samples, *m.prefix_queries)) is not None:
        state.prefix_cache_queries_total = value
    if m.prefix_hits and (value := total(samples, *m.prefix_hits)) is not None:
        state.prefix_cache_hits_total = value
    if m.spec_draft and (value := total(samples, *m.spec_draft)) is not None:
        state.spec_draft_tokens_total = value
    if m.spec_accepted and (value := total(samples, *m.spec_accepted)) is not None:
        state.spec_accepted_tokens_total = value
    for name in m.itl:  # a histogram's base name: the first one present wins
        s = total(samples, name + "_sum")
        n = total(samples, name + "_count")
        if s is not None and n is not None:
            state.itl_sum_s, state.itl_count = s, n
            break
