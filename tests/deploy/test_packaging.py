"""The gateway installs and runs without the simulator and the load tools.

`gateway`, `admission` and `routing` never import `enginesim`, `loadtests` or the demo
harness (`kvgate_demo`), neither at module import nor lazily; a process where those (and
the load tools' third-party packages) cannot be imported still imports every gateway
module, validates a config and serves; `kvgate demo` there names the extra to install.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

# Deployment checks run external tools and subprocesses: left out of the fast subset.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
GATEWAY_PACKAGES = ("gateway", "admission", "routing")
OUTSIDE = ("enginesim", "loadtests", "kvgate_demo")
LOAD_DEPS = ("locust", "gevent", "openai", "matplotlib")

# Run in a fresh interpreter: a finder first on sys.meta_path refuses the packages the
# gateway must do without, as if they were not installed.
_BLOCKER = """
import importlib.abc, sys
BLOCKED = set({blocked!r})
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, Block())
"""


def _run_blocked(body: str, *args: str) -> subprocess.CompletedProcess[str]:
    code = _BLOCKER.format(blocked=OUTSIDE + LOAD_DEPS) + body
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.partition(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.partition(".")[0])
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            out.add(node.args[0].value.partition(".")[0])
    return out


def test_no_gateway_module_imports_the_simulator_or_the_load_tools() -> None:
    offenders = []
    for pkg in GATEWAY_PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            bad = _imports(path) & set(OUTSIDE + LOAD_DEPS)
            if bad:
                offenders.append(f"{path.relative_to(ROOT)}: {sorted(bad)}")
    assert offenders == []


def test_every_gateway_module_imports_without_them() -> None:
    body = """
import importlib, pkgutil
names = []
for pkg in ("gateway", "admission", "routing"):
    mod = importlib.import_module(pkg)
    names.append(pkg)
    for info in pkgutil.walk_packages(mod.__path__, pkg + "."):
        importlib.import_module(info.name)
        names.append(info.name)
leaked = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
print(len(names), leaked)
"""
    r = _run_blocked(body)
    assert r.returncode == 0, r.stderr
    count, leaked = r.stdout.split(" ", 1)
    assert int(count) > 30  # the walk found the gateway's modules
    assert leaked.strip() == "[]"


def test_serve_help_and_config_check_run_without_them() -> None:
    body = """
from gateway.cli import main
rc = main(sys.argv[1:])
sys.exit(rc)
"""
    r = _run_blocked(body, "serve", "--help")
    assert r.returncode == 0, r.stderr
    assert "--config" in r.stdout
    r = _run_blocked(body, "serve", "--config", "deploy/kvgate.example.yaml", "--check")
    assert r.returncode == 0, r.stderr
    assert "config OK" in r.stdout


def test_demo_without_the_extras_names_them() -> None:
    body = """
from gateway.cli import main
sys.exit(main(sys.argv[1:]))
"""
    for command, extra in (("demo", "kvgate[sim,load]"), ("sweep", "kvgate[load]")):
        r = _run_blocked(body, command, "--help")
        assert r.returncode == 2, (command, r.stdout, r.stderr)
        assert extra in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


def test_extras_carry_the_tools_and_the_core_does_not() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(reqs: list[str]) -> set[str]:
        out = set()
        for req in reqs:
            out.add(req.split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower())
        return out

    core = names(meta["dependencies"])
    extras = meta["optional-dependencies"]
    assert core.isdisjoint({"locust", "openai", "matplotlib", "gevent", "pytest"})
    assert {"locust", "openai"} <= names(extras["load"])
    assert "sim" in extras
    # dev pulls both extras (and so everything the tests and the demo need).
    dev = " ".join(extras["dev"])
    assert "sim" in dev and "load" in dev
