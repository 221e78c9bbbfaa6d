"""The routing package's import graph, read from the source: no module imports itself
through others (an import at any depth counts, a function-level one too), plugins import
the interfaces and never the registry, and the interfaces import no plugin."""

from __future__ import annotations

from pathlib import Path

from tests.import_graph import cycles, import_graph

ROOT = Path(__file__).resolve().parents[2]


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
