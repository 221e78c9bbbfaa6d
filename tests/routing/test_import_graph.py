"""The routing package's import graph, read from the source: no module imports itself
through others (an import at any depth counts, a function-level one too), plugins import
the interfaces and never the registry, and the interfaces import no plugin."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> its file, for every module of `package` under `root`."""
    out: dict[str, Path] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of `package` whose names it imports. A package's
    ``__init__`` counts only where it is imported by name (``from pkg import thing``):
    Python loads it before a submodule, but the submodule does not read it."""
    files = module_files(root, package)
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


def test_no_routing_module_imports_itself_through_others() -> None:
    graph = import_graph(ROOT, "routing")
    assert "routing.wiring" in graph["routing.registry"]  # the check sees real imports
    assert "routing.scorers.prefix_cache" in graph["routing.wiring"]
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_lazy_import_circle(tmp_path: Path) -> None:
    """The shape routing had: the registry imports the plugins inside a function, the
    plugins import the registry at the top."""
    pkg = tmp_path / "pkg"
    (pkg / "plugins").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "plugins" / "__init__.py").write_text("")
    (pkg / "registry.py").write_text("def load():\n    from .plugins import one\n")
    (pkg / "plugins" / "one.py").write_text("from pkg.registry import load\n")
    (pkg / "alone.py").write_text("import pkg.plugins\n")
    assert cycles(import_graph(tmp_path, "pkg")) == [["pkg.plugins.one", "pkg.registry"]]


def test_plugins_import_the_interfaces_never_the_registry() -> None:
    graph = import_graph(ROOT, "routing")
    plugins = [m for m in graph if m.split(".")[1:2] in (["filters"], ["scorers"], ["pickers"])]
    assert len(plugins) >= 10
    above = {"routing.registry", "routing.wiring", "routing.config", "routing.scheduler"}
    for mod in plugins:
        assert not graph[mod] & above, (mod, graph[mod] & above)
    assert graph["routing.plugin"] == {"routing.types"}
