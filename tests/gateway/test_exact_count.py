"""Count, do not guess, before saying no (invariant 4), over real loopback HTTP.

A fresh kvgate estimates prompts at a conservative 3 characters a token. The prompts
here are six-letter words, which enginesim's tokenizer counts one token each (7
characters a token with the space): the estimate is more than twice the real count.
Near a limit kvgate asks the replica's own ``/tokenize`` once and admits or refuses on
the exact count; when no exact count can be had, it forwards the request and the
engine's own answer decides.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from enginesim import tokenizer
from enginesim.server import EngineServer, error_response
from tests.gateway.conftest import MODEL

MAX_MODEL_LEN = 2048  # the tiny profile
FITS = " ".join(["abcdef"] * 1400)  # ~1,400 tokens; 9,799 chars: estimated at 3,267
TOO_LONG = " ".join(["abcdef"] * 2100)  # ~2,100 tokens: over the context


class CountingReplica(EngineServer):
    """An enginesim replica that counts the calls it receives and whose ``/tokenize`` can
    be made to fail (``tokenize_status``) or hang (``tokenize_hangs``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.tokenize_status: int | None = kwargs.pop("tokenize_status", None)
        self.tokenize_hangs: bool = kwargs.pop("tokenize_hangs", False)
        self.hits: Counter[str] = Counter()
        self.tokenize_bodies: list[dict[str, Any]] = []
        super().__init__(*args, **kwargs)

    async def _tokenize(self, request: web.Request) -> web.Response:
        self.hits["tokenize"] += 1
        self.tokenize_bodies.append(await request.json())
        if self.tokenize_hangs:
            await asyncio.Event().wait()
        if self.tokenize_status is not None:
            return error_response(self.tokenize_status, "injected: tokenize failed")
        return await super()._tokenize(request)

    async def _serve(self, request: web.Request, kind: Any) -> web.StreamResponse:
        self.hits[kind] += 1
        return await super()._serve(request, kind)


@pytest.fixture
async def counting_replica() -> AsyncIterator[Callable[..., Awaitable[CountingReplica]]]:
    made: list[CountingReplica] = []

    async def factory(**kwargs: Any) -> CountingReplica:
        kwargs.setdefault("speed", 50.0)
        srv = CountingReplica("tiny", **kwargs)
        await srv.start()
        made.append(srv)
        return srv

    yield factory
    for srv in reversed(made):
        await srv.stop()


def chat_body(content: str, max_tokens: int = 8) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
    }


async def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, await r.json()


