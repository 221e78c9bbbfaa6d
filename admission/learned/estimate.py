"""Per-model token estimators learned online (sans-IO).

The gateway must size a request's KV reservation *before* the engine tokenizes it, so it
estimates prompt tokens from characters and output tokens from history. Both estimates
err on the side of reserving too much: an over-estimate costs some idle pool, an
under-estimate is what pushes an engine over its cliff (preemption and recompute).

* Prompt: ``tokens = ceil(chars / cpt) + messages * overhead``, where ``cpt`` (characters
  per token) starts low (``initial_chars_per_token``) and is learned from the engine's
  ``usage.prompt_tokens`` as a *low* quantile (``PROMPT_QUANTILE``) of observed ratios.
  The learned value may fall at once (more conservative) but rises by at most
  ``MAX_CHARS_PER_TOKEN_GROWTH`` per observation, so one batch of unusually dense text
  cannot make it optimistic.
* Output: the ``output_quantile`` (p90 by default) of recent completion lengths, never
  more than the request's ``max_tokens`` or the context left. Until enough completions
  were seen the full ``max_tokens`` (or ``default_output_tokens``) is reserved; the
  gateway tops the reservation up if a stream outgrows it.

An exact tokenizer can be plugged in per model (``tokenizer_for``); it is then used by
`prompt_tokens_for_text` instead of the character heuristic.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable

from admission.config import AdmissionConfig
from admission.learned.margin import EstimateMargin

# Recent observations kept per model (prompt ratios, completion lengths, estimate misses):
# enough that a tenth or nine-tenths quantile is not one observation's, few enough that
# traffic that changed ages out.
ESTIMATOR_WINDOW = 1000
# Prompts seen before the learned chars per token replaces the initial one: a single
# prompt's ratio is its own text's, not the model's traffic's.
MIN_PROMPT_SAMPLES = 5
# The low quantile of observed chars per token that is used: low counts more tokens, and
# over-reserving costs idle pool where under-reserving preempts (above).
PROMPT_QUANTILE = 0.1
# The learned chars per token rises by at most this share per observation (it falls at
# once): one batch of dense text cannot make the estimate optimistic.
MAX_CHARS_PER_TOKEN_GROWTH = 0.1
# Completions seen before their quantile replaces max_tokens: over fewer, the default
# 90th percentile is the largest or the second largest.
MIN_OUTPUT_SAMPLES = 20

TokenCounter = Callable[[str], int]
TokenizerLookup = Callable[[str], TokenCounter | None]


class SortedWindow:
    """The last `size` samples, kept both in arrival order and sorted (O(n) memmove updates)."""

    __slots__ = ("_order", "_sorted", "_size")

    def __init__(self, size: int) -> None:
        self._order: deque[float] = deque()
        self._sorted: list[float] = []
        self._size = size

    def add(self, value: float) -> None:
        if len(self._order) >= self._size:
            old = self._order.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._order.append(value)
        bisect.insort(self._sorted, value)

    def __len__(self) -> int:
        return len(self._sorted)

    def quantile(self, q: float) -> float:
        """Nearest-rank quantile (an observed value, never interpolated below the data)."""
        n = len(self._sorted)
        idx = min(n - 1, max(0, math.ceil(q * n) - 1))
        return self._sorted[idx]


class _ModelStats:
    __slots__ = ("chars_per_token", "prompt_ratios", "outputs", "output_q", "short")

    def __init__(self, config: AdmissionConfig) -> None:
        self.chars_per_token = config.initial_chars_per_token
        self.prompt_ratios = SortedWindow(ESTIMATOR_WINDOW)
        self.outputs = SortedWindow(ESTIMATOR_WINDOW)
        self.output_q: int | None = None  # cached learned quantile
        self.short = EstimateMargin(ESTIMATOR_WINDOW)


class TokenEstimator:
    """Conservative, per-model prompt and output token estimates, learned from usage."""

    def __init__(
        self, config: AdmissionConfig, *, tokenizer_for: TokenizerLookup | None = None
    ) -> None:
        self._config = config
        self._models: dict[str, _ModelStats] = {}
        self._tokenizer_for = tokenizer_for

    def _stats(self, model: str) -> _ModelStats:
        stats = self._models.get(model)
        if stats is None:
            stats = self._models[model] = _ModelStats(self._config)
        return stats

    # ----------------------------------------------------------------- prompt
    def chars_per_token(self, model: str) -> float:
        """The chars-per-token currently used for `model` (low means conservative)."""
        stats = self._models.get(model)
        return stats.chars_per_token if stats else self._config.initial_chars_per_token

    def prompt_tokens(self, model: str, chars: int, messages: int = 1) -> int:
        """Estimated prompt tokens of `chars` characters in `messages` chat messages."""
        cpt = self.chars_per_token(model)
        overhead = max(0, messages) * self._config.per_message_overhead_tokens
        return max(1, math.ceil(max(0, chars) / cpt) + overhead)

    def has_tokenizer(self, model: str) -> bool:
        return self._tokenizer_for is not None and self._tokenizer_for(model) is not None

    def prompt_tokens_for_text(self, model: str, text: str, messages: int = 1) -> int:
        """Exact count when a tokenizer is configured for `model` (plus the chat template's
        per-message overhead, which a tokenizer file does not describe), else the estimate."""
        if self._tokenizer_for is not None:
            counter = self._tokenizer_for(model)
            if counter is not None:
                overhead = max(0, messages) * self._config.per_message_overhead_tokens
                return max(1, counter(text) + overhead)
        return self.prompt_tokens(model, len(text), messages)

    def observe_prompt(self, model: str, chars: int, messages: int, actual_tokens: int) -> None:
        """Learn from the engine's ``usage.prompt_tokens`` for a prompt of `chars` characters."""
        if chars <= 0 or actual_tokens <= 0:
            return
        cfg = self._config
        content_tokens = max(1, actual_tokens - max(0, messages) * cfg.per_message_overhead_tokens)
        stats = self._stats(model)
        stats.prompt_ratios.add(chars / content_tokens)
        if len(stats.prompt_ratios) < MIN_PROMPT_SAMPLES:
            return
        target = stats.prompt_ratios.quantile(PROMPT_QUANTILE)
        if target <= stats.chars_per_token:
            stats.chars_per_token = target  # more conservative: adopt at once
        else:
            stats.chars_per_token = min(
                target, stats.chars_per_token * (1.0 + MAX_CHARS_PER_TOKEN_GROWTH)
            )

    def most_chars_per_token(self, model: str) -> float | None:
        """The most characters per token seen in the model's recent prompts (None before
        ``MIN_PROMPT_SAMPLES``): what bounds the tokens a stretch of text holds from
        below, where `prompt_tokens` bounds them from above."""
        stats = self._models.get(model)
        if stats is None or len(stats.prompt_ratios) < MIN_PROMPT_SAMPLES:
            return None
        return stats.prompt_ratios.quantile(1.0)

    # ----------------------------------------------------------------- output
    def learned_output(self, model: str) -> int | None:
        """The learned completion-length quantile, or None before enough samples."""
        stats = self._models.get(model)
        return stats.output_q if stats else None

    def expected_output(
        self, model: str, max_tokens: int | None, limit: int, floor: int = 0
    ) -> int:
        """Output tokens to reserve: min(max_tokens or limit, learned quantile), at least 1
        and at least `floor` (within `limit`).

        `limit` is the most the request could generate (context left after the prompt).
        Before enough completions were observed: `max_tokens`, or `default_output_tokens`
        when the client gave none, capped by `limit`. `floor`: what the request will
        generate whatever history says (``ignore_eos``: its bound; ``min_tokens``), for a
        request that cannot be topped up as it grows (a non-stream one).
        """
        bound = limit if max_tokens is None else min(max_tokens, limit)
        learned = self.learned_output(model)
        if learned is None:
            guess = max_tokens if max_tokens is not None else self._config.default_output_tokens
            expected = max(1, min(guess, limit))
        else:
            expected = max(1, min(bound, learned))
        return max(expected, min(floor, limit))

    def observe_output(self, model: str, completion_tokens: int) -> None:
        """Learn from the engine's ``usage.completion_tokens``."""
        if completion_tokens < 0:
            return
        stats = self._stats(model)
        stats.outputs.add(float(completion_tokens))
        if len(stats.outputs) >= MIN_OUTPUT_SAMPLES:
            stats.output_q = max(1, math.ceil(stats.outputs.quantile(self._config.output_quantile)))

    # ----------------------------------------------------------------- margin
    def observe_estimated(self, model: str, reserved: int, used: int) -> None:
        """A completed request whose reservation rested on an estimate: it reserved
        `reserved` tokens (prompt and output, before any margin) and used `used`."""
        self._stats(model).short.observe(reserved, used)

    def margin(self, model: str) -> float:
        """The share an estimated reservation of `model` keeps beyond its size
        (`admission.learned.margin`); the configured headroom until learned."""
        stats = self._models.get(model)
        cold = self._config.headroom
        return cold if stats is None else stats.short.margin(cold)
