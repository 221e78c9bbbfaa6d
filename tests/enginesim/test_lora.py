"""LoRA adapters in the simulator, as vLLM serves them: ``--lora-modules``, the
``/v1/models`` entries with ``parent``, requests by the adapter's name, runtime loading,
and the prefix cache that keeps an adapter's blocks apart from its base's."""

from __future__ import annotations

import random

import pytest

from enginesim.cli import build_parser, main
from enginesim.core import EngineCore
from enginesim.lora import LoraModule, parse_lora_module
from enginesim.profiles import load_profile
from enginesim.types import EventKind, SimRequest
from tests.enginesim.helpers import CHAT, COMPLETIONS, chat_body

BASE = "tiny-llm"


# ------------------------------------------------------------------ the flag's syntax
def test_lora_modules_take_vllms_two_forms() -> None:
    assert parse_lora_module("sql=/adapters/sql") == LoraModule("sql", "/adapters/sql")
    assert parse_lora_module(
        '{"name": "sql", "path": "/a/sql", "base_model_name": "other"}'
    ) == LoraModule("sql", "/a/sql", "other")
    for bad in ("sql", "=/p", "sql=", '{"name": "sql"}', "[1]", '{"name": 1, "path": "/p"}'):
        with pytest.raises(ValueError):
            parse_lora_module(bad)


def test_the_cli_reads_lora_modules_and_refuses_them_off_vllm(capsys) -> None:
    args = build_parser().parse_args(
        ["serve", "--profile", "tiny", "--lora-modules", "a=/p/a", '{"name":"b","path":"/p/b"}']
    )
    assert args.lora_modules == [LoraModule("a", "/p/a"), LoraModule("b", "/p/b")]
    with pytest.raises(SystemExit):
        main(["serve", "--profile", "tiny", "--flavor", "sglang", "--lora-modules", "a=/p"])
    assert "--lora-modules" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a name used twice
        main(["serve", "--profile", "tiny", "--lora-modules", "a=/p", "a=/q"])
    with pytest.raises(SystemExit):  # the base's own name
        main(["serve", "--profile", "tiny", "--lora-modules", f"{BASE}=/p"])


# ------------------------------------------------------------------ over HTTP
async def test_models_lists_each_adapter_with_its_parent(enginesim_server, session) -> None:
    srv = await enginesim_server(
        "tiny", lora_modules=["sql=/adapters/sql", LoraModule("chat", "/a/chat", "alias")]
    )
    async with session.get(srv.url + "/v1/models") as r:
        data = (await r.json())["data"]
    by_id = {c["id"]: c for c in data}
    assert [c["id"] for c in data] == [BASE, "sql", "chat"]
    assert by_id[BASE]["parent"] is None and by_id[BASE]["max_model_len"] == 2048
    assert by_id["sql"]["parent"] == BASE and by_id["sql"]["root"] == "/adapters/sql"
    assert by_id["sql"]["max_model_len"] is None  # vLLM lists none: the base's applies
    assert by_id["chat"]["parent"] == "alias"


async def test_a_request_for_an_adapter_is_served_under_its_name(enginesim_server, session):
    srv = await enginesim_server("tiny", lora_modules=["sql=/adapters/sql"])
    async with session.post(
        srv.url + CHAT, json=chat_body(model="sql", max_tokens=3, ignore_eos=True)
    ) as r:
        assert r.status == 200
        out = await r.json()
    assert out["model"] == "sql" and out["usage"]["completion_tokens"] == 3
    comp = {"model": "sql", "prompt": "hi", "max_tokens": 2, "ignore_eos": True, "stream": True}
    async with session.post(srv.url + COMPLETIONS, json=comp) as r:
        assert r.status == 200
        raw = await r.read()
    assert b'"model":"sql"' in raw.replace(b" ", b"")
    async with session.post(srv.url + "/tokenize", json={"model": "sql", "prompt": "hi"}) as r:
        assert r.status == 200 and (await r.json())["count"] > 0
    async with session.post(srv.url + CHAT, json=chat_body(model="nope", max_tokens=1)) as r:
        assert r.status == 404
        assert (await r.json())["error"]["type"] == "NotFoundError"


async def test_adapters_load_and_unload_at_runtime(enginesim_server, session) -> None:
    srv = await enginesim_server("tiny")
    body = chat_body(model="fin", max_tokens=1)
    async with session.post(srv.url + CHAT, json=body) as r:
        assert r.status == 404
    load = {"lora_name": "fin", "lora_path": "/a/fin"}
    async with session.post(srv.url + "/v1/load_lora_adapter", json=load) as r:
        assert r.status == 200
    async with session.post(srv.url + "/v1/load_lora_adapter", json=load) as r:
        assert r.status == 400  # already loaded
    async with session.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "x"}) as r:
        assert r.status == 400
    async with session.get(srv.url + "/v1/models") as r:
        cards = (await r.json())["data"]
    assert {c["id"]: c["parent"] for c in cards} == {BASE: None, "fin": BASE}
    async with session.post(srv.url + CHAT, json=body) as r:
        assert r.status == 200 and (await r.json())["model"] == "fin"
    async with session.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "fin"}) as r:
        assert r.status == 200
    async with session.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "fin"}) as r:
        assert r.status == 404
    async with session.post(srv.url + CHAT, json=body) as r:
        assert r.status == 404


async def test_only_the_vllm_flavor_serves_adapters(enginesim_server) -> None:
    with pytest.raises(ValueError, match="lora_modules"):
        await enginesim_server("tiny", flavor="sglang", lora_modules=["a=/p"])


# ------------------------------------------------------------------ the prefix cache
def _served(core: EngineCore, req: SimRequest, now: float) -> tuple[float, int]:
    """Run `req` to its end; the time it ended and its cached prompt tokens."""
    core.add_request(req, now)
    while core.has_work():
        res = core.step(now)
        now = res.end
        for ev in res.events:
            if ev.kind is EventKind.FINISHED and ev.request_id == req.request_id:
                cached = ev.cached_tokens
    return now, cached


def test_an_adapters_kv_blocks_are_its_own() -> None:
    """vLLM keys a cached block by its adapter too: a prompt the base cached is no hit
    for an adapter, nor for another adapter; the same adapter hits its own."""
    core = EngineCore(load_profile("tiny"), seed=0)
    rng = random.Random(7)
    prompt = [rng.randrange(300, 100_000) for _ in range(160)]

    def req(rid: str, lora: str | None) -> SimRequest:
        return SimRequest(rid, list(prompt), max_tokens=2, ignore_eos=True, lora_name=lora)

    now, cached = _served(core, req("base", None), 0.0)
    assert cached == 0
    now, cached = _served(core, req("sql-1", "sql"), now)
    assert cached == 0  # the base's blocks are not the adapter's
    now, cached = _served(core, req("chat-1", "chat"), now)
    assert cached == 0
    now, cached = _served(core, req("sql-2", "sql"), now)
    assert cached == 144  # its own: the prompt's full blocks but the last token's
    _, cached = _served(core, req("base-2", None), now)
    assert cached == 144
