"""Embeddings through kvgate on a second real vLLM started as a pooling model (the tiny
model with `--runner pooling --convert embed`), beside the generative one: each request
goes to the replica serving its model, the embeddings are the engine's own, and nothing
stays reserved."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import openai
import pytest

from gateway.app import Gateway
from gateway.config import config_from_mapping
from tests.realengine import boot
from tests.realengine.test_through_kvgate import until
from tests.realengine.vllm import MODEL_NAME, VllmServer

EMBED_MODEL = "tiny-embed"


def _embed(folder: Path) -> VllmServer:
    extra = ["--served-model-name", EMBED_MODEL, "--runner", "pooling", "--convert", "embed"]
    return VllmServer("embed", extra, folder / "vllm.log")


boot.declare("embed_vllm", _embed)


@pytest.fixture(scope="module")
def embed_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    server = boot.take("embed_vllm", tmp_path_factory.mktemp("embed"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def both(vllm: VllmServer, embed_vllm: VllmServer) -> AsyncIterator[Gateway]:
    data = {
        "replicas": [
            {"name": "gen", "url": vllm.url, "engine": "vllm"},
            {"name": "embed", "url": embed_vllm.url, "engine": "vllm"},
        ],
        "discovery": {"refresh_interval_s": 1.0, "probe_timeout_s": 2.0},
        "logging": {"access_log": False},
    }
    gw = Gateway(config_from_mapping(data, env={}), host="127.0.0.1", port=0)
    await gw.start()
    try:
        assert await until(lambda: all(u.ready for u in gw.report.replica_usage()), 30.0)
        yield gw
        assert await gw.drain(15.0)
        assert gw.report.reserved_tokens() == 0
    finally:
        await gw.stop()


async def test_embeddings_through_kvgate_on_a_pooling_vllm(
    both: Gateway, embed_vllm: VllmServer
) -> None:
    gw = both
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x") as c:
        through = await c.embeddings.create(model=EMBED_MODEL, input=["hello there", "second"])
        assert len(through.data) == 2 and len(through.data[0].embedding) > 0
        assert through.usage.prompt_tokens > 0
        # The engine's own vectors: the same input straight at the engine gives the same.
        async with openai.AsyncOpenAI(base_url=embed_vllm.url + "/v1", api_key="x") as d:
            direct = await d.embeddings.create(model=EMBED_MODEL, input=["hello there"])
        assert through.data[0].embedding == pytest.approx(direct.data[0].embedding, abs=1e-5)
        # A chat request goes to the generative replica, never the pooling one.
        chat = await c.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert chat.usage is not None and chat.usage.completion_tokens >= 1
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
        text = await r.text()
    assert 'kvgate_endpoint_requests_total{endpoint="embeddings",outcome="ok"} 1.0' in text
    assert 'kvgate_endpoint_requests_total{endpoint="chat",outcome="ok"} 1.0' in text
