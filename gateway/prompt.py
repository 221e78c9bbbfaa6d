"""What an engine counts in a chat prompt, measured without a tokenizer (pure, no IO).

A chat template renders more than the messages' text, and every part costs prompt
tokens:

- message text: a string content, or the text of its ``text`` (and ``refusal``) parts;
  ``tool`` role messages are text like any other;
- an assistant turn's ``tool_calls`` (and the legacy ``function_call``): the template
  writes each call's function name and JSON arguments, roughly as
  ``{"name": ..., "arguments": ...}``;
- the request's ``tools``: the schemas are rendered into the system prompt;
- per message, the template's role markers and separators (the admission config's
  ``per_message_overhead_tokens``, added by the estimator);
- image, audio and other non-text parts: the engine's encoder turns each into a number
  of tokens that depends on the model and the media (an image's resolution, a clip's
  length), which no character count describes. They are reserved at a fixed allowance
  per part (``counting.image_part_tokens``, ``counting.audio_part_tokens``), and such a
  prompt is marked not *countable*: its characters-to-tokens ratio says nothing about
  text, so it must not teach the estimator's learned chars-per-token.

`PromptShape.pieces` holds every text the template renders (message text, tool calls,
tool schemas) so that a tokenizer can count them exactly; `text` is only the messages'
text, which is what the workload classifier reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from gateway.schemas import ChatCompletionRequest

IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image", "image_embeds", "image_pil"})
AUDIO_PART_TYPES = frozenset({"input_audio", "audio_url", "audio"})


@dataclass(slots=True)
class PromptShape:
    text: str  # the messages' text, joined by newlines (for the classifier)
    pieces: list[str]  # every text the template renders: to count with a tokenizer
    chars: int  # characters the estimator counts
    messages: int
    images: int = 0
    audios: int = 0
    others: int = 0  # non-text parts of other kinds (video, files, unknown types)
    # The tools' schemas as rendered for counting ("" without tools): the engine's
    # template puts them in the prompt, so routing's prefix chain starts with them.
    tools_text: str = ""
    # The characters each message adds to `chars` (its text, refusals, tool calls): with
    # ``len(tools_text)`` they sum to `chars`. What a counted prefix leaves to estimate
    # (gateway/prefixcount.py) is the sum over the messages after it.
    message_chars: list[int] = field(default_factory=list)

    @property
    def countable(self) -> bool:
        """True when every part is text: then chars / tokens describes the model's text."""
        return not (self.images or self.audios or self.others)

    def media_tokens(self, image_part_tokens: int, audio_part_tokens: int) -> int:
        """The fixed allowance reserved for the non-text parts."""
        return (self.images + self.others) * image_part_tokens + self.audios * audio_part_tokens


def _call_text(fn: Any) -> str | None:
    """A function call as a template writes it: ``{"name": N, "arguments": A}``."""
    if not isinstance(fn, dict):
        return None
    name = fn.get("name")
    args = fn.get("arguments")
    if not isinstance(args, str):
        args = json.dumps(args, separators=(",", ":")) if args is not None else "{}"
    return f'{{"name": "{name if isinstance(name, str) else ""}", "arguments": {args}}}'


def chat_shape(req: ChatCompletionRequest) -> PromptShape:
    """Measure a chat request: its text, the extra text the template renders, its media."""
    texts: list[str] = []
    extra: list[str] = []
    images = audios = others = 0
    per_message: list[int] = []
    for m in req.messages:
        before = len(texts), len(extra)
        c = m.content
        if isinstance(c, str):
            texts.append(c)
        elif c:
            for p in c:
                t = p.get("text")
                kind = p.get("type")
                if isinstance(t, str):
                    texts.append(t)
                elif kind in IMAGE_PART_TYPES:
                    images += 1
                elif kind in AUDIO_PART_TYPES:
                    audios += 1
                elif kind == "refusal":
                    r = p.get("refusal")
                    if isinstance(r, str):
                        extra.append(r)
                elif kind != "text":
                    others += 1
        fields = m.model_extra
        if fields:
            calls = fields.get("tool_calls")
            if isinstance(calls, list):
                for call in calls:
                    if isinstance(call, dict) and (s := _call_text(call.get("function"))):
                        extra.append(s)
            if (s := _call_text(fields.get("function_call"))) is not None:
                extra.append(s)
        per_message.append(
            sum(len(t) for t in texts[before[0] :]) + sum(len(t) for t in extra[before[1] :])
        )
    tools = json.dumps(req.tools, separators=(",", ":")) if req.tools else ""
    if tools:
        extra.append(tools)
    text = "\n".join(texts)
    return PromptShape(
        text=text,
        pieces=[*texts, *extra],
        chars=len(text) + sum(len(s) for s in extra),
        messages=len(req.messages),
        images=images,
        audios=audios,
        others=others,
        tools_text=tools,
        message_chars=per_message,
    )
