"""The gateway's packages type-check: mypy over gateway/, admission/ and routing/, as
pyproject.toml's [tool.mypy] configures it (its incremental cache in .mypy_cache keeps
a second run to seconds). An error mypy is told to ignore names its code (mypy checks
that) and says why in a comment after it (checked here)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "admission", "routing")


pytestmark = pytest.mark.slow


def test_mypy_finds_no_error() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mypy"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        pytest.fail(f"mypy failed:\n{done.stdout}{done.stderr}", pytrace=False)


# `# type: ignore[code]  # why`: the reason is a comment of its own after the ignore.
IGNORE = re.compile(r"#\s*type:\s*ignore")
EXPLAINED = re.compile(r"#\s*type:\s*ignore\[[\w\-, ]+\]\s*#\s*\S")


def test_every_type_ignore_says_why() -> None:
    bare = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if IGNORE.search(line) and not EXPLAINED.search(line)
    ]
    if bare:
        pytest.fail("`# type: ignore[code]` without a `# reason` after it:\n" + "\n".join(bare))
