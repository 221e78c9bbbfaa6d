"""A request that names no model, as vLLM answers it (gateway/default_model.py): the
one base model the replicas serve, else a 400 that names the choice; Anthropic's
Messages API still requires it."""

from __future__ import annotations

import json

import aiohttp
import pytest

from gateway.default_model import default_model, fill_model
from gateway.errors import ApiError
from tests.gateway.conftest import MODEL, all_replicas_ready

LORAS = ["sql=/adapters/sql"]


def chat() -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_a_request_that_names_no_model_goes_to_the_one_base_model(replica, gateway):
    # The base and an adapter on it: the adapter is not the default, as on vLLM.
    gw = await gateway(await replica(lora_modules=LORAS))
    assert await all_replicas_ready(gw)
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/chat/completions", json=chat()) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["model"] == MODEL
        body = {"prompt": "hello", "max_tokens": 3}
        async with s.post(gw.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["model"] == MODEL
        async with s.post(gw.url + "/tokenize", json={"prompt": "hello"}) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["count"] > 0
        form = aiohttp.FormData(default_to_multipart=True)
        form.add_field("file", b"\0" * 6400, filename="a.wav", content_type="audio/wav")
        async with s.post(gw.url + "/v1/audio/transcriptions", data=form) as r:
            assert r.status == 200, await r.text()
    assert gw.report.reserved_tokens() == 0


async def test_with_several_models_the_request_is_told_which_it_may_name(
    replica, gateway, enginesim_server
):
    other = await enginesim_server("seed2-8b-16gb", speed=50.0)
    gw = await gateway(await replica(), other)
    assert await all_replicas_ready(gw)
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/chat/completions", json=chat()) as r:
            assert r.status == 400
            err = (await r.json())["error"]
            assert err["param"] == "model" and err["type"] == "invalid_request_error"
            assert MODEL in err["message"] and "llama-3.1-8b-instruct-awq" in err["message"]
        async with s.post(gw.url + "/tokenize", json={"prompt": "hello"}) as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "model"
        # Anthropic's Messages API requires the field whatever the fleet serves.
        async with s.post(gw.url + "/v1/messages", json=chat()) as r:
            assert r.status == 400
            assert (await r.json())["error"]["type"] == "invalid_request_error"
    assert gw.report.reserved_tokens() == 0


def test_the_model_goes_in_the_clients_bytes_as_sent() -> None:
    served, bases = ["m"], lambda m: frozenset({m})
    raw = b' {"messages": [], "x": 1.10, "s": "\\u00e9"}'
    body = json.loads(raw)
    out = fill_model(body, raw, True, lambda: served, bases)
    assert (
        body["model"] == "m" and out == b' {"model":"m","messages": [], "x": 1.10, "s": "\\u00e9"}'
    )
    assert fill_model({}, b"{ }", True, lambda: served, bases) == b'{"model":"m" }'
    named = {"model": "z"}
    assert fill_model(named, b'{"model":"z"}', True, lambda: served, bases) == b'{"model":"z"}'
    # A form goes as sent; its engine picks the one model it serves.
    form: dict = {}
    assert fill_model(form, b"--b\r\n", False, lambda: served, bases) == b"--b\r\n"
    assert form["model"] == "m"
    # An adapter beside its base is not a second base; two bases are a choice.
    assert default_model(["m", "ad"], lambda m: frozenset({"m"})) == "m"
    with pytest.raises(ApiError) as e:
        default_model(["a", "b"], lambda m: frozenset({m}))
    assert e.value.status == 400 and "a, b" in str(e.value.message)
    with pytest.raises(ApiError):
        default_model([], bases)
