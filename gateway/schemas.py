"""Request bodies of the OpenAI surface kvgate fronts, validated with pydantic v2.

Only the fields admission needs are declared and checked strictly (a string where a
number belongs is a 400, not a silent coercion). Everything else is allowed and passed
to the engine untouched (``extra="allow"``): engines accept many fields OpenAI does not
(vLLM's ``priority``, ``top_k``, ``ignore_eos``, ``min_tokens``...), and a gateway that
dropped them would silently change what the engine does.

kvgate forwards the client's original bytes for non-streamed requests, so these models
are validators and readers, never serialisers.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

# Far above any context window served today, low enough that arithmetic on it is safe.
# Between a model's real limit and this, admission answers context_length_exceeded.
MAX_TOKENS_CEILING = 1 << 24

MaxTokens = Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_CEILING)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: StrictBool | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: StrictStr
    # A string, or OpenAI content parts ({"type": "text", "text": ...}, images...).
    content: StrictStr | list[dict[str, Any]] | None = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Annotated[StrictStr, Field(min_length=1)]
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: MaxTokens | None = None
    # kvgate reserves KV for one sequence per request; n > 1 multiplies the need in ways
    # the engine may or may not share (prefix), so it is refused rather than guessed.
    n: Literal[1] | None = None

    @property
    def wants_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def bounds_output(self) -> bool:
        """The client set an output bound (otherwise an engine such as llama.cpp may
        generate until the context is full, whatever the API's documented default)."""
        return self.max_tokens is not None


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    tools: list[dict[str, Any]] | None = None

    @property
    def bounds_output(self) -> bool:
        return self.max_tokens is not None or self.max_completion_tokens is not None

    @property
    def output_bound(self) -> int | None:
        """The client's output bound; OpenAI's newer name wins when both are given."""
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def prompt_text(self) -> str:
        """The text content of the messages, for character-based token estimation and
        workload classification (never logged)."""
        parts: list[str] = []
        for m in self.messages:
            c = m.content
            if isinstance(c, str):
                parts.append(c)
            elif c:
                for p in c:
                    t = p.get("text")
                    if isinstance(t, str):
                        parts.append(t)
        return "\n".join(parts)


# A completions prompt: text, or token ids. Batches (lists of several prompts) are
# refused: each would need its own reservation.
Prompt = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(_Common):
    prompt: Prompt

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
