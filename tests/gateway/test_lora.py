"""LoRA adapters are models: what discovery learns of them (vLLM lists each with
``parent`` naming its base), where their requests go (only replicas that serve them, in
the replica's one KV pool and under its running cap, within the base's context), which
tenants may use them (those allowed the base, or the adapter by name) and how kvgate's
``/v1/models`` lists them. Real HTTP on loopback, to enginesim replicas that serve
adapters as vLLM does (``lora_modules``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from admission.tenants import TenantState, hash_key
from enginesim.lora import LoraModule
from gateway.fleet.discovery import ModelCatalog
from gateway.models_api import ModelsApi
from routing.adapters._common import apply_models
from routing.types import ReplicaState
from tests.gateway.conftest import MODEL, wait_for

KEY_BASE = "sk-lora-base-0123456789abcdef"
KEY_SQL = "sk-lora-sql-0123456789abcdef0"
KEY_OTHER = "sk-lora-other-0123456789abcde"
LORAS = ["sql=/adapters/sql", "chat=/adapters/chat"]


def tenants() -> list[dict]:
    def t(name: str, key: str, models: list[str]) -> dict:
        return {"name": name, "keys_sha256": [hash_key(key)], "models": models}

    return [
        t("base", KEY_BASE, [MODEL]),  # the base, hence its adapters
        t("sql", KEY_SQL, ["sql"]),  # one adapter by its own name
        t("other", KEY_OTHER, ["another-model"]),
    ]


def chat(model: str, max_tokens: int = 3, content: str = "hi", **extra) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }


async def post(url: str, body: dict, key: str | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/chat/completions", json=body, headers=headers) as r,
    ):
        return r.status, await r.json()


async def get(url: str, path: str, key: str | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as s, s.get(url + path, headers=headers) as r:
        return r.status, await r.json()


# ------------------------------------------------------------------ what is learned
VLLM_MODELS = {
    "object": "list",
    "data": [
        {"id": "llama", "root": "/m/llama", "parent": None, "max_model_len": 8192},
        {"id": "sql", "root": "/adapters/sql", "parent": "llama", "max_model_len": None},
        {"id": "chat", "root": "/adapters/chat", "parent": "llama"},
    ],
}


def test_discovery_reads_adapters_and_keeps_the_bases_context() -> None:
    st = ReplicaState("r0", "http://x")
    assert apply_models(st, json.dumps(VLLM_MODELS))
    assert st.models == ["llama", "sql", "chat"]
    assert st.adapters == {"sql": "llama", "chat": "llama"}
    assert st.max_model_len == 8192  # the base's: an adapter lists none
    # The adapter unloaded (vLLM's /v1/unload_lora_adapter): it is gone from both.
    VLLM_MODELS_AFTER = {"data": VLLM_MODELS["data"][:2]}
    assert apply_models(st, json.dumps(VLLM_MODELS_AFTER))
    assert st.models == ["llama", "sql"] and st.adapters == {"sql": "llama"}
    # A parent naming the entry itself, or not a string, is no adapter.
    odd = {"data": [{"id": "a", "parent": "a"}, {"id": "b", "parent": 3}]}
    assert apply_models(st, json.dumps(odd)) and st.adapters == {}


def test_a_tenant_may_use_the_adapters_of_a_base_it_is_allowed() -> None:
    st = TenantState("t", models=frozenset({"llama", "sql-only"}))
    assert st.may_use("llama", frozenset({"llama"}))
    assert st.may_use("sql", frozenset({"llama"}))  # an adapter of its base
    assert st.may_use("sql-only", frozenset({"qwen"}))  # allowed by its own name
    assert not st.may_use("sql", frozenset({"qwen"}))  # an adapter of another base
    assert not st.may_use("sql")  # served nowhere: only its own name counts
    # One name, two bases (or a base on one replica): every one must be allowed.
    assert not st.may_use("sql", frozenset({"llama", "qwen"}))
    assert not st.may_use("sql", frozenset({"llama", "sql"}))
    assert TenantState("all").may_use("anything", frozenset({"whatever"}))


def test_the_catalog_knows_each_adapters_base_across_the_fleet() -> None:
    cat = ModelCatalog()
    a = ReplicaState("a", "u", models=["llama", "sql"], adapters={"sql": "llama"})
    b = ReplicaState("b", "u", models=["qwen", "sql"], adapters={"sql": "qwen"})
    cat.saw("a", a)
    assert cat.bases_of("sql") == {"llama"} and cat.bases_of("llama") == {"llama"}
    assert cat.bases_of("nope") == frozenset()
    cat.saw("b", b)
    assert cat.bases_of("sql") == {"llama", "qwen"}  # the names collide: both count
    cat.forget("b")
    assert cat.bases_of("sql") == {"llama"} and cat.bases_of("qwen") == frozenset()
    a.models, a.adapters = ["llama"], {}
    cat.saw("a", a)  # unloaded
    assert cat.bases_of("sql") == frozenset()
    assert {"llama", "sql", "qwen"} <= cat.known  # the metrics label bound only grows


# ------------------------------------------------------------------ routing
async def test_an_adapters_requests_go_only_to_replicas_that_serve_it(replica, gateway):
    with_lora = await replica(lora_modules=LORAS)
    plain = await replica()
    gw = await gateway(with_lora, plain)
    assert gw.state.discovery.bases_of("sql") == {MODEL}
    got = await asyncio.gather(*(post(gw.url, chat("sql")) for _ in range(8)))
    assert all(status == 200 and out["model"] == "sql" for status, out in got), got
    assert with_lora.core.stats().num_finished == 8
    assert plain.core.stats().num_finished == 0
    # The base model is served by both.
    got = await asyncio.gather(*(post(gw.url, chat(MODEL)) for _ in range(16)))
    assert all(status == 200 for status, _ in got)
    assert plain.core.stats().num_finished > 0
    # The replica that served it retired: its adapters are nobody's now.
    gw.state.discovery.retire("r0")
    assert gw.state.discovery.bases_of("sql") == frozenset()
    assert gw.state.discovery.bases_of(MODEL) == {MODEL}
    status, out = await post(gw.url, chat("sql"))
    assert status == 404 and out["error"]["code"] == "model_not_found"


@pytest.mark.slow
async def test_an_adapter_shares_its_replicas_running_cap_with_the_base(replica, gateway):
    """One replica, one running slot: an adapter request waits for the base's."""
    srv = await replica(lora_modules=LORAS, speed=1.0)
    gw = await gateway(replicas=[{"name": "r0", "url": srv.url, "max_running": 1}])
    await wait_for(lambda: all(w.state.ready for w in gw.state.discovery.watchers.values()))
    base = asyncio.create_task(post(gw.url, chat(MODEL, max_tokens=1500)))
    assert await wait_for(lambda: gw.report.replica_usage()[0].running == 1)
    adapter = asyncio.create_task(post(gw.url, chat("sql")))
    assert await wait_for(lambda: gw.report.queue_depth() == 1)
    assert not base.done()
    (s1, out1), (s2, out2) = await asyncio.gather(base, adapter)
    assert (s1, s2) == (200, 200), (out1, out2)
    assert out2["model"] == "sql"


