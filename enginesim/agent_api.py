"""The APIs vLLM 0.32 serves to coding agents beside chat completions, on the same core.

* `POST /v1/responses` (OpenAI Responses API), stream and non-stream, with vLLM's
  in-memory store as `VLLM_ENABLE_RESPONSES_API_STORE=1` runs it: `store` (default true)
  keeps a finished response, `GET /v1/responses/{id}` returns it, `previous_response_id`
  continues its conversation (its input messages, instructions excepted, then its
  output, then the new input). `background: true` (non-stream) answers `queued` at once
  and runs the request in a task; `POST /v1/responses/{id}/cancel` cancels it (and aborts
  it in the core), and is a 400 for a response that was not run in the background, as on
  vLLM. There is no DELETE route, as on vLLM (405).
* `POST /v1/messages` (Anthropic Messages API), stream and non-stream, and
  `POST /v1/messages/count_tokens`: vLLM turns them into a chat completion and back, so
  the message id is the chat completion's (`chatcmpl-...`), errors the handler raises are
  Anthropic-shaped with vLLM's error type names (`{"type": "error", "error": {"type":
  "NotFoundError", "message": ...}}`), while a body that fails validation gets vLLM's
  usual OpenAI error object, as FastAPI's validation handler sends it there.
* `POST /v1/embeddings` on any model (a real vLLM needs a pooling runner for it): one
  prefill-only core request per input, which holds its prompt's KV while prefilled and
  generates nothing; the vector is a deterministic function of the tokens
  (`enginesim.pooling.EMBED_DIM` floats, unit length, as vLLM normalizes).

Every generating request goes through the chat path's own steps (`Host.prepared`,
`submitted`, `batches`, in `enginesim.host`): it queues, takes KV, streams at the
simulated pace, is aborted in the core when its client goes away, honours the `drop`
fault, and counts in /metrics exactly as a chat completion does. Shapes, field order and
event sequences follow vLLM 0.32's `entrypoints/openai/responses` and
`entrypoints/anthropic` code paths for a model without reasoning or tool parsers.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, field_validator

from enginesim import tokenizer
from enginesim.api import (
    ApiError,
    ChatMessage,
    Prepared,
    SamplingRequest,
    bound_max_tokens,
    dumps,
    error_type,
    hex16,
    read_json,
    render_chat,
    validated,
)
from enginesim.driver import RequestHandle
from enginesim.host import Host, open_sse, prefill_together, run_to_end
from enginesim.pooling import embedding_vector, input_items, input_prompt, list_answer
from enginesim.types import EngineEvent, EventKind

MAX_STORED_RESPONSES = 10_000  # vLLM never evicts; a long simulation should not grow forever


# --------------------------------------------------------------------------------------
# Request schemas (unknown fields are accepted and ignored, as elsewhere in enginesim)
# --------------------------------------------------------------------------------------


class ResponsesRequest(SamplingRequest):
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    stream: bool | None = False  # type: ignore[assignment]
    store: bool | None = True
    previous_response_id: str | None = None
    background: bool | None = False
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool | None = True
    metadata: dict[str, Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    top_logprobs: int | None = 0
    max_tool_calls: int | None = None
    service_tier: str = "auto"
    truncation: str | None = "disabled"
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    user: str | None = None


class AnthropicBlock(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    id: str | None = None
    tool_use_id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    content: str | list[dict[str, Any]] | None = None
    thinking: str | None = None


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant", "system"]
    content: str | list[AnthropicBlock]


class _AnthropicPrompt(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[AnthropicMessage]
    system: str | list[AnthropicBlock] | None = None
    tools: list[dict[str, Any]] | None = None

    @field_validator("model")
    @classmethod
    def _model_required(cls, v: str) -> str:
        if not v:
            raise ValueError("Model is required")
        return v


class MessagesRequest(_AnthropicPrompt, SamplingRequest):
    model: str
    max_tokens: int
    stream: bool | None = False  # type: ignore[assignment]
    metadata: dict[str, Any] | None = None

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v <= 0:
            raise ValueError("max_tokens must be positive")
        return v


class CountTokensRequest(_AnthropicPrompt):
    pass


class EmbeddingRequest(SamplingRequest):
    input: list[list[int]] | list[int] | list[str] | str
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None


# --------------------------------------------------------------------------------------
# Prompts: each API's input as the chat messages vLLM renders
# --------------------------------------------------------------------------------------


def _part_text(content: Any) -> str | None:
    """A message's content as text (input_text / output_text / text parts joined)."""
    if content is None or isinstance(content, str):
        return content
    return "".join(
        str(p.get("text") or "")
        for p in content
        if isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
    )


