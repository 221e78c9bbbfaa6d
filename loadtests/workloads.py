"""What the Locust users send: length distributions, synthetic prompts, prompt files.

No Locust here (importing Locust monkey-patches the process with gevent), so these
pieces are tested and reused anywhere. Client side only: nothing below knows the
engine's tokenizer. Token counts of synthetic text are estimated the way BPE behaves on
English and code, about four characters a token (`estimate_tokens`); the engine's own
count comes back in ``usage.prompt_tokens`` and is what the sweep reports.

Four workloads, one per Locust user class:

- ``chat``: a short system prompt and one user message of prose.
- ``coding``: a code file in a fence and an instruction to change it.
- ``agentic``: multi-turn sessions on a large system prompt and tool schema shared by
  every session (the prefix a prefix cache can keep warm); each turn resends the history
  with the assistant's answer, a tool call and the tool's result appended.
- ``batch-json``: seed 001's shape: a shared extraction instruction, a unique document
  (lognormal, median 2,000 tokens, sigma 0.35, clipped to 600-5,000) and a small JSON
  answer (lognormal, median 70, sigma 0.4, clipped to 24-200).

A JSONL prompt file replaces the synthetic prompts of every class: the seed warns that
synthetic short prompts tell a comfortable lie, because they under-consume exactly the
resource that runs out.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------------------
# Length distributions
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Dist:
    """A token-length distribution, written ``fixed:N``, ``uniform:LO,HI`` or
    ``lognormal:MEDIAN,SIGMA[,LO,HI]`` (clipped to [LO, HI])."""

    kind: str
    a: float
    b: float = 0.0
    lo: int = 1
    hi: int = 1_000_000

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        x = self.a * math.exp(self.b * rng.gauss(0.0, 1.0))
        return int(min(self.hi, max(self.lo, round(x))))

    @property
    def median(self) -> float:
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        return float(self.a)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{int(self.a)}"
        if self.kind == "uniform":
            return f"uniform:{int(self.a)},{int(self.b)}"
        return f"lognormal:{self.a:g},{self.b:g},{self.lo},{self.hi}"

    @classmethod
    def parse(cls, spec: str) -> Dist:
        kind, _, rest = spec.strip().partition(":")
        try:
            nums = [float(x) for x in rest.split(",")] if rest else []
        except ValueError:
            raise ValueError(f"{spec!r}: the numbers after {kind}: do not parse") from None
        if kind == "fixed" and len(nums) == 1 and nums[0] >= 1:
            return cls("fixed", nums[0])
        if kind == "uniform" and len(nums) == 2 and 1 <= nums[0] <= nums[1]:
            return cls("uniform", nums[0], nums[1])
        if kind == "lognormal" and len(nums) in (2, 4) and nums[0] >= 1 and nums[1] >= 0:
            lo, hi = (int(nums[2]), int(nums[3])) if len(nums) == 4 else (1, 1_000_000)
            if 1 <= lo <= hi:
                return cls("lognormal", nums[0], nums[1], lo, hi)
        raise ValueError(
            f"{spec!r}: expected fixed:N, uniform:LO,HI or lognormal:MEDIAN,SIGMA[,LO,HI] "
            "with positive token counts"
        )


# --------------------------------------------------------------------------------------
# Synthetic text
# --------------------------------------------------------------------------------------

# A word of up to six letters, a number of up to three digits, a run of whitespace or one
# other character: about one BPE token each on English and code.
_PIECE = re.compile(r" ?[A-Za-z]{1,6}| ?\d{1,3}|\s+|[^\sA-Za-z\d]")


def estimate_tokens(text: str) -> int:
    """Tokens `text` costs, estimated as BPE behaves (about four characters a token)."""
    return len(_PIECE.findall(text))


_WORDS = (
    "account amount annual asset balance billing branch budget carrier claim client "
    "clause coverage date delivery deposit entity fee filing fiscal freight income "
    "issuer item lease ledger margin market member method notice office order owner "
    "party period policy price rate record region report seller status tax tenant term "
    "total unit vendor weight model cache memory batch server queue answer result value "
    "system user data time river forest window garden market summer winter number "
    "letter paper story travel health energy light sound water stone metal glass"
).split()
_VERBS = "covers lists states shows notes defines updates keeps sends holds reads takes".split()
_JOIN = "the a this each every that our their its any".split()


def prose(rng: random.Random, tokens: int, header: str = "") -> str:
    """About `tokens` tokens of sentences, after `header` (which makes the text unique,
    so a prefix cache shares nothing past it)."""
    parts = [header] if header else []
    used = estimate_tokens(header)
    while used < tokens:
        n = rng.randint(6, 14)
        words = [
            rng.choice(_VERBS if j % 4 == 1 else _JOIN if j % 4 == 2 else _WORDS) for j in range(n)
        ]
        if rng.random() < 0.3:
            words.append(str(rng.randint(1, 999)))
        sentence = " " + " ".join(words).capitalize() + "."
        parts.append(sentence)
        used += estimate_tokens(sentence)
    return "".join(parts).strip()


_IDENT = "data item value result index count total buffer cache queue node key size limit".split()
_CODE_LINES = (
    "def {a}_{b}({c}, {d}):",
    "    {a} = {c}.get({d}, None)",
    "    if {a} is None:",
    "        return {b}",
    "    for {c} in range(len({d})):",
    "        {a}[{c}] += {b} * {n}",
    "    {b} = [{c} for {c} in {d} if {c} > {n}]",
    "    return {a}, {b}",
    "class {A}{B}:",
    "    def __init__(self, {c}):",
    "        self.{a} = {c}",
    "        self.{b} = {{}}",
    "    total = sum({a}.{b} for {a} in {c})",
    "    raise ValueError(f'{a} {{ {c} }} out of range')",
    "",
)


def code(rng: random.Random, tokens: int, header: str = "") -> str:
    """About `tokens` tokens of Python-looking source, after a `header` comment line."""
    lines = [f"# {header}"] if header else []
    used = estimate_tokens(lines[0]) if lines else 0
    while used < tokens:
        a, b, c, d = (rng.choice(_IDENT) for _ in range(4))
        line = rng.choice(_CODE_LINES).format(
            a=a, b=b, c=c, d=d, A=a.capitalize(), B=b.capitalize(), n=rng.randint(0, 99)
        )
        lines.append(line)
        used += estimate_tokens(line) + 1
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------


@dataclass(slots=True)
class RequestSpec:
    """One chat completion to send: the messages, its output length, optional tools."""

    messages: list[dict[str, Any]]
    max_tokens: int
    tools: list[dict[str, Any]] | None = None

    def body(self, model: str, *, ignore_eos: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "messages": self.messages,
            "max_tokens": self.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.tools:
            body["tools"] = self.tools
        if ignore_eos:  # vLLM / SGLang / enginesim: generate exactly max_tokens
            body["ignore_eos"] = True
        return body


@dataclass(slots=True)
class LoadConfig:
    """What every user of a run shares. Times are wall seconds of this client.

    `prompt_tokens` / `output_tokens` override each workload's own distributions;
    `prompt_file` replaces its synthetic prompts.
    """

    model: str | None = None
    timeout_s: float = 60.0  # the SDK's read timeout: to the first byte and between chunks
    connect_timeout_s: float = 10.0
    max_retries: int = 2  # the openai SDK's default
    api_key: str | None = None
    prompt_tokens: Dist | None = None
    output_tokens: Dist | None = None
    prompt_file: str | None = None
    ignore_eos: bool = True
    system_tokens: int = 3000  # agentic: the shared system prompt (tool schema on top)
    turns: Dist = field(default_factory=lambda: Dist("uniform", 3, 8))
    max_context: int = 8192  # agentic: a session ends before its history outgrows this
    seed: int | None = None


class Workload:
    """Makes one user's requests. `answered` is told what the model said."""

    name = ""
    prompt = Dist("fixed", 512)
    output = Dist("fixed", 128)

    def __init__(self, cfg: LoadConfig, rng: random.Random, user_id: int) -> None:
        self.cfg = cfg
        self.rng = rng
        self.user_id = user_id
        self.count = 0
        self.prompt_dist = cfg.prompt_tokens or self.prompt
        self.output_dist = cfg.output_tokens or self.output

    def header(self) -> str:
        self.count += 1
        return (
            f"Request {self.name}-{self.user_id}-{self.count:06d} ref {self.rng.randrange(10**9)}:"
        )

    def next(self) -> RequestSpec:
        raise NotImplementedError

    def answered(self, spec: RequestSpec, text: str) -> None:
        """The answer to `spec` arrived in full."""

    def failed(self, spec: RequestSpec) -> None:
        """`spec` got no answer (timeout, error, shed too often)."""


