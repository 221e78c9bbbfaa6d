"""Adding a scorer is one new file, one entry in the wiring list and the YAML that names
it: ``label_match`` (routing/scorers/label_match.py) was added that way, and a profile
from a YAML config file that names it changes the pick (docs/writing-a-plugin.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gateway.config import ConfigError, load_config
from routing.scheduler import build_router
from routing.types import Candidate, RouteRequest
from routing.wiring import PLUGINS

ROOT = Path(__file__).resolve().parents[2]

CONFIG = """
replicas:
  - {name: near, url: "http://127.0.0.1:9001", pool_tokens: 1000, labels: {zone: a}}
  - {name: far, url: "http://127.0.0.1:9002", pool_tokens: 1000, labels: {zone: b}}
routing:
  default_profile:
    scorers:
      - {name: kv_headroom, weight: 1.0}
      - {name: label_match, weight: 2.0, params: {zone: a}}
"""
PREFER_LINE = "      - {name: label_match, weight: 2.0, params: {zone: a}}\n"


def candidates(path: Path, free: dict[str, int]) -> list[Candidate]:
    cfg = load_config(path, env={})
    return [
        Candidate(r.name, free[r.name], r.pool_tokens or 0, 0, None, labels=r.labels)
        for r in cfg.replicas
        if r.name in free
    ]


def pick(yaml_text: str, tmp_path: Path, free: dict[str, int]) -> str | None:
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml_text)
    router = build_router(load_config(path, env={}).routing, seed=0)
    chosen = router.pick(RouteRequest("r", "m", 10), candidates(path, free))
    return None if chosen is None else chosen.name


def test_the_yaml_that_names_the_scorer_changes_the_pick(tmp_path: Path) -> None:
    # far has three times near's free room: the load scorer alone sends the request there.
    assert pick(CONFIG.replace(PREFER_LINE, ""), tmp_path, {"near": 300, "far": 900}) == "far"
    # Named in the profile, the label preference (2 x 1) outweighs the headroom gap.
    assert pick(CONFIG, tmp_path, {"near": 300, "far": 900}) == "near"
    # A preference, not a rule: when near cannot take it (admission did not list it),
    # far does, where the `label` filter would have kept the request queued.
    assert pick(CONFIG, tmp_path, {"far": 900}) == "far"
    as_filter = CONFIG.replace(PREFER_LINE, "").replace(
        "    scorers:", "    filters: [{name: label, params: {zone: a}}]\n    scorers:"
    )
    assert pick(as_filter, tmp_path, {"far": 900}) is None


def test_a_bad_param_is_an_error_naming_the_yaml_field(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text(CONFIG.replace("params: {zone: a}", "params: {zone: [a]}"))
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    assert "routing.default_profile.scorers.1" in str(err.value)
    path.write_text(CONFIG.replace("params: {zone: a}", "params: {}"))
    with pytest.raises(ConfigError, match="at least one label"):
        load_config(path, env={})


def test_the_scorer_took_one_file_and_one_wiring_entry() -> None:
    assert [(k, n) for k, n, _ in PLUGINS if n == "label_match"] == [("scorer", "label_match")]
    mentions = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "routing").rglob("*.py")
        if "label_match" in p.read_text()
    }
    assert mentions == {"routing/scorers/label_match.py", "routing/wiring.py"}
    # The new file reads only the interfaces and the types of routing.
    tree = ast.parse((ROOT / "routing/scorers/label_match.py").read_text())
    ours = {
        n.module
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == "routing"
    }
    assert ours == {"routing.plugin", "routing.types"}
