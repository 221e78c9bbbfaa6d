"""Exact prompt token counts from local tokenizer files (optional).

When the config maps a model to a Hugging Face ``tokenizer.json`` (``tokenizers:`` in the
YAML), kvgate counts that model's prompt tokens exactly instead of estimating them from
characters. The file is read once at start-up; counting runs the Rust tokenizer (tens of
microseconds for a few thousand tokens). A ``tokenizer.json`` holds no chat template, so
for chat requests kvgate counts the text the template renders (messages, tool calls, tool
schemas) exactly and adds the admission config's per-message template overhead; such a
count is refused on only when that overhead guess cannot change the verdict, and a chat
request near a limit is still counted by a replica's tokenize endpoint, template included
(gateway/counting.py).

The ``tokenizers`` package is an optional dependency (``pip install 'kvgate[tokenizer]'``);
configuring a tokenizer without it is a configuration error that names the field.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from gateway.config import ConfigError

TokenCounter = Callable[[str], int]


def load_token_counters(files: Mapping[str, Path]) -> dict[str, TokenCounter]:
    """One counter per model from its tokenizer file. Raises ConfigError naming the field."""
    if not files:
        return {}
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - depends on the installation
        raise ConfigError(
            "invalid configuration:\n  tokenizers: the 'tokenizers' package is not installed "
            "(pip install 'kvgate[tokenizer]')"
        ) from None
    counters: dict[str, TokenCounter] = {}
    for model, path in files.items():
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises its own exception type
            raise ConfigError(
                f"invalid configuration:\n  tokenizers.{model}: cannot load {path}: {e}"
            ) from None

        def count(text: str, _tok: Tokenizer = tok) -> int:
            return len(_tok.encode(text, add_special_tokens=False))

        counters[model] = count
    return counters
