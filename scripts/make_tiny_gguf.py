"""Write a tiny Llama-architecture GGUF that llama.cpp's llama-server loads and serves.

Random weights (a fixed seed, so the file is the same on every machine), a byte-level BPE
tokenizer trained here on generated English-ish text, and a small chat template. The model
answers gibberish, fast: it exists so that tests can talk to a real engine, not to read
its words.

    .venv/bin/python scripts/make_tiny_gguf.py --out /tmp/tiny.gguf

With `--tokenizer-out` it also writes the same tokenizer as a Hugging Face `tokenizer.json`,
so a client can count tokens exactly as the engine does.

Shape: 2 layers, hidden 64, 4 query heads and 2 KV heads of 16, feed-forward 128, a
vocabulary of 4,096, trained context 4,096, all float32 (about 2.6 MB). The output rows of
the special tokens are zero, so their logits sit at 0 while ordinary tokens spread with a
standard deviation of about 4: sampling practically never ends a reply with end-of-sequence
and a reply runs to `max_tokens` (or to the context's end).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import gguf
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SEED = 20240611
N_LAYER = 2
N_EMBD = 64
N_HEAD = 4
N_HEAD_KV = 2
N_FF = 128
N_CTX_TRAIN = 4096
VOCAB_SIZE = 4096
OUTPUT_LOGIT_STD = 4.0

BOS = "<|bos|>"
EOS = "<|endoftext|>"  # a name llama.cpp counts as end-of-generation
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
SPECIAL_TOKENS = [BOS, EOS, *ROLE_TOKENS]

# One line per message: "<|role|>content<|end|>", then "<|assistant|>" to prompt a reply.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

_SYLLABLES = (
    "ka lo mi ra ne to su pe da vi ko ma li ro na te sa po de ri "
    "an el in or un as es is os us ar er ir ur al il ol ul en on"
).split()
_COMMON = (
    "the a an of to and in is it that for on with as was be by at this from or are "
    "request token cache model replica queue server client stream slot context pool "
    "admit shed retry latency prompt reply engine memory block batch decode prefill "
    "hello world please answer question time data value number first last next one two"
).split()


def corpus(rng: random.Random, n_sentences: int = 6000) -> list[str]:
    """English-ish sentences: common words, made-up words, digits and punctuation."""
    made_up = [
        "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(1500)
    ]
    lines = []
    for _ in range(n_sentences):
        words = []
        for _ in range(rng.randint(4, 16)):
            r = rng.random()
            if r < 0.55:
                words.append(rng.choice(_COMMON))
            elif r < 0.93:
                words.append(rng.choice(made_up))
            else:
                words.append(str(rng.randint(0, 9999)))
        sentence = " ".join(words)
        sentence = sentence[0].upper() + sentence[1:] + rng.choice([".", ".", ".", "?", "!"])
        if rng.random() < 0.2:
            sentence += ' "' + rng.choice(made_up) + '", ' + rng.choice(_COMMON) + "."
        lines.append(sentence)
    return lines


def train_tokenizer(seed: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(random.Random(seed)), trainer=trainer)
    return tok


def vocab_and_merges(tok: Tokenizer) -> tuple[list[str], list[str]]:
    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    for added in spec["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [""] * len(vocab)
    for text, idx in vocab.items():
        tokens[idx] = text
    if any(t == "" for t in tokens):
        raise SystemExit("token ids are not contiguous")
    # tokenizers < 0.20 writes merges as "a b", later versions as ["a", "b"].
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return tokens, merges


def write_gguf(out: Path, tok: Tokenizer, seed: int) -> None:
    tokens, merges = vocab_and_merges(tok)
    n_vocab = len(tokens)
    special_ids = [tokens.index(t) for t in SPECIAL_TOKENS]
    token_types = [
        gguf.TokenType.CONTROL if i in special_ids else gguf.TokenType.NORMAL
        for i in range(n_vocab)
    ]

    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name("kvgate tiny llama (random weights)")
    w.add_context_length(N_CTX_TRAIN)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index(BOS))
    w.add_eos_token_id(tokens.index(EOS))
    w.add_eot_token_id(tokens.index("<|end|>"))
    w.add_add_bos_token(False)  # the chat template writes it
    w.add_chat_template(CHAT_TEMPLATE)

    rng = np.random.default_rng(seed)

    def rand(*shape: int, scale: float) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    head_dim = N_EMBD // N_HEAD
    inv = 1.0 / np.sqrt(N_EMBD)
    w.add_tensor("token_embd.weight", rand(n_vocab, N_EMBD, scale=1.0))
    for i in range(N_LAYER):
        p = f"blk.{i}"
        w.add_tensor(f"{p}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        w.add_tensor(f"{p}.attn_q.weight", rand(N_HEAD * head_dim, N_EMBD, scale=inv))
        w.add_tensor(f"{p}.attn_k.weight", rand(N_HEAD_KV * head_dim, N_EMBD, scale=inv))
        w.add_tensor(f"{p}.attn_v.weight", rand(N_HEAD_KV * head_dim, N_EMBD, scale=inv))
        w.add_tensor(f"{p}.attn_output.weight", rand(N_EMBD, N_HEAD * head_dim, scale=inv))
        w.add_tensor(f"{p}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        w.add_tensor(f"{p}.ffn_gate.weight", rand(N_FF, N_EMBD, scale=inv))
        w.add_tensor(f"{p}.ffn_up.weight", rand(N_FF, N_EMBD, scale=inv))
        w.add_tensor(f"{p}.ffn_down.weight", rand(N_EMBD, N_FF, scale=1.0 / np.sqrt(N_FF)))
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    # After RMS norm the hidden state has unit RMS, so rows of std s/sqrt(n) give logits of std s.
    output = rand(n_vocab, N_EMBD, scale=OUTPUT_LOGIT_STD * inv)
    output[special_ids] = 0.0
    w.add_tensor("output.weight", output)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the .gguf file to write")
    ap.add_argument("--tokenizer-out", type=Path, help="also write the tokenizer.json here")
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args()
    tok = train_tokenizer(args.seed)
    write_gguf(args.out, tok, args.seed)
    if args.tokenizer_out:
        tok.save(str(args.tokenizer_out))
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
