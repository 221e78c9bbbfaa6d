"""The rest of vLLM 0.32's serving surface, on the same core: pooling, audio, detokenize.

* Pooling (a real vLLM needs a pooling runner; the simulator serves them on any model):
  `POST /rerank` (`/v1/rerank`, `/v2/rerank`), `POST /score` (`/v1/score`),
  `POST /classify`, `POST /pooling`. Each prompt is a prefill-only core request, as
  `/v1/embeddings` is (`enginesim.agent_api`; both use `enginesim.pooling`): it queues,
  holds its prompt's KV while prefilled, counts in /metrics, and is aborted when its
  client goes away. Score and rerank run as a cross-encoder does: one request per
  (query, document) pair, the pair's prompt being the query's tokens, a separator and
  the document's. Scores, class probabilities and pooled vectors are deterministic
  functions of the tokens.
* Audio: `POST /v1/audio/transcriptions` and `/v1/audio/translations` (multipart form).
  The audio becomes prompt tokens by its length: one token per `AUDIO_BYTES_PER_TOKEN`
  bytes (20 ms of 16 kHz 16-bit mono PCM, the rate of Whisper's encoder), their ids a
  hash of each 640-byte frame (the same audio is the same prompt), then the form's
  `prompt` text. The answer is decoded on the core like a completion; the clip's
  duration is its byte length at 32,000 bytes a second.
* `POST /detokenize`: token ids back to text as far as the stand-in tokenizer can
  (generated and special tokens; a prompt token is a one-way hash and decodes to nothing).

Shapes follow vLLM 0.32's `entrypoints/pooling`, `entrypoints/speech_to_text` and
`entrypoints/serve/tokenize` for a text-only model: response ids are
`<prefix>-<16 hex digits>` (`score-` for score and rerank, `classify-`, `pooling-`,
`transcribe-`, `translate-`), or the `X-Request-Id` header after the prefix.
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, model_validator

from enginesim import tokenizer
from enginesim.api import (
    ApiError,
    ChatMessage,
    Prepared,
    SamplingRequest,
    bound_max_tokens,
    dumps,
    hex16,
    read_json,
    render_chat,
    validated,
)
from enginesim.driver import RequestHandle
from enginesim.host import Host, open_sse, prefill_together, run_to_end
from enginesim.pooling import (
    check_prompt_len,
    embedding_vector,
    input_items,
    input_prompt,
    list_answer,
)

AUDIO_BYTES_PER_TOKEN = 640  # 20 ms of 16 kHz, 16-bit mono PCM
AUDIO_BYTES_PER_SECOND = 32_000
MAX_AUDIO_FILE_MB = 25  # vLLM's VLLM_MAX_AUDIO_CLIP_FILESIZE_MB default
NUM_CLASSES = 2  # labels LABEL_0 / LABEL_1, as a Hugging Face config without id2label
SEP_ID = tokenizer.SPECIAL["<|end|>"]  # between a pair's query and document
_POOLING_TASKS = ("embed", "classify", "token_embed", "token_classify", "plugin")
_REMOVED_TASKS = {
    "score": "`score` task was removed; use `classify` instead.",
    "encode": "`encode` task was removed; use `token_embed` or `token_classify` instead.",
}


# --------------------------------------------------------------------------------------
# Request schemas (unknown fields are accepted and ignored)
# --------------------------------------------------------------------------------------


class _PoolingBase(SamplingRequest):
    """What every pooling request carries (PoolingBasicRequestMixin), plus the core's
    sampling defaults so it can be prepared like any request."""

    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    use_activation: bool | None = None
    request_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _removed(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if "normalize" in data:
                raise ApiError(
                    400,
                    "Parameter `normalize` was removed; use `use_activation` instead.",
                    "normalize",
                )
            task = data.get("task")
            if isinstance(task, str) and task in _REMOVED_TASKS:
                raise ApiError(400, _REMOVED_TASKS[task], "task")
        return data


ScoreInput = str | dict[str, Any]


class _ScoringBase(_PoolingBase):
    max_tokens_per_query: int = 0
    max_tokens_per_doc: int = 0
    instruction: str | None = None


class RerankRequest(_ScoringBase):
    query: ScoreInput
    documents: ScoreInput | list[ScoreInput]
    top_n: int = Field(default=0, ge=0)


class ScoreRequest(_ScoringBase):
    """vLLM's four spellings of the two sides: queries/documents, queries/items,
    data_1/data_2, text_1/text_2 (the first complete pair wins, as its union does)."""

    queries: ScoreInput | list[ScoreInput] | None = None
    documents: ScoreInput | list[ScoreInput] | None = None
    items: ScoreInput | list[ScoreInput] | None = None
    data_1: ScoreInput | list[ScoreInput] | None = None
    data_2: ScoreInput | list[ScoreInput] | None = None
    text_1: ScoreInput | list[ScoreInput] | None = None
    text_2: ScoreInput | list[ScoreInput] | None = None

    def sides(self) -> tuple[Any, Any]:
        for a, b in (
            (self.queries, self.documents),
            (self.queries, self.items),
            (self.data_1, self.data_2),
            (self.text_1, self.text_2),
        ):
            if a is not None and b is not None:
                return a, b
        raise ApiError(400, "text_1: Field required; text_2: Field required", "text_1")


class _InputRequest(_PoolingBase):
    """A completion-style (`input`) or chat-style (`messages`) pooling request."""

    input: list[list[int]] | list[int] | list[str] | str | None = None
    messages: list[ChatMessage] | None = None

    @model_validator(mode="after")
    def _one_of(self) -> _InputRequest:
        if self.input is None and self.messages is None:
            raise ValueError("Field required: `input` (or `messages`)")
        return self


class ClassificationRequest(_InputRequest):
    pass


class PoolingRequest(_InputRequest):
    task: Literal["embed", "classify", "token_embed", "token_classify", "plugin"] | None = None
    dimensions: int | None = None
    encoding_format: Literal["float", "base64", "bytes", "bytes_only"] = "float"


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int]


class AudioForm(SamplingRequest):
    """TranscriptionRequest / TranslationRequest's form fields (the file apart)."""

    language: str | None = None
    prompt: str = ""
    response_format: str = "json"
    stream: bool | None = False  # type: ignore[assignment]
    stream_include_usage: bool | None = False
    stream_continuous_usage_stats: bool | None = False
    temperature: float | None = None
    max_completion_tokens: int | None = None
    use_beam_search: bool = False

    @model_validator(mode="before")
    @classmethod
    def _stream_options(cls, data: Any) -> Any:
        if isinstance(data, dict) and not _truthy(data.get("stream")):
            for opt in ("stream_include_usage", "stream_continuous_usage_stats"):
                if _truthy(data.get(opt)):
                    raise ApiError(
                        400, "Stream options can only be defined when `stream=True`.", opt
                    )
        return data


