"""Exact counts of conversation prefixes: a growing conversation estimates its tail only.

Agentic traffic resends its history. Turn N's messages are turn N-1's, then the reply
and a new user or tool message, after a system prompt and tools that many sessions
share. The engine counted turn N-1's whole prompt (its ``usage.prompt_tokens``), and
that count covers all of turn N except the tail, so only the tail needs an estimate.

Each chat request gets a digest chain, computed once (incremental BLAKE2b):
``chain[0]`` covers what the template renders besides the messages (the endpoint, the
tools, the template options), and ``chain[k]`` adds ``messages[:k]``, each message as
canonical JSON (sorted keys, so a client that rebuilds its history in another key
order still matches; a plain text message as its role and text, which is cheaper). `PrefixCounts` maps (model, ``chain[k]``) to the engine's count
of the prompt made of ``messages[:k]``, generation prompt included. It learns from:

- the engine's usage, once a completion comes back (`PrefixCount.learn`, called by the
  account stage): the exact count of the whole prompt, at no extra cost;
- a replica's tokenize answer, when the counter asked one (gateway/counting.py).

A request then takes its longest counted prefix (`PrefixCounts.lookup`). When it covers
every message, the count is exact (the engine's own count of this very prompt) and
admission may refuse on it. Otherwise the prompt is the prefix's count plus the
estimate of the messages after it: not exact, but its error is bounded by the tail's.
The prefix's count includes its generation prompt, which the tail's next assistant
message renders again, so the sum leans high by a few tokens, never low.

Only prompts a client sent are counted, never a prefix on its own: a template may render
a prefix alone differently from the same messages inside a longer prompt (Llama 3.1 puts
the tools in the first user message, and a system prompt without one renders them
nowhere or fails), so a count asked for a bare prefix could be low, and a low count
under-reserves. The count of the whole prompt a client sent covers every later turn that
extends it, at no cost. Hence no background counts: a session's first turn, counted
inline when long, is the one tokenize call it costs (gateway/counting.py's rule).

Not chained: prompts with media parts (their tokens depend on the media, not the JSON),
and a Responses request that continues a stored response (``previous_response_id``:
the engine prepends history the request does not carry).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

from gateway.schemas import ChatCompletionRequest

_CANON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _canon(obj: Any) -> bytes:
    return _CANON.encode(obj).encode("utf-8", "surrogatepass")


def _message_bytes(m: dict[str, Any]) -> bytes:
    """A message as bytes that differ whenever the message does: a plain text message
    (role and string content only, most of a conversation's bytes) without a JSON
    encoder; any other as canonical JSON (it starts with ``{``, never with a digit)."""
    content = m.get("content")
    if len(m) == 2 and type(content) is str and type(role := m.get("role")) is str:
        return f"{len(role)}:{role}{content}".encode("utf-8", "surrogatepass")
    return _canon(m)


def prompt_chain(
    parsed: ChatCompletionRequest, kind: str, fields: Iterable[str]
) -> list[bytes] | None:
    """The digest chain of a chat request (`chain[k]` covers ``messages[:k]``), or None
    when prefix counts cannot describe it (a continued stored response)."""
    if getattr(parsed, "previous_response_id", None):
        return None
    body = parsed.template_body
    head: dict[str, Any] = {"kind": kind, "tools": body.get("tools")}
    for k in fields:
        if k in body:
            head[k] = body[k]
    h = hashlib.blake2b(_canon(head), digest_size=16)
    chain = [h.digest()]
    for m in parsed.messages:
        h.update(b"\x1e")
        h.update(_message_bytes(m.model_extra))
        chain.append(h.digest())  # digest() leaves the state as it was: the chain goes on
    return chain


class Lru:
    """A bounded least-recently-used map."""

    __slots__ = ("_data", "_size")

    def __init__(self, size: int) -> None:
        self._data: OrderedDict[Hashable, Any] = OrderedDict()
        self._size = size

    def get(self, key: Hashable) -> Any:
        value = self._data.get(key)
        if value is not None:
            self._data.move_to_end(key)
        return value

    def put(self, key: Hashable, value: Any) -> None:
        if self._size <= 0:
            return
        self._data[key] = value
        self._data.move_to_end(key)
        if len(self._data) > self._size:
            self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)


@dataclass(slots=True)
class PrefixCount:
    """What the counted prefixes say of one chat request's prompt (on its context)."""

    store: PrefixCounts
    model: str
    chain: list[bytes]
    counted: int = 0  # messages the longest counted prefix covers (0: none)
    tokens: int = 0  # the engine's count of that prefix
    # The messages after the prefix, for the estimate of the tail (and what teaches it).
    tail_chars: int = 0
    tail_messages: int = 0

    @property
    def whole(self) -> bool:
        """The count covers every message: it is the engine's count of this prompt."""
        return self.counted == len(self.chain) - 1

    def learn(self, tokens: int) -> None:
        """The engine's count of the whole prompt (its usage, or a tokenize answer)."""
        if tokens > 0:
            self.store.put(self.model, self.chain[-1], tokens)


class PrefixCounts:
    """Engine counts of prompts per (model, digest of tools and messages[:k]), bounded."""

    def __init__(self, size: int) -> None:
        self._lru = Lru(size)

    def put(self, model: str, digest: bytes, tokens: int) -> None:
        self._lru.put((model, digest), tokens)

    def get(self, model: str, digest: bytes) -> int | None:
        return self._lru.get((model, digest))

    def lookup(self, model: str, chain: list[bytes], message_chars: list[int]) -> PrefixCount:
        """The longest counted prefix of a chain (``counted`` 0 when none) and the
        characters and messages it leaves to estimate."""
        p = PrefixCount(self, model, chain)
        n = len(chain) - 1
        for k in range(n, 0, -1):
            tokens = self._lru.get((model, chain[k]))
            if tokens is not None:
                p.counted, p.tokens = k, tokens
                break
        tail = message_chars[p.counted :]
        p.tail_chars = sum(tail) + len(tail)  # each message's text, a separator each
        p.tail_messages = n - p.counted
        return p

    def __len__(self) -> int:
        return len(self._lru)