def responses_messages(req: ResponsesRequest, prev: StoredResponse | None) -> list[dict[str, Any]]:
    """vLLM's construct_input_messages: instructions, the previous turn, the new input."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if prev is not None:
        # Instructions do not carry over across responses.
        # Copies: a function_call item may extend the last assistant message's tool_calls.
        messages.extend(copy.deepcopy(m) for m in prev.messages if m.get("role") != "system")
        for item in prev.response["output"]:
            if item.get("type") == "message":
                for part in item.get("content") or []:
                    messages.append({"role": "assistant", "content": part.get("text", "")})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
        return messages
    for item in req.input:
        kind = item.get("type")
        last = messages[-1] if messages else None
        prev_assistant = last if last is not None and last.get("role") == "assistant" else None
        if kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
            }
            if prev_assistant is not None:
                prev_assistant.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "content": output if isinstance(output, str) else _part_text(output),
                    "tool_call_id": item.get("call_id"),
                }
            )
        elif kind == "reasoning":
            continue  # no reasoning parser: reasoning items do not reach the template
        elif kind in (None, "message"):
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"input: unsupported message role {role!r}", "input")
            text = _part_text(item.get("content"))
            if role == "assistant" and prev_assistant is not None:
                if prev_assistant.get("content") is None:
                    prev_assistant["content"] = text
                    continue
            messages.append({"role": role, "content": text})
        else:
            raise ApiError(400, f"input: unsupported item type {kind!r}", "input")
    return messages


def anthropic_messages(
    req: _AnthropicPrompt,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """vLLM's Anthropic-to-chat conversion: the chat messages and the tools."""
    out: list[dict[str, Any]] = []
    system: list[str] = []
    if isinstance(req.system, str):
        system.append(req.system)
    elif req.system:
        system.extend(
            b.text
            for b in req.system
            if b.type == "text" and b.text and not b.text.startswith("x-anthropic-billing-header")
        )
    if system:
        out.append({"role": "system", "content": "".join(system)})
    for msg in req.messages:
        if isinstance(msg.content, str):
            out.append({"role": msg.role, "content": msg.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for b in msg.content:
            if b.type == "text" and b.text:
                texts.append(b.text)
            elif b.type == "tool_use":
                calls.append(
                    {
                        "id": b.id or f"call_{int(time.time())}",
                        "type": "function",
                        "function": {"name": b.name or "", "arguments": dumps(b.input or {})},
                    }
                )
            elif b.type == "tool_result":
                result = b.content
                if isinstance(result, list):
                    result = "\n".join(
                        str(p.get("text", "")) for p in result if p.get("type") == "text"
                    )
                if msg.role == "user":  # a tool message of its own, before the user's text
                    out.append(
                        {"role": "tool", "tool_call_id": b.tool_use_id or "", "content": result}
                    )
                else:
                    texts.append(f"Tool result: {result or ''}")
        chat: dict[str, Any] = {"role": msg.role}
        if calls:
            chat["tool_calls"] = calls
        if texts:
            chat["content"] = "".join(texts)
        if msg.role == "user" and "content" not in chat:
            continue
        out.append(chat)
    tools = None
    if req.tools:
        tools = [
            {
                "type": "function",
                "function": {
                    "name": t.get("name"),
                    "description": t.get("description"),
                    "parameters": t.get("input_schema"),
                },
            }
            for t in req.tools
        ]
    return out, tools


def _render(messages: list[dict[str, Any]], tools: Any) -> tuple[str, list[int]]:
    text = render_chat([ChatMessage.model_validate(m) for m in messages], tools or None)
    return text, tokenizer.encode(text)


# --------------------------------------------------------------------------------------
# The routes
# --------------------------------------------------------------------------------------


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as GET returns it
    messages: list[dict[str, Any]]  # the chat messages its prompt was rendered from


class AgentApi:
    """The routes of this module for one `EngineServer`, seen as a `Host` (vLLM and SGLang
    flavors)."""

    def __init__(self, server: Host) -> None:
        self.server = server
        self.responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._tasks: dict[str, asyncio.Task[None]] = {}  # background responses running

    def add_routes(self, r: web.UrlDispatcher) -> None:
        r.add_post("/v1/responses", self.create_response)
        r.add_get("/v1/responses/{response_id}", self.retrieve_response)
        r.add_post("/v1/responses/{response_id}/cancel", self.cancel_response)
        r.add_post("/v1/messages", self.messages)
        r.add_post("/v1/messages/count_tokens", self.count_tokens)
        r.add_post("/v1/embeddings", self.embeddings)

    # -- Responses API -----------------------------------------------------------------

    @staticmethod
    def _not_found(response_id: str) -> web.Response:
        return web.json_response(
            {
                "error": {
                    "message": f"Response with id '{response_id}' not found.",
                    "type": "invalid_request_error",
                    "param": "response_id",
                    "code": 404,
                }
            },
            status=404,
        )

    async def create_response(self, request: web.Request) -> web.StreamResponse:
        server = self.server
        req: ResponsesRequest = validated(ResponsesRequest, await read_json(request))
        model = server.check_model(req.model)
        if req.background and req.stream:
            raise ApiError(400, "streaming background responses are not simulated", "stream")
        prev = None
        if req.previous_response_id is not None:
            prev = self.responses.get(req.previous_response_id)
            if prev is None:
                return self._not_found(req.previous_response_id)
        messages = responses_messages(req, prev)
        prompt_text, prompt_ids = _render(messages, req.tools)
        max_tokens = bound_max_tokens(
            server.profile.max_model_len,
            len(prompt_ids),
            req.max_output_tokens,
            "max_output_tokens",
            "input",
        )
        prep = server.prepared(
            request, req, "chat", model, prompt_text, prompt_ids, max_tokens, f"resp_{hex16()}"
        )
        base = self._response_head(req, prep, max_tokens)
        if req.background:
            return self._start_background(request, prep, base, messages)
        async with server.submitted(prep) as handle:
            if req.stream:
                return await self._stream_response(request, req, prep, handle, base, messages)
            ids, final = await run_to_end(self.server, request, prep, handle)
            obj = self._finish_message(base, ids, final)
            self._store(req, obj, messages)
            return web.json_response(obj)

    def _start_background(
        self,
        request: web.Request,
        prep: Prepared,
        base: dict[str, Any],
        messages: list[dict[str, Any]],
    ) -> web.Response:
        """vLLM's background mode: answer `queued` at once, run the request in a task."""
        queued = {**base, "status": "queued"}
        self.responses[prep.public_id] = StoredResponse(queued, messages)

        async def run() -> None:
            try:
                async with self.server.submitted(prep) as handle:
                    ids, final = await run_to_end(self.server, request, prep, handle)
            except ApiError:  # the engine aborted it (shutdown)
                stored = self.responses.get(prep.public_id)
                if stored is not None and stored.response["status"] not in (
                    "completed",
                    "cancelled",
                ):
                    stored.response["status"] = "failed"
                return
            obj = self._finish_message(base, ids, final)
            stored = self.responses.get(prep.public_id)
            if stored is None or stored.response["status"] != "cancelled":
                self.responses[prep.public_id] = StoredResponse(obj, messages)

        task = asyncio.get_running_loop().create_task(run(), name=f"enginesim-{prep.public_id}")
        self._tasks[prep.public_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(prep.public_id, None))
        return web.json_response(queued)

    def _response_head(
        self, req: ResponsesRequest, prep: Prepared, max_tokens: int
    ) -> dict[str, Any]:
        """vLLM's ResponsesResponse.from_request, in its field order (status, output and
        usage filled in later)."""
        no_tools = not req.tools and req.tool_choice in ("auto", "none")
        return {
            "id": prep.public_id,
            "created_at": prep.created,
            "incomplete_details": None,
            "instructions": req.instructions,
            "metadata": req.metadata,
            "model": prep.model,
            "object": "response",
            "output": [],
            "parallel_tool_calls": req.parallel_tool_calls
            if req.parallel_tool_calls is not None
            else True,
            "temperature": req.temperature if req.temperature is not None else 1.0,
            "tool_choice": "none" if no_tools else req.tool_choice,
            "tools": [_echo_tool(t) for t in req.tools],
            "top_p": req.top_p if req.top_p is not None else 1.0,
            "background": bool(req.background),
            "max_output_tokens": max_tokens,
            "max_tool_calls": req.max_tool_calls,
            "previous_response_id": req.previous_response_id,
            "prompt": req.prompt,
            "reasoning": req.reasoning,
            "service_tier": req.service_tier,
            "status": "in_progress",
            "text": req.text,
            "top_logprobs": req.top_logprobs or None,
            "truncation": req.truncation or "disabled",
            "usage": None,
            "user": req.user,
            "presence_penalty": req.presence_penalty or 0.0,
            "frequency_penalty": req.frequency_penalty or 0.0,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "input_messages": None,
            "output_messages": None,
        }

    def _cache_write(self, final: EngineEvent) -> int:
        """vLLM's created_cache_tokens: the prompt's full blocks this request wrote to the
        prefix cache (those it found there excepted)."""
        if not getattr(self.server.core, "enable_prefix_caching", False):
            return 0
        bs = self.server.profile.block_size
        return max(0, final.prompt_tokens // bs * bs - final.cached_tokens)

    def _finish_response(
        self, base: dict[str, Any], output: list[dict[str, Any]], final: EngineEvent, n_out: int
    ) -> dict[str, Any]:
        prompt = final.prompt_tokens
        completion = final.completion_tokens or n_out
        if final.kind is EventKind.ABORTED:
            status = "cancelled"
        elif final.finish_reason == "length":
            status = "incomplete"
        else:
            status = "completed"
        return {
            **base,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "output": output,
            "status": status,
            "usage": {
                "input_tokens": prompt,
                "input_tokens_details": {
                    "cached_tokens": final.cached_tokens,
                    "cache_write_tokens": self._cache_write(final),
                    "input_tokens_per_turn": [],
                    "cached_tokens_per_turn": [],
                },
                "output_tokens": completion,
                "output_tokens_details": {
                    "reasoning_tokens": 0,
                    "tool_output_tokens": 0,
                    "output_tokens_per_turn": [],
                    "tool_output_tokens_per_turn": [],
                },
                "total_tokens": prompt + completion,
            },
        }

    def _finish_message(
        self, base: dict[str, Any], ids: list[int], final: EngineEvent
    ) -> dict[str, Any]:
        """A non-stream response: one completed message of the output tokens."""
        item = _message_item(f"msg_{hex16()}", tokenizer.decode(ids), "completed")
        return self._finish_response(base, [item], final, len(ids))

    def _store(
        self, req: ResponsesRequest, obj: dict[str, Any], messages: list[dict[str, Any]]
    ) -> None:
        if not req.store:
            return
        self.responses[obj["id"]] = StoredResponse(obj, messages)
        while len(self.responses) > MAX_STORED_RESPONSES:
            self.responses.popitem(last=False)

    async def _stream_response(
        self,
        request: web.Request,
        req: ResponsesRequest,
        prep: Prepared,
        handle: RequestHandle,
        base: dict[str, Any],
        messages: list[dict[str, Any]],
    ) -> web.StreamResponse:
        resp = await open_sse(request)
        seq = 0

        async def send(event: dict[str, Any]) -> None:
            nonlocal seq
            event["sequence_number"] = seq
            seq += 1
            ev_type = event["type"]
            # Field order as vLLM's event models dump them: the type comes last.
            del event["type"]
            event["type"] = ev_type
            await resp.write(f"event: {ev_type}\ndata: {dumps(event)}\n\n".encode())

        await send({"response": base, "type": "response.created"})
        await send({"response": base, "type": "response.in_progress"})
        if prep.drop_after == 0:
            self.server.drop(request, prep)
        item_id: str | None = None
        text = ""
        n_out = 0
        output: list[dict[str, Any]] = []
        final: EngineEvent | None = None
        async for ids, end in self.server.batches(request, prep, handle):
            final = end
            n_out += len(ids)
            delta = tokenizer.decode(ids)
            if not delta:
                continue
            if item_id is None:  # the message opens with its first text
                item_id = f"msg_{hex16()}"
                await send(
                    {
                        "item": _message_item(item_id, "", "in_progress"),
                        "output_index": 0,
                        "type": "response.output_item.added",
                    }
                )
                await send(
                    {
                        "content_index": 0,
                        "item_id": item_id,
                        "output_index": 0,
                        "part": _text_part("", logprobs=[]),
                        "type": "response.content_part.added",
                    }
                )
            text += delta
            await send(
                {
                    "content_index": 0,
                    "delta": delta,
                    "item_id": item_id,
                    "logprobs": [],
                    "output_index": 0,
                    "type": "response.output_text.delta",
                }
            )
        assert final is not None  # noqa: S101
        if item_id is not None:
            part = _text_part(text)
            item = _message_item(item_id, text, "completed")
            await send(
                {
                    "content_index": 0,
                    "item_id": item_id,
                    "logprobs": [],
                    "output_index": 0,
                    "text": text,
                    "type": "response.output_text.done",
                }
            )
            await send(
                {
                    "content_index": 0,
                    "item_id": item_id,
                    "output_index": 0,
                    "part": part,
                    "type": "response.content_part.done",
                }
            )
            await send({"item": item, "output_index": 0, "type": "response.output_item.done"})
            output.append(item)
        obj = self._finish_response(base, output, final, n_out)
        self._store(req, obj, messages)
        await send({"response": obj, "type": "response.completed"})
        await resp.write_eof()
        return resp

    async def retrieve_response(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        stored = self.responses.get(response_id)
        if stored is None:
            return self._not_found(response_id)
        return web.json_response(stored.response)

    async def cancel_response(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        stored = self.responses.get(response_id)
        if stored is None:
            return self._not_found(response_id)
        if stored.response["status"] in ("queued", "in_progress"):
            # A background response still running: cancelled, and its request aborted.
            stored.response["status"] = "cancelled"
            task = self._tasks.get(response_id)
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            return web.json_response(stored.response)
        return web.json_response(
            {
                "error": {
                    "message": "Cannot cancel a synchronous response.",
                    "type": "invalid_request_error",
                    "param": "response_id",
                    "code": 400,
                }
            },
            status=400,
        )

    # -- Anthropic Messages API ----------------------------------------------------------

    @staticmethod
    def _anthropic_error(exc: ApiError) -> web.Response:
        body = {"type": "error", "error": {"type": error_type(exc.status), "message": exc.message}}
        return web.json_response(body, status=exc.status)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        server = self.server
        req: MessagesRequest = validated(MessagesRequest, await read_json(request))
        try:
            model = server.check_model(req.model)
            chat, tools = anthropic_messages(req)
            prompt_text, prompt_ids = _render(chat, tools)
            max_tokens = bound_max_tokens(
                server.profile.max_model_len,
                len(prompt_ids),
                req.max_tokens,
                "max_tokens",
                "messages",
            )
            prep = server.prepared(request, req, "chat", model, prompt_text, prompt_ids, max_tokens)
            async with server.submitted(prep) as handle:
                if req.stream:
                    return await self._stream_message(request, prep, handle)
                ids, final = await run_to_end(self.server, request, prep, handle)
        except ApiError as exc:
            return self._anthropic_error(exc)
        return web.json_response(
            {
                "id": prep.public_id,
                "type": "message",
                "role": "assistant",
                "content": [{"type": "text", "text": tokenizer.decode(ids)}],
                "model": prep.model,
                "stop_reason": _stop_reason(final),
                "usage": self._anthropic_usage(final, len(ids)),
            }
        )

    async def _stream_message(
        self, request: web.Request, prep: Prepared, handle: RequestHandle
    ) -> web.StreamResponse:
        resp = await open_sse(request)

        async def send(event: dict[str, Any]) -> None:
            await resp.write(f"event: {event['type']}\ndata: {dumps(event)}\n\n".encode())

        if prep.drop_after == 0:
            self.server.drop(request, prep)
        started = block_open = False
        n_out = 0
        final: EngineEvent | None = None
        async for ids, end in self.server.batches(request, prep, handle):
            final = end
            n_out += len(ids)
            if not started:  # vLLM's first chat chunk, with the prompt's usage
                started = True
                message = {
                    "id": prep.public_id,
                    "type": "message",
                    "role": "assistant",
                    "content": [],
                    "model": prep.model,
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": len(prep.sim.prompt_token_ids), "output_tokens": 0},
                }
                await send({"type": "message_start", "message": message})
            delta = tokenizer.decode(ids)
            if not delta:
                continue
            if not block_open:
                block_open = True
                await send(
                    {
                        "type": "content_block_start",
                        "content_block": {"type": "text", "text": ""},
                        "index": 0,
                    }
                )
            await send(
                {
                    "type": "content_block_delta",
                    "delta": {"type": "text_delta", "text": delta},
                    "index": 0,
                }
            )
        assert final is not None  # noqa: S101
        if block_open:
            await send({"type": "content_block_stop", "index": 0})
        await send(
            {
                "type": "message_delta",
                "delta": {"stop_reason": _stop_reason(final), "stop_sequence": None},
                "usage": self._anthropic_usage(final, n_out),
            }
        )
        await send({"type": "message_stop"})
        await resp.write_eof()
        return resp

    async def count_tokens(self, request: web.Request) -> web.Response:
        req: CountTokensRequest = validated(CountTokensRequest, await read_json(request))
        try:
            self.server.check_model(req.model)
            chat, tools = anthropic_messages(req)
            n = len(_render(chat, tools)[1])
        except ApiError as exc:
            return self._anthropic_error(exc)
        return web.json_response(
            {"input_tokens": n, "context_management": {"original_input_tokens": n}}
        )

    def _anthropic_usage(self, final: EngineEvent, n_out: int) -> dict[str, int]:
        """vLLM's usage in Anthropic's terms: input_tokens leaves out the prompt tokens read
        from and written to the prefix cache."""
        cached, created = final.cached_tokens, self._cache_write(final)
        return {
            "input_tokens": max(0, final.prompt_tokens - cached - created),
            "output_tokens": final.completion_tokens or n_out,
            "cache_creation_input_tokens": created,
            "cache_read_input_tokens": cached,
        }

    # -- embeddings --------------------------------------------------------------------

    async def embeddings(self, request: web.Request) -> web.Response:
        server = self.server
        req: EmbeddingRequest = validated(EmbeddingRequest, await read_json(request))
        model = server.check_model(req.model)
        if req.dimensions is not None:
            raise ApiError(
                400,
                f'Model "{model}" does not support matryoshka representation, changing '
                "output dimensions will lead to poor results.",
                "dimensions",
            )
        inputs = input_items(req.input)
        if not inputs:
            raise ApiError(400, "input must not be empty", "input")
        limit = server.profile.max_model_len
        prompts = [input_prompt(item, limit, " for embedding generation") for item in inputs]
        embd_id = f"embd-{hex16()}"
        preps = await prefill_together(server, request, req, model, embd_id, prompts)
        data = []
        for i, p in enumerate(preps):
            vec = embedding_vector(p.sim.prompt_token_ids)
            emb: list[float] | str = vec
            if req.encoding_format == "base64":
                emb = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
            data.append({"index": i, "object": "embedding", "embedding": emb})
        n_prompt = sum(len(p.sim.prompt_token_ids) for p in preps)
        return list_answer(
            embd_id,
            model,
            data,
            {
                "prompt_tokens": n_prompt,
                "total_tokens": n_prompt,
                "completion_tokens": 0,
                "prompt_tokens_details": None,
            },
        )


def _text_part(text: str, logprobs: list[Any] | None = None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [_text_part(text)] if text and status == "completed" else []
    return {
        "id": item_id,
        "content": content,
        "role": "assistant",
        "status": status,
        "type": "message",
        "phase": None,
    }


_FUNCTION_TOOL_FIELDS = (
    "name",
    "parameters",
    "strict",
    "type",
    "allowed_callers",
    "async",
    "defer_loading",
    "description",
    "output_schema",
)


def _echo_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool as vLLM echoes it (the openai type's fields, unset ones null)."""
    if tool.get("type") != "function":
        return tool
    return {**{k: tool.get(k) for k in _FUNCTION_TOOL_FIELDS}, **tool}


def _stop_reason(final: EngineEvent) -> str:
    return "max_tokens" if final.finish_reason == "length" else "end_turn"