class ChatWorkload(Workload):
    name = "chat"
    prompt = Dist("lognormal", 400, 0.8, 16, 4000)
    output = Dist("lognormal", 250, 0.6, 16, 1024)

    def next(self) -> RequestSpec:
        text = prose(self.rng, self.prompt_dist.sample(self.rng), self.header())
        return RequestSpec(
            [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": text},
            ],
            self.output_dist.sample(self.rng),
        )


class CodingWorkload(Workload):
    name = "coding"
    prompt = Dist("lognormal", 1500, 0.6, 200, 6000)
    output = Dist("lognormal", 300, 0.5, 32, 1500)

    def next(self) -> RequestSpec:
        src = code(self.rng, self.prompt_dist.sample(self.rng), f"file: {self.header()}")
        return RequestSpec(
            [
                {"role": "system", "content": "You are a senior Python engineer."},
                {
                    "role": "user",
                    "content": "Refactor this module and fix its bugs:\n```python\n"
                    + src
                    + "\n```",
                },
            ],
            self.output_dist.sample(self.rng),
        )


BATCH_INSTRUCTION = (
    "You are a document extraction service. Read the document in the user message and "
    "return one JSON object and nothing else. Do not add commentary, markdown fences or "
    "explanations. Use null for fields the document does not state. Dates use the ISO "
    "format YYYY-MM-DD. Amounts are numbers without currency symbols; put the currency "
    "code in the currency field. Names are copied exactly as written. The object has "
    "these fields: document_type (one of invoice, contract, claim, report, order, "
    "notice), document_id, issue_date, due_date, parties (a list of objects with name, "
    "role and identifier), currency, subtotal, tax, total, line_items (a list of objects "
    "with description, quantity, unit_price and amount), payment_terms, governing_law, "
    "renewal (an object with automatic, notice_days and term_months), obligations (a "
    "list of short strings, at most five), risk_flags (a list of short strings naming "
    "unusual clauses, at most three), and confidence (a number from 0 to 1 for the "
    "extraction as a whole). If the document contains several candidate values for a "
    "field, choose the one in the most recent section and list the conflict in "
    "risk_flags. Keep every string under two hundred characters. Return valid JSON that "
    "parses without errors; the output is read by a program."
)