async def test_an_adapter_has_its_bases_context(replica, gateway):
    """The tiny base's max_model_len is 2,048: a prompt over it for the adapter is
    refused by kvgate on an exact count (the replica's /tokenize, asked with the
    adapter's name), never sent to the engine."""
    srv = await replica(lora_modules=LORAS)
    gw = await gateway(srv)
    too_long = " ".join(["abcdef"] * 2100)
    status, out = await post(gw.url, chat("sql", max_tokens=8, content=too_long))
    assert status == 400, out
    err = out["error"]
    assert err["code"] == "context_length_exceeded"
    assert err["type"] == "invalid_request_error"  # kvgate's own, not the engine's relayed
    assert "in the messages" in err["message"]
    assert srv.core.stats().num_finished == 0


async def test_an_adapter_loaded_at_runtime_becomes_a_model_and_unloaded_goes(replica, gateway):
    srv = await replica()
    gw = await gateway(srv)
    disc = gw.state.discovery
    status, out = await post(gw.url, chat("fin"))
    assert status == 404 and out["error"]["code"] == "model_not_found"
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            srv.url + "/v1/load_lora_adapter", json={"lora_name": "fin", "lora_path": "/a/fin"}
        ) as r,
    ):
        assert r.status == 200
    assert await wait_for(lambda: disc.bases_of("fin") == {MODEL})
    assert await wait_for(lambda: "fin" in gw.report.models())
    status, out = await post(gw.url, chat("fin"))
    assert status == 200 and out["model"] == "fin"
    async with (
        aiohttp.ClientSession() as s,
        s.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "fin"}) as r,
    ):
        assert r.status == 200
    assert await wait_for(lambda: disc.bases_of("fin") == frozenset())
    assert await wait_for(lambda: "fin" not in gw.report.models())
    status, out = await post(gw.url, chat("fin"))
    assert status == 404 and out["error"]["code"] == "model_not_found"


