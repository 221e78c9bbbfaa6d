"""Workload classification of a request: coding, agentic or chat.

The class drives speculative acceptance and natural output lengths in the simulator (and
the gateway's routing uses the same idea). An explicit `x-workload` header always wins.
Otherwise a cheap, documented heuristic over the rendered prompt text:

1. agentic if the prompt carries tool / function-call structure (OpenAI `tools`,
   `tool_calls`, `"function":`, a `tool` role marker, ReAct-style `Action:` /
   `Observation:` lines) or is a long multi-turn conversation (at least
   `AGENTIC_MIN_TURNS` assistant turns, the shape of an agent loop);
2. coding if it carries code markers (fenced code blocks, `def `/`class `/`import `
   lines, `function (`, `#include`, braces-and-semicolons density);
3. chat otherwise.

Agentic is checked first because agent prompts routinely embed code, while the reverse
is rare; the tool structure is the stronger signal.
"""

from __future__ import annotations

import re

from enginesim.types import Workload

AGENTIC_MIN_TURNS = 4

_AGENTIC = re.compile(
    r'"tool_calls"|"function"\s*:|"tools"\s*:|<\|tool\|>|<tool_call>|\btool_call_id\b'
    r"|^\s*(?:Action|Observation|Thought)\s*:",
    re.MULTILINE,
)
_CODE = re.compile(
    r"```|^\s*(?:def|class|import|from\s+\S+\s+import|#include|public\s+class|fn|func|package)\s"
    r"|\bfunction\s*\(|\bconsole\.log\(|\breturn\s+[^\n]*;|=>\s*\{",
    re.MULTILINE,
)
_ASSISTANT_TURN = re.compile(r"<\|assistant\|>|\bassistant\s*:", re.IGNORECASE)


def classify_workload(header: str | None, prompt_text: str) -> Workload:
    """The workload class of a request (see the module docstring for the rules)."""
    if header:
        try:
            return Workload(header.strip().lower())
        except ValueError:
            pass  # an unknown header value falls back to the heuristic
    if _AGENTIC.search(prompt_text):
        return Workload.AGENTIC
    # The final "<|assistant|>" cue of a chat template is not a turn.
    turns = len(_ASSISTANT_TURN.findall(prompt_text)) - (
        1 if prompt_text.rstrip().endswith("<|assistant|>") else 0
    )
    if turns >= AGENTIC_MIN_TURNS:
        return Workload.AGENTIC
    if _CODE.search(prompt_text):
        return Workload.CODING
    return Workload.CHAT