def _truthy(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "on", "y", "t")
    return bool(v)


# --------------------------------------------------------------------------------------
# Deterministic model outputs
# --------------------------------------------------------------------------------------


def _unit(*parts: bytes) -> float:
    """A number in [0, 1) from the bytes given."""
    digest = hashlib.blake2b(b"\0".join(parts), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def _ids_bytes(ids: list[int]) -> bytes:
    return struct.pack(f"<{len(ids)}I", *ids)


def relevance_score(query_ids: list[int], doc_ids: list[int]) -> float:
    """A cross-encoder's sigmoid score in (0, 1): the share of the query's distinct
    tokens found in the document, plus a small deterministic jitter."""
    q = set(query_ids)
    overlap = len(q & set(doc_ids)) / len(q) if q else 0.0
    jitter = _unit(_ids_bytes(query_ids), _ids_bytes(doc_ids)) - 0.5
    return 1.0 / (1.0 + math.exp(-(6.0 * overlap - 3.0 + jitter)))


def class_probs(ids: list[int]) -> list[float]:
    """NUM_CLASSES probabilities (a softmax) from the tokens."""
    logits = [4.0 * _unit(_ids_bytes(ids), bytes([k])) - 2.0 for k in range(NUM_CLASSES)]
    top = max(logits)
    exps = [math.exp(v - top) for v in logits]
    total = sum(exps)
    return [e / total for e in exps]


def audio_token_ids(audio: bytes) -> list[int]:
    """One prompt token per AUDIO_BYTES_PER_TOKEN bytes (the last frame may be short)."""
    span = tokenizer.GEN_BASE - 256
    return [
        256
        + int.from_bytes(
            hashlib.blake2b(audio[i : i + AUDIO_BYTES_PER_TOKEN], digest_size=4).digest(),
            "little",
        )
        % span
        for i in range(0, len(audio), AUDIO_BYTES_PER_TOKEN)
    ]


def detokenize(ids: list[int]) -> str:
    """Generated and special tokens as text; hashed prompt tokens have none."""
    special = {v: k for k, v in tokenizer.SPECIAL.items()}
    return "".join(
        special.get(t, "") if t < tokenizer.GEN_BASE else tokenizer.decode([t]) for t in ids
    )


# --------------------------------------------------------------------------------------
# The routes
# --------------------------------------------------------------------------------------


class ServingApi:
    """The routes of this module for one `EngineServer`, seen as a `Host` (vLLM and SGLang
    flavors)."""

    def __init__(self, server: Host) -> None:
        self.server = server

    def add_routes(self, r: web.UrlDispatcher) -> None:
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            r.add_post(path, self.rerank)
        for path in ("/score", "/v1/score"):
            r.add_post(path, self.score)
        r.add_post("/classify", self.classify)
        r.add_post("/pooling", self.pooling)
        r.add_post("/v1/audio/transcriptions", self.transcriptions)
        r.add_post("/v1/audio/translations", self.translations)
        r.add_post("/detokenize", self.detokenize)

    # -- the core ----------------------------------------------------------------------

    @staticmethod
    def _request_id(request: web.Request, prefix: str, body_id: str | None = None) -> str:
        base = request.headers.get("X-Request-Id") or body_id or hex16()
        return f"{prefix}-{base}"

    def _inputs(self, req: _InputRequest) -> list[tuple[str, list[int]]]:
        items = [render_chat(req.messages)] if req.messages is not None else input_items(req.input)
        if not items:
            raise ApiError(400, "You must pass at least one prompt", "input")
        return [input_prompt(item, self.server.profile.max_model_len) for item in items]

    @staticmethod
    def _list_answer(rid: str, model: str, data: list[dict[str, Any]], n: int) -> web.Response:
        """A pooling answer (score, classify, pooling): its data and vLLM's UsageInfo for
        `n` prompt tokens, as model_dump writes it."""
        usage = {
            "prompt_tokens": n,
            "total_tokens": n,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        }
        return list_answer(rid, model, data, usage)

    # -- score and rerank --------------------------------------------------------------

    def _pairs(self, side_1: Any, side_2: Any) -> tuple[list[str], list[str]]:
        """vLLM's validate_score_input for a text-only model: lists, 1:1, 1:N or N:N."""
        d1 = side_1 if isinstance(side_1, list) else [side_1]
        d2 = side_2 if isinstance(side_2, list) else [side_2]
        for d in (*d1, *d2):
            if not isinstance(d, str):
                raise ApiError(400, "MultiModalParam is not supported for EngineSimForScoring")
        if len(d1) > 1 and len(d1) != len(d2):
            raise ApiError(400, "Input lengths must be either 1:1, 1:N or N:N")
        if not d1:
            raise ApiError(400, "At least one text element must be given")
        if not d2:
            raise ApiError(400, "At least one text_pair element must be given")
        if len(d1) == 1:
            d1 = d1 * len(d2)
        return d1, d2

    async def _score_pairs(
        self, request: web.Request, req: _ScoringBase, rid: str, d1: list[str], d2: list[str]
    ) -> tuple[str, list[float], int]:
        model = self.server.check_model(req.model)
        for name, value in (
            ("max_tokens_per_query", req.max_tokens_per_query),
            ("max_tokens_per_doc", req.max_tokens_per_doc),
        ):
            if value < 0:
                raise ApiError(400, f"{name} must be a non-negative integer", name)
            if value >= self.server.profile.max_model_len:
                raise ApiError(
                    400,
                    f"{name} ({value}) must be less than max_model_len "
                    f"({self.server.profile.max_model_len}).",
                    name,
                )
        prompts: list[tuple[str, list[int]]] = []
        sides: list[tuple[list[int], list[int]]] = []
        for q, d in zip(d1, d2, strict=True):
            q_ids, d_ids = tokenizer.encode(q), tokenizer.encode(d)
            if req.max_tokens_per_query:
                q_ids = q_ids[: req.max_tokens_per_query]
            if req.max_tokens_per_doc:
                d_ids = d_ids[: req.max_tokens_per_doc]
            ids = [*q_ids, SEP_ID, *d_ids, SEP_ID]
            check_prompt_len(ids, self.server.profile.max_model_len, "documents")
            prompts.append((q + d, ids))
            sides.append((q_ids, d_ids))
        preps = await prefill_together(self.server, request, req, model, rid, prompts)
        scores = [relevance_score(q, d) for q, d in sides]
        return model, scores, sum(len(p.sim.prompt_token_ids) for p in preps)

    async def rerank(self, request: web.Request) -> web.Response:
        req: RerankRequest = validated(RerankRequest, await read_json(request))
        rid = self._request_id(request, "score", req.request_id)
        docs = req.documents if isinstance(req.documents, list) else [req.documents]
        d1, d2 = self._pairs(req.query, docs)
        model, scores, n = await self._score_pairs(request, req, rid, d1, d2)
        results = [
            {"index": i, "document": {"text": d, "multi_modal": None}, "relevance_score": s}
            for i, (d, s) in enumerate(zip(d2, scores, strict=True))
        ]
        results.sort(key=lambda r: r["relevance_score"], reverse=True)
        top_n = req.top_n if req.top_n > 0 else len(results)
        if top_n < len(docs):
            results = results[:top_n]
        return web.json_response(
            {
                "id": rid,
                "model": model,
                "usage": {"prompt_tokens": n, "total_tokens": n},
                "results": results,
            }
        )

    async def score(self, request: web.Request) -> web.Response:
        req: ScoreRequest = validated(ScoreRequest, await read_json(request))
        rid = self._request_id(request, "score", req.request_id)
        d1, d2 = self._pairs(*req.sides())
        model, scores, n = await self._score_pairs(request, req, rid, d1, d2)
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return self._list_answer(rid, model, data, n)

    # -- classify and pooling ----------------------------------------------------------

    async def classify(self, request: web.Request) -> web.Response:
        req: ClassificationRequest = validated(ClassificationRequest, await read_json(request))
        rid = self._request_id(request, "classify", req.request_id)
        model = self.server.check_model(req.model)
        preps = await prefill_together(self.server, request, req, model, rid, self._inputs(req))
        data = []
        for i, p in enumerate(preps):
            probs = class_probs(p.sim.prompt_token_ids)
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append(
                {"index": i, "label": f"LABEL_{best}", "probs": probs, "num_classes": len(probs)}
            )
        return self._list_answer(rid, model, data, sum(len(p.sim.prompt_token_ids) for p in preps))

    async def pooling(self, request: web.Request) -> web.Response:
        req: PoolingRequest = validated(PoolingRequest, await read_json(request))
        rid = self._request_id(request, "pooling", req.request_id)
        model = self.server.check_model(req.model)
        if req.dimensions is not None:
            raise ApiError(400, "dimensions is currently not supported", "dimensions")
        task = req.task or "embed"
        if task == "plugin":
            raise ApiError(
                400,
                "No IOProcessor plugin installed. Please refer to the documentation and to "
                "the 'prithvi_geospatial_mae_io_processor' offline inference example for "
                "more details.",
                "task",
            )
        if req.encoding_format in ("bytes", "bytes_only"):
            raise ApiError(
                400, "the simulator answers encoding_format float or base64", "encoding_format"
            )
        preps = await prefill_together(self.server, request, req, model, rid, self._inputs(req))
        data = []
        for i, p in enumerate(preps):
            ids = p.sim.prompt_token_ids
            out: list[float] | list[list[float]]
            if task == "embed":
                out = embedding_vector(ids)
            elif task == "classify":
                out = class_probs(ids)
            elif task == "token_embed":
                out = [embedding_vector(ids[: k + 1]) for k in range(len(ids))]
            else:  # token_classify
                out = [class_probs(ids[: k + 1]) for k in range(len(ids))]
            value: Any = out
            if req.encoding_format == "base64":
                flat = [x for row in out for x in row] if out and isinstance(out[0], list) else out
                value = base64.b64encode(struct.pack(f"<{len(flat)}f", *flat)).decode()
            data.append({"index": i, "object": "pooling", "data": value})
        return self._list_answer(rid, model, data, sum(len(p.sim.prompt_token_ids) for p in preps))

    # -- detokenize --------------------------------------------------------------------

    async def detokenize(self, request: web.Request) -> web.Response:
        req: DetokenizeRequest = validated(DetokenizeRequest, await read_json(request))
        self.server.check_model(req.model)
        if any(t < 0 or t >= tokenizer.VOCAB_SIZE for t in req.tokens):
            raise ApiError(400, f"token ids must be in [0, {tokenizer.VOCAB_SIZE})", "tokens")
        return web.json_response({"prompt": detokenize(req.tokens)})

    # -- audio -------------------------------------------------------------------------

    async def transcriptions(self, request: web.Request) -> web.StreamResponse:
        return await self._audio(request, "transcribe")

    async def translations(self, request: web.Request) -> web.StreamResponse:
        return await self._audio(request, "translate")

    async def _read_form(self, request: web.Request) -> tuple[bytes, AudioForm]:
        fields: dict[str, Any] = {}
        audio: bytes | None = None
        if request.content_type in ("multipart/form-data", "application/x-www-form-urlencoded"):
            try:
                form = await request.post()
            except web.HTTPRequestEntityTooLarge as exc:
                raise ApiError(400, "Maximum file size exceeded", "audio_filesize_mb") from exc
            except ValueError as exc:
                raise ApiError(400, f"the form could not be parsed: {exc}") from exc
            for key, value in form.items():
                if key == "file":
                    if isinstance(value, str):
                        raise ApiError(
                            422, "Expected 'file' to be a file-like object, not 'str'.", "file"
                        )
                    audio = value.file.read()
                elif isinstance(value, str):
                    fields[key] = value
        if audio is None:
            raise ApiError(400, "file: Field required", "file")
        if len(audio) > MAX_AUDIO_FILE_MB * 1024 * 1024:
            raise ApiError(400, "Maximum file size exceeded", "audio_filesize_mb")
        return audio, validated(AudioForm, fields)

    async def _audio(
        self, request: web.Request, task: Literal["transcribe", "translate"]
    ) -> web.StreamResponse:
        server = self.server
        audio, form = await self._read_form(request)
        if form.stream and form.use_beam_search:
            raise ApiError(400, "Streaming is not currently supported with beam search")
        model = server.check_model(form.model)
        if form.response_format not in ("text", "json", "verbose_json", "diarized_json"):
            raise ApiError(
                400,
                "Currently only support response_format: `text`, `json`, `verbose_json` "
                "or `diarized_json`",
            )
        if form.response_format in ("verbose_json", "diarized_json"):
            # A model without segment timestamps or diarization (vLLM's check for either).
            raise ApiError(400, f"Currently do not support {form.response_format} for {model}")
        if not audio:
            raise ApiError(400, "Invalid or unsupported audio file.")
        duration_s = len(audio) / AUDIO_BYTES_PER_SECOND
        prompt_ids = audio_token_ids(audio) + tokenizer.encode(form.prompt)
        max_tokens = bound_max_tokens(
            server.profile.max_model_len,
            len(prompt_ids),
            form.max_completion_tokens,
            "max_completion_tokens",
            "file",
        )
        rid = self._request_id(request, task)
        prep = server.prepared(request, form, "completion", model, "", prompt_ids, max_tokens, rid)
        async with server.submitted(prep) as handle:
            if form.stream:
                return await self._audio_stream(request, prep, handle, form, task)
            ids, _final = await run_to_end(self.server, request, prep, handle)
        out: dict[str, Any] = {"text": tokenizer.decode(ids)}
        if task == "transcribe":  # no usage in a translation
            out["usage"] = {"type": "duration", "seconds": math.ceil(duration_s)}
        return web.json_response(out)

    async def _audio_stream(
        self,
        request: web.Request,
        prep: Prepared,
        handle: RequestHandle,
        form: AudioForm,
        task: Literal["transcribe", "translate"],
    ) -> web.StreamResponse:
        """vLLM's chat-like chunks (`transcription.chunk` / `translation.chunk`, no
        `index` in a choice), an optional usage chunk, then `[DONE]`."""
        resp = await open_sse(request)
        head = {
            "id": prep.public_id,
            "object": "transcription.chunk" if task == "transcribe" else "translation.chunk",
            "created": prep.created,
            "model": prep.model,
        }
        include_usage = bool(form.stream_include_usage)
        continuous = include_usage and bool(form.stream_continuous_usage_stats)
        n_prompt = len(prep.sim.prompt_token_ids)
        n_out = 0

        def usage() -> dict[str, int]:
            return {
                "prompt_tokens": n_prompt,
                "total_tokens": n_prompt + n_out,
                "completion_tokens": n_out,
            }

        async def send(payload: dict[str, Any]) -> None:
            await resp.write(f"data: {dumps(payload)}\n\n".encode())

        if prep.drop_after == 0:
            self.server.drop(request, prep)
        async for ids, final in self.server.batches(request, prep, handle):
            n_out += len(ids)
            text = tokenizer.decode(ids)
            if final is None and not text:
                continue
            choice: dict[str, Any] = {"delta": {"content": text}}
            if final is not None:
                choice["finish_reason"] = final.finish_reason
                choice["stop_reason"] = None
            chunk: dict[str, Any] = {**head, "choices": [choice]}
            if continuous:
                chunk["usage"] = usage()
            await send(chunk)
        if include_usage:
            await send({**head, "choices": [], "usage": usage()})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
