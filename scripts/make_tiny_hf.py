"""Write a tiny random-weight Llama as a Hugging Face model directory that vLLM serves.

No hub is reachable here, so everything is made locally: the weights are random (a fixed
seed), the tokenizer is a byte-level BPE trained with `tokenizers` on generated text, and
the chat template is ChatML (with tools listed in a system block). The model answers
gibberish, fast: it exists so that tests and benches can talk to a real vLLM.

    $KVGATE_VLLM_PYTHON scripts/make_tiny_hf.py --out DIR

Shape: 2 layers, hidden 128, 4 heads of 32 (4 KV heads), feed-forward 256, bfloat16, a
4,096-entry vocabulary, 4,096 positions. KV per token: 2 layers x (K + V) x 128 x 2 bytes
= 1 KiB, so `--kv-cache-memory-bytes` sets the pool in tokens almost exactly.
The output rows of the special tokens are zero and the others are scaled so ordinary
logits spread with a standard deviation of about 4: sampling practically never ends a reply
with end-of-sequence, so a reply runs to `max_tokens`.

`--brief` writes the same model with a 65,536-token context, except that every token's embedding carries a constant
`BRIEF_OFFSET` in its first dimension and end-of-sequence's output row reads that
dimension alone (`BRIEF_EOS_WEIGHT`): its logit is then about the same at every step,
whatever the context, and wins on about a third of them, so a reply ends after a few
tokens, as a coding agent needs its model's turns to end (Claude Code treats a reply cut
at `max_tokens` as an error).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM

SEED = 20261201
VOCAB_SIZE = 4096
HIDDEN = 128
LAYERS = 2
HEADS = 4
FFN = 256
MAX_POSITIONS = 4096
# The brief variant's context: the coding agents' prompts (Claude Code's is ~49k of this
# tokenizer's tokens). RoPE has no weights; vLLM sizes its rotary table by this.
BRIEF_MAX_POSITIONS = 65536
OUTPUT_LOGIT_STD = 4.0
# A constant first embedding dimension leaves the normed hidden state's first dimension
# at ~2.4 at every position (measured at 10 to 8,000 tokens of context), where the
# ordinary logits' log-sum-exp is ~15: 6 x 2.4 = 14.4 ends ~30% of the steps.
BRIEF_OFFSET = 0.2
BRIEF_EOS_WEIGHT = 6.0

EOS = "<|im_end|>"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", EOS]

# ChatML; tools (if any) go first as a system block with one JSON object a line.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "{{ call['function'] | tojson }}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS = (
    "the a of to and in is it that for on with as be by at this from or are not "
    "request token cache model replica queue server client stream context pool prefix "
    "admit shed retry latency prompt reply engine memory block batch decode prefill "
    "weather city unit function name type object string number array required "
    "def return import class self if else for while print value data list key"
).split()
_SYLLABLES = "ba de fi go hu ka le mo nu pi ra se ti vo wu xa ye zo an en in on un".split()


def corpus(rng: random.Random, n_lines: int = 8000) -> list[str]:
    """Prose, code-ish and JSON-ish lines, so all three tokenize into whole-word merges."""
    made_up = ["".join(rng.choices(_SYLLABLES, k=rng.randint(1, 4))) for _ in range(2000)]

    def word() -> str:
        r = rng.random()
        if r < 0.5:
            return rng.choice(_WORDS)
        if r < 0.92:
            return rng.choice(made_up)
        return str(rng.randint(0, 999))

    lines = []
    for _ in range(n_lines):
        kind = rng.random()
        if kind < 0.7:
            text = " ".join(word() for _ in range(rng.randint(4, 18)))
            lines.append(text.capitalize() + rng.choice(".?!."))
        elif kind < 0.85:
            lines.append(f"    {word()} = {word()}({word()}, {rng.randint(0, 99)})")
        else:
            lines.append(json.dumps({word(): word(), "type": rng.choice(_WORDS)}))
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


def write_tokenizer(out: Path, tok: Tokenizer, positions: int = MAX_POSITIONS) -> None:
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": positions,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"eos_token": EOS, "pad_token": "<|endoftext|>"}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def write_model(out: Path, tok: Tokenizer, seed: int, brief: bool = False) -> None:
    torch.manual_seed(seed)
    eos_id = tok.token_to_id(EOS)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=BRIEF_MAX_POSITIONS if brief else MAX_POSITIONS,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=tok.token_to_id("<|endoftext|>"),
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # RMS-normed hidden states have unit scale: this weight std gives logits of ~4.
        head = model.lm_head.weight
        head.normal_(0.0, OUTPUT_LOGIT_STD / HIDDEN**0.5)
        for special in SPECIAL_TOKENS:
            head[tok.token_to_id(special)] = 0.0
        if brief:
            model.model.embed_tokens.weight[:, 0] = BRIEF_OFFSET
            head[eos_id] = 0.0
            head[eos_id, 0] = BRIEF_EOS_WEIGHT
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--brief", action="store_true", help="replies end after a few tokens")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(args.seed)
    write_tokenizer(args.out, tok, BRIEF_MAX_POSITIONS if args.brief else MAX_POSITIONS)
    write_model(args.out, tok, args.seed, brief=args.brief)
    print(f"wrote {args.out} (vocabulary {tok.get_vocab_size()})")


if __name__ == "__main__":
    main()
