"""A deterministic stand-in tokenizer for the simulator.

Real engines tokenize with BPE; the simulator only needs token counts that behave like
BPE on English and code (about four characters a token), identical token ids for
identical text (so prefix caching works on shared prefixes), and generated tokens that
decode to readable text. Pieces are: an optional leading space followed by up to six
letters, up to three digits, or one other character; runs of whitespace are one piece.
Ids are a stable CRC32 of the piece, so they do not depend on process or hash seed.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable, Sequence

VOCAB_SIZE = 128_000
# Ids at or above GEN_BASE are generated tokens that decode through GEN_VOCAB.
GEN_BASE = 120_000
BOS_ID = 1
SPECIAL = {"<|begin|>": 1, "<|system|>": 2, "<|user|>": 3, "<|assistant|>": 4, "<|end|>": 5}

_PIECE = re.compile(r" ?[A-Za-z]{1,6}| ?\d{1,3}|\s+|[^\sA-Za-z\d]")
_SPECIAL_RE = re.compile("|".join(re.escape(s) for s in SPECIAL))

_CHAT_WORDS = (
    " the of and to in is that for it as with was on be by this are or from at an not "
    "which have has but can more will one all their there been if would about into also "
    "model request token cache memory batch server latency queue answer result value "
    "system user data time first each other when some could these them then than only"
).split(" ")
_CODE_WORDS = (
    " def return self if else for in range import from class None True False print "
    "( ) : , . = == + - [ ] { } \n \n     x i n len list dict key value result data"
).split(" ")
GEN_VOCAB: tuple[str, ...] = tuple(
    dict.fromkeys(
        [
            (" " + w) if w and not w.startswith((" ", "\n")) else w
            for w in _CHAT_WORDS + _CODE_WORDS
            if w
        ]
    )
)


def _piece_id(piece: str) -> int:
    # 256 low ids are reserved for special tokens.
    return 256 + zlib.crc32(piece.encode("utf-8")) % (GEN_BASE - 256)


def encode(text: str) -> list[int]:
    """Token ids of `text`; special markers such as <|user|> are single tokens."""
    out: list[int] = []
    pos = 0
    for m in _SPECIAL_RE.finditer(text):
        out.extend(_piece_id(p) for p in _PIECE.findall(text, pos, m.start()))
        out.append(SPECIAL[m.group(0)])
        pos = m.end()
    out.extend(_piece_id(p) for p in _PIECE.findall(text, pos))
    return out


def count_tokens(text: str) -> int:
    return len(encode(text))


def decode(token_ids: Iterable[int]) -> str:
    """Text of generated tokens (prompt ids are one-way hashes and decode to nothing)."""
    parts: list[str] = []
    for t in token_ids:
        if t >= GEN_BASE:
            parts.append(GEN_VOCAB[(t - GEN_BASE) % len(GEN_VOCAB)])
    return "".join(parts)


def gen_token(index: int) -> int:
    """The id of generated-vocabulary entry `index` (taken modulo the vocabulary)."""
    return GEN_BASE + index % len(GEN_VOCAB)


def apply_chat_template(messages: Sequence[dict]) -> str:
    """Render chat messages the way a chat template would, ending with the assistant cue."""
    parts = ["<|begin|>"]
    for msg in messages:
        role = str(msg.get("role", "user"))
        marker = {"system": "<|system|>", "assistant": "<|assistant|>"}.get(role, "<|user|>")
        content = msg.get("content", "")
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(
                str(p.get("text", ""))
                for p in content
                if isinstance(p, dict) and p.get("type") == "text"
            )
        parts.append(f"{marker}\n{content or ''}<|end|>\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)
