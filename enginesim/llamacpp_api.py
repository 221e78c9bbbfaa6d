"""llama.cpp's llama-server HTTP API over `LlamaCppCore` (the `llamacpp` flavor).

What a client sees of a llama-server, with shapes read from llama.cpp's
`tools/server` (`server-context.cpp`, `server-task.cpp`, `server-common.cpp`):

* `GET /health` (`{"status": "ok"}`), `GET /props` (`default_generation_settings.n_ctx`
  is one slot's context, `total_slots` the slot count), `GET /slots` (one object per
  slot, `is_processing`; `?fail_on_no_slot=1` answers 503 when every slot is busy),
  `GET /metrics` (`llamacpp:` names, see `enginesim.metrics.render_llamacpp`),
  `POST /tokenize` (`{"tokens": [...]}`, `with_pieces`), `POST /detokenize`,
  `POST /apply-template` (`{"prompt": ...}`), `GET /models` and `GET /v1/models`;
* `POST /v1/chat/completions` (also `/chat/completions`) and `POST /v1/completions`,
  stream and non-stream, with llama.cpp's `timings` and
  `usage.prompt_tokens_details.cached_tokens`; ids are `chatcmpl-` and 32 alphanumerics
  for both, and `system_fingerprint` is the build. `max_tokens` 0 still generates one
  token, a negative one sets no limit. llama.cpp's native `/completion` is not served.

A stream whose client goes away is cancelled at once (llama-server notices at its next
write). A non-stream one is not: llama-server's HTTP thread looks at its connection only
when its wait for results times out, after one second without a result for any request
(another stream's tokens, a `/slots` or `/metrics` answer restart the wait), so on a busy
server an abandoned non-stream request generates to its end. Here too, in virtual seconds.

Errors are `{"error": {"code": <HTTP status>, "message": ..., "type": ...}}` with
llama.cpp's type strings; a prompt that does not fit its slot's context is HTTP 400
`exceed_context_size_error` with `n_prompt_tokens` and `n_ctx` added. A stream's first
result decides its status: an error before the slot starts the request is a plain JSON
error response, while an error after that (the unified pool running out) is one
`data: {"error": {...}}` event that ends the stream without `data: [DONE]`. A body that
is not JSON is a 500 `server_error`, as llama-server's parser throws outside its request
validation.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import TYPE_CHECKING, Any, Literal, NoReturn, Protocol

from aiohttp import web
from pydantic import ValidationError

from enginesim import tokenizer
from enginesim.api import ApiError, ChatCompletionRequest, Prepared, render_chat, validation_error
from enginesim.driver import RequestHandle
from enginesim.llamacpp import UNLIMITED, LlamaCppCore, SlotInfo
from enginesim.types import EngineError, EngineEvent, EventKind, SlotTimings

if TYPE_CHECKING:
    from enginesim.driver import EngineDriver
    from enginesim.metrics import EngineMetrics
    from enginesim.profiles import Profile


class ServerView(Protocol):
    """What the llama-server routes use of the `enginesim.server.EngineServer` they
    serve for (named here so that this module needs nothing of the server's)."""

    core: object
    driver: EngineDriver
    metrics: EngineMetrics
    profile: Profile
    model_name: str
    started_at: int

    async def serve_body(
        self, request: web.Request, body: Any, kind: Literal["chat", "completion"]
    ) -> web.StreamResponse: ...

    def drop(self, request: web.Request, prep: Prepared) -> NoReturn: ...


BUILD_INFO = "b0-enginesim"
# llama-server's HTTP thread waits this long for a result before it checks its client.
HTTP_POLLING_SECONDS = 1.0
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4"
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
}
# llama.cpp's defaults for the sampling parameters /props and /slots show.
_DEFAULT_PARAMS: dict[str, Any] = {
    "seed": 4294967295,
    "temperature": 0.8,
    "dynatemp_range": 0.0,
    "dynatemp_exponent": 1.0,
    "top_k": 40,
    "top_p": 0.95,
    "min_p": 0.05,
    "top_n_sigma": -1.0,
    "xtc_probability": 0.0,
    "xtc_threshold": 0.1,
    "typical_p": 1.0,
    "repeat_last_n": 64,
    "repeat_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "dry_multiplier": 0.0,
    "dry_base": 1.75,
    "dry_allowed_length": 2,
    "dry_penalty_last_n": 64,
    "mirostat": 0,
    "mirostat_tau": 5.0,
    "mirostat_eta": 0.1,
    "adaptive_target": -1.0,
    "adaptive_decay": 0.9,
    "max_tokens": UNLIMITED,
    "n_predict": UNLIMITED,
    "n_keep": 0,
    "n_discard": 0,
    "ignore_eos": False,
    "stream": False,
    "n_probs": 0,
    "min_keep": 0,
    "chat_format": "Content-only",
    "reasoning_format": "none",
    "reasoning_in_content": False,
    "generation_prompt": "",
    "samplers": ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p",
                 "xtc", "temperature"],
    "speculative.types": "none",
    "timings_per_token": False,
    "post_sampling_probs": False,
    "backend_sampling": False,
    "lora": [],
}  # fmt: skip
# A Jinja rendering of `tokenizer.apply_chat_template`, for /props.
CHAT_TEMPLATE = (
    "{{ '<|begin|>' }}{% for m in messages %}"
    "{{ '<|' + (m['role'] if m['role'] in ['system', 'assistant'] else 'user') + '|>\\n' "
    "+ m['content'] + '<|end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(
        text=_dumps(obj), status=status, content_type="application/json", charset="utf-8"
    )


