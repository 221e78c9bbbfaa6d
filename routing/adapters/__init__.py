"""Engine adapters: the only code that knows an engine's endpoints and metric names.

Each adapter is sans-IO. It declares the GET paths it needs (`probe_paths`); the gateway
shell fetches them and hands the answers back as ``{path: (status, body_text)}`` (a
missing path means the replica was unreachable), and `apply` maps them onto the
engine-neutral `ReplicaState` that admission and routing read, including how the engine
behaves when its pool is over-admitted (``preempts``: vLLM and SGLang preempt, llama.cpp
fails; the generic OpenAI adapter cannot know and keeps the default, preempting, so a
pinned pool there is reserved like vLLM's). A replica is marked ready
only when every probe answered 200 and its KV capacity is known (the generic OpenAI
adapter cannot know capacity; it must be pinned in config, and the admission controller
refuses to route to a replica without capacity).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from routing.types import ReplicaState

if TYPE_CHECKING:  # the adapters are imported when one is asked for
    from routing.adapters.llamacpp import KvLayout

Responses = Mapping[str, tuple[int, str]]


@runtime_checkable
class EngineAdapter(Protocol):
    engine: str
    probe_paths: tuple[str, ...]

    def apply(self, state: ReplicaState, responses: Responses, now: float) -> None: ...


def adapter_for(engine: str, *, kv_layout: KvLayout = "auto") -> EngineAdapter:
    """The adapter for `engine` (``vllm`` | ``sglang`` | ``llamacpp`` | ``openai``).

    `kv_layout` (``auto`` | ``per_slot`` | ``unified``) is llama.cpp's KV layout, which
    the server does not report (see `routing.adapters.llamacpp`); other engines accept
    only ``auto``.
    """
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
        cls = adapters[engine.lower()]
    except KeyError:
        known = ", ".join(sorted(k for k in adapters if "." not in k))
        raise ValueError(f"unknown engine {engine!r}; expected one of: {known}") from None
    if cls is LlamaCppAdapter:
        return LlamaCppAdapter(kv_layout)
    if kv_layout != "auto":
        raise ValueError(f"kv_layout applies to llama.cpp replicas only, not to {engine!r}")
    return cls()


__all__ = ["EngineAdapter", "Responses", "adapter_for"]
