"""The live simulated replica: the OpenAI API as vLLM serves it, over the sans-IO core.

`EngineServer` embeds in any running event loop (tests, the demo and benches run several
in one process) and is also what `enginesim serve` runs. It speaks what kvgate and its
clients see of a real engine:

* `POST /v1/chat/completions`, `POST /v1/completions` (stream and non-stream, vLLM's
  chunk shapes, `stream_options.include_usage`, vLLM's extensions `ignore_eos`,
  `min_tokens`, `priority`; unknown sampling fields are accepted and ignored);
* `POST /v1/responses` (stored responses: `GET /v1/responses/{id}`,
  `previous_response_id`), `POST /v1/messages` (Anthropic, and `/count_tokens`),
  `POST /v1/embeddings` (prefill-only), on the same core: `enginesim.agent_api`;
* `GET /v1/models`, `GET /health`, `POST /tokenize`, `GET /version`;
* `POST /rerank`, `/score`, `/classify`, `/pooling` (prefill-only), `POST
  /v1/audio/transcriptions` and `/translations`, `POST /detokenize`: `enginesim.serving_api`;
* LoRA adapters as models (vLLM flavor, `lora_modules`; `--lora-modules` on the CLI):
  listed in `/v1/models` with `parent` naming the base, served by name, in the base's
  KV pool (`enginesim.lora`);
* `GET /metrics` under vLLM's (or, with the sglang flavor, SGLang's) metric names, plus
  `GET /server_info` for the sglang flavor;
* `GET|POST /admin/faults` for fault injection (see `enginesim.faults`).

With the llamacpp flavor the server is llama.cpp's llama-server instead, over
`enginesim.llamacpp.LlamaCppCore`: its routes, response shapes, error bodies and metrics
are in `enginesim.llamacpp_api`.

Errors are OpenAI error objects as vLLM sends them: `type` is the exception class name
(`BadRequestError`, `NotFoundError`, ...) and `code` the HTTP status. Bad input is always
a 4xx, never a 500. (llama.cpp's are `{"error": {"code", "message", "type"}}` with its
own type strings.)

A client that goes away aborts its request in the core at once (its KV blocks are freed
before the handler returns): stream writes that fail, and aiohttp's handler cancellation
on a lost connection, both end in the same `finally` that aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import string
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Literal, NoReturn

from aiohttp import web
from pydantic import ValidationError

from enginesim import tokenizer
from enginesim.agent_api import AgentApi
from enginesim.api import (
    MAX_BODY_BYTES,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    Prepared,
    SamplingRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    bound_max_tokens,
    error_response,
    read_json,
    render_chat,
    validation_error,
)
from enginesim.core import EngineCore
from enginesim.driver import EngineDriver, RequestHandle
from enginesim.faults import NO_FAULT, FaultConfig, FaultConfigError, FaultMode
from enginesim.llamacpp import UNLIMITED, LlamaCppCore
from enginesim.lora import LoraModule, lora_card, lora_table
from enginesim.metrics import CONTENT_TYPE, EngineMetrics
from enginesim.profiles import Profile, load_profile
from enginesim.serving_api import ServingApi
from enginesim.types import EngineEvent, EventKind, Flavor, SimRequest, Workload
from enginesim.workload import classify_workload

log = logging.getLogger(__name__)

ENGINESIM_VERSION = "0.1.0"
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_ALNUM = string.ascii_letters + string.digits
_RNG = random.SystemRandom()


# --------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------


class EngineServer:
    """One simulated replica on 127.0.0.1 (or `host`), embeddable in a running loop.

    Port 0 picks a free port; `.port` and `.url` are known after `start()`. With
    `exit_on_crash` (the CLI) the `crash` fault ends the process; embedded, it aborts
    every connection and stops listening instead.
    """

    def __init__(
        self,
        profile: Profile | str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        speed: float = 1.0,
        flavor: Flavor | str | None = None,
        seed: int = 0,
        speculative: bool | None = None,
        fault: FaultConfig | None = None,
        exit_on_crash: bool = False,
        kv_unified: bool | None = None,
        kv_cache_metrics: bool = False,
        cache_ram_mib: int | None = None,
        lora_modules: Iterable[LoraModule | str] = (),
    ) -> None:
        self.profile = load_profile(profile) if isinstance(profile, str) else profile
        self.host = host
        self._requested_port = port
        self.flavor = Flavor(flavor) if flavor is not None else self.profile.flavor
        self.core: EngineCore | LlamaCppCore
        on_scrape = None
        if self.flavor is Flavor.LLAMACPP:
            if speculative:
                raise ValueError("the llamacpp flavor does not model speculative decoding")
            self.core = LlamaCppCore(
                self.profile, seed=seed, kv_unified=kv_unified, cache_ram_mib=cache_ram_mib
            )
            on_scrape = self.core.reset_metrics_bucket
        else:
            if kv_unified is not None or cache_ram_mib is not None:
                raise ValueError("kv_unified and cache_ram_mib apply to the llamacpp flavor only")
            self.core = EngineCore(
                self.profile, flavor=self.flavor, seed=seed, speculative=speculative
            )
        self.model_name = self.profile.served_model_name
        # LoRA adapters by name (vLLM's --lora-modules): models of their own that run on
        # the base in its KV pool.
        self.loras = lora_table(lora_modules, self.model_name)
        if self.loras and self.flavor is not Flavor.VLLM:
            raise ValueError("lora_modules: the simulator serves LoRA adapters as vLLM does")
        self.speculative = self._speculation_enabled()
        self.metrics = EngineMetrics(
            flavor=self.flavor,
            model_name=self.model_name,
            stats=self.core.stats,
            speculative=self.speculative,
            max_running_requests=self.profile.max_num_seqs,
            on_scrape=on_scrape,
            kv_cache_metrics=kv_cache_metrics,
        )
        self.driver = EngineDriver(
            self.core, speed=speed, metrics=self.metrics, on_tokens=self._on_tokens
        )
        self.exit_on_crash = exit_on_crash
        self._fault = NO_FAULT
        self._crash_countdown: int | None = None
        self._crashed = False
        self._crash_task: asyncio.Task[None] | None = None
        self._closing = False
        self._not_hung = asyncio.Event()
        self._not_hung.set()
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._port: int | None = None
        self.started_at = int(time.time())
        self.app = self._make_app()
        if fault is not None:
            self.set_fault(fault)

    def _speculation_enabled(self) -> bool:
        spec = getattr(self.core, "speculative", None)
        if spec is None:
            spec = self.profile.speculative
        return bool(spec)

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("server not started")
        return self._port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        self.driver.start()
        self._runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, self.host, self._requested_port)
        await self._site.start()
        server = self._site._server  # the asyncio Server: the only way to learn port 0
        assert server is not None and server.sockets  # noqa: S101
        self._port = server.sockets[0].getsockname()[1]
        if self._fault.mode is FaultMode.CRASH and not self._crash_countdown:
            self._trigger_crash()

    async def stop(self) -> None:
        self._closing = True
        if self.flavor is Flavor.LLAMACPP:
            await self.llamacpp.close()
        await self.driver.stop()
        self._not_hung.set()  # release hung handlers so shutdown does not wait for them
        if self._crash_task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._crash_task
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
            self._site = None

    async def __aenter__(self) -> EngineServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- faults ------------------------------------------------------------------------

    @property
    def fault(self) -> FaultConfig:
        return self._fault

    @property
    def crashed(self) -> bool:
        return self._crashed

    def set_fault(self, fault: FaultConfig) -> None:
        """Make `fault` the active fault, replacing the previous one."""
        if self._crashed:
            raise FaultConfigError("the server has crashed; a crash cannot be cleared", "mode")
        self._fault = fault
        self.driver.slow_factor = fault.factor if fault.mode is FaultMode.SLOW else 1.0
        if fault.mode is FaultMode.HANG:
            self._not_hung.clear()
            self.driver.pause()
        else:
            self._not_hung.set()
            self.driver.resume()
        self._crash_countdown = None
        if fault.mode is FaultMode.CRASH:
            if fault.after_tokens > 0:
                self._crash_countdown = fault.after_tokens
            elif self._runner is not None:
                self._trigger_crash()

    def _on_tokens(self, n: int) -> None:
        if self._crash_countdown is None:
            return
        self._crash_countdown -= n
        if self._crash_countdown <= 0:
            self._crash_countdown = None
            self._trigger_crash()

    def _trigger_crash(self, spare: asyncio.BaseTransport | None = None) -> None:
        if self._crashed:
            return
        self._crashed = True
        self._crash_task = asyncio.get_running_loop().create_task(self._crash(spare))

    async def _crash(self, spare: asyncio.BaseTransport | None) -> None:
        log.warning("enginesim: injected crash")
        if self.exit_on_crash:
            sys.stderr.write("enginesim: injected crash, exiting\n")
            sys.stderr.flush()
            os._exit(1)
        # What a dead process looks like from outside: nothing listens, every connection
        # drops at once, and the engine's state is gone.
        self.driver.pause()
        if self._site is not None:
            await self._site.stop()
        if self._runner is not None and self._runner.server is not None:
            for conn in self._runner.server.connections:
                transport = conn.transport
                if transport is not None and transport is not spare:
                    transport.abort()
        await self.driver.stop()

    # -- app ---------------------------------------------------------------------------

    def _make_app(self) -> web.Application:
        app = web.Application(
            middlewares=[self._error_middleware, self._fault_middleware],
            client_max_size=MAX_BODY_BYTES,
        )
        r = app.router
        if self.flavor is Flavor.LLAMACPP:
            from enginesim.llamacpp_api import LlamaCppApi

            self.llamacpp = LlamaCppApi(self)
            self.llamacpp.add_routes(r)
            r.add_get("/admin/faults", self._get_faults)
            r.add_post("/admin/faults", self._post_faults)
            return app
        r.add_post("/v1/chat/completions", self._chat_completions)
        r.add_post("/v1/completions", self._completions)
        r.add_get("/v1/models", self._models)
        r.add_get("/health", self._health)
        r.add_post("/tokenize", self._tokenize)
        r.add_get("/version", self._version)
        r.add_get("/metrics", self._metrics)
        self.agent_api = AgentApi(self)  # /v1/responses, /v1/messages, /v1/embeddings
        self.agent_api.add_routes(r)
        self.serving_api = ServingApi(self)  # pooling, audio, /detokenize
        self.serving_api.add_routes(r)
        if self.flavor is Flavor.VLLM:  # VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
            r.add_post("/v1/load_lora_adapter", self._load_lora)
            r.add_post("/v1/unload_lora_adapter", self._unload_lora)
        if self.flavor is Flavor.SGLANG:
            r.add_get("/server_info", self._server_info)
            r.add_get("/get_server_info", self._server_info)
        r.add_get("/admin/faults", self._get_faults)
        r.add_post("/admin/faults", self._post_faults)
        return app

    @web.middleware
    async def _error_middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Every error leaves as an OpenAI error object, whatever raised it."""
        try:
            return await handler(request)
        except ApiError as exc:
            return self._error(exc.status, exc.message, exc.param, exc.type)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            if self.flavor is Flavor.LLAMACPP and exc.status in (404, 405):
                from enginesim.llamacpp_api import not_found_response

                return not_found_response()
            return self._error(exc.status, exc.reason or "error")
        except asyncio.CancelledError:
            raise
        except ConnectionError as exc:
            # The client went away mid-response ("Cannot write to closing transport"): an
            # abort, as a real engine treats it. The handler's `finally` has already ended
            # the core request; end this one quietly, as the `drop` fault does, instead of
            # letting aiohttp log a traceback for a normal event.
            log.debug("enginesim: client gone on %s %s: %s", request.method, request.path, exc)
            raise asyncio.CancelledError("client disconnected") from None
        except Exception:  # a bug: still an error object, and logged loudly
            log.exception("enginesim: unhandled error on %s %s", request.method, request.path)
            return self._error(500, "internal error in the engine simulator")

    def _error(
        self, status: int, message: str, param: str | None = None, type: str | None = None
    ) -> web.Response:
        """An error response in the shape the imitated engine sends."""
        if self.flavor is Flavor.LLAMACPP:
            from enginesim.llamacpp_api import llamacpp_error_response

            return llamacpp_error_response(status, message, type)
        return error_response(status, message, param)

    @web.middleware
    async def _fault_middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Apply crash / hang / error before any handler runs (admin endpoints excepted)."""
        if self._crashed:
            # A keep-alive connection that was idle when the process "died".
            if request.transport is not None:
                request.transport.abort()
            raise asyncio.CancelledError("engine crashed")
        if request.path.startswith("/admin/"):
            return await handler(request)
        if not self._not_hung.is_set():
            await self._not_hung.wait()
            if self._crashed:
                raise asyncio.CancelledError("engine crashed")
        if self._closing:
            return self._error(503, "the engine is shutting down")
        fault = self._fault
        if fault.mode is FaultMode.ERROR and request.path != "/metrics":
            return self._error(fault.status, f"injected fault: engine error ({fault.status})")
        return await handler(request)

    # -- simple endpoints --------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"version": ENGINESIM_VERSION, "engine": "enginesim", "flavor": str(self.flavor)}
        )

    async def _models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.started_at,
            "owned_by": "sglang" if self.flavor is Flavor.SGLANG else "vllm",
            "root": self.model_name,
            "parent": None,
            "max_model_len": self.profile.max_model_len,
        }
        cards = [card, *(lora_card(m, self.started_at) for m in self.loras.values())]
        return web.json_response({"object": "list", "data": cards})

    async def _metrics(self, request: web.Request) -> web.Response:
        if self._fault.mode is FaultMode.SLOW_METRICS:
            await asyncio.sleep(self._fault.delay_s)
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _server_info(self, request: web.Request) -> web.Response:
        p = self.profile
        spec_algo = "EAGLE" if self.speculative else None
        return web.json_response(
            {
                "served_model_name": self.model_name,
                "model_path": self.model_name,
                "max_total_num_tokens": p.num_gpu_blocks * p.block_size,
                "max_running_requests": p.max_num_seqs,
                "page_size": p.block_size,
                "context_length": p.max_model_len,
                "chunked_prefill_size": p.max_num_batched_tokens,
                "max_prefill_tokens": p.max_num_batched_tokens,
                "disable_radix_cache": not self.core.enable_prefix_caching,
                "speculative_algorithm": spec_algo,
                # SGLang's server arguments: drafts verified per step (EAGLE: one chain).
                "speculative_num_draft_tokens": (
                    self.core.num_draft_tokens + 1 if self.speculative else None
                ),
                "speculative_num_steps": self.core.num_draft_tokens if self.speculative else None,
                "speculative_eagle_topk": 1 if self.speculative else None,
                "version": ENGINESIM_VERSION,
            }
        )

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        try:
            if "messages" in body:
                chat = TokenizeChatRequest.model_validate(body)
                self.check_model(chat.model)
                tokens = tokenizer.encode(render_chat(chat.messages, body.get("tools")))
            else:
                comp = TokenizeCompletionRequest.model_validate(body)
                self.check_model(comp.model)
                tokens = tokenizer.encode(comp.prompt)
        except ValidationError as exc:
            raise validation_error(exc) from None
        return web.json_response(
            {
                "count": len(tokens),
                "max_model_len": self.profile.max_model_len,
                "tokens": tokens,
                "token_strs": None,
            }
        )

    async def _load_lora(self, request: web.Request) -> web.Response:
        """vLLM's runtime LoRA loading: the adapter is a model from now on."""
        body = await read_json(request)
        name = body.get("lora_name") if isinstance(body, dict) else None
        path = body.get("lora_path") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if name in self.loras or name == self.model_name:
            raise ApiError(400, f"The lora adapter '{name}' has already been loaded.")
        self.loras[name] = LoraModule(name, path, self.model_name)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def _unload_lora(self, request: web.Request) -> web.Response:
        """vLLM's runtime LoRA unloading: requests running on it finish; new ones 404."""
        body = await read_json(request)
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not isinstance(name, str) or name not in self.loras:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
        del self.loras[name]
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    # -- admin -------------------------------------------------------------------------

    def _fault_json(self) -> dict[str, Any]:
        out = self._fault.to_json()
        out["crashed"] = self._crashed
        return out

    async def _get_faults(self, request: web.Request) -> web.Response:
        return web.json_response(self._fault_json())

    async def _post_faults(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        try:
            fault = FaultConfig.from_json(body)
        except FaultConfigError as exc:
            raise ApiError(400, str(exc), exc.param) from None
        immediate_crash = fault.mode is FaultMode.CRASH and fault.after_tokens == 0
        if immediate_crash:
            # Answer the admin call first, on a connection that closes behind it; then die.
            self._fault = fault
            resp = web.json_response({**fault.to_json(), "crashed": True})
            resp.force_close()
            await resp.prepare(request)
            await resp.write_eof()
            self._trigger_crash(spare=request.transport)
            return resp
        self.set_fault(fault)
        return web.json_response(self._fault_json())

    # -- completions -------------------------------------------------------------------

    def check_model(self, model: str | None) -> str:
        """The model a request is served as: the base, or a LoRA adapter it names."""
        if model is None or model == self.model_name:
            return self.model_name
        if model in self.loras:
            return model
        raise ApiError(404, f"The model `{model}` does not exist.", "model")

    def _prepare(
        self, request: web.Request, body: Any, kind: Literal["chat", "completion"]
    ) -> Prepared:
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        try:
            req: ChatCompletionRequest | CompletionRequest
            if kind == "chat":
                req = ChatCompletionRequest.model_validate(body)
            else:
                req = CompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc) from None
        llamacpp = self.flavor is Flavor.LLAMACPP
        # llama-server serves one model whatever the request names.
        model = self.model_name if llamacpp else self.check_model(req.model)
        if req.n != 1:
            raise ApiError(400, f"n must be 1 (the simulator samples one choice), got {req.n}", "n")
        if req.stream_options is not None and not req.stream and not llamacpp:
            raise ApiError(
                400, "Stream options can only be defined when `stream=True`.", "stream_options"
            )

        if isinstance(req, ChatCompletionRequest):
            prompt_text = render_chat(req.messages, body.get("tools"))
            prompt_ids = tokenizer.encode(prompt_text)
            max_tokens = (
                req.max_completion_tokens
                if req.max_completion_tokens is not None
                else req.max_tokens
            )
            max_param = (
                "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            )
        else:
            prompt = req.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
                if len(prompt) != 1:
                    raise ApiError(
                        400,
                        "batched prompts are not supported; send one prompt per request",
                        "prompt",
                    )
                prompt = prompt[0]  # type: ignore[assignment]
            if isinstance(prompt, str):
                prompt_text = prompt
                prompt_ids = tokenizer.encode(prompt)
            else:
                prompt_text = ""
                prompt_ids = list(prompt)  # type: ignore[arg-type]
                if any(t < 0 or t >= tokenizer.VOCAB_SIZE for t in prompt_ids):
                    raise ApiError(
                        400, f"token ids must be in [0, {tokenizer.VOCAB_SIZE})", "prompt"
                    )
            max_tokens = req.max_tokens
            max_param = "max_tokens"

        n_prompt = len(prompt_ids)
        if llamacpp:
            # llama-server checks the prompt against the slot's context only when a slot
            # starts the request, and has no up-front check of prompt + max_tokens.
            if n_prompt == 0:
                raise ApiError(400, "empty prompt", "prompt")
            # n_predict: negative is unlimited, and 0 still generates one token.
            if max_tokens is None or max_tokens < 0:
                n_predict = UNLIMITED
            else:
                n_predict = max(1, max_tokens)
            return self.prepared(
                request, req, kind, model, prompt_text, prompt_ids, n_predict
            )  # fmt: skip
        if n_prompt == 0:  # vLLM names `prompt` for an empty chat prompt too
            raise ApiError(400, "The prompt is empty; at least one token is required.", "prompt")
        max_tokens = bound_max_tokens(
            self.profile.max_model_len,
            n_prompt,
            max_tokens,
            max_param,
            "messages" if kind == "chat" else "prompt",
        )
        if req.min_tokens > max_tokens:
            raise ApiError(
                400,
                f"min_tokens must be less than or equal to {max_param}={max_tokens}, got {req.min_tokens}.",
                "min_tokens",
            )

        return self.prepared(request, req, kind, model, prompt_text, prompt_ids, max_tokens)

    def prepared(
        self,
        request: web.Request,
        req: SamplingRequest,
        kind: Literal["chat", "completion"],
        model: str,
        prompt_text: str,
        prompt_ids: list[int],
        max_tokens: int,
        public_id: str | None = None,
    ) -> Prepared:
        """A checked request ready for the core, as `public_id` if given (the step every
        API's requests take after their own checks; see `enginesim.host.Host`)."""
        # The agent APIs name their own requests (resp_..., embd-...).
        if public_id is None and self.flavor is Flavor.LLAMACPP:
            public_id = "chatcmpl-" + "".join(_RNG.choices(_ALNUM, k=32))  # 32 alphanumerics
        elif public_id is None:
            public_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        workload: Workload = classify_workload(request.headers.get("x-workload"), prompt_text)
        sim = SimRequest(
            request_id=public_id,
            prompt_token_ids=prompt_ids,
            max_tokens=max_tokens,
            workload=workload,
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
            priority=req.priority,
            lora_name=model if model in self.loras else None,
        )
        opts = req.stream_options
        fault = self._fault
        return Prepared(
            kind=kind,
            public_id=public_id,
            model=model,
            created=int(time.time()),
            sim=sim,
            stream=req.stream,
            include_usage=bool(opts and opts.include_usage),
            continuous_usage=bool(opts and opts.continuous_usage_stats),
            drop_after=fault.after_tokens if fault.mode is FaultMode.DROP else None,
        )

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completion")

    async def _serve(
        self, request: web.Request, kind: Literal["chat", "completion"]
    ) -> web.StreamResponse:
        return await self.serve_body(request, await read_json(request), kind)

    async def serve_body(
        self, request: web.Request, body: Any, kind: Literal["chat", "completion"]
    ) -> web.StreamResponse:
        """A chat or completion request's answer from its parsed JSON body."""
        prep = self._prepare(request, body, kind)
        async with self.submitted(prep) as handle:
            if self.flavor is Flavor.LLAMACPP:
                if prep.stream:
                    return await self.llamacpp.stream(request, prep, handle)
                return await self.llamacpp.complete(request, prep, handle)
            if prep.stream:
                return await self._stream(request, prep, handle)
            return await self._complete(request, prep, handle)

    @contextlib.asynccontextmanager
    async def submitted(self, prep: Prepared) -> AsyncIterator[RequestHandle]:
        """The request in the core for the block's duration (every API's way in).

        Every way out (finished, client gone, cancelled, fault, bug) ends the core
        request; after a normal finish this is a no-op. (llama-server is slower to notice
        a non-stream client gone: see LlamaCppApi.complete.)
        """
        try:
            handle = self.driver.submit(prep.sim)
        except ValueError as exc:  # the core refused it (e.g. its own length check)
            raise ApiError(400, str(exc)) from None
        try:
            yield handle
        finally:
            if not (self.flavor is Flavor.LLAMACPP and self.llamacpp.lingers(prep.public_id)):
                self.driver.abort(prep.public_id)

    async def batches(
        self, request: web.Request, prep: Prepared, handle: RequestHandle
    ) -> AsyncIterator[tuple[list[int], EngineEvent | None]]:
        """A request's output step by step: (new token ids, terminal event or None).

        The last item carries the terminal event (FINISHED or ABORTED). The `drop` fault
        strikes after the item that reaches its token count has been handled.
        """
        sent = 0
        while True:
            batch = await handle.next_batch()
            ids = [t for ev in batch for t in ev.token_ids]
            final = next(
                (ev for ev in batch if ev.kind in (EventKind.FINISHED, EventKind.ABORTED)), None
            )
            sent += len(ids)
            yield ids, final
            if final is not None:
                return
            if prep.drop_after is not None and sent >= prep.drop_after:
                self.drop(request, prep)

    # -- non-stream --------------------------------------------------------------------

    async def _complete(
        self, request: web.Request, prep: Prepared, handle: RequestHandle
    ) -> web.StreamResponse:
        token_ids: list[int] = []
        final: EngineEvent | None = None
        async for ids, end in self.batches(request, prep, handle):
            token_ids.extend(ids)
            final = end
        assert final is not None  # noqa: S101
        if final.kind is EventKind.ABORTED:
            raise ApiError(500, "the engine aborted the request")
        text = tokenizer.decode(token_ids)
        usage = _usage(final, len(token_ids))
        choice: dict[str, Any]
        if prep.kind == "chat":
            choice = {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "reasoning_content": None,
                    "tool_calls": [],
                },
                "logprobs": None,
                "finish_reason": final.finish_reason,
                "stop_reason": None,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": final.finish_reason,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
            obj = "text_completion"
        return web.json_response(
            {
                "id": prep.public_id,
                "object": obj,
                "created": prep.created,
                "model": prep.model,
                "choices": [choice],
                "usage": usage,
            }
        )

    def drop(self, request: web.Request, prep: Prepared) -> NoReturn:
        """The `drop` fault: abort the request and close the connection under the client."""
        self.driver.abort(prep.public_id)
        if request.transport is not None:
            request.transport.abort()
        # End the handler the way a lost connection does (aiohttp cancels the handler
        # then), so nothing tries to answer on the dead connection or logs it as an error.
        raise asyncio.CancelledError("injected fault: connection dropped")

    # -- stream ------------------------------------------------------------------------

    async def _stream(
        self, request: web.Request, prep: Prepared, handle: RequestHandle
    ) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers=_SSE_HEADERS)
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        chat = prep.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": prep.public_id, "object": obj, "created": prep.created, "model": prep.model}
        n_prompt = len(prep.sim.prompt_token_ids)
        sent = 0
        first = True

        async def send(payload: dict[str, Any]) -> None:
            await resp.write(
                b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
            )

        def chunk(text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
                if text is not None:
                    delta["content"] = text
                c: dict[str, Any] = {
                    "index": 0,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": finish,
                }
            else:
                c = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            if finish is not None:
                c["stop_reason"] = None
            out = {**head, "choices": [c]}
            if prep.continuous_usage:
                out["usage"] = {
                    "prompt_tokens": n_prompt,
                    "completion_tokens": sent,
                    "total_tokens": n_prompt + sent,
                }
            return out

        if prep.drop_after == 0:
            self.drop(request, prep)
        final: EngineEvent | None = None
        async for ids, final in self.batches(request, prep, handle):
            if chat and first:
                await send(chunk(None, None, role=True))
            first = False
            if ids or final is not None:
                sent += len(ids)
                finish = final.finish_reason if final is not None else None
                await send(chunk(tokenizer.decode(ids), finish))
        assert final is not None  # noqa: S101
        if prep.include_usage:
            await send({**head, "choices": [], "usage": _usage(final, sent)})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _usage(final: EngineEvent, counted_tokens: int) -> dict[str, Any]:
    """Usage as vLLM reports it, from the engine's own accounting of the request."""
    prompt = final.prompt_tokens
    completion = final.completion_tokens or counted_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": final.cached_tokens},
    }
