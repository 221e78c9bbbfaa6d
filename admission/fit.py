"""The fit rules, once: what a request needs of a replica's context and pool, and whether
it can ever fit there. The ledger reserves by them (`admission.replica`) and the gateway's
prompt counter decides by them whether a count must be exact (`gateway.counting`), so a
request the counter lets through is one admission can place, and the other way round.

The reasons for each rule (an engine that preempts against one that does not, private
slots): the module docstring of `admission.replica`, and docs/admission.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A margin reserves at most ten times the size: a headroom configured near 1 must not
# reserve without end.
_MOST_MARGIN = 0.9


@dataclass(frozen=True, slots=True)
class FitLimits:
    """What one replica can ever hold, as admission sees it."""

    max_model_len: int | None
    pool: int | None  # the effective pool in tokens (None: not known yet)
    block_size: int = 16
    preempts: bool = True  # vLLM and SGLang preempt; llama.cpp does not
    private_slots: bool = False  # llama.cpp per-slot KV: a slot cannot overrun the pool
    margin: float = 0.0  # share of an estimated reservation kept for its error (headroom)


def round_up(tokens: int, block_size: int) -> int:
    """`tokens` rounded up to a whole number of `block_size` blocks."""
    bs = max(1, block_size)
    return -(-max(0, tokens) // bs) * bs


def sized_exactly(
    prompt_exact: bool, expected_output: int, max_tokens: int, max_tokens_given: bool
) -> bool:
    """A reservation of ``prompt + expected_output`` bounds the request: its prompt was
    counted exactly and its whole ``max_tokens`` is reserved. Anything else rests on an
    estimate and keeps a margin (`reservation`), which the gateway learns from such
    requests' misses (`admission.learned.margin`)."""
    return prompt_exact and max_tokens_given and expected_output >= max_tokens


def reservation(
    lim: FitLimits,
    prompt: int,
    expected_output: int,
    max_tokens: int,
    max_tokens_given: bool,
    prompt_exact: bool = True,
    margin: float | None = None,
) -> int:
    """The tokens a request holds in the replica's pool: ``prompt + expected_output`` on an
    engine that preempts (an under-estimate is a slowdown there); on one that does not,
    what it may use: ``prompt + max_tokens`` within the context, the whole context when no
    ``max_tokens`` was given, and never more than a shared pool (alone it cannot overrun it).

    A size that rests on an estimate (a prompt counted from its characters, an output
    reserved below its bound) is grown by ``1 / (1 - margin)``: what the pool keeps for
    estimates that fall short (`margin`, learned: `admission.learned.margin`; None: the replica's
    configured headroom). A size known to bound the request (an exact prompt and its
    whole ``max_tokens``) keeps none: margin kept there is pool left idle."""
    bs = max(1, lim.block_size)
    prompt = max(1, prompt)
    if lim.preempts:
        raw = prompt + max(0, expected_output)
        exact = sized_exactly(prompt_exact, expected_output, max_tokens, max_tokens_given)
        return round_up(_with_margin(lim, raw, exact, margin), bs)
    most = prompt + max(1, max_tokens) if max_tokens_given else None
    if lim.max_model_len is not None:
        most = lim.max_model_len if most is None else min(most, lim.max_model_len)
    bounded = most is not None
    if most is None:  # nothing bounds the output here: the best estimate there is
        most = prompt + max(0, expected_output)
    tokens = round_up(_with_margin(lim, most, prompt_exact and bounded, margin), bs)
    if lim.pool is not None and not lim.private_slots:
        whole = lim.pool // bs * bs
        if whole >= bs:
            tokens = min(tokens, whole)
    return tokens


def _with_margin(lim: FitLimits, tokens: int, exact: bool, margin: float | None) -> int:
    share = lim.margin if margin is None else margin
    if exact or share <= 0.0 or lim.private_slots:
        return tokens
    return math.ceil(tokens / (1.0 - min(share, _MOST_MARGIN)))


def context_needed(preempts: bool, prompt: int, max_tokens: int) -> int:
    """What a request needs of the context: prompt + max_tokens, which vLLM and SGLang
    refuse when over it; llama.cpp refuses only a prompt that leaves no room to generate
    and stops the rest at the context's end (finish reason ``length``)."""
    return prompt + max_tokens if preempts else prompt + 1


def can_ever_fit(lim: FitLimits, prompt: int, max_tokens: int, tokens: int) -> bool:
    """A request of `prompt` and `max_tokens` that reserves `tokens` (`reservation`) fits
    the replica's context and, alone, its pool (True while the pool is unknown)."""
    if (
        lim.max_model_len is not None
        and context_needed(lim.preempts, prompt, max_tokens) > lim.max_model_len
    ):
        return False
    return lim.pool is None or tokens <= lim.pool
