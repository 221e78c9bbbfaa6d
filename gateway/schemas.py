"""Request bodies of the OpenAI surface kvgate fronts: what kvgate reads, checked by hand.

Only the fields admission needs are read and checked, strictly (a string where a number
belongs is a 400, not a silent coercion): ``model``, ``stream``, ``stream_options``,
``max_tokens`` / ``max_completion_tokens``, ``n``, the messages' ``role`` and
``content`` (the text to count), ``tools``, the completions ``prompt``. Everything else
is left alone and passed to the engine untouched: engines accept many fields OpenAI does
not (vLLM's ``priority``, ``top_k``, ``ignore_eos``, ``min_tokens``...), and a gateway
that dropped them would silently change what the engine does.

Why not pydantic models of the body: validating every message into a model costs more
than the rest of kvgate's own work on a request together (bench/results/profile_*.txt),
and kvgate never serialises these objects (it forwards the client's bytes), so the
readers below wrap the parsed dict and check only the fields above, in one pass, with
errors that name the field (`BodyError`, answered as a 400 OpenAI error object).
"""

from __future__ import annotations

import json
from email import policy as email_policy
from email.parser import BytesParser
from typing import Any

# Far above any context window served today, low enough that arithmetic on it is safe.
# Between a model's real limit and this, admission answers context_length_exceeded.
MAX_TOKENS_CEILING = 1 << 24


class BodyError(ValueError):
    """A field kvgate reads is missing or of the wrong type. ``param`` names the
    top-level field (OpenAI's ``param``); the message gives the full location."""

    def __init__(self, loc: str, msg: str) -> None:
        super().__init__(f"{loc}: {msg}")
        self.message = f"{loc}: {msg}"
        self.param = loc.split(".", 1)[0]


def _max_tokens(body: dict[str, Any], key: str) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if type(v) is not int:  # bool is an int subclass: true is not a token count
        raise BodyError(key, "Input should be a valid integer")
    if not 1 <= v <= MAX_TOKENS_CEILING:
        raise BodyError(key, f"Input should be between 1 and {MAX_TOKENS_CEILING}")
    return v


def _message_list(body: dict[str, Any]) -> list[Any]:
    """The body's non-empty ``messages`` list (chat's and Anthropic's)."""
    msgs = body.get("messages")
    if type(msgs) is not list:
        raise BodyError(
            "messages", "Field required" if msgs is None else "Input should be a valid list"
        )
    if not msgs:
        raise BodyError("messages", "List should have at least 1 item after validation")
    return msgs


class ChatMessage:
    """One message: its ``role`` and ``content`` checked; the rest in ``model_extra``
    (the message dict itself: ``tool_calls``, ``function_call``... are read from it)."""

    __slots__ = ("role", "content", "model_extra")

    def __init__(self, raw: Any, i: int) -> None:
        if not isinstance(raw, dict):
            raise BodyError(f"messages.{i}", "Input should be a valid dictionary")
        role = raw.get("role")
        if type(role) is not str:
            raise BodyError(
                f"messages.{i}.role",
                "Field required" if role is None else "Input should be a valid string",
            )
        content = raw.get("content")
        if content is not None and type(content) is not str:
            if type(content) is not list or not all(type(p) is dict for p in content):
                raise BodyError(
                    f"messages.{i}.content",
                    "Input should be a string, a list of content parts (objects) or null",
                )
        self.role: str = role
        # A string, or OpenAI content parts ({"type": "text", "text": ...}, images...).
        self.content: str | list[dict[str, Any]] | None = content
        self.model_extra: dict[str, Any] = raw


