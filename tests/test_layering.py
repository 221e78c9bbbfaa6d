"""The layering of DESIGN.md, checked on the source: arrows point down only
(gateway -> admission -> routing), admission takes routing's types but never its
policies, and the simulator and the load tools stand apart from the gateway's packages."""

from __future__ import annotations

import ast
from pathlib import Path

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


# One room per concern: no admission module and no request pipeline grows back into a
# god object (docs/architecture.md). A file that needs more is two concepts.
_MAX_LINES = 500


def test_no_admission_module_and_not_the_pipeline_is_over_500_lines() -> None:
    files = [*(ROOT / "admission").glob("*.py"), ROOT / "gateway" / "pipeline.py"]
    assert len(files) > 10  # the check sees the rooms
    long = {p.name: n for p in files if (n := len(p.read_text().splitlines())) > _MAX_LINES}
    assert not long, long
