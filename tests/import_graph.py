"""Reading kvgate's import graph from the source, for the tests that hold its shape
(tests/test_layering.py, tests/routing/test_import_graph.py)."""

from __future__ import annotations

import ast
from pathlib import Path


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> its file, for every module of `package` under `root`."""
    out: dict[str, Path] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph(root: Path, *packages: str) -> dict[str, set[str]]:
    """Module -> the modules of `packages` whose names it imports (at any depth, a
    function-level or type-only import too). A package's ``__init__`` counts only where
    it is imported by name (``from pkg import thing``): Python loads it before a
    submodule, but the submodule does not read it."""
    files = {m: p for package in packages for m, p in module_files(root, package).items()}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                graph[mod] |= {alias.name for alias in node.names} & files.keys()
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the module's own package upwards
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    target = node.module or ""
                for alias in node.names:  # a submodule, else a name of `target` itself
                    sub = f"{target}.{alias.name}"
                    graph[mod] |= {sub if sub in files else target} & files.keys()
        graph[mod].discard(mod)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)