async def samples(gw: Any, family: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples of one metric family: (sample name, sorted labels) -> value."""
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
        text = await r.text()
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == family:
            for smp in fam.samples:
                out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out


async def engine_count(srv: EngineServer, body: dict[str, Any]) -> int:
    status, data = await post(srv.url + "/tokenize", body)
    assert status == 200
    return data["count"]


async def test_long_words_that_fit_are_counted_exactly_and_served(counting_replica, gateway):
    srv = await counting_replica()
    gw = await gateway(srv)
    body = chat_body(FITS)
    exact = await engine_count(srv, {"model": MODEL, "messages": body["messages"]})
    assert exact + 8 < MAX_MODEL_LEN < len(FITS) / 3.0  # fits; the estimate says it does not
    srv.hits.clear()

    status, data = await post(gw.url + "/v1/chat/completions", body)
    assert status == 200, data
    assert data["usage"]["prompt_tokens"] == exact
    assert srv.hits == Counter(tokenize=1, chat=1)  # one extra call, near the limit only
    # The same prompt again (a retry): counted from the cache, not asked again.
    status, _ = await post(gw.url + "/v1/chat/completions", body)
    assert status == 200 and srv.hits == Counter(tokenize=1, chat=2)
    counts = await samples(gw, "kvgate_prompt_counts")
    assert counts[("kvgate_prompt_counts_total", (("how", "replica"),))] == 1
    assert counts[("kvgate_prompt_counts_total", (("how", "cache"),))] == 1
    # The reservation was the exact count: estimated / actual is exactly 1.
    ratio = await samples(gw, "kvgate_prompt_estimate_ratio")
    assert ratio[("kvgate_prompt_estimate_ratio_count", (("exact", "true"),))] == 2
    assert ratio[("kvgate_prompt_estimate_ratio_sum", (("exact", "true"),))] == 2.0
    # A short prompt far from every limit costs no call at all.
    status, _ = await post(gw.url + "/v1/chat/completions", chat_body("hello there"))
    assert status == 200 and srv.hits["tokenize"] == 1


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_a_prompt_truly_over_the_context_is_refused_without_reaching_the_engine(
    counting_replica, gateway, kind
):
    srv = await counting_replica()
    gw = await gateway(srv)
    if kind == "chat":
        path, body = "/v1/chat/completions", chat_body(TOO_LONG)
        exact = await engine_count(srv, {"model": MODEL, "messages": body["messages"]})
    else:
        path, body = "/v1/completions", {"model": MODEL, "prompt": TOO_LONG, "max_tokens": 8}
        exact = await engine_count(srv, {"model": MODEL, "prompt": TOO_LONG})
    assert exact + 8 > MAX_MODEL_LEN
    srv.hits.clear()

    status, data = await post(gw.url + path, body)
    assert status == 400
    err = data["error"]
    assert err["code"] == "context_length_exceeded" and err["type"] == "invalid_request_error"
    assert f"{exact} in the messages" in err["message"]  # kvgate quotes the exact count
    assert srv.hits == Counter(tokenize=1)  # never sent to the completion endpoint
    assert gw.report.queue_depth() == 0


@pytest.mark.parametrize("failure", ["tokenize_500", "tokenize_timeout", "openai_engine"])
async def test_without_an_exact_count_the_engine_decides(counting_replica, gateway, failure):
    if failure == "tokenize_500":
        srv = await counting_replica(tokenize_status=500)
        gw = await gateway(srv)
    elif failure == "tokenize_timeout":
        srv = await counting_replica(tokenize_hangs=True)
        gw = await gateway(srv, upstream={"tokenize_timeout_s": 0.2})
    else:  # a generic OpenAI-compatible server: no tokenize endpoint is known
        srv = await counting_replica()
        gw = await gateway(srv, engine="openai", pool_tokens=4096)

    status, data = await post(gw.url + "/v1/chat/completions", chat_body(TOO_LONG))
    # Forwarded (its reservation clamped to what fits), and the engine's own 400 relayed.
    assert status == 400
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"}
    # The engine's answer (it was sent there), in OpenAI's shape: its message, and the
    # code a client acts on instead of the engine's numeric one.
    assert srv.hits["chat"] == 1
    assert err["code"] == "context_length_exceeded"
    assert "maximum context length" in err["message"]
    assert srv.hits["tokenize"] == (0 if failure == "openai_engine" else 1)
    counts = await samples(gw, "kvgate_prompt_counts")
    how = "unavailable" if failure == "openai_engine" else "failed"
    assert counts[("kvgate_prompt_counts_total", (("how", how),))] == 1
    # A long-word prompt that fits is served on its estimate, clamped, never refused.
    status, data = await post(gw.url + "/v1/chat/completions", chat_body(FITS))
    assert status == 200, data


async def test_an_image_part_does_not_teach_the_learned_ratio(
    counting_replica, gateway, monkeypatch
):
    srv = await counting_replica()
    monkeypatch.setattr("admission.learned.estimate.MIN_PROMPT_SAMPLES", 1)
    gw = await gateway(srv)
    est = gw.state.estimator
    image = {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "describe this picture in a few words please"},
                    {
                        "type": "image_url",
                        "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="},
                    },
                ],
            }
        ],
    }
    status, data = await post(gw.url + "/v1/chat/completions", image)
    assert status == 200, data
    assert est.chars_per_token(MODEL) == 3.0  # not learned from a prompt with an image
    status, _ = await post(
        gw.url + "/v1/chat/completions", chat_body("tell me about the sea " * 20)
    )
    assert status == 200
    assert est.chars_per_token(MODEL) != 3.0  # a text prompt does teach it
    # Both estimates were exported (neither was an exact count).
    ratio = await samples(gw, "kvgate_prompt_estimate_ratio")
    assert ratio[("kvgate_prompt_estimate_ratio_count", (("exact", "false"),))] == 2
    assert srv.hits["tokenize"] == 0


async def test_sglang_counts_the_text_and_the_template_overhead_decides_only_when_it_cannot_matter(
    counting_replica, gateway
):
    """SGLang's /tokenize takes a plain prompt (no chat template): kvgate counts the text
    exactly and adds the configured per-message overhead. It refuses only when the text
    alone is over the context, and leaves to the engine the band where the overhead guess
    would decide."""
    srv = await counting_replica(flavor="sglang")
    gw = await gateway(srv, engine="sglang")
    url = gw.url + "/v1/chat/completions"

    status, data = await post(url, chat_body(TOO_LONG))  # 2,100 text tokens alone: over
    assert status == 400 and data["error"]["code"] == "context_length_exceeded"
    assert srv.hits == Counter(tokenize=1)
    assert "messages" not in srv.tokenize_bodies[0] and "prompt" in srv.tokenize_bodies[0]

    status, data = await post(url, chat_body(FITS))  # 1,400 text tokens: fits either way
    assert status == 200, data
    # 1,400 text tokens fit with 644 to generate (2,044), but not once the overhead guess
    # of 8 is added (2,052): not kvgate's call. The engine counts 1,407 and refuses.
    other = FITS.replace("abcdef", "abcdeg")  # as many tokens, never served
    status, data = await post(url, chat_body(other, max_tokens=644))
    assert status == 400 and data["error"]["code"] == "context_length_exceeded"
    assert "input tokens" in data["error"]["message"]  # the engine's words, not kvgate's
    assert srv.hits == Counter(tokenize=3, chat=2)
    status, _ = await post(url, chat_body(other))
    assert status == 200 and srv.hits == Counter(tokenize=3, chat=3)  # its text count cached
    # The engine's usage of a served prompt is its exact count (1,407): kvgate refuses on
    # it, without a call.
    status, data = await post(url, chat_body(FITS, max_tokens=644))
    assert status == 400 and "1407 in the messages" in data["error"]["message"]
    assert srv.hits == Counter(tokenize=3, chat=3)


class LlamaCppStub:
    """A llama.cpp server as kvgate sees it: /props, /v1/models, /apply-template, /tokenize
    and a chat endpoint that checks the context (enginesim's tokenizer and template)."""

    def __init__(self) -> None:
        self.hits: Counter[str] = Counter()
        self.runner: web.AppRunner | None = None
        self.url = ""

    def _count(self, prompt: str) -> int:
        return 1 + len(tokenizer.encode(prompt))  # BOS, as add_special does

    async def start(self) -> None:
        async def props(request: web.Request) -> web.Response:
            settings = {"n_ctx": MAX_MODEL_LEN}
            return web.json_response({"total_slots": 2, "default_generation_settings": settings})

        async def models(request: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": MODEL}]})

        async def apply_template(request: web.Request) -> web.Response:
            self.hits["apply-template"] += 1
            body = await request.json()
            return web.json_response({"prompt": tokenizer.apply_chat_template(body["messages"])})

        async def tokenize(request: web.Request) -> web.Response:
            self.hits["tokenize"] += 1
            body = await request.json()
            assert body["add_special"] is True
            return web.json_response({"tokens": list(range(self._count(body["content"])))})

        async def chat(request: web.Request) -> web.Response:
            self.hits["chat"] += 1
            body = await request.json()
            n = self._count(tokenizer.apply_chat_template(body["messages"]))
            if n + body["max_tokens"] > MAX_MODEL_LEN:
                return error_response(400, "the request exceeds the available context size")
            usage = {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1}
            choice = {"index": 0, "message": {"role": "assistant", "content": "ok"}}
            return web.json_response({"choices": [choice], "usage": usage})

        app = web.Application(client_max_size=1 << 24)
        app.router.add_get("/props", props)
        app.router.add_get("/v1/models", models)
        app.router.add_post("/apply-template", apply_template)
        app.router.add_post("/tokenize", tokenize)
        app.router.add_post("/v1/chat/completions", chat)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"


@pytest.fixture
async def llamacpp() -> AsyncIterator[LlamaCppStub]:
    stub = LlamaCppStub()
    await stub.start()
    yield stub
    assert stub.runner is not None
    await stub.runner.cleanup()


async def test_llamacpp_chat_is_templated_then_tokenized(llamacpp, gateway):
    gw = await gateway(replicas=[{"name": "l0", "url": llamacpp.url, "engine": "llamacpp"}])
    url = gw.url + "/v1/chat/completions"
    status, data = await post(url, chat_body(TOO_LONG))
    assert status == 400 and data["error"]["code"] == "context_length_exceeded"
    assert llamacpp.hits == Counter({"apply-template": 1, "tokenize": 1})
    status, data = await post(url, chat_body(FITS))
    assert status == 200, data
    assert llamacpp.hits == Counter({"apply-template": 2, "tokenize": 2, "chat": 1})