class _Common:
    """The fields of both endpoints. Build with the constructor (or `model_validate`)."""

    __slots__ = ("body", "model", "stream", "stream_options", "max_tokens", "n")

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        model = body.get("model")
        if type(model) is not str or not model:
            raise BodyError(
                "model",
                "Field required" if model is None else "Input should be a non-empty string",
            )
        self.model: str = model
        stream = body.get("stream", False)
        if type(stream) is not bool:
            raise BodyError("stream", "Input should be a valid boolean")
        self.stream: bool = stream
        opts = body.get("stream_options")
        if opts is not None:
            if type(opts) is not dict:
                raise BodyError("stream_options", "Input should be a valid dictionary")
            inc = opts.get("include_usage")
            if inc is not None and type(inc) is not bool:
                raise BodyError("stream_options.include_usage", "Input should be a valid boolean")
        self.stream_options: dict[str, Any] | None = opts
        self.max_tokens = _max_tokens(body, "max_tokens")
        # kvgate reserves KV for one sequence per request; n > 1 multiplies the need in
        # ways the engine may or may not share (prefix), so it is refused, not guessed.
        n = body.get("n")
        if n is not None and (type(n) is not int or n != 1):
            raise BodyError("n", "Input should be 1")
        self.n: int | None = n

    # The name pydantic gave it, kept for callers and tests written against the models.
    @classmethod
    def model_validate(cls, body: Any) -> Any:
        if not isinstance(body, dict):
            raise BodyError("body", "Input should be a valid dictionary")
        return cls(body)

    @property
    def wants_usage(self) -> bool:
        opts = self.stream_options
        return bool(opts and opts.get("include_usage"))

    @property
    def bounds_output(self) -> bool:
        """The client set an output bound (otherwise an engine such as llama.cpp may
        generate until the context is full, whatever the API's documented default)."""
        return self.max_tokens is not None

    @property
    def output_bound(self) -> int | None:
        """The client's output bound (each endpoint reads its own fields)."""
        raise NotImplementedError

    @property
    def output_floor(self) -> int:
        """Output tokens the request will generate at least, by what it asks the engine
        (vLLM's and SGLang's extensions): all of its bound with ``ignore_eos``, else its
        ``min_tokens``; 0 when it says nothing. History cannot shorten these."""
        body = self.body
        bound = self.output_bound
        if body.get("ignore_eos") is True and bound is not None:
            return bound
        floor = body.get("min_tokens")
        if type(floor) is int and floor > 0:
            return floor if bound is None else min(floor, bound)
        return 0


class ChatCompletionRequest(_Common):
    __slots__ = ("messages", "max_completion_tokens", "tools")

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(body)
        self.messages = [ChatMessage(m, i) for i, m in enumerate(_message_list(body))]
        self.max_completion_tokens = _max_tokens(body, "max_completion_tokens")
        tools = body.get("tools")
        if tools is not None and (
            type(tools) is not list or not all(type(t) is dict for t in tools)
        ):
            raise BodyError("tools", "Input should be a list of objects")
        self.tools: list[dict[str, Any]] | None = tools

    @property
    def bounds_output(self) -> bool:
        return self.max_tokens is not None or self.max_completion_tokens is not None

    @property
    def template_body(self) -> dict[str, Any]:
        """The chat request the engine's template renders (for its tokenize endpoint)."""
        return self.body

    @property
    def output_bound(self) -> int | None:
        """The client's output bound; OpenAI's newer name wins when both are given."""
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


def _is_ints(v: list[Any]) -> bool:
    return all(type(x) is int for x in v)


class CompletionRequest(_Common):
    """A completions prompt: text, or token ids. Batches (lists of several prompts) are
    read (`batch_size`) and refused by the pipeline: each would need its own reservation."""

    __slots__ = ("prompt",)

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(body)
        p: Any = body.get("prompt")  # JSON: the checks below give its type
        ok = type(p) is str or (
            type(p) is list
            and (
                all(type(x) is str for x in p)
                or _is_ints(p)
                or all(type(x) is list and _is_ints(x) for x in p)
            )
        )
        if not ok:
            raise BodyError(
                "prompt",
                "Field required"
                if p is None
                else "Input should be a string, a list of strings, a list of token ids "
                "or a list of lists of token ids",
            )
        self.prompt: str | list[str] | list[int] | list[list[int]] = p

    @property
    def output_bound(self) -> int | None:
        # The legacy completions API defaults to 16 tokens when max_tokens is absent.
        return self.max_tokens if self.max_tokens is not None else 16

    def prompt_parts(self) -> tuple[str, int | None]:
        """(text, exact token count if the prompt is token ids else None)."""
        p = self.prompt
        if isinstance(p, str):
            return p, None
        if not p:
            return "", 0
        first = p[0]
        if isinstance(first, str):
            return first, None
        if isinstance(first, int):
            return "", len(p)
        return "", len(first)

    def batch_size(self) -> int:
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return 1
        return len(p)