class BatchJsonWorkload(Workload):
    """Seed 001's production-shaped job: large prompts, small structured JSON outputs."""

    name = "batch-json"
    prompt = Dist("lognormal", 2000, 0.35, 600, 5000)
    output = Dist("lognormal", 70, 0.4, 24, 200)

    def next(self) -> RequestSpec:
        doc = prose(self.rng, self.prompt_dist.sample(self.rng), "Document " + self.header())
        return RequestSpec(
            [
                {"role": "system", "content": BATCH_INSTRUCTION},
                {
                    "role": "user",
                    "content": doc + "\n\nExtract the fields and return the JSON object.",
                },
            ],
            self.output_dist.sample(self.rng),
        )


AGENT_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {
                "type": "object",
                "properties": {p: {"type": "string", "description": f"the {p}"} for p in params},
                "required": list(params),
            },
        },
    }
    for name, desc, params in (
        ("read_file", "Read a file of the repository and return its text.", ("path",)),
        ("write_file", "Replace a file's text.", ("path", "content")),
        ("search", "Search the repository for a regular expression.", ("pattern", "glob")),
        ("run_tests", "Run the test suite, or one test, and return the report.", ("target",)),
        ("shell", "Run a shell command in the sandbox and return its output.", ("command",)),
        ("fetch_url", "Fetch a web page and return its text.", ("url",)),
    )
]


def agent_system_prompt(tokens: int) -> str:
    """The system prompt every agentic session shares: the same text in every process."""
    return "You are an autonomous software agent. " + prose(random.Random(0xA6E7), tokens)


