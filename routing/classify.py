"""Workload classification: ``coding`` | ``agentic`` | ``chat``.

The class decides routing later (coding to speculation-enabled replicas while their batch
is small, agentic to the replica whose prefix cache is warm), so a wrong guess costs
efficiency, never correctness. Order of evidence:

1. The ``x-workload`` header, when it names a known class, wins: the client knows best.
   An unknown value is ignored (falls through), never an error.
2. The tenant's ``default_workload`` (config ``tenants[].default_workload``), when set
   to a known class: an operator who knows a tenant runs a coding assistant says so once.
3. Tools: a request that declares tools or carries tool / function messages is an agent
   loop (``agentic``), even when it edits code: what matters for routing is its long,
   repeated prefix (system prompt + tool schemas + growing transcript).
4. Code: a fenced block (three backticks), or at least ``CODE_SIGNALS_NEEDED`` code
   signals (lines that look like definitions, imports, includes, braces-and-semicolons,
   or a traceback) -> ``coding``.
5. Many turns (``AGENTIC_TURNS`` messages or more) -> ``agentic``.
6. Otherwise ``chat``.

Only the first ``SCAN_CHARS`` characters and the last ``SCAN_CHARS`` characters are
scanned, so classification stays O(1) on very long prompts.
"""

from __future__ import annotations

import re

WORKLOADS = ("coding", "agentic", "chat")
AGENTIC_TURNS = 8
CODE_SIGNALS_NEEDED = 2
SCAN_CHARS = 8192

# The last alternative, a line ending in ``;`` or ``{``, is ``.*[;{]\s*$`` (the same
# matches, in the same order of preference) with each run between those characters taken
# whole: ``.*`` backtracked over every character of every line, most of the scan's cost.
_CODE_LINE = re.compile(
    r"""^[ \t]*(?:
        def\ \w+\s*\( | class\ \w+[\s:(] | (?:from\ [\w.]+\ )?import\ [\w.]+ |
        \#include\s*[<"] | (?:public|private|protected)\ [\w<>\[\]]+\ \w+\s*\( |
        (?:async\ )?function\ \w*\s*\( | (?:const|let|var)\ \w+\s*= |
        fn\ \w+\s*[(<] | func\ \w+\s*\( | package\ \w+ | \#!/ |
        (?:SELECT|INSERT|UPDATE|DELETE)\ .+\ (?:FROM|INTO|SET)\ |
        Traceback\ \(most\ recent\ call\ last\) | at\ [\w.$]+\([\w.]+:\d+\) |
        (?:[^\n;{]*+[;{])+\s*$
    )""",
    re.VERBOSE | re.MULTILINE,
)


def _scan_window(text: str) -> str:
    if len(text) <= 2 * SCAN_CHARS:
        return text
    return text[:SCAN_CHARS] + "\n" + text[-SCAN_CHARS:]


def looks_like_code(text: str) -> bool:
    """True when `text` carries a code fence or enough code-shaped lines."""
    window = _scan_window(text)
    if "```" in window:
        return True
    signals = 0
    for _ in _CODE_LINE.finditer(window):
        signals += 1
        if signals >= CODE_SIGNALS_NEEDED:
            return True
    return False


def classify_workload(
    header: str | None,
    text: str,
    *,
    has_tools: bool = False,
    num_messages: int = 1,
    tenant_default: str | None = None,
) -> str:
    """The workload class of a request.

    `header` is the ``x-workload`` header value (case-insensitive); `tenant_default` the
    authenticated tenant's configured default (None: not set); `text` the prompt or
    rendered messages; `has_tools` should be set when the request declares tools or
    contains tool / function messages; `num_messages` is the chat length.
    """
    for given in (header, tenant_default):
        if given:
            wanted = given.strip().lower()
            if wanted in WORKLOADS:
                return wanted
    if has_tools:
        return "agentic"
    if looks_like_code(text):
        return "coding"
    if num_messages >= AGENTIC_TURNS:
        return "agentic"
    return "chat"