# ---------------------------------------------------------------------- the agents' APIs
# The Responses API (the Codex CLI's) and Anthropic's Messages API (Claude Code's) are
# read as the chat request the engine turns them into (vLLM renders both through the
# model's chat template): the same prompt to count, classify and route on. The client's
# body is still what the engine gets, byte for byte.


def _str_or_none(body: dict[str, Any], key: str) -> str | None:
    v = body.get(key)
    if v is not None and type(v) is not str:
        raise BodyError(key, "Input should be a valid string")
    return v


def _json_text(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))


def _function_tool(name: Any, description: Any, parameters: Any) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name if isinstance(name, str) else ""}
    if isinstance(description, str):
        fn["description"] = description
    if isinstance(parameters, dict):
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


def _tool_list(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if type(tools) is not list or not all(type(t) is dict for t in tools):
        raise BodyError("tools", "Input should be a list of objects")
    return tools


def _responses_parts(content: Any, loc: str) -> str | list[dict[str, Any]]:
    """A Responses message's content as chat content: text parts as ``text``, images as
    ``input_image`` (counted by allowance), anything else kept by its type."""
    if type(content) is str:
        return content
    if type(content) is not list or not all(type(p) is dict for p in content):
        raise BodyError(loc, "Input should be a string or a list of content parts (objects)")
    parts: list[dict[str, Any]] = []
    for p in content:
        kind = p.get("type")
        text = p.get("text")
        if kind in ("input_text", "output_text", "text") and isinstance(text, str):
            parts.append({"type": "text", "text": text})
        elif kind == "refusal" and isinstance(p.get("refusal"), str):
            parts.append({"type": "text", "text": p["refusal"]})
        else:
            parts.append({"type": kind if isinstance(kind, str) else "unknown"})
    return parts


def _responses_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The Responses API's ``instructions`` and ``input`` as chat messages."""
    out: list[dict[str, Any]] = []
    instructions = _str_or_none(body, "instructions")
    if instructions:
        out.append({"role": "system", "content": instructions})
    items = body.get("input")
    if type(items) is str:
        out.append({"role": "user", "content": items})
        return out
    if type(items) is not list:
        raise BodyError(
            "input",
            "Field required" if items is None else "Input should be a string or a list of items",
        )
    for i, item in enumerate(items):
        loc = f"input.{i}"
        if type(item) is not dict:
            raise BodyError(loc, "Input should be a valid dictionary")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if type(role) is not str:
                raise BodyError(
                    f"{loc}.role",
                    "Field required" if role is None else "Input should be a valid string",
                )
            out.append({"role": "system" if role == "developer" else role,
                        "content": _responses_parts(item.get("content", ""), f"{loc}.content")})  # fmt: skip
        elif kind == "function_call":
            call = {"id": str(item.get("call_id", "")), "type": "function",
                    "function": {"name": item.get("name", ""), "arguments": _json_text(item.get("arguments", "{}"))}}  # fmt: skip
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                        "content": output if isinstance(output, str) else _responses_parts(output, f"{loc}.output")})  # fmt: skip
        elif kind == "reasoning":
            texts = [t for p in (item.get("summary") or []) + (item.get("content") or [])
                     if isinstance(p, dict) and isinstance(t := p.get("text"), str)]  # fmt: skip
            if texts:
                out.append({"role": "assistant", "content": "\n".join(texts)})
        else:  # built-in tools' items (web search, MCP...): their JSON is what the model reads
            out.append({"role": "assistant", "content": json.dumps(item, separators=(",", ":"))})
    if not out:
        raise BodyError("input", "List should have at least 1 item after validation")
    return out


class ResponsesRequest(ChatCompletionRequest):
    """``POST /v1/responses``: ``input`` (a string or items), ``instructions``,
    ``max_output_tokens``, ``tools`` (flat function tools), ``previous_response_id`` (a
    stored response the engine continues from), ``prompt_cache_key`` (routing's
    session)."""

    __slots__ = ("chat_body", "previous_response_id", "session_key")

    def __init__(self, body: dict[str, Any]) -> None:
        max_out = _max_tokens(body, "max_output_tokens")
        tools = _tool_list(body)
        chat: dict[str, Any] = {"model": body.get("model"), "stream": body.get("stream", False),
                                "messages": _responses_messages(body)}  # fmt: skip
        if max_out is not None:
            chat["max_completion_tokens"] = max_out
        if tools:
            chat["tools"] = [
                _function_tool(t.get("name"), t.get("description"), t.get("parameters"))
                for t in tools
                if t.get("type", "function") == "function"
            ] or None
        super().__init__(chat)
        self.body = body
        self.chat_body = chat  # what the engine's chat template renders (for /tokenize)
        self.previous_response_id = _str_or_none(body, "previous_response_id")
        self.session_key = _str_or_none(body, "prompt_cache_key")

    @property
    def template_body(self) -> dict[str, Any]:
        return self.chat_body

    @property
    def wants_usage(self) -> bool:
        return True  # the Responses API reports usage on every answer