class AgenticWorkload(Workload):
    """Multi-turn sessions on a large shared system prompt and tool schema.

    `prompt` is the size of each new piece of the transcript (the task, then each tool
    result); `output` the assistant's answer per turn; `cfg.turns` the turns per session.
    A session ends early rather than outgrow `cfg.max_context`, and after a failed turn.
    """

    name = "agentic"
    prompt = Dist("lognormal", 300, 0.8, 20, 3000)
    output = Dist("lognormal", 150, 0.5, 16, 600)
    _system: dict[int, str] = {}

    def __init__(self, cfg: LoadConfig, rng: random.Random, user_id: int) -> None:
        super().__init__(cfg, rng, user_id)
        if cfg.system_tokens not in self._system:
            self._system[cfg.system_tokens] = agent_system_prompt(cfg.system_tokens)
        self.system = self._system[cfg.system_tokens]
        self.tools_tokens = estimate_tokens(json.dumps(AGENT_TOOLS))
        self.messages: list[dict[str, Any]] = []
        self.turns_left = 0
        self.sessions = 0

    def _context(self) -> int:
        return self.tools_tokens + sum(estimate_tokens(json.dumps(m)) + 4 for m in self.messages)

    def next(self) -> RequestSpec:
        if not self.messages or self.turns_left <= 0:
            self.sessions += 1
            self.turns_left = self.cfg.turns.sample(self.rng)
            task = prose(self.rng, self.prompt_dist.sample(self.rng), f"Task {self.header()}")
            self.messages = [
                {"role": "system", "content": self.system},
                {"role": "user", "content": task},
            ]
        self.turns_left -= 1
        out = self.output_dist.sample(self.rng)
        if self._context() + out > self.cfg.max_context:
            self.turns_left = 0  # the last turn of this session
            out = max(1, min(out, self.cfg.max_context - self._context()))
        return RequestSpec(list(self.messages), out, AGENT_TOOLS)

    def answered(self, spec: RequestSpec, text: str) -> None:
        if self.turns_left <= 0:
            self.messages = []
            return
        tool = self.rng.choice(AGENT_TOOLS)["function"]
        call_id = f"call_{self.sessions}_{len(self.messages)}"
        args = {p: f"{p}-{self.rng.randrange(1000)}" for p in tool["parameters"]["required"]}
        result = prose(self.rng, self.prompt_dist.sample(self.rng))
        self.messages += [
            {
                "role": "assistant",
                "content": text,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": tool["name"], "arguments": json.dumps(args)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call_id, "content": result},
        ]
        # Leave room for the next answer, or end the session here.
        if self._context() + self.output_dist.median > self.cfg.max_context:
            self.messages = []

    def failed(self, spec: RequestSpec) -> None:
        self.messages = []


@dataclass(slots=True)
class FileItem:
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None


def load_prompt_file(path: str | Path) -> list[FileItem]:
    """Requests from a JSONL file, one object a line: ``{"messages": [...]}`` (chat
    messages as the API takes them) or ``{"prompt": "text"}`` (one user message), with
    optional ``max_tokens`` and ``tools``. Blank lines are skipped; a bad line names
    its number."""
    items: list[FileItem] = []
    with Path(path).open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                if not isinstance(obj, dict):
                    raise ValueError("not a JSON object")
                if "messages" in obj:
                    messages = obj["messages"]
                    if not isinstance(messages, list) or not messages:
                        raise ValueError("messages must be a non-empty list")
                elif isinstance(obj.get("prompt"), str):
                    messages = [{"role": "user", "content": obj["prompt"]}]
                else:
                    raise ValueError('needs "messages" or "prompt"')
                max_tokens = obj.get("max_tokens")
                if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
                    raise ValueError("max_tokens must be a positive integer")
                items.append(FileItem(messages, max_tokens, obj.get("tools")))
            except ValueError as e:
                raise ValueError(f"{path}:{n}: {e}") from None
    if not items:
        raise ValueError(f"{path}: no requests")
    return items


class FileWorkload(Workload):
    """Requests drawn at random from a prompt file; an item without ``max_tokens`` takes
    its output length from the workload's output distribution."""

    def __init__(
        self,
        cfg: LoadConfig,
        rng: random.Random,
        user_id: int,
        items: Sequence[FileItem],
        base: type[Workload],
    ) -> None:
        super().__init__(cfg, rng, user_id)
        self.name = base.name
        self.output_dist = cfg.output_tokens or base.output
        self.items = items

    def next(self) -> RequestSpec:
        item = self.items[self.rng.randrange(len(self.items))]
        out = item.max_tokens or self.output_dist.sample(self.rng)
        return RequestSpec(item.messages, out, item.tools)


WORKLOADS: dict[str, type[Workload]] = {
    w.name: w for w in (ChatWorkload, CodingWorkload, AgenticWorkload, BatchJsonWorkload)
}

_FILES: dict[str, list[FileItem]] = {}


def make_workload(name: str, cfg: LoadConfig, rng: random.Random, user_id: int) -> Workload:
    """The workload of one user: its class's synthetic requests, or the prompt file's."""
    base = WORKLOADS[name]
    if cfg.prompt_file:
        if cfg.prompt_file not in _FILES:
            _FILES[cfg.prompt_file] = load_prompt_file(cfg.prompt_file)
        return FileWorkload(cfg, rng, user_id, _FILES[cfg.prompt_file], base)
    return base(cfg, rng, user_id)
