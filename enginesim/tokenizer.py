"""A deterministic stand-in tokenizer for the simulator.

Real engines tokenize with BPE; the simulator only needs token counts that behave like
BPE on English and code (about four characters a token), identical token ids for
identical text (so prefix caching works on shared prefixes), and generated tokens that
decode to readable text. Pieces are: an optional leading space followed by up to six
letters, up to three digits, or one other character; runs of whitespace are one piece,
except that a run followed by a word gives its last space to the word (as GPT-2's
pre-tokenizer does), so "\n the" is "\n" + " the" and not "\n " + "the".
Ids are a stable CRC32 of the piece, so they do not depend on process or hash seed;
pieces of the generation vocabulary (`GEN_VOCAB`) have their own ids at `GEN_BASE` and up.

Generated text round-trips: `encode(prompt + decode(ids)) == encode(prompt) + ids` for
any ids `next_generated` produces after that prompt. This is what lets a chat client that
resends its history (the previous prompt, the assistant's answer, a new user turn) hit
the prefix-cache blocks the engine filled while it generated the answer, as it would on a
real engine whose tokenizer re-encodes its own output to the same ids. Two rules make it
hold: every vocabulary entry is exactly one piece, and `next_generated` never puts a
whitespace entry after whitespace (two runs would re-encode as one).
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

# The lazy whitespace alternative stops before " word" so the word keeps its space; it
# changes no piece count of the plain `\s+` rule, only where one run's last space goes.
_PIECE = re.compile(r" ?[A-Za-z]{1,6}| ?\d{1,3}|\s+?(?= [A-Za-z\d])|\s+|[^\sA-Za-z\d]")
_SPECIAL_RE = re.compile("|".join(re.escape(s) for s in SPECIAL))

# Words of at most six letters (one piece each with their leading space), single
# punctuation characters, a few numbers, and two whitespace entries for code-like output.
_WORDS = (
    "the of and to in is that for it as with was on be by this are or from at an not "
    "which have has but can more will one all their there been if would about into also "
    "model token cache memory batch server queue answer result value system user data "
    "time first each other when some could these them then than only "
    "def return self if else for in range import from class None True False print "
    "x i n len list dict key"
).split()
_PUNCT = list("():,.=+-[]{}")
_NUMBERS = ["0", "1", "2", "10", "42", "100"]
_SPACES = ["\n", "\n    "]
GEN_VOCAB: tuple[str, ...] = tuple(
    dict.fromkeys([" " + w for w in _WORDS] + _PUNCT + [" " + d for d in _NUMBERS] + _SPACES)
)
_GEN_ID = {piece: GEN_BASE + i for i, piece in enumerate(GEN_VOCAB)}
_GEN_SPACE = frozenset(i for i, piece in enumerate(GEN_VOCAB) if piece.isspace())


def _piece_id(piece: str) -> int:
    gen = _GEN_ID.get(piece)
    if gen is not None:
        return gen
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


def encode_pieces(text: str) -> list[tuple[int, str]]:
    """`encode(text)` with the text of each token (as llama.cpp's /tokenize `with_pieces`)."""
    out: list[tuple[int, str]] = []
    pos = 0
    for m in _SPECIAL_RE.finditer(text):
        out.extend((_piece_id(p), p) for p in _PIECE.findall(text, pos, m.start()))
        out.append((SPECIAL[m.group(0)], m.group(0)))
        pos = m.end()
    out.extend((_piece_id(p), p) for p in _PIECE.findall(text, pos))
    return out


def count_tokens(text: str) -> int:
    return len(encode(text))


def decode(token_ids: Iterable[int]) -> str:
    """Text of generation-vocabulary ids (other ids are one-way hashes: they decode to
    nothing)."""
    parts: list[str] = []
    for t in token_ids:
        if t >= GEN_BASE:
            parts.append(GEN_VOCAB[(t - GEN_BASE) % len(GEN_VOCAB)])
    return "".join(parts)


def gen_token(index: int) -> int:
    """The id of generated-vocabulary entry `index` (taken modulo the vocabulary)."""
    return GEN_BASE + index % len(GEN_VOCAB)


def next_generated(seed: int, index: int, prev: int) -> int:
    """Generated token `index` of the sequence `seed`, following token id `prev`.

    A fixed function of its arguments, so a request's output is reproducible. Whitespace
    is not allowed after whitespace, nor after a token that is not from the generation
    vocabulary (a prompt may end in any whitespace run), so the text re-encodes to the
    same ids (see the module docstring).
    """
    n = len(GEN_VOCAB)
    x = (seed ^ (index * 0x9E3779B1)) & 0xFFFFFFFF  # a cheap integer mix of both
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    i = (x ^ (x >> 13)) % n
    if i in _GEN_SPACE:
        p = prev - GEN_BASE
        if not 0 <= p < n or p in _GEN_SPACE:
            while i in _GEN_SPACE:
                i = (i + 1) % n
    return GEN_BASE + i


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