def _anthropic_blocks(
    content: Any, loc: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """One Anthropic message's content: (chat content parts, tool calls, tool results as
    chat ``tool`` messages)."""
    if type(content) is str:
        return [{"type": "text", "text": content}], [], []
    if type(content) is not list or not all(type(b) is dict for b in content):
        raise BodyError(loc, "Input should be a string or a list of content blocks (objects)")
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for b in content:
        kind = b.get("type")
        if kind == "text" and isinstance(b.get("text"), str):
            parts.append({"type": "text", "text": b["text"]})
        elif kind == "thinking" and isinstance(b.get("thinking"), str):
            parts.append({"type": "text", "text": b["thinking"]})
        elif kind == "tool_use":
            calls.append({"id": str(b.get("id", "")), "type": "function",
                          "function": {"name": b.get("name", ""), "arguments": _json_text(b.get("input", {}))}})  # fmt: skip
        elif kind == "tool_result":
            inner = b.get("content", "")
            body = inner if isinstance(inner, str) else _anthropic_blocks(inner, loc)[0]
            results.append(
                {"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")), "content": body}
            )
        elif kind == "redacted_thinking":
            continue
        else:  # image, document...: counted by allowance
            parts.append({"type": kind if isinstance(kind, str) else "unknown"})
    return parts, calls, results


class MessagesRequest(ChatCompletionRequest):
    """``POST /v1/messages`` (Anthropic): ``system``, ``messages`` of content blocks,
    ``max_tokens`` (required, as Anthropic requires it), ``tools`` with
    ``input_schema``, ``metadata.user_id`` (routing's session)."""

    __slots__ = ("chat_body", "session_key")

    def __init__(self, body: dict[str, Any]) -> None:
        if body.get("max_tokens") is None:
            raise BodyError("max_tokens", "Field required")
        msgs = _message_list(body)
        chat_msgs: list[dict[str, Any]] = []
        system = body.get("system")
        if system is not None:
            if type(system) is str:
                if system:
                    chat_msgs.append({"role": "system", "content": system})
            else:
                parts = _anthropic_blocks(system, "system")[0]
                if parts:
                    chat_msgs.append({"role": "system", "content": parts})
        for i, m in enumerate(msgs):
            loc = f"messages.{i}"
            if type(m) is not dict:
                raise BodyError(loc, "Input should be a valid dictionary")
            role = m.get("role")
            if type(role) is not str:  # its value is the engine's to judge
                raise BodyError(
                    f"{loc}.role",
                    "Field required" if role is None else "Input should be a valid string",
                )
            parts, calls, results = _anthropic_blocks(m.get("content"), f"{loc}.content")
            chat_msgs.extend(results)  # a user turn's tool results come first, as vLLM renders
            if parts or calls:
                msg: dict[str, Any] = {"role": role, "content": parts or None}
                if calls:
                    msg["tool_calls"] = calls
                chat_msgs.append(msg)
        chat: dict[str, Any] = {"model": body.get("model"), "stream": body.get("stream", False),
                                "messages": chat_msgs, "max_tokens": body.get("max_tokens")}  # fmt: skip
        tools = _tool_list(body)
        if tools:
            chat["tools"] = [
                _function_tool(t.get("name"), t.get("description"), t.get("input_schema"))
                for t in tools
            ]
        super().__init__(chat)
        self.body = body
        self.chat_body = chat
        meta = body.get("metadata")
        user = meta.get("user_id") if isinstance(meta, dict) else None
        self.session_key = user if isinstance(user, str) and user else None

    @property
    def template_body(self) -> dict[str, Any]:
        return self.chat_body

    @property
    def wants_usage(self) -> bool:
        return True  # message_start and message_delta carry usage


