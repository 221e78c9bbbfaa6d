"""Synthetic request sets with documented length distributions.

`seed2_workload` reproduces the shape of seed 001's bring-up job: 738 "production-shaped
requests (large prompts, small structured JSON outputs)". The seed gives no lengths, so
we choose and document them:

* a shared instruction prefix (system message: an extraction brief plus a JSON schema,
  ~340 tokens), identical in every request, so a prefix cache can share it;
* a unique document per request (user message): lognormal token length (`DOC_MEDIAN`
  2,000, `DOC_SIGMA` 0.35, clipped to [600, 5,000]: mean ~2,120, p90 ~3,130). Each
  document opens with a unique header, so prefix-cache sharing stops at the instruction
  prefix;
* an output of a small JSON object: lognormal (`OUT_MEDIAN` 70 tokens, `OUT_SIGMA` 0.4,
  clipped to [24, 200]: a few dozen to a couple of hundred tokens).

Prompts are rendered through `tokenizer.apply_chat_template`, and token ids are exactly
`tokenizer.encode(prompt_text)` (tested), built from pre-encoded sentences so 738 items
take well under a second.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from functools import lru_cache

from enginesim import tokenizer
from enginesim.types import Workload

_WORDS = (
    "account agreement amount annual applicant approval asset balance billing branch "
    "budget carrier claim client clause company contract coverage customer date deadline "
    "delivery department deposit document employee entity estimate expense facility fee "
    "filing fiscal freight identifier income insurance inventory invoice issuer item "
    "lease ledger liability license location manager margin market member merchant "
    "method notice obligation office order owner party payment period policy premium "
    "price product project property provider purchase quantity quarter rate receipt "
    "record region renewal report request revenue schedule section seller service "
    "shipment signature status subtotal supplier tax tenant term total transaction unit "
    "vendor warranty weight"
).split()
_VERBS = (
    "covers lists states confirms requires includes describes records specifies shows "
    "notes reports defines mentions references updates replaces extends"
).split()
_JOIN = "the a this each every that our their its any".split()

INSTRUCTION = (
    "You are a document extraction service. Read the document in the user message and "
    "return one JSON object and nothing else. Do not add commentary, markdown fences or "
    "explanations. Use null for fields that the document does not state. Dates use the "
    "ISO format YYYY-MM-DD. Amounts are numbers without currency symbols; put the "
    "currency code in the currency field. Names are copied exactly as written. "
    "The object has these fields: document_type (one of invoice, contract, claim, "
    "report, order, notice), document_id, issue_date, due_date, parties (a list of "
    "objects with name, role and identifier), currency, subtotal, tax, total, "
    "line_items (a list of objects with description, quantity, unit_price and amount), "
    "payment_terms, governing_law, renewal (an object with automatic, notice_days and "
    "term_months), obligations (a list of short strings, at most five), risk_flags (a "
    "list of short strings naming unusual clauses, at most three), and confidence (a "
    "number from 0 to 1 for the extraction as a whole). If the document contains several "
    "candidate values for a field, choose the one in the most recent section and list "
    "the conflict in risk_flags. Keep every string under two hundred characters. "
    "Return valid JSON that parses without errors; the output is read by a program."
)
TASK_SUFFIX = "\n\nExtract the fields and return the JSON object."

DOC_MEDIAN, DOC_SIGMA, DOC_MIN, DOC_MAX = 2000, 0.35, 600, 5000
OUT_MEDIAN, OUT_SIGMA, OUT_MIN, OUT_MAX = 70, 0.4, 24, 200


@dataclass(slots=True)
class WorkItem:
    request_id: str
    messages: list[dict]
    prompt_text: str
    prompt_token_ids: list[int]
    output_tokens: int
    workload: Workload


@lru_cache(maxsize=1)
def _sentences() -> tuple[tuple[str, tuple[int, ...]], ...]:
    """A fixed bank of sentences, each with its token ids (encoded once per process)."""
    rng = random.Random(0x5EED)
    out = []
    for _ in range(4000):
        n = rng.randint(6, 16)
        words = []
        for j in range(n):
            if j % 4 == 1:
                words.append(rng.choice(_VERBS))
            elif j % 4 == 2:
                words.append(rng.choice(_JOIN))
            else:
                words.append(rng.choice(_WORDS))
        if rng.random() < 0.5:
            words.append(str(rng.randint(1, 99999)))
        text = " " + " ".join(words).capitalize() + "."
        out.append((text, tuple(tokenizer.encode(text))))
    return tuple(out)


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(median * math.exp(sigma * rng.gauss(0.0, 1.0))))))


def _split_template(messages: list[dict], doc_marker: str) -> tuple[str, str]:
    text = tokenizer.apply_chat_template(messages)
    head, tail = text.split(doc_marker, 1)
    return head, tail


def seed2_workload(n: int = 738, seed: int = 0) -> list[WorkItem]:
    """Seed 001's production-shaped job: large prompts, small structured JSON outputs."""
    rng = random.Random(seed)
    bank = _sentences()
    marker = "\x00DOC\x00"
    head, tail = _split_template(
        [
            {"role": "system", "content": INSTRUCTION},
            {"role": "user", "content": marker + TASK_SUFFIX},
        ],
        marker,
    )
    head_ids = tokenizer.encode(head)
    tail_ids = tokenizer.encode(tail)
    items: list[WorkItem] = []
    for i in range(n):
        target = _lognormal(rng, DOC_MEDIAN, DOC_SIGMA, DOC_MIN, DOC_MAX)
        header = f"Document {seed}-{i:05d} reference {rng.randint(10**6, 10**7 - 1)}:"
        parts = [header]
        ids = tokenizer.encode(header)
        while len(ids) < target:
            text, sids = bank[rng.randrange(len(bank))]
            parts.append(text)
            ids.extend(sids)
        doc = "".join(parts)
        messages = [
            {"role": "system", "content": INSTRUCTION},
            {"role": "user", "content": doc + TASK_SUFFIX},
        ]
        items.append(
            WorkItem(
                request_id=f"seed2-{seed}-{i:05d}",
                messages=messages,
                prompt_text=head + doc + tail,
                prompt_token_ids=head_ids + ids + tail_ids,
                output_tokens=_lognormal(rng, OUT_MEDIAN, OUT_SIGMA, OUT_MIN, OUT_MAX),
                workload=Workload.CHAT,
            )
        )
    return items


def synthetic_items(
    n: int,
    prompt_tokens: int,
    output_tokens: int,
    workload: Workload = Workload.CHAT,
    prefix: str = "item",
) -> list[WorkItem]:
    """`n` items with unique prompts of exactly `prompt_tokens` tokens (for measurements)."""
    bank = _sentences()
    items = []
    for i in range(n):
        header = f"Request {prefix}-{i:06d}:"
        ids = tokenizer.encode(header)
        parts = [header]
        j = i * 7
        while len(ids) < prompt_tokens:
            text, sids = bank[j % len(bank)]
            parts.append(text)
            ids.extend(sids)
            j += 1
        ids = ids[:prompt_tokens]
        text = "".join(parts)
        items.append(
            WorkItem(
                f"{prefix}-{i:06d}",
                [{"role": "user", "content": text}],
                text,
                ids,
                output_tokens,
                workload,
            )
        )
    return items
