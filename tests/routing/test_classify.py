"""Workload classification: header first, then tools, code, turns."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routing.classify import _CODE_LINE, classify_workload, looks_like_code


@pytest.mark.parametrize("header", ["coding", "AGENTIC", " chat "])
def test_header_wins(header: str) -> None:
    assert classify_workload(header, "def f():\n    return 1\nimport os\n", has_tools=True) == (
        header.strip().lower()
    )


def test_unknown_header_falls_back_to_heuristic() -> None:
    assert classify_workload("batch", "hello there") == "chat"


def test_code_fence_or_code_lines_mean_coding() -> None:
    assert classify_workload(None, "Why does this fail?\n```\nx = [1, 2\n```") == "coding"
    java = "public static void main(String[] args) {\n  System.out.println(x);\n}"
    assert classify_workload(None, java) == "coding"
    trace = 'Traceback (most recent call last):\n  File "a.py", line 3\nimport numpy as np\n'
    assert classify_workload(None, trace) == "coding"


def test_prose_is_chat_even_with_one_semicolon() -> None:
    text = "Write me a poem about the sea; make it short.\nThanks a lot!"
    assert classify_workload(None, text) == "chat"
    assert not looks_like_code("I will import some goods from France next year.")


def test_tools_and_long_conversations_are_agentic() -> None:
    assert classify_workload(None, "what is the weather", has_tools=True) == "agentic"
    assert classify_workload(None, "ok", num_messages=12) == "agentic"
    assert classify_workload(None, "ok", num_messages=3) == "chat"


def test_only_head_and_tail_of_long_prompts_are_scanned() -> None:
    middle_code = "word " * 5000 + "\n```\ncode\n```\n" + "word " * 5000
    assert classify_workload(None, middle_code) == "chat"
    assert classify_workload(None, "word " * 5000 + "\n```py\nx=1\n```") == "coding"


def test_tenant_default_between_header_and_heuristic() -> None:
    code = "Why does this fail?\n```\nx = [1, 2\n```"
    # The header wins over the tenant's default; the default wins over the heuristic.
    assert classify_workload("chat", code, tenant_default="agentic") == "chat"
    assert classify_workload(None, code, tenant_default="agentic") == "agentic"
    assert classify_workload(None, "hello", tenant_default="Coding ") == "coding"
    # An unknown or missing default falls through to the heuristic.
    assert classify_workload(None, code, tenant_default="batch") == "coding"
    assert classify_workload("nonsense", code, tenant_default=None) == "coding"


# The line-ending alternative as first written; the compiled one takes each run between
# ``;``/``{`` whole (possessive) for speed and must find exactly the same matches.
_BACKTRACKING = _CODE_LINE.pattern.replace(r"(?:[^\n;{]*+[;{])+\s*$", r".*[;{]\s*$")
_PIECES = [";", "{", "}", "\n", " ", "\t", "\r", "\x0b", "\u2028", "x", "(", ":", "=", "```"]
_PIECES += ["def f(", "class A:", "import os", "#include <x>", "let b=", "SELECT a FROM b "]


@settings(max_examples=3000, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=40).map("".join))
def test_code_lines_match_as_the_backtracking_pattern_does(text: str) -> None:
    reference = re.compile(_BACKTRACKING, re.VERBOSE | re.MULTILINE)
    assert _BACKTRACKING != _CODE_LINE.pattern
    spans = [m.span() for m in _CODE_LINE.finditer(text)]
    assert spans == [m.span() for m in reference.finditer(text)]