# ---------------------------------------------------------------------- pooling
# Fields of the pooling endpoints (embeddings, rerank, score, classify, pooling) that
# hold what the model reads: texts, or token ids.
_POOLING_FIELDS = ("input", "query", "documents", "text_1", "text_2", "queries", "items", "data")


def _pooled(v: Any, texts: list[str]) -> int:
    """Collect the texts in `v` into `texts`; returns the token ids found."""
    if type(v) is str:
        texts.append(v)
        return 0
    if type(v) is list:
        if v and _is_ints(v):
            return len(v)
        return sum(_pooled(x, texts) for x in v)
    if type(v) is dict:  # a document or content part: {"text": ...}, {"type": "text"...}
        t = v.get("text", v.get("content"))
        return _pooled(t, texts) if t is not None else 0
    return 0


class PoolingRequest(_Common):
    """``/v1/embeddings``, ``/v1/rerank``, ``/v1/score``, ``/classify``, ``/pooling``:
    every input of the body is prefilled and nothing is generated, so the request
    reserves its prompt (all inputs together: the engine runs a batch's inputs at once)
    and no output."""

    __slots__ = ("texts", "ids")

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(body)
        if body.get("stream") is True:
            raise BodyError("stream", "Pooling endpoints do not stream")
        texts: list[str] = []
        ids = 0
        found = False
        for key in _POOLING_FIELDS:
            if key in body:
                found = True
                ids += _pooled(body[key], texts)
        if not found:
            raise BodyError("input", "Field required")
        self.texts = texts
        self.ids = ids

    @property
    def output_bound(self) -> int | None:
        return 0

    @property
    def bounds_output(self) -> bool:
        return True

    @property
    def wants_usage(self) -> bool:
        return True

    def prompt_parts(self) -> tuple[str, int | None]:
        """(the texts, joined; the exact count when the inputs are all token ids)."""
        return "\n".join(self.texts), (self.ids if not self.texts else None)


# ---------------------------------------------------------------------- audio
AUDIO_FILE = "file"  # the multipart field that carries the audio


def audio_form(raw: bytes, content_type: str) -> dict[str, Any]:
    """The fields of a ``multipart/form-data`` body (``/v1/audio/transcriptions`` and
    ``/translations``): text fields as strings, the file as its size in bytes (kvgate
    never keeps audio). Raises `BodyError` on a body that is not such a form."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise BodyError("file", "The body must be multipart/form-data with the audio file")
    msg = BytesParser(policy=email_policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + raw
    )
    if not msg.is_multipart():
        raise BodyError("file", "The body must be multipart/form-data with the audio file")
    fields: dict[str, Any] = {}
    for part in msg.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not isinstance(name, str):
            continue
        payload = part.get_payload(decode=True)
        data = payload if isinstance(payload, bytes) else b""
        if name == AUDIO_FILE:
            fields[name] = len(data)
        else:
            fields[name] = data.decode("utf-8", "replace")
    return fields


class AudioRequest(_Common):
    """``/v1/audio/transcriptions`` and ``/v1/audio/translations``: the form's ``model``,
    ``stream`` ("true"/"false"), ``max_completion_tokens``; the audio is reserved at the
    counting allowance for an audio part (its tokens depend on the model's encoder, which
    no byte count describes)."""

    __slots__ = ("audio_bytes",)

    def __init__(self, fields: dict[str, Any]) -> None:
        form = dict(fields)
        if AUDIO_FILE not in form:
            raise BodyError(AUDIO_FILE, "Field required")
        stream = form.get("stream", "false")
        if stream not in ("true", "false", "True", "False", True, False):
            raise BodyError("stream", "Input should be a valid boolean")
        form["stream"] = stream in ("true", "True", True)
        bound = form.pop("max_completion_tokens", None)
        if bound is not None:
            if not str(bound).isdigit():
                raise BodyError("max_completion_tokens", "Input should be a valid integer")
            form["max_tokens"] = int(bound)
        super().__init__(form)
        self.audio_bytes: int = form[AUDIO_FILE]

    @property
    def output_bound(self) -> int | None:
        return self.max_tokens

    @property
    def wants_usage(self) -> bool:
        return True  # the form is forwarded as sent: nothing is added to it


# A parsed body of any admitted endpoint (gateway/endpoints.py's SCHEMAS; the Responses and
# Messages APIs are ChatCompletionRequests).
ParsedRequest = ChatCompletionRequest | CompletionRequest | PoolingRequest | AudioRequest
