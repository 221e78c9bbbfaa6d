"""LoRA adapters as vLLM serves them (``vllm serve BASE --enable-lora --lora-modules ...``).

An adapter is a model by name: ``/v1/models`` lists it after the base model, with
``root`` its path and ``parent`` its base's served name (a base has ``parent: null``;
vLLM lists no ``max_model_len`` for an adapter, it has its base's), and a request whose
``model`` names it is served, its responses naming it as their model. It runs in the
base's one KV pool, and its KV blocks are its own: vLLM keys a cached block by the
adapter too (a prompt cached under the base is no hit under an adapter, nor across two
adapters), so the simulator seeds an adapter request's block hash chain with its name.

`parse_lora_module` reads vLLM's ``--lora-modules`` syntax: ``name=path``, or the JSON
form ``{"name": ..., "path": ..., "base_model_name": ...}``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, frozen=True)
class LoraModule:
    name: str
    path: str
    base_model_name: str | None = None  # None: the server's (first) served model


def parse_lora_module(text: str) -> LoraModule:
    """One ``--lora-modules`` value; ValueError naming what is wrong."""
    text = text.strip()
    if text.startswith("{"):
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"not valid JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise ValueError("the JSON form must be an object")
        name, path, base = doc.get("name"), doc.get("path"), doc.get("base_model_name")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError('the JSON form needs "name" and "path" strings')
        if base is not None and not isinstance(base, str):
            raise ValueError('"base_model_name" must be a string')
        return LoraModule(name, path, base or None)
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"expected name=path or a JSON object, got {text!r}")
    return LoraModule(name.strip(), path.strip())


def lora_table(modules: Iterable[LoraModule | str], base: str) -> dict[str, LoraModule]:
    """The adapters by name, each with its base named (`base` where it names none);
    ValueError for a name used twice or one that is the base's own."""
    out: dict[str, LoraModule] = {}
    for m in modules:
        mod = parse_lora_module(m) if isinstance(m, str) else m
        if mod.base_model_name is None:
            mod = LoraModule(mod.name, mod.path, base)
        if mod.name == base or mod.name in out:
            raise ValueError(f"LoRA module name {mod.name!r} is already a served model")
        out[mod.name] = mod
    return out


def lora_card(mod: LoraModule, created: int) -> dict[str, Any]:
    """The adapter's entry in ``/v1/models``, as vLLM's ``ModelCard`` serializes it."""
    return {
        "id": mod.name,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": mod.path,
        "parent": mod.base_model_name,
        "max_model_len": None,
    }