def error_object(err: EngineError) -> dict[str, Any]:
    """llama.cpp's error object (`format_error_response`, plus the context fields)."""
    out: dict[str, Any] = {"code": err.status, "message": err.message, "type": err.type}
    if err.n_prompt_tokens is not None:
        out["n_prompt_tokens"] = err.n_prompt_tokens
        out["n_ctx"] = err.n_ctx
    return out


def llamacpp_error_response(status: int, message: str, type: str | None = None) -> web.Response:
    err_type = type or _ERROR_TYPES.get(
        status, "server_error" if status >= 500 else "invalid_request_error"
    )
    return _json({"error": error_object(EngineError(status, err_type, message))}, status)


def not_found_response() -> web.Response:
    """What llama-server's HTTP layer answers an unknown route with (its own key order)."""
    body = {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}
    return _json(body, 404)


def _timings(t: SlotTimings | None) -> dict[str, Any]:
    if t is None:
        return {}
    steps = max(0, t.predicted_n - 1)  # the first token comes with the prompt's logits
    return {
        "cache_n": t.cache_n,
        "prompt_n": t.prompt_n,
        "prompt_ms": t.prompt_ms,
        "prompt_per_token_ms": t.prompt_ms / t.prompt_n if t.prompt_n else 0.0,
        "prompt_per_second": 1e3 / t.prompt_ms * t.prompt_n if t.prompt_ms > 0 else 0.0,
        "predicted_n": t.predicted_n,
        "predicted_ms": t.predicted_ms,
        "predicted_per_token_ms": t.predicted_ms / steps if steps else 0.0,
        "predicted_per_second": 1e3 / t.predicted_ms * steps if t.predicted_ms > 0 else 0.0,
    }


def _usage(final: EngineEvent) -> dict[str, Any]:
    return {
        "completion_tokens": final.completion_tokens,
        "prompt_tokens": final.prompt_tokens,
        "total_tokens": final.completion_tokens + final.prompt_tokens,
        "prompt_tokens_details": {"cached_tokens": final.cached_tokens},
    }


def _aborted() -> EngineError:
    return EngineError(500, "server_error", "the engine stopped before the request finished")


