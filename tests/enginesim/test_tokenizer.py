"""The stand-in tokenizer: generated text re-encodes to the ids the engine generated."""

from __future__ import annotations

import random
import re

import pytest

from enginesim import tokenizer
from enginesim.workloads import _sentences

# The piece rule before whitespace runs gave their last space to a following word.
_PLAIN_PIECE = re.compile(r" ?[A-Za-z]{1,6}| ?\d{1,3}|\s+|[^\sA-Za-z\d]")


def _generate(seed: int, n: int, prev: int) -> list[int]:
    out = []
    for i in range(n):
        prev = tokenizer.next_generated(seed, i, prev)
        out.append(prev)
    return out


def test_every_vocabulary_entry_is_one_piece() -> None:
    for i, piece in enumerate(tokenizer.GEN_VOCAB):
        assert tokenizer.encode(piece) == [tokenizer.GEN_BASE + i], repr(piece)
        assert tokenizer.decode([tokenizer.GEN_BASE + i]) == piece


@pytest.mark.parametrize(
    "prompt",
    [
        tokenizer.apply_chat_template([{"role": "user", "content": "Say something."}]),
        "def add(a, b):",
        "The answer is",
        "Count: 1 2 3",
        "trailing space ",
        "two trailing spaces  ",
        "ends in a blank line\n\n",
        "indented\n    ",
        "x",
    ],
)
def test_generated_text_round_trips_after_any_prompt(prompt: str) -> None:
    head = tokenizer.encode(prompt)
    for seed in range(40):
        gen = _generate(seed * 7_777_777, 300, head[-1])
        assert tokenizer.encode(prompt + tokenizer.decode(gen)) == head + gen


def test_a_resent_chat_history_encodes_as_its_first_turn_plus_the_answer() -> None:
    turn1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]
    ids1 = tokenizer.encode(tokenizer.apply_chat_template(turn1))
    answer = _generate(12345, 80, ids1[-1])
    turn2 = [
        *turn1,
        {"role": "assistant", "content": tokenizer.decode(answer)},
        {"role": "user", "content": "And then?"},
    ]
    ids2 = tokenizer.encode(tokenizer.apply_chat_template(turn2))
    assert ids2[: len(ids1) + len(answer)] == ids1 + answer
    assert ids2[len(ids1) + len(answer)] == tokenizer.SPECIAL["<|end|>"]


def test_piece_counts_are_those_of_the_plain_whitespace_rule() -> None:
    rng = random.Random(3)
    texts = [s for s, _ in _sentences()[:200]]
    texts += ["a  b", "\n the", "x\n\n  y", "  (", "\t 42", "   word", " \n  12345 abcdefgh"]
    for _ in range(300):
        texts.append("".join(rng.choice([" ", "  ", "\n", "\t", "ab", "7", "(", "xyz"])
                             for _ in range(12)))  # fmt: skip
    for text in texts:
        assert len(tokenizer.encode(text)) == len(_PLAIN_PIECE.findall(text)), repr(text)


def test_no_whitespace_after_whitespace() -> None:
    space = {tokenizer.GEN_BASE + i for i, p in enumerate(tokenizer.GEN_VOCAB) if p.isspace()}
    assert space  # the vocabulary has newlines, for code-like output
    crc_id = tokenizer.encode("Hello")[0]  # not from the generation vocabulary
    for prev in (crc_id, *space):
        for seed in range(200):
            assert tokenizer.next_generated(seed, 0, prev) not in space
    gen = _generate(99, 5000, crc_id)
    assert any(t in space for t in gen)
    assert not any(a in space and b in space for a, b in zip(gen, gen[1:], strict=False))