# ------------------------------------------------------------------ tenants and /v1/models
@asynccontextmanager
async def serving(api: ModelsApi) -> AsyncIterator[str]:
    """`api`'s two routes on a loopback port, as the app mounts them."""
    app = web.Application()
    app.router.add_get("/v1/models", api.list)
    app.router.add_get("/v1/models/{model}", api.get)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def ids(listing: dict) -> dict[str, object]:
    return {c["id"]: c.get("parent", "-") for c in listing["data"]}


async def test_models_lists_an_adapter_for_the_tenants_allowed_it(replica, gateway):
    """`ModelsApi` with discovery's `bases_of`, over the live gateway's discovery."""
    srv = await replica(lora_modules=[*LORAS, LoraModule("odd", "/a/odd", "elsewhere")])
    gw = await gateway(srv, tenants=tenants())
    st = gw.state
    api = ModelsApi(lambda: st.tenants, st.door.report.models, st.discovery.bases_of)
    async with serving(api) as url:
        status, out = await get(url, "/v1/models", KEY_BASE)
        assert status == 200
        # The base and its adapters, each with `parent` as vLLM's card has it; not the
        # adapter of a base the tenant is not allowed.
        assert ids(out) == {MODEL: None, "sql": MODEL, "chat": MODEL}
        status, out = await get(url, "/v1/models", KEY_SQL)
        assert ids(out) == {"sql": MODEL}
        status, out = await get(url, "/v1/models", KEY_OTHER)
        assert ids(out) == {}
        status, out = await get(url, "/v1/models/sql", KEY_BASE)
        assert status == 200 and out["parent"] == MODEL
        status, out = await get(url, "/v1/models/chat", KEY_SQL)
        assert status == 404 and out["error"]["code"] == "model_not_found"
        status, _ = await get(url, "/v1/models", None)
        assert status == 401


async def test_the_gateways_models_list_names_the_adapters(replica, gateway):
    srv = await replica(lora_modules=LORAS)
    gw = await gateway(srv)
    status, out = await get(gw.url, "/v1/models")
    assert status == 200
    assert {c["id"] for c in out["data"]} == {MODEL, "sql", "chat"}


async def test_a_tenant_allowed_an_adapter_by_name_uses_it_and_only_it(replica, gateway):
    srv = await replica(lora_modules=LORAS)
    gw = await gateway(srv, tenants=tenants())
    status, out = await post(gw.url, chat("sql"), KEY_SQL)
    assert status == 200 and out["model"] == "sql"
    for key, model in ((KEY_SQL, MODEL), (KEY_SQL, "chat"), (KEY_OTHER, "sql")):
        status, out = await post(gw.url, chat(model), key)
        assert status == 404 and out["error"]["code"] == "model_not_found", (key, model)


async def test_a_tenant_allowed_the_base_uses_its_adapters(replica, gateway):
    srv = await replica(lora_modules=LORAS)
    gw = await gateway(srv, tenants=tenants())
    for model in (MODEL, "sql", "chat"):
        status, out = await post(gw.url, chat(model), KEY_BASE)
        assert status == 200 and out["model"] == model, out
