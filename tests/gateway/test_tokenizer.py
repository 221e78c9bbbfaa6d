"""Exact prompt counts from a configured local tokenizer file.

The tokenizer here is a real Hugging Face ``tokenizers`` file built on the spot (a
word-level model over whitespace), so every whitespace-separated word is one token and
the expected counts are known exactly.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from admission.config import AdmissionConfig
from admission.learned.estimate import TokenEstimator
from gateway.config import ConfigError, config_from_mapping
from gateway.tokenizers import load_token_counters

from .conftest import MODEL


@pytest.fixture
def word_tokenizer(tmp_path: Path) -> Path:
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def test_counter_counts_with_the_file(word_tokenizer: Path) -> None:
    counters = load_token_counters({"m": word_tokenizer})
    assert counters["m"]("a b unknownword  b") == 4
    est = TokenEstimator(AdmissionConfig(per_message_overhead_tokens=8), tokenizer_for=counters.get)
    assert est.has_tokenizer("m") and not est.has_tokenizer("other")
    # Chat: the messages' text exactly, plus the template overhead per message.
    assert est.prompt_tokens_for_text("m", "a b c", messages=2) == 3 + 2 * 8
    # A model without a tokenizer falls back to the character estimate.
    assert est.prompt_tokens_for_text("other", "x" * 30, messages=0) == 10  # 30 / 3.0


def test_missing_or_broken_tokenizer_files_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tokenizers\.m: Path does not point to a file"):
        config_from_mapping({"tokenizers": {"m": str(tmp_path / "absent.json")}}, env={})
    broken = tmp_path / "broken.json"
    broken.write_text("{not a tokenizer")
    with pytest.raises(ConfigError, match=r"tokenizers\.m: cannot load"):
        load_token_counters({"m": broken})


async def test_exact_count_refuses_what_the_estimate_would_let_through(
    replica, gateway, word_tokenizer: Path
) -> None:
    """2,100 one-letter words: 4,200 characters, which the conservative character
    estimate (3 chars a token) puts at 1,400 tokens, inside the tiny profile's 2,048
    context; the tokenizer counts 2,100, so kvgate refuses at once with its own 400
    instead of passing the request to the engine to fail there."""
    srv = await replica()
    prompt = "a " * 2100
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    exact = await gateway(srv, tokenizers={MODEL: str(word_tokenizer)})
    # No tokenizer and no replica count (a long prompt is counted at the replica now).
    estimated = await gateway(srv, counting={"replica_tokenize": False})
    async with aiohttp.ClientSession() as s:
        async with s.post(exact.url + "/v1/completions", json=body) as r:
            err = (await r.json())["error"]
            assert r.status == 400
            assert err["code"] == "context_length_exceeded"
        # Without an exact count kvgate admits it and the engine itself rejects it.
        async with s.post(estimated.url + "/v1/completions", json=body) as r:
            err = (await r.json())["error"]
            assert r.status == 400
            # The engine's message (kvgate's own says "you requested N tokens"), with the
            # code a client acts on in place of the engine's numeric one.
            assert "input tokens" in err["message"]
            assert err["code"] == "context_length_exceeded"
