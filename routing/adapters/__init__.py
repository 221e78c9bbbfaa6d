"""Engine adapters: the only code that knows an engine's endpoints and metric names.

Each adapter is sans-IO. It declares the GET paths it needs (`probe_paths`); the gateway
shell fetches them and hands the answers back as ``{path: (status, body_text)}`` (a
missing path means the replica was unreachable), and `apply` maps them onto the
engine-neutral `ReplicaState` that admission and routing read. A replica is marked ready
only when every probe answered 200 and its KV capacity is known (the generic OpenAI
adapter cannot know capacity; it must be pinned in config, and the admission controller
refuses to route to a replica without capacity).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from routing.types import ReplicaState

Responses = Mapping[str, tuple[int, str]]


@runtime_checkable
class EngineAdapter(Protocol):
    engine: str
    probe_paths: tuple[str, ...]

    def apply(self, state: ReplicaState, responses: Responses, now: float) -> None: ...


def adapter_for(engine: str) -> EngineAdapter:
    """The adapter for `engine` (``vllm`` | ``sglang`` | ``llamacpp`` | ``openai``)."""
    from routing.adapters.llamacpp import LlamaCppAdapter
    from routing.adapters.openai import OpenAIAdapter
    from routing.adapters.sglang import SGLangAdapter
    from routing.adapters.vllm import VLLMAdapter

    adapters: dict[str, type] = {
        "vllm": VLLMAdapter,
        "sglang": SGLangAdapter,
        "llamacpp": LlamaCppAdapter,
        "llama.cpp": LlamaCppAdapter,
        "openai": OpenAIAdapter,
    }
    try:
        return adapters[engine.lower()]()
    except KeyError:
        known = ", ".join(sorted(k for k in adapters if "." not in k))
        raise ValueError(f"unknown engine {engine!r}; expected one of: {known}") from None


__all__ = ["EngineAdapter", "Responses", "adapter_for"]
