"""Every constant of admission is named in docs/admission-constants.md with the measurement that
sets it (issue 47): the page lists exactly the numeric module-level constants of
`admission/`, each with its value, so a constant added, removed or changed without the
page fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "admission-constants.md"
_NAME = re.compile(r"^_?[A-Z][A-Z0-9_]*$")
# A row: | `NAME` (path under admission/) | value | what it decides | what sets it |
_ROW = re.compile(r"^\| `(?P<name>[A-Z_0-9]+)` \((?P<file>[a-z_/]+\.py)\) \| (?P<value>[^|]+) \|")


def _number(node: ast.expr) -> float | None:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _number(node.operand)
        return None if inner is None else -inner
    return None


def constants_in_code() -> dict[tuple[str, str], float]:
    """(file under admission/, name) -> value, for each numeric module-level constant."""
    out: dict[tuple[str, str], float] = {}
    for path in sorted((ROOT / "admission").rglob("*.py")):
        rel = path.relative_to(ROOT / "admission").as_posix()
        for stmt in ast.parse(path.read_text()).body:
            target = value = None
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
                target, value = stmt.targets[0], stmt.value
            elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
                target, value = stmt.target, stmt.value
            pairs: list[tuple[ast.expr, ast.expr]] = []
            if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
                pairs = list(zip(target.elts, value.elts, strict=False))  # A, B = 1, 2
            elif target is not None and value is not None:
                pairs = [(target, value)]
            for name, val in pairs:
                number = _number(val)
                if isinstance(name, ast.Name) and _NAME.match(name.id) and number is not None:
                    out[(rel, name.id)] = number
    return out


def constants_on_page() -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for line in PAGE.read_text().splitlines():
        m = _ROW.match(line)
        if m:
            value = m["value"].strip().replace(",", "").replace("_", "")
            out[(m["file"], m["name"])] = float(value)
    return out


def test_the_page_names_every_constant_of_admission_with_its_value() -> None:
    code, page = constants_in_code(), constants_on_page()
    assert len(code) > 60  # the parse found them
    missing = sorted(set(code) - set(page))
    gone = sorted(set(page) - set(code))
    assert not missing, f"constants not on {PAGE.name}: {missing}"
    assert not gone, f"rows for constants admission no longer has: {gone}"
    wrong = {k: (page[k], code[k]) for k in code if page[k] != code[k]}
    assert not wrong, f"values on the page differ from the code's (page, code): {wrong}"


def test_each_row_says_what_sets_it() -> None:
    rows = [line for line in PAGE.read_text().splitlines() if _ROW.match(line)]
    assert rows
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 4 and all(cells), row
