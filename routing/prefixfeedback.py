"""The approximate prefix index corrected by the engine's own answers (sans-IO).

The approximate index (routing.prefix) records what kvgate placed on a replica and
assumes its engine still holds it. The engine says what it held: each answer's
``usage.prompt_tokens_details.cached_tokens`` (vLLM with ``--enable-prompt-tokens-details``,
SGLang, llama.cpp, enginesim), which the relay reads and the gateway hands to routing
with the request's own characters per engine token.

At placement on a replica the approximate index matched, the prediction (blocks within
the index's horizon) and the clock stamps of the chain's blocks are kept. When the
answer comes, the engine's cached tokens are turned into index blocks (x characters per
token / ``block_chars``) and compared, with a slack of one engine block plus one index
block (an engine caches whole blocks; characters per token vary inside a prompt):

- fewer than predicted: the engine had evicted the first block it did not hit, so a
  block of that age is past what the replica keeps: the horizon moves toward that age;
- more than predicted, where the index held blocks the horizon had aged out: the engine
  keeps more than the horizon says: the horizon moves toward the age of the deepest
  block it held.

The answers also say how many characters an engine token of that replica's prompts
holds (the request's characters / its prompt tokens): `chars_per_token` per replica, a
running mean, turns the index's blocks of characters into the engine's tokens and
sizes the index from the pool, where a fixed guess (``chars_per_token``, 4) was far off
on the real vLLM's test prompts (docs/routing.md gives both).

Each move goes halfway (the first miss sets the horizon), so one odd answer (a
restart, another client's burst) does not decide alone. The chain itself is not cut
back to what hit: the request was just prefilled there, so its engine holds the whole
prompt again; what a miss teaches is how long that replica keeps blocks, which holds for
every chain on it. A replica whose engine publishes KV events is matched on those
(routing.kvindex) and is not corrected here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from routing.prefix import PrefixIndex

STEP = 0.5  # how far one answer moves the horizon toward what it shows
CPT_STEP = 0.25  # the weight of one answer in a replica's characters per token


@dataclass(slots=True)
class _Expected:
    replica: str
    clock: int  # the replica index's clock at placement
    stamps: list[int | None]  # each chain block's last touch then (None: not held)
    predicted: int  # leading blocks the index expected held (within the horizon)
    engine_block: int  # the replica's block size, in its tokens


class HitFeedback:
    """Predictions awaiting the engine's answer, and the horizon each answer teaches
    (module docstring)."""

    def __init__(self, indexes: Mapping[str, PrefixIndex], block_chars: int) -> None:
        self._indexes = indexes
        self.block_chars = block_chars
        self._expected: dict[str, _Expected] = {}
        # Characters per engine token of each replica's prompts, as its answers say.
        self.chars_per_token: dict[str, float] = {}
        # Answers that showed the index too far (misses) or too short (reaches).
        self.misses = self.reaches = self.answers = 0

    def __len__(self) -> int:
        return len(self._expected)

    def placed(
        self,
        request_id: str,
        replica: str,
        index: PrefixIndex,
        hashes: tuple[int, ...],
        predicted: int,
        engine_block: int,
    ) -> None:
        """A request was placed where the approximate index predicted `predicted` blocks
        (call before the index takes its chain). Until the replica's engine has answered
        once, only the replica is kept: its index stamps no blocks yet (routing.prefix)."""
        if not index.aging:
            self._expected[request_id] = _Expected(replica, 0, [], 0, 1)
            return
        self._expected[request_id] = _Expected(
            replica, index.clock, index.stamps(hashes), predicted, max(1, engine_block)
        )

    def forget(self, request_id: str) -> None:
        self._expected.pop(request_id, None)

    def answered(self, request_id: str, cached_tokens: int, chars_per_token: float) -> bool:
        """The engine held `cached_tokens` of the request's prompt; True when that moved
        the replica's horizon."""
        got = self._expected.pop(request_id, None)
        if got is None or chars_per_token <= 0:
            return False
        index = self._indexes.get(got.replica)
        if index is None:
            return False
        self.answers += 1
        cpt = self.chars_per_token.get(got.replica)
        self.chars_per_token[got.replica] = (
            chars_per_token if cpt is None else cpt + CPT_STEP * (chars_per_token - cpt)
        )
        if not index.aging:  # the first answer: from now on its blocks are stamped
            index.aging = True
            return False
        ages = []  # the ages at placement of the chain's leading blocks the index held
        for t in got.stamps:
            if t is None:
                break
            ages.append(got.clock - t)
        per_block = self.block_chars / chars_per_token  # engine tokens per index block
        held = int(max(0, cached_tokens) / per_block)
        slack = math.ceil(got.engine_block / per_block) + 1
        if held + slack < got.predicted and held < len(ages):
            self.misses += 1
            _move(index, ages[held])
            return True
        if held > got.predicted + slack and got.predicted < len(ages):
            self.reaches += 1
            _move(index, ages[min(held, len(ages)) - 1])
            return True
        return False


def _move(index: PrefixIndex, age: int) -> None:
    if index.horizon == math.inf:
        index.horizon = float(age)
    else:
        index.horizon += STEP * (age - index.horizon)