class LlamaCppApi:
    """The llama-server routes of one `EngineServer` (flavor `llamacpp`)."""

    def __init__(self, server: ServerView) -> None:
        self.server = server
        core = server.core
        assert isinstance(core, LlamaCppCore)
        self.core = core
        self._last_result = 0.0  # virtual time of the last result of any request
        self._lingering: set[str] = set()
        self._linger_tasks: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        for task in list(self._linger_tasks):
            task.cancel()
        await asyncio.gather(*self._linger_tasks, return_exceptions=True)

    def lingers(self, request_id: str) -> bool:
        """True while an abandoned non-stream request still runs, as on llama-server."""
        return request_id in self._lingering

    def _result(self) -> None:
        self._last_result = self.server.driver.vnow()

    def _linger(self, request_id: str, handle: RequestHandle, since: float) -> None:
        self._lingering.add(request_id)
        task = asyncio.get_running_loop().create_task(self._abandon(request_id, handle, since))
        self._linger_tasks.add(task)
        task.add_done_callback(self._linger_tasks.discard)

    async def _abandon(self, request_id: str, handle: RequestHandle, since: float) -> None:
        """Cancel an abandoned non-stream request when llama-server would notice.

        `since` is when its HTTP thread began to wait (the request's arrival).
        """
        driver = self.server.driver
        gone = driver.vnow()
        try:
            while not handle.done:
                seen = self._last_result
                last = max(seen, since)
                # The wait restarted at the last result and times out every second; the
                # first timeout after the hang-up sees the client gone.
                fire = last + HTTP_POLLING_SECONDS * max(1, math.ceil(gone - last))
                await asyncio.sleep(max(0.0, (fire - driver.vnow()) / driver.speed))
                if self._last_result == seen:
                    break
        finally:
            self._lingering.discard(request_id)
            driver.abort(request_id)

    def add_routes(self, r: web.UrlDispatcher) -> None:
        r.add_get("/health", self.health)
        r.add_get("/v1/health", self.health)
        r.add_get("/props", self.props)
        r.add_get("/slots", self.slots)
        r.add_get("/metrics", self.metrics)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/detokenize", self.detokenize)
        r.add_post("/apply-template", self.apply_template)
        r.add_get("/models", self.models)
        r.add_get("/v1/models", self.models)
        r.add_post("/chat/completions", self.chat_completions)
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_post("/v1/completions", self.completions)

    # -- plain endpoints -----------------------------------------------------------------

    async def _body(self, request: web.Request) -> Any:

        raw = await request.read()
        try:
            return json.loads(raw) if raw else {}
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(500, f"[json.exception.parse_error] {exc}") from None

    def _object(self, body: Any) -> dict[str, Any]:

        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        return body

    async def health(self, request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    def _params(self, n_predict: int = UNLIMITED, ignore_eos: bool = False) -> dict[str, Any]:
        return {**_DEFAULT_PARAMS, "max_tokens": n_predict, "n_predict": n_predict,
                "ignore_eos": ignore_eos}  # fmt: skip

    def _ftype(self) -> str:
        b = self.server.profile.model.weight_bytes_per_param
        return "all F32" if b >= 4 else "MOSTLY_F16" if b >= 2 else "MOSTLY_Q4_K_M"

    async def props(self, request: web.Request) -> web.Response:
        name = self.server.model_name
        return _json(
            {
                "default_generation_settings": {
                    "params": self._params(),
                    "n_ctx": self.core.slot_n_ctx,
                },
                "total_slots": self.core.n_slots,
                "model_alias": name,
                "model_ftype": self._ftype(),
                "model_path": f"/models/{name}.gguf",
                "modalities": {"vision": False, "video": False, "audio": False},
                "media_marker": "<__media__>",
                "endpoint_slots": True,
                "endpoint_props": False,
                "endpoint_metrics": True,
                "ui": False,
                "ui_settings": {},
                "chat_template": CHAT_TEMPLATE,
                "chat_template_caps": {
                    "supports_string_content": True,
                    "supports_system_role": True,
                    "supports_tool_calls": False,
                    "supports_tools": False,
                },
                "bos_token": "<|begin|>",
                "eos_token": "<|end|>",
                "build_info": BUILD_INFO,
                "is_sleeping": False,
                "cors_proxy_enabled": False,
            }
        )

    def _slot_json(self, s: SlotInfo) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": s.id,
            "n_ctx": s.n_ctx,
            "speculative": False,
            "is_processing": s.is_processing,
        }
        if s.id_task is not None:
            out["id_task"] = s.id_task
            out["n_prompt_tokens"] = s.n_prompt_tokens
            out["n_prompt_tokens_processed"] = s.n_prompt_tokens_processed
            out["n_prompt_tokens_cache"] = s.n_prompt_tokens_cache
            out["params"] = self._params(s.n_predict, s.ignore_eos)
            out["next_token"] = [
                {
                    "has_next_token": s.has_next_token,
                    "has_new_line": False,
                    "n_remain": s.n_remain,
                    "n_decoded": s.n_decoded,
                }
            ]
        return out

    async def slots(self, request: web.Request) -> web.Response:
        self._result()  # a task through llama-server's queue, with a result
        info = self.core.slot_info()
        if request.query.get("fail_on_no_slot") and all(s.is_processing for s in info):
            return llamacpp_error_response(503, "no slot available")
        return _json([self._slot_json(s) for s in info])

    async def metrics(self, request: web.Request) -> web.Response:
        self._result()
        return web.Response(
            body=self.server.metrics.render(),
            headers={
                "Content-Type": METRICS_CONTENT_TYPE,
                "Process-Start-Time-Unix": str(self.server.started_at),
            },
        )

    async def tokenize(self, request: web.Request) -> web.Response:

        body = self._object(await self._body(request))
        if "content" not in body:
            return _json({"tokens": []})
        content = body["content"]
        pieces: list[tuple[int, str]] = []
        parts = content if isinstance(content, list) else [content]
        for part in parts:  # llama.cpp's tokenize_mixed: strings and token ids
            if isinstance(part, str):
                pieces.extend(tokenizer.encode_pieces(part))
            elif isinstance(part, int) and not isinstance(part, bool):
                pieces.append((part, tokenizer.decode([part])))
            else:
                raise ApiError(400, "content must be a string or a list of strings and ids")
        if body.get("add_special", False):
            pieces.insert(0, (tokenizer.BOS_ID, "<|begin|>"))
        if body.get("with_pieces", False):
            return _json({"tokens": [{"id": i, "piece": p} for i, p in pieces]})
        return _json({"tokens": [i for i, _ in pieces]})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = self._object(await self._body(request))
        ids = [t for t in body.get("tokens", []) if isinstance(t, int)]
        return _json({"content": tokenizer.decode(ids)})

    async def apply_template(self, request: web.Request) -> web.Response:

        body = self._object(await self._body(request))
        try:
            req = ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            err = validation_error(exc)
            raise ApiError(400, err.message) from None
        return _json({"prompt": render_chat(req.messages, body.get("tools"))})

    async def models(self, request: web.Request) -> web.Response:
        p = self.server.profile
        name = self.server.model_name
        info = {
            "id": name,
            "aliases": [name],
            "tags": [],
            "object": "model",
            "created": int(time.time()),
            "owned_by": "llamacpp",
            "meta": {
                "vocab_type": 2,
                "n_vocab": tokenizer.VOCAB_SIZE,
                "n_ctx": self.core.slot_n_ctx,
                "n_ctx_train": p.max_model_len,
                "n_embd": p.model.hidden_size,
                "n_params": int(p.model.params_b * 1e9),
                "size": int(p.model.weight_bytes),
                "ftype": self._ftype(),
            },
        }
        listing = {
            "name": name,
            "model": name,
            "modified_at": "",
            "size": "",
            "digest": "",
            "type": "model",
            "description": "",
            "tags": [""],
            "capabilities": ["completion"],
            "parameters": "",
            "details": {"parent_model": "", "format": "gguf", "family": "", "families": [""],
                        "parameter_size": "", "quantization_level": ""},
        }  # fmt: skip
        return _json({"models": [listing], "object": "list", "data": [info]})

    # -- completions ---------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.server.serve_body(request, await self._body(request), "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.server.serve_body(request, await self._body(request), "completion")

    def _head(self, prep: Prepared) -> dict[str, Any]:
        return {
            "created": int(time.time()),
            "id": prep.public_id,
            "model": prep.model,
            "system_fingerprint": BUILD_INFO,
        }

    async def complete(
        self, request: web.Request, prep: Prepared, handle: RequestHandle
    ) -> web.StreamResponse:
        token_ids: list[int] = []
        final: EngineEvent | None = None
        since = self.server.driver.vnow()
        try:
            while final is None:
                for ev in await handle.next_batch():
                    token_ids.extend(ev.token_ids)
                    if ev.kind in (EventKind.FINISHED, EventKind.FAILED, EventKind.ABORTED):
                        final = ev
                if (
                    prep.drop_after is not None
                    and len(token_ids) >= prep.drop_after
                    and final is None
                ):
                    self.server.drop(request, prep)
        except asyncio.CancelledError:
            if not handle.done:  # the client went away; the engine has not noticed yet
                self._linger(prep.public_id, handle, since)
            raise
        self._result()
        if final.kind is not EventKind.FINISHED:
            err = final.error or _aborted()
            return _json({"error": error_object(err)}, err.status)
        text = tokenizer.decode(token_ids)
        head = self._head(prep)
        reason = final.finish_reason
        if prep.kind == "chat":
            body: dict[str, Any] = {
                "choices": [
                    {
                        "finish_reason": reason,
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                    }
                ],
                "created": head["created"],
                "model": prep.model,
                "system_fingerprint": BUILD_INFO,
                "object": "chat.completion",
            }
        else:
            body = {
                "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": reason}],
                "created": head["created"],
                "model": prep.model,
                "system_fingerprint": BUILD_INFO,
                "object": "text_completion",
            }
        body["usage"] = _usage(final)
        body["id"] = prep.public_id
        body["timings"] = _timings(final.timings)
        return _json(body)

    async def stream(
        self, request: web.Request, prep: Prepared, handle: RequestHandle
    ) -> web.StreamResponse:
        # The first result decides the status: until a slot starts the request, an error
        # is an ordinary JSON error response.
        pending: list[EngineEvent] = []
        while True:
            batch = await handle.next_batch()
            started = next((i for i, ev in enumerate(batch) if ev.kind is EventKind.STARTED), None)
            if started is not None:
                pending = batch[started + 1 :]
                break
            end = next((ev for ev in batch if ev.kind is not EventKind.TOKENS), None)
            if end is not None:
                err = end.error or _aborted()
                return _json({"error": error_object(err)}, err.status)
        resp = web.StreamResponse(status=200, headers=_SSE_HEADERS)
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        self._result()  # the start is a result too (llama-server's "begin" partial)
        chat = prep.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"

        async def send(payload: dict[str, Any]) -> None:
            self._result()
            await resp.write(b"data: " + _dumps(payload).encode() + b"\n\n")

        def chat_chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
            h = self._head(prep)
            return {"choices": choices, "created": h["created"], "id": prep.public_id,
                    "model": prep.model, "system_fingerprint": BUILD_INFO, "object": obj}  # fmt: skip

        def delta(d: dict[str, Any], finish: str | None = None) -> list[dict[str, Any]]:
            return [{"finish_reason": finish, "index": 0, "delta": d}]

        if prep.drop_after == 0:
            self.server.drop(request, prep)
        sent = 0
        while True:
            for ev in pending:
                if ev.kind is EventKind.TOKENS:
                    text = tokenizer.decode(ev.token_ids)
                    first = sent == 0
                    sent += len(ev.token_ids)
                    if chat:
                        if first:  # llama.cpp opens with the role, as OpenAI does
                            await send(chat_chunk(delta({"role": "assistant", "content": None})))
                        if text:
                            await send(chat_chunk(delta({"content": text})))
                    else:
                        await send(
                            {
                                "choices": [{"text": text, "index": 0, "logprobs": None,
                                             "finish_reason": None}],
                                "created": int(time.time()),
                                "model": prep.model,
                                "system_fingerprint": BUILD_INFO,
                                "object": obj,
                                "id": prep.public_id,
                            }
                        )  # fmt: skip
                    if prep.drop_after is not None and sent >= prep.drop_after:
                        self.server.drop(request, prep)
                elif ev.kind is EventKind.FINISHED:
                    await self._stream_final(send, chat_chunk, delta, prep, ev)
                    await resp.write(b"data: [DONE]\n\n")
                    await resp.write_eof()
                    return resp
                elif ev.kind in (EventKind.FAILED, EventKind.ABORTED):
                    # Mid-stream, llama-server sends the error as one event and ends the
                    # stream there: no [DONE].
                    await send({"error": error_object(ev.error or _aborted())})
                    await resp.write_eof()
                    return resp
            pending = await handle.next_batch()

    async def _stream_final(
        self, send: Any, chat_chunk: Any, delta: Any, prep: Prepared, final: EngineEvent
    ) -> None:
        reason = final.finish_reason
        timings = _timings(final.timings)
        if prep.kind == "chat":
            out = [chat_chunk(delta({}, reason))]
            if prep.include_usage:
                out.append({**chat_chunk([]), "usage": _usage(final)})
            out[-1]["timings"] = timings
            for payload in out:
                await send(payload)
            return
        await send(
            {
                "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": reason}],
                "created": int(time.time()),
                "model": prep.model,
                "system_fingerprint": BUILD_INFO,
                "object": "text_completion",
                "usage": _usage(final),
                "id": prep.public_id,
                "timings": timings,
            }
        )
