"""The layering of DESIGN.md, checked on the source: arrows point down only
(gateway -> admission -> routing), admission takes routing's types but never its
policies, and the simulator and the load tools stand apart from the gateway's packages."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.import_graph import cycles, import_graph

ROOT = Path(__file__).resolve().parents[1]


def imports(package: str) -> set[tuple[str, str]]:
    """(file, imported module) for every import in `package`, at any depth."""
    found: set[tuple[str, str]] = set()
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found.update((path.name, alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add((path.name, node.module))
    return found


def ours(module: str) -> str:
    return module.split(".")[0]


def test_routing_imports_nothing_of_ours_above_it() -> None:
    bad = {(f, m) for f, m in imports("routing") if ours(m) in {"admission", "gateway"}}
    assert not bad


def test_admission_takes_routing_types_only_and_never_the_gateway() -> None:
    found = imports("admission")
    assert not {(f, m) for f, m in found if ours(m) == "gateway"}
    policies = {(f, m) for f, m in found if ours(m) == "routing" and m != "routing.types"}
    assert not policies, policies
    assert any(m == "routing.types" for _, m in found)  # the check sees real imports


@pytest.mark.slow
def test_the_gateway_packages_never_import_the_simulator_or_the_load_tools() -> None:
    apart = {"enginesim", "loadtests", "kvgate_demo", "locust"}
    for package in ("gateway", "admission", "routing"):
        assert not {(f, m) for f, m in imports(package) if ours(m) in apart}, package


def test_enginesim_stands_apart() -> None:
    assert not {
        (f, m) for f, m in imports("enginesim") if ours(m) in {"gateway", "admission", "routing"}
    }


# The sans-IO cores: no event loop, no sockets or HTTP, no Redis, no wall clock. Time comes
# in as `now`; IO is the gateway's (DESIGN.md, "Sans-IO cores").
_IO = {"asyncio", "aiohttp", "redis", "socket", "time", "datetime", "threading", "uvloop"}


def test_the_sans_io_cores_do_no_io_and_read_no_clock() -> None:
    for package in ("admission", "routing"):
        found = imports(package)
        assert any(ours(m) in {"admission", "routing"} for _, m in found)  # sees real imports
        bad = {(f, m) for f, m in found if ours(m) in _IO}
        assert not bad, (package, bad)


def test_the_io_check_sees_io() -> None:
    found = imports("gateway")
    assert {"asyncio", "redis", "time"} <= {ours(m) for _, m in found}


def test_the_shared_state_backends_live_in_the_gateway() -> None:
    assert not list((ROOT / "admission").glob("state/*.py"))
    assert (ROOT / "gateway" / "state" / "lease.lua").is_file()
    assert (ROOT / "admission" / "lease.py").is_file()


# Packages follow the import graph (docs/architecture.md): each one's imports of kvgate's
# own code stay inside what it is allowed, so a module that reaches up or sideways shows.
_GATEWAY_BASE = {
    "gateway.config",
    "gateway.replica_config",
    "gateway.errors",
    "gateway.tasks",
    "gateway.logging",
    "gateway.metrics",
    "gateway.context",
    "gateway.schemas",
}


def ours_imported(package: str) -> set[tuple[str, str]]:
    """(file, module) for every import of kvgate's own packages in `package`."""
    return {(f, m) for f, m in imports(package) if ours(m) in {"admission", "gateway", "routing"}}


def test_what_admission_learns_imports_only_itself_and_the_settings() -> None:
    found = ours_imported("admission/learned")
    assert found  # the check sees real imports
    bad = {
        (f, m)
        for f, m in found
        if not m.startswith("admission.learned") and m != "admission.config"
    }
    assert not bad, bad


def test_the_fleet_knows_the_door_and_the_settings_not_the_request_path() -> None:
    allowed = _GATEWAY_BASE | {"gateway.door"}
    found = {(f, m) for f, m in ours_imported("gateway/fleet") if ours(m) == "gateway"}
    assert found
    bad = {(f, m) for f, m in found if not m.startswith("gateway.fleet") and m not in allowed}
    assert not bad, bad


def test_the_upstream_side_never_reaches_up_into_the_pipeline_or_the_app() -> None:
    above = (
        "gateway.pipeline",
        "gateway.app",
        "gateway.gateway_state",
        "gateway.state",
        "gateway.cli",
        "gateway.operations_api",
        "gateway.forward",
    )
    found = {(f, m) for f, m in ours_imported("gateway/upstream") if ours(m) == "gateway"}
    assert found
    assert not {(f, m) for f, m in found if m.startswith(above)}


def test_shared_state_never_reaches_into_the_request_path() -> None:
    above = (
        "gateway.pipeline",
        "gateway.app",
        "gateway.gateway_state",
        "gateway.upstream",
        "gateway.fleet",
        "gateway.cli",
    )
    found = {(f, m) for f, m in ours_imported("gateway/state") if ours(m) == "gateway"}
    assert found
    assert not {(f, m) for f, m in found if m.startswith(above)}


def test_no_import_circle_in_the_gateway_admission_routing_or_the_simulator() -> None:
    # tests/routing/test_import_graph.py shows the check finds a circle.
    graph = import_graph(ROOT, "gateway", "admission", "routing", "enginesim")
    assert len(graph) > 100 and sum(map(len, graph.values())) > 200  # sees the modules
    assert cycles(graph) == []
