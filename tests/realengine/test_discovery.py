"""What llama-server says about itself, per KV layout (scripts/REAL_ENGINE_NOTES.md)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from tests.realengine.llama import MODEL_ALIAS, N_CTX, N_SLOTS, LlamaServer, engine_file, user

# The context one slot may use: n_ctx / n_slots per slot, the whole n_ctx when unified.
SLOT_CTX = {"per_slot": N_CTX // N_SLOTS, "unified": N_CTX}

METRICS = {
    "llamacpp:prompt_tokens_total": "counter",
    "llamacpp:prompt_tokens_cached_total": "counter",
    "llamacpp:prompt_seconds_total": "counter",
    "llamacpp:tokens_predicted_total": "counter",
    "llamacpp:tokens_predicted_seconds_total": "counter",
    "llamacpp:n_decode_total": "counter",
    "llamacpp:n_tokens_max": "counter",
    "llamacpp:prompt_tokens_seconds": "gauge",
    "llamacpp:predicted_tokens_seconds": "gauge",
    "llamacpp:requests_processing": "gauge",
    "llamacpp:requests_deferred": "gauge",
    "llamacpp:n_busy_slots_per_decode": "gauge",
}


def test_health(engine: LlamaServer) -> None:
    reply = engine.get("/health")
    assert reply.status == 200
    assert reply.json() == {"status": "ok"}


def test_props_report_slots_and_slot_context_not_the_layout(engine: LlamaServer) -> None:
    props = engine.props()
    assert props["total_slots"] == N_SLOTS
    assert props["default_generation_settings"]["n_ctx"] == SLOT_CTX[engine.name]
    assert props["model_alias"] == MODEL_ALIAS
    assert props["endpoint_slots"] is True and props["endpoint_metrics"] is True
    assert props["is_sleeping"] is False
    # No whole-cache n_ctx and no word of the KV layout: per-slot 4 x 1,024 and unified
    # 1 x 4,096 differ only in the per-slot figure, which alone cannot tell them apart.
    assert "n_ctx" not in props
    assert "unified" not in json.dumps(props).lower()


def test_slots_list_each_slot_with_its_context(engine: LlamaServer) -> None:
    slots = engine.slots()
    assert [s["id"] for s in slots] == list(range(N_SLOTS))
    assert {s["n_ctx"] for s in slots} == {SLOT_CTX[engine.name]}
    assert not any(s["is_processing"] for s in slots)


def test_metrics_names_and_types(engine: LlamaServer) -> None:
    reply = engine.get("/metrics")
    assert reply.status == 200
    types = {}
    for line in reply.body.decode().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            types[name] = kind
    assert {name: types.get(name) for name in METRICS} == METRICS
    assert all(name.startswith("llamacpp:") for name in types)


def test_models_use_the_alias_and_report_slot_context(engine: LlamaServer) -> None:
    body = engine.get("/v1/models").json()
    assert body["object"] == "list"
    [model] = body["data"]
    assert model["id"] == MODEL_ALIAS
    assert model["owned_by"] == "llamacpp"
    assert model["meta"]["n_ctx"] == SLOT_CTX[engine.name]
    assert model["meta"]["n_ctx_train"] == 4096
    assert model["meta"]["n_vocab"] == 4096


def test_apply_template_and_tokenize_count_the_prompt_exactly(engine: LlamaServer) -> None:
    prompt = engine.post("/apply-template", {"messages": user("hi")}).json()["prompt"]
    assert prompt == "<|bos|><|user|>hi<|end|><|assistant|>"
    tokens = engine.post("/tokenize", {"content": prompt}).json()["tokens"]
    assert len(tokens) == 6  # 4 control tokens + "hi" (2)
    reply = engine.post("/v1/chat/completions", {"messages": user("hi"), "max_tokens": 1})
    assert reply.json()["usage"]["prompt_tokens"] == len(tokens)


@pytest.mark.parametrize(
    "text",
    [
        "<|bos|><|user|>hi<|end|><|assistant|>",
        "Hello world, the replica admits 1234 requests!",
        "  spaces\n\nnew lines\ttabs",
        "ünïcödé 漢字 emoji 🙂",
        "don't won't it's",
    ],
)
def test_tokenizer_json_counts_as_the_engine_does(per_slot: LlamaServer, text: str) -> None:
    """The tokenizer.json real-engine.sh writes beside the model is the engine's tokenizer."""
    local = Tokenizer.from_file(str(engine_file("KVGATE_LLAMA_TOKENIZER")))
    remote = per_slot.post("/tokenize", {"content": text}).json()["tokens"]
    assert local.encode(text).ids == remote


def test_slots_show_what_their_caches_hold_which_only_per_slot_can_exceed_a_slot(
    engine: LlamaServer,
) -> None:
    """The one tell between the layouts (routing/adapters/llamacpp.py): each slot lists the
    tokens its cache holds. Per slot, an idle slot keeps its last request's tokens, so three
    requests of ~600 tokens on three slots hold more than one slot's 1,024 together. A
    unified server clears the idle slots whenever it starts a task: one slot holds tokens."""
    for i in range(3):
        reply = engine.post(
            "/v1/chat/completions", {"messages": user(f"{i} " + "the " * 600), "max_tokens": 4}
        )
        assert reply.status == 200
    held = [s.get("n_prompt_tokens", 0) for s in engine.slots()]
    if engine.name == "per_slot":
        assert sum(held) > SLOT_CTX["per_slot"]
        assert sorted(held)[-3:] == [609, 609, 609]
    else:
        assert [n for n in held if n] == [609]
